// libfragless_preload.so, the driver half: the CUDA driver API's allocation entry points, for programs that
// allocate with libcuda rather than the runtime (XLA's and TensorFlow's StreamExecutor: cuMemAlloc per
// buffer; their cuda_malloc_async allocator: cuMemAllocFromPoolAsync and cuMemFreeAsync). What is interposed,
// and how a pointer to it is obtained, is written in driver.h (R20-R25); in short:
//  - exported: cuMemAlloc_v2, cuMemAllocPitch_v2, cuMemFree_v2, cuMemAllocAsync, cuMemAllocFromPoolAsync and
//    cuMemFreeAsync (and their _ptsz forms), cuMemGetInfo_v2, cuMemGetAddressRange_v2,
//    cuPointerGetAttribute(s), the pool calls whose answers fragless needs or changes (cuMemPoolCreate,
//    cuDeviceGetDefaultMemPool, cuMemPoolSetAccess, cuMemPoolDestroy, cuDeviceSetMemPool, cuMemSetMemPool,
//    cuMemPoolGetAttribute, cuMemPoolSetAttribute), the capture calls (cuStreamBeginCapture_v2,
//    cuStreamEndCapture and _ptsz), cuStreamDestroy(_v2), cuGetProcAddress and cuGetProcAddress_v2;
//  - cuGetProcAddress(_v2) hands out the interposed entry point wherever the driver would hand out one of
//    these, for the version and flags asked (the CUDA runtime takes all its driver pointers that way);
//  - dlsym on a handle of the driver library (XLA and TensorFlow dlopen libcuda.so.1 with RTLD_LOCAL and
//    look each symbol up in that handle, which an exported symbol never reaches) hands out the interposed
//    entry point for these names. Lookups made by this library itself (fragless's own driver) get the real
//    driver's, so fragless's calls never come back here (Note [No recursion]).
// Foreign pointers (memory fragless did not allocate) and calls fragless cannot serve as the driver would
// go to the real driver unchanged; each case is listed in driver.h.
#include <dlfcn.h>

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "fragless/allocator.h"
#include "fragless/cuda_driver.h"
#include "preload_core.h"

#undef cuGetProcAddress  // cuda.h maps these to their _v2; both ABIs are interposed under their own names
#undef cuStreamDestroy

namespace {

using fragless_preload::counters;

// ---- The real driver and the real dlsym ---------------------------------------------------------------------

using Dlsym = void* (*)(void*, const char*);

// Note [dlsym before the sanitizers]: a sanitizer runtime resolves its interceptors with
// dlsym(RTLD_NEXT, ...) while it initialises, and with this library first in LD_PRELOAD that call lands in
// the dlsym below. AddressSanitizer does it before it maps its shadow memory (InitializeAsanInterceptors
// runs before InitializeShadowMemory in AsanInitInternal), so the path RTLD_NEXT and RTLD_DEFAULT take
// must execute no instrumented code: no sanitizer checks in these two functions, and no function-local
// static (its guard is a call into the instrumented C++ runtime): a plain pointer read and written with
// the compiler's atomic builtins, which the instrumentation does not wrap in a call.
#define FRAGLESS_NO_SANITIZE __attribute__((no_sanitize("address", "undefined", "thread")))

Dlsym g_real_dlsym = nullptr;  // constant-initialised: set before any constructor runs

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

template <typename F>
void resolve_in(void* lib, F* out, const char* name) {
  *out = lib && real_dlsym() ? reinterpret_cast<F>(real_dlsym()(lib, name)) : nullptr;
}

// The entry points of the library fragless loads as its driver (cuda_library_name()), by their exported
// names, looked up in its own handle: never the interposed ones.
struct Real {
  void* lib = dlopen(fragless::cuda_library_name(), RTLD_NOW | RTLD_LOCAL);
  CUresult (*get_proc)(const char*, void**, int, cuuint64_t);
  CUresult (*get_proc_v2)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
  CUresult (*mem_alloc)(CUdeviceptr*, size_t);
  CUresult (*mem_alloc_pitch)(CUdeviceptr*, size_t*, size_t, size_t, unsigned);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*mem_get_info)(size_t*, size_t*);
  CUresult (*alloc_async)(CUdeviceptr*, size_t, CUstream);
  CUresult (*alloc_async_ptsz)(CUdeviceptr*, size_t, CUstream);
  CUresult (*alloc_pool)(CUdeviceptr*, size_t, CUmemoryPool, CUstream);
  CUresult (*alloc_pool_ptsz)(CUdeviceptr*, size_t, CUmemoryPool, CUstream);
  CUresult (*free_async)(CUdeviceptr, CUstream);
  CUresult (*free_async_ptsz)(CUdeviceptr, CUstream);
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*pointer_attribute)(void*, CUpointer_attribute, CUdeviceptr);
  CUresult (*pointer_attributes)(unsigned, CUpointer_attribute*, void**, CUdeviceptr);
  CUresult (*pool_create)(CUmemoryPool*, const CUmemPoolProps*);
  CUresult (*pool_destroy)(CUmemoryPool);
  CUresult (*default_pool)(CUmemoryPool*, CUdevice);
  CUresult (*pool_set_access)(CUmemoryPool, const CUmemAccessDesc*, size_t);
  CUresult (*pool_get_attribute)(CUmemoryPool, CUmemPool_attribute, void*);
  CUresult (*pool_set_attribute)(CUmemoryPool, CUmemPool_attribute, void*);
  CUresult (*device_set_pool)(CUdevice, CUmemoryPool);
  CUresult (*mem_set_pool)(CUmemLocation*, CUmemAllocationType, CUmemoryPool);
  CUresult (*begin_capture)(CUstream, CUstreamCaptureMode);
  CUresult (*begin_capture_ptsz)(CUstream, CUstreamCaptureMode);
  CUresult (*end_capture)(CUstream, CUgraph*);
  CUresult (*end_capture_ptsz)(CUstream, CUgraph*);
  CUresult (*is_capturing)(CUstream, CUstreamCaptureStatus*);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*stream_destroy_v1)(CUstream);
  CUresult (*is_capturing_ptsz)(CUstream, CUstreamCaptureStatus*);
  CUresult (*ctx_get_current)(CUcontext*);
  CUresult (*ctx_get_device)(CUdevice*);
  CUresult (*ctx_push)(CUcontext);
  CUresult (*ctx_pop)(CUcontext*);
  CUresult (*stream_get_ctx)(CUstream, CUcontext*);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*device_count)(int*);
  CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*primary_state)(CUdevice, unsigned*, int*);
  CUresult (*primary_retain)(CUcontext*, CUdevice);
  CUresult (*primary_release)(CUdevice);
  Real() {
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
};

