// What the converters keep and refuse, from a hostile review of the readers and writers: the snapshot
// writer's segments, RMM logs as RMM writes them.
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "fragless/trace_format.h"
#include "pickle.h"
#include "replay.h"
#include "window.h"
#include "trace_model.h"

using namespace fragless;
using namespace fragless::formats;

namespace {

const std::string kData = FRAGLESS_SOURCE_DIR "/../shared/data/traces/torch";

formats::Event ev(Op op, std::uint64_t address, std::uint64_t size) {
  formats::Event e;
  e.op = op;
  e.address = address;
  e.size = size;
  return e;
}

// The first way the snapshot's segments break what PyTorch's snapshots hold and its viewer asserts (each
// segment's blocks tile it from its address to its end; segments are disjoint), or "" when none does.
std::string segment_problem(const std::string& snapshot, std::set<std::uint64_t>* live = nullptr) {
  auto pr = read_pickle(snapshot);
  if (!pr.value) return "unreadable: " + pr.error;
  const PyValue* segs = pr.value->get("segments");
  if (!segs) return "no segments";
  std::map<std::pair<std::int64_t, std::uint64_t>, std::uint64_t> ranges;  // (device, start) -> end
  for (auto& s : segs->items) {
    const std::uint64_t base = s->get("address")->as_uint(), total = s->get("total_size")->as_uint();
    const std::int64_t dev = s->get("device")->as_int();
    std::uint64_t at = base;
    for (auto& b : s->get("blocks")->items) {
      if (b->get("address")->as_uint() != at) return "a gap or overlap among the blocks of the segment at " + std::to_string(base);
      if (live && b->get("state")->s == "active_allocated") live->insert(b->get("address")->as_uint());
      at += b->get("size")->as_uint();
    }
    if (at != base + total) return "the blocks of the segment at " + std::to_string(base) + " do not end at its end";
    if (!ranges.emplace(std::make_pair(dev, base), base + total).second) return "two segments at " + std::to_string(base);
  }
  std::pair<std::int64_t, std::uint64_t> last{-1, 0};
  for (auto [key, end] : ranges) {
    if (key.first == last.first && key.second < last.second)
      return "the segment at " + std::to_string(key.second) + " overlaps the one before it";
    last = {key.first, end};
  }
  return "";
}

}  // namespace

TEST_CASE("snapshot writer: a block live before any segment event gets a segment apart from the recorded ones", "[formats]") {
  // The writer once appended such a block's own segment to the sorted list it was still searching: blocks
  // after it missed their recorded segment and got overlapping segments of their own.
  Trace t;
  t.source = "t";
  t.seed.push_back(ev(Op::alloc, 0x1000, 512));
  t.events.push_back(ev(Op::segment_alloc, 0x100000, 2u << 20));
  t.events.push_back(ev(Op::alloc, 0x100000, 1u << 20));
  t.events.push_back(ev(Op::alloc, 0x300000, 4096));  // live before any segment held it: its own
  std::set<std::uint64_t> live;
  const std::string snap = trace_to_snapshot(t);
  CHECK(segment_problem(snap, &live) == "");
  CHECK(live == std::set<std::uint64_t>{0x1000, 0x100000, 0x300000});
  auto back = trace_from_snapshot_bytes(snap, "s");
  REQUIRE(back.ok);
  std::size_t live_at_dump = 0;
  for (const auto& e : back.trace.seed) live_at_dump += e.address == 0x1000;
  CHECK(live_at_dump == 1);
}

