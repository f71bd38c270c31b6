// The driver half of libfragless_preload.so, in three files by concept: preload_driver.cpp (contexts and
// streams; the allocation, free, query, capture and stream-destroy entry points), preload_driver_pools.cpp
// (pools, their statistics and what the interposer keeps about a block: driver.h R23-R25) and
// preload_driver_lookup.cpp (the real driver, cuGetProcAddress and dlsym: R20). What they share.
#pragma once
#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "fragless/allocator.h"

#undef cuGetProcAddress  // cuda.h maps these to their _v2; both ABIs are interposed under their own names
#undef cuStreamDestroy

#define FRAGLESS_EXPORT __attribute__((visibility("default")))

#if CUDA_VERSION < 12030  // cuda.h before 12.3 has neither: the entry point takes a pointer all the same
typedef void CUgraphEdgeData;
extern "C" CUresult cuStreamBeginCaptureToGraph(CUstream, CUgraph, const CUgraphNode*, const CUgraphEdgeData*, size_t,
                                                CUstreamCaptureMode);
#endif

// The entry points cuda.h does not declare under these names (the per-thread forms, the older ABIs).
extern "C" {
CUresult cuMemAllocAsync_ptsz(CUdeviceptr*, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr*, size_t, CUmemoryPool, CUstream);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr, CUstream);
CUresult cuStreamBeginCapture_v2_ptsz(CUstream, CUstreamCaptureMode);
CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream, CUgraph, const CUgraphNode*, const CUgraphEdgeData*, size_t,
                                          CUstreamCaptureMode);
CUresult cuStreamEndCapture_ptsz(CUstream, CUgraph*);
CUresult cuStreamDestroy(CUstream);
CUresult cuGetProcAddress(const char*, void**, int, cuuint64_t);
}

