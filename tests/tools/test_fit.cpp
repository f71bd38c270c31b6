// The searches of bench/replay/fit.h, checked rather than trusted: every answer found is replayed again here,
// from scratch and to the end, with zero OOMs, and its neighbour (one capacity step below, one value above)
// with at least one; bad questions get an error naming what was wrong.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <functional>
#include <random>
#include <sstream>

#include "fit.h"
#include "fragless/config.h"
#include "seed.h"
#include "workload.h"

using namespace fragless;
using namespace fragless::replay;

namespace {

constexpr std::uint64_t kGiB = 1ull << 30, kMiB = 1ull << 20;
const PolicyKind kPolicies[] = {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless};

ReplayResult replay_on(const formats::Trace& t, int device, PolicyKind p, std::uint64_t capacity) {
  ReplayOptions o;
  o.capacity = capacity;
  o.check = true;
  return replay::replay(t, device, p, o);
}

// The answer fits, a step below does not, and nothing fits below peak live.
void verify_fit(const formats::Trace& t, int device, PolicyKind p, std::uint64_t step, unsigned parallel) {
  SearchOptions so;
  so.parallel = parallel;
  const FitResult f = fit_capacity(t, device, p, step, so);
  INFO(t.source << " device " << device << " " << policy_name(p) << " step " << step / kMiB << " MiB: " << f.error);
  REQUIRE(f.error.empty());
  REQUIRE(f.min_capacity % step == 0);
  CHECK(f.min_capacity >= static_cast<std::uint64_t>(f.peak_live));
  CHECK(f.at.ooms == 0);
  CHECK(f.replays >= 2);
  const ReplayResult at = replay_on(t, device, p, f.min_capacity);
  INFO("at " << f.min_capacity / kMiB << " MiB: " << at.error);
  REQUIRE(at.error.empty());
  CHECK(at.ooms == 0);
  CHECK(at.peak_reserved <= static_cast<std::int64_t>(f.min_capacity));
  CHECK(at.peak_reserved == f.at.peak_reserved);  // the search's replay and this one are the same replay
  if (f.min_capacity > step) {
    const ReplayResult below = replay_on(t, device, p, f.min_capacity - step);
    INFO("below: " << below.error);
    CHECK(below.ooms >= 1);
  }
  // Every step above it fits, up to the top (Note [Every step up]), which holds the peak reserved without
  // a limit.
  CHECK(f.top >= f.min_capacity);
  CHECK(f.top % step == 0);
  const auto reserved = static_cast<std::uint64_t>(replay_on(t, device, p, 0).peak_reserved);
  const std::uint64_t from = p == PolicyKind::fragless ? 2 * reserved : reserved;  // Note [Above the top]
  CHECK(f.top == (from + step - 1) / step * step);
  for (std::uint64_t c = f.min_capacity + step; c <= f.top; c += step) {
    const ReplayResult r = replay_on(t, device, p, c);
    INFO("at " << c / kMiB << " MiB: " << r.error);
    CHECK(r.ooms == 0);
  }
}

void verify_max(const std::string& spec, const std::string& key, PolicyKind p, std::uint64_t capacity,
                unsigned parallel) {
  SearchOptions so;
  so.parallel = parallel;
  const MaxResult m = max_value(spec, key, p, capacity, so);
  INFO(spec << " " << key << " " << policy_name(p) << " on " << capacity / kMiB << " MiB: " << m.error);
  REQUIRE(m.error.empty());
  REQUIRE(m.max_value >= m.least);
  REQUIRE(m.max_value < m.greatest);
  auto run = [&](long long v) {
    formats::Trace t;
    std::string err;
    REQUIRE(make_workload(workload_with(spec, key, v), &t, &err));
    return replay_on(t, 0, p, capacity);
  };
  const ReplayResult at = run(m.max_value);
  REQUIRE(at.error.empty());
  CHECK(at.ooms == 0);
  const ReplayResult above = run(m.max_value + 1);
  REQUIRE(above.error.empty());
  CHECK(above.ooms >= 1);
}

// A small random draw of one zoo workload, made into *t.
std::string zoo_draw(std::mt19937_64& rng, const std::string& name, formats::Trace* t) {
  std::ostringstream spec;
  // (serving's steps are decode iterations: 3 may see no request arrive, and nothing to fit)
  spec << "workload:" << name << ":seed=" << rng() % 100000 << ",steps=" << (name == "serving" ? 60 : 3);
  if (name == "random") spec << ",ops=" << 200 + rng() % 600 << ",live_gib=0.25,streams=" << 1 + rng() % 4;
  if (name == "unet2d") spec << ",res=" << 128 + rng() % 256 << ",batch=" << 1 + rng() % 4;
  if (name == "serving") spec << ",layers=4,max_batch=" << 4 + rng() % 16;
  if (name == "moe") spec << ",layers=2,experts=8,tokens=" << 1024 + rng() % 4096;
  if (name == "pipeline") spec << ",layers=2,d_model=1024,d_ff=4096,micro=" << 2 + rng() % 6;
  std::string err;
  INFO(spec.str());
  REQUIRE(make_workload(spec.str(), t, &err));
  return spec.str();
}

// Calls f on every device with allocations of every real trace; returns how many.
int for_each_real_trace(const std::function<void(const formats::Trace&, int)>& f) {
  const std::string dir = FRAGLESS_SOURCE_DIR "/../shared/data/traces/torch";
  REQUIRE(std::filesystem::exists(dir));
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    auto lr = formats::load_trace(entry.path().string());
    INFO(entry.path().string() << ": " << lr.error);
    REQUIRE(lr.ok);
    for (int d = 0; d < lr.trace.devices(); ++d) {
      bool any = false;
      for (const auto& ev : lr.trace.events) any |= ev.device == d && ev.op == formats::Op::alloc;
      if (!any) continue;
      f(lr.trace, d);
      ++n;
    }
  }
  return n;
}

}  // namespace

