// A test double of the CUDA runtime (linked as libcudart.so.12 by the test program): host memory,
// counted calls. fakecudart_calls(name) says how many calls reached it, i.e. were not interposed.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#define API extern "C" __attribute__((visibility("default")))

typedef int cudaError_t;
struct CUstream_st;
typedef CUstream_st* cudaStream_t;

namespace {
std::mutex mu;
std::map<std::string, unsigned long>& calls() {
  static auto* m = new std::map<std::string, unsigned long>();
  return *m;
}
void count(const char* n) {
  std::lock_guard lk(mu);
  ++calls()[n];
}
}  // namespace

API cudaError_t cudaMalloc(void** p, size_t size) {
  count("cudaMalloc");
  *p = std::malloc(size ? size : 1);
  return *p ? 0 : 2;
}
API cudaError_t cudaFree(void* p) {
  count("cudaFree");
  std::free(p);
  return 0;
}
API cudaError_t cudaMallocAsync(void** p, size_t size, cudaStream_t) {
  count("cudaMallocAsync");
  *p = std::malloc(size ? size : 1);
  return *p ? 0 : 2;
}
API cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  count("cudaFreeAsync");
  std::free(p);
  return 0;
}
API cudaError_t cudaMemGetInfo(size_t* f, size_t* t) {
  count("cudaMemGetInfo");
  *t = size_t{1} << 30;
  *f = size_t{1} << 29;
  return 0;
}
API cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return 0;
}
API cudaError_t cudaDeviceSynchronize() {
  count("cudaDeviceSynchronize");
  return 0;
}
// Memory from "another allocator" in the same process (a library that allocated before fragless was
// asked, or through another path): fragless must forward its frees to the runtime.
API void* fakecudart_foreign_alloc(size_t size) {
  count("foreign_alloc");
  return std::malloc(size);
}
API unsigned long fakecudart_calls(const char* name) {
  std::lock_guard lk(mu);
  auto it = calls().find(name);
  return it == calls().end() ? 0 : it->second;
}
