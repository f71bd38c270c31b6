// libfragless_preload.so, the driver half (preload_driver.h): the real driver's entry points, and how a
// program obtains the interposed ones: cuGetProcAddress(_v2) and dlsym on a handle of the driver (R20).
#include <dlfcn.h>

#include <cstring>

#include "fragless/cuda_driver.h"
#include "made_once.h"
#include "preload_driver.h"

// Note [No recursion]: fragless's own driver (cuda_driver.cpp, linked into this library) dlopens the driver
// and looks up cuGetProcAddress with dlsym on that handle; the dlsym below answers lookups made from this
// library with the real driver's symbols, so every call fragless makes goes to the real driver. As a second line, a thread
// that is inside fragless (allocating or freeing for an interposed call) and comes back into an interposed
// entry point is counted (counters().recursions; the tests require none) and forwarded. One such return is
// expected and not counted: an allocation the runtime half hands on to the real runtime (Forwarding in
// preload_core.h), which the runtime makes with the driver's cuMemAllocAsync or cuMemAlloc, interposed here.

namespace fragless_preload::cu {

namespace {

// Note [dlsym before the sanitizers]: a sanitizer runtime resolves its interceptors with
// dlsym(RTLD_NEXT, ...) while it initialises, and with this library first in LD_PRELOAD that call lands in
// the dlsym below. AddressSanitizer does it before it maps its shadow memory (InitializeAsanInterceptors
// runs before InitializeShadowMemory in AsanInitInternal), so the path RTLD_NEXT and RTLD_DEFAULT take
// must execute no instrumented code: no sanitizer checks in these two functions, and no function-local
// static (its guard is a call into the instrumented C++ runtime): a plain pointer read and written with
// the compiler's atomic builtins, which the instrumentation does not wrap in a call.
#define FRAGLESS_NO_SANITIZE __attribute__((no_sanitize("address", "undefined", "thread")))

Dlsym g_real_dlsym = nullptr;  // constant-initialised: set before any constructor runs

}  // namespace

// glibc's own dlsym (2.34 moved it into libc; older ones have it in libdl with the architecture's base
// version). Two threads racing here both find the same pointer; either store is right.
FRAGLESS_NO_SANITIZE Dlsym real_dlsym() {
  Dlsym f = __atomic_load_n(&g_real_dlsym, __ATOMIC_ACQUIRE);
  if (f) return f;
  static const char* const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
  for (const char* v : versions) {
    if (void* p = dlvsym(RTLD_NEXT, "dlsym", v)) {
      f = reinterpret_cast<Dlsym>(p);
      break;
    }
  }
  __atomic_store_n(&g_real_dlsym, f, __ATOMIC_RELEASE);
  return f;
}

namespace {

template <typename F>
void resolve_in(void* lib, F* out, const char* name) {
  *out = lib && real_dlsym() ? reinterpret_cast<F>(real_dlsym()(lib, name)) : nullptr;
}

}  // namespace

Real::Real() {
  lib = dlopen(fragless::cuda_library_name(), RTLD_NOW | RTLD_LOCAL);
  resolve_in(lib, &get_proc, "cuGetProcAddress");
  resolve_in(lib, &get_proc_v2, "cuGetProcAddress_v2");
  resolve_in(lib, &mem_alloc, "cuMemAlloc_v2");
  resolve_in(lib, &mem_alloc_pitch, "cuMemAllocPitch_v2");
  resolve_in(lib, &mem_free, "cuMemFree_v2");
  resolve_in(lib, &mem_get_info, "cuMemGetInfo_v2");
  resolve_in(lib, &alloc_async, "cuMemAllocAsync");
  resolve_in(lib, &alloc_async_ptsz, "cuMemAllocAsync_ptsz");
  resolve_in(lib, &alloc_pool, "cuMemAllocFromPoolAsync");
  resolve_in(lib, &alloc_pool_ptsz, "cuMemAllocFromPoolAsync_ptsz");
  resolve_in(lib, &free_async, "cuMemFreeAsync");
  resolve_in(lib, &free_async_ptsz, "cuMemFreeAsync_ptsz");
  resolve_in(lib, &address_range, "cuMemGetAddressRange_v2");
  resolve_in(lib, &pointer_attribute, "cuPointerGetAttribute");
  resolve_in(lib, &pointer_attributes, "cuPointerGetAttributes");
  resolve_in(lib, &pool_create, "cuMemPoolCreate");
  resolve_in(lib, &pool_destroy, "cuMemPoolDestroy");
  resolve_in(lib, &default_pool, "cuDeviceGetDefaultMemPool");
  resolve_in(lib, &pool_set_access, "cuMemPoolSetAccess");
  resolve_in(lib, &pool_get_attribute, "cuMemPoolGetAttribute");
  resolve_in(lib, &pool_set_attribute, "cuMemPoolSetAttribute");
  resolve_in(lib, &device_set_pool, "cuDeviceSetMemPool");
  resolve_in(lib, &mem_set_pool, "cuMemSetMemPool");  // CUDA 13
  resolve_in(lib, &begin_capture, "cuStreamBeginCapture_v2");
  resolve_in(lib, &begin_capture_ptsz, "cuStreamBeginCapture_v2_ptsz");
  resolve_in(lib, &begin_capture_to_graph, "cuStreamBeginCaptureToGraph");  // CUDA 12.3+
  resolve_in(lib, &begin_capture_to_graph_ptsz, "cuStreamBeginCaptureToGraph_ptsz");
  resolve_in(lib, &end_capture, "cuStreamEndCapture");
  resolve_in(lib, &end_capture_ptsz, "cuStreamEndCapture_ptsz");
  resolve_in(lib, &is_capturing, "cuStreamIsCapturing");
  resolve_in(lib, &stream_destroy, "cuStreamDestroy_v2");
  resolve_in(lib, &stream_destroy_v1, "cuStreamDestroy");
  resolve_in(lib, &is_capturing_ptsz, "cuStreamIsCapturing_ptsz");
  resolve_in(lib, &ctx_get_current, "cuCtxGetCurrent");
  resolve_in(lib, &ctx_get_device, "cuCtxGetDevice");
  resolve_in(lib, &ctx_push, "cuCtxPushCurrent_v2");
  resolve_in(lib, &ctx_pop, "cuCtxPopCurrent_v2");
  resolve_in(lib, &stream_get_ctx, "cuStreamGetCtx");
  resolve_in(lib, &device_get, "cuDeviceGet");
  resolve_in(lib, &device_count, "cuDeviceGetCount");
  resolve_in(lib, &device_attribute, "cuDeviceGetAttribute");
  resolve_in(lib, &primary_state, "cuDevicePrimaryCtxGetState");
  resolve_in(lib, &primary_retain, "cuDevicePrimaryCtxRetain");
  resolve_in(lib, &primary_release, "cuDevicePrimaryCtxRelease_v2");
}

const Real& real() {  // made_once: a fork may come while another thread makes it
  static std::atomic<const Real*> r{nullptr};
  static std::once_flag once;
  return fragless::made_once(r, once, [] { return new Real(); });  // never destroyed: frees come from static destructors
}

}  // namespace fragless_preload::cu