const Real& real() {
  static const Real* r = new Real();  // never destroyed: frees may come from static destructors
  return *r;
}

// ---- Recursion ----------------------------------------------------------------------------------------------

// Note [No recursion]: fragless's own driver (cuda_driver.cpp, linked into this library) dlopens the driver and looks up
// cuGetProcAddress with dlsym on that handle; the dlsym below answers lookups made from this library with the
// real driver's symbols, so every call fragless makes goes to the real driver. As a second line, a thread
// that is inside fragless (allocating or freeing for an interposed call) and comes back into an interposed
// entry point is counted (counters().recursions; the tests require none) and forwarded.
using fragless_preload::Inside;
using fragless_preload::recursing;

// ---- Contexts and devices -----------------------------------------------------------------------------------

// Contexts seen so far, with their device ordinal and whether each is that device's primary context. Appended
// under a lock (once per context), read without one.
struct KnownContext {
  std::atomic<CUcontext> ctx{nullptr};
  int ordinal = -1;
  bool primary = false;
};
constexpr int kMaxContexts = 256;
KnownContext g_contexts[kMaxContexts];
std::atomic<int> g_context_count{0};
std::mutex g_contexts_mu;

int ordinal_of(CUdevice dev) {
  const Real& r = real();
  int n = 0;
  if (!r.device_count || r.device_count(&n) != CUDA_SUCCESS) return -1;
  for (int d = 0; d < n; ++d) {  // a CUdevice is a handle: its ordinal is the one cuDeviceGet maps to it
    CUdevice h = -1;
    if (r.device_get(&h, d) == CUDA_SUCCESS && h == dev) return d;
  }
  return -1;
}

// What context c is: learnt once (its device through cuCtxGetDevice under it; primary when the device's
// primary context is active and is c, found with a retain and release that leave its count as it was).
const KnownContext* learn(CUcontext c) {
  const Real& r = real();
  std::lock_guard lk(g_contexts_mu);
  const int n = g_context_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (g_contexts[i].ctx.load(std::memory_order_relaxed) == c) return &g_contexts[i];
  if (n == kMaxContexts || !r.ctx_push || r.ctx_push(c) != CUDA_SUCCESS) return nullptr;
  CUdevice dev = -1;
  const bool got = r.ctx_get_device(&dev) == CUDA_SUCCESS;
  CUcontext popped = nullptr;
  r.ctx_pop(&popped);
  if (!got) return nullptr;
  KnownContext& k = g_contexts[n];
  k.ordinal = ordinal_of(dev);
  unsigned flags = 0;
  int active = 0;
  CUcontext primary = nullptr;
  if (r.primary_state(dev, &flags, &active) == CUDA_SUCCESS && active &&
      r.primary_retain(&primary, dev) == CUDA_SUCCESS) {
    r.primary_release(dev);
    k.primary = primary == c;
  }
  k.ctx.store(c, std::memory_order_relaxed);
  g_context_count.store(n + 1, std::memory_order_release);
  return &k;
}

const KnownContext* known(CUcontext c) {
  if (!c) return nullptr;
  const int n = g_context_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (g_contexts[i].ctx.load(std::memory_order_relaxed) == c) return &g_contexts[i];
  return learn(c);
}

// The device whose primary context is c, or -1 (no context, another context, unknown).
int primary_device(CUcontext c) {
  const KnownContext* k = known(c);
  return k && k->primary ? k->ordinal : -1;
}

// The primary context of `device`, among those seen (nullptr if none was).
CUcontext primary_of(int device) {
  const int n = g_context_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (g_contexts[i].primary && g_contexts[i].ordinal == device) return g_contexts[i].ctx.load(std::memory_order_relaxed);
  return nullptr;
}

CUcontext current_context() {
  CUcontext c = nullptr;
  if (!real().ctx_get_current || real().ctx_get_current(&c) != CUDA_SUCCESS) return nullptr;
  return c;
}

bool default_stream(CUstream s) { return s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD; }

// The device of a stream when its context is that device's primary context (the default streams: the current
// context's), else -1.
int stream_device(CUstream s) {
  if (default_stream(s)) return primary_device(current_context());
  CUcontext c = nullptr;
  if (!real().stream_get_ctx || real().stream_get_ctx(s, &c) != CUDA_SUCCESS) return -1;
  return primary_device(c);
}

// R16: fragless's key for a stream (per-thread default streams keyed by thread; the legacy stream is 0).
fragless::Stream stream_key(CUstream s, bool ptsz) {
  if (s == CU_STREAM_PER_THREAD || (ptsz && s == nullptr)) return fragless::per_thread_stream();
  return s == CU_STREAM_LEGACY ? 0 : reinterpret_cast<fragless::Stream>(s);
}

