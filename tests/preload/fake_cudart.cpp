// A test double of the CUDA runtime (linked as libcudart.so.12 by the test program): host memory,
// counted calls. fakecudart_calls(name) says how many calls reached it, i.e. were not interposed.
// With a libcuda double named (FRAGLESS_LIBCUDA), what the real runtime does through the driver goes to it:
// each device's primary context is retained on its first use and made current on the calling thread
// (cudaSetDevice initialises the device, as CUDA 12's does); streams, stream capture, cudaStreamGetDevice,
// cudaDeviceSynchronize (cuCtxSynchronize) and the memory pools are the double's. Built with FAKECUDART_BEFORE_12_8 it has no
// cudaStreamGetDevice, as runtimes before CUDA 12.8. The stream-ordered allocations keep the thread's last error
// (cudaGetLastError, cudaPeekAtLastError).
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <mutex>
#include <string>
#include <type_traits>

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

namespace {
bool driver_malloc(void** p, size_t size, cudaError_t* r);  // below: the driver's cuMemAlloc, with a double
bool driver_free(void* p, cudaError_t* r);                   // cuMemFree of what driver_malloc gave
}  // namespace
// With a libcuda double, the driver's cuMemAlloc on the current device, as CUDA's runtime implements it (an
// interposer of the driver sees it); else host memory.
API cudaError_t cudaMalloc(void** p, size_t size) {
  count("cudaMalloc");
  if (cudaError_t r = 0; size && driver_malloc(p, size, &r)) return r;
  *p = std::malloc(size ? size : 1);
  return *p ? 0 : 2;
}
namespace {
using AllocAsync = int (*)(void**, size_t, void*);
using FreeAsync = int (*)(void*, void*);
// Below: the driver's stream-ordered calls, default or per-thread-default stream (nullptr without a double).
AllocAsync driver_alloc_async(bool ptsz);
FreeAsync driver_free_async(bool ptsz);
bool double_stream(cudaStream_t s);  // a stream the libcuda double knows (not one set with fakecudart_set_stream)
bool make_current(int device);
extern thread_local int t_device;
std::set<void*>& host_async() {  // what cudaMallocAsync gave from host memory
  static auto* m = new std::set<void*>();
  return *m;
}
// With a libcuda double, on a stream of the double's, the driver's cuMemAllocAsync and cuMemFreeAsync (or their
// per-thread default stream variants), as CUDA's runtime implements them (an interposer of the driver sees them:
// what the runtime half forwards comes back through the driver half); else (no double, or a stream only this
// double knows, fakecudart_set_stream) host memory.
cudaError_t malloc_async(void** p, size_t size, cudaStream_t s, bool ptsz) {
  if (AllocAsync f = driver_alloc_async(ptsz); f && double_stream(s)) return make_current(t_device) ? f(p, size, s) : 1;
  *p = std::malloc(size ? size : 1);
  if (!*p) return 2;
  std::lock_guard lk(mu);
  host_async().insert(*p);
  return 0;
}
cudaError_t free_async(void* p, cudaStream_t s, bool ptsz) {
  bool host;
  {
    std::lock_guard lk(mu);
    host = host_async().erase(p) > 0;
  }
  FreeAsync f = driver_free_async(ptsz);
  if (!host && f) return make_current(t_device) ? f(p, s) : 1;
  std::free(p);
  return 0;
}
}  // namespace
API cudaError_t cudaFree(void* p) {
  count(p ? "cudaFree" : "cudaFree(0)");  // the context idiom counted apart (the interposer makes one per thread)
  // cudaFree(0), the classic idiom: a call that needs a context, so the runtime makes the current device's
  // primary context current on a thread that has none (cuda_runtime_api.h, "Initialization and Tear-Down").
  if (!p) {
    make_current(t_device);  // (without a libcuda double there is no context to make)
    return 0;
  }
  if (cudaError_t r = 0; driver_free(p, &r)) return r;
  {
    std::lock_guard lk(mu);
    host_async().erase(p);  // memory of cudaMallocAsync may be freed with cudaFree too
  }
  std::free(p);
  return 0;
}
namespace {
// The runtime's last error, per thread (cudaGetLastError returns it and resets it; an error of a later call
// replaces it; a success leaves it). Only the allocation calls set it here.
thread_local cudaError_t t_last_error = 0;
cudaError_t noted(cudaError_t r) {
  if (r) t_last_error = r;
  return r;
}
}  // namespace
API cudaError_t cudaGetLastError() {
  count("cudaGetLastError");
  const cudaError_t r = t_last_error;
  t_last_error = 0;
  return r;
}
API cudaError_t cudaPeekAtLastError() { return t_last_error; }
API cudaError_t cudaMallocAsync(void** p, size_t size, cudaStream_t s) {
  count("cudaMallocAsync");
  return noted(malloc_async(p, size, s, false));
}
API cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  count("cudaFreeAsync");
  return free_async(p, s, false);
}
namespace {
thread_local int t_device = 0;  // the runtime's current device, per thread

// The libcuda double's entry points the runtime uses (CUresult is an int; handles are pointers).
struct Driver {
  void* lib = nullptr;
  int (*retain)(void**, int) = nullptr;
  int (*set_current)(void*) = nullptr;
  int (*ctx_synchronize)() = nullptr;
  int (*stream_create)(void**, unsigned) = nullptr;
  int (*is_capturing)(void*, int*) = nullptr;
  int (*begin_capture)(void*, int) = nullptr;
  // cuStreamBeginCaptureToGraph (interposed too, found by name in the driver's handle as the others here): the
  // runtime's ToGraph begin reaches it, as CUDA's runtime does.
  int (*begin_capture_to_graph)(void*, void*, const void*, const void*, size_t, int) = nullptr;
  int (*end_capture)(void*, void**) = nullptr;
  int (*stream_get_ctx)(void*, void**) = nullptr;
  int (*push)(void*) = nullptr;
  int (*pop)(void**) = nullptr;
  int (*ctx_get_device)(int*) = nullptr;
  // Taken through cuGetProcAddress_v2, as the CUDA 13 runtime takes every driver entry point: the
  // cuGetProcAddress_v2 it uses comes from a lookup that finds an LD_PRELOAD library's export first (driver.h
  // R20), so an interposer's entry points are what it calls.
  int (*mem_get_info)(size_t*, size_t*) = nullptr;
  int (*mem_alloc_pitch)(void**, size_t*, size_t, size_t, unsigned) = nullptr;
  int (*pointer_attributes)(unsigned, int*, void**, void*) = nullptr;
  int (*stream_destroy)(void*) = nullptr;
  // The pool calls (a pool, a device, a CUmemPool_attribute, a CUmemPoolProps: the runtime's types are the
  // driver's).
  int (*default_pool)(void**, int) = nullptr;
  int (*device_set_pool)(int, void*) = nullptr;
  int (*device_get_pool)(void**, int) = nullptr;
  int (*pool_create)(void**, const void*) = nullptr;
  int (*pool_destroy)(void*) = nullptr;
  int (*pool_get_attribute)(void*, int, void*) = nullptr;
  int (*mem_alloc)(void**, size_t) = nullptr;  // cuMemAlloc and cuMemFree (their _v2, at version 12000)
  int (*mem_free)(void*) = nullptr;
  int (*mem_alloc_async)(void**, size_t, void*) = nullptr;
  int (*mem_free_async)(void*, void*) = nullptr;
  // The same with the per-thread default stream (CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM), as the
  // runtime's _ptsz entry points take them.
  int (*mem_alloc_async_ptsz)(void**, size_t, void*) = nullptr;
  int (*mem_free_async_ptsz)(void*, void*) = nullptr;
  Driver() {
    const char* path = std::getenv("FRAGLESS_LIBCUDA");
    if (!path || !*path || !(lib = dlopen(path, RTLD_NOW | RTLD_LOCAL))) return;
    auto load = [&](auto* fn, const char* name) { *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name)); };
    load(&retain, "cuDevicePrimaryCtxRetain");
    load(&set_current, "cuCtxSetCurrent");
    load(&ctx_synchronize, "cuCtxSynchronize");
    load(&stream_create, "cuStreamCreate");
    load(&is_capturing, "cuStreamIsCapturing");
    load(&begin_capture, "cuStreamBeginCapture_v2");
    load(&begin_capture_to_graph, "cuStreamBeginCaptureToGraph");
    load(&end_capture, "cuStreamEndCapture");
    load(&stream_get_ctx, "cuStreamGetCtx");
    load(&push, "cuCtxPushCurrent_v2");
    load(&pop, "cuCtxPopCurrent_v2");
    load(&ctx_get_device, "cuCtxGetDevice");
    using GetProc = int (*)(const char*, void**, int, unsigned long long, int*);
    auto get_proc = reinterpret_cast<GetProc>(dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"));
    if (!get_proc) get_proc = reinterpret_cast<GetProc>(dlsym(lib, "cuGetProcAddress_v2"));
    auto proc = [&](auto* fn, const char* name) {
      void* p = nullptr;
      if (get_proc && get_proc(name, &p, 12000, 0, nullptr) == 0) *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
    };
    proc(&mem_get_info, "cuMemGetInfo");
    proc(&mem_alloc_pitch, "cuMemAllocPitch");
    proc(&pointer_attributes, "cuPointerGetAttributes");
    proc(&stream_destroy, "cuStreamDestroy");  // so an interposed cudaStreamDestroy reaches cuStreamDestroy too
    proc(&default_pool, "cuDeviceGetDefaultMemPool");
    proc(&device_set_pool, "cuDeviceSetMemPool");
    proc(&device_get_pool, "cuDeviceGetMemPool");
    proc(&pool_create, "cuMemPoolCreate");
    proc(&pool_destroy, "cuMemPoolDestroy");
    proc(&pool_get_attribute, "cuMemPoolGetAttribute");
    proc(&mem_alloc, "cuMemAlloc");
    proc(&mem_free, "cuMemFree");
    proc(&mem_alloc_async, "cuMemAllocAsync");
    proc(&mem_free_async, "cuMemFreeAsync");
    auto proc_ptsz = [&](auto* fn, const char* name) {
      void* p = nullptr;
      if (get_proc && get_proc(name, &p, 12000, 2 /* PER_THREAD_DEFAULT_STREAM */, nullptr) == 0)
        *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
    };
    proc_ptsz(&mem_alloc_async_ptsz, "cuMemAllocAsync");
    proc_ptsz(&mem_free_async_ptsz, "cuMemFreeAsync");
  }
};
Driver& drv() {
  static auto* d = new Driver();
  return *d;
}
void* g_primary[8] = {};        // retained primary contexts, per device (kept, as the runtime keeps them)
thread_local void* t_current = nullptr;

