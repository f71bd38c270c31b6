// libfragless_preload.so: LD_PRELOAD interposer for programs that link the CUDA runtime dynamically, and
// (preload_driver.cpp, the driver half) for programs that allocate with the driver API. This is the runtime
// half; what both share is in preload_core.h.
//
// cudaMalloc / cudaMallocAsync allocate from fragless; cudaFree / cudaFreeAsync give fragless's pointers
// back and forward every other pointer to the real runtime (dlsym(RTLD_NEXT, ...)); cudaMemGetInfo counts
// memory fragless caches but does not use as free. Semantics kept:
//  - cudaFree promises the memory is not reused while work queued before it may still touch it. fragless
//    defers such frees and releases them in batches behind one device-wide fence (cudaDeviceSynchronize)
//    when 1024 frees or 256 MiB are pending, or when an allocation would otherwise fail.
//    The fence synchronises the device that owns the memory (made current for the call), not the caller's.
//    It never runs while a capture is under way (it would invalidate it), and a fence that fails keeps the
//    frees deferred.
//  - cudaFreeAsync is stream-ordered: the block is reused by its own stream at once and by other streams
//    only after the work queued on the freeing stream before the free is done (record_stream semantics).
//  - cudaMallocAsync allocates on the stream's device (cudaStreamGetDevice, CUDA 12.8+; before that the
//    stream's context, through the driver), and only while fragless can serve that device's current memory
//    pool (cudaDeviceSetMemPool), whose statistics then count the block: the driver half's rule (R24). On
//    a capturing stream both calls go to the runtime: memory allocated in a capture belongs to the graph (a
//    free of fragless memory on a capturing stream is refused: it is no graph allocation, R21).
//  - cudaStreamBeginCapture / EndCapture (and their _ptsz and ToGraph forms) tell the device's engine that
//    a capture is under way: it then records no event, synchronises nothing and releases nothing (Note
//    [Capture rules], engine_state.h; a destroyed stream's event excepted, Note [Destroyed streams]).
//  - cudaStreamDestroy retires the stream first, without waiting for its work (Note [Destroyed streams]), so
//    a later stream that gets the same handle value is a new stream to fragless.
//  - Per-thread default streams (cudaStreamPerThread; stream 0 of the _ptsz variants, which code built with
//    --default-stream per-thread calls) are keyed by thread (driver.h, R16).
//  - cudaIpcGetMemHandle, cudaIpcOpenMemHandle and cudaIpcCloseMemHandle share fragless memory between two
//    interposed processes through fragless's own sharing (preload_ipc.cpp, Note [Legacy IPC handles]).
//  - Looking up who owns a pointer uses the engines that exist: it never creates one, nor a context. No
//    engine or context exists for a device before the program uses it; no process-wide lock is taken per call.
// A statically linked CUDA runtime cannot be interposed (its calls never reach the dynamic linker).
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fragless/allocator.h"
#include "made_once.h"
#include "preload_core.h"
#if defined(FRAGLESS_HAVE_CUDA)
#include "fragless/cuda_driver.h"
#endif

extern "C" {
typedef int cudaError_t;  // cudaSuccess = 0, cudaErrorMemoryAllocation = 2, cudaErrorInvalidValue = 1
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
struct CUgraph_st;
typedef CUgraph_st* cudaGraph_t;
}

