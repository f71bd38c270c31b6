// Several threads share devices: random alloc / free / record_stream / empty_cache / stats / snapshot, with
// data patterns on real host memory and the tracer on (its files read back at the end: every allocation and
// free recorded); the invariant checker at quiescent points between phases; a watchdog turns a deadlock into
// a failure with thread stacks. Run under ThreadSanitizer by the sanitizer test.
#include <atomic>
#include <barrier>
#include <cstring>
#include <filesystem>
#include <thread>
#include <unistd.h>
#include <vector>

#include "fragless/allocator.h"
#include "trace_model.h"
#include "random_ops.h"
#include "seeded_policies.h"
#include "watchdog.h"

using namespace fragless;
using namespace fragless::test;

TEST_CASE("concurrency: 8 threads on shared devices keep data and invariants intact, tracer on", "[concurrency][seeded]") {
  FRAGLESS_SEEDED_POLICIES(policy, seed, 77);
  Watchdog dog("concurrency test", 300);
  const std::string dir = (std::filesystem::temp_directory_path() / ("fragless-conc-" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  auto parsed = parse_config(std::string("driver:host,capacity_mb:256,policy:") + name(policy) + ",trace:" + dir + "/t-%d.fgt");
  REQUIRE(parsed.ok);
  std::string err;
  auto a = Allocator::create(parsed.options, 2, &err);
  REQUIRE(a);
  const std::vector<std::string> paths = a->trace_paths();
  REQUIRE(paths.size() == 2);
  constexpr unsigned kThreads = 8, kPhases = 4, kOpsPerPhase = 1000;
  std::atomic<std::uint64_t> corrupt{0}, ops{0}, bad_frees{0};  // Catch2 assertions are not thread-safe
  std::atomic<std::uint64_t> allocs[2] = {0, 0}, frees[2] = {0, 0};  // per device, for the traces
  std::atomic<int> inconsistent{0};
  // At each phase end every thread waits; the completion step checks both devices while nothing moves.
  std::barrier phase_end(kThreads, [&]() noexcept {
    for (int d = 0; d < 2; ++d)
      if (!a->device(d)->check_invariants().empty()) ++inconsistent;
  });
  auto worker = [&](unsigned t) {
    std::mt19937_64 rng(seed + t);
    std::vector<std::pair<LiveBlock, int>> live;
    for (unsigned phase = 0; phase < kPhases; ++phase) {
      for (unsigned i = 0; i < kOpsPerPhase; ++i) {
        const int r = static_cast<int>(rng() % 100);
        const int dev = static_cast<int>(rng() % 2);
        DeviceEngine* e = a->device(dev);
        if (r < 50 || live.empty()) {
          const std::size_t size = 1 + random_size(rng) / 16;
          auto* p = static_cast<char*>(e->allocate(size, t % 3, nullptr));
          if (p) {
            std::memset(p, static_cast<int>(t + 1), std::min<std::size_t>(size, 256));
            live.push_back({{p, size, t, t % 3}, dev});
            ++allocs[dev];
          }
        } else if (r < 95) {
          const std::size_t k = rng() % live.size();
          auto& [b, bdev] = live[k];
          const std::size_t n = std::min<std::size_t>(b.size, 256);
          for (std::size_t j = 0; j < n; ++j)
            if (b.ptr[j] != static_cast<char>(t + 1)) {
              ++corrupt;
              break;
            }
          if (rng() % 8 == 0) a->device(bdev)->record_stream(b.ptr, 5);
          if (a->device(bdev)->free(b.ptr) != Status::ok) ++bad_frees;
          ++frees[bdev];
          live[k] = live.back();
          live.pop_back();
        } else if (r < 97) {
          e->empty_cache();
        } else if (r < 99) {
          (void)e->stats();
        } else {
          (void)e->snapshot();
        }
        ++ops;
      }
      phase_end.arrive_and_wait();
    }
    for (auto& [b, bdev] : live) {
      if (a->device(bdev)->free(b.ptr) != Status::ok) ++bad_frees;
      ++frees[bdev];
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  CHECK(ops == kThreads * kPhases * kOpsPerPhase);
  CHECK(corrupt == 0);
  CHECK(bad_frees == 0);
  CHECK(inconsistent == 0);
  for (int d = 0; d < 2; ++d) {
    require_consistent(*a->device(d));
    CHECK(a->device(d)->stats().allocation.all().current == 0);
    a->device(d)->empty_cache();
    CHECK(reserved(*a->device(d)) == 0);
  }
  a.reset();  // flushes the traces
  // The tracer saw every allocation and every free of its device, in order: each free pairs with an earlier
  // allocation of its address (the reader refuses one that does not), and the counts balance.
  for (int d = 0; d < 2; ++d) {
    auto r = formats::load_trace(paths[static_cast<std::size_t>(d)]);
    INFO(paths[static_cast<std::size_t>(d)] << ": " << r.error << r.warning);
    REQUIRE(r.ok);
    CHECK(r.warning.empty());
    CHECK(r.trace.seed.empty());  // nothing was live before the trace began
    std::uint64_t n_alloc = 0, n_free = 0, other_device = 0;
    for (const auto& ev : r.trace.events) {
      n_alloc += ev.op == formats::Op::alloc;
      n_free += ev.op == formats::Op::free;
      other_device += ev.device != d;
    }
    CHECK(allocs[d] > 1000);
    CHECK(n_alloc == allocs[d]);
    CHECK(n_free == frees[d]);
    CHECK(n_free == n_alloc);
    CHECK(other_device == 0);
  }
  std::filesystem::remove_all(dir);
}