// The second conversion holds fewer or more segments (the segments held before the window are not carried:
// `fragless-trace convert` says so), but the same blocks live at the dump, in disjoint segments.
TEST_CASE("snapshot writer: real snapshots converted twice keep disjoint segments", "[formats][real]") {
  if (!std::filesystem::exists(kData)) {
    WARN("SKIPPED: " << kData << " is not here");
    return;
  }
  int files = 0;
  for (const auto& f : std::filesystem::directory_iterator(kData)) {
    if (f.path().extension() != ".pickle") continue;
    INFO(f.path().filename().string());
    auto first = load_trace(f.path().string());
    REQUIRE(first.ok);
    const std::string once = trace_to_snapshot(first.trace);
    std::set<std::uint64_t> live1, live2;
    CHECK(segment_problem(once, &live1) == "");
    auto again = trace_from_snapshot_bytes(once, "once");
    REQUIRE(again.ok);
    const std::string twice = trace_to_snapshot(again.trace);
    CHECK(segment_problem(twice, &live2) == "");
    CHECK(live2 == live1);
    ++files;
  }
  CHECK(files > 0);
}

namespace {

LoadResult rmm(const std::string& rows, const std::string& header = "Thread,Time,Action,Pointer,Size,Stream") {
  return trace_from_rmm_csv(header + "\n" + rows, "log.csv");
}

std::vector<std::int64_t> times(const Trace& t) {
  std::vector<std::int64_t> v;
  for (const auto& e : t.events) v.push_back(e.time_us);
  return v;
}

}  // namespace

TEST_CASE("RMM logs: a run past midnight goes on the next day", "[formats]") {
  // RMM's logger writes the local time of day, with no date (Note [Times of day in an RMM log]).
  auto r = rmm("1,23:59:50.000000,allocate,0x7f0000000000,1073741824,0\n"
               "1,23:59:59.000000,allocate,0x7f0040000000,1048576,0\n"
               "1,00:00:09.000000,free,0x7f0040000000,1048576,0\n"
               "1,00:00:10.500000,free,0x7f0000000000,1073741824,0\n");
  REQUIRE(r.ok);
  const std::int64_t s = 1000000, day = 86400 * s;
  CHECK(times(r.trace) == std::vector<std::int64_t>{day - 10 * s, day - s, day + 9 * s, day + 10 * s + s / 2});
}

TEST_CASE("RMM logs: a row stamped just before midnight and written just after it stays on its day", "[formats]") {
  auto r = rmm("101,23:59:59.900000,allocate,0x7f0000000000,1048576,0x0\n"
               "102,00:00:00.100000,allocate,0x7f0000100000,1048576,0x0\n"
               "101,23:59:59.950000,free,0x7f0000000000,1048576,0x0\n"
               "102,00:00:00.200000,free,0x7f0000100000,1048576,0x0\n");
  REQUIRE(r.ok);
  const std::int64_t ms = 1000, day = 86400LL * 1000000;
  CHECK(times(r.trace) == std::vector<std::int64_t>{day - 100 * ms, day + 100 * ms, day - 50 * ms, day + 200 * ms});
}

TEST_CASE("RMM logs: rows a little out of order are kept, a clock set back is refused", "[formats]") {
  // Threads take the time before the logger's lock: a row may be a little older than the one before it.
  auto r = rmm("1,10:00:00.500000,allocate,0x1000,512,0\n"
               "2,10:00:00.100000,allocate,0x2000,512,0\n"
               "1,10:00:01.000000,free,0x1000,512,0\n"
               "2,10:00:01.000000,free,0x2000,512,0\n");
  REQUIRE(r.ok);
  auto back = rmm("1,10:00:00.000000,allocate,0x1000,512,0\n"
                  "1,09:00:00.000000,free,0x1000,512,0\n");
  CHECK_FALSE(back.ok);
  CHECK(back.error == "log.csv:3: time 09:00:00.000000 is 3600.000000 s before line 2's (a clock set back? RMM logs the "
                      "local time of day); rows may be out of order by at most 1 s");
  auto mixed = rmm("1,10:00:00.000000,allocate,0x1000,512,0\n"
                   "1,,free,0x1000,512,0\n");
  CHECK_FALSE(mixed.ok);
  CHECK(mixed.error == "log.csv:3: no time where the rows before had one");
}

