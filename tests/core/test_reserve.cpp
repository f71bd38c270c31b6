// The fragless policy's reserve of pages made ahead of growths (Note [Growth reserve],
// allocator/src/policy/fragless/fragless_policy.h): what brings it about (growths into gaps that each miss a
// page, as a KV cache grown by concatenation makes them), what takes it (a growth it covers, instead of a
// cuMemCreate on the caller's path), what bounds it (a cell, the peak of live bytes, the memory fraction),
// what gives it back (empty_cache, the out-of-memory retry), and what it may not do (add a call to a repeated
// step after warm-up, leak or crash when its creates fail). The thread test is tagged [concurrency] for the
// ThreadSanitizer run. Last, a hidden survey ([.survey]) of repeated decoding and random steps per policy,
// which docs/RESULTS.md ("Repeated steps") quotes.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include "census_checks.h"
#include "fragless/host_driver.h"
#include "fragless/sim_driver.h"
#include "helpers.h"

using namespace fragless;
using namespace fragless::test;

namespace {

constexpr Stream kStream = 7;

EngineSpec reserve_spec(BackgroundMode mode, const char* conf, DriverKind driver = DriverKind::sim,
                        std::size_t capacity = 64ull * 1024 * MiB) {
  EngineSpec spec;
  spec.driver = driver;
  spec.capacity = capacity;
  auto parsed = parse_config(conf);
  REQUIRE(parsed.ok);
  spec.base = parsed.options;
  spec.base.background = mode;
  return spec;
}

std::uint64_t path_creates(DeviceEngine& e) {
  const auto& c = e.driver_counters();
  return c[DriverCall::create] - c.background(DriverCall::create);
}

// Reserved bytes no segment maps: idle handles and the reserve (the replay's --peak-detail reads them so).
std::int64_t unmapped_reserved(DeviceEngine& e) {
  std::int64_t mapped = 0;
  for (const SegmentInfo& s : e.snapshot()) mapped += static_cast<std::int64_t>(s.total_size);
  return e.stats().reserved_bytes.all().current - mapped;
}

// A decoder's KV caches grown by torch.cat: `caches` tensors, each made 1 MiB longer at every token (a new
// tensor, then the old one freed), a projection's output alive around each, as in workload:rl with
// static_kv=0; `weights` MiB stay live throughout. `between` runs after every token (the GPU's time: the
// worker's turn). Allocations that fail are counted, not required.
struct KvDecode {
  DeviceEngine& e;
  std::vector<void*> kv;
  std::vector<std::size_t> len;
  void* weights = nullptr;
  int failed = 0;
  std::size_t unit;  // a token's keys (or values): 1 MiB, or less on a device of smaller pages
  KvDecode(DeviceEngine& eng, std::size_t weights_mib, int caches, std::size_t prompt_mib, std::size_t unit_bytes = MiB)
      : e(eng), unit(unit_bytes) {
    weights = e.allocate(weights_mib * unit, kStream, nullptr);
    failed += !weights;
    for (int i = 0; i < caches; ++i) {
      kv.push_back(e.allocate(prompt_mib * unit, kStream, nullptr));
      len.push_back(prompt_mib);
      failed += !kv.back();
    }
  }
  template <class F>
  void tokens(int n, F&& between) {
    for (int t = 0; t < n; ++t) {
      for (std::size_t i = 0; i < kv.size(); ++i) {
        void* qkv = e.allocate(std::max<std::size_t>(3 * unit, 2 * MiB), kStream, nullptr);
        void* grown = e.allocate((len[i] + 1) * unit, kStream, nullptr);
        if (grown) {
          if (kv[i]) e.free(kv[i]);
          kv[i] = grown;
          ++len[i];
        }
        failed += !qkv + !grown;
        if (qkv) e.free(qkv);
      }
      between();
    }
  }
  void end() {
    for (void*& p : kv)
      if (p) e.free(p), p = nullptr;
    if (weights) e.free(weights), weights = nullptr;
  }
  ~KvDecode() { end(); }
};

}  // namespace

