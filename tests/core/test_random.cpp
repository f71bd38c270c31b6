// Randomized operations, with the invariant checker after every one.
#include "random_ops.h"
#include "seeded_policies.h"

using namespace fragless;
using namespace fragless::test;

TEST_CASE("randomized: 100,000 operations per policy keep every invariant", "[random][seeded]") {
  FRAGLESS_SEEDED_POLICIES(policy, seed, 0xf7a61e55);
  EngineSpec spec;
  spec.policy = policy;
  spec.capacity = 384 * MiB;
  spec.base.max_split_size = GENERATE(SIZE_MAX, std::size_t{24} << 20);
  CAPTURE(spec.base.max_split_size);
  auto e = make_engine(spec);
  TestEvents* ev = test_events_of(e->driver());
  std::mt19937_64 rng(seed);
  std::vector<LiveBlock> live;
  std::uint64_t ooms = 0, retirements = 0;
  constexpr int kOps = 50000;  // x2 max_split_size settings = 100,000 per policy
  for (int op = 0; op < kOps; ++op) {
    const int r = static_cast<int>(rng() % 100);
    if (r < 52 || live.empty()) {
      const std::size_t size = random_size(rng);
      const Stream st = rng() % 3;
      AllocError err;
      void* p = e->allocate(size, st, &err);
      if (!p) {
        REQUIRE(err.status == Status::out_of_memory);
        ++ooms;
      } else {
        live.push_back({static_cast<char*>(p), size, static_cast<std::uint64_t>(op), st});
      }
    } else if (r < 92) {
      const std::size_t i = rng() % live.size();
      if (rng() % 8 == 0) {
        // Used on a side stream; freed by a later step, which a retirement of that stream may come before.
        REQUIRE(e->record_stream(live[i].ptr, 3 + rng() % 2) == Status::ok);
      } else {
        REQUIRE(e->free(live[i].ptr) == Status::ok);
        live[i] = live.back();
        live.pop_back();
      }
    } else if (r < 96) {
      const Stream st = rng() % 5;  // allocation streams too: fragless's lending events stay pending
      const auto what = rng() % 4;
      if (what == 3 && st >= 1) {
        // A stream destroyed, its work (held or not) still to come (Note [Destroyed streams]): blocks it still
        // uses wait, listed, at their free; a later allocation or record_stream on the value names a new
        // stream with it (an allocation stream's free blocks, holes and splits meanwhile go by its event).
        REQUIRE(e->retire_stream(st) == Status::ok);
        ++retirements;
      } else if (what % 2) {
        ev->hold(st);
      } else {
        ev->complete(st);
      }
    } else if (r < 97) {
      e->empty_cache();
    } else if (r < 98) {
      e->set_memory_fraction(rng() % 2 ? 1.0 : 0.75);
    } else {
      (void)e->snapshot();
    }
    const std::string err = e->check_invariants();
    if (!err.empty()) {
      INFO("operation " << op << ": " << err);
      REQUIRE(err.empty());
    }
  }
  CHECK(ooms > 0);  // the walk reached the capacity and recovered
  CHECK(retirements > 0);
  for (auto& b : live) REQUIRE(e->free(b.ptr) == Status::ok);
  for (Stream st = 0; st < 5; ++st) ev->complete(st);
  e->empty_cache();
  CHECK(reserved(*e) == 0);
  require_consistent(*e);
}
