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
namespace {
thread_local int t_device = 0;  // the runtime's current device, per thread
std::map<cudaStream_t, int>& stream_devices() {
  static auto* m = new std::map<cudaStream_t, int>();
  return *m;
}
std::map<cudaStream_t, bool>& capturing() {
  static auto* m = new std::map<cudaStream_t, bool>();
  return *m;
}
}  // namespace
API cudaError_t cudaGetDevice(int* d) {
  *d = t_device;
  return 0;
}
API cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d > 7) return 101;  // cudaErrorInvalidDevice
  t_device = d;
  return 0;
}
// Synchronises the current device: counted per device ("cudaDeviceSynchronize@1").
API cudaError_t cudaDeviceSynchronize() {
  count("cudaDeviceSynchronize");
  count(("cudaDeviceSynchronize@" + std::to_string(t_device)).c_str());
  return 0;
}
API cudaError_t cudaStreamGetDevice(cudaStream_t s, int* d) {
  std::lock_guard lk(mu);
  auto it = stream_devices().find(s);
  *d = it == stream_devices().end() ? t_device : it->second;
  return 0;
}
API cudaError_t cudaStreamIsCapturing(cudaStream_t s, int* status) {  // cudaStreamCaptureStatus
  std::lock_guard lk(mu);
  *status = capturing()[s] ? 1 : 0;
  return 0;
}
API cudaError_t cudaMallocAsync_ptsz(void** p, size_t size, cudaStream_t) {
  count("cudaMallocAsync_ptsz");
  *p = std::malloc(size ? size : 1);
  return *p ? 0 : 2;
}
API cudaError_t cudaFreeAsync_ptsz(void* p, cudaStream_t) {
  count("cudaFreeAsync_ptsz");
  std::free(p);
  return 0;
}
// Fails for every pointer, as it does for memory from cuMemCreate (no legacy IPC handle).
API cudaError_t cudaIpcGetMemHandle(void* handle, void*) {
  count("cudaIpcGetMemHandle");
  std::memset(handle, 0, 64);
  return 1;  // cudaErrorInvalidValue
}
// Test controls: which device a stream belongs to, and whether it is capturing.
API void fakecudart_set_stream(cudaStream_t s, int device, int is_capturing) {
  std::lock_guard lk(mu);
  stream_devices()[s] = device;
  capturing()[s] = is_capturing != 0;
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
