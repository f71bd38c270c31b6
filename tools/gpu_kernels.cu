// The one kernel the GPU check needs: spins for `cycles` GPU clock cycles, then writes to buf, so a test can
// hold work on a stream that touches memory (does cuMemUnmap wait for it? is a block reused under it?).
// Built by tools/gpu_bundle.sh with nvcc into a fatbin (sm_90 code and compute_80 PTX), loaded on the device
// with cuModuleLoadData; no CUDA runtime involved.
extern "C" __global__ void fragless_spin(unsigned int* buf, unsigned long long cycles) {
  const long long start = clock64();
  unsigned int spins = 0;
  while (static_cast<unsigned long long>(clock64() - start) < cycles) ++spins;
  buf[threadIdx.x] = spins;
}
