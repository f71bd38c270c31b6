// A conversion keeps what the replay measures: an RMM log written from a trace without times weighs each
// event by one unit again (Note [Times in a converted RMM log], rmm_csv.cpp), and allocations live before a
// window are stamped at its start, so the log's time span is the window's.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "replay.h"
#include "trace_model.h"
#include "workload.h"

using namespace fragless;
using namespace fragless::formats;

namespace {

constexpr std::int64_t kHourUs = 3'600'000'000, kDayUs = 24 * kHourUs;

double tw_frag(const Trace& t, PolicyKind p) {
  // Without background work, which runs on the trace's clock: the workload's modelled times and the log's
  // one unit per event would give it different time, and the fragless policy would hold other memory.
  replay::ReplayOptions o;
  o.base.background = BackgroundMode::off;
  const auto r = replay::replay(t, 0, p, o);
  REQUIRE(r.error.empty());
  return r.time_weighted_fragmentation;
}

Trace through_rmm(const Trace& t) {
  auto back = trace_from_rmm_csv(trace_to_rmm_csv(t, 0), "converted.csv");
  REQUIRE(back.ok);
  return back.trace;
}

std::pair<std::int64_t, std::int64_t> span(const Trace& t) {
  std::int64_t lo = -1, hi = -1;
  for (const auto& e : t.events)
    if (e.time_us >= 0) {
      lo = lo < 0 ? e.time_us : std::min(lo, e.time_us);
      hi = std::max(hi, e.time_us);
    }
  return {lo, hi};
}

}  // namespace

TEST_CASE("conversions: a trace without times keeps its time-weighted fragmentation through an RMM log", "[formats][replay]") {
  Trace t;
  std::string err;
  REQUIRE(replay::make_workload("workload:transformer-train:layers=4,steps=3,d_model=512", &t, &err));
  REQUIRE_FALSE(t.has_time);
  const Trace back = through_rmm(t);
  CHECK(back.has_time);
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless}) {
    INFO(policy_name(p));
    const double want = tw_frag(t, p);
    CHECK(want > 0.01);
    CHECK(tw_frag(back, p) == Approx(want).epsilon(1e-9));
  }
}

TEST_CASE("conversions: allocations live before the window are stamped at its start in an RMM log", "[formats][replay]") {
  const std::int64_t start = 6'000'000'000'000;  // wall-clock microseconds: about 1.7 billion seconds after 1970
  Trace t;
  t.has_time = true;
  for (std::uint64_t i = 0; i < 4; ++i) t.seed.push_back({Op::alloc, 0, 0, 0x1000 * (i + 1), (i + 1) << 20, 0, -1});
  for (std::uint64_t i = 0; i < 6; ++i) {
    t.events.push_back({Op::alloc, 0, 0, 0x100000 * (i + 1), 3u << 20, 0, start + static_cast<std::int64_t>(10 * i)});
    if (i % 2) t.events.push_back({Op::free, 0, 0, 0x100000 * i, 3u << 20, 0, start + static_cast<std::int64_t>(10 * i + 5)});
  }
  t.events.push_back({Op::free, 0, 0, 0x1000, 1u << 20, 0, start + 100});  // a pre-window allocation freed
  const Trace back = through_rmm(t);
  const auto [lo, hi] = span(back);
  CHECK(lo == start % kDayUs);  // the window's first time of day (an RMM log has no date), not 00:00:00
  CHECK(hi - lo == 100);        // the window's span
  for (PolicyKind p : {PolicyKind::expandable, PolicyKind::fragless})
    CHECK(tw_frag(back, p) == Approx(tw_frag(t, p)).epsilon(1e-9));
}