namespace {

constexpr cudaError_t kSuccess = 0, kInvalidValue = 1, kMemoryAllocation = 2;
constexpr std::uintptr_t kStreamLegacy = 0x1, kStreamPerThread = 0x2;  // cudaStreamLegacy, cudaStreamPerThread

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
  cudaError_t (*get_last_error)() = next<decltype(get_last_error)>("cudaGetLastError");
  cudaError_t (*peek_last_error)() = next<decltype(peek_last_error)>("cudaPeekAtLastError");
  cudaError_t (*stream_is_capturing)(cudaStream_t, int*) = next<decltype(stream_is_capturing)>("cudaStreamIsCapturing");
  cudaError_t (*stream_is_capturing_ptsz)(cudaStream_t, int*) =
      next<decltype(stream_is_capturing_ptsz)>("cudaStreamIsCapturing_ptsz");
  cudaError_t (*stream_get_device)(cudaStream_t, int*) = next<decltype(stream_get_device)>("cudaStreamGetDevice");  // CUDA 12.8+
  cudaError_t (*stream_destroy)(cudaStream_t) = next<decltype(stream_destroy)>("cudaStreamDestroy");
  cudaError_t (*begin_capture)(cudaStream_t, int) = next<decltype(begin_capture)>("cudaStreamBeginCapture");
  cudaError_t (*begin_capture_ptsz)(cudaStream_t, int) = next<decltype(begin_capture_ptsz)>("cudaStreamBeginCapture_ptsz");
  cudaError_t (*begin_capture_to_graph)(cudaStream_t, cudaGraph_t, const void*, const void*, size_t, int) =
      next<decltype(begin_capture_to_graph)>("cudaStreamBeginCaptureToGraph");  // CUDA 12.3+
  cudaError_t (*begin_capture_to_graph_ptsz)(cudaStream_t, cudaGraph_t, const void*, const void*, size_t, int) =
      next<decltype(begin_capture_to_graph_ptsz)>("cudaStreamBeginCaptureToGraph_ptsz");
  cudaError_t (*end_capture)(cudaStream_t, cudaGraph_t*) = next<decltype(end_capture)>("cudaStreamEndCapture");
  cudaError_t (*end_capture_ptsz)(cudaStream_t, cudaGraph_t*) = next<decltype(end_capture_ptsz)>("cudaStreamEndCapture_ptsz");
};

const Real& real() {  // made_once: a fork may come while another thread makes it
  static std::atomic<const Real*> r{nullptr};
  static std::once_flag once;
  return fragless::made_once(r, once, [] { return new Real(); });  // never destroyed, as the interposer
}

fragless_preload::Counters& g_counts = fragless_preload::counters();

struct Pending {
  void* ptr;
  std::size_t size;
};

// The frees of one device waiting for the fence, under that device's own lock.
struct DevicePending {
  std::mutex mu;
  std::vector<Pending> list;
  std::size_t bytes = 0;
};

// A bad FRAGLESS_CONF is named when the library loads, the moment the string is given, even in a program
// that never calls CUDA; the allocator itself is still made at the first call that needs it (which then
// forwards everything, without naming the error again).
bool& conf_reported_at_load() {
  static bool reported = false;
  return reported;
}
__attribute__((constructor)) void check_conf_at_load() {
  const auto conf = fragless::config_from_environment();  // reads constant tables only: safe before main
  if (conf.ok) return;
  std::fprintf(stderr, "fragless (LD_PRELOAD): %s; fragless is off: every CUDA call goes to the CUDA runtime\n",
               conf.error.c_str());
  conf_reported_at_load() = true;
}

void stop_at_exit();

struct Interposer {
  std::atomic<fragless::Allocator*> ready{nullptr};  // set once the allocator exists: one load per call
  fragless::MakeOnce once;                            // the allocator is made once (Note [Making the allocator once])
  std::unique_ptr<fragless::Allocator> alloc;         // set by the maker, read after ready
  std::unique_ptr<DevicePending[]> pending;  // per device: cudaFree'd, waiting for the fence
  std::atomic<int> captures{0};              // captures under way (any device)
  std::mutex captures_mu;                    // guards capturing (begin and end of a capture only)
  std::map<fragless::Stream, int> capturing;  // capturing stream -> its device

  // Locks whose holders take no other lock are held across fork(): a child forked while another thread held
  // one would wait for ever at its next cudaFree (or capture). The table of captures' from the library's load,
  // the lists of frees with the allocator's other fork locks.
  static void lock_mutex(void* m) { static_cast<std::mutex*>(m)->lock(); }
  static void unlock_mutex(void* m) { static_cast<std::mutex*>(m)->unlock(); }
  Interposer() { fragless::hold_across_fork_from_load(&lock_mutex, &unlock_mutex, &unlock_mutex, &captures_mu); }