TEST_CASE("reserve: KV caches grown by concatenation get their pages from the worker, not the caller's path",
          "[reserve]") {
  // 3 GiB live: a cell of 10 pages. The worker runs between tokens only, so a token's 24 growths find at
  // most a cell made for them: measured 538 path creates without the reserve, 314 with it.
  std::uint64_t path[2] = {0, 0}, background[2] = {0, 0};
  std::int64_t peak[2] = {0, 0};
  for (int on = 0; on < 2; ++on) {
    auto e = make_engine(reserve_spec(BackgroundMode::manual, on ? "" : "growth_reserve:False"));
    {
      KvDecode d(*e, 3072, 24, 64);
      d.tokens(8, [&] { e->run_background(1e18); });  // the layout settles
      const auto p0 = path_creates(*e), b0 = e->driver_counters().background(DriverCall::create);
      d.tokens(64, [&] { e->run_background(1e18); });
      path[on] = path_creates(*e) - p0;
      background[on] = e->driver_counters().background(DriverCall::create) - b0;
      CHECK(d.failed == 0);
      require_consistent(*e);
      if (on) CHECK(unmapped_reserved(*e) > 0);  // the reserve is there, counted in reserved
    }
    peak[on] = e->stats().reserved_bytes.all().peak;
  }
  INFO("path creates without / with the reserve: " << path[0] << " / " << path[1] << "; background: "
                                                   << background[0] << " / " << background[1]);
  CHECK(path[0] >= 64 * 24 / 4);       // without it, about a page every other growth
  CHECK(path[1] * 10 <= path[0] * 7);  // with it, a third of them or more made by the worker instead
  CHECK(background[1] >= background[0] + (path[0] - path[1]) / 2);
  // What it adds to the peak is bounded by a cell (10 pages here).
  CHECK(peak[1] <= peak[0] + static_cast<std::int64_t>(10 * 2 * MiB));
}

// Every driver call (path and worker) of `run` on a fresh engine with `conf`.
template <class Run>
DriverCounters counters_of(const EngineSpec& spec, Run&& run) {
  auto e = make_engine(spec);
  run(*e);
  require_consistent(*e);
  return e->driver_counters();
}

void check_same_calls(const DriverCounters& a, const DriverCounters& b) {
  for (int c = 0; c < kDriverCallCount; ++c) {
    const auto call = static_cast<DriverCall>(c);
    INFO(driver_call_name(call));
    CHECK(a[call] == b[call]);
    CHECK(a.background(call) == b.background(call));
  }
}

TEST_CASE("reserve: growths that create only at memory's end, or with the worker off, make no reserve",
          "[reserve]") {
  // Tensors that only grow memory at its end (frontier growths: their cells already cost a call each) ask
  // for nothing: every call is the same with the reserve on and off.
  auto frontier = [](DeviceEngine& e) {
    std::vector<void*> live;
    for (int i = 0; i < 200; ++i) {
      live.push_back(e.allocate((1 + i % 7) * MiB, kStream, nullptr));
      e.run_background(1e18);
    }
    CHECK(unmapped_reserved(e) == 0);
    for (void* p : live) e.free(p);
  };
  check_same_calls(counters_of(reserve_spec(BackgroundMode::manual, ""), frontier),
                   counters_of(reserve_spec(BackgroundMode::manual, "growth_reserve:False"), frontier));
  // With background:False the decode that asks for a reserve gets none: the same calls as without one.
  auto decode = [](DeviceEngine& e) {
    KvDecode d(e, 3072, 24, 64);
    d.tokens(32, [&] { e.run_background(1e18); });
    CHECK(d.failed == 0);
    CHECK(unmapped_reserved(e) == 0);
  };
  check_same_calls(counters_of(reserve_spec(BackgroundMode::off, ""), decode),
                   counters_of(reserve_spec(BackgroundMode::off, "growth_reserve:False"), decode));
}

