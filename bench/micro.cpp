// Micro-benchmarks (Google Benchmark): cache-hit malloc+free pairs over a training-like size mix, one and
// two threads, for each policy; the same mix through mimalloc as the reference floor; the growth path on
// the sim driver.
#include <benchmark/benchmark.h>
#include <mimalloc.h>

#include <cstdio>
#include <malloc.h>
#include <unistd.h>
#include <atomic>
#include <new>
#include <cstdlib>
#include <memory>
#include <string>
#include <random>
#include <vector>

#include <thread>

#include "fragless/engine.h"
#include "fragless/sim_driver.h"
#include "fragless/tracer.h"
#include "replay.h"
#include "bench_common.h"
#include "workload.h"

using namespace fragless;

namespace {

using bench::size_mix;

std::unique_ptr<DeviceEngine> engine(PolicyKind p) { return bench::sim_engine(p); }

// One engine per policy, made once for every thread (a function-local static: the two threads of a
// two-thread run both ask, and made lazily per policy without a lock they raced to make it).
DeviceEngine* shared_engine(PolicyKind p) {
  static const std::unique_ptr<DeviceEngine> engines[3] = {engine(PolicyKind::classic), engine(PolicyKind::expandable),
                                                           engine(PolicyKind::fragless)};
  return engines[static_cast<int>(p)].get();
}

// Cache hits: the working set (64 live blocks) is allocated once; each iteration frees one block and
// allocates the same size again on the same stream, which best fit serves from the cache.
void BM_CacheHitPair(benchmark::State& state) {
  const auto policy = static_cast<PolicyKind>(state.range(0));
  DeviceEngine* e = shared_engine(policy);
  const auto sizes = size_mix();
  const Stream stream = static_cast<Stream>(state.thread_index() + 1);
  std::vector<void*> live(64);
  std::vector<std::size_t> live_size(64);
  for (std::size_t i = 0; i < live.size(); ++i) {
    live_size[i] = sizes[(i * 7 + static_cast<std::size_t>(state.thread_index()) * 13) % sizes.size()];
    live[i] = e->allocate(live_size[i], stream, nullptr);
  }
  std::size_t i = 0;
  for (auto _ : state) {
    const std::size_t k = i++ & 63;
    e->free(live[k]);
    live[k] = e->allocate(live_size[k], stream, nullptr);
    benchmark::DoNotOptimize(live[k]);
  }
  for (void* p : live) e->free(p);
  state.SetLabel(policy_name(policy));
}
BENCHMARK(BM_CacheHitPair)->Arg(0)->Arg(1)->Arg(2)->Threads(1)->Threads(2)->UseRealTime();

// The same cache-hit pairs with the tracer on (fragless policy), writing a real file in the temporary
// directory: the difference to BM_CacheHitPair/2 is the tracer's cost per alloc+free pair.
void BM_CacheHitPairTraced(benchmark::State& state) {
  std::string err;
  const char* tmp = std::getenv("TMPDIR");
  // Arg 0: a real file in the temporary directory (the writer thread copies ~100 bytes per pair into the
  // page cache on the other core); arg 1: /dev/null (the hot path and the hand-off only).
  const bool to_null = state.range(0) == 1;
  const std::string path = to_null ? std::string("/dev/null") : std::string(tmp && *tmp ? tmp : "/tmp") + "/fragless-bench-%p.trace";
  auto tracing = Tracing::open(path, 1, "fragless", &err);
  if (!tracing) {
    state.SkipWithError(err.c_str());
    return;
  }
  auto e = engine(PolicyKind::fragless);
  e->set_event_sink(tracing->sink(0));
  const auto sizes = size_mix();
  std::vector<void*> live(64);
  std::vector<std::size_t> live_size(64);
  for (std::size_t i = 0; i < live.size(); ++i) {
    live_size[i] = sizes[(i * 7) % sizes.size()];
    live[i] = e->allocate(live_size[i], 1, nullptr);
  }
  std::size_t i = 0;
  for (auto _ : state) {
    const std::size_t k = i++ & 63;
    e->free(live[k]);
    live[k] = e->allocate(live_size[k], 1, nullptr);
    benchmark::DoNotOptimize(live[k]);
  }
  for (void* p : live) e->free(p);
  e->flush_trace();
  const auto paths = tracing->paths();
  e.reset();
  tracing.reset();
  if (!to_null)
    for (auto& p : paths) std::remove(p.c_str());
  state.SetLabel(to_null ? "fragless, tracer on, to /dev/null" : "fragless, tracer on, to a file");
}
BENCHMARK(BM_CacheHitPairTraced)->Arg(0)->Arg(1)->UseRealTime();

// The same pairs through mimalloc, a general-purpose allocator (no floor for this mix: it hands its largest
// sizes back to the OS on every free; docs/RESULTS.md, "Micro-benchmarks").
void BM_MimallocPair(benchmark::State& state) {
  const auto sizes = size_mix();
  std::vector<void*> live(64);
  std::vector<std::size_t> live_size(64);
  for (std::size_t i = 0; i < live.size(); ++i) {
    live_size[i] = sizes[(i * 7 + static_cast<std::size_t>(state.thread_index()) * 13) % sizes.size()];
    live[i] = mi_malloc(live_size[i]);
  }
  std::size_t i = 0;
  for (auto _ : state) {
    const std::size_t k = i++ & 63;
    mi_free(live[k]);
    live[k] = mi_malloc(live_size[k]);
    benchmark::DoNotOptimize(live[k]);
  }
  for (void* p : live) mi_free(p);
  state.SetLabel("mimalloc");
}
BENCHMARK(BM_MimallocPair)->Threads(1)->Threads(2)->UseRealTime();

// Growth: every iteration builds a fresh engine and allocates the size mix once, with no frees (issue 24's
// "growth path"): about a third of the 1,024 requests grow (336 classic, 291 expandable, 344 fragless creates
// on 2026-12-06), the rest are served from what earlier growths left. So it times a first step's allocations
// on the sim driver, host bookkeeping only, and none of fragless's re-backing, lending or splitting (no
// request follows a free).
void BM_GrowthPath(benchmark::State& state) {
  const auto policy = static_cast<PolicyKind>(state.range(0));
  const auto sizes = size_mix();
  std::int64_t allocs = 0;
  for (auto _ : state) {
    auto e = engine(policy);
    for (std::size_t s : sizes) benchmark::DoNotOptimize(e->allocate(s, 0, nullptr));
    allocs += static_cast<std::int64_t>(sizes.size());
    state.PauseTiming();
    e.reset();
    state.ResumeTiming();
  }
  state.SetItemsProcessed(allocs);
  state.SetLabel(policy_name(policy));
}
BENCHMARK(BM_GrowthPath)->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);

}  // namespace