  fragless::Allocator* get() {
    if (fragless::Allocator* a = ready.load(std::memory_order_acquire)) return a;
    if (fragless::MakeOnce::Turn turn = once.begin()) {  // made here, holding nothing of ours (a fork may take it away)
      std::string err;
      std::unique_ptr<fragless::Allocator> made;
      std::unique_ptr<DevicePending[]> lists;
      bool reported = false;
      try {
        auto conf = fragless::config_from_environment();
        reported = !conf.ok && conf_reported_at_load();  // a bad FRAGLESS_CONF was named when the library loaded
        if (turn.after_lost_making()) fragless::forked_child_traces_not(&conf.options);
        // No engine yet: each device's (and its CUDA context) comes with that device's first use.
        if (conf.ok) made = fragless::Allocator::create(conf.options, -1, &err, /*eager=*/false);
        else err = conf.error;
        if (made) {
          lists = std::make_unique<DevicePending[]>(static_cast<std::size_t>(made->device_count()));
          for (int d = 0; d < made->device_count(); ++d) fragless::hold_across_fork(&lock_mutex, &unlock_mutex, &lists[d].mu);
          std::atexit(stop_at_exit);
        }
      } catch (const std::exception& e) {  // out of host memory: an error, never a maker that never ends
        made.reset();
        (void)lists.release();  // registered with fork: never destroyed
        err = std::string("fragless: could not make the allocator: ") + e.what();
      }
      if (!made && !reported) {
        // Under LD_PRELOAD the host and sim drivers are no way round a missing GPU: the program's other CUDA
        // calls (cudaMemGetInfo, kernels) still go to the runtime. So the driver's hint is left out here.
        if (const auto at = err.find("; use driver:host or driver:sim"); at != std::string::npos)
          err.erase(at, err.find(';', at + 1) - at);  // to the clause's end (npos: the message's)
        std::fprintf(stderr, "fragless (LD_PRELOAD): %s; forwarding every call to the CUDA runtime\n", err.c_str());
      }
      turn.made([&] {  // publication, all at once for a fork
        pending = std::move(lists);
        alloc = std::move(made);
        ready.store(alloc.get(), std::memory_order_release);
      });
    }
    return ready.load(std::memory_order_acquire);  // none from inside the making, on its thread: forwarded
  }

  DevicePending& of(int device) { return pending[static_cast<std::size_t>(device)]; }

  // One device-wide fence on the owning device (made current for the call, then the caller's again), then
  // the deferred frees of `device` go back to the cache. Not while a capture is under way, and a fence that
  // fails frees nothing: the batch stays deferred. True when the frees went back.
  bool drain(int device) {
    if (captures.load(std::memory_order_acquire) > 0) return false;
    DevicePending& d = of(device);
    std::vector<Pending> batch;
    std::size_t bytes = 0;
    {
      std::lock_guard lk(d.mu);
      batch.swap(d.list);
      std::swap(bytes, d.bytes);
    }
    if (batch.empty()) return true;
    int caller = device;
    if (real().get_device) real().get_device(&caller);
    const bool switch_device = caller != device && real().set_device;
    if (switch_device) real().set_device(device);
    // A program with no CUDA runtime (the driver API only) gets the fence from the engine's own driver.
    const bool ok = real().device_synchronize ? real().device_synchronize() == kSuccess
                                              : alloc->device(device)->driver().synchronize_device() == fragless::Status::ok;
    if (switch_device) real().set_device(caller);
    if (!ok) {
      std::lock_guard lk(d.mu);
      d.list.insert(d.list.begin(), batch.begin(), batch.end());
      d.bytes += bytes;
      return false;
    }
    ++g_counts.fences;
    for (const Pending& p : batch) {
      // Forgotten by the driver half again before the block can be reused (R25: a new block at this address
      // gets a new id), then freed: free_deferred frees only a block defer_free marked, once.
      fragless_preload::forget(device, p.ptr);
      alloc->device(device)->free_deferred(p.ptr);
    }
    return true;
  }
};

Interposer& ip() {
  static Interposer* i = new Interposer();  // never destroyed: frees may come from static destructors
  return *i;
}
// Made when the library loads, before any thread of the program can call it: its fork handlers must be
// registered before anything they cover can be held.
__attribute__((constructor)) void make_interposer_at_load() { ip(); }

// At exit, as the C ABI's (capi.cpp): the background workers stop (none of their driver calls runs while the
// CUDA driver tears down), the trace writers are joined and the traces written, each later record as it
// comes (Note [Tracing at exit]). The allocator stays for later frees.
void stop_at_exit() {
  // (In a forked child at_exit does nothing: no worker or writer of ours runs there, and a lock another thread
  // of the parent held at the fork would never be released.)
  if (fragless::Allocator* a = ip().ready.load(std::memory_order_acquire)) a->at_exit();
}

int current_device() {
  int d = 0;
  if (real().get_device) real().get_device(&d);
  return d;
}

using fragless_preload::owner;

// R16 (driver.h): cudaStreamPerThread, and stream 0 of the _ptsz entry points, are the calling thread's own
// per-thread default stream, which fragless keys by thread; cudaStreamLegacy is stream 0.
fragless::Stream engine_stream(cudaStream_t s, bool ptsz) {
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  if (v == kStreamPerThread || (ptsz && v == 0)) return fragless::per_thread_stream();
  return v == kStreamLegacy ? 0 : v;
}