TEST_CASE("reserve: empty_cache and the out-of-memory retry give the reserve back first", "[reserve]") {
  // A 16 GiB device, 5 GiB live while decoding: the reserve is made (less than half the device is held).
  const EngineSpec spec = reserve_spec(BackgroundMode::manual, "", DriverKind::sim, 16ull * 1024 * MiB);
  {
    auto e = make_engine(spec);
    KvDecode d(*e, 3072, 24, 64);
    d.tokens(24, [&] { e->run_background(1e18); });
    REQUIRE(d.failed == 0);
    REQUIRE(unmapped_reserved(*e) > 0);
    REQUIRE(e->empty_cache() == Status::ok);
    CHECK(unmapped_reserved(*e) == 0);
    CHECK(static_cast<std::int64_t>(e->driver().live_bytes()) == e->stats().reserved_bytes.all().current);
    require_consistent(*e);
  }
  {
    // Everything freed, then one allocation of the whole device less a page: it fits only once the
    // out-of-memory retry has given back the cached blocks and the reserve.
    auto e = make_engine(spec);
    KvDecode d(*e, 3072, 24, 64);
    d.tokens(24, [&] { e->run_background(1e18); });
    REQUIRE(unmapped_reserved(*e) > 0);
    d.end();
    void* all = e->allocate(16ull * 1024 * MiB - 2 * MiB, kStream, nullptr);
    CHECK(all != nullptr);
    CHECK(unmapped_reserved(*e) == 0);
    require_consistent(*e);
    if (all) e->free(all);
  }
}

TEST_CASE("reserve: never near the limit, never past the memory fraction", "[reserve]") {
  // More than half of what the process may hold is live (a 6 GiB device, or half of 12 GiB): no reserve
  // page, and every call the same as without the reserve.
  for (const char* conf : {"", "per_process_memory_fraction:0.5"}) {
    INFO(conf);
    const std::size_t device = std::string_view(conf).empty() ? 6ull * 1024 * MiB : 12ull * 1024 * MiB;
    const std::string off = std::string(conf) + (*conf ? "," : "") + "growth_reserve:False";
    auto decode = [](DeviceEngine& e) {
      KvDecode d(e, 3072, 24, 32);
      d.tokens(32, [&] { e.run_background(1e18); });
      CHECK(d.failed == 0);
      CHECK(unmapped_reserved(e) == 0);
    };
    check_same_calls(counters_of(reserve_spec(BackgroundMode::manual, conf, DriverKind::sim, device), decode),
                     counters_of(reserve_spec(BackgroundMode::manual, off.c_str(), DriverKind::sim, device), decode));
  }
}

TEST_CASE("reserve: a repeated decoding step: the reserve makes no call after warm-up", "[reserve]") {
  // The same step again and again (grow 24 caches by 16 tokens from the same prompt, then free them): the
  // reserve made while memory first grew is used or kept, and the steps after warm-up make exactly the calls
  // they make without it. (Not none: fragless re-backs a page per cache and step here, and its worker splits
  // again every few steps, with or without the reserve: docs/RESULTS.md, "Growth reserve".)
  DriverCounters per_step[2];
  for (int on = 0; on < 2; ++on) {
    auto e = make_engine(reserve_spec(BackgroundMode::manual, on ? "" : "growth_reserve:False"));
    void* weights = e->allocate(3072 * MiB, kStream, nullptr);
    REQUIRE(weights);
    auto step = [&] {
      KvDecode d(*e, 1, 24, 64);
      d.tokens(16, [&] { e->run_background(1e18); });
      CHECK(d.failed == 0);
    };
    for (int i = 0; i < 4; ++i) step();
    const DriverCounters warm = e->driver_counters();
    for (int i = 0; i < 12; ++i) step();
    for (int c = 0; c < kDriverCallCount; ++c) {
      const auto call = static_cast<DriverCall>(c);
      per_step[on].calls[c] = e->driver_counters()[call] - warm[call];
      per_step[on].background_calls[c] = e->driver_counters().background(call) - warm.background(call);
    }
    require_consistent(*e);
    e->free(weights);
  }
  check_same_calls(per_step[0], per_step[1]);
}