bool capturing(CUstream s, bool ptsz) {
  auto f = ptsz && real().is_capturing_ptsz ? real().is_capturing_ptsz : real().is_capturing;
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  return f && f(s, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

// ---- Pools (R23, R24) ---------------------------------------------------------------------------------------

// Pools whose properties the interposer knows (from cuMemPoolCreate and cuDeviceGetDefaultMemPool), and
// whether fragless can serve them as the driver would: device memory of one device, no shareable handle
// type, no size limit, no special usage, access for no peer fragless does not grant. Added and changed under
// a lock (pool calls are rare), read without one.
struct KnownPool {
  std::atomic<CUmemoryPool> pool{nullptr};
  std::atomic<int> device{-1};
  std::atomic<bool> servable{false};
  // R24: fragless memory allocated from the pool and not freed yet (the sizes asked), and its high-water
  // marks since the program last reset CU_MEMPOOL_ATTR_USED_MEM_HIGH and RESERVED_MEM_HIGH.
  std::atomic<std::uint64_t> used{0}, used_high{0}, reserved_high{0};
};
constexpr int kMaxPools = 256;
KnownPool g_pools[kMaxPools];
std::atomic<int> g_pool_count{0};
std::mutex g_pools_mu;

KnownPool* find_pool(CUmemoryPool p) {
  const int n = g_pool_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (g_pools[i].pool.load(std::memory_order_relaxed) == p) return &g_pools[i];
  return nullptr;
}

void remember_pool(CUmemoryPool p, int device, bool servable) {
  std::lock_guard lk(g_pools_mu);
  const int n = g_pool_count.load(std::memory_order_acquire);
  KnownPool* k = nullptr;
  for (int i = 0; i < n && !k; ++i)
    if (g_pools[i].pool.load(std::memory_order_relaxed) == p || g_pools[i].pool.load(std::memory_order_relaxed) == nullptr)
      k = &g_pools[i];
  if (!k) {
    if (n == kMaxPools) return;  // unknown pools are forwarded
    k = &g_pools[n];
    g_pool_count.store(n + 1, std::memory_order_release);
  }
  k->device.store(device, std::memory_order_relaxed);
  k->servable.store(servable, std::memory_order_relaxed);
  k->pool.store(p, std::memory_order_release);
}

// Each device's default pool (once seen) and its current pool (cuDeviceSetMemPool, cuMemSetMemPool; nullptr
// until one is set), by ordinal: cuMemAllocAsync allocates from the current pool of the stream's device.
constexpr int kMaxDevices = 64;
std::atomic<CUmemoryPool> g_default_pools[kMaxDevices], g_current_pools[kMaxDevices];

void remember_default_pool(CUmemoryPool p, int device) {
  if (device < 0 || device >= kMaxDevices) return;
  if (!find_pool(p)) remember_pool(p, device, true);
  g_default_pools[device].store(p, std::memory_order_release);
}

// The pool cuMemAllocAsync on `device` allocates from, if the interposer knows it (nullptr otherwise).
KnownPool* current_pool(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  if (CUmemoryPool p = g_current_pools[device].load(std::memory_order_acquire)) return find_pool(p);
  CUmemoryPool p = g_default_pools[device].load(std::memory_order_acquire);
  CUdevice d = -1;
  if (!p && real().default_pool && real().device_get(&d, device) == CUDA_SUCCESS && real().default_pool(&p, d) == CUDA_SUCCESS)
    remember_default_pool(p, device);
  return p ? find_pool(p) : nullptr;
}

void raise_to(std::atomic<std::uint64_t>& high, std::uint64_t v) {
  std::uint64_t h = high.load(std::memory_order_relaxed);
  while (h < v && !high.compare_exchange_weak(h, v, std::memory_order_relaxed)) {
  }
}

// ---- What the interposer keeps about a block ----------------------------------------------------------------

// Per device, the fragless blocks the interposer keeps something about, by address: the pool it was
// allocated from and the size asked (R24), its buffer id once asked for (R25). An entry goes at the block's
// free (fragless_preload::forget, from either half). Each device's book has its own lock; a free skips it
// while the book is empty.
struct Entry {
  KnownPool* pool = nullptr;
  std::uint64_t asked = 0;
  unsigned long long id = 0;
};
struct DeviceBook {
  std::mutex mu;
  std::unordered_map<CUdeviceptr, Entry> live;
  std::atomic<std::size_t> entries{0};
};

DeviceBook* book(int device) {
  static DeviceBook* books = new DeviceBook[kMaxDevices];  // never destroyed: frees may come from static destructors
  return device >= 0 && device < kMaxDevices ? &books[device] : nullptr;
}

// Block p (asked bytes) was allocated from pool k.
void count_in(int device, CUdeviceptr p, KnownPool* k, std::uint64_t asked) {
  DeviceBook* b = book(device);
  if (!b) return;
  const std::uint64_t now = k->used.fetch_add(asked, std::memory_order_relaxed) + asked;
  raise_to(k->used_high, now);
  raise_to(k->reserved_high, now);
  std::lock_guard lk(b->mu);
  b->live[p] = Entry{k, asked, 0};
  b->entries.store(b->live.size(), std::memory_order_release);
}

// R25: fragless's ids have the top bit set; the driver's count its allocations from 1.
constexpr unsigned long long kFraglessBufferIds = 1ull << 63;

// The buffer id of the block at `base` on `device` (0: none can be kept).
unsigned long long buffer_id(int device, CUdeviceptr base) {
  static std::atomic<unsigned long long> next{0};
  DeviceBook* b = book(device);
  if (!b) return 0;
  std::lock_guard lk(b->mu);
  Entry& e = b->live[base];
  if (!e.id) e.id = kFraglessBufferIds | (next.fetch_add(1, std::memory_order_relaxed) + 1);
  b->entries.store(b->live.size(), std::memory_order_release);
  return e.id;
}

// The pool the block at `base` was allocated from (nullptr: none, or not from a pool).
CUmemoryPool pool_of(int device, CUdeviceptr base) {
  DeviceBook* b = book(device);
  if (!b || b->entries.load(std::memory_order_acquire) == 0) return nullptr;
  std::lock_guard lk(b->mu);
  auto it = b->live.find(base);
  return it != b->live.end() && it->second.pool ? it->second.pool->pool.load(std::memory_order_relaxed) : nullptr;
}

void say_once(std::atomic<bool>& said, const char* what) {
  if (!said.exchange(true)) std::fprintf(stderr, "fragless (LD_PRELOAD): %s\n", what);
}

// Whether fragless grants `peer` access to memory of `device` (the cuda driver grants every peer that can
// access it when peer_access is on).
bool fragless_grants(int device, int peer) {
  fragless::Allocator* a = fragless_preload::allocator();
  if (!a || !a->options().peer_access) return false;
  const Real& r = real();
  CUdevice d = -1, p = -1;
  int can = 0;
  if (r.device_get(&d, device) != CUDA_SUCCESS || r.device_get(&p, peer) != CUDA_SUCCESS) return false;
  auto can_access = reinterpret_cast<CUresult (*)(int*, CUdevice, CUdevice)>(
      real_dlsym() ? real_dlsym()(r.lib, "cuDeviceCanAccessPeer") : nullptr);
  return can_access && can_access(&can, p, d) == CUDA_SUCCESS && can;
}

// ---- Allocation and free ------------------------------------------------------------------------------------

// Allocates `size` bytes on `device` for stream key s; CUDA_ERROR_OUT_OF_MEMORY (said on stderr) when
// fragless cannot, after the deferred frees went back. nullptr engine: not served (the caller forwards).
CUresult serve(fragless::DeviceEngine* e, int device, size_t size, fragless::Stream s, CUdeviceptr* out) {
  Inside in;
  fragless::AllocError err;
  void* p = e->allocate(size, s, &err);
  if (!p && err.status == fragless::Status::out_of_memory && fragless_preload::drain(device))
    p = e->allocate(size, s, &err);  // memory waiting behind the fence may be all that is missing
  if (!p) {
    std::fprintf(stderr, "%s\n", err.message.c_str());
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  ++counters().driver_mallocs;
  *out = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

// The engine that serves an allocation on `device` (nullptr: forward the call).
fragless::DeviceEngine* engine_for(int device) {
  fragless::Allocator* a = device >= 0 ? fragless_preload::allocator() : nullptr;
  return a && device < a->device_count() ? a->device(device) : nullptr;
}

CUresult alloc_sync(CUdeviceptr* out, size_t size) {
  if (!out || size == 0 || recursing()) return real().mem_alloc(out, size);  // the driver's answer (0: invalid)
  const int dev = primary_device(current_context());
  fragless::DeviceEngine* e = engine_for(dev);
  if (!e) {
    ++counters().driver_forwarded;
    return real().mem_alloc(out, size);
  }
  return serve(e, dev, size, 0, out);
}

std::atomic<bool> g_said_pool{false}, g_said_stream{false}, g_said_current{false};

CUresult alloc_async(CUdeviceptr* out, size_t size, CUstream s, bool ptsz) {
  auto forward = [&] {
    ++counters().driver_forwarded;
    auto f = ptsz ? real().alloc_async_ptsz : real().alloc_async;
    return f ? f(out, size, s) : CUDA_ERROR_NOT_SUPPORTED;
  };
  // Memory allocated during a capture belongs to the graph: only the driver can serve it.
  if (!out || size == 0 || recursing() || capturing(s, ptsz)) return forward();
  const int dev = stream_device(s);
  fragless::DeviceEngine* e = engine_for(dev);
  if (!e) return forward();
  KnownPool* k = current_pool(dev);
  if (!k || !k->servable.load(std::memory_order_relaxed)) {
    say_once(g_said_current,
             "cuMemAllocAsync on a device whose current memory pool fragless cannot serve as the driver would "
             "(unknown to it, or with a shareable handle type, a maximum size, a usage, or access for a peer it "
             "does not grant): its allocations go to the driver");
    return forward();
  }
  const CUresult r = serve(e, dev, size, stream_key(s, ptsz), out);
  if (r == CUDA_SUCCESS) count_in(dev, *out, k, size);
  return r;
}

CUresult alloc_from_pool(CUdeviceptr* out, size_t size, CUmemoryPool pool, CUstream s, bool ptsz) {
  auto forward = [&] {
    ++counters().driver_forwarded;
    auto f = ptsz ? real().alloc_pool_ptsz : real().alloc_pool;
    return f ? f(out, size, pool, s) : CUDA_ERROR_NOT_SUPPORTED;
  };
  if (!out || size == 0 || recursing() || capturing(s, ptsz)) return forward();
  KnownPool* k = find_pool(pool);
  if (!k || !k->servable.load(std::memory_order_relaxed)) {
    say_once(g_said_pool,
             "a memory pool fragless cannot serve as the driver would (unknown to it, or with a shareable handle "
             "type, a maximum size, a usage, or access for a peer it does not grant): its allocations go to the driver");
    return forward();
  }
  const int dev = k->device.load(std::memory_order_relaxed);
  if (stream_device(s) != dev) {  // fragless orders a block only on streams of its own device
    say_once(g_said_stream, "cuMemAllocFromPoolAsync on a stream of another device than the pool's goes to the driver");
    return forward();
  }
  fragless::DeviceEngine* e = engine_for(dev);
  if (!e) return forward();
  const CUresult r = serve(e, dev, size, stream_key(s, ptsz), out);
  if (r == CUDA_SUCCESS) count_in(dev, *out, k, size);
  return r;
}

CUresult free_sync(CUdeviceptr p) {
  void* ptr = reinterpret_cast<void*>(p);
  const int dev = recursing() ? -1 : fragless_preload::owner(ptr);
  if (dev < 0) {
    if (p) ++counters().driver_forwarded;
    return real().mem_free(p);
  }
  Inside in;
  ++counters().frees;
  fragless_preload::free_behind_fence(dev, ptr);
  return CUDA_SUCCESS;
}

CUresult free_async(CUdeviceptr p, CUstream s, bool ptsz) {
  void* ptr = reinterpret_cast<void*>(p);
  const int dev = recursing() ? -1 : fragless_preload::owner(ptr);
  if (dev < 0) {  // the driver's (graph-owned memory from a capture among them)
    ++counters().driver_forwarded;
    auto f = ptsz ? real().free_async_ptsz : real().free_async;
    return f ? f(p, s) : CUDA_ERROR_NOT_SUPPORTED;
  }
  Inside in;
  ++counters().frees;
  // No event may be recorded into a capture, nor on a stream of another device: behind the fence instead.
  if (capturing(s, ptsz) || stream_device(s) != dev) {
    fragless_preload::free_behind_fence(dev, ptr);
    return CUDA_SUCCESS;
  }
  return fragless_preload::free_on_stream(dev, ptr, stream_key(s, ptsz)) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// ---- Queries (R22) ------------------------------------------------------------------------------------------

// The device and block of fragless memory holding p (any byte of it), or -1.
int block_of(CUdeviceptr p, CUdeviceptr* base, size_t* size) {
  fragless::Allocator* a = p ? fragless_preload::allocator() : nullptr;
  if (!a) return -1;
  for (int d = 0; d < a->device_count(); ++d)
    if (fragless::DeviceEngine* e = a->existing(d))
      if (void* b = e->allocation_containing(reinterpret_cast<void*>(p), size)) {
        *base = reinterpret_cast<CUdeviceptr>(b);
        return d;
      }
  return -1;
}

// The attribute of fragless memory (block `base`, `size`, on `device`) answered here; false: the driver's
// answer stands (it sees the mapping fragless made: memory type, mapped, handle types, access flags...).
bool answer(CUpointer_attribute attr, void* data, int device, CUdeviceptr p, CUdeviceptr base, size_t size) {
  switch (attr) {
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *static_cast<CUdeviceptr*>(data) = base; return true;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *static_cast<size_t*>(data) = size; return true;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int*>(data) = device; return true;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *static_cast<unsigned*>(data) = CU_MEMORYTYPE_DEVICE; return true;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *static_cast<CUdeviceptr*>(data) = p; return true;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *static_cast<int*>(data) = 0; return true;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *static_cast<CUmemoryPool*>(data) = pool_of(device, base); return true;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: {  // R25
      const unsigned long long id = buffer_id(device, base);
      if (!id) return false;
      *static_cast<unsigned long long*>(data) = id;
      return true;
    }
    case CU_POINTER_ATTRIBUTE_CONTEXT: {
      CUcontext c = primary_of(device);
      if (!c) return false;
      *static_cast<CUcontext*>(data) = c;
      return true;
    }
    default: return false;
  }
}

// ---- Streams ------------------------------------------------------------------------------------------------

// cuStreamDestroy through `destroy` (the driver's entry point of the ABI asked), once fragless has settled the
// stream's blocks.
CUresult destroy_stream(CUstream s, CUresult (*destroy)(CUstream)) {
  if (!destroy) return CUDA_ERROR_NOT_SUPPORTED;
  if (!default_stream(s) && !recursing()) fragless_preload::retire_stream(stream_key(s, false), stream_device(s));
  return destroy(s);
}

}  // namespace

// ---- The entry points ---------------------------------------------------------------------------------------

extern "C" {

#define FRAGLESS_EXPORT __attribute__((visibility("default")))

FRAGLESS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t size) { return alloc_sync(p, size); }

// R21: the pitch is the width rounded up to the device's texture pitch alignment.
FRAGLESS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr* p, size_t* pitch, size_t width, size_t height, unsigned element) {
  const bool bad = !p || !pitch || width == 0 || height == 0 || (element != 4 && element != 8 && element != 16);
  const int dev = bad || recursing() ? -1 : primary_device(current_context());
  fragless::DeviceEngine* e = engine_for(dev);
  CUdevice d = -1;
  int align = 0, max_pitch = 0;
  if (!e || real().device_get(&d, dev) != CUDA_SUCCESS ||
      real().device_attribute(&align, CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT, d) != CUDA_SUCCESS || align <= 0 ||
      real().device_attribute(&max_pitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, d) != CUDA_SUCCESS) {
    if (!bad) ++counters().driver_forwarded;
    return real().mem_alloc_pitch(p, pitch, width, height, element);  // the driver's answer to bad arguments too
  }
  const size_t a = static_cast<size_t>(align);
  const size_t rounded = (width + a - 1) / a * a;
  if (max_pitch > 0 && rounded > static_cast<size_t>(max_pitch)) return CUDA_ERROR_INVALID_VALUE;
  if (height > SIZE_MAX / rounded) return CUDA_ERROR_INVALID_VALUE;
  const CUresult r = serve(e, dev, rounded * height, 0, p);
  if (r == CUDA_SUCCESS) *pitch = rounded;
  return r;
}

FRAGLESS_EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return free_sync(p); }

FRAGLESS_EXPORT CUresult cuMemAllocAsync(CUdeviceptr* p, size_t size, CUstream s) { return alloc_async(p, size, s, false); }
FRAGLESS_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr* p, size_t size, CUstream s) { return alloc_async(p, size, s, true); }
FRAGLESS_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr* p, size_t size, CUmemoryPool pool, CUstream s) {
  return alloc_from_pool(p, size, pool, s, false);
}
FRAGLESS_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* p, size_t size, CUmemoryPool pool, CUstream s) {
  return alloc_from_pool(p, size, pool, s, true);
}
FRAGLESS_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { return free_async(p, s, false); }
FRAGLESS_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return free_async(p, s, true); }