TEST_CASE("native traces: a record more than a second before an earlier one is refused, naming both", "[formats][bad-input]") {
  Trace t;
  t.has_time = true;
  formats::Event a;
  a.op = Op::alloc;
  a.address = 0x1000;
  a.size = 512;
  a.time_us = 100000000;  // 100 s
  formats::Event f = a;
  f.op = Op::free;
  for (std::int64_t back : {999999, 1000001}) {
    f.time_us = a.time_us - back;
    t.events = {a, f};
    auto r = trace_from_native_bytes(trace_to_native(t), "n.fgt");
    INFO(back << ": " << r.error);
    if (back < 1000000) {
      CHECK(r.ok);  // threads take the time before the recorder's lock: a little out of order is kept
    } else {
      CHECK_FALSE(r.ok);
      CHECK(r.error.find("record 1 at byte ") != std::string::npos);
      CHECK(r.error.find(": its time is 1.000001 s before record 0's, on device 0; a device's records may be out "
                         "of order by at most 1 s") != std::string::npos);
    }
  }
  // Per device: a file devices share (or a snapshot converted, one device's events after another's) may hold
  // a device's earlier records after another device's later ones.
  formats::Event b = a;
  b.device = 1;
  b.address = 0x2000;
  b.time_us = 1000;
  formats::Event bf = b;
  bf.op = Op::free;
  bf.time_us = 2000;
  f.time_us = a.time_us + 10;
  t.events = {a, f, b, bf};
  auto two = trace_from_native_bytes(trace_to_native(t), "two.fgt");
  INFO(two.error);
  CHECK(two.ok);
}

TEST_CASE("RMM logs: allocations 256 bytes apart convert to a snapshot that reads back", "[formats]") {
  // RMM aligns to 256 bytes; the snapshot writer guesses a block's size as PyTorch's rounding (512 bytes), so
  // a block reached into the next one, which went to an overlapping segment of its own, and the snapshot
  // reader (which refuses memory given twice) refused what the writer wrote.
  auto r = rmm("1,10:00:00.000001,allocate,0x7f0000000000,256,0\n"
               "1,10:00:00.000002,allocate,0x7f0000000100,256,0\n"
               "1,10:00:00.000003,allocate,0x7f0000000300,100,0\n");
  REQUIRE(r.ok);
  auto back = trace_from_snapshot_bytes(trace_to_snapshot(r.trace), "s.pickle");
  INFO(back.error);
  REQUIRE(back.ok);
  std::vector<std::uint64_t> addrs;
  for (const auto& e : back.trace.events)
    if (e.op == Op::alloc) addrs.push_back(e.address);
  CHECK(addrs == std::vector<std::uint64_t>{0x7f0000000000, 0x7f0000000100, 0x7f0000000300});
}

TEST_CASE("RMM logs: a byte order mark before the header is not part of its first column", "[formats]") {
  // A spreadsheet's export begins with one: the first column kept its name, and the log loads as without it.
  const std::string rows = "7,10:00:00.000000,allocate,0x1000,512,0\n7,10:00:01.000000,free,0x1000,512,0\n";
  auto plain = rmm(rows);
  auto marked = rmm(rows, "\xEF\xBB\xBFThread,Time,Action,Pointer,Size,Stream");
  REQUIRE(plain.ok);
  INFO(marked.error);
  REQUIRE(marked.ok);
  CHECK(marked.trace.events.size() == plain.trace.events.size());
  CHECK(marked.dropped == plain.dropped);  // the Thread column read (its one thread named), not ignored
  CHECK_FALSE(plain.dropped.empty());
  auto action_first = rmm("10:00:00.000000,allocate,0x1000,512\n", "\xEF\xBB\xBFTime,Action,Pointer,Size");
  INFO(action_first.error);
  CHECK(action_first.ok);
}

