// libfragless_preload.so, the driver half: the CUDA driver API's allocation entry points, for programs that
// allocate with libcuda rather than the runtime (XLA's and TensorFlow's StreamExecutor: cuMemAlloc per
// buffer; their cuda_malloc_async allocator: cuMemAllocFromPoolAsync and cuMemFreeAsync). What is interposed,
// and how a pointer to it is obtained, is written in driver.h (R20-R25); in short:
//  - exported: cuMemAlloc_v2, cuMemAllocPitch_v2, cuMemFree_v2, cuMemAllocAsync, cuMemAllocFromPoolAsync and
//    cuMemFreeAsync (and their _ptsz forms), cuMemGetInfo_v2, cuMemGetAddressRange_v2,
//    cuPointerGetAttribute(s), the pool calls whose answers fragless needs or changes (cuMemPoolCreate,
//    cuDeviceGetDefaultMemPool, cuMemPoolSetAccess, cuMemPoolDestroy, cuDeviceSetMemPool, cuMemSetMemPool,
//    cuMemPoolGetAttribute, cuMemPoolSetAttribute), the capture calls (cuStreamBeginCapture_v2,
//    cuStreamBeginCaptureToGraph, cuStreamEndCapture and _ptsz), cuStreamDestroy(_v2), cuGetProcAddress and
//    cuGetProcAddress_v2;
//  - cuGetProcAddress(_v2) hands out the interposed entry point wherever the driver would hand out one of
//    these, for the version and flags asked (the CUDA runtime takes all its driver pointers that way);
//  - dlsym on a handle of the driver library (XLA and TensorFlow dlopen libcuda.so.1 with RTLD_LOCAL and
//    look each symbol up in that handle, which an exported symbol never reaches) hands out the interposed
//    entry point for these names. Lookups made by this library itself (fragless's own driver) get the real
//    driver's, so fragless's calls never come back here (Note [No recursion]).
// Foreign pointers (memory fragless did not allocate) and calls fragless cannot serve as the driver would
// go to the real driver unchanged; each case is listed in driver.h.
#include <cstdio>

#include "preload_core.h"
#include "preload_driver.h"