// Memory fragless caches but does not use counts as free, as for cudaMemGetInfo.
FRAGLESS_EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  if (!real().mem_get_info) return CUDA_ERROR_NOT_INITIALIZED;
  const CUresult r = real().mem_get_info(free_bytes, total);
  if (r != CUDA_SUCCESS || recursing()) return r;
  fragless_preload::cached_counted() = true;
  const int dev = primary_device(current_context());
  fragless::Allocator* a = fragless_preload::allocator();
  if (fragless::DeviceEngine* e = a && dev >= 0 ? a->existing(dev) : nullptr) {
    const auto u = e->usage();
    if (u.reserved > u.allocated) *free_bytes += static_cast<size_t>(u.reserved - u.allocated);
  }
  return r;
}

FRAGLESS_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize, CUdeviceptr p) {
  CUdeviceptr base = 0;
  size_t size = 0;
  if (block_of(p, &base, &size) < 0) return real().address_range(pbase, psize, p);
  if (pbase) *pbase = base;
  if (psize) *psize = size;
  return CUDA_SUCCESS;
}

FRAGLESS_EXPORT CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attr, CUdeviceptr p) {
  CUdeviceptr base = 0;
  size_t size = 0;
  const int dev = data ? block_of(p, &base, &size) : -1;
  if (dev >= 0 && answer(attr, data, dev, p, base, size)) return CUDA_SUCCESS;
  return real().pointer_attribute(data, attr, p);
}