TEST_CASE("RMM logs: a null pointer for 0 bytes converts and replays as nothing held", "[formats][replay]") {
  // RMM's pools answer 0 bytes with nullptr, and the adaptor logs it with %p: "(nil)".
  auto r = rmm("1,10:00:00.000001,allocate,(nil),0,0\n"
               "1,10:00:00.000002,allocate,(nil),0,0\n"
               "1,10:00:00.000003,allocate,0x1000,4096,0\n"
               "1,10:00:00.000004,free,(nil),0,0\n"
               "1,10:00:00.000005,free,(nil),0,0\n"
               "1,10:00:00.000006,free,0x1000,4096,0\n");
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.trace.events.size() == 6);
  auto native = trace_from_native_bytes(trace_to_native(r.trace), "n");
  INFO(native.error);
  REQUIRE(native.ok);
  CHECK(native.trace.events.size() == 6);
  auto snap = trace_from_snapshot_bytes(trace_to_snapshot(r.trace), "s");
  INFO(snap.error);
  REQUIRE(snap.ok);
  CHECK(snap.trace.seed.empty());
  CHECK(snap.warning.empty());
}

TEST_CASE("RMM logs: thread ids are checked and their loss is named", "[formats]") {
  auto r = rmm("140234,10:00:00.000001,allocate,0x1000,4096,0\n"
               "140299,10:00:00.000002,free,0x1000,4096,0\n");
  REQUIRE(r.ok);
  CHECK(r.dropped == "the Thread column (2 threads; a log written from the trace names thread 0 on every row)");
  auto ours = trace_from_rmm_csv(trace_to_rmm_csv(r.trace, 0), "ours.csv");
  REQUIRE(ours.ok);
  CHECK(ours.dropped.empty());  // thread 0 everywhere: nothing to lose
  auto bogus = rmm("bogus,10:00:00.000001,allocate,0x1000,4096,0\n");
  CHECK_FALSE(bogus.ok);
  CHECK(bogus.error == "log.csv:2: bad thread id 'bogus' (expected a number, as RMM's logger writes it)");
  auto extra = rmm("1,10:00:00.000001,allocate,0x1000,4096,0,0x999,junk\n");
  CHECK_FALSE(extra.ok);
  CHECK(extra.error == "log.csv:2: expected 6 fields (the header's), found 8");
}

TEST_CASE("native traces: state records after the first event and times past the range are refused", "[formats]") {
  Trace t;
  t.source = "t";
  t.has_time = true;
  formats::Event seed = ev(Op::alloc, 0x1000, 512);
  seed.time_us = 1;
  t.seed.push_back(seed);
  for (formats::Event e : {ev(Op::alloc, 0x2000, 512), ev(Op::free, 0x2000, 512)}) {
    e.time_us = 2;
    t.events.push_back(e);
  }
  const std::string good = trace_to_native(t);
  REQUIRE(trace_from_native_bytes(good, "good").ok);
  constexpr std::size_t kRec = sizeof(NativeTraceRecord);
  const std::size_t header = good.size() - 3 * kRec;
  // The block_present record moved after the events: a phantom block live "before" the window.
  std::string late = good.substr(0, header) + good.substr(header + kRec) + good.substr(header, kRec);
  auto r = trace_from_native_bytes(late, "late");
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("a block_present record after the trace's first event") != std::string::npos);
  // A record's time that wraps past 2^64 nanoseconds with the header's origin.
  std::string wrap = good;
  NativeTraceRecord rec;
  std::memcpy(&rec, wrap.data() + header + kRec, kRec);
  rec.time_ns = UINT64_MAX;
  std::memcpy(wrap.data() + header + kRec, &rec, kRec);
  auto w = trace_from_native_bytes(wrap, "wrap");
  CHECK_FALSE(w.ok);
  CHECK(w.error.find("is past the latest time a trace holds") != std::string::npos);
}

namespace {

// Pickle opcodes, by hand: a str (BINUNICODE), small ints (BININT1, BININT2), the memo (BINPUT, BINGET).
std::string X(const std::string& s) {
  const auto n = static_cast<std::uint32_t>(s.size());
  std::string len(4, '\0');
  std::memcpy(len.data(), &n, 4);
  return "X" + len + s;
}
std::string K(int v) { return "K" + std::string(1, static_cast<char>(v)); }
std::string M(int v) { return "M" + std::string(1, static_cast<char>(v & 0xff)) + std::string(1, static_cast<char>(v >> 8)); }
std::string put(int i) { return "q" + std::string(1, static_cast<char>(i)); }
std::string get(int i) { return "h" + std::string(1, static_cast<char>(i)); }
const std::string kProto2 = "\x80\x02";

}  // namespace

