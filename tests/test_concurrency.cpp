// Several threads share one device: random alloc / free / record_stream / empty_cache / stats / snapshot,
// with data patterns on real host memory, then the invariant checker at the quiescent end.
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "random_ops.h"

using namespace fragless;
using namespace fragless::test;

TEST_CASE("concurrency: 8 threads on one device keep data and invariants intact", "[concurrency]") {
  const PolicyKind policy = GENERATE(PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless);
  CAPTURE(name(policy));
  EngineSpec spec;
  spec.policy = policy;
  spec.driver = DriverKind::host;
  spec.capacity = 256 * MiB;
  auto e = make_engine(spec);
  std::atomic<std::uint64_t> corrupt{0}, ops{0}, bad_frees{0};  // Catch2 assertions are not thread-safe
  auto worker = [&](unsigned t) {
    std::mt19937_64 rng(test_seed(77) + t);
    std::vector<LiveBlock> live;
    for (int i = 0; i < 4000; ++i) {
      const int r = static_cast<int>(rng() % 100);
      if (r < 50 || live.empty()) {
        const std::size_t size = 1 + random_size(rng) / 16;
        auto* p = static_cast<char*>(e->allocate(size, t % 3, nullptr));
        if (p) {
          std::memset(p, static_cast<int>(t + 1), std::min<std::size_t>(size, 256));
          live.push_back({p, size, t, t % 3});
        }
      } else if (r < 95) {
        const std::size_t k = rng() % live.size();
        const std::size_t n = std::min<std::size_t>(live[k].size, 256);
        for (std::size_t j = 0; j < n; ++j)
          if (live[k].ptr[j] != static_cast<char>(t + 1)) {
            ++corrupt;
            break;
          }
        if (rng() % 8 == 0) e->record_stream(live[k].ptr, 5);
        if (e->free(live[k].ptr) != Status::ok) ++bad_frees;
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
    for (auto& b : live) e->free(b.ptr);
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 8; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  CHECK(ops == 8 * 4000);
  CHECK(corrupt == 0);
  CHECK(bad_frees == 0);
  require_consistent(*e);
  CHECK(e->stats().allocation.all().current == 0);
  e->empty_cache();
  CHECK(reserved(*e) == 0);
}