TEST_CASE("fit: the smallest capacity fits, one step below does not", "[fit]") {
  const char* specs[] = {
      "workload:transformer-infer:layers=4,steps=3",
      "workload:transformer-train:layers=2,d_model=512,heads=8,d_ff=2048,steps=3,batch=2",
      "workload:unet2d:res=256,batch=2,steps=3",
      "workload:random:ops=400,steps=3,live_gib=0.5,streams=3",
      "workload:moe:layers=2,experts=8,tokens=4096,steps=3",
  };
  for (const char* spec : specs) {
    formats::Trace t;
    std::string err;
    REQUIRE(make_workload(spec, &t, &err));
    for (PolicyKind p : kPolicies) {
      verify_fit(t, 0, p, kGiB / 4, 1);
      verify_fit(t, 0, p, 32 * kMiB, 3);  // a finer step, probes in parallel
    }
  }
}

TEST_CASE("fit: random draws of the pattern zoo (a property test, a failing draw is printed)", "[fit][property][seeded]") {
  const std::uint64_t seed = fragless::test::test_seed(20261201);
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const char* names[] = {"random", "unet2d", "serving", "pipeline"};
  for (int draw = 0; draw < 8; ++draw) {
    formats::Trace t;
    const std::string spec = zoo_draw(rng, names[draw % 4], &t);
    INFO("draw " << draw << ": " << spec);
    const std::uint64_t step = (8u << 20) << (rng() % 4);  // 8 .. 64 MiB
    for (PolicyKind p : kPolicies) verify_fit(t, 0, p, step, 1 + static_cast<unsigned>(rng() % 4));
  }
}

TEST_CASE("fit: a step far finer than the trace is refused before any search replay, naming step and range",
          "[fit][bad-input]") {
  // One 20 GiB tensor: fragless's search would replay every MiB from 20 to 40 GiB (20,480 replays; a review's
  // 600 GiB one at 1 KiB steps would have taken days); refused. At the default step (1/4 GiB) it is searched.
  formats::Trace t;
  t.source = "big";
  formats::Event a;
  a.op = formats::Op::alloc;
  a.address = 1 << 20;
  a.size = 20 * kGiB;
  t.events = {a};
  SearchOptions so;
  const FitResult f = fit_capacity(t, 0, PolicyKind::fragless, kMiB, so);
  INFO(f.error);
  CHECK(f.error.find("big (device 0, fragless): ") == 0);
  CHECK(f.error.find(" steps of 0.0009766 GiB between its peak live bytes (20 GiB) and where it runs as without a "
                     "limit (") != std::string::npos);
  CHECK(f.error.find("more than 10000: give a larger --fit-step") != std::string::npos);
  CHECK(f.replays == 1);  // the replay without a limit, that found the range
  const FitResult coarse = fit_capacity(t, 0, PolicyKind::fragless, kGiB / 4, so);
  INFO(coarse.error);
  CHECK(coarse.error.empty());
  CHECK(coarse.min_capacity >= 20 * kGiB);
}