FRAGLESS_EXPORT CUresult cuPointerGetAttributes(unsigned n, CUpointer_attribute* attrs, void** data, CUdeviceptr p) {
  const CUresult r = real().pointer_attributes(n, attrs, data, p);
  CUdeviceptr base = 0;
  size_t size = 0;
  if (r != CUDA_SUCCESS || !attrs || !data) return r;
  const int dev = block_of(p, &base, &size);
  if (dev >= 0)
    for (unsigned i = 0; i < n; ++i)
      if (data[i]) answer(attrs[i], data[i], dev, p, base, size);
  return r;
}

FRAGLESS_EXPORT CUresult cuMemPoolCreate(CUmemoryPool* pool, const CUmemPoolProps* props) {
  const CUresult r = real().pool_create(pool, props);
  if (r != CUDA_SUCCESS || !pool || !props) return r;
  bool servable = props->allocType == CU_MEM_ALLOCATION_TYPE_PINNED && props->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
                  props->handleTypes == CU_MEM_HANDLE_TYPE_NONE && props->maxSize == 0 && props->usage == 0;
  int dev = -1;
  CUdevice d = -1;
  if (servable && real().device_get(&d, props->location.id) == CUDA_SUCCESS) dev = props->location.id;
  remember_pool(*pool, dev, servable && dev >= 0);
  return r;
}