// Replay throughput (events per second, one thread) on the sim driver: a generated training run (every
// machine) and, when ../shared/data is beside the repository, the largest real dev trace.
void BM_Replay(benchmark::State& state) {
  const auto policy = static_cast<PolicyKind>(state.range(0));
  static formats::Trace workload, real;
  static std::string workload_error, real_error;
  static bool ready = false;
  if (!ready) {
    if (!replay::make_workload("workload:transformer-train:steps=40,layers=24", &workload, &workload_error))
      workload_error = "the built-in workload: " + workload_error;
    auto r = formats::load_trace(FRAGLESS_SOURCE_DIR
                                 "/../shared/data/traces/torch/cs336_wedsonlin_87b0864_results_medium_1024_training_memory_snapshot.pickle");
    if (r.ok) real = std::move(r.trace);
    else real_error = "the real trace (../shared/data beside the repository): " + r.error;
    ready = true;
  }
  const formats::Trace& t = state.range(1) ? real : workload;
  const std::string& why = state.range(1) ? real_error : workload_error;
  if (t.events.empty()) {
    state.SkipWithError((why.empty() ? std::string("no events to replay") : why).c_str());
    return;
  }
  std::uint64_t events = 0;
  for (auto _ : state) {
    const auto r = replay::replay(t, 0, policy, 0);
    if (!r.error.empty()) {
      state.SkipWithError(r.error.c_str());
      break;
    }
    events += r.events;
  }
  state.counters["events_per_second"] = benchmark::Counter(static_cast<double>(events), benchmark::Counter::kIsRate);
  state.SetLabel(std::string(policy_name(policy)) + (state.range(1) ? ", wedsonlin 1024 training" : ", transformer-train"));
}
BENCHMARK(BM_Replay)->ArgsProduct({{0, 1, 2}, {0, 1}})->Unit(benchmark::kMillisecond);