TEST_CASE("fit: a search is deterministic", "[fit]") {
  formats::Trace t;
  std::string err;
  REQUIRE(make_workload("workload:transformer-infer:layers=6,steps=4", &t, &err));
  for (PolicyKind p : kPolicies) {
    SearchOptions one, many;
    many.parallel = 5;
    const FitResult a = fit_capacity(t, 0, p, 16 * kMiB, one), b = fit_capacity(t, 0, p, 16 * kMiB, one);
    const FitResult c = fit_capacity(t, 0, p, 16 * kMiB, many);
    REQUIRE(a.error.empty());
    CHECK(a.min_capacity == b.min_capacity);
    CHECK(c.min_capacity == a.min_capacity);  // replays run at once change neither the answer
    CHECK(c.replays == a.replays);            // nor what is replayed
    verify_fit(t, 0, p, 16 * kMiB, 5);
  }
}

// Where OOMs are not monotone in capacity: classic caching runs the mercuryb1 snapshot on 4.0625 GiB but on
// no step from 4.078 to 5.25 GiB. A search whose answer depended on its probes (a bisection that tried
// 4.0625 first, as one with 33 probes at once did) answered 4.0625, and a device of 5 GiB would then fail.
TEST_CASE("fit: where a larger device does worse, the answer is the capacity from which every larger one fits", "[data][fit]") {
  const std::string path =
      FRAGLESS_SOURCE_DIR "/../shared/data/traces/torch/mercuryb1_sqattn_cuda_memory_snapshot.pickle";
  REQUIRE(std::filesystem::exists(path));
  auto lr = formats::load_trace(path);
  REQUIRE(lr.ok);
  const std::uint64_t step = kGiB / 16;
  CHECK(replay_on(lr.trace, 0, PolicyKind::classic, 65 * step).ooms == 0);  // 4.0625 GiB
  CHECK(replay_on(lr.trace, 0, PolicyKind::classic, 66 * step).ooms >= 1);
  CHECK(replay_on(lr.trace, 0, PolicyKind::classic, 84 * step).ooms >= 1);  // 5.25 GiB
  for (unsigned parallel : {1u, 2u, 40u}) {
    SearchOptions so;
    so.parallel = parallel;
    const FitResult f = fit_capacity(lr.trace, 0, PolicyKind::classic, step, so);
    INFO("parallel " << parallel << ": " << f.error);
    REQUIRE(f.error.empty());
    CHECK(f.min_capacity == 85 * step);  // 5.3125 GiB
  }
  verify_fit(lr.trace, 0, PolicyKind::classic, step, 2);
}

// Note [Above the top]: every step from the answer to 8/3 of fragless's peak reserved without a limit (where
// no rule of it reads the limit) is replayed here, from the answer up, independently of the search's own
// replays: none runs out of memory. `conf`: settings for the search and the replays.
static void check_fragless_above_answer(const formats::Trace& t, int device, std::uint64_t step,
                                        const std::string& conf = "") {
  SearchOptions so;
  so.parallel = 2;
  const ConfigResult cr = parse_config(conf);
  REQUIRE(cr.ok);
  so.replay.base = cr.options;
  const FitResult f = fit_capacity(t, device, PolicyKind::fragless, step, so);
  INFO(t.source << " device " << device << " " << conf << ": " << f.error);
  REQUIRE(f.error.empty());
  ReplayOptions o = so.replay;
  const auto unlimited = static_cast<double>(replay::replay(t, device, PolicyKind::fragless, o).peak_reserved);
  CHECK(static_cast<double>(f.top) >= 2 * unlimited);
  const double bound = unlimited * 8 / 3 + static_cast<double>(step);
  for (std::uint64_t c = f.min_capacity; static_cast<double>(c) <= bound; c += step) {
    o.capacity = c;
    o.stop_at_first_oom = true;
    const ReplayResult r = replay::replay(t, device, PolicyKind::fragless, o);
    INFO("at " << c / kMiB << " MiB: " << r.error);
    REQUIRE(r.error.empty());
    CHECK(r.ooms == 0);
  }
}

// Found by a second reader (2026-12-06): with larger handles, fragless ran out of memory between its peak
// reserved and twice it, where the search did not look (its top was the peak then).
TEST_CASE("fit: fragless's answer holds above its peak with larger handles", "[fit]") {
  formats::Trace t;
  std::string err;
  REQUIRE(make_workload("workload:random:min_bytes=512,lifetime=40,streams=4,live_gib=1,ops=2000,seed=14976", &t, &err));
  check_fragless_above_answer(t, 0, kGiB / 64, "handle_max_mb:512");
  check_fragless_above_answer(t, 0, kGiB / 64, "chunk_size_mb:64");
}