TEST_CASE("fault sweep: creates of the reserve fail at every point of a decode, nothing leaks",
          "[reserve][faults]") {
  // On the host driver, 12 caches of 16 MiB behind 128 MiB of weights for 16 tokens, reserve_slack:0.1 (a cell
  // of 10 pages; the path's creates fall from 40 to 23 with the reserve): the nth create fails once, out of
  // memory and a driver error in turn, for 9 values of n spread over every create of the decode (the path's
  // count too; measured on a first run). Each run takes about two seconds of the host driver's system calls,
  // and more under load: every n and both failures took 9 minutes in a loaded fast tier. The engine stays consistent, empty_cache gives everything back, and the decode then runs
  // again. The worker's failed create fails nothing: the growth that misses the page creates it.
  const EngineSpec spec = reserve_spec(BackgroundMode::manual, "reserve_slack:0.1", DriverKind::host, 4096 * MiB);
  auto decode = [](DeviceEngine& e) {
    KvDecode d(e, 128, 12, 16);
    d.tokens(16, [&] { e.run_background(1e18); });
    return d.failed;
  };
  std::uint64_t creates = 0;
  {
    auto e = make_engine(spec);
    CHECK(decode(*e) == 0);
    REQUIRE(unmapped_reserved(*e) > 0);
    creates = e->driver_counters()[DriverCall::create];
  }
  std::size_t runs = 0;
  for (std::uint64_t nth = 1; nth <= creates; nth += std::max<std::uint64_t>(1, creates / 8)) {
    const Status failure = runs % 2 ? Status::driver_error : Status::out_of_memory;
    INFO("create " << nth << " of " << creates << " fails with " << status_name(failure));
    auto e = make_engine(spec);
    host_driver_inject_failure(e->driver(), DriverCall::create, nth, failure);
    decode(*e);  // a failure on the path fails that allocation, the decode goes on
    CHECK(host_driver_injected_failures(e->driver()) == 1);
    host_driver_inject_failure(e->driver(), DriverCall::create, 0, Status::ok);
    require_consistent(*e);
    check_all_given_back(*e, false);
    CHECK(decode(*e) == 0);
    require_consistent(*e);
    ++runs;
  }
  CHECK(runs >= 8);
}

TEST_CASE("reserve: a create the driver refuses stops the worker's reserve until a growth has asked again",
          "[reserve][faults]") {
  // Every create refused after 8 tokens (memory another process took unseen): the next token's growths fail
  // or take the reserve, and the worker tries its refill at most once per answer a growth got from the driver,
  // its demand halved each time, not again and again on the same answer (before, one turn of the worker made
  // 100,000 refused creates, as many as were injected). Measured: 5 refused creates over the token's 24
  // allocations.
  auto e = make_engine(reserve_spec(BackgroundMode::manual, "reserve_slack:0.1", DriverKind::host, 4096 * MiB));
  KvDecode d(*e, 128, 12, 16);
  d.tokens(8, [&] { e->run_background(1e18); });
  REQUIRE(d.failed == 0);
  REQUIRE(unmapped_reserved(*e) > 0);
  const std::uint64_t path_before = path_creates(*e);
  host_driver_inject_failure(e->driver(), DriverCall::create, 1, Status::out_of_memory, 100000);
  d.tokens(1, [&] { e->run_background(1e18); });
  const std::uint64_t refused = host_driver_injected_failures(e->driver());
  INFO("refused creates " << refused << ", of them the path's " << path_creates(*e) - path_before);
  CHECK(refused <= 24);
  host_driver_inject_failure(e->driver(), DriverCall::create, 0, Status::ok);
  require_consistent(*e);
  d.end();
  check_all_given_back(*e, false);
}

TEST_CASE("reserve: a growth whose create is refused part way takes the reserve before creating again",
          "[reserve][faults]") {
  // Auditing on (Note [Auditing creations]) before the growth: a 90 MiB growth's second create is refused; what
  // it still misses afterwards is taken from the reserve when the reserve covers it, never created beside it.
  auto e = make_engine(reserve_spec(BackgroundMode::manual, "reserve_slack:0.1", DriverKind::host, 4096 * MiB));
  KvDecode d(*e, 128, 12, 16);
  d.tokens(8, [&] { e->run_background(1e18); });
  REQUIRE(unmapped_reserved(*e) > 0);
  require_consistent(*e);
  for (std::size_t mib : {6, 20, 42, 70, 90}) {
    INFO(mib << " MiB");
    host_driver_inject_failure(e->driver(), DriverCall::create, 2, Status::out_of_memory);
    void* p = e->allocate(mib * MiB, kStream, nullptr);
    host_driver_inject_failure(e->driver(), DriverCall::create, 0, Status::ok);
    require_consistent(*e);
    if (p) e->free(p);
    e->run_background(1e18);
  }
}

