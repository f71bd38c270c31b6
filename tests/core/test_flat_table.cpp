// FlatTable (allocator/include/fragless/flat_table.h, Note [Flat tables]) against std::unordered_map: the same
// answers after every operation of a random walk whose keys collide on purpose (addresses 2 MiB apart, ids in
// a run, and keys that share their home slots), so the backward-shift erase is taken through every case.
#include <catch2/catch.hpp>

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
