// The kernels the GPU check needs. fragless_spin spins for `cycles` GPU clock cycles, then writes to buf, so a
// test can hold work on a stream that touches memory (does cuMemUnmap wait for it? is a block reused under
// it?). fragless_spin_fill spins, then writes `value` into every one of `words` 32-bit words of buf: memory
// handed out again before it ends shows the value, or loses what was written into it.
// Built by tools/gpu_bundle.sh with nvcc into a fatbin (sm_90 code and compute_80 PTX), loaded on the device
// with cuModuleLoadData; no CUDA runtime involved.
extern "C" __global__ void fragless_spin(unsigned int* buf, unsigned long long cycles) {
  const long long start = clock64();
  unsigned int spins = 0;
  while (static_cast<unsigned long long>(clock64() - start) < cycles) ++spins;
  buf[threadIdx.x] = spins;
}

extern "C" __global__ void fragless_spin_fill(unsigned int* buf, unsigned long long cycles, unsigned long long words,
                                              unsigned int value) {
  const long long start = clock64();
  while (static_cast<unsigned long long>(clock64() - start) < cycles) {
  }
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) buf[i] = value;
}