TEST_CASE("snapshots: a key set twice reads as its last value, in small dicts and in large ones", "[formats]") {
  // {'k0': 0, ..., 'k(n-1)': n-1, 'k0': 200}: Python keeps the last 'k0'.
  for (int n : {4, 100}) {
    std::string p = kProto2 + "}(";
    for (int i = 0; i < n; ++i) p += X("k" + std::to_string(i)) + K(i);
    p += X("k0") + K(200) + "u.";
    auto r = read_pickle(p);
    INFO(n << " keys: " << r.error);
    REQUIRE(r.value);
    REQUIRE(r.value->get("k0"));
    CHECK(r.value->get("k0")->as_int() == 200);
    REQUIRE(r.value->get("k3"));
    CHECK(r.value->get("k3")->as_int() == 3);
    CHECK(r.value->get("k") == nullptr);
  }
}

TEST_CASE("snapshots: one block named a million times through references is refused quickly", "[formats]") {
  // segments: [seg], seg = {'address': 0, 'total_size': 2^30, 'blocks': [blk] * 4000}, blk = {'size': 512,
  // 'state': 'inactive', 'history': [{}] * 4000}: a few KB naming 16 million history records (Note [Work
  // bounded by the input]). (One segment named many times is refused sooner: segments that overlap.)
  const auto J = [](std::uint32_t v) {
    std::string b = "J";
    for (int i = 0; i < 4; ++i) b += static_cast<char>((v >> (8 * i)) & 0xff);
    return b;
  };
  std::string p = kProto2 + "}(" + X("segments") + "](";
  p += "}(" + X("address") + K(0) + X("total_size") + J(1u << 30) + X("blocks") + "](";
  p += "}" + put(3) + "(" + X("size") + M(512) + X("state") + X("inactive") + X("history") + "](}" + put(4);
  for (int i = 1; i < 4000; ++i) p += get(4);
  p += "eu";
  for (int i = 1; i < 4000; ++i) p += get(3);
  p += "eue" + X("device_traces") + "]u.";
  auto pr = read_pickle(p);
  INFO(pr.error);
  REQUIRE(pr.value);
  auto r = trace_from_snapshot_bytes(p, "amp.pickle");
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("through references to the same objects: not a snapshot PyTorch writes") != std::string::npos);
}

TEST_CASE("snapshots: protocols 0 and 1 are told from their first bytes", "[formats]") {
  const std::string p0 = "(dp0\nVsegments\np1\n(lp2\nsVdevice_traces\np3\n(lp4\ns.";
  const std::string p1 = "}" + put(0) + "(" + X("segments") + put(1) + "]" + put(2) + X("device_traces") + put(3) + "]" +
                         put(4) + "u.";
  for (const std::string& p : {p0, p1}) {
    auto r = trace_from_bytes(p, "old.pickle");
    INFO(r.error);
    CHECK(r.ok);
    CHECK(r.format == Format::snapshot);
  }
}

TEST_CASE("replay: the time after an OOM is weighed by what the OOM retry left reserved", "[replay]") {
  // 60 MiB for 10 us, freed; 200 MiB fails on a 100 MiB device (the retry gives the cached 60 MiB back);
  // 20 MiB for 10 us. Allocated over time: 60*10 + 20*10; reserved: 60*20 (until the OOM) + 20*20.
  constexpr std::uint64_t M = 1u << 20;
  Trace t;
  t.source = "oom";
  t.has_time = true;
  auto at = [&](Op op, std::uint64_t a, std::uint64_t size, std::int64_t us) {
    formats::Event e = ev(op, a, size);
    e.time_us = us;
    t.events.push_back(e);
  };
  at(Op::alloc, 0x1000000, 60 * M, 0);
  at(Op::free, 0x1000000, 60 * M, 10);
  at(Op::alloc, 0x9000000, 200 * M, 20);
  at(Op::alloc, 0x2000000, 20 * M, 1000);
  at(Op::free, 0x2000000, 20 * M, 1010);
  at(Op::free, 0x9000000, 200 * M, 1020);
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless}) {
    INFO(policy_name(p));
    replay::ReplayOptions o;
    o.capacity = 100 * M;
    o.base.background = BackgroundMode::off;
    const auto r = replay::replay(t, 0, p, o);
    REQUIRE(r.error.empty());
    CHECK(r.ooms == 1);
    // 1 - (600 + 200) / (600 + 600 + 200 + 200 + 0 * 980): the 980 us after the OOM hold nothing.
    CHECK(r.time_weighted_fragmentation == Approx(0.5));
  }
}