// The device's primary context, retained on first use and made current on this thread; false without a double.
bool make_current(int device) {
  Driver& d = drv();
  if (!d.lib) return false;
  std::lock_guard lk(mu);
  if (!g_primary[device] && d.retain(&g_primary[device], device) != 0) return false;
  if (t_current != g_primary[device] && d.set_current(g_primary[device]) == 0) t_current = g_primary[device];
  return true;
}
// cudaError_t for a CUresult: 0 stays 0, anything else is reported as it is (tests only ask "failed?").
int runtime_error(int cu) { return cu; }
std::map<cudaStream_t, int>& stream_devices();
bool double_stream(cudaStream_t s) {
  std::lock_guard lk(mu);
  return !stream_devices().count(s);
}
std::set<void*>& driver_sync() {  // what cudaMalloc took from the driver
  static auto* m = new std::set<void*>();
  return *m;
}
bool driver_malloc(void** p, size_t size, cudaError_t* r) {
  if (!drv().mem_alloc || !make_current(t_device)) return false;
  *r = drv().mem_alloc(p, size);
  if (*r == 0) {
    std::lock_guard lk(mu);
    driver_sync().insert(*p);
  }
  return true;
}
bool driver_free(void* p, cudaError_t* r) {
  {
    std::lock_guard lk(mu);
    if (!driver_sync().erase(p)) return false;
  }
  *r = drv().mem_free ? drv().mem_free(p) : 1;
  return true;
}
AllocAsync driver_alloc_async(bool ptsz) { return ptsz ? drv().mem_alloc_async_ptsz : drv().mem_alloc_async; }
FreeAsync driver_free_async(bool ptsz) { return ptsz ? drv().mem_free_async_ptsz : drv().mem_free_async; }
void* per_thread(cudaStream_t s) { return s ? s : reinterpret_cast<void*>(std::uintptr_t{0x2}); }  // _ptsz 0
std::map<cudaStream_t, int>& stream_devices() {
  static auto* m = new std::map<cudaStream_t, int>();
  return *m;
}
std::map<cudaStream_t, bool>& capturing() {
  static auto* m = new std::map<cudaStream_t, bool>();
  return *m;
}
}  // namespace
// Through the driver when there is one (cuMemGetInfo of the current device), else a fixed answer.
API cudaError_t cudaMemGetInfo(size_t* f, size_t* t) {
  count("cudaMemGetInfo");
  if (make_current(t_device) && drv().mem_get_info) return runtime_error(drv().mem_get_info(f, t));
  *t = size_t{1} << 30;
  *f = size_t{1} << 29;
  return 0;
}
// cudaMallocPitch and cudaPointerGetAttributes are the driver's cuMemAllocPitch and cuPointerGetAttributes
// (CUDA's runtime reaches them the same way); without a double they fail.
API cudaError_t cudaMallocPitch(void** p, size_t* pitch, size_t width, size_t height) {
  count("cudaMallocPitch");
  if (!make_current(t_device) || !drv().mem_alloc_pitch) return 1;
  return runtime_error(drv().mem_alloc_pitch(p, pitch, width, height, 16));
}
struct FakePointerAttributes {  // cudaPointerAttributes: type, device, devicePointer, hostPointer
  int type;
  int device;
  void* device_pointer;
  void* host_pointer;
};
API cudaError_t cudaPointerGetAttributes(FakePointerAttributes* a, const void* ptr) {
  count("cudaPointerGetAttributes");
  if (!a || !make_current(t_device) || !drv().pointer_attributes) return 1;
  unsigned type = 0;
  int device = -1;
  void* dp = nullptr;
  int attrs[3] = {2 /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */, 9 /* DEVICE_ORDINAL */, 3 /* DEVICE_POINTER */};
  void* data[3] = {&type, &device, &dp};
  if (int r = drv().pointer_attributes(3, attrs, data, const_cast<void*>(ptr)); r != 0) return runtime_error(r);
  a->type = type == 2 /* CU_MEMORYTYPE_DEVICE */ ? 2 /* cudaMemoryTypeDevice */ : 0 /* unregistered */;
  a->device = device;
  a->device_pointer = dp;
  a->host_pointer = nullptr;
  return 0;
}
API cudaError_t cudaGetDevice(int* d) {
  *d = t_device;
  return 0;
}
API cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d > 7) return 101;  // cudaErrorInvalidDevice
  t_device = d;
  make_current(d);
  return 0;
}
// Synchronises the current device: counted per device ("cudaDeviceSynchronize@1"); the double's context.
API cudaError_t cudaDeviceSynchronize() {
  count("cudaDeviceSynchronize");
  count(("cudaDeviceSynchronize@" + std::to_string(t_device)).c_str());
  if (make_current(t_device)) return runtime_error(drv().ctx_synchronize());
  return 0;
}
API cudaError_t cudaStreamCreate(cudaStream_t* s) {
  count("cudaStreamCreate");
  if (!make_current(t_device)) return 1;
  void* h = nullptr;
  const int r = drv().stream_create(&h, 0);
  *s = static_cast<cudaStream_t>(h);
  return runtime_error(r);
}
API cudaError_t cudaStreamDestroy(cudaStream_t s) {
  count("cudaStreamDestroy");
  if (!make_current(t_device)) return 1;
  return runtime_error(drv().stream_destroy(s));
}
#if !defined(FAKECUDART_BEFORE_12_8)
API cudaError_t cudaStreamGetDevice(cudaStream_t s, int* d) {
  {
    std::lock_guard lk(mu);
    auto it = stream_devices().find(s);
    if (it != stream_devices().end()) {
      *d = it->second;
      return 0;
    }
  }
  *d = t_device;
  void* ctx = nullptr;
  if (s && make_current(t_device) && drv().stream_get_ctx(s, &ctx) == 0 && drv().push(ctx) == 0) {
    drv().ctx_get_device(d);
    drv().pop(&ctx);
  }
  return 0;
}
#endif
namespace {
int is_capturing(cudaStream_t s, int* status) {  // cudaStreamCaptureStatus
  {
    std::lock_guard lk(mu);
    auto it = capturing().find(s);
    if (it != capturing().end() || !drv().lib) {
      *status = it != capturing().end() && it->second ? 1 : 0;
      return 0;
    }
  }
  make_current(t_device);
  return runtime_error(drv().is_capturing(s, status));
}
}  // namespace
API cudaError_t cudaStreamIsCapturing(cudaStream_t s, int* status) { return is_capturing(s, status); }
API cudaError_t cudaStreamIsCapturing_ptsz(cudaStream_t s, int* status) {
  return is_capturing(static_cast<cudaStream_t>(per_thread(s)), status);
}
namespace {
void (*g_on_capture_begun)() = nullptr;
// The capture has begun in the double: the test's function runs now, inside the runtime's call, before it
// returns to whoever called it (an interposer that tells fragless of the capture only then is too late).
cudaError_t began(int r) {
  if (r == 0 && g_on_capture_begun) g_on_capture_begun();
  return runtime_error(r);
}
}  // namespace
API cudaError_t cudaStreamBeginCapture(cudaStream_t s, int mode) {
  count("cudaStreamBeginCapture");
  if (!make_current(t_device)) return 1;
  return began(drv().begin_capture(s, mode));
}
API cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t s, int mode) {
  return cudaStreamBeginCapture(static_cast<cudaStream_t>(per_thread(s)), mode);
}
// CUDA 12.3's capture into an existing graph, through the driver's cuStreamBeginCaptureToGraph.
API cudaError_t cudaStreamBeginCaptureToGraph(cudaStream_t s, void* graph, const void* deps, const void* data,
                                              size_t n, int mode) {
  count("cudaStreamBeginCaptureToGraph");
  if (!make_current(t_device) || !drv().begin_capture_to_graph) return 1;
  return began(drv().begin_capture_to_graph(s, graph, deps, data, n, mode));
}
API cudaError_t cudaStreamBeginCaptureToGraph_ptsz(cudaStream_t s, void* graph, const void* deps, const void* data,
                                                   size_t n, int mode) {
  return cudaStreamBeginCaptureToGraph(static_cast<cudaStream_t>(per_thread(s)), graph, deps, data, n, mode);
}
// Test control: a function each capture's begin calls once the capture has begun (nullptr: none).
API void fakecudart_on_capture_begun(void (*fn)()) { g_on_capture_begun = fn; }
API cudaError_t cudaStreamEndCapture(cudaStream_t s, void** graph) {
  count("cudaStreamEndCapture");
  if (!make_current(t_device)) return 1;
  return runtime_error(drv().end_capture(s, graph));
}
API cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t s, void** graph) {
  return cudaStreamEndCapture(static_cast<cudaStream_t>(per_thread(s)), graph);
}
API cudaError_t cudaMallocAsync_ptsz(void** p, size_t size, cudaStream_t s) {
  count("cudaMallocAsync_ptsz");
  return noted(malloc_async(p, size, s, true));
}
API cudaError_t cudaFreeAsync_ptsz(void* p, cudaStream_t s) {
  count("cudaFreeAsync_ptsz");
  return free_async(p, s, true);
}
// Fails for every pointer, as it does for memory from cuMemCreate (no legacy IPC handle).
API cudaError_t cudaIpcGetMemHandle(void* handle, void*) {
  count("cudaIpcGetMemHandle");
  std::memset(handle, 0, 64);
  return 1;  // cudaErrorInvalidValue
}
// The stream-ordered allocator's pools are the driver's (cudaDeviceSetMemPool is cuDeviceSetMemPool...);
// without a double they fail.
namespace {
template <typename F, typename... Args>
cudaError_t through(F Driver::*fn, Args... args) {
  if (!make_current(t_device) || !(drv().*fn)) return 1;
  return runtime_error((drv().*fn)(args...));
}
}  // namespace
API cudaError_t cudaDeviceGetDefaultMemPool(void** pool, int device) { return through(&Driver::default_pool, pool, device); }
API cudaError_t cudaDeviceSetMemPool(int device, void* pool) { return through(&Driver::device_set_pool, device, pool); }
API cudaError_t cudaDeviceGetMemPool(void** pool, int device) { return through(&Driver::device_get_pool, pool, device); }
API cudaError_t cudaMemPoolCreate(void** pool, const void* props) { return through(&Driver::pool_create, pool, props); }
API cudaError_t cudaMemPoolDestroy(void* pool) { return through(&Driver::pool_destroy, pool); }
API cudaError_t cudaMemPoolGetAttribute(void* pool, int attr, void* value) {
  return through(&Driver::pool_get_attribute, pool, attr, value);
}
// The runtime's own handles are none here: every open fails as an unknown handle does, and a close of a
// pointer no open returned fails (cudaErrorInvalidResourceHandle, cudaErrorInvalidValue).
struct FakeIpcHandle {  // cudaIpcMemHandle_t
  char reserved[64];
};
API cudaError_t cudaIpcOpenMemHandle(void** p, FakeIpcHandle, unsigned) {
  count("cudaIpcOpenMemHandle");
  *p = nullptr;
  return 400;
}
API cudaError_t cudaIpcCloseMemHandle(void*) {
  count("cudaIpcCloseMemHandle");
  return 1;
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