TEST_CASE("conversions: every real snapshot keeps its time-weighted fragmentation through an RMM log", "[formats][replay][data]") {
  const char* env = std::getenv("FRAGLESS_DATA_DIR");
  const std::string dir = env ? env : FRAGLESS_SOURCE_DIR "/../shared/data/traces/torch";
  REQUIRE(std::filesystem::exists(dir));
  int checked = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().extension() != ".pickle") continue;
    auto lr = load_trace(f.path().string());
    REQUIRE(lr.ok);
    bool replayable = false, empty_cache = false;
    for (const auto& e : lr.trace.events) {
      replayable |= e.device == 0 && e.op == Op::alloc;
      empty_cache |= e.op == Op::empty_cache;  // an RMM log has no such row
    }
    if (!replayable || empty_cache || lr.trace.devices() > 1) continue;
    INFO(f.path().filename().string());
    const Trace back = through_rmm(lr.trace);
    // classic also starts from the segments held before the window, which an RMM log cannot carry.
    for (PolicyKind p : {PolicyKind::expandable, PolicyKind::fragless})
      CHECK(tw_frag(back, p) == Approx(tw_frag(lr.trace, p)).epsilon(1e-6));
    ++checked;
  }
  CHECK(checked >= 10);
}

namespace {

Trace timed_allocations(std::initializer_list<std::int64_t> times) {
  Trace t;
  t.has_time = true;
  std::uint64_t address = 0;
  for (std::int64_t us : times) t.events.push_back({Op::alloc, 0, 0, address += 0x1000, 512, 0, us});
  return t;
}

// Every time of t reads back from its RMM log exactly, less `date` (the microseconds before its first day).
void reads_back_less(const Trace& t, std::int64_t date) {
  const Trace back = through_rmm(t);
  REQUIRE(back.events.size() == t.events.size());
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    INFO(i);
    CHECK(back.events[i].time_us == t.events[i].time_us - date);
  }
}

}  // namespace

// Note [Times of day in a converted RMM log]
TEST_CASE("conversions: an RMM log's times are times of day, and read back exactly", "[formats]") {
  // Wall-clock microseconds, as a snapshot has them: 23:59:59.5 on some day, then across two midnights in
  // steps of under 12 hours.
  const std::int64_t day = 20000 * kDayUs, late = day + 24 * kHourUs - 500000;
  const Trace t = timed_allocations({late, late + 1000000, late + 11 * kHourUs, late + 22 * kHourUs,
                                     late + 33 * kHourUs + 7});
  std::string lost;
  const std::string csv = trace_to_rmm_csv(t, 0, &lost);
  CHECK(lost == "the date of its times (an RMM log has the time of day)");
  // Hours 00 to 23, as RMM's logger writes them ("%H:%M:%S.%f").
  CHECK(csv.find(",23:59:59.500000,allocate,") != std::string::npos);
  CHECK(csv.find(",00:00:00.500000,allocate,") != std::string::npos);
  CHECK(csv.find(",10:59:59.500000,allocate,") != std::string::npos);
  CHECK(csv.find(",21:59:59.500000,allocate,") != std::string::npos);
  CHECK(csv.find(",08:59:59.500007,allocate,") != std::string::npos);
  reads_back_less(t, day);
}

TEST_CASE("conversions: an RMM log of a trace with rows 12 hours apart or more counts hours since its first midnight", "[formats]") {
  // Across midnight in a step of 13 hours: as times of day it would read as a step 11 hours back, refused.
  const std::int64_t day = 20000 * kDayUs, first = day + 20 * kHourUs;
  const Trace t = timed_allocations({first, first + 13 * kHourUs, first + 13 * kHourUs + 5, first + 50 * kHourUs});
  std::string lost;
  const std::string csv = trace_to_rmm_csv(t, 0, &lost);
  CHECK(lost == "the date of its times (an RMM log has the time of day); the time of day after the first day: rows "
                "12 hours apart or more, so its times are hours since the first row's midnight");
  CHECK(csv.find(",20:00:00.000000,allocate,") != std::string::npos);
  CHECK(csv.find(",33:00:00.000005,allocate,") != std::string::npos);
  CHECK(csv.find(",70:00:00.000000,allocate,") != std::string::npos);
  reads_back_less(t, day);
  // A trace without a date (times from 0) loses nothing.
  trace_to_rmm_csv(timed_allocations({0, 5, kHourUs}), 0, &lost);
  CHECK(lost.empty());
}