TEST_CASE("replay: a window cuts each device's events at its own fractions", "[replay]") {
  // A snapshot holds one device's events after the other's: fractions of the whole list cut by device.
  Trace t;
  t.source = "two";
  t.has_time = true;
  for (std::int32_t d : {0, 1}) {
    const std::uint64_t base = 0x100000u * (d + 1);
    std::int64_t us = 0;
    for (auto [op, a] : {std::pair{Op::alloc, base}, {Op::alloc, base + 0x1000}, {Op::free, base}, {Op::free, base + 0x1000}}) {
      formats::Event e = ev(op, a, 512);
      e.device = d;
      e.time_us = us += 10;
      t.events.push_back(e);
    }
  }
  Trace first = t, second = t;
  replay::cut_window(&first, {0, 0.5}, "0:0.5");
  replay::cut_window(&second, {0.5, 1}, "0.5:1");
  auto ops = [](const Trace& x, std::int32_t d) {
    std::vector<Op> v;
    for (const auto& e : x.events)
      if (e.device == d) v.push_back(e.op);
    return v;
  };
  for (std::int32_t d : {0, 1}) {
    INFO("device " << d);
    CHECK(ops(first, d) == std::vector<Op>{Op::alloc, Op::alloc});
    CHECK(ops(second, d) == std::vector<Op>{Op::free, Op::free});
    std::size_t seeded = 0;
    for (const auto& e : second.seed) seeded += e.device == d;
    CHECK(seeded == 2);  // both blocks were live when the second half began
  }
  CHECK(first.seed.empty());
}

TEST_CASE("replay: external fragmentation is measured at each OOM", "[replay]") {
  // Classic on a 100 MiB device: one 90 MiB segment, split into three 30 MiB blocks; the first and last
  // freed leave 60 MiB free in two ranges of 30 around a live one, which no retry can give back. A request of
  // 40 MiB then fails: 1 - 30 / 60 = 0.5 (DESIGN.md's external fragmentation).
  constexpr std::uint64_t M = 1u << 20;
  Trace t;
  t.source = "split";
  for (auto [op, a, size] : {std::tuple{Op::alloc, 0x10000000ull, 90 * M}, {Op::free, 0x10000000ull, 90 * M},
                             {Op::alloc, 0x20000000ull, 30 * M}, {Op::alloc, 0x30000000ull, 30 * M},
                             {Op::alloc, 0x40000000ull, 30 * M}, {Op::free, 0x20000000ull, 30 * M},
                             {Op::free, 0x40000000ull, 30 * M}, {Op::alloc, 0x50000000ull, 40 * M}})
    t.events.push_back(ev(op, a, size));
  replay::ReplayOptions o;
  o.capacity = 100 * M;
  const auto r = replay::replay(t, 0, PolicyKind::classic, o);
  REQUIRE(r.error.empty());
  REQUIRE(r.ooms == 1);
  CHECK(r.external_fragmentation_at_oom_mean == Approx(0.5));
  CHECK(r.external_fragmentation_at_oom_max == Approx(0.5));
  const auto none = replay::replay(t, 0, PolicyKind::classic, replay::ReplayOptions{});
  CHECK(none.ooms == 0);
  CHECK(none.external_fragmentation_at_oom_mean == 0);
}