FRAGLESS_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool, CUdevice dev) {
  const CUresult r = real().default_pool(pool, dev);
  if (r != CUDA_SUCCESS || !pool) return r;
  remember_default_pool(*pool, ordinal_of(dev));
  return r;
}

FRAGLESS_EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc* map, size_t count) {
  const CUresult r = real().pool_set_access(pool, map, count);
  const KnownPool* k = find_pool(pool);
  if (r != CUDA_SUCCESS || !k || !map) return r;
  const int dev = k->device.load(std::memory_order_relaxed);
  bool servable = k->servable.load(std::memory_order_relaxed);
  for (size_t i = 0; i < count && servable; ++i)
    if (map[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && map[i].location.id != dev &&
        map[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && !fragless_grants(dev, map[i].location.id))
      servable = false;  // a peer that would read fragless memory without access
  remember_pool(pool, dev, servable);
  return r;
}

FRAGLESS_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  const CUresult r = real().pool_destroy(pool);
  if (r == CUDA_SUCCESS && find_pool(pool)) remember_pool(pool, -1, false);  // fragless's blocks live on until freed
  return r;
}

// R24: the pool's statistics count the fragless memory allocated from it.
FRAGLESS_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  if (!real().pool_get_attribute) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().pool_get_attribute(pool, attr, value);
  const KnownPool* k = r == CUDA_SUCCESS && value ? find_pool(pool) : nullptr;
  if (!k) return r;
  auto add = [&](const std::atomic<std::uint64_t>& v) { *static_cast<cuuint64_t*>(value) += v.load(std::memory_order_relaxed); };
  if (attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT || attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) add(k->used);
  else if (attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) add(k->used_high);
  else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) add(k->reserved_high);
  return r;
}

// R24: a high-water mark the driver reset (to zero: it refuses any other value) restarts from fragless's use.
FRAGLESS_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  if (!real().pool_set_attribute) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().pool_set_attribute(pool, attr, value);
  KnownPool* k = r == CUDA_SUCCESS ? find_pool(pool) : nullptr;
  if (k && attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) k->used_high.store(k->used.load(std::memory_order_relaxed));
  if (k && attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) k->reserved_high.store(k->used.load(std::memory_order_relaxed));
  return r;
}