// Engine metadata per live block: heap bytes (every operator new in this process, counted below) held
// after N live 512-byte allocations on the sim driver, divided by the count.
std::atomic<std::int64_t> g_heap_bytes{0};

// Heap bytes per live block while n blocks of size(i) are live on a fresh engine of the policy.
template <class Size>
void metadata_per_block(benchmark::State& state, PolicyKind policy, std::size_t n, Size size) {
  double per_block = 0;
  for (auto _ : state) {
    auto e = engine(policy);
    std::vector<void*> live;
    live.reserve(n);
    const std::int64_t before = g_heap_bytes.load();
    for (std::size_t i = 0; i < n; ++i) live.push_back(e->allocate(size(i), 0, nullptr));
    per_block = static_cast<double>(g_heap_bytes.load() - before) / static_cast<double>(n);
    for (void* p : live) e->free(p);
  }
  state.counters["bytes_per_live_block"] = per_block;
  state.SetLabel(policy_name(policy));
}

void BM_MetadataPerLiveBlock(benchmark::State& state) {
  metadata_per_block(state, static_cast<PolicyKind>(state.range(0)), static_cast<std::size_t>(state.range(1)),
                     [](std::size_t) { return std::size_t{512}; });
}
// The address table grows at 70% of its slots: 183,000 live blocks sit just below a growth, 184,000 just
// above it, the two ends of what a small live block costs.
BENCHMARK(BM_MetadataPerLiveBlock)->ArgsProduct({{0, 1, 2}, {183000, 184000}})->Iterations(1)->Unit(benchmark::kMillisecond);

// The same for large blocks (2 MiB + 512 B and 3 MiB in turn: a segment, pages and handles each), 12,000 of
// them. Segments' page tables come from calloc, which the counting operator new does not see.
void BM_MetadataPerLargeBlock(benchmark::State& state) {
  metadata_per_block(state, static_cast<PolicyKind>(state.range(0)), 12000,
                     [](std::size_t i) { return i % 2 ? (std::size_t{2} << 20) + 512 : std::size_t{3} << 20; });
}
BENCHMARK(BM_MetadataPerLargeBlock)->Arg(0)->Arg(1)->Arg(2)->Iterations(1)->Unit(benchmark::kMillisecond);

// Counting operator new/delete for BM_MetadataPerLiveBlock: requested bytes, kept in a 16-byte header, so
// the figure does not depend on which malloc the process uses (size classes add 0-25% on top).
void* operator new(std::size_t n) {
  auto* p = static_cast<std::size_t*>(std::malloc(n + 16));
  if (!p) throw std::bad_alloc();
  *p = n;
  g_heap_bytes += static_cast<std::int64_t>(n);
  return p + 2;
}
void operator delete(void* p) noexcept {
  if (!p) return;
  auto* h = static_cast<std::size_t*>(p) - 2;
  g_heap_bytes -= static_cast<std::int64_t>(*h);
  std::free(h);
}
void operator delete(void* p, std::size_t) noexcept { operator delete(p); }
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete[](void* p) noexcept { operator delete(p); }
void operator delete[](void* p, std::size_t) noexcept { operator delete(p); }

BENCHMARK_MAIN();