bool capturing(cudaStream_t s, bool ptsz) {
  int status = 0;  // cudaStreamCaptureStatusNone
  auto f = ptsz && real().stream_is_capturing_ptsz ? real().stream_is_capturing_ptsz : real().stream_is_capturing;
  return f && f(s, &status) == kSuccess && status != 0;
}

// The device a stream belongs to: cudaStreamGetDevice where the runtime has it (12.8+), else the stream's
// context through the driver; the default streams are the current device's.
int device_of(cudaStream_t s) {
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  if (v == 0 || v == kStreamLegacy || v == kStreamPerThread) return current_device();
  int d = -1;
  if (real().stream_get_device && real().stream_get_device(s, &d) == kSuccess && d >= 0) return d;
#if defined(FRAGLESS_HAVE_CUDA)
  if (fragless::Allocator* a = ip().get(); a && a->options().driver == fragless::DriverKind::cuda)
    if ((d = fragless::cuda_stream_device(v)) >= 0) return d;
#endif
  return current_device();
}

// The real runtime's stream-ordered allocation (per-thread default stream variant where asked), and its
// cudaMalloc: what it does through the driver comes back through the driver half, forwarded (Note [No
// recursion], Forwarding).
cudaError_t real_malloc_async(void** out, size_t size, cudaStream_t stream, bool ptsz) {
  fragless_preload::Forwarding forwarding;
  auto f = ptsz && real().malloc_async_ptsz ? real().malloc_async_ptsz : real().malloc_async;
  return f ? f(out, size, stream) : kInvalidValue;
}
cudaError_t real_malloc(void** out, size_t size) {
  fragless_preload::Forwarding forwarding;
  return real().malloc(out, size);
}

// cuda_runtime_api.h ("Initialization and Tear-Down"): "If no CUcontext is current to the calling thread when a
// CUDA Runtime API call which requires an active context is made, then the primary context for a device will be
// selected, made current to the calling thread, and initialized." A cudaMalloc fragless serves never reaches
// the runtime, so a thread's first one has the runtime do that (cudaFree(0), which keeps a context already
// current), once per thread: a program that goes on with the driver API finds the context CUDA would have made
// current. (Later, cudaSetDevice makes its device's current itself.)
thread_local bool t_runtime_context = false;
void runtime_context_once() {
  if (t_runtime_context) return;
  t_runtime_context = true;
  if (real().free) real().free(nullptr);
}

cudaError_t allocate(void** out, size_t size, cudaStream_t stream, bool async, bool ptsz = false) {
  if (!out) return kInvalidValue;
  if (fragless_preload::recursing()) return async ? real_malloc_async(out, size, stream, ptsz) : real_malloc(out, size);
  runtime_context_once();
  fragless_preload::Inside inside;
  // Allocations on a capturing stream become graph-owned memory: only the runtime can serve them.
  if (async && capturing(stream, ptsz)) {
    ++g_counts.fallbacks;
    return real_malloc_async(out, size, stream, ptsz);
  }
  fragless::Allocator* a = ip().get();
  const int dev = async ? device_of(stream) : current_device();
  fragless::DeviceEngine* e = a ? a->device(dev) : nullptr;
  if (!e) {
    ++g_counts.fallbacks;
    return async ? real_malloc_async(out, size, stream, ptsz) : real_malloc(out, size);
  }
  // R24 (driver.h): cudaMallocAsync allocates from the device's current pool, as cuMemAllocAsync does: the
  // same rule, through the same code (the driver half's).
  fragless_preload::cu::KnownPool* pool = nullptr;
  if (async && size != 0 && !(pool = fragless_preload::current_pool_served(dev))) {
    ++g_counts.fallbacks;
    const cudaError_t r = real_malloc_async(out, size, stream, ptsz);
    // Note [Forwarded allocations out of memory] (preload_core.h)
    if (r != kMemoryAllocation || fragless_preload::current_pool_cap_reached(dev, size) ||
        !fragless_preload::release_for_forwarded(dev))
      return r;
    // The first try's error is taken back unless something since replaced it (the release's synchronisation
    // reporting a kernel's fault): the retry's own outcome is the call's.
    if (real().peek_last_error && real().get_last_error && real().peek_last_error() == kMemoryAllocation)
      real().get_last_error();
    return real_malloc_async(out, size, stream, ptsz);
  }
  ++g_counts.mallocs;
  if (size == 0) {
    *out = nullptr;
    return kSuccess;
  }
  const fragless::Stream s = async ? engine_stream(stream, ptsz) : 0;
  fragless::AllocError err;
  void* p = e->allocate(size, s, &err);
  if (!p && err.status == fragless::Status::out_of_memory && ip().drain(dev)) {
    p = e->allocate(size, s, &err);  // memory waiting behind the fence may be all that is missing
  }
  if (!p) {
    std::fprintf(stderr, "%s\n", err.message.c_str());
    *out = nullptr;
    return kMemoryAllocation;
  }
  *out = p;
  if (pool) fragless_preload::count_in(dev, p, pool, size);
  return kSuccess;
}