TEST_CASE("reserve: a growth the reserve covers only in part leaves it whole and creates", "[reserve]") {
  // Note [Growth reserve], "use": the reserve is taken when it covers all a growth still misses (taking fewer
  // pages would save no create); a larger growth creates and leaves the reserve for the gaps it is for.
  auto e = make_engine(reserve_spec(BackgroundMode::manual, "reserve_slack:0.1"));
  KvDecode d(*e, 128, 12, 16);
  d.tokens(8, [&] { e->run_background(1e18); });
  const std::int64_t held = unmapped_reserved(*e);
  REQUIRE(held > 0);
  const std::uint64_t creates = path_creates(*e);
  void* p = e->allocate(static_cast<std::size_t>(held) + 64 * MiB, kStream, nullptr);  // misses more than it holds
  REQUIRE(p);
  INFO("unmapped reserved " << (held >> 20) << " -> " << (unmapped_reserved(*e) >> 20) << " MiB");
  CHECK(path_creates(*e) > creates);
  CHECK(unmapped_reserved(*e) == held);
  require_consistent(*e);
  e->free(p);
}

TEST_CASE("reserve: the worker thread makes it while threads decode, and stops with the engine",
          "[reserve][concurrency]") {
  // A worker thread makes the reserve while the decode runs, the engine checked after every token. Whether a
  // given token finds reserve pages depends on the worker's timing (its splits move the caches' free tails and
  // with them the peak bound's room): the cases above, on a worker stepped by hand, assert what it makes. Without
  // the reserve no page is ever held beyond the mapped ones.
  {
    auto e = make_engine(reserve_spec(BackgroundMode::thread, "growth_reserve:False"));
    KvDecode d(*e, 3072, 24, 64);
    d.tokens(24, [&] {
      e->drain_background();
      CHECK(unmapped_reserved(*e) == 0);
    });
    CHECK(d.failed == 0);
    require_consistent(*e);
  }
  auto e = make_engine(reserve_spec(BackgroundMode::thread, ""));
  {
    KvDecode d(*e, 3072, 24, 64);
    d.tokens(48, [&] { e->drain_background(); });
    CHECK(d.failed == 0);
    require_consistent(*e);
  }
  // A second thread allocates and frees meanwhile; the engine is destroyed with the worker possibly busy.
  std::thread other([&] {
    for (int i = 0; i < 200; ++i)
      if (void* p = e->allocate((1 + i % 5) * MiB, kStream + 1, nullptr)) e->free(p);
  });
  {
    KvDecode d(*e, 1, 24, 64);
    d.tokens(16, [] {});
    CHECK(d.failed == 0);
  }
  other.join();
  e->drain_background();
  require_consistent(*e);
  e.reset();
}

namespace {

// One policy's outcome over a family of repeated steps: how many reach a step without a driver call, the calls
// (event calls and memory queries left out: they change no mapping) of the steps measured after warm-up, and
// the peak reserved and live bytes summed over the family.
struct SurveyRow {
  int steady = 0, members = 0;
  std::uint64_t calls = 0;
  double path_us = 0;  // modelled driver time on the allocation path
  std::int64_t reserved_mib = 0, live_mib = 0;
};

// Runs `step` `warm` times, then `more` times, on a fresh engine made by `spec`, and adds the outcome to row.
template <class Step>
void survey(SurveyRow& row, const EngineSpec& spec, int warm, int more, Step&& step) {
  auto e = make_engine(spec);
  for (int i = 0; i < warm; ++i) step(*e);
  const DriverCounters before = e->driver_counters();
  for (int i = 0; i < more; ++i) step(*e);
  std::uint64_t calls = 0;
  for (DriverCall c : {DriverCall::create, DriverCall::release, DriverCall::map, DriverCall::unmap,
                       DriverCall::set_access, DriverCall::synchronize_stream, DriverCall::synchronize_event,
                       DriverCall::synchronize_device, DriverCall::stream_wait_event})
    calls += e->driver_counters()[c] - before[c];
  row.steady += calls == 0;
  ++row.members;
  row.calls += calls;
  row.path_us += e->driver_counters().on_path_us() - before.on_path_us();
  row.reserved_mib += e->stats().reserved_bytes.all().peak / static_cast<std::int64_t>(MiB);
  row.live_mib += e->stats().live_bytes.peak / static_cast<std::int64_t>(MiB);
}

}  // namespace

