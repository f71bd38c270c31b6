// Drives build/lib/libfragless.so exactly as PyTorch's CUDAPluggableAllocator does: dlopen, symbols looked
// up by name, the allocation functions and every hook called through plain function pointers, on the
// libcuda test double, with the tracer on (both devices into one file). At exit it checks what the library's
// exit handler leaves: no thread, and a trace that holds the frees made after that handler, as a static
// destructor's would be (Note [Tracing at exit]). Usage: fragless-capi-harness LIBFRAGLESS LIBFAKECUDA
#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fake_cuda.h"
#include "os_probes.h"
#include "pickle.h"
#include "trace_model.h"

namespace {

int failures = 0;
#define EXPECT(cond)                                                        \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                           \
    }                                                                       \
  } while (0)

struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct PoolId { unsigned long long first, second; };

template <typename F>
F sym(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (!p) {
    std::fprintf(stderr, "FAIL: libfragless.so does not export %s\n", name);
    std::exit(1);
  }
  return reinterpret_cast<F>(p);
}

cudaStream_t stream(std::uintptr_t v) { return reinterpret_cast<cudaStream_t>(v); }

// The exit handlers below are registered before libfragless.so's own (its first call registers it), so they
// run after it, in this order: free_after_fragless, then check_threads_at_exit.
int g_threads_seen = 0;  // the most threads seen while the checks ran: the worker must have run
using os_probes::thread_count;

// One block per device, still live when main returns, freed after fragless's exit handler has run.
void (*g_free)(void*, size_t, int, cudaStream_t) = nullptr;
void* g_last[2] = {nullptr, nullptr};
const size_t kLastSize = 1 << 20;
void free_after_fragless() {
  for (int dev = 0; dev < 2; ++dev)
    if (g_last[dev]) g_free(g_last[dev], kLastSize, dev, stream(0x100 + static_cast<std::uintptr_t>(dev) * 0x1000));
}

// The trace file (both devices) and its folder, removed when the checks pass.
std::string g_trace_dir;
std::string g_trace_path;

// The trace holds every free, the ones made after fragless's exit handler included: on each device as many
// frees as allocations (everything was freed), and the last free is the block freed last.
bool trace_complete() {
  const auto r = fragless::formats::load_trace(g_trace_path);
  if (!r.ok || !r.warning.empty()) {
    std::fprintf(stderr, "FAIL: the trace %s: %s%s\n", g_trace_path.c_str(), r.error.c_str(), r.warning.c_str());
    return false;
  }
  bool ok = true;
  for (int dev = 0; dev < 2; ++dev) {
    std::size_t allocs = 0, frees = 0;
    std::uint64_t last_free = 0;
    for (const auto& e : r.trace.events) {
      if (e.device != dev) continue;
      allocs += e.op == fragless::formats::Op::alloc;
      if (e.op == fragless::formats::Op::free) ++frees, last_free = e.address;
    }
    const auto want = reinterpret_cast<std::uint64_t>(g_last[dev]);
    std::fprintf(stderr, "trace, device %d: %zu allocations, %zu frees, the last at 0x%llx (freed at exit: 0x%llx)\n",
                 dev, allocs, frees, static_cast<unsigned long long>(last_free), static_cast<unsigned long long>(want));
    if (allocs == 0 || frees != allocs || last_free != want) {
      std::fprintf(stderr, "FAIL: device %d's trace lacks frees: the ones after the exit handler were not written\n", dev);
      ok = false;
    }
  }
  return ok;
}