// ---- cuGetProcAddress and dlsym (R20) -----------------------------------------------------------------------

namespace {

using namespace fragless_preload::cu;

// The interposed entry points (Note [One list of entry points], preload_driver.h): the exported name, the
// base name cuGetProcAddress is asked for, the CUDA versions whose ABI the entry point has (an older or
// newer version gets the driver's own), and the default-stream semantics it has.
constexpr int kAnyVersion = 1 << 30;
constexpr unsigned kLegacyStream = 1, kPerThreadStream = 2, kEitherStream = kLegacyStream | kPerThreadStream;

struct EntryPoint {
  const char* symbol;
  const char* base;
  int since, until;
  unsigned streams;
  void* fn;
};

template <typename F>
void* fn(F f) {
  return reinterpret_cast<void*>(f);
}

#define FRAGLESS_ENTRY_POINT(symbol, base, since, until, streams) {#symbol, base, since, until, streams, fn(&symbol)},
const EntryPoint kEntryPoints[] = {FRAGLESS_DRIVER_ENTRY_POINTS(FRAGLESS_ENTRY_POINT)};
#undef FRAGLESS_ENTRY_POINT

bool driver_name(const char* name) { return name && name[0] == 'c' && name[1] == 'u'; }

// What cuGetProcAddress hands out for `symbol` once the driver found it: the interposed entry point for the
// version and flags asked, or the driver's own. CU_GET_PROC_ADDRESS_DEFAULT is the legacy stream at the ABI
// (R20: cuda.h's inline wrapper adds the per-thread flag for code built for per-thread streams).
void substitute(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  if (!driver_name(symbol) || !pfn || !*pfn) return;
  const unsigned stream = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM ? kPerThreadStream : kLegacyStream;
  for (const EntryPoint& e : kEntryPoints)
    if (std::strcmp(e.base, symbol) == 0 && version >= e.since && version < e.until && (e.streams & stream)) {
      *pfn = e.fn;
      return;
    }
}

// The interposed entry point exported under `name` (a driver's exported symbol name), or nullptr.
void* exported(const char* name) {
  if (!driver_name(name)) return nullptr;
  for (const EntryPoint& e : kEntryPoints)
    if (std::strcmp(e.symbol, name) == 0) return e.fn;
  return nullptr;
}

// Whether `address` (a caller's) lies in this library: fragless's own lookups get the real driver.
bool from_here(const void* address) {
  // This library's base, made once (made_once: a fork may come while another thread finds it).
  static std::atomic<const void* const*> base{nullptr};
  static std::once_flag once;
  const void* self = fragless::made_once(base, once, [] {
    Dl_info info{};
    return new const void* const(dladdr(reinterpret_cast<const void*>(&exported), &info) ? info.dli_fbase : nullptr);
  });
  Dl_info info{};
  return self && dladdr(address, &info) && info.dli_fbase == self;
}

void* lookup(void* handle, const char* name, const void* caller) {
  void* p = real_dlsym() ? real_dlsym()(handle, name) : nullptr;
  void* mine = p ? exported(name) : nullptr;
  if (!mine || p == mine || from_here(caller)) return p;
  // Only the driver's own symbols are swapped: p must be what the library the interposer forwards to has.
  return real().lib && p == real_dlsym()(real().lib, name) ? mine : p;
}

}  // namespace