// A memory fraction moves every policy's top (and garbage collection classic's): the search starts where the
// policy runs as without a limit, not below it and then doubling.
TEST_CASE("fit: the top follows the memory fraction and classic's garbage collection", "[fit]") {
  formats::Trace t;
  std::string err;
  REQUIRE(make_workload("workload:transformer-infer:layers=4,steps=3", &t, &err));
  const std::uint64_t step = 32 * kMiB;
  for (PolicyKind p : kPolicies)
    for (const char* conf : {"per_process_memory_fraction:0.5", "per_process_memory_fraction:0.7,garbage_collection_threshold:0.6"}) {
      SearchOptions so;
      const ConfigResult cr = parse_config(conf);
      REQUIRE(cr.ok);
      so.replay.base = cr.options;
      const FitResult f = fit_capacity(t, 0, p, step, so);
      INFO(policy_name(p) << " " << conf << ": " << f.error);
      REQUIRE(f.error.empty());
      ReplayOptions o = so.replay;
      double from = static_cast<double>(replay::replay(t, 0, p, o).peak_reserved) / cr.options.per_process_memory_fraction;
      if (p == PolicyKind::classic && cr.options.garbage_collection_threshold > 0) from /= cr.options.garbage_collection_threshold;
      if (p == PolicyKind::fragless) from *= 2;
      const auto top = static_cast<std::uint64_t>(std::ceil(from / static_cast<double>(step))) * step;
      CHECK(f.top == top);
      // No doubling: the unlimited replay, every step from the top down to the answer, and the one below it.
      CHECK(static_cast<std::uint64_t>(f.replays) <= (f.top - f.min_capacity) / step + 2 + 4);
    }
}

TEST_CASE("fit: fragless fits every step from its answer to 8/3 of its peak reserved (zoo draws)", "[fit][property][seeded]") {
  const std::uint64_t seed = fragless::test::test_seed(20261206);
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const char* names[] = {"random", "unet2d", "moe", "pipeline"};
  for (int draw = 0; draw < 8; ++draw) {
    formats::Trace t;
    const std::string spec = zoo_draw(rng, names[draw % 4], &t);
    INFO("draw " << draw << ": " << spec);
    check_fragless_above_answer(t, 0, 32 * kMiB);
  }
}

TEST_CASE("fit: fragless fits every step from its answer to 8/3 of its peak reserved (real traces)", "[data][fit]") {
  CHECK(for_each_real_trace([](const formats::Trace& t, int d) { check_fragless_above_answer(t, d, kGiB / 4); }) >= 10);
}

TEST_CASE("max: the largest batch fits, one more does not", "[fit]") {
  for (PolicyKind p : kPolicies) {
    verify_max("workload:transformer-infer:layers=4,steps=3", "batch", p, 4 * kGiB, 1);
    verify_max("workload:transformer-train:layers=2,d_model=512,heads=8,d_ff=2048,steps=3", "batch", p, 6 * kGiB, 3);
    verify_max("workload:unet2d:res=256,steps=3", "batch", p, 3 * kGiB, 2);
    verify_max("workload:fsdp:layers=4,d_model=1024,steps=3", "batch", p, 4 * kGiB, 1);
    verify_max("workload:transformer-infer:layers=4,steps=3,batch=8", "max_seq", p, 2 * kGiB, 4);
    verify_max("workload:pipeline:layers=2,d_model=1024,d_ff=4096", "batch", p, 3 * kGiB, 2);
  }
}

