// The PyTorch devlog fragmentation cases (reference/real-data.md §8): exact reserved figures for classic
// and expandable, and fragless never above expandable.
#include <vector>

#include "helpers.h"

using namespace fragless;
using namespace fragless::test;

namespace {

struct Case {
  const char* name;
  std::vector<std::size_t> first;   // allocated, then all freed (if second is non-empty)
  std::vector<std::size_t> second;  // allocated after the free
};

const Case kCases[] = {
    {"8x16 MiB, free, 4x32 MiB", std::vector<std::size_t>(8, 16 * MiB), std::vector<std::size_t>(4, 32 * MiB)},
    {"4x32 MiB, free, 8x16 MiB", std::vector<std::size_t>(4, 32 * MiB), std::vector<std::size_t>(8, 16 * MiB)},
    {"2 MiB then 0.5 MiB", {2 * MiB, MiB / 2}, {}},
    {"2 MiB then 2 MiB", {2 * MiB, 2 * MiB}, {}},
};

// Reserved after each phase: {after first round, at the end}.
std::pair<std::int64_t, std::int64_t> run(const Case& c, PolicyKind p, DriverKind d) {
  EngineSpec spec;
  spec.policy = p;
  spec.driver = d;
  auto e = make_engine(spec);
  std::vector<void*> ptrs;
  for (auto s : c.first) {
    void* ptr = e->allocate(s, 0, nullptr);
    REQUIRE(ptr);
    ptrs.push_back(ptr);
  }
  const auto after_first = reserved(*e);
  if (!c.second.empty()) {
    for (void* ptr : ptrs) REQUIRE(e->free(ptr) == Status::ok);
    for (auto s : c.second) REQUIRE(e->allocate(s, 0, nullptr));
  }
  require_consistent(*e);
  return {after_first, reserved(*e)};
}

}  // namespace

TEST_CASE("oracle: classic reproduces PyTorch's native reserved figures", "[oracle]") {
  for (DriverKind d : {DriverKind::sim, DriverKind::host}) {
    CAPTURE(driver_kind_name(d));
    CHECK(run(kCases[0], PolicyKind::classic, d).second == 256 * MiB);
    CHECK(run(kCases[1], PolicyKind::classic, d).first == 128 * MiB);
    CHECK(run(kCases[1], PolicyKind::classic, d).second == 128 * MiB);
    CHECK(run(kCases[2], PolicyKind::classic, d).second == 22 * MiB);
    CHECK(run(kCases[3], PolicyKind::classic, d).second == 20 * MiB);
  }
}

TEST_CASE("oracle: expandable maps 140 MiB and nothing new for the 32 MiB round", "[oracle]") {
  for (DriverKind d : {DriverKind::sim, DriverKind::host}) {
    CAPTURE(driver_kind_name(d));
    auto [first, end] = run(kCases[0], PolicyKind::expandable, d);
    CHECK(first == 140 * MiB);
    CHECK(end == 140 * MiB);
    CHECK(run(kCases[2], PolicyKind::expandable, d).second == 22 * MiB);
    CHECK(run(kCases[3], PolicyKind::expandable, d).second == 20 * MiB);
  }
}

TEST_CASE("oracle: fragless never reserves more than expandable, and less where pages allow", "[oracle]") {
  for (const Case& c : kCases) {
    CAPTURE(c.name);
    const auto ex = run(c, PolicyKind::expandable, DriverKind::sim);
    const auto fr = run(c, PolicyKind::fragless, DriverKind::sim);
    CHECK(fr.first <= ex.first);
    CHECK(fr.second <= ex.second);
  }
  // 8x16 MiB is exactly 64 pages of 2 MiB: no page is wasted.
  CHECK(run(kCases[0], PolicyKind::fragless, DriverKind::sim).second == 128 * MiB);
  CHECK(run(kCases[2], PolicyKind::fragless, DriverKind::sim).second == 4 * MiB);
}

// From a review of the peers' models against PyTorch's CUDACachingAllocator.cpp (docs/RELIABILITY.md, "Hostile
// reviews (2026-12-06, fourth)").
TEST_CASE("oracle: expandable creates a growth's pages before mapping any, and a failed create maps nothing",
          "[oracle]") {
  // ExpandableSegment::map: every handle is created first; one create failing releases those made and
  // returns. The model used to create and map page by page, counting maps and unmaps PyTorch never makes.
  EngineSpec spec;
  spec.policy = PolicyKind::expandable;
  spec.capacity = 100 * MiB;  // five 20 MiB pages
  spec.base.background = BackgroundMode::off;
  auto e = make_engine(spec);
  void* a = e->allocate(30 * MiB, 0, nullptr);  // two pages
  REQUIRE(a);
  const DriverCounters before = e->driver().counters();
  CHECK(e->allocate(70 * MiB, 1, nullptr) == nullptr);  // four pages on another stream: the fourth create fails
  const DriverCounters after = e->driver().counters();
  CHECK(after[DriverCall::map] == before[DriverCall::map]);
  CHECK(after[DriverCall::unmap] == before[DriverCall::unmap]);
  CHECK(after[DriverCall::release] - before[DriverCall::release] >= 3);  // the three made, released
  CHECK(reserved(*e) == static_cast<std::int64_t>(40 * MiB));
  require_consistent(*e);
}

TEST_CASE("oracle: after emptying the cache for a request, the peers grow without searching the cache again",
          "[oracle]") {
  // PyTorch's malloc calls alloc_block after release_cached_blocks. A block freed on a busy stream comes back to
  // the pool inside the release, in a segment a live block keeps (so not released): PyTorch still creates, and
  // here runs out of memory; fragless takes the block.
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::fragless}) {
    INFO(name(p));
    EngineSpec spec;
    spec.policy = p;
    spec.capacity = 30 * MiB;
    spec.base.background = BackgroundMode::off;
    auto e = make_engine(spec);
    TestEvents* ev = test_events_of(e->driver());
    REQUIRE(ev);
    void* a = e->allocate(5 * MiB, 1, nullptr);
    void* b = e->allocate(15 * MiB, 1, nullptr);
    REQUIRE((a && b));
    ev->hold(2);
    REQUIRE(e->record_stream(b, 2) == Status::ok);
    REQUIRE(e->free(b) == Status::ok);
    void* c = e->allocate(15 * MiB, 1, nullptr);
    CHECK(e->stats().num_alloc_retries == 1);
    if (p == PolicyKind::classic) CHECK(c == nullptr);
    else CHECK(c == b);
  }
}
