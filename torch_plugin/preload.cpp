// libfragless_preload.so: LD_PRELOAD interposer for programs that link the CUDA runtime dynamically.
//
// cudaMalloc / cudaMallocAsync allocate from fragless; cudaFree / cudaFreeAsync give fragless's pointers
// back and forward every other pointer to the real runtime (dlsym(RTLD_NEXT, ...)); cudaMemGetInfo counts
// memory fragless caches but does not use as free. Semantics kept:
//  - cudaFree promises the memory is not reused while work queued before it may still touch it. fragless
//    defers such frees and releases them in batches behind one device-wide fence (cudaDeviceSynchronize)
//    when 1024 frees or 256 MiB are pending, or when an allocation would otherwise fail.
//  - cudaFreeAsync is stream-ordered: the block is reused by its own stream at once and by other streams
//    only after the work queued on the freeing stream before the free is done (record_stream semantics).
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
  cudaError_t (*mem_get_info)(size_t*, size_t*) = next<decltype(mem_get_info)>("cudaMemGetInfo");
  cudaError_t (*get_device)(int*) = next<decltype(get_device)>("cudaGetDevice");
  cudaError_t (*device_synchronize)() = next<decltype(device_synchronize)>("cudaDeviceSynchronize");
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

  // One device-wide fence, then the deferred frees of `device` go back to the cache.
  void drain(int device) {
    std::vector<Pending> batch;
    {
      std::lock_guard lk(mu);
      batch.swap(pending[static_cast<std::size_t>(device)]);
      pending_bytes[static_cast<std::size_t>(device)] = 0;
    }
    if (batch.empty()) return;
    if (real().device_synchronize) real().device_synchronize();
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

cudaError_t allocate(void** out, size_t size, cudaStream_t stream) {
  if (!out) return kInvalidValue;
  fragless::Allocator* a = ip().get();
  const int dev = current_device();
  fragless::DeviceEngine* e = a ? a->device(dev) : nullptr;
  if (!e) {
    ++g_counts.fallbacks;
    return stream ? real().malloc_async(out, size, stream) : real().malloc(out, size);
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

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** p, size_t size) { return allocate(p, size, nullptr); }

__attribute__((visibility("default"))) cudaError_t cudaMallocAsync(void** p, size_t size, cudaStream_t s) {
  return allocate(p, size, s);
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

__attribute__((visibility("default"))) cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  if (!p) return kSuccess;
  const int dev = owner(p);
  if (dev < 0) {
    ++g_counts.forwarded_frees;
    return real().free_async ? real().free_async(p, s) : kInvalidValue;
  }
  ++g_counts.frees;
  fragless::DeviceEngine* e = ip().alloc->device(dev);
  e->record_stream(p, reinterpret_cast<fragless::Stream>(s));  // a no-op when s is the allocation stream
  return e->free(p) == fragless::Status::ok ? kSuccess : kInvalidValue;
}

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
