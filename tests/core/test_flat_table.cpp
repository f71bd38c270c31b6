// FlatTable (allocator/include/fragless/flat_table.h, Note [Flat tables]) against std::unordered_map: the same
// answers after every operation of a random walk whose keys collide on purpose (addresses 2 MiB apart, ids in
// a run, and keys that share their home slots), so the backward-shift erase is taken through every case.
#include <catch2/catch.hpp>

#include <new>
#include <random>
#include <unordered_map>

#include "fragless/flat_table.h"
#include "seed.h"

using namespace fragless;

TEST_CASE("FlatTable: the answers of std::unordered_map through a random walk", "[flat_table][seeded]") {
  const std::uint64_t seed = fragless::test::test_seed(5);
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const std::uint64_t kinds[] = {std::uint64_t{2} << 20, 1, std::uint64_t{1} << 58};  // spacing of the keys
  for (std::uint64_t step : kinds) {
    FlatTable<std::uint64_t> t;
    std::unordered_map<std::uint64_t, std::uint64_t> m;
    for (int i = 0; i < 20000; ++i) {
      const std::uint64_t key = (rng() % 600) * step;  // key 0 included: no key value is reserved
      switch (rng() % 3) {
        case 0: t[key] = m[key] = rng(); break;
        case 1: CHECK(t.erase(key) == (m.erase(key) == 1)); break;
        default: {
          const std::uint64_t* v = t.find(key);
          auto it = m.find(key);
          REQUIRE((v != nullptr) == (it != m.end()));
          if (v) CHECK(*v == it->second);
        }
      }
      REQUIRE(t.size() == m.size());
    }
    std::size_t seen = 0;
    t.for_each([&](std::uint64_t k, std::uint64_t v) {
      ++seen;
      auto it = m.find(k);
      REQUIRE(it != m.end());
      CHECK(it->second == v);
    });
    CHECK(seen == m.size());
  }
}

namespace {
// A value whose construction fails once its budget is spent: the array a growth makes constructs one per slot.
struct Fragile {
  static inline int budget = -1;  // constructions left before one throws; negative: never
  int v = 0;
  Fragile() {
    if (budget == 0) throw std::bad_alloc();
    if (budget > 0) --budget;
  }
};
}  // namespace

TEST_CASE("FlatTable: a growth that cannot make its array leaves the table as it was", "[flat_table]") {
  FlatTable<Fragile> t;
  for (std::uint64_t k = 1; k <= 8; ++k) t[k].v = static_cast<int>(k);  // 8 of 16 slots: the next insert grows
  Fragile::budget = 5;  // the 32-slot array fails part-way
  CHECK_THROWS_AS(t[100], std::bad_alloc);
  Fragile::budget = -1;
  CHECK(t.size() == 8);
  for (std::uint64_t k = 1; k <= 8; ++k) {
    INFO("key " << k);
    REQUIRE(t.find(k));
    CHECK(t.find(k)->v == static_cast<int>(k));
  }
  CHECK_FALSE(t.find(100));
  t[100].v = 100;  // and it still grows
  CHECK(t.size() == 9);
  CHECK(t.find(100)->v == 100);
  CHECK(t.find(3)->v == 3);
}