cudaError_t free_sync(void* p) {
  if (!p) return real().free ? real().free(p) : kSuccess;  // cudaFree(0) is the classic context-init idiom
  const int dev = fragless_preload::recursing() ? -1 : owner(p);
  if (dev < 0) {
    ++g_counts.forwarded_frees;
    return real().free ? real().free(p) : kInvalidValue;
  }
  fragless_preload::Inside inside;
  if (!fragless_preload::free_behind_fence(dev, p)) return kInvalidValue;  // freed already (cuda_runtime_api.h)
  ++g_counts.frees;
  return kSuccess;
}

cudaError_t free_async(void* p, cudaStream_t s, bool ptsz) {
  if (!p) return kSuccess;
  const int dev = fragless_preload::recursing() ? -1 : owner(p);
  if (dev < 0) {  // the runtime's (graph-owned memory from a capture among them)
    ++g_counts.forwarded_frees;
    auto f = ptsz && real().free_async_ptsz ? real().free_async_ptsz : real().free_async;
    return f ? f(p, s) : kInvalidValue;
  }
  // cuda_runtime_api.h: during a capture cudaFreeAsync "must be passed the address of a graph allocation", and
  // fragless's memory never is one (allocations on a capturing stream go to the runtime): refused (driver.h R21).
  if (capturing(s, ptsz)) return kInvalidValue;
  fragless_preload::Inside inside;
  ++g_counts.frees;
  return fragless_preload::free_on_stream(dev, p, engine_stream(s, ptsz)) ? kSuccess : kInvalidValue;
}

// A capture begins on stream s: its device's engine follows the capture rules until it ends.
//
// Note [Quiet before a capture]
// The engine is told before the capture begins, not after: its background work stops (a job in flight is
// waited for) while nothing is being captured yet. Told after, a job in flight could record, query or wait
// in the window between cuStreamBeginCapture and the engine's pause, which in a global-mode capture
// invalidates it (seen under ASan, whose slowness widens that window). When the real call then fails, the
// engine is told the capture ended.
void capture_began(cudaStream_t s, bool ptsz) {
  fragless::Allocator* a = ip().get();
  if (!a) return;
  const int dev = device_of(s);
  if (!a->device(dev)) return;
  fragless_preload::capture_began(engine_stream(s, ptsz), dev);
}

// The capture on stream s is over (ended, or never began): the engine may record, wait and release again.
void capture_ended(cudaStream_t s, bool ptsz) {
  if (!ip().ready.load(std::memory_order_acquire) || capturing(s, ptsz)) return;
  fragless_preload::capture_ended(engine_stream(s, ptsz));
}

}  // namespace

// ---- What the driver half shares (preload_core.h) ---------------------------------------------------------

