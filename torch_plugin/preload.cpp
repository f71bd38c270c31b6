// libfragless_preload.so: LD_PRELOAD interposer for programs that link the CUDA runtime dynamically.
//
// cudaMalloc / cudaMallocAsync allocate from fragless; cudaFree / cudaFreeAsync give fragless's pointers
// back and forward every other pointer to the real runtime (dlsym(RTLD_NEXT, ...)); cudaMemGetInfo counts
// memory fragless caches but does not use as free. Semantics kept:
//  - cudaFree promises the memory is not reused while work queued before it may still touch it. fragless
//    defers such frees and releases them in batches behind one device-wide fence (cudaDeviceSynchronize)
//    when 1024 frees or 256 MiB are pending, or when an allocation would otherwise fail.
//    The fence synchronises the device that owns the memory (made current for the call), not the caller's.
//  - cudaFreeAsync is stream-ordered: the block is reused by its own stream at once and by other streams
//    only after the work queued on the freeing stream before the free is done (record_stream semantics).
//  - cudaMallocAsync allocates on the stream's device (cudaStreamGetDevice, CUDA 12.8+; else the current
//    device). On a capturing stream both calls go to the runtime: memory allocated in a capture belongs to
//    the graph (a free of fragless memory on a capturing stream waits behind the fence instead).
//  - The _ptsz variants (code built with --default-stream per-thread) are interposed too.
//  - cudaIpcGetMemHandle goes to the runtime; when it refuses fragless memory (cuMemCreate memory has no
//    legacy IPC handle) fragless says why on stderr.
// A statically linked CUDA runtime cannot be interposed (its calls never reach the dynamic linker).
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "fragless/allocator.h"

extern "C" {
typedef int cudaError_t;  // cudaSuccess = 0, cudaErrorMemoryAllocation = 2, cudaErrorInvalidValue = 1
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
}