namespace fragless_preload::cu {

// Note [No recursion] (preload_driver_lookup.cpp): a thread inside fragless (fragless_preload::Inside) that
// comes back into an entry point here is forwarded (fragless_preload::recursing()).

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

namespace {

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

std::atomic<bool> g_said_pool{false}, g_said_stream{false};

// A forwarded allocation of `size` from pool k (nullptr: unknown) of `device`, tried once more when the driver
// is out of memory and fragless gave its cache there back (Note [Forwarded allocations out of memory],
// preload_core.h).
template <class F>
CUresult forward_on(int device, const KnownPool* k, size_t size, F&& forward) {
  const CUresult r = forward();
  if (r != CUDA_ERROR_OUT_OF_MEMORY || pool_cap_reached(k, size)) return r;
  bool released = false;
  {
    Inside in;
    released = fragless_preload::release_for_forwarded(device);
  }
  return released ? forward() : r;
}

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
  KnownPool* k = fragless_preload::current_pool_served(dev);
  if (!k) return forward_on(dev, current_pool(dev), size, forward);
  const CUresult r = serve(e, dev, size, stream_key(s, ptsz), out);
  if (r == CUDA_SUCCESS) fragless_preload::count_in(dev, reinterpret_cast<void*>(*out), k, size);
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
    return k ? forward_on(k->device.load(std::memory_order_relaxed), k, size, forward) : forward();
  }
  const int dev = k->device.load(std::memory_order_relaxed);
  if (stream_device(s) != dev) {  // fragless orders a block only on streams of its own device
    say_once(g_said_stream, "cuMemAllocFromPoolAsync on a stream of another device than the pool's goes to the driver");
    return forward_on(dev, k, size, forward);
  }
  fragless::DeviceEngine* e = engine_for(dev);
  if (!e) return forward();
  const CUresult r = serve(e, dev, size, stream_key(s, ptsz), out);
  if (r == CUDA_SUCCESS) fragless_preload::count_in(dev, reinterpret_cast<void*>(*out), k, size);
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
  if (!fragless_preload::free_behind_fence(dev, ptr)) return CUDA_ERROR_INVALID_VALUE;  // freed already (R21)
  ++counters().frees;
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
  // R21: during a capture cuMemFreeAsync "must be passed the address of a graph allocation", and memory
  // fragless serves never is one (allocations on a capturing stream go to the driver): refused, as the driver
  // refuses it.
  if (capturing(s, ptsz)) return CUDA_ERROR_INVALID_VALUE;
  Inside in;
  ++counters().frees;
  // No event may be recorded on a stream of another device: behind the fence instead.
  if (stream_device(s) != dev)
    return fragless_preload::free_behind_fence(dev, ptr) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  return fragless_preload::free_on_stream(dev, ptr, stream_key(s, ptsz)) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// ---- Queries (R22) ------------------------------------------------------------------------------------------

// The device and block of fragless memory holding p (any byte of it), or -1. A block the program freed (behind
// the fence, or held for other processes after its free) is not the program's any more: -1, the driver answers.
int block_of(CUdeviceptr p, CUdeviceptr* base, size_t* size) {
  fragless::Allocator* a = p ? fragless_preload::allocator() : nullptr;
  if (!a) return -1;
  for (int d = 0; d < a->device_count(); ++d)
    if (fragless::DeviceEngine* e = a->existing(d)) {
      bool freed = false;
      if (void* b = e->allocation_containing(reinterpret_cast<void*>(p), size, &freed)) {
        if (freed) return -1;
        *base = reinterpret_cast<CUdeviceptr>(b);
        return d;
      }
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

// cuStreamDestroy through `destroy` (the driver's entry point of the ABI asked), once fragless has retired the
// stream (without a wait, Note [Destroyed streams]).
CUresult destroy_stream(CUstream s, CUresult (*destroy)(CUstream)) {
  if (!destroy) return CUDA_ERROR_NOT_SUPPORTED;
  // A capturing stream is not retired: its destroy fails, and an event recorded on it would be a graph node.
  if (!default_stream(s) && !recursing() && !capturing(s, false))
    fragless_preload::retire_stream(stream_key(s, false), stream_device(s));
  return destroy(s);
}

}  // namespace
}  // namespace fragless_preload::cu

using namespace fragless_preload::cu;
using fragless_preload::counters;
using fragless_preload::recursing;

// ---- The entry points ---------------------------------------------------------------------------------------

extern "C" {

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

// Memory fragless caches but does not use counts as free, as for cudaMemGetInfo (Note [Free memory at one
// moment], preload_core.h).
FRAGLESS_EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  if (!real().mem_get_info) return CUDA_ERROR_NOT_INITIALIZED;
  if (fragless_preload::reading_free_memory() || recursing()) return real().mem_get_info(free_bytes, total);
  const CUresult r = real().mem_get_info(free_bytes, total);  // the answer and error for the current context
  if (r != CUDA_SUCCESS) return r;
  const int dev = primary_device(current_context());
  fragless::Allocator* a = fragless_preload::allocator();
  if (fragless::DeviceEngine* e = a && dev >= 0 ? a->existing(dev) : nullptr)
    fragless_preload::count_cached_as_free(e, free_bytes, total);
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
// CUDA 12.3's capture into an existing graph (XLA's StreamBeginCaptureToGraph calls it directly), told to the
// engine as cuStreamBeginCapture_v2 is. A driver without the _ptsz form gets the legacy one with the
// per-thread stream named.
FRAGLESS_EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode* deps,
                                                     const CUgraphEdgeData* data, size_t n, CUstreamCaptureMode mode) {
  if (!real().begin_capture_to_graph) return CUDA_ERROR_NOT_SUPPORTED;
  fragless_preload::capture_began(stream_key(s, false), stream_device(s));  // Note [Quiet before a capture]
  const CUresult r = real().begin_capture_to_graph(s, g, deps, data, n, mode);
  if (r != CUDA_SUCCESS && !capturing(s, false)) fragless_preload::capture_ended(stream_key(s, false));
  return r;
}
FRAGLESS_EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g, const CUgraphNode* deps,
                                                          const CUgraphEdgeData* data, size_t n, CUstreamCaptureMode mode) {
  auto begin = real().begin_capture_to_graph_ptsz;
  CUstream named = s;
  if (!begin) {
    begin = real().begin_capture_to_graph;
    if (!s) named = CU_STREAM_PER_THREAD;
  }
  if (!begin) return CUDA_ERROR_NOT_SUPPORTED;
  fragless_preload::capture_began(stream_key(s, true), stream_device(named));  // Note [Quiet before a capture]
  const CUresult r = begin(named, g, deps, data, n, mode);
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

// The stream is retired first, without a wait, as for cudaStreamDestroy (fragless_preload::retire_stream). The
// CUDA 4.0 ABI (cuStreamDestroy_v2) and the older one (cuStreamDestroy) take the same argument.
FRAGLESS_EXPORT CUresult cuStreamDestroy_v2(CUstream s) { return destroy_stream(s, real().stream_destroy); }
FRAGLESS_EXPORT CUresult cuStreamDestroy(CUstream s) {
  return destroy_stream(s, real().stream_destroy_v1 ? real().stream_destroy_v1 : real().stream_destroy);
}

}  // extern "C"