// Note [One list of entry points]: every driver entry point the interposer defines is named once, here:
// X(symbol, base, since, until, streams). `symbol` is exported (torch_plugin/preload.map; a test checks the
// library's dynamic symbols against that file and this list against both) and handed out by dlsym on a
// handle of the driver; cuGetProcAddress(base, version, flags) hands it out for since <= version < until and
// the default-stream semantics of the flags (`streams`: legacy, per-thread or either). R20.
#define FRAGLESS_DRIVER_ENTRY_POINTS(X)                                                          \
  X(cuMemAlloc_v2, "cuMemAlloc", 3020, kAnyVersion, kEitherStream)                               \
  X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, kAnyVersion, kEitherStream)                     \
  X(cuMemFree_v2, "cuMemFree", 3020, kAnyVersion, kEitherStream)                                 \
  X(cuMemGetInfo_v2, "cuMemGetInfo", 3020, kAnyVersion, kEitherStream)                           \
  X(cuMemGetAddressRange_v2, "cuMemGetAddressRange", 3020, kAnyVersion, kEitherStream)           \
  X(cuPointerGetAttribute, "cuPointerGetAttribute", 4000, kAnyVersion, kEitherStream)            \
  X(cuPointerGetAttributes, "cuPointerGetAttributes", 7000, kAnyVersion, kEitherStream)          \
  X(cuMemAllocAsync, "cuMemAllocAsync", 11020, kAnyVersion, kLegacyStream)                       \
  X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, kAnyVersion, kPerThreadStream)               \
  X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, kAnyVersion, kLegacyStream)       \
  X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, kAnyVersion, kPerThreadStream) \
  X(cuMemFreeAsync, "cuMemFreeAsync", 11020, kAnyVersion, kLegacyStream)                         \
  X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, kAnyVersion, kPerThreadStream)                 \
  X(cuMemPoolCreate, "cuMemPoolCreate", 11020, kAnyVersion, kEitherStream)                       \
  X(cuMemPoolDestroy, "cuMemPoolDestroy", 11020, kAnyVersion, kEitherStream)                     \
  X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 11020, kAnyVersion, kEitherStream)   \
  X(cuMemPoolSetAccess, "cuMemPoolSetAccess", 11020, kAnyVersion, kEitherStream)                 \
  X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute", 11020, kAnyVersion, kEitherStream)           \
  X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 11020, kAnyVersion, kEitherStream)           \
  X(cuDeviceSetMemPool, "cuDeviceSetMemPool", 11020, kAnyVersion, kEitherStream)                 \
  X(cuMemSetMemPool, "cuMemSetMemPool", 13000, kAnyVersion, kEitherStream)                       \
  X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, kAnyVersion, kLegacyStream)          \
  X(cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture", 10010, kAnyVersion, kPerThreadStream)  \
  X(cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", 12030, kAnyVersion, kLegacyStream) \
  X(cuStreamBeginCaptureToGraph_ptsz, "cuStreamBeginCaptureToGraph", 12030, kAnyVersion, kPerThreadStream) \
  X(cuStreamEndCapture, "cuStreamEndCapture", 10000, kAnyVersion, kLegacyStream)                 \
  X(cuStreamEndCapture_ptsz, "cuStreamEndCapture", 10000, kAnyVersion, kPerThreadStream)         \
  X(cuStreamDestroy, "cuStreamDestroy", 0, 4000, kEitherStream)                                  \
  X(cuStreamDestroy_v2, "cuStreamDestroy", 4000, kAnyVersion, kEitherStream)                     \
  X(cuGetProcAddress, "cuGetProcAddress", 0, 12000, kEitherStream)                               \
  X(cuGetProcAddress_v2, "cuGetProcAddress", 12000, kAnyVersion, kEitherStream)

namespace fragless_preload::cu {

// ---- The real driver (preload_driver_lookup.cpp) ------------------------------------------------------------

using Dlsym = void* (*)(void*, const char*);
// glibc's own dlsym (Note [dlsym before the sanitizers]).
Dlsym real_dlsym();

// The entry points of the library fragless loads as its driver (cuda_library_name()), by their exported
// names, looked up in its own handle: never the interposed ones.
struct Real {
  void* lib = nullptr;
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
  CUresult (*begin_capture_to_graph)(CUstream, CUgraph, const CUgraphNode*, const CUgraphEdgeData*, size_t,
                                     CUstreamCaptureMode);
  CUresult (*begin_capture_to_graph_ptsz)(CUstream, CUgraph, const CUgraphNode*, const CUgraphEdgeData*, size_t,
                                          CUstreamCaptureMode);
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
  Real();
};
const Real& real();

// ---- Contexts and streams (preload_driver.cpp) --------------------------------------------------------------

// The ordinal of a device handle, or -1.
int ordinal_of(CUdevice dev);
// The device whose primary context is c, or -1 (no context, another context, unknown).
int primary_device(CUcontext c);
// The primary context of `device`, among those seen (nullptr if none was).
CUcontext primary_of(int device);
CUcontext current_context();
bool default_stream(CUstream s);
// The device of a stream when its context is that device's primary context (the default streams: the current
// context's), else -1.
int stream_device(CUstream s);
// R16: fragless's key for a stream (per-thread default streams keyed by thread; the legacy stream is 0).
fragless::Stream stream_key(CUstream s, bool ptsz);
bool capturing(CUstream s, bool ptsz);

// ---- Pools and blocks (preload_driver_pools.cpp) ------------------------------------------------------------

// Pools whose properties the interposer knows (from cuMemPoolCreate and cuDeviceGetDefaultMemPool), and
// whether fragless can serve them as the driver would: device memory of one device, no shareable handle
// type, no size limit, no special usage, access for no peer fragless does not grant. Added and changed under
// a lock (pool calls are rare), read without one.
struct KnownPool {
  std::atomic<CUmemoryPool> pool{nullptr};
  std::atomic<int> device{-1};  // the pool's device (for a pool of device memory, servable or not)
  std::atomic<bool> servable{false};
  std::atomic<std::uint64_t> max_size{0};  // CUmemPoolProps::maxSize at its creation (0: none)
  // R24: fragless memory allocated from the pool and not freed yet (the sizes asked), and its high-water
  // marks since the program last reset CU_MEMPOOL_ATTR_USED_MEM_HIGH and RESERVED_MEM_HIGH.
  std::atomic<std::uint64_t> used{0}, used_high{0}, reserved_high{0};
};

KnownPool* find_pool(CUmemoryPool p);
// The pool cuMemAllocAsync on `device` allocates from, if the interposer knows it (nullptr otherwise).
KnownPool* current_pool(int device);
// Whether a driver allocation of `size` from k fails for k's own maximum size (its reserved memory and the
// request exceed it), not for the device's memory (Note [Forwarded allocations out of memory]).
bool pool_cap_reached(const KnownPool* k, size_t size);
// The buffer id of the block at `base` on `device` (0: none can be kept; R25).
unsigned long long buffer_id(int device, CUdeviceptr base);
// The pool the block at `base` was allocated from (nullptr: none, or not from a pool).
CUmemoryPool pool_of(int device, CUdeviceptr base);
// Says `what` on stderr, once per flag.
void say_once(std::atomic<bool>& said, const char* what);

}  // namespace fragless_preload::cu