namespace fragless_preload {

Counters& counters() {
  static Counters* c = new Counters();  // never destroyed, as the interposer
  return *c;
}

fragless::Allocator* allocator() { return ip().get(); }

namespace {
thread_local int t_inside = 0, t_forwarding = 0;
}
Inside::Inside() { ++t_inside; }
Inside::~Inside() { --t_inside; }
Forwarding::Forwarding() { ++t_forwarding; }
Forwarding::~Forwarding() { --t_forwarding; }
bool recursing() {
  if (t_inside == 0) return false;
  ++(t_forwarding == 0 ? counters().recursions : counters().handed_on);
  return true;
}

namespace {
thread_local int t_reading_free = 0;
}
ReadingFreeMemory::ReadingFreeMemory() { ++t_reading_free; }
ReadingFreeMemory::~ReadingFreeMemory() { --t_reading_free; }
bool reading_free_memory() { return t_reading_free != 0; }

void count_cached_as_free(fragless::DeviceEngine* e, size_t* free_bytes, size_t* total) {
  std::size_t f = 0, t = 0;
  fragless::DeviceEngine::Usage u;
  if (!e->memory_info_and_usage(&f, &t, &u)) return;  // this thread holds the engine's lock: the driver's answer
  if (t != 0) *free_bytes = f, *total = t;             // 0: the engine's query failed, the caller's answer stays
  if (u.reserved > u.allocated) *free_bytes += static_cast<size_t>(u.reserved - u.allocated);
}

int owner(const void* p) {
  fragless::Allocator* a = ip().get();
  if (!a || !p) return -1;
  void* q = const_cast<void*>(p);
  for (int d = 0; d < a->device_count(); ++d)
    if (fragless::DeviceEngine* e = a->existing(d); e && e->owns(q)) return d;
  return -1;
}

// Note [Frees behind the fence]: cudaFree (and cuMemFree of memory not from the stream-ordered allocator)
// promise that the memory is not reused while work queued before the free may still touch it. The free is
// deferred; a batch of them goes back to the cache behind one device-wide synchronisation, when 1024 frees
// or 256 MiB are pending or when an allocation would otherwise fail. The engine marks the block first
// (DeviceEngine::defer_free), under its own lock: a second free of it, through either half and either call,
// is refused from then on, and the fence frees each block it marked once (free_deferred), so a stale entry
// can never free a block allocated anew at the same address.
bool free_behind_fence(int device, void* p) {
  Interposer& i = ip();
  fragless::DeviceEngine* e = i.alloc->device(device);
  std::size_t size = 0;  // the block's own: what the fence gives back (not its segment's, which it shares)
  if (e->defer_free(p, nullptr, &size) != fragless::Status::ok) return false;
  forget(device, p);
  forget_export(device, p);  // after the engine took the free (Note [Exports and frees], preload_ipc.cpp)
  bool due = false;
  {
    DevicePending& d = i.of(device);
    std::lock_guard lk(d.mu);
    d.list.push_back({p, size});
    d.bytes += size;
    due = d.list.size() >= 1024 || d.bytes >= (256u << 20);
  }
  if (due) i.drain(device);
  return true;
}

bool drain(int device) { return ip().drain(device); }

bool free_on_stream(int device, void* p, fragless::Stream s) {
  forget(device, p);  // before the free: once freed, the block may be another thread's new allocation
  fragless::DeviceEngine* e = ip().alloc->device(device);
  e->record_stream(p, s);  // a no-op when s is the allocation stream
  if (e->free(p) != fragless::Status::ok) return false;
  // After the free (Note [Exports and frees], preload_ipc.cpp): an exported block is held by its share's lease
  // until then; the exporter's copy closed, it goes now unless another process has it open.
  if (forget_export(device, p)) e->reap_shared(0);
  return true;
}

bool release_for_forwarded(int device) {
  fragless::Allocator* a = ip().ready.load(std::memory_order_acquire);
  fragless::DeviceEngine* e = a && device >= 0 ? a->existing(device) : nullptr;
  if (!e) return false;
  const std::int64_t before = e->usage().reserved;
  ip().drain(device);
  fragless::AllocError err;
  if (e->empty_cache(&err) != fragless::Status::ok) std::fprintf(stderr, "%s\n", err.message.c_str());
  return e->usage().reserved < before;
}

void retire_stream(fragless::Stream stream, int device) {
  fragless::Allocator* a = ip().ready.load(std::memory_order_acquire);
  fragless::DeviceEngine* e = a && device >= 0 ? a->existing(device) : nullptr;
  fragless::AllocError err;
  if (e && e->retire_stream(stream, &err) != fragless::Status::ok) std::fprintf(stderr, "%s\n", err.message.c_str());
}

void capture_began(fragless::Stream stream, int device) {
  Interposer& i = ip();
  fragless::Allocator* a = i.ready.load(std::memory_order_acquire);
  fragless::DeviceEngine* e = a ? a->existing(device) : nullptr;
  if (!e) return;
  {
    std::lock_guard lk(i.captures_mu);
    if (!i.capturing.emplace(stream, device).second) return;
  }
  i.captures.fetch_add(1, std::memory_order_acq_rel);
  e->capture_began();
}

void capture_ended(fragless::Stream stream) {
  Interposer& i = ip();
  fragless::Allocator* a = i.ready.load(std::memory_order_acquire);
  if (!a) return;
  int dev = -1;
  {
    std::lock_guard lk(i.captures_mu);
    auto it = i.capturing.find(stream);
    if (it == i.capturing.end()) return;
    dev = it->second;
    i.capturing.erase(it);
  }
  i.captures.fetch_sub(1, std::memory_order_acq_rel);
  if (fragless::DeviceEngine* e = a->existing(dev)) e->capture_ended();
}

}  // namespace fragless_preload