extern "C" {

FRAGLESS_EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  if (!real().get_proc) return CUDA_ERROR_NOT_FOUND;
  const CUresult r = real().get_proc(symbol, pfn, version, flags);
  if (r == CUDA_SUCCESS) substitute(symbol, pfn, version, flags);
  return r;
}

FRAGLESS_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags,
                                             CUdriverProcAddressQueryResult* status) {
  if (!real().get_proc_v2) return CUDA_ERROR_NOT_FOUND;
  const CUresult r = real().get_proc_v2(symbol, pfn, version, flags, status);
  if (r == CUDA_SUCCESS && (!status || *status == CU_GET_PROC_ADDRESS_SUCCESS)) substitute(symbol, pfn, version, flags);
  return r;
}

// dlsym: lookups in a handle of the driver library hand out the interposed entry points (XLA and TensorFlow
// look libcuda's symbols up in their own RTLD_LOCAL handle). RTLD_DEFAULT and RTLD_NEXT are passed on as a
// tail call, so glibc sees the original caller (RTLD_NEXT is relative to it; a test checks it), and touch
// nothing instrumented (Note [dlsym before the sanitizers]).
FRAGLESS_EXPORT FRAGLESS_NO_SANITIZE __attribute__((optimize("O2", "optimize-sibling-calls"))) void* dlsym(void* handle, const char* name) {
  if (handle == RTLD_DEFAULT || handle == RTLD_NEXT) return real_dlsym()(handle, name);
  return lookup(handle, name, __builtin_return_address(0));
}

}  // extern "C"
