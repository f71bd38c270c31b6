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
