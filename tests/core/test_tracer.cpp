// The runtime tracer and the native format: paths, recording through the Allocator, flushing, replaying
// what was recorded, truncated and corrupt files; conversions between every pair of formats.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fragless/allocator.h"
#include "fragless/trace_format.h"
#include "fragless/tracer.h"
#include "helpers.h"
#include "os_probes.h"
#include "pickle.h"
#include "seed.h"
#include "replay.h"
#include "trace/trace_clock.h"
#include "trace_model.h"
#include "workload.h"

using namespace fragless;
using namespace fragless::formats;

namespace {

std::string temp_dir() {
  auto d = std::filesystem::temp_directory_path() / ("fragless-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

using os_probes::slurp;

std::size_t count(const Trace& t, Op op, int device = -1) {
  std::size_t n = 0;
  for (auto& e : t.events) n += e.op == op && (device < 0 || e.device == device);
  return n;
}

}  // namespace

// Note [The trace clock]: a line whose rate is off (as a 2 ms first measure leaves it, here far worse) is
// refitted to the monotonic clock, and no time it gives steps back, whichever way and however far it was off.
TEST_CASE("trace clock: refits bring a skewed counter back to the monotonic clock, never stepping back", "[tracer]") {
  if (!TraceClock::steady_tsc()) {
    WARN("SKIPPED: this processor has no invariant time-stamp counter; the trace clock is the monotonic clock");
    return;
  }
  using namespace std::chrono;
  struct Case {
    double ppm;
    bool refits;
    std::unique_ptr<TraceClock> clock;
    std::uint64_t last = 0;
  };
  std::vector<Case> cases;
  for (const double ppm : {2000.0, -2000.0, 500000.0, -600000.0})
    for (const bool refits : {true, false}) {
      cases.push_back({ppm, refits, std::make_unique<TraceClock>(TraceClock::Source::tsc, milliseconds(20))});
      cases.back().clock->skew_for_test(ppm);
    }
  // The clock's error against the monotonic clock: the smallest of a few reads, so a preemption between the
  // two reads does not count.
  auto error_ns = [](TraceClock& c) {
    double best = 1e18;
    for (int i = 0; i < 16; ++i) {
      const double a = static_cast<double>(c.monotonic_now()), t = static_cast<double>(c.now()),
                   b = static_cast<double>(c.monotonic_now());
      if (std::abs(t - (a + b) / 2) < std::abs(best)) best = t - (a + b) / 2;
    }
    return best;
  };
  // Ticks kept to be converted at the end, as a writer converts what a buffer has held since: by the line that
  // held when each was read, through every refit since (9 lines by the end, one more than are kept).
  struct Kept {
    std::uint64_t time_ns;  // ticks, then nanoseconds
    std::uint64_t mono_ns;
  };
  std::vector<std::vector<Kept>> kept(cases.size());
  const auto until = steady_clock::now() + milliseconds(1500);
  std::size_t steps = 0;
  while (steady_clock::now() < until) {
    for (std::size_t k = 0; k < cases.size(); ++k) {
      Case& c = cases[k];
      const std::uint64_t t = c.clock->now();
      INFO("skew " << c.ppm << " ppm, refits " << c.refits << ", step " << steps);
      REQUIRE(t >= c.last);
      c.last = t;
      if (steps % 16 == 0) kept[k].push_back({c.clock->ticks(), c.clock->monotonic_now()});
      if (c.refits) c.clock->refine();
    }
    ++steps;
    std::this_thread::sleep_for(microseconds(200));
  }
  for (std::size_t k = 0; k < cases.size(); ++k) {
    Case& c = cases[k];
    c.clock->to_ns(kept[k].data(), kept[k].size());
    std::size_t near = 0, late = 0;
    for (std::size_t i = 0; i < kept[k].size(); ++i) {
      INFO("skew " << c.ppm << " ppm, refits " << c.refits << ", kept tick " << i);
      if (i) REQUIRE(kept[k][i].time_ns >= kept[k][i - 1].time_ns);  // converted late, still in order
      if (kept[k][i].mono_ns > 200'000'000) {
        ++late;
        near += std::abs(static_cast<double>(kept[k][i].time_ns) - static_cast<double>(kept[k][i].mono_ns)) < 50e3;
      }
    }
    // Converted late, a tick read after the first refits gets the time its line gave then: within 50 µs of the
    // monotonic clock where the skew was refitted away (a tick read just before a refit may be a little off).
    if (c.refits && std::abs(c.ppm) <= 2000) CHECK(near >= late * 9 / 10);
    const double err = error_ns(*c.clock);
    INFO("skew " << c.ppm << " ppm, refits " << c.refits << ": " << err << " ns off the monotonic clock after 1.5 s");
    if (c.refits)
      CHECK(std::abs(err) < 50e3);  // refitted at 20, 60, 140, ... 1260 ms
    else
      CHECK(std::abs(err) > 1e6);  // 2000 ppm of 1.5 s is 3 ms: what the refits removed
  }
}

TEST_CASE("tracer: path patterns expand pid, device and rank", "[tracer]") {
  std::string err;
  CHECK(expand_trace_path("/t/run-%p-%d-%r.fgt", 3, 42, 7, &err) == "/t/run-42-3-7.fgt");
  CHECK(expand_trace_path("a%%b", 0, 1, -1, &err) == "a%b");
  CHECK(expand_trace_path("x%r", 0, 1, -1, &err) == "x0");  // no RANK: rank 0
  CHECK(expand_trace_path("x%q", 0, 1, 0, &err).empty());
  CHECK(err.find("'%' must be followed by") != std::string::npos);
  auto bad = parse_config("trace:/tmp/x%q");
  CHECK_FALSE(bad.ok);
  CHECK(bad.error.find("'trace'") != std::string::npos);
  auto good = parse_config("trace:/tmp/x-%p-%d.fgt");
  REQUIRE(good.ok);
  CHECK(good.options.trace == "/tmp/x-%p-%d.fgt");
}

// Note [Opening a trace file], from a review of the tracer: "%%d" is no device token; a FIFO is refused instead
// of blocking the first allocation; a file another open holds is refused instead of truncated under it.
TEST_CASE("tracer: %%d is one file, a FIFO and a file already being written are refused", "[tracer]") {
  const std::string dir = temp_dir();
  std::string err;
  {
    auto t = Tracing::open(dir + "/pct%%d.fgt", 2, "fragless", &err);
    INFO(err);
    REQUIRE(t);
    REQUIRE(t->paths().size() == 1);
    CHECK(t->paths()[0] == dir + "/pct%d.fgt");
  }
  const std::string fifo = dir + "/fifo";
  std::filesystem::remove(fifo);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_FALSE(Tracing::open(fifo, 1, "fragless", &err));  // returns at once: no reader needed
  CHECK(err == "fragless: the trace path '" + fifo + "' is a FIFO (a trace is written to a regular file, or to /dev/null)");
  {
    auto first = Tracing::open(dir + "/busy.fgt", 1, "fragless", &err);
    REQUIRE(first);
    err.clear();
    CHECK_FALSE(Tracing::open(dir + "/busy.fgt", 1, "fragless", &err));
    CHECK(err.find("another process is writing the trace file '" + dir + "/busy.fgt'") != std::string::npos);
    CHECK(std::filesystem::file_size(dir + "/busy.fgt") > 0);  // the first one's header is still there
  }
  CHECK(Tracing::open(dir + "/busy.fgt", 1, "fragless", &err));  // free again once the first is closed
  std::filesystem::remove_all(dir);
}

TEST_CASE("tracer: records every event, per device, and replays to the same reserved peak", "[tracer][seeded]") {
  const std::string dir = temp_dir();
  // No background work: when the worker runs depends on the threads' timing, and the replay below must
  // make the same decisions as the traced run. The sim driver, as in the replay: the policies break ties
  // by address, and the host driver's addresses come from mmap, whose order depends on what else the
  // process maps meanwhile (a thread's malloc arena, created when the thread first allocates), so on the
  // host driver the same requests can be placed differently from one run to the next.
  auto parsed = parse_config("driver:sim,capacity_mb:1024,background:False,trace:" + dir + "/rec-%d.fgt");
  REQUIRE(parsed.ok);
  std::string err;
  std::vector<std::string> paths;
  std::int64_t live_peak_reserved[2] = {0, 0};
  std::size_t allocs[2] = {0, 0}, frees[2] = {0, 0};
  auto unix_us = [] {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  };
  const std::int64_t began_us = unix_us();
  {
    auto a = Allocator::create(parsed.options, 2, &err);
    REQUIRE(a);
    paths = a->trace_paths();
    REQUIRE(paths.size() == 2);
    const std::uint64_t seed = fragless::test::test_seed(7);
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    for (int d = 0; d < 2; ++d) {
      DeviceEngine* e = a->device(d);
      std::vector<void*> live;
      for (int i = 0; i < 3000; ++i) {
        if (live.size() < 60 && (live.empty() || rng() % 2 != 0)) {
          const std::size_t size = rng() % 4 == 0 ? (1 + rng() % 24) << 20 : 512 * (1 + rng() % 2000);
          void* p = e->allocate(size, 1 + rng() % 2, nullptr);
          REQUIRE(p);
          ++allocs[d];
          if (rng() % 10 == 0) e->record_stream(p, 9);
          live.push_back(p);
        } else {
          const std::size_t k = rng() % live.size();
          REQUIRE(e->free(live[k]) == Status::ok);
          ++frees[d];
          live.erase(live.begin() + static_cast<long>(k));
        }
        if (i == 1500) e->empty_cache();
      }
      for (void* p : live) e->free(p), ++frees[d];
      e->empty_cache();  // completes the frees still waiting for their streams
      live_peak_reserved[d] = e->stats().reserved_bytes.all().peak;
    }
    a->flush_traces();
    // Flushed while the allocator is alive: the records are in the file already.
    auto mid = load_trace(paths[0]);
    REQUIRE(mid.ok);
    CHECK(count(mid.trace, Op::alloc) == allocs[0]);
  }
  for (int d = 0; d < 2; ++d) {
    auto r = load_trace(paths[static_cast<std::size_t>(d)]);
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(r.warning.empty());
    CHECK(r.trace.has_time);
    CHECK(count(r.trace, Op::alloc, d) == allocs[d]);
    CHECK(count(r.trace, Op::free, d) == frees[d]);
    CHECK(count(r.trace, Op::empty_cache, d) == 2);
    CHECK(count(r.trace, Op::free_requested, d) > 0);  // record_stream'd blocks wait for their events
    CHECK(count(r.trace, Op::segment_map, d) + count(r.trace, Op::phys_create, d) > 0);
    for (std::size_t i = 1; i < r.trace.events.size(); ++i)
      REQUIRE(r.trace.events[i].time_us >= r.trace.events[i - 1].time_us);
    // The records' counter ticks were made nanoseconds of the recording (Note [The trace clock]): every time
    // is within it (a millisecond either side for the wall clock's own steps).
    const std::int64_t ended_us = unix_us();
    CHECK(r.trace.events.front().time_us >= began_us - 1000);
    CHECK(r.trace.events.back().time_us <= ended_us + 1000);
    // The engine is deterministic: replaying the recorded requests through the same policy on the sim
    // driver reserves exactly what the traced run reserved. (It once was not: the policy's decisions
    // depended on where the heap put its segments, Note [Strips die with their segment]; and the replay
    // kept cached what an empty_cache had released, Note [Frees an empty_cache completes].)
    replay::ReplayOptions ro;
    ro.base.background = BackgroundMode::off;
    auto res = replay::replay(r.trace, d, PolicyKind::fragless, ro);
    REQUIRE(res.error.empty());
    CHECK(res.peak_reserved == live_peak_reserved[d]);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("replay: the frees an empty_cache completes are released by it, as in the traced run", "[tracer]") {
  // Note [Frees an empty_cache completes]: a record_stream'd block freed just before empty_cache goes back
  // to the cache inside the call and is released by it, though its `free` record follows the call's.
  const std::string dir = temp_dir();
  // The classic policy: a block cached on stream 1 serves no request of stream 2, so a block the replay
  // kept cached shows in the peak.
  auto parsed = parse_config("driver:sim,policy:classic,background:False,trace:" + dir + "/ec-%d.fgt");
  REQUIRE(parsed.ok);
  std::string err, path;
  std::int64_t live_peak_reserved = 0;
  {
    auto a = Allocator::create(parsed.options, 1, &err);
    REQUIRE(a);
    path = a->trace_paths()[0];
    DeviceEngine* e = a->device(0);
    void* big = e->allocate(40 << 20, 1, nullptr);
    REQUIRE(big);
    REQUIRE(e->record_stream(big, 9) == Status::ok);
    REQUIRE(e->free(big) == Status::ok);  // waits for its event: completed by the empty_cache
    e->empty_cache();
    CHECK(e->usage().reserved == 0);
    void* next = e->allocate(40 << 20, 2, nullptr);
    REQUIRE(next);
    e->free(next);
    live_peak_reserved = e->stats().reserved_bytes.all().peak;
  }
  auto r = load_trace(path);
  REQUIRE(r.ok);
  CHECK(count(r.trace, Op::free_requested) == 1);
  replay::ReplayOptions ro;
  ro.base.background = BackgroundMode::off;
  auto res = replay::replay(r.trace, 0, PolicyKind::classic, ro);
  REQUIRE(res.error.empty());
  CHECK(live_peak_reserved == 40 << 20);
  CHECK(res.peak_reserved == live_peak_reserved);
  std::filesystem::remove_all(dir);
}

TEST_CASE("tracer: without %d every device shares one file", "[tracer]") {
  const std::string dir = temp_dir();
  auto parsed = parse_config("driver:sim,trace:" + dir + "/shared.fgt");
  REQUIRE(parsed.ok);
  std::string err;
  std::string path;
  {
    auto a = Allocator::create(parsed.options, 3, &err);
    REQUIRE(a);
    REQUIRE(a->trace_paths().size() == 1);
    path = a->trace_paths()[0];
    for (int d = 0; d < 3; ++d)
      for (int i = 0; i < 20000; ++i) a->device(d)->free(a->device(d)->allocate(4096 * (1 + i % 7), 0, nullptr));
  }
  auto r = load_trace(path);
  REQUIRE(r.ok);
  for (int d = 0; d < 3; ++d) CHECK(count(r.trace, Op::alloc, d) == 20000);
  std::filesystem::remove_all(dir);
}

TEST_CASE("tracer: an unwritable path is a clear error", "[tracer][bad-input]") {
  auto parsed = parse_config("driver:sim,trace:/nonexistent-dir/x.fgt");
  REQUIRE(parsed.ok);
  std::string err;
  CHECK_FALSE(Allocator::create(parsed.options, 1, &err));
  CHECK(err.find("cannot open trace file '/nonexistent-dir/x.fgt'") != std::string::npos);
}

// From a review of the tracer (docs/RELIABILITY.md, "Hostile reviews (2026-12-06, fourth)").
TEST_CASE("tracer: an earlier trace at the path is kept as PATH.prev, and said", "[tracer]") {
  // Note [An earlier trace at the path]: a restarted job (torchrun keeps RANK) or an exec'd image (the pid stays)
  // emptied the trace of the run before it.
  const std::string dir = temp_dir();
  const std::string path = dir + "/again.fgt";
  std::filesystem::remove(path);
  std::filesystem::remove(path + ".prev");
  auto run = [&](int pairs) {
    auto a = test::allocator_from("driver:sim,trace:" + path, 1);
    DeviceEngine* e = a->device(0);
    for (int i = 0; i < pairs; ++i) REQUIRE(e->free(e->allocate(4096, 0, nullptr)) == Status::ok);
  };
  run(10);
  run(3);
  auto prev = load_trace(path + ".prev");
  INFO(prev.error);
  REQUIRE(prev.ok);
  CHECK(count(prev.trace, Op::alloc) == 10);
  auto now = load_trace(path);
  REQUIRE(now.ok);
  CHECK(count(now.trace, Op::alloc) == 3);
  // A file that is no trace is kept too, byte for byte; a header alone (a run that made no event) is not.
  { std::ofstream(path) << "notes the user kept here\n"; }
  run(1);
  CHECK(slurp(path + ".prev") == "notes the user kept here\n");
  std::filesystem::remove(path);
  {
    std::string err;
    auto t = Tracing::open(path, 1, "fragless", &err);  // a header, no record
    REQUIRE(t);
  }
  run(2);
  CHECK(slurp(path + ".prev") == "notes the user kept here\n");
  // A path that is a link: the target is kept and made again, the link stays a link (a review of the first
  // version found the link itself renamed, and the trace then written beside it).
  const std::string target = dir + "/target.fgt", link = dir + "/link.fgt";
  std::filesystem::create_symlink(target, link);
  auto run_at = [&](const std::string& p, int pairs) {
    auto a = test::allocator_from("driver:sim,trace:" + p, 1);
    DeviceEngine* e = a->device(0);
    for (int i = 0; i < pairs; ++i) REQUIRE(e->free(e->allocate(4096, 0, nullptr)) == Status::ok);
  };
  run_at(link, 4);
  run_at(link, 5);
  CHECK(std::filesystem::is_symlink(link));
  CHECK(count(load_trace(target + ".prev").trace, Op::alloc) == 4);
  CHECK(count(load_trace(target).trace, Op::alloc) == 5);
  {  // a message names the path as given
    std::string err;
    std::filesystem::create_directories(dir + "/folder");
    std::filesystem::create_symlink(dir + "/folder", dir + "/to-folder.fgt");
    CHECK_FALSE(Tracing::open(dir + "/to-folder.fgt", 1, "fragless", &err));
    CHECK(err.find("the trace path '" + dir + "/to-folder.fgt' is a directory") != std::string::npos);
  }
  // PATH.prev another name of the file at PATH (a hard link): the earlier trace stays there, and the new one
  // is made (the rename would have done nothing, and the new file then seemed made by another process).
  std::filesystem::remove(target + ".prev");
  std::filesystem::create_hard_link(target, target + ".prev");
  run_at(target, 6);
  CHECK(count(load_trace(target + ".prev").trace, Op::alloc) == 5);
  CHECK(count(load_trace(target).trace, Op::alloc) == 6);
  // Where the earlier file cannot be renamed (a folder named PATH.prev), it is emptied in place, and the
  // descriptor kept for it is not inherited across exec (it holds the file's lock).
  std::filesystem::create_directories(target + ".prev.d");
  std::filesystem::remove(target + ".prev");
  std::filesystem::rename(target + ".prev.d", target + ".prev");
  {
    std::string err;
    auto t = Tracing::open(target, 1, "fragless", &err);
    REQUIRE(t);
    bool found = false;
    for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      if (std::filesystem::read_symlink(fd.path(), ec) != target) continue;
      found = true;
      CHECK((::fcntl(std::stoi(fd.path().filename().string()), F_GETFD) & FD_CLOEXEC) != 0);
    }
    CHECK(found);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("tracer: a trace file removed while written is said lost, and flush_traces says so", "[tracer]") {
  // Note [A trace file removed while written]: every record went to a file with no name, and nothing said so.
  const std::string dir = temp_dir();
  auto a = test::allocator_from("driver:sim,background:False,trace:" + dir + "/gone.fgt", 1);
  DeviceEngine* e = a->device(0);
  for (int i = 0; i < 10; ++i) REQUIRE(e->free(e->allocate(4096, 0, nullptr)) == Status::ok);
  CHECK(a->flush_traces().empty());
  REQUIRE(std::filesystem::remove(dir + "/gone.fgt"));
  REQUIRE(e->free(e->allocate(4096, 0, nullptr)) == Status::ok);
  const std::string lost = a->flush_traces();  // at once: a flush asks too, not only the writer every 100 ms
  // The 10 pairs written before the removal (20 records, besides the segment's) are lost with it, and counted.
  CHECK(lost.find("trace records are missing from " + dir + "/gone.fgt: it was removed while it was written, with "
                  "the records written to it") != std::string::npos);
  CHECK(std::stoull(lost.substr(lost.find(": ") + 2)) >= 20);
  a.reset();
  std::filesystem::remove_all(dir);
}

TEST_CASE("tracer: %r with a RANK that is not a rank is refused, and the checks look at every device's file",
          "[tracer][bad-input]") {
  const char* saved = std::getenv("RANK");
  const std::string keep = saved ? saved : "";
  std::string err;
  for (const char* bad : {"abc", "3x", " 3", "-1", "+2", "1000001", "99999999999999999999"}) {
    ::setenv("RANK", bad, 1);
    CAPTURE(bad);
    CHECK(rank_from_environment() == kRankInvalid);
    err.clear();
    CHECK(expand_trace_path("/t/r%r.fgt", 0, 1, rank_from_environment(), &err).empty());
    CHECK(err == std::string("fragless: the trace path '/t/r%r.fgt' has %r, but RANK='") + bad +
                     "' in the environment is not a rank (a whole number from 0 to 1000000)");
    CHECK(expand_trace_path("/t/p%p.fgt", 0, 1, rank_from_environment(), &err) == "/t/p1.fgt");  // no %r: no matter
  }
  ::setenv("RANK", "12", 1);
  CHECK(expand_trace_path("/t/r%r.fgt", 0, 1, rank_from_environment(), &err) == "/t/r12.fgt");
  if (saved) ::setenv("RANK", keep.c_str(), 1);
  else ::unsetenv("RANK");

  const std::string dir = temp_dir();
  std::filesystem::create_directories(dir + "/dev0");
  std::filesystem::remove_all(dir + "/dev1");
  CHECK(trace_path_usable(dir + "/dev%d/t.fgt", 1, &err));
  CHECK_FALSE(trace_path_usable(dir + "/dev%d/t.fgt", 2, &err));
  CHECK(err == "fragless: cannot open trace file '" + dir + "/dev1/t.fgt': its folder '" + dir +
                   "/dev1': No such file or directory");
  CHECK(trace_path_usable(dir + "/dev0/all.fgt", 2, &err));  // no %d: one file
  // Made inside a program's first allocation (the C ABI, the interposer), after the checks: a file that
  // cannot be opened then leaves the process untraced instead of failing every allocation.
  auto parsed = parse_config("driver:sim,trace:" + dir + "/dev%d/t.fgt");
  REQUIRE(parsed.ok);
  CHECK_FALSE(Allocator::create(parsed.options, 2, &err));
  auto lazy = Allocator::create(parsed.options, 2, &err, /*eager=*/false);
  REQUIRE(lazy);
  CHECK(lazy->trace_paths().empty());
  REQUIRE(lazy->device(1));
  void* p = lazy->device(1)->allocate(4096, 0, nullptr);
  CHECK(p);
  lazy->device(1)->free(p);
  std::filesystem::remove_all(dir);
}

// Note [Reading a native trace in blocks]: load_trace reads a native file a block (21,845 records) at a time;
// every answer, events, warnings and errors alike, is the one reading the same bytes from memory gives, also
// where a zero tail, a zero record or a cut falls in a later block or across blocks' edges.
TEST_CASE("native format: a file read a block at a time reads as the same bytes in memory", "[formats][bad-input]") {
  Trace t;
  std::string err;
  REQUIRE(replay::make_workload("workload:transformer-train:steps=40,layers=24", &t, &err));
  const std::string good = trace_to_native(t);
  const std::size_t records = (good.size() - 64) / 48;
  REQUIRE(records > 2 * 21845 + 100);  // three blocks at least
  auto at = [](std::size_t record) { return static_cast<std::ptrdiff_t>(64 + 48 * record); };
  std::vector<std::pair<std::string, std::string>> cases;
  cases.push_back({"whole", good});
  cases.push_back({"cut mid-record", good.substr(0, good.size() - 20)});
  cases.push_back({"a partial zero record", good + std::string(100, '\0')});
  cases.push_back({"a zero tail of three blocks", good + std::string(3 * 21845 * 48 + 17, '\0')});
  std::string b = good;
  std::fill(b.begin() + at(30000), b.begin() + at(30001), '\0');
  cases.push_back({"a zero record in the second block", b});
  b = good;
  std::fill(b.begin() + at(21845 - 3), b.end(), '\0');
  cases.push_back({"zeros from the end of the first block on", b});
  b = good;
  std::fill(b.begin() + at(21845), b.end(), '\0');
  cases.push_back({"zeros from the second block's first record on", b});
  b = good;
  b[static_cast<std::size_t>(at(2 * 21845 + 7) + 43)] = 0x11;  // a marker in the third block
  cases.push_back({"a garbage record in the third block", b});
  cases.push_back({"a header alone", good.substr(0, 64)});
  cases.push_back({"a header cut short", good.substr(0, 30)});
  const std::string dir = temp_dir();
  for (const auto& [what, bytes] : cases) {
    const std::string path = dir + "/blocks.fgt";
    {
      std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    const LoadResult mem = trace_from_native_bytes(bytes, path), file = load_trace(path);
    INFO(what << ": " << mem.error << " / " << file.error);
    REQUIRE(file.ok == mem.ok);
    CHECK(file.error == mem.error);
    CHECK(file.warning == mem.warning);
    if (!mem.ok) continue;
    CHECK(file.format == Format::native);
    CHECK(file.trace.has_time == mem.trace.has_time);
    CHECK(file.trace.seed.size() == mem.trace.seed.size());
    CHECK(file.trace.pre_segments.size() == mem.trace.pre_segments.size());
    REQUIRE(file.trace.events.size() == mem.trace.events.size());
    for (std::size_t i = 0; i < mem.trace.events.size(); ++i) {
      const formats::Event &x = file.trace.events[i], &y = mem.trace.events[i];
      REQUIRE((x.op == y.op && x.device == y.device && x.stream == y.stream && x.address == y.address &&
               x.size == y.size && x.block_size == y.block_size && x.time_us == y.time_us));
    }
  }
  // A file cut short after it was opened (another process replacing it): said so, not as a read error. The
  // size the reader was given stands for the one it found when it opened the file.
  {
    const std::string path = dir + "/shrunk.fgt";
    std::ofstream(path, std::ios::binary | std::ios::trunc).write(good.data(), static_cast<std::streamsize>(good.size()));
    const int fd = ::open(path.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    const LoadResult cut = trace_from_native_file(fd, good.size() + 4800, path);
    ::close(fd);
    CHECK_FALSE(cut.ok);
    CHECK(cut.error == path + ": it was cut short while it was read (" + std::to_string(good.size() + 4800) +
                           " bytes when opened, " + std::to_string(good.size()) +
                           " now): another process is replacing it; read it again once it is written");
  }
  // What the cases are, so that they test what they name.
  CHECK(trace_from_native_bytes(cases[4].second, "z").error.find("corrupt record 30000 at byte " +
                                                                  std::to_string(at(30000))) != std::string::npos);
  CHECK(trace_from_native_bytes(cases[5].second, "z").warning.find("read 21842 complete records") != std::string::npos);
  CHECK(trace_from_native_bytes(cases[3].second, "z").warning.find("read " + std::to_string(records) +
                                                                    " complete records") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("native format: cut short, corrupt, other versions", "[formats][bad-input]") {
  Trace t;
  std::string err;
  REQUIRE(replay::make_workload("workload:transformer-train:steps=1,layers=2", &t, &err));
  const std::string good = trace_to_native(t);
  REQUIRE((good.size() - 64) % 48 == 0);
  const std::size_t records = (good.size() - 64) / 48;

  SECTION("a crash mid-record: reads up to the last complete record, with a warning") {
    auto r = trace_from_native_bytes(good.substr(0, good.size() - 20), "cut.fgt");
    REQUIRE(r.ok);
    // Blocks live before the window come back as the seed, not as allocations of the window.
    CHECK(r.trace.seed.size() == t.seed.size());
    CHECK(r.trace.events.size() + r.trace.seed.size() == records - 1);
    CHECK(r.warning.find("partial record at byte") != std::string::npos);
  }
  SECTION("a machine's crash: zero bytes where the last blocks were never written, read up to them") {
    // Note [A zero-filled tail]: the file's last record ends in zero bytes (its sequence's high bytes), and a
    // zero record in the middle is corruption still.
    auto r = trace_from_native_bytes(good + std::string(8192, '\0'), "z.fgt");
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(r.trace.events.size() + r.trace.seed.size() == records);
    CHECK(r.warning == "z.fgt: the trace ends in 8192 zero bytes from byte " + std::to_string(good.size()) +
                           " (blocks never written, as a crash of the machine leaves them); read " +
                           std::to_string(records) +
                           " complete records before them (events, and the segments and blocks present before the first)");
    auto cut = trace_from_native_bytes(good.substr(0, good.size() - 48) + std::string(100, '\0'), "z2.fgt");
    REQUIRE(cut.ok);
    CHECK(cut.trace.events.size() + cut.trace.seed.size() == records - 1);
    std::string mid = good;
    std::fill(mid.begin() + 64 + 48 * 5, mid.begin() + 64 + 48 * 6, '\0');
    auto bad = trace_from_native_bytes(mid, "zm.fgt");
    CHECK_FALSE(bad.ok);
    CHECK(bad.error.find("corrupt record 5 at byte 304") != std::string::npos);
  }
  SECTION("header cut short") {
    auto r = trace_from_native_bytes(good.substr(0, 30), "h.fgt");
    CHECK_FALSE(r.ok);
    CHECK(r.error.find("h.fgt: native trace header cut short") != std::string::npos);
  }
  SECTION("unknown version") {
    std::string b = good;
    b[8] = 9;
    auto r = trace_from_native_bytes(b, "v.fgt");
    CHECK_FALSE(r.ok);
    CHECK(r.error.find("unsupported native trace version 9") != std::string::npos);
  }
  SECTION("garbage record") {
    std::string b = good;
    b[64 + 48 * 5 + 43] = 0x11;  // marker of record 5
    auto r = trace_from_native_bytes(b, "g.fgt");
    CHECK_FALSE(r.ok);
    CHECK(r.error.find("corrupt record 5 at byte 304") != std::string::npos);
  }
  SECTION("a free of an address never allocated") {
    Trace bad;
    bad.events.push_back({Op::free, 0, 0, 0x1000, 512, 0, -1});
    auto r = trace_from_native_bytes(trace_to_native(bad), "f.fgt");
    CHECK_FALSE(r.ok);
    CHECK(r.error.find("free of address 0x1000 that was never allocated") != std::string::npos);
  }
}

TEST_CASE("conversions: native, RMM CSV and PyTorch snapshots carry the same allocations", "[formats]") {
  Trace t;
  std::string err;
  REQUIRE(replay::make_workload("workload:transformer-train:steps=2,layers=3", &t, &err));
  auto allocs_frees = [](const Trace& x) {
    std::vector<std::tuple<int, std::uint64_t, std::uint64_t>> v;
    for (auto& s : x.seed) v.emplace_back(0, s.address, s.size);
    for (auto& e : x.events)
      if (e.op == Op::alloc || e.op == Op::free) v.emplace_back(e.op == Op::alloc ? 0 : 1, e.address, e.size);
    return v;
  };
  const auto expect = allocs_frees(t);
  auto native = trace_from_native_bytes(trace_to_native(t), "n");
  REQUIRE(native.ok);
  CHECK(allocs_frees(native.trace) == expect);
  auto csv = trace_from_rmm_csv(trace_to_rmm_csv(native.trace, 0), "c");
  REQUIRE(csv.ok);
  CHECK(allocs_frees(csv.trace) == expect);
  const std::string snap = trace_to_snapshot(csv.trace);
  auto back = trace_from_snapshot_bytes(snap, "s");
  INFO(back.error);
  REQUIRE(back.ok);
  CHECK(allocs_frees(back.trace) == expect);
  // The same peak through any format.
  auto a = replay::replay(t, 0, PolicyKind::classic, 0), b = replay::replay(back.trace, 0, PolicyKind::classic, 0);
  CHECK(a.peak_reserved == b.peak_reserved);
  CHECK(a.peak_live == b.peak_live);
}

TEST_CASE("snapshot writer: segments tile their blocks as PyTorch's viewer asserts", "[formats]") {
  // A recorded run with mapped pages and blocks still live at the end.
  const std::string dir = temp_dir();
  auto parsed = parse_config("driver:sim,policy:expandable,trace:" + dir + "/s.fgt");
  REQUIRE(parsed.ok);
  std::string err, path;
  {
    auto a = Allocator::create(parsed.options, 1, &err);
    REQUIRE(a);
    path = a->trace_paths()[0];
    DeviceEngine* e = a->device(0);
    std::vector<void*> keep;
    for (int i = 0; i < 200; ++i) {
      void* p = e->allocate((1 + i % 13) * 300000, 0, nullptr);
      if (i % 3) e->free(p);
      else keep.push_back(p);
    }
    a->flush_traces();
    auto r = load_trace(path);
    REQUIRE(r.ok);
    auto pr = read_pickle(trace_to_snapshot(r.trace));
    REQUIRE(pr.value);
    const PyValue* segs = pr.value->get("segments");
    REQUIRE(segs);
    // Each segment's blocks start at its address and follow each other without gap or overlap to its end;
    // segments do not overlap; the live blocks are exactly the ones kept, at their addresses.
    std::set<std::uint64_t> live_at;
    std::map<std::uint64_t, std::uint64_t> segment_ranges;
    for (auto& s : segs->items) {
      const std::uint64_t base = s->get("address")->as_uint(), total = s->get("total_size")->as_uint();
      INFO("segment at " << base << " of " << total << " bytes");
      CHECK(segment_ranges.emplace(base, base + total).second);
      std::uint64_t at = base;
      for (auto& b : s->get("blocks")->items) {
        CHECK(b->get("address")->as_uint() == at);
        at += b->get("size")->as_uint();
        if (b->get("state")->s == "active_allocated") live_at.insert(b->get("address")->as_uint());
      }
      CHECK(at == base + total);
    }
    std::uint64_t end = 0;
    for (auto [lo, hi] : segment_ranges) {
      CHECK(lo >= end);
      end = hi;
    }
    std::set<std::uint64_t> kept;
    for (void* p : keep) kept.insert(reinterpret_cast<std::uint64_t>(p));
    CHECK(live_at == kept);
    const PyValue* traces = pr.value->get("device_traces");
    REQUIRE(traces);
    REQUIRE(traces->items.size() == 1);
    std::size_t maps = 0;
    for (auto& ev : traces->items[0]->items) maps += ev->get("action")->s == "segment_map";
    CHECK(maps > 0);
    for (void* p : keep) e->free(p);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("pickle writer: integers of every width and strings round-trip", "[formats]") {
  PickleWriter w;
  w.begin_list();
  const std::int64_t ints[] = {0, 255, 256, 65535, 65536, -1, -129, INT32_MAX, INT32_MIN, 1ll << 40, -(1ll << 40), INT64_MAX, INT64_MIN};
  for (auto v : ints) w.integer(v);
  w.str(std::string(300, 'x'));
  w.real(2.5);
  w.boolean(true);
  w.none();
  w.end_list();
  auto pr = read_pickle(w.finish());
  REQUIRE(pr.value);
  REQUIRE(pr.value->items.size() == std::size(ints) + 4);
  for (std::size_t i = 0; i < std::size(ints); ++i) CHECK(pr.value->items[i]->i == ints[i]);
  CHECK(pr.value->items[std::size(ints)]->s.size() == 300);
  CHECK(pr.value->items[std::size(ints) + 1]->f == 2.5);
}

TEST_CASE("pickle writer: shared strings and dicts are written once and read back wherever they recur", "[formats]") {
  // 2500 items (three batches) drawn from 300 strings and 300 dicts: memo indices past 255 (LONG_BINGET), a
  // MEMOIZE as the last item of a batch, and a dict remembered before its items.
  PickleWriter w;
  w.begin_list();
  for (int i = 0; i < 2500; ++i) {
    const int k = (i * 7) % 300;
    if (i % 2) {
      w.shared_str("s" + std::to_string(k));
    } else if (w.begin_shared_dict("d" + std::to_string(k))) {
      w.shared_str("k");
      w.integer(k);
      w.shared_str("name");
      w.shared_str("n" + std::to_string(k % 10));
      w.end_dict();
    }
  }
  w.end_list();
  const std::string bytes = w.finish();
  auto pr = read_pickle(bytes);
  REQUIRE(pr.value);
  REQUIRE(pr.value->items.size() == 2500);
  for (int i = 0; i < 2500; ++i) {
    INFO("item " << i);
    const int k = (i * 7) % 300;
    const PyValue& v = *pr.value->items[static_cast<std::size_t>(i)];
    if (i % 2) {
      CHECK(v.s == "s" + std::to_string(k));
    } else {
      REQUIRE(v.get("k"));
      CHECK(v.get("k")->i == k);
      REQUIRE(v.get("name"));
      CHECK(v.get("name")->s == "n" + std::to_string(k % 10));
    }
  }
  CHECK(bytes.size() < 2500 * 8);  // written out each time, the dicts alone would take more
}

TEST_CASE("pickle writer: an object recalled by address writes what its key would have", "[formats]") {
  // The same 2500 items as above, written twice: once by key alone, once recalling each key's object by an
  // address after its first appearance (the snapshot writer's frames). The bytes must be the same, and an
  // address never seen must recall nothing.
  int objects[300];
  auto write = [&](bool by_address) {
    PickleWriter w;
    w.begin_list();
    for (int i = 0; i < 2500; ++i) {
      const int k = (i * 7) % 300;
      const void* id = &objects[k];
      if (by_address && w.recall_object(id)) continue;
      if (i % 3) {
        w.shared_str("s" + std::to_string(k));
      } else if (w.begin_shared_dict("d" + std::to_string(k))) {
        if (by_address) w.also_known_as(id);
        w.shared_str("k");
        w.integer(k);
        w.end_dict();
        continue;
      }
      if (by_address) w.also_known_as(id);
    }
    int never = 0;
    CHECK_FALSE(w.recall_object(&never));
    w.end_list();
    return w.finish();
  };
  const std::string by_key = write(false), by_address = write(true);
  CHECK(by_address == by_key);
  auto pr = read_pickle(by_address);
  REQUIRE(pr.value);
  REQUIRE(pr.value->items.size() == 2500);
}

TEST_CASE("pickle writer: lists and dicts in batches of at most 1000, as CPython writes them", "[formats]") {
  // [[0 .. 2499], {k0: 0 .. k1499: 1499}, [], {}, [[1]]] at the top level.
  PickleWriter w;
  w.begin_list();
  w.begin_list();
  for (int i = 0; i < 2500; ++i) w.integer(i);
  w.end_list();
  w.begin_dict();
  for (int i = 0; i < 1500; ++i) w.kv_int("k" + std::to_string(i), i);
  w.end_dict();
  w.begin_list();
  w.end_list();
  w.begin_dict();
  w.end_dict();
  w.begin_list();
  w.begin_list();
  w.integer(1);
  w.end_list();
  w.end_list();
  w.end_list();
  const std::string bytes = w.finish();
  // Walk the opcodes: every batch (MARK to APPENDS / SETITEMS) holds at most 1000 items at its own level.
  std::vector<std::size_t> batch;  // items so far in each open batch
  std::size_t appends = 0, setitems = 0, largest = 0;
  for (std::size_t i = 2; i < bytes.size();) {
    const auto op = static_cast<unsigned char>(bytes[i++]);
    auto item = [&] {
      if (!batch.empty()) ++batch.back();
    };
    switch (op) {
      case '(': batch.push_back(0); break;
      case 'e': case 'u': {
        REQUIRE(!batch.empty());
        largest = std::max(largest, op == 'u' ? batch.back() / 2 : batch.back());
        (op == 'e' ? appends : setitems) += 1;
        batch.pop_back();
        break;
      }
      case ']': case '}': item(); break;
      case 'K': i += 1; item(); break;
      case 'M': i += 2; item(); break;
      case 'J': i += 4; item(); break;
      case 0x8c: i += 1 + static_cast<unsigned char>(bytes[i]); item(); break;
      case '.': break;
      default: FAIL("unexpected opcode " << int(op));
    }
  }
  CHECK(largest == PickleWriter::kBatch);
  CHECK(appends == 1 + 3 + 2);   // the top list, 2500 items in 3 batches, [[1]]'s two lists
  CHECK(setitems == 2);          // 1500 pairs in 2 batches; the empty dict has none
  // ... and the content reads back whole.
  auto pr = read_pickle(bytes);
  REQUIRE(pr.value);
  REQUIRE(pr.value->items.size() == 5);
  REQUIRE(pr.value->items[0]->items.size() == 2500);
  for (int i = 0; i < 2500; ++i) CHECK(pr.value->items[0]->items[static_cast<std::size_t>(i)]->i == i);
  CHECK(pr.value->items[1]->get("k1499")->i == 1499);
  CHECK(pr.value->items[1]->get("k0")->i == 0);
  CHECK(pr.value->items[2]->items.empty());
  CHECK(pr.value->items[4]->items[0]->items[0]->i == 1);
}

TEST_CASE("RMM CSV: Time is written as RMM writes it (HH:MM:SS.ffffff) and a round trip keeps it", "[formats]") {
  Trace t;
  t.has_time = true;
  const std::int64_t times[] = {0, 7, 999999, 61000001, 3600000000LL * 27 + 59 * 60000000LL + 1234567};
  std::uint64_t addr = 0x1000;
  for (std::int64_t us : times) {
    formats::Event e;
    e.op = Op::alloc;
    e.address = addr += 0x1000;
    e.size = 512;
    e.time_us = us;
    t.events.push_back(e);
  }
  const std::string csv = trace_to_rmm_csv(t, 0);
  CHECK(csv.find(",00:00:00.000007,allocate,") != std::string::npos);
  CHECK(csv.find(",00:01:01.000001,allocate,") != std::string::npos);
  CHECK(csv.find(",27:59:01.234567,allocate,") != std::string::npos);
  auto back = trace_from_rmm_csv(csv, "c");
  INFO(back.error);
  REQUIRE(back.ok);
  REQUIRE(back.trace.events.size() == std::size(times));
  for (std::size_t i = 0; i < std::size(times); ++i) CHECK(back.trace.events[i].time_us == times[i]);
}