TEST_CASE("fit and max: bad questions are clear errors", "[fit][bad-input]") {
  SearchOptions so;
  // A capacity that cannot hold the workload at its smallest value.
  MaxResult m = max_value("workload:transformer-train", "batch", PolicyKind::fragless, kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("does not fit at its smallest batch=1 (a larger device"));
  // A key whose memory falls as it grows: said so, not "a larger device is needed".
  m = max_value("workload:fsdp:layers=4,d_model=2048,batch=1,steps=2,max_seq=1024", "world", PolicyKind::fragless,
                kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("does not fit at its smallest world=1 but fits at world="));
  CHECK_THAT(m.error, Catch::Contains(": its memory does not grow with world"));
  // A key that is not numeric, or not a key at all, or an input that is a trace.
  m = max_value("workload:transformer-train", "dtype", PolicyKind::fragless, 80 * kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("key 'dtype' is not numeric"));
  CHECK_THAT(m.error, Catch::Contains("batch"));
  m = max_value("workload:unet2d", "width", PolicyKind::fragless, 80 * kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("workload unet2d has no key 'width' to search"));
  CHECK_THAT(m.error, Catch::Contains("--max-of KEY searches one of its keys: dims, base, res, levels"));
  CHECK_THAT(m.error, !Catch::Contains("jitter"));  // [0, 0.9]: no whole values to search between
  // --max-batch on a workload without a batch key: said so, with the keys --max-of could search instead.
  m = max_value("workload:moe", "batch", PolicyKind::fragless, 80 * kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("workload moe has no key 'batch' to search (--max-batch searches batch)"));
  CHECK_THAT(m.error, Catch::Contains("layers, experts"));
  m = max_value("workload:transformer-infer", "width", PolicyKind::fragless, 80 * kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("has no key 'width' to search; --max-of KEY searches one of its numeric keys: layers"));
  // A spec that sets the key the search varies: the search would replace its value, so it is refused.
  m = max_value("workload:transformer-infer:layers=2,batch=16", "batch", PolicyKind::fragless, 80 * kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("sets batch, the key the search varies: leave batch= out of the spec"));
  m = max_value("workload:unet2d:res=256,batch=2", "batch", PolicyKind::fragless, 80 * kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("sets batch, the key the search varies"));
  m = max_value("trace.pickle", "batch", PolicyKind::fragless, 80 * kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("this input is a trace"));
  m = max_value("workload:unet2d", "batch", PolicyKind::fragless, 0, so);
  CHECK_THAT(m.error, Catch::Contains("--capacity-gib"));
  // A search that cannot converge: the key does not bound memory.
  m = max_value("workload:transformer-infer:layers=2,steps=2", "seed", PolicyKind::classic, 80 * kGiB, so);
  CHECK_THAT(m.error, Catch::Contains("cannot converge"));
  CHECK(m.replays > 1);
  // It stops at seed=1e15, below the seeds a transformer workload takes ([0, 2^64)), and says so; a zoo
  // workload's seeds end there.
  CHECK_THAT(m.error, Catch::Contains("it still fits at seed=1000000000000000, where the search stops (the workload "
                                      "takes larger values; seed does not bound memory here)"));
  // A zoo workload's seeds end at 1e15: fitting there, that is the answer, marked as the workload's limit.
  m = max_value("workload:random:ops=10,steps=1", "seed", PolicyKind::classic, 80 * kGiB, so);
  CHECK(m.error.empty());
  CHECK(m.max_value == 1000000000000000LL);
  CHECK(m.at_limit);
  CHECK(m.at.ooms == 0);
  formats::Trace t;
  std::string seed_err;
  CHECK(make_workload("workload:transformer-infer:layers=2,steps=1,seed=18446744073709551615", &t, &seed_err));
  CHECK(make_workload("workload:random:ops=10,steps=1,seed=1000000000000000", &t, &seed_err));
  CHECK_FALSE(make_workload("workload:random:ops=10,steps=1,seed=1000000000000001", &t, &seed_err));
  CHECK_THAT(seed_err, Catch::Contains("seed='1000000000000001' is not an integer in [0, 1000000000000000]"));

  // An allocation larger than any device, a trace with nothing to replay, a step too fine.
  formats::Trace huge;
  huge.source = "huge";
  formats::Event e;
  e.op = formats::Op::alloc;
  e.address = 4096;
  e.size = 2 * kUnlimitedCapacity;
  huge.events.push_back(e);
  FitResult f = fit_capacity(huge, 0, PolicyKind::fragless, kGiB / 4, so);
  CHECK_THAT(f.error, Catch::Contains("even on"));
  formats::Trace empty;
  empty.source = "empty";
  f = fit_capacity(empty, 0, PolicyKind::fragless, kGiB / 4, so);
  CHECK_THAT(f.error, Catch::Contains("no allocations"));
  formats::Trace small;
  std::string err;
  REQUIRE(make_workload("workload:transformer-infer:layers=2,steps=2", &small, &err));
  f = fit_capacity(small, 0, PolicyKind::fragless, 4096, so);
  CHECK_THAT(f.error, Catch::Contains("at least 1 MiB"));
}

TEST_CASE("fit: every real trace, every policy (checked at the answer, every step above it to the top and one step below)", "[data][fit]") {
  CHECK(for_each_real_trace([](const formats::Trace& t, int d) {
          for (PolicyKind p : kPolicies) verify_fit(t, d, p, kGiB / 4, 2);
        }) >= 10);
}