// Last: the background workers and the tracer's writers are stopped, and this process is down to its one
// thread (a worker left running raced the driver's teardown and made LeakSanitizer's tracer crash reading
// its thread-local storage); the trace is whole.
void check_threads_at_exit() {
  // A thread just joined may still be listed for a moment (the kernel wakes the joiner before it has
  // removed the thread): up to 2 s for it to go.
  int n = thread_count();
  for (int i = 0; i < 2000 && n != 1; ++i, n = thread_count()) usleep(1000);
  if (n != 1)
    std::fprintf(stderr, "FAIL: %d threads still running at exit (a background worker or a trace writer was not "
                 "stopped)\n", n);
  else
    std::fprintf(stderr, "at exit: 1 thread (%d while the checks ran)\n", g_threads_seen);
  // (When main failed before its last blocks, it said why; the trace is not checked.)
  const bool trace_ok = !g_last[0] || !g_last[1] || trace_complete();
  if (n != 1 || !trace_ok) _exit(1);  // the trace is left to look at
  if (g_trace_dir.empty()) return;
  unlink(g_trace_path.c_str());
  rmdir(g_trace_dir.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0))
    return std::printf("usage: fragless-capi-harness LIBFRAGLESS LIBFAKECUDA\n"
                       "  drives libfragless.so through dlopen exactly as PyTorch's CUDAPluggableAllocator does, on\n"
                       "  the libcuda double, with the tracer on (a temporary file); at exit, checks that no thread is\n"
                       "  left and that the trace holds the frees made after the library's exit handler; exit 0 when\n"
                       "  every check passes\n"), 0;
  if (argc != 3) return std::fprintf(stderr, "usage: fragless-capi-harness LIBFRAGLESS LIBFAKECUDA\n"), 2;
  setenv("FRAGLESS_LIBCUDA", argv[2], 1);
  const char* tmp = std::getenv("TMPDIR");
  g_trace_dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/fragless-capi-XXXXXX";
  if (!mkdtemp(g_trace_dir.data())) return std::fprintf(stderr, "FAIL: mkdtemp: %s\n", std::strerror(errno)), 1;
  g_trace_path = g_trace_dir + "/capi.fgt";  // no %d: one file for both devices
  const char* conf = std::getenv("FRAGLESS_CONF");
  setenv("FRAGLESS_CONF", ((conf && *conf ? std::string(conf) + "," : std::string()) + "trace:" + g_trace_path).c_str(), 1);
  std::atexit(check_threads_at_exit);
  std::atexit(free_after_fragless);
  void* fake = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!fake || !lib) return std::fprintf(stderr, "FAIL: dlopen: %s\n", dlerror()), 1;
  auto hold = sym<decltype(&fakecuda_hold_stream)>(fake, "fakecuda_hold_stream");
  auto census = sym<decltype(&fakecuda_get_census)>(fake, "fakecuda_get_census");

  // The names and types PyTorch's hooks use.
  auto malloc_fn = sym<void* (*)(size_t, int, cudaStream_t)>(lib, "fragless_malloc");
  auto free_fn = sym<void (*)(void*, size_t, int, cudaStream_t)>(lib, "fragless_free");
  auto pool_malloc_fn = sym<void* (*)(size_t, int, cudaStream_t)>(lib, "fragless_pool_malloc");
  auto init_fn = sym<void (*)(int)>(lib, "fragless_init");
  auto reset_fn = sym<void (*)()>(lib, "fragless_empty_cache");
  auto fraction_fn = sym<void (*)(double, int)>(lib, "fragless_set_memory_fraction");
  auto base_fn = sym<void* (*)(void*, size_t*)>(lib, "fragless_get_base_allocation");
  auto record_fn = sym<void (*)(void*, cudaStream_t)>(lib, "fragless_record_stream");
  auto begin_pool = sym<void (*)(int, PoolId, std::function<bool(cudaStream_t)>)>(lib, "fragless_begin_allocate_to_pool");
  auto end_pool = sym<void (*)(int, PoolId)>(lib, "fragless_end_allocate_to_pool");
  auto release_pool = sym<void (*)(int, PoolId)>(lib, "fragless_release_pool");
  auto stats_fn = sym<long (*)(int, char*, size_t)>(lib, "fragless_memory_stats");
  auto snapshot_fn = sym<long (*)(char*, size_t)>(lib, "fragless_snapshot");
  auto history_fn = sym<void (*)(size_t)>(lib, "fragless_record_history");
  auto last_error = sym<const char* (*)()>(lib, "fragless_last_error");
  auto count_fn = sym<int (*)()>(lib, "fragless_device_count");
  g_free = free_fn;

  init_fn(2);
  EXPECT(count_fn() == 2);
  history_fn(10000);
  // No device's context is retained before that device is used (PyTorch's lazy per-device state).
  fakecuda_census c0{};
  census(&c0);
  EXPECT(c0.context_retains == 0);

  // A multi-stream workload on both devices, with cross-stream use and empty_cache.
  // A stream belongs to one device (the double refuses an event of one device's context recorded on another's
  // stream, as CUDA does): device d's streams are 0x100, 0x200, 0x300 plus d * 0x1000.
  auto adopt = sym<decltype(&fakecuda_adopt_stream)>(fake, "fakecuda_adopt_stream");
  auto on = [](int dev, std::uintptr_t v) { return stream(v + static_cast<std::uintptr_t>(dev) * 0x1000); };
  for (int dev = 0; dev < 2; ++dev)
    for (std::uintptr_t v : {0x100, 0x200, 0x300}) EXPECT(adopt(on(dev, v), dev) == 1);
  const cudaStream_t s1 = on(0, 0x100), s2 = on(0, 0x200), s3 = on(0, 0x300);
  // Each block is filled with its own byte (the memory is real on the double) and read back whole before
  // it is freed: two live blocks that share memory fail.
  struct Live { unsigned char* p; size_t size; unsigned char pattern; };
  std::size_t corrupt = 0;
  auto intact = [&](const Live& b) {
    for (size_t k = 0; k < b.size; ++k)
      if (b.p[k] != b.pattern) return false;
    return true;
  };
  for (int dev = 0; dev < 2; ++dev) {
    const cudaStream_t s1 = on(dev, 0x100), s2 = on(dev, 0x200), s3 = on(dev, 0x300);
    std::vector<Live> live;
    for (int i = 0; i < 200; ++i) {
      const size_t size = (i % 5 == 0) ? (size_t{1} + i % 7) << 20 : 512 * (1 + (i * 37) % 900);
      auto* p = static_cast<unsigned char*>(malloc_fn(size, dev, i % 2 ? s1 : s2));
      EXPECT(p != nullptr);
      if (!p) continue;
      const auto pattern = static_cast<unsigned char>(1 + i % 255);  // unique among the live blocks
      std::memset(p, pattern, size);
      if (i % 7 == 0) record_fn(p, s3);
      live.push_back({p, size, pattern});
      if (i % 3 == 2) {
        corrupt += !intact(live.front());
        free_fn(live.front().p, live.front().size, dev, i % 2 ? s1 : s2);
        live.erase(live.begin());
      }
      if (i == 100) reset_fn();
    }
    for (auto& b : live) {
      corrupt += !intact(b);
      free_fn(b.p, b.size, dev, s1);
    }
  }
  EXPECT(corrupt == 0);

  // record_stream: a block used on a held stream is not reused until that stream's work is done.
  hold(s3, 1);
  void* a = malloc_fn(4 << 20, 0, s1);
  record_fn(a, s3);
  free_fn(a, 4 << 20, 0, s1);
  void* b = malloc_fn(4 << 20, 0, s1);
  EXPECT(b != a);
  hold(s3, 0);
  free_fn(b, 4 << 20, 0, s1);

  // Base allocation of a block fragless owns.
  void* c = malloc_fn(3 << 20, 1, on(1, 0x200));
  size_t base_size = 0;
  EXPECT(base_fn(c, &base_size) != nullptr);
  EXPECT(base_size >= (3u << 20));
  free_fn(c, 3 << 20, 1, on(1, 0x200));

  // Private pools (CUDA graph capture / MemPool).
  begin_pool(0, {1, 1}, [&](cudaStream_t s) { return s == s2; });
  void* d = malloc_fn(1 << 20, 0, s2);
  end_pool(0, {1, 1});
  EXPECT(d != nullptr);
  free_fn(d, 1 << 20, 0, s2);
  release_pool(0, {1, 1});

  // torch.cuda.graph, as PyTorch drives it: the capture begins on s2, allocations on s2 are routed to the
  // graph's pool, the capture ends, the routing ends, and the pool is released later. The capture must not be
  // invalidated (no event query, synchronisation or release inside it), and nothing may leak.
  {
    using Retain = int (*)(void**, int);
    using Push = int (*)(void*);
    using Pop = int (*)(void**);
    using Begin = int (*)(void*, int);
    using End = int (*)(void*, void**);
    auto retain = sym<Retain>(fake, "cuDevicePrimaryCtxRetain");
    auto ctx_release = sym<int (*)(int)>(fake, "cuDevicePrimaryCtxRelease_v2");
    auto push = sym<Push>(fake, "cuCtxPushCurrent_v2");
    auto pop = sym<Pop>(fake, "cuCtxPopCurrent_v2");
    auto begin_capture = sym<Begin>(fake, "cuStreamBeginCapture_v2");
    auto end_capture = sym<End>(fake, "cuStreamEndCapture");
    void* ctx = nullptr;
    EXPECT(retain(&ctx, 0) == 0 && push(ctx) == 0);  // the capturing thread has device 0 current
    hold(s3, 1);
    EXPECT(begin_capture(s2, 0 /* CU_STREAM_CAPTURE_MODE_GLOBAL */) == 0);
    begin_pool(0, {2, 2}, [&](cudaStream_t s) { return s == s2; });
    std::vector<void*> graph_blocks;
    for (int i = 0; i < 10; ++i) {
      void* g = malloc_fn((size_t{1} + i) << 20, 0, s2);
      EXPECT(g != nullptr);
      if (i % 2) {
        record_fn(g, s3);  // used on another stream: the free waits for the end of the capture
        free_fn(g, (size_t{1} + i) << 20, 0, s2);
      } else {
        graph_blocks.push_back(g);
      }
      void* other = malloc_fn(256 << 10, 0, s1);  // meanwhile, another stream allocates as usual
      free_fn(other, 256 << 10, 0, s1);
    }
    reset_fn();  // torch.cuda.empty_cache() during a capture releases nothing
    void* graph = nullptr;
    EXPECT(end_capture(s2, &graph) == 0 && graph != nullptr);  // not invalidated
    end_pool(0, {2, 2});
    hold(s3, 0);
    for (void* g : graph_blocks) free_fn(g, 0, 0, s2);
    release_pool(0, {2, 2});
    void* popped = nullptr;
    EXPECT(pop(&popped) == 0 && popped == ctx && ctx_release(0) == 0);
    fakecuda_census cc{};
    census(&cc);
    EXPECT(cc.invalidated_captures == 0 && cc.faults == 0);
  }

  // PyTorch 2.1 and 2.2's graph hooks, which name the capture's stream and not a filter:
  // fragless_begin_allocate_stream_to_pool(device, stream, pool), called before cudaStreamBeginCapture, and
  // fragless_end_allocate_stream_to_pool(device, stream), after cudaStreamEndCapture. Two graphs share one pool
  // (torch.cuda.graph(g3, pool=g2.pool())) and are captured at once, on s2 and s3: each stream's allocations,
  // and only theirs, come from the pool, and each end takes away its own stream's routing (Note [Routing by
  // stream]). The pool is the one each block's segment names in a snapshot.
  {
    auto begin_stream = sym<void (*)(int, cudaStream_t, PoolId)>(lib, "fragless_begin_allocate_stream_to_pool");
    auto end_stream = sym<void (*)(int, cudaStream_t)>(lib, "fragless_end_allocate_stream_to_pool");
    auto retain = sym<int (*)(void**, int)>(fake, "cuDevicePrimaryCtxRetain");
    auto ctx_release = sym<int (*)(int)>(fake, "cuDevicePrimaryCtxRelease_v2");
    auto push = sym<int (*)(void*)>(fake, "cuCtxPushCurrent_v2");
    auto pop = sym<int (*)(void**)>(fake, "cuCtxPopCurrent_v2");
    auto begin_capture = sym<int (*)(void*, int)>(fake, "cuStreamBeginCapture_v2");
    auto end_capture = sym<int (*)(void*, void**)>(fake, "cuStreamEndCapture");
    auto pool_of = [&](void* p) {  // the pool of the segment that holds p; {~0, ~0} when none does
      PoolId id{~0ull, ~0ull};
      const long need = snapshot_fn(nullptr, 0);
      std::string snap(static_cast<size_t>(need > 0 ? need : 0) + 1, '\0');
      if (need <= 0 || snapshot_fn(snap.data(), snap.size()) != need) return id;
      snap.resize(static_cast<size_t>(need));
      auto pr = fragless::formats::read_pickle(snap);
      const auto* segs = pr.value ? pr.value->get("segments") : nullptr;
      const auto at = reinterpret_cast<std::uint64_t>(p);
      for (std::size_t i = 0; segs && i < segs->items.size(); ++i) {
        const auto& seg = segs->items[i];
        const std::uint64_t base = seg->get("address")->as_uint(), size = seg->get("total_size")->as_uint();
        const auto* pool = seg->get("segment_pool_id");
        if (at >= base && at < base + size && pool && pool->items.size() == 2)
          id = {pool->items[0]->as_uint(), pool->items[1]->as_uint()};
      }
      return id;
    };
    auto in = [](PoolId a, PoolId b) { return a.first == b.first && a.second == b.second; };
    const PoolId shared{3, 0}, none{0, 0};
    void* ctx = nullptr;
    EXPECT(retain(&ctx, 0) == 0 && push(ctx) == 0);
    begin_stream(0, s2, shared);
    EXPECT(std::string(last_error()).empty());
    EXPECT(begin_capture(s2, 0 /* CU_STREAM_CAPTURE_MODE_GLOBAL */) == 0);
    begin_stream(0, s3, shared);  // a second graph, sharing the first one's pool
    EXPECT(begin_capture(s3, 0) == 0);
    void* g2 = malloc_fn(2 << 20, 0, s2);
    void* g3 = malloc_fn(2 << 20, 0, s3);
    void* other = malloc_fn(2 << 20, 0, s1);  // a stream no capture routes: the default pool
    EXPECT(g2 && g3 && other);
    EXPECT(in(pool_of(g2), shared));
    EXPECT(in(pool_of(g3), shared));
    EXPECT(in(pool_of(other), none));
    free_fn(g2, 2 << 20, 0, s2);  // freed during the capture: the graph's memory, never the default pool's
    void* graph = nullptr;
    EXPECT(end_capture(s2, &graph) == 0 && graph != nullptr);
    end_stream(0, s2);  // s2's routing ends, not s3's (the pool's newest)
    EXPECT(std::string(last_error()).empty());
    void* after2 = malloc_fn(2 << 20, 0, s2);
    void* still3 = malloc_fn(1 << 20, 0, s3);
    EXPECT(after2 && after2 != g2 && in(pool_of(after2), none));
    EXPECT(in(pool_of(still3), shared));
    EXPECT(end_capture(s3, &graph) == 0 && graph != nullptr);
    end_stream(0, s3);
    EXPECT(std::string(last_error()).empty());
    void* after3 = malloc_fn(1 << 20, 0, s3);
    EXPECT(in(pool_of(after3), none));
    // An end with no begin (s3's is over) changes nothing and is reported; so is a device fragless lacks.
    end_stream(0, s3);
    EXPECT(std::string(last_error()).find("allocates to no pool") != std::string::npos);
    end_stream(9, s3);
    EXPECT(std::string(last_error()).find("invalid device 9") != std::string::npos);
    begin_stream(9, s3, shared);
    EXPECT(std::string(last_error()).find("invalid device 9") != std::string::npos);
    for (auto [p, st] : {std::pair{g3, s3}, {still3, s3}, {after2, s2}, {after3, s3}, {other, s1}}) free_fn(p, 0, 0, st);
    release_pool(0, shared);  // g2's graph: g3's still holds the pool
    release_pool(0, shared);
    void* popped = nullptr;
    EXPECT(pop(&popped) == 0 && popped == ctx && ctx_release(0) == 0);
    fakecuda_census cc{};
    census(&cc);
    EXPECT(cc.invalidated_captures == 0 && cc.faults == 0);
  }

  // Stats with PyTorch's names.
  char buf[16384];
  const long n = stats_fn(0, buf, sizeof buf);
  EXPECT(n > 0 && n < static_cast<long>(sizeof buf));
  const std::string stats(buf);
  EXPECT(stats.find("\"allocated_bytes.all.current\":0") != std::string::npos);
  EXPECT(stats.find("\"reserved_bytes.all.peak\":") != std::string::npos);
  EXPECT(stats.find("\"num_alloc_retries\":") != std::string::npos);
  EXPECT(stats_fn(7, buf, sizeof buf) == -1);
  EXPECT(std::string(last_error()).find("invalid device 7") != std::string::npos);

  // A sizing call keeps the snapshot it built for this thread's next call with a buffer, which returns it as it
  // was sized: not one built anew after the allocation in between (whose history has an event more).
  {
    const long sized = snapshot_fn(nullptr, 0);
    void* between = malloc_fn(1 << 20, 0, s1);
    std::string kept(static_cast<size_t>(sized) + 1, '\0');
    EXPECT(snapshot_fn(kept.data(), kept.size()) == sized);
    EXPECT(snapshot_fn(nullptr, 0) > sized);  // a new sizing call builds anew: the allocation is in it
    free_fn(between, 1 << 20, 0, s1);
  }

  // A snapshot in PyTorch's layout, with the recorded history as device_traces.
  void* e = malloc_fn(5 << 20, 0, s1);
  const long need = snapshot_fn(nullptr, 0);
  EXPECT(need > 0);
  std::string snap(static_cast<size_t>(need) + 1, '\0');
  EXPECT(snapshot_fn(snap.data(), snap.size()) == need);
  snap.resize(static_cast<size_t>(need));
  auto pr = fragless::formats::read_pickle(snap);
  EXPECT(pr.value != nullptr);
  if (pr.value) {
    const auto* segs = pr.value->get("segments");
    const auto* traces = pr.value->get("device_traces");
    EXPECT(segs && !segs->items.empty());
    EXPECT(traces && traces->items.size() == 2);
    std::size_t live_blocks = 0, allocs = 0;
    if (segs)
      for (auto& s : segs->items) {
        std::int64_t sum = 0;
        for (auto& blk : s->get("blocks")->items) {
          sum += blk->get("size")->as_int();
          live_blocks += blk->get("state")->s == "active_allocated";
        }
        EXPECT(sum == s->get("total_size")->as_int());
      }
    if (traces)
      for (auto& ev : traces->items[0]->items) allocs += ev->get("action")->s == "alloc";
    EXPECT(live_blocks == 1);
    EXPECT(allocs > 100);
  }
  free_fn(e, 5 << 20, 0, s1);

  // Size 0 is legal: NULL, no exception.
  bool threw = false;
  try {
    EXPECT(malloc_fn(0, 0, s1) == nullptr);
  } catch (...) {
    threw = true;
  }
  EXPECT(!threw);

  // Out of memory reaches the caller as an exception carrying the diagnosis, never as a bare NULL.
  fraction_fn(0.25, 0);  // 256 MiB of the double's 1024
  std::string oom;
  try {
    void* big = malloc_fn(600u << 20, 0, s1);
    EXPECT(big == nullptr);  // not reached
  } catch (const std::runtime_error& ex) {
    oom = ex.what();
  }
  std::fprintf(stderr, "OOM as raised: %s\n", oom.c_str());
  // PyTorch's first sentence, word for word (tools match it), then fragless's diagnosis.
  EXPECT(oom.rfind("CUDA out of memory. Tried to allocate 600.00 MiB. GPU 0 has a total capacity of ", 0) == 0);
  EXPECT(oom.find("fragless") != std::string::npos);
  // The MemPool entry point returns NULL instead (PyTorch's pool path retries and raises OutOfMemoryError),
  // with the same diagnosis in fragless_last_error.
  threw = false;
  try {
    EXPECT(pool_malloc_fn(600u << 20, 0, s1) == nullptr);
  } catch (...) {
    threw = true;
  }
  EXPECT(!threw);
  EXPECT(std::string(last_error()).rfind("CUDA out of memory. Tried to allocate", 0) == 0);
  fraction_fn(1.0, 0);
  void* after = malloc_fn(600u << 20, 0, s1);  // usable again
  EXPECT(after != nullptr);
  free_fn(after, 600u << 20, 0, s1);

  // A bad free is reported, changes nothing and does not crash.
  int local = 0;
  free_fn(&local, 4, 0, s1);
  EXPECT(std::string(last_error()).find("did not allocate") != std::string::npos);

  // Everything back after empty_cache.
  g_threads_seen = thread_count();
  reset_fn();
  fakecuda_census cs{};
  census(&cs);
  std::fprintf(stderr, "after empty_cache: %ld handles, %ld mappings, %zu bytes\n", cs.handles, cs.mappings, cs.used_bytes);
  EXPECT(cs.handles == 0 && cs.mappings == 0 && cs.used_bytes == 0);
  EXPECT(cs.faults == 0 && cs.invalidated_captures == 0);
  EXPECT(cs.context_retains == 2);  // one per device used, held for the process's life

  EXPECT(g_threads_seen > 2);  // a background worker ran beside the trace's writer: the exit check means something

  // Live when main returns: freed by free_after_fragless, after libfragless.so's exit handler.
  for (int dev = 0; dev < 2; ++dev) EXPECT((g_last[dev] = malloc_fn(kLastSize, dev, on(dev, 0x100))) != nullptr);
  if (failures) return std::fprintf(stderr, "%d check(s) failed\n", failures), 1;
  std::printf("libfragless.so driven as PyTorch does: all checks passed\n");
  return 0;
}