namespace {

constexpr cudaError_t kSuccess = 0, kInvalidValue = 1, kMemoryAllocation = 2;

template <typename F>
F next(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

struct Real {
  cudaError_t (*malloc)(void**, size_t) = next<decltype(malloc)>("cudaMalloc");
  cudaError_t (*free)(void*) = next<decltype(free)>("cudaFree");
  cudaError_t (*malloc_async)(void**, size_t, cudaStream_t) = next<decltype(malloc_async)>("cudaMallocAsync");
  cudaError_t (*free_async)(void*, cudaStream_t) = next<decltype(free_async)>("cudaFreeAsync");
  cudaError_t (*malloc_async_ptsz)(void**, size_t, cudaStream_t) = next<decltype(malloc_async_ptsz)>("cudaMallocAsync_ptsz");
  cudaError_t (*free_async_ptsz)(void*, cudaStream_t) = next<decltype(free_async_ptsz)>("cudaFreeAsync_ptsz");
  cudaError_t (*mem_get_info)(size_t*, size_t*) = next<decltype(mem_get_info)>("cudaMemGetInfo");
  cudaError_t (*get_device)(int*) = next<decltype(get_device)>("cudaGetDevice");
  cudaError_t (*set_device)(int) = next<decltype(set_device)>("cudaSetDevice");
  cudaError_t (*device_synchronize)() = next<decltype(device_synchronize)>("cudaDeviceSynchronize");
  cudaError_t (*stream_is_capturing)(cudaStream_t, int*) = next<decltype(stream_is_capturing)>("cudaStreamIsCapturing");
  cudaError_t (*stream_get_device)(cudaStream_t, int*) = next<decltype(stream_get_device)>("cudaStreamGetDevice");  // CUDA 12.8+
  cudaError_t (*ipc_get_mem_handle)(void*, void*) = next<decltype(ipc_get_mem_handle)>("cudaIpcGetMemHandle");
};

const Real& real() {
  static const Real r;
  return r;
}

struct Counters {
  std::atomic<unsigned long> mallocs{0}, frees{0}, forwarded_frees{0}, fences{0}, fallbacks{0};
};
Counters g_counts;

struct Pending {
  void* ptr;
  std::size_t size;
};

struct Interposer {
  std::mutex mu;  // guards pending and creation
  std::unique_ptr<fragless::Allocator> alloc;
  bool tried = false;
  std::vector<std::vector<Pending>> pending;  // per device: cudaFree'd, waiting for the fence
  std::vector<std::size_t> pending_bytes;

  fragless::Allocator* get() {
    std::lock_guard lk(mu);
    if (alloc || tried) return alloc.get();
    tried = true;
    auto conf = fragless::config_from_environment();
    std::string err;
    if (conf.ok) alloc = fragless::Allocator::create(conf.options, -1, &err);
    else err = conf.error;
    if (!alloc) {
      std::fprintf(stderr, "fragless (LD_PRELOAD): %s; forwarding every call to the CUDA runtime\n", err.c_str());
      return nullptr;
    }
    pending.resize(static_cast<std::size_t>(alloc->device_count()));
    pending_bytes.assign(pending.size(), 0);
    return alloc.get();
  }

  // One device-wide fence on the owning device (made current for the call, then the caller's again), then
  // the deferred frees of `device` go back to the cache.
  void drain(int device) {
    std::vector<Pending> batch;
    {
      std::lock_guard lk(mu);
      batch.swap(pending[static_cast<std::size_t>(device)]);
      pending_bytes[static_cast<std::size_t>(device)] = 0;
    }
    if (batch.empty()) return;
    int caller = device;
    if (real().get_device) real().get_device(&caller);
    const bool switch_device = caller != device && real().set_device;
    if (switch_device) real().set_device(device);
    if (real().device_synchronize) real().device_synchronize();
    if (switch_device) real().set_device(caller);
    ++g_counts.fences;
    for (const Pending& p : batch) alloc->device(device)->free(p.ptr);
  }
};

Interposer& ip() {
  static Interposer* i = new Interposer();  // never destroyed: frees may come from static destructors
  return *i;
}

int current_device() {
  int d = 0;
  if (real().get_device) real().get_device(&d);
  return d;
}

// The engine that owns p, or -1.
int owner(void* p) {
  fragless::Allocator* a = ip().get();
  if (!a || !p) return -1;
  for (int d = 0; d < a->device_count(); ++d)
    if (a->device(d)->owns(p)) return d;
  return -1;
}

bool capturing(cudaStream_t s) {
  int status = 0;  // cudaStreamCaptureStatusNone
  return s && real().stream_is_capturing && real().stream_is_capturing(s, &status) == kSuccess && status != 0;
}

// The device a stream belongs to (cudaStreamGetDevice where the runtime has it), else the current one.
int device_of(cudaStream_t s) {
  int d = -1;
  if (s && real().stream_get_device && real().stream_get_device(s, &d) == kSuccess && d >= 0) return d;
  return current_device();
}

// The real runtime's stream-ordered allocation (per-thread default stream variant where asked).
cudaError_t real_malloc_async(void** out, size_t size, cudaStream_t stream, bool ptsz) {
  auto f = ptsz && real().malloc_async_ptsz ? real().malloc_async_ptsz : real().malloc_async;
  return f ? f(out, size, stream) : kInvalidValue;
}

cudaError_t allocate(void** out, size_t size, cudaStream_t stream, bool async, bool ptsz = false) {
  if (!out) return kInvalidValue;
  // Allocations on a capturing stream become graph-owned memory: only the runtime can serve them.
  if (async && capturing(stream)) {
    ++g_counts.fallbacks;
    return real_malloc_async(out, size, stream, ptsz);
  }
  fragless::Allocator* a = ip().get();
  const int dev = async ? device_of(stream) : current_device();
  fragless::DeviceEngine* e = a ? a->device(dev) : nullptr;
  if (!e) {
    ++g_counts.fallbacks;
    return async ? real_malloc_async(out, size, stream, ptsz) : real().malloc(out, size);
  }
  ++g_counts.mallocs;
  if (size == 0) {
    *out = nullptr;
    return kSuccess;
  }
  fragless::AllocError err;
  void* p = e->allocate(size, reinterpret_cast<fragless::Stream>(stream), &err);
  if (!p && err.status == fragless::Status::out_of_memory) {
    ip().drain(dev);  // memory waiting behind the fence may be all that is missing
    p = e->allocate(size, reinterpret_cast<fragless::Stream>(stream), &err);
  }
  if (!p) {
    std::fprintf(stderr, "%s\n", err.message.c_str());
    *out = nullptr;
    return kMemoryAllocation;
  }
  *out = p;
  return kSuccess;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** p, size_t size) {
  return allocate(p, size, nullptr, false);
}

__attribute__((visibility("default"))) cudaError_t cudaMallocAsync(void** p, size_t size, cudaStream_t s) {
  return allocate(p, size, s, true);
}

// The entry points of code built with --default-stream per-thread.
__attribute__((visibility("default"))) cudaError_t cudaMallocAsync_ptsz(void** p, size_t size, cudaStream_t s) {
  return allocate(p, size, s, true, true);
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* p) {
  if (!p) return real().free ? real().free(p) : kSuccess;  // cudaFree(0) is the classic context-init idiom
  const int dev = owner(p);
  if (dev < 0) {
    ++g_counts.forwarded_frees;
    return real().free ? real().free(p) : kInvalidValue;
  }
  ++g_counts.frees;
  Interposer& i = ip();
  std::size_t size = 0;
  i.alloc->device(dev)->base_allocation(p, &size);
  bool drain = false;
  {
    std::lock_guard lk(i.mu);
    auto& list = i.pending[static_cast<std::size_t>(dev)];
    list.push_back({p, size});
    i.pending_bytes[static_cast<std::size_t>(dev)] += size;
    drain = list.size() >= 1024 || i.pending_bytes[static_cast<std::size_t>(dev)] >= (256u << 20);
  }
  if (drain) i.drain(dev);
  return kSuccess;
}

namespace {
cudaError_t free_async(void* p, cudaStream_t s, bool ptsz) {
  if (!p) return kSuccess;
  const int dev = owner(p);
  if (dev < 0) {  // the runtime's (graph-owned memory from a capture among them)
    ++g_counts.forwarded_frees;
    auto f = ptsz && real().free_async_ptsz ? real().free_async_ptsz : real().free_async;
    return f ? f(p, s) : kInvalidValue;
  }
  if (capturing(s)) return cudaFree(p);  // no event may be recorded into the capture: behind the fence instead
  ++g_counts.frees;
  fragless::DeviceEngine* e = ip().alloc->device(dev);
  e->record_stream(p, reinterpret_cast<fragless::Stream>(s));  // a no-op when s is the allocation stream
  return e->free(p) == fragless::Status::ok ? kSuccess : kInvalidValue;
}
}  // namespace

__attribute__((visibility("default"))) cudaError_t cudaFreeAsync(void* p, cudaStream_t s) { return free_async(p, s, false); }

__attribute__((visibility("default"))) cudaError_t cudaFreeAsync_ptsz(void* p, cudaStream_t s) {
  return free_async(p, s, true);
}

// fragless memory comes from cuMemCreate, which has no legacy IPC handle: the runtime refuses it. The call
// still goes to the runtime (other memory may be shareable); when it fails on fragless memory, say why.
__attribute__((visibility("default"))) cudaError_t cudaIpcGetMemHandle(void* handle, void* p) {
  const cudaError_t r = real().ipc_get_mem_handle ? real().ipc_get_mem_handle(handle, p) : kInvalidValue;
  static std::atomic<bool> said{false};
  if (r != kSuccess && owner(p) >= 0 && !said.exchange(true))
    std::fprintf(stderr,
                 "fragless (LD_PRELOAD): cudaIpcGetMemHandle cannot share %p: fragless memory comes from cuMemCreate, "
                 "which has no legacy CUDA IPC handle (torch.multiprocessing sharing of CUDA tensors needs the "
                 "runtime's own allocator); the runtime's error is returned\n",
                 p);
  return r;
}

// The device whose engine owns p, or -1 (for tests and curious users).
__attribute__((visibility("default"))) int fragless_preload_device_of(void* p) { return owner(p); }

__attribute__((visibility("default"))) cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  const cudaError_t r = real().mem_get_info ? real().mem_get_info(free_bytes, total) : kInvalidValue;
  if (r != kSuccess) return r;
  if (fragless::Allocator* a = ip().get())
    if (fragless::DeviceEngine* e = a->device(current_device())) {
      const auto u = e->usage();
      if (u.reserved > u.allocated) *free_bytes += static_cast<size_t>(u.reserved - u.allocated);  // cached, reusable
    }
  return kSuccess;
}

// Counters for tests and curious users: mallocs served, frees taken, frees forwarded, fences, fallbacks.
__attribute__((visibility("default"))) void fragless_preload_counters(unsigned long out[5]) {
  out[0] = g_counts.mallocs;
  out[1] = g_counts.frees;
  out[2] = g_counts.forwarded_frees;
  out[3] = g_counts.fences;
  out[4] = g_counts.fallbacks;
}

}  // extern "C"
