// A driver with the kernel calls that loads no kernel: FRAGLESS_LIBCUDA names this library (which needs the
// libcuda double, and so reaches every other call through it) to show fragless-gpu-probe and
// fragless-gpu-tests a driver that runs kernels but refuses their module, as a CUDA 12 driver refuses PTX of a
// newer ISA. cuModuleLoadDataEx returns FAKECUDA_MODULE_ERROR (a CUresult; default
// CUDA_ERROR_UNSUPPORTED_PTX_VERSION) with a line in the JIT's error log when it was given one, and appends
// every PTX image it is given (text: a NUL-terminated string starting with "//" or ".") to the file
// FAKECUDA_MODULE_IMAGES, so a test can check that what the programs load is the PTX of
// tools/gpu_kernels.ptx and assemble it. The other kernel and graph calls are CUDA_ERROR_NOT_SUPPORTED.
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#define FAKE_API extern "C" __attribute__((visibility("default")))

FAKE_API CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned n, CUjit_option* options,
                                     void** values) {
  if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
  *module = nullptr;
  const char* text = static_cast<const char*>(image);
  const bool ptx = text[0] == '/' || text[0] == '.';
  if (const char* dump = std::getenv("FAKECUDA_MODULE_IMAGES"); dump && *dump && ptx) {
    if (std::FILE* f = std::fopen(dump, "ab")) {
      std::fwrite(text, 1, std::strlen(text), f);
      std::fclose(f);
    }
  }
  const char* e = std::getenv("FAKECUDA_MODULE_ERROR");
  const auto r = static_cast<CUresult>(e && *e ? std::atoi(e) : CUDA_ERROR_UNSUPPORTED_PTX_VERSION);
  const char* name = nullptr;
  if (cuGetErrorName(r, &name) != CUDA_SUCCESS) name = "an error";
  char* log = nullptr;
  std::size_t size = 0;
  for (unsigned i = 0; i < n && options && values; ++i) {
    if (options[i] == CU_JIT_ERROR_LOG_BUFFER) log = static_cast<char*>(values[i]);
    if (options[i] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) size = reinterpret_cast<std::size_t>(values[i]);
  }
  if (log && size) std::snprintf(log, size, "the module double refuses every %s image with %s", ptx ? "PTX" : "binary", name);
  return r;
}

FAKE_API CUresult cuModuleGetFunction(CUfunction*, CUmodule, const char*) { return CUDA_ERROR_NOT_SUPPORTED; }
FAKE_API CUresult cuModuleUnload(CUmodule) { return CUDA_ERROR_NOT_SUPPORTED; }
FAKE_API CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 CUstream, void**, void**) {
  return CUDA_ERROR_NOT_SUPPORTED;
}
FAKE_API CUresult cuGraphInstantiateWithFlags(CUgraphExec*, CUgraph, unsigned long long) { return CUDA_ERROR_NOT_SUPPORTED; }
FAKE_API CUresult cuGraphLaunch(CUgraphExec, CUstream) { return CUDA_ERROR_NOT_SUPPORTED; }
FAKE_API CUresult cuGraphExecDestroy(CUgraphExec) { return CUDA_ERROR_NOT_SUPPORTED; }
