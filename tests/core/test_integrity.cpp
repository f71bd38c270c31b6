// Data integrity on the host driver: every live block carries a pattern keyed by its id, written at
// allocation and verified at free, across page reuse, re-backing and remapping.
#include <cstring>

#include "random_ops.h"
#include "seeded_policies.h"

using namespace fragless;
using namespace fragless::test;

namespace {

// A word at the first and last bytes of the block, and one at every address of a fixed grid (the multiples
// of 4096) inside it: two live blocks that overlap by a grid step write the same grid word, wherever each
// of them starts. Probes never overlap each other.
constexpr std::uintptr_t kGrid = 4096;

template <class F>
void each_probe(const LiveBlock& b, F f) {
  const auto start = reinterpret_cast<std::uintptr_t>(b.ptr);
  f(0);
  std::size_t last = 0;
  for (std::size_t off = (start + 8 + kGrid - 1) / kGrid * kGrid - start; off + 16 <= b.size; off += kGrid) f(last = off);
  if (b.size >= 16 && b.size - 8 >= last + 8) f(b.size - 8);
}

std::uint64_t pattern(std::uint64_t id, std::size_t off) { return (id * 0x9e3779b97f4a7c15ull) ^ off; }

void fill(const LiveBlock& b) {
  if (b.size < 8) {
    std::memset(b.ptr, static_cast<int>(b.id & 0xff), b.size);
    return;
  }
  each_probe(b, [&](std::size_t off) {
    const std::uint64_t v = pattern(b.id, off);
    std::memcpy(b.ptr + off, &v, 8);
  });
}

bool verify(const LiveBlock& b) {
  if (b.size < 8) {
    for (std::size_t i = 0; i < b.size; ++i)
      if (static_cast<unsigned char>(b.ptr[i]) != (b.id & 0xff)) return false;
    return true;
  }
  bool ok = true;
  each_probe(b, [&](std::size_t off) {
    std::uint64_t v;
    std::memcpy(&v, b.ptr + off, 8);
    ok &= v == pattern(b.id, off);
  });
  return ok;
}

}  // namespace

TEST_CASE("integrity: 100,000 random operations on real memory corrupt nothing", "[integrity][seeded]") {
  FRAGLESS_SEEDED_POLICIES(policy, seed, 0x1e7e6417);
  EngineSpec spec;
  spec.policy = policy;
  spec.driver = DriverKind::host;
  spec.capacity = 64 * MiB;  // small: pages are reclaimed and re-backed often
  auto e = make_engine(spec);
  TestEvents* ev = test_events_of(e->driver());
  std::mt19937_64 rng(seed);
  std::vector<LiveBlock> live;
  std::uint64_t corrupt = 0, frees = 0;
  // Waves: live bytes climb towards a target between 30% and 95% of capacity, then fall back, so pages
  // are freed in holes, reclaimed and re-backed over and over.
  std::size_t live_bytes = 0, target = spec.capacity / 2;
  for (int op = 0; op < 100000; ++op) {
    if (op % 2000 == 0) target = spec.capacity * (30 + rng() % 66) / 100;
    const int r = static_cast<int>(rng() % 100);
    if ((r < 60 && live_bytes < target) || live.empty()) {
      const std::size_t size = random_size(rng) / (rng() % 8 + 4);
      const Stream st = rng() % 2;
      void* p = e->allocate(size ? size : 1, st, nullptr);
      if (p) {
        live.push_back({static_cast<char*>(p), size ? size : 1, static_cast<std::uint64_t>(op) + 1, st});
        live_bytes += live.back().size;
        fill(live.back());
      }
    } else if (r < 97 || live_bytes >= target) {
      const std::size_t i = rng() % live.size();
      if (!verify(live[i])) ++corrupt;
      if (rng() % 10 == 0) REQUIRE(e->record_stream(live[i].ptr, 2) == Status::ok);
      REQUIRE(e->free(live[i].ptr) == Status::ok);
      live_bytes -= live[i].size;
      ++frees;
      live[i] = live.back();
      live.pop_back();
    } else if (r < 99) {
      // Any stream may be busy: a held allocation stream keeps fragless's lent ranges mapped for longer.
      const Stream h = rng() % 3;
      if (rng() % 2) ev->hold(h); else ev->complete(h);
    } else {
      e->empty_cache();
    }
  }
  for (auto& b : live) {
    if (!verify(b)) ++corrupt;
    REQUIRE(e->free(b.ptr) == Status::ok);
  }
  const auto st = e->stats();
  CHECK(st.num_device_free > 10);  // memory really went back and came again
  CHECK(frees > 40000);
  if (policy == PolicyKind::fragless) {
    CHECK(st.num_forced_syncs > 0);  // pages were reclaimed from other streams' holes
    CHECK(e->driver_counters()[DriverCall::record_event] > 0);  // and lent from the same stream's holes
  }
  CHECK(corrupt == 0);
  require_consistent(*e);
}

// A segment's page table (state/engine_state.h): entries are made in chunks on first write, reads never make
// one, and what is written is read back, in the last (partial) chunk too.
#include "state/engine_state.h"

TEST_CASE("page table: only writes make chunks and entries hold what was written", "[integrity]") {
  // A growable segment's table on the replay's 1 TiB device: 9/8 TiB of 2 MiB pages, and one entry more,
  // so that the last chunk holds a single entry.
  const std::size_t n = (std::size_t{9} << 40) / 8 / (2u << 20) + 1;
  PageTable t;
  REQUIRE(t.allocate(n));
  CHECK_FALSE(t.allocate(n));  // once
  CHECK(t.size() == n);
  const PageTable& ro = t;
  for (std::size_t i = 0; i < n; i += 997) CHECK_FALSE(ro[i].valid());
  CHECK(t.chunks_made() == 0);
  t.slot(5) = PageRef{42, 0};
  t.slot(PageTable::kChunk - 1) = PageRef{43, 4096};
  CHECK(t.chunks_made() == 1);
  t.slot(n - 1) = PageRef{44, 8192};
  CHECK(t.chunks_made() == 2);
  CHECK(ro[5].handle == 42);
  CHECK((ro[PageTable::kChunk - 1].handle == 43 && ro[PageTable::kChunk - 1].offset == 4096));
  CHECK((ro[n - 1].handle == 44 && ro[n - 1].offset == 8192));
  CHECK_FALSE(ro[4].valid());
  CHECK_FALSE(ro[PageTable::kChunk].valid());
  CHECK_FALSE(ro[n - 2].valid());
  CHECK(t.chunks_made() == 2);
  // prepare() makes the chunks of a range ahead of the driver work it records (here two, one already made).
  REQUIRE(t.prepare(PageTable::kChunk - 2, 4));
  CHECK(t.chunks_made() == 3);
  CHECK(t.prepare(7, 0));
  CHECK(t.chunks_made() == 3);
  CHECK_FALSE(ro[PageTable::kChunk].valid());
  PageTable other;
  other.swap(t);
  CHECK(other[n - 1].handle == 44);
  CHECK(t.size() == 0);
  // A classic segment's table is one entry.
  PageTable one;
  REQUIRE(one.allocate(1));
  one.slot(0) = PageRef{7, 0};
  CHECK((one[0].handle == 7 && one.chunks_made() == 1));
  PageTable made;  // a one-chunk table is made whole by allocate(), before any driver call
  REQUIRE(made.allocate(3));
  CHECK(made.chunks_made() == 1);
  CHECK_FALSE(PageTable().allocate(0));
}