extern "C" {

#define FRAGLESS_EXPORT __attribute__((visibility("default")))

FRAGLESS_EXPORT cudaError_t cudaMalloc(void** p, size_t size) { return allocate(p, size, nullptr, false); }

FRAGLESS_EXPORT cudaError_t cudaMallocAsync(void** p, size_t size, cudaStream_t s) { return allocate(p, size, s, true); }

// The entry points of code built with --default-stream per-thread.
FRAGLESS_EXPORT cudaError_t cudaMallocAsync_ptsz(void** p, size_t size, cudaStream_t s) {
  return allocate(p, size, s, true, true);
}

FRAGLESS_EXPORT cudaError_t cudaFree(void* p) { return free_sync(p); }

FRAGLESS_EXPORT cudaError_t cudaFreeAsync(void* p, cudaStream_t s) { return free_async(p, s, false); }

FRAGLESS_EXPORT cudaError_t cudaFreeAsync_ptsz(void* p, cudaStream_t s) { return free_async(p, s, true); }

FRAGLESS_EXPORT cudaError_t cudaStreamBeginCapture(cudaStream_t s, int mode) {
  if (!real().begin_capture) return kInvalidValue;
  capture_began(s, false);  // Note [Quiet before a capture]
  const cudaError_t r = real().begin_capture(s, mode);
  if (r != kSuccess) capture_ended(s, false);
  return r;
}

FRAGLESS_EXPORT cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t s, int mode) {
  if (!real().begin_capture_ptsz) return kInvalidValue;
  capture_began(s, true);  // Note [Quiet before a capture]
  const cudaError_t r = real().begin_capture_ptsz(s, mode);
  if (r != kSuccess) capture_ended(s, true);
  return r;
}

FRAGLESS_EXPORT cudaError_t cudaStreamBeginCaptureToGraph(cudaStream_t s, cudaGraph_t g, const void* deps,
                                                          const void* data, size_t n, int mode) {
  if (!real().begin_capture_to_graph) return kInvalidValue;
  capture_began(s, false);  // Note [Quiet before a capture]
  const cudaError_t r = real().begin_capture_to_graph(s, g, deps, data, n, mode);
  if (r != kSuccess) capture_ended(s, false);
  return r;
}

FRAGLESS_EXPORT cudaError_t cudaStreamBeginCaptureToGraph_ptsz(cudaStream_t s, cudaGraph_t g, const void* deps,
                                                               const void* data, size_t n, int mode) {
  if (!real().begin_capture_to_graph_ptsz) return kInvalidValue;
  capture_began(s, true);  // Note [Quiet before a capture]
  const cudaError_t r = real().begin_capture_to_graph_ptsz(s, g, deps, data, n, mode);
  if (r != kSuccess) capture_ended(s, true);
  return r;
}

FRAGLESS_EXPORT cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  if (!real().end_capture) return kInvalidValue;
  const cudaError_t r = real().end_capture(s, g);
  capture_ended(s, false);  // also when the capture was invalidated: it is over either way
  return r;
}

FRAGLESS_EXPORT cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t s, cudaGraph_t* g) {
  if (!real().end_capture_ptsz) return kInvalidValue;
  const cudaError_t r = real().end_capture_ptsz(s, g);
  capture_ended(s, true);
  return r;
}

// The stream is retired first, without a wait (fragless_preload::retire_stream).
FRAGLESS_EXPORT cudaError_t cudaStreamDestroy(cudaStream_t s) {
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  // A capturing stream is not retired: its destroy fails, and an event recorded on it would be a graph node.
  if (ip().ready.load(std::memory_order_acquire) && v > kStreamPerThread && !capturing(s, false))
    fragless_preload::retire_stream(v, device_of(s));
  return real().stream_destroy ? real().stream_destroy(s) : kInvalidValue;
}

// The device whose engine owns p, or -1 (for tests and curious users).
FRAGLESS_EXPORT int fragless_preload_device_of(void* p) { return owner(p); }