TEST_CASE("survey: repeated steps of KV caches grown by concatenation and of random shapes, per policy",
          "[.survey]") {
  // A measurement, not a check (hidden; docs/RESULTS.md, "Repeated steps", quotes what it prints): the same
  // step again and again, in two families the replay's workloads do not hold.
  //  - decode: the KvDecode step above behind 2 GiB of weights, for 8, 24 and 48 caches, prompts of 16, 64 and
  //    200 tokens, 8 and 32 new tokens, and tokens of 1 MiB and 256 KiB (36 steps); 40 steps of warm-up, 10
  //    measured, the worker run after every token;
  //  - random: 20 steps drawn once each (seeds 1 to 20: 100 to 400 allocations of 512 B to 576 MiB, each freed
  //    1 to 60 allocations later, the rest at the step's end) behind 1 GiB; 30 of warm-up, 10 measured, the
  //    worker run every 8 allocations.
  struct Setting { const char* name; PolicyKind policy; const char* conf; };
  const Setting settings[] = {{"classic", PolicyKind::classic, ""},
                              {"expandable", PolicyKind::expandable, ""},
                              {"fragless", PolicyKind::fragless, ""},
                              {"fragless reserve_slack:0.125", PolicyKind::fragless, "reserve_slack:0.125"},
                              {"fragless handle_max_mb:16", PolicyKind::fragless, "handle_max_mb:16"},
                              {"fragless handles:pages", PolicyKind::fragless, "handles:pages"}};
  std::printf("| family | setting | steps without a driver call | calls per measured step | alloc-path µs per "
              "measured step | peak reserved MiB (sum) | peak live MiB (sum) |\n|---|---|---|---|---|---|---|\n");
  for (const char* family : {"decode", "random"})
    for (const Setting& set : settings) {
      EngineSpec spec = reserve_spec(BackgroundMode::manual, set.conf);
      spec.policy = set.policy;
      SurveyRow row;
      int measured = 0;
      if (std::string_view(family) == "decode") {
        for (int caches : {8, 24, 48})
          for (int prompt : {16, 64, 200})
            for (int toks : {8, 32})
              for (std::size_t unit : {MiB, MiB / 4})
                survey(row, spec, 40, 10, [&](DeviceEngine& e) {
                  void* weights = e.allocate(2048 * MiB, kStream, nullptr);
                  {
                    KvDecode d(e, 1, caches, prompt, unit);
                    d.tokens(toks, [&] { e.run_background(1e18); });
                  }
                  e.free(weights);
                });
        measured = 10;
      } else {
        for (std::uint64_t seed = 1; seed <= 20; ++seed) {
          std::mt19937_64 rng(seed);
          struct Op { std::size_t size; int life; };
          std::vector<Op> ops(100 + rng() % 300);
          for (Op& op : ops) {
            const auto kind = rng() % 10;
            op.size = kind < 3 ? 512 + rng() % MiB : kind < 8 ? MiB + rng() % (64 * MiB) : 64 * MiB + rng() % (512 * MiB);
            op.life = 1 + static_cast<int>(rng() % 60);
          }
          survey(row, spec, 30, 10, [&](DeviceEngine& e) {
            void* weights = e.allocate(1024 * MiB, kStream, nullptr);
            std::vector<std::pair<int, void*>> live;  // (index of the allocation that frees it, pointer)
            for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
              std::erase_if(live, [&](const auto& l) { return l.first <= i && (e.free(l.second), true); });
              if (void* p = e.allocate(ops[i].size, kStream, nullptr)) live.push_back({i + ops[i].life, p});
              if (i % 8 == 0) e.run_background(1e18);
            }
            for (const auto& l : live) e.free(l.second);
            e.free(weights);
            e.run_background(1e18);
          });
        }
        measured = 10;
      }
      std::printf("| %s | %s | %d of %d | %.1f | %.1f | %lld | %lld |\n", family, set.name, row.steady, row.members,
                  static_cast<double>(row.calls) / (row.members * measured), row.path_us / (row.members * measured),
                  static_cast<long long>(row.reserved_mib), static_cast<long long>(row.live_mib));
    }
}