// The current pool of a device: cuMemAllocAsync on its streams allocates from it (R24).
FRAGLESS_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
  if (!real().device_set_pool) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().device_set_pool(dev, pool);
  const int ordinal = r == CUDA_SUCCESS ? ordinal_of(dev) : -1;
  if (ordinal >= 0 && ordinal < kMaxDevices) g_current_pools[ordinal].store(pool, std::memory_order_release);
  return r;
}
FRAGLESS_EXPORT CUresult cuMemSetMemPool(CUmemLocation* location, CUmemAllocationType type, CUmemoryPool pool) {
  if (!real().mem_set_pool) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().mem_set_pool(location, type, pool);
  if (r == CUDA_SUCCESS && location->type == CU_MEM_LOCATION_TYPE_DEVICE && type == CU_MEM_ALLOCATION_TYPE_PINNED &&
      location->id >= 0 && location->id < kMaxDevices)
    g_current_pools[location->id].store(pool, std::memory_order_release);
  return r;
}

FRAGLESS_EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) {
  if (!real().begin_capture) return CUDA_ERROR_NOT_SUPPORTED;
  fragless_preload::capture_began(stream_key(s, false), stream_device(s));  // Note [Quiet before a capture]
  const CUresult r = real().begin_capture(s, mode);
  if (r != CUDA_SUCCESS && !capturing(s, false)) fragless_preload::capture_ended(stream_key(s, false));
  return r;
}
FRAGLESS_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode) {
  if (!real().begin_capture_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
  fragless_preload::capture_began(stream_key(s, true), stream_device(s));  // Note [Quiet before a capture]
  const CUresult r = real().begin_capture_ptsz(s, mode);
  if (r != CUDA_SUCCESS && !capturing(s, true)) fragless_preload::capture_ended(stream_key(s, true));
  return r;
}
FRAGLESS_EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph* g) {
  if (!real().end_capture) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().end_capture(s, g);
  if (!capturing(s, false)) fragless_preload::capture_ended(stream_key(s, false));  // also when invalidated
  return r;
}
FRAGLESS_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream s, CUgraph* g) {
  if (!real().end_capture_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().end_capture_ptsz(s, g);
  if (!capturing(s, true)) fragless_preload::capture_ended(stream_key(s, true));
  return r;
}

// The stream's blocks are settled first, as for cudaStreamDestroy (fragless_preload::retire_stream). The
// CUDA 4.0 ABI (cuStreamDestroy_v2) and the older one (cuStreamDestroy) take the same argument.
FRAGLESS_EXPORT CUresult cuStreamDestroy_v2(CUstream s) { return destroy_stream(s, real().stream_destroy); }
FRAGLESS_EXPORT CUresult cuStreamDestroy(CUstream s) {
  return destroy_stream(s, real().stream_destroy_v1 ? real().stream_destroy_v1 : real().stream_destroy);
}

}  // extern "C"

// ---- cuGetProcAddress and dlsym (R20) -----------------------------------------------------------------------