// fragless's own allocated and reserved bytes on a device (0 and 0 for a device it has not used); -1 when
// the interposer is off.
FRAGLESS_EXPORT int fragless_preload_memory(int device, size_t* allocated, size_t* reserved) {
  fragless::Allocator* a = ip().get();
  if (!a || !allocated || !reserved) return -1;
  *allocated = *reserved = 0;
  if (fragless::DeviceEngine* e = a->existing(device)) {
    const auto u = e->usage();
    *allocated = static_cast<size_t>(u.allocated);
    *reserved = static_cast<size_t>(u.reserved);
  }
  return 0;
}

// fragless's own peak allocated and reserved bytes on a device since the last reset: allocated_bytes.all.peak
// and reserved_bytes.all.peak of its statistics, which torch.cuda.max_memory_allocated and max_memory_reserved
// read under fragless.torch.enable() (PyTorch's own answer 0 here: its allocator is bypassed). 0 and 0 for a
// device fragless has not used; -1 when the interposer is off or the device is not one of its devices (a
// caller that named the wrong device must not read a plain 0).
FRAGLESS_EXPORT int fragless_preload_peak_memory(int device, size_t* allocated, size_t* reserved) {
  fragless::Allocator* a = ip().get();
  if (!a || !allocated || !reserved || device < 0 || device >= a->device_count()) return -1;
  *allocated = *reserved = 0;
  if (fragless::DeviceEngine* e = a->existing(device)) {
    const fragless::DeviceStats st = e->stats();
    *allocated = static_cast<size_t>(st.allocated_bytes.all().peak);
    *reserved = static_cast<size_t>(st.reserved_bytes.all().peak);
  }
  return 0;
}

// Starts every peak of the device's statistics again from its current value (torch.cuda.reset_peak_memory_stats).
// 0, or -1 when the interposer is off or the device is not one of its devices.
FRAGLESS_EXPORT int fragless_preload_reset_peak_memory(int device) {
  fragless::Allocator* a = ip().get();
  if (!a || device < 0 || device >= a->device_count()) return -1;
  if (fragless::DeviceEngine* e = a->existing(device)) e->reset_peak_stats();
  return 0;
}

// Returns once the device's background worker has no job in flight or queued (DeviceEngine::drain_background):
// for tests and tools that read the driver's free memory, which moves for a moment during a split. 0, or -1
// when the interposer is off; a device fragless has not used has nothing to wait for.
FRAGLESS_EXPORT int fragless_preload_drain(int device) {
  fragless::Allocator* a = ip().get();
  if (!a) return -1;
  if (fragless::DeviceEngine* e = a->existing(device)) e->drain_background();
  return 0;
}

FRAGLESS_EXPORT cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  if (!real().mem_get_info) return kInvalidValue;
  if (fragless_preload::reading_free_memory() || fragless_preload::recursing()) return real().mem_get_info(free_bytes, total);
  cudaError_t r = kInvalidValue;
  {
    fragless_preload::ReadingFreeMemory reading;  // the runtime's answer and error (and its set-up), no lock held
    r = real().mem_get_info(free_bytes, total);
  }
  fragless::Allocator* a = ip().get();
  fragless::DeviceEngine* e = r == kSuccess && a ? a->existing(current_device()) : nullptr;
  if (e) fragless_preload::count_cached_as_free(e, free_bytes, total);
  return r;
}

// Counters for tests and curious users: mallocs served, frees taken, frees forwarded, fences, fallbacks.
FRAGLESS_EXPORT void fragless_preload_counters(unsigned long out[5]) {
  out[0] = g_counts.mallocs;
  out[1] = g_counts.frees;
  out[2] = g_counts.forwarded_frees;
  out[3] = g_counts.fences;
  out[4] = g_counts.fallbacks;
}

// The driver half's counters: allocations it served, calls and frees it forwarded to the driver, calls that
// came back into an interposed entry point from inside fragless (Note [No recursion]; always 0).
FRAGLESS_EXPORT void fragless_preload_driver_counters(unsigned long out[3]) {
  out[0] = g_counts.driver_mallocs;
  out[1] = g_counts.driver_forwarded;
  out[2] = g_counts.recursions;
}

// Calls that came back through the driver half from a runtime call fragless forwarded (a cudaMalloc it does
// not serve is the runtime's cuMemAlloc), handed on to the driver: what shows they took that way.
FRAGLESS_EXPORT unsigned long fragless_preload_handed_on() { return g_counts.handed_on; }

}  // extern "C"