namespace {

// An interposed entry point as cuGetProcAddress names it: the base name, the oldest CUDA version whose ABI
// the interposer's entry point has (an older version gets the driver's own), and the entry points for legacy
// and per-thread default-stream semantics.
struct Proc {
  const char* name;
  int since;
  void* legacy;
  void* ptsz;
};

template <typename F>
void* fn(F f) {
  return reinterpret_cast<void*>(f);
}

extern "C" CUresult cuGetProcAddress(const char*, void**, int, cuuint64_t);
extern "C" CUresult cuGetProcAddress_v2(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

const Proc* proc(const char* name) {
  static const Proc table[] = {
      {"cuMemAlloc", 3020, fn(&cuMemAlloc_v2), fn(&cuMemAlloc_v2)},
      {"cuMemAllocPitch", 3020, fn(&cuMemAllocPitch_v2), fn(&cuMemAllocPitch_v2)},
      {"cuMemFree", 3020, fn(&cuMemFree_v2), fn(&cuMemFree_v2)},
      {"cuMemGetInfo", 3020, fn(&cuMemGetInfo_v2), fn(&cuMemGetInfo_v2)},
      {"cuMemGetAddressRange", 3020, fn(&cuMemGetAddressRange_v2), fn(&cuMemGetAddressRange_v2)},
      {"cuPointerGetAttribute", 4000, fn(&cuPointerGetAttribute), fn(&cuPointerGetAttribute)},
      {"cuPointerGetAttributes", 7000, fn(&cuPointerGetAttributes), fn(&cuPointerGetAttributes)},
      {"cuMemAllocAsync", 11020, fn(&cuMemAllocAsync), fn(&cuMemAllocAsync_ptsz)},
      {"cuMemAllocFromPoolAsync", 11020, fn(&cuMemAllocFromPoolAsync), fn(&cuMemAllocFromPoolAsync_ptsz)},
      {"cuMemFreeAsync", 11020, fn(&cuMemFreeAsync), fn(&cuMemFreeAsync_ptsz)},
      {"cuMemPoolCreate", 11020, fn(&cuMemPoolCreate), fn(&cuMemPoolCreate)},
      {"cuMemPoolDestroy", 11020, fn(&cuMemPoolDestroy), fn(&cuMemPoolDestroy)},
      {"cuDeviceGetDefaultMemPool", 11020, fn(&cuDeviceGetDefaultMemPool), fn(&cuDeviceGetDefaultMemPool)},
      {"cuMemPoolSetAccess", 11020, fn(&cuMemPoolSetAccess), fn(&cuMemPoolSetAccess)},
      {"cuMemPoolGetAttribute", 11020, fn(&cuMemPoolGetAttribute), fn(&cuMemPoolGetAttribute)},
      {"cuMemPoolSetAttribute", 11020, fn(&cuMemPoolSetAttribute), fn(&cuMemPoolSetAttribute)},
      {"cuDeviceSetMemPool", 11020, fn(&cuDeviceSetMemPool), fn(&cuDeviceSetMemPool)},
      {"cuMemSetMemPool", 13000, fn(&cuMemSetMemPool), fn(&cuMemSetMemPool)},
      {"cuStreamBeginCapture", 10010, fn(&cuStreamBeginCapture_v2), fn(&cuStreamBeginCapture_v2_ptsz)},
      {"cuStreamEndCapture", 10000, fn(&cuStreamEndCapture), fn(&cuStreamEndCapture_ptsz)},
      {"cuStreamDestroy", 4000, fn(&cuStreamDestroy_v2), fn(&cuStreamDestroy_v2)},
      {"cuGetProcAddress", 12000, fn(&cuGetProcAddress_v2), fn(&cuGetProcAddress_v2)},
  };
  if (!name || name[0] != 'c' || name[1] != 'u') return nullptr;
  for (const Proc& p : table)
    if (std::strcmp(p.name, name) == 0) return &p;
  return nullptr;
}

// What cuGetProcAddress hands out for `symbol` once the driver found it: the interposed entry point for the
// version and flags asked, or the driver's own. CU_GET_PROC_ADDRESS_DEFAULT is the legacy stream at the ABI
// (R20: cuda.h's inline wrapper adds the per-thread flag for code built for per-thread streams).
void substitute(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  const Proc* p = proc(symbol);
  if (!p || !pfn || !*pfn) return;
  if (std::strcmp(symbol, "cuGetProcAddress") == 0) {  // both ABIs, by version
    *pfn = version >= 12000 ? fn(&cuGetProcAddress_v2) : fn(&cuGetProcAddress);
    return;
  }
  if (version < p->since) return;
  *pfn = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM ? p->ptsz : p->legacy;
}

// The interposed entry point exported under `name` (a driver's exported symbol name), or nullptr.
void* exported(const char* name) {
  static const struct {
    const char* name;
    void* fn;
  } table[] = {
      {"cuMemAlloc_v2", fn(&cuMemAlloc_v2)},
      {"cuMemAllocPitch_v2", fn(&cuMemAllocPitch_v2)},
      {"cuMemFree_v2", fn(&cuMemFree_v2)},
      {"cuMemGetInfo_v2", fn(&cuMemGetInfo_v2)},
      {"cuMemGetAddressRange_v2", fn(&cuMemGetAddressRange_v2)},
      {"cuPointerGetAttribute", fn(&cuPointerGetAttribute)},
      {"cuPointerGetAttributes", fn(&cuPointerGetAttributes)},
      {"cuMemAllocAsync", fn(&cuMemAllocAsync)},
      {"cuMemAllocAsync_ptsz", fn(&cuMemAllocAsync_ptsz)},
      {"cuMemAllocFromPoolAsync", fn(&cuMemAllocFromPoolAsync)},
      {"cuMemAllocFromPoolAsync_ptsz", fn(&cuMemAllocFromPoolAsync_ptsz)},
      {"cuMemFreeAsync", fn(&cuMemFreeAsync)},
      {"cuMemFreeAsync_ptsz", fn(&cuMemFreeAsync_ptsz)},
      {"cuMemPoolCreate", fn(&cuMemPoolCreate)},
      {"cuMemPoolDestroy", fn(&cuMemPoolDestroy)},
      {"cuDeviceGetDefaultMemPool", fn(&cuDeviceGetDefaultMemPool)},
      {"cuMemPoolSetAccess", fn(&cuMemPoolSetAccess)},
      {"cuMemPoolGetAttribute", fn(&cuMemPoolGetAttribute)},
      {"cuMemPoolSetAttribute", fn(&cuMemPoolSetAttribute)},
      {"cuDeviceSetMemPool", fn(&cuDeviceSetMemPool)},
      {"cuMemSetMemPool", fn(&cuMemSetMemPool)},
      {"cuStreamBeginCapture_v2", fn(&cuStreamBeginCapture_v2)},
      {"cuStreamBeginCapture_v2_ptsz", fn(&cuStreamBeginCapture_v2_ptsz)},
      {"cuStreamEndCapture", fn(&cuStreamEndCapture)},
      {"cuStreamEndCapture_ptsz", fn(&cuStreamEndCapture_ptsz)},
      {"cuStreamDestroy", fn(&cuStreamDestroy)},
      {"cuStreamDestroy_v2", fn(&cuStreamDestroy_v2)},
      {"cuGetProcAddress", fn(&cuGetProcAddress)},
      {"cuGetProcAddress_v2", fn(&cuGetProcAddress_v2)},
  };
  if (!name || name[0] != 'c' || name[1] != 'u') return nullptr;
  for (const auto& e : table)
    if (std::strcmp(e.name, name) == 0) return e.fn;
  return nullptr;
}

// Whether `address` (a caller's) lies in this library: fragless's own lookups get the real driver.
bool from_here(const void* address) {
  static const void* const self = [] {
    Dl_info info{};
    return dladdr(reinterpret_cast<const void*>(&exported), &info) ? info.dli_fbase : nullptr;
  }();
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

// ---- What either half's free tells this one (preload_core.h) ------------------------------------------------

void fragless_preload::forget(int device, const void* p) {
  DeviceBook* b = book(device);
  if (!b || b->entries.load(std::memory_order_acquire) == 0) return;
  std::lock_guard lk(b->mu);
  auto it = b->live.find(reinterpret_cast<CUdeviceptr>(p));
  if (it == b->live.end()) return;
  if (KnownPool* k = it->second.pool) k->used.fetch_sub(it->second.asked, std::memory_order_relaxed);
  b->live.erase(it);
  b->entries.store(b->live.size(), std::memory_order_release);
}
