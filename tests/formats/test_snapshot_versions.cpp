// PyTorch memory snapshots in the shape each PyTorch version writes (Note [Snapshot versions],
// snapshot_import.cpp), through both of PyTorch's picklers: Python's (what _dump_snapshot writes) and
// TorchScript's (the C++ _memory_snapshot_pickled: protocol 2, every string and every shared list memoised).
// One recorded window, written in each shape, must load to the same trace; snapshots without history, with
// skipped actions and on several devices load with what they hold and say what they lack; malformed fields
// are refused with the entry and key named.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pickle.h"
#include "trace_model.h"

using namespace fragless::formats;

namespace {

// A Python value to pickle: what a snapshot holds.
struct Py {
  enum class K { none, boolean, integer, uinteger, real, str, list, tuple, dict } k = K::none;
  std::int64_t i = 0;
  std::uint64_t u = 0;
  double f = 0;
  std::string s;
  std::vector<Py> items;
  std::vector<std::pair<std::string, Py>> kv;
  int shared = -1;  // the same list object at every use (PyTorch's frames): memoised by TorchScript's pickler

  Py& at(const std::string& key) {
    for (auto& [k2, v] : kv)
      if (k2 == key) return v;
    FAIL("no key " << key);
    return *this;
  }
  void set(const std::string& key, Py v) {
    for (auto& [k2, old] : kv)
      if (k2 == key) {
        old = std::move(v);
        return;
      }
    kv.emplace_back(key, std::move(v));
  }
  void erase(const std::string& key) {
    for (std::size_t n = 0; n < kv.size(); ++n)
      if (kv[n].first == key) {
        kv.erase(kv.begin() + static_cast<std::ptrdiff_t>(n));
        return;
      }
  }
};
Py I(std::int64_t v) { Py p; p.k = Py::K::integer; p.i = v; return p; }
Py U(std::uint64_t v) { Py p; p.k = Py::K::uinteger; p.u = v; return p; }
Py S(std::string v) { Py p; p.k = Py::K::str; p.s = std::move(v); return p; }
Py B(bool v) { Py p; p.k = Py::K::boolean; p.i = v; return p; }
Py F(double v) { Py p; p.k = Py::K::real; p.f = v; return p; }
Py L(std::vector<Py> v = {}) { Py p; p.k = Py::K::list; p.items = std::move(v); return p; }
Py T(std::vector<Py> v) { Py p; p.k = Py::K::tuple; p.items = std::move(v); return p; }
Py D(std::vector<std::pair<std::string, Py>> v) { Py p; p.k = Py::K::dict; p.kv = std::move(v); return p; }

// Python's pickler, as pickle.dump writes protocol 4 (without the memo, which the differential test covers).
void python_write(PickleWriter& w, const Py& v) {
  switch (v.k) {
    case Py::K::none: w.none(); break;
    case Py::K::boolean: w.boolean(v.i != 0); break;
    case Py::K::integer: w.integer(v.i); break;
    case Py::K::uinteger: w.uinteger(v.u); break;
    case Py::K::real: w.real(v.f); break;
    case Py::K::str: w.str(v.s); break;
    case Py::K::list:
    case Py::K::tuple:
      v.k == Py::K::list ? w.begin_list() : w.begin_tuple();
      for (const auto& x : v.items) python_write(w, x);
      v.k == Py::K::list ? w.end_list() : w.end_tuple();
      break;
    case Py::K::dict:
      w.begin_dict();
      for (const auto& [k2, x] : v.kv) w.str(k2), python_write(w, x);
      w.end_dict();
      break;
  }
}
std::string python_pickle(const Py& v) {
  PickleWriter w;
  python_write(w, v);
  return w.finish();
}

// TorchScript's pickler (torch/csrc/jit/serialization/pickler.cpp) as _memory_snapshot_pickled drives it:
// PROTO 2; ints as BININT1/BININT2/BININT or LONG1 of 8 bytes; each distinct string once (BINUNICODE, BINPUT),
// then BINGET; lists and dicts as EMPTY_x MARK ... APPENDS/SETITEMS in one batch; a shared list once.
class TorchScriptPickler {
 public:
  std::string run(const Py& v) {
    out_ = std::string("\x80\x02", 2);
    push(v);
    out_ += '.';
    return out_;
  }

 private:
  void le(std::uint64_t v, int n) {
    for (int b = 0; b < n; ++b) out_ += static_cast<char>(v >> (8 * b) & 0xff);
  }
  void put() { memo_ <= 255 ? (out_ += 'q', le(memo_, 1)) : (out_ += 'r', le(memo_, 4)); ++memo_; }
  void get(std::uint32_t id) { id <= 255 ? (out_ += 'h', le(id, 1)) : (out_ += 'j', le(id, 4)); }
  void str(const std::string& s) {
    for (const auto& [known, id] : strings_)
      if (known == s) return get(id);
    out_ += 'X';
    le(s.size(), 4);
    out_ += s;
    strings_.emplace_back(s, memo_);
    put();
  }
  void push(const Py& v) {
    switch (v.k) {
      case Py::K::none: out_ += 'N'; break;
      case Py::K::boolean: out_ += v.i ? '\x88' : '\x89'; break;
      case Py::K::integer:
        if (v.i >= 0 && v.i <= 255) out_ += 'K', le(static_cast<std::uint64_t>(v.i), 1);
        else if (v.i >= 0 && v.i <= 65535) out_ += 'M', le(static_cast<std::uint64_t>(v.i), 2);
        else if (v.i >= INT32_MIN && v.i <= INT32_MAX) out_ += 'J', le(static_cast<std::uint64_t>(v.i), 4);
        else out_ += "\x8a\x08", le(static_cast<std::uint64_t>(v.i), 8);
        break;
      case Py::K::uinteger: out_ += "\x8a\x09", le(v.u, 8), out_ += '\0'; break;  // never from PyTorch: sizes are int64
      case Py::K::real: {
        std::uint64_t bits;
        std::memcpy(&bits, &v.f, 8);
        out_ += 'G';
        for (int b = 7; b >= 0; --b) out_ += static_cast<char>(bits >> (8 * b) & 0xff);
        break;
      }
      case Py::K::str: str(v.s); break;
      case Py::K::tuple:
        for (const auto& x : v.items) push(x);
        out_ += v.items.size() == 2 ? '\x86' : v.items.size() == 1 ? '\x85' : ')';
        break;
      case Py::K::list:
      case Py::K::dict: {
        if (v.shared >= 0)
          for (const auto& [id, memo] : shared_)
            if (id == v.shared) return get(memo);
        const bool list = v.k == Py::K::list;
        out_ += list ? ']' : '}';
        if (!v.items.empty() || !v.kv.empty()) {
          out_ += '(';
          for (const auto& x : v.items) push(x);
          for (const auto& [k2, x] : v.kv) str(k2), push(x);
          out_ += list ? 'e' : 'u';
        }
        if (v.shared >= 0) shared_.emplace_back(v.shared, memo_), put();
        break;
      }
    }
  }
  std::string out_;
  std::uint32_t memo_ = 0;
  std::vector<std::pair<std::string, std::uint32_t>> strings_;
  std::vector<std::pair<int, std::uint32_t>> shared_;
};

constexpr std::int64_t MiB = 1 << 20;
constexpr std::int64_t kBase = 0x7f0000000000;

enum class Shape { v2_0, v2_1, v2_3, nightly };
const char* shape_name(Shape s) {
  switch (s) {
    case Shape::v2_0: return "2.0 (history lists, no block addresses, no requested_size, no time_us)";
    case Shape::v2_1: return "2.1 (frames, segment_pool_id, is_expandable)";
    case Shape::v2_3: return "2.3 (time_us, allocator_settings, external_annotations)";
    case Shape::nightly: return "2.6+ (compile_context, user_metadata)";
  }
  return "?";
}

Py frames() {
  Py f = L({D({{"filename", S("train.py")}, {"line", I(10)}, {"name", S("step")}}),
            D({{"filename", S("model.py")}, {"line", I(3)}, {"name", S("forward")}})});
  f.shared = 1;
  return f;
}

// The recorded window on one device, addresses from `base`: A (freed in the window), B and C (live at the
// dump), X (allocated before the window, freed in it), a small segment the window creates holding E, an OOM
// and a snapshot entry. Before the window the 20 MiB segment held P (1.5 MiB asked, a 2 MiB block) and X.
Py window(Shape shape, std::int64_t base) {
  struct E { const char* action; std::int64_t addr, size; };
  const E es[] = {{"alloc", base, 4 * MiB - 100},      {"alloc", base + 4 * MiB, 8 * MiB},
                  {"free_requested", base, 4 * MiB - 100}, {"free_completed", base, 4 * MiB - 100},
                  {"alloc", base + 12 * MiB, 2 * MiB}, {"free_completed", base + 16 * MiB, MiB},
                  {"segment_alloc", base + 32 * MiB, 2 * MiB}, {"alloc", base + 32 * MiB, 100},
                  {"oom", 12345, std::int64_t{1} << 40},  {"snapshot", 0, 10 * MiB}};
  Py list = L();
  std::int64_t time = 1700000000000000;
  for (const E& e : es) {
    Py d = D({{"action", S(e.action)}});
    d.set(std::string(e.action) == "oom" ? "device_free" : "addr", I(e.addr));
    d.set("size", I(e.size));
    d.set("stream", I(0));
    if (shape == Shape::nightly) d.set("compile_context", S("N/A")), d.set("user_metadata", S(""));
    d.set("frames", frames());
    if (shape == Shape::v2_0) d.set("cpp_frames", S("c10::alloc\nmain"));
    if (shape >= Shape::v2_3) d.set("time_us", I(time += 7));
    list.items.push_back(d);
  }
  return list;
}

struct BlockSpec { std::int64_t size, requested; const char* state; };

Py segment(Shape shape, int device, std::int64_t address, std::int64_t total, const std::vector<BlockSpec>& blocks) {
  Py seg = D({{"device", I(device)}, {"address", I(address)}, {"total_size", I(total)}, {"allocated_size", I(0)},
              {"active_size", I(0)}});
  if (shape != Shape::v2_0) seg.set("requested_size", I(0));
  seg.set("stream", I(0));
  seg.set("segment_type", S(total > 2 * MiB ? "large" : "small"));
  if (shape != Shape::v2_0) {
    seg.set("segment_pool_id", T({I(0), I(0)}));
    seg.set("is_expandable", B(false));
    seg.set("frames", frames());
  }
  Py list = L();
  std::int64_t at = address;
  for (const BlockSpec& b : blocks) {
    Py d = D({});
    const bool live = std::string(b.state) == "active_allocated";
    if (shape != Shape::v2_0) d.set("address", I(at));
    d.set("size", I(b.size));
    if (shape != Shape::v2_0) d.set("requested_size", I(b.requested));
    d.set("state", S(b.state));
    if (shape == Shape::v2_0 && live)  // newest first
      d.set("history", L({D({{"addr", I(at)}, {"real_size", I(b.requested)}, {"frames", frames()}}),
                          D({{"addr", I(at)}, {"real_size", I(b.size / 4)}})}));
    if (shape != Shape::v2_0) d.set("frames", live ? frames() : L());
    list.items.push_back(d);
    at += b.size;
  }
  seg.set("blocks", list);
  return seg;
}

std::vector<Py> dump_segments(Shape shape, int device, std::int64_t base) {
  return {segment(shape, device, base, 20 * MiB,
                  {{4 * MiB, 0, "inactive"},
                   {8 * MiB, 8 * MiB, "active_allocated"},
                   {2 * MiB, 2 * MiB, "active_allocated"},
                   {2 * MiB, 3 * MiB / 2, "active_allocated"},  // P, live since before the window
                   {4 * MiB, 0, "inactive"}}),
          segment(shape, device, base + 32 * MiB, 2 * MiB, {{512, 100, "active_allocated"}, {2 * MiB - 512, 0, "inactive"}})};
}

Py settings() {
  Py r = D({});
  for (int k = 1; k <= 32768; k *= 2) r.set(std::to_string(k), I(0));
  return D({{"PYTORCH_CUDA_ALLOC_CONF", S("")}, {"max_split_size", I(-1)}, {"garbage_collection_threshold", F(0.0)},
            {"expandable_segments", B(false)}, {"pinned_num_register_threads", I(1)},
            {"release_lock_on_cudamalloc", B(false)}, {"pinned_use_cuda_host_register", B(false)},
            {"roundup_power2_divisions", r}});
}

Py snapshot(Shape shape, int devices = 1) {
  Py segs = L(), traces = L();
  for (int d = 0; d < devices; ++d) {
    const std::int64_t base = kBase + d * (std::int64_t{1} << 36);
    for (auto& s : dump_segments(shape, d, base)) segs.items.push_back(s);
    traces.items.push_back(window(shape, base));
  }
  Py snap = D({{"segments", segs}, {"device_traces", traces}});
  if (shape >= Shape::v2_3) {
    Py st = settings();
    if (shape == Shape::nightly) st.set("graph_capture_record_stream_reuse", B(false));
    snap.set("allocator_settings", st);
    snap.set("external_annotations",
             L({D({{"name", S("fwd")}, {"stage", S("START")}, {"device", I(0)}, {"time_us", I(1700000000000001)}})}));
  }
  return snap;
}

// What the window must load to on `device`, whatever the shape.
void check_window(const Trace& t, int device) {
  const std::uint64_t base = static_cast<std::uint64_t>(kBase + device * (std::int64_t{1} << 36));
  std::vector<Event> evs;
  for (const auto& e : t.events)
    if (e.device == device) evs.push_back(e);
  const Op ops[] = {Op::alloc, Op::alloc, Op::free_requested, Op::free, Op::alloc,
                    Op::free,  Op::segment_alloc, Op::alloc, Op::oom, Op::snapshot};
  REQUIRE(evs.size() == std::size(ops));
  for (std::size_t n = 0; n < evs.size(); ++n) {
    INFO("event " << n);
    CHECK(evs[n].op == ops[n]);
  }
  CHECK(evs[1].address == base + 4 * MiB);
  CHECK(evs[1].size == 8 * MiB);
  CHECK(evs[1].block_size == 8 * MiB);  // from the dump's block
  CHECK(evs[0].block_size == 0);        // freed: the dump does not tell
  CHECK(evs[7].size == 100);
  CHECK(evs[7].block_size == 512);
  CHECK(evs[8].address == 12345);  // the oom's device_free
  CHECK(evs[8].size == std::uint64_t{1} << 40);
  // Seeds: X (freed in the window) at its requested size, P (live throughout) at its requested size.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> seeds;
  for (const auto& s : t.seed)
    if (s.device == device) seeds.emplace_back(s.address, s.size);
  CHECK(seeds == std::vector<std::pair<std::uint64_t, std::uint64_t>>{{base + 16 * MiB, MiB}, {base + 14 * MiB, 3 * MiB / 2}});
  // Before the window: the 20 MiB segment (the small one is the window's own).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> pre;
  for (const auto& s : t.pre_segments)
    if (s.device == device) pre.emplace_back(s.address, s.size);
  CHECK(pre == std::vector<std::pair<std::uint64_t, std::uint64_t>>{{base, 20 * MiB}});
  REQUIRE(t.recorded_peak_reserved.size() > static_cast<std::size_t>(device));
  CHECK(t.recorded_peak_reserved[static_cast<std::size_t>(device)] == std::optional<std::uint64_t>(22 * MiB));
}

LoadResult load(const std::string& bytes) { return trace_from_snapshot_bytes(bytes, "snap.pickle"); }

// A byte string from a literal that may hold NUL bytes.
template <std::size_t N>
std::string bin(const char (&s)[N]) {
  return std::string(s, N - 1);
}

}  // namespace

TEST_CASE("snapshot versions: one window written as PyTorch 2.0 to nightly writes it, by either pickler, loads the same",
          "[formats][snapshot-versions]") {
  for (Shape shape : {Shape::v2_0, Shape::v2_1, Shape::v2_3, Shape::nightly}) {
    for (bool torchscript : {false, true}) {
      const Py snap = snapshot(shape);
      const std::string bytes = torchscript ? TorchScriptPickler().run(snap) : python_pickle(snap);
      INFO(shape_name(shape) << (torchscript ? ", TorchScript's pickler" : ", Python's pickler"));
      auto r = load(bytes);
      INFO(r.error);
      REQUIRE(r.ok);
      CHECK(r.warning.empty());
      check_window(r.trace, 0);
      CHECK(r.trace.has_time == (shape >= Shape::v2_3));
      // Frames are counted wherever the version kept them (2.0: in each block's history).
      CHECK(r.dropped.find("stack frames (10 events, 4 blocks") == 0);
      CHECK((r.dropped.find("external_annotations") != std::string::npos) == (shape >= Shape::v2_3));
    }
  }
}

TEST_CASE("snapshot versions: without history the blocks live at the dump load, and a warning says nothing replays",
          "[formats][snapshot-versions]") {
  const Py base = snapshot(Shape::v2_1);
  std::vector<std::pair<std::string, Py>> cases;
  {
    Py s = base;  // recording never on: one empty list per device the process saw
    s.set("device_traces", L({L(), L(), L(), L(), L(), L(), L(), L()}));
    cases.emplace_back("device_traces are empty", s);
  }
  {
    Py s = base;  // the legacy _record_memory_history(True) keeps the last entry alone
    s.set("device_traces", L({L({D({{"action", S("free_completed")}, {"addr", I(kBase + 99 * MiB)}, {"size", I(512)},
                                   {"stream", I(0)}})})}));
    cases.emplace_back("hold 1 entry and no 'alloc'", s);
  }
  {
    Py s = base;
    s.erase("device_traces");
    cases.emplace_back("has no 'device_traces'", s);
  }
  cases.emplace_back("a list of segments", base.kv[0].second);  // torch.cuda.memory_snapshot()
  for (const auto& [why, snap] : cases) {
    INFO(why);
    auto r = load(python_pickle(snap));
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(r.warning.find("snap.pickle: no allocation history to replay") == 0);
    CHECK(r.warning.find(why) != std::string::npos);
    // The one entry of the legacy history frees a block that was live before it: known too, and said.
    const bool one_free = why == std::string("hold 1 entry and no 'alloc'");
    CHECK(r.warning.find(one_free ? "only the 4 blocks live at the dump and the 1 its history frees are known"
                                  : "only the 4 blocks live at the dump are known") != std::string::npos);
    CHECK(r.warning.find("_record_memory_history(max_entries=") != std::string::npos);
    // B, C, P and E: every block the dump holds, at its requested size, before any event.
    std::uint64_t seeded = 0;
    for (const auto& s : r.trace.seed) seeded += s.size;
    CHECK(r.trace.seed.size() >= 4);
    CHECK(seeded >= static_cast<std::uint64_t>(8 * MiB + 2 * MiB + 3 * MiB / 2 + 100));
    CHECK(r.trace.pre_segments.size() == 2);
  }
}

TEST_CASE("snapshot versions: a block pending its free at the dump (active_pending_free) holds its memory",
          "[formats][snapshot-versions]") {
  // P (allocated before the window, never freed in it) freed by the program while another stream still used it:
  // PyTorch writes it as active_pending_free, and its memory is still held, so it is seeded like a live block.
  Py s = snapshot(Shape::v2_1);
  Py& blocks = s.at("segments").items[0].at("blocks");
  blocks.items[3].set("state", S("active_pending_free"));
  auto r = load(python_pickle(s));
  INFO(r.error);
  REQUIRE(r.ok);
  bool seeded = false;
  for (const auto& e : r.trace.seed) seeded |= e.address == static_cast<std::uint64_t>(kBase + 14 * MiB) && e.size == 3 * MiB / 2;
  CHECK(seeded);
  blocks.items[3].set("state", S("inactive"));  // and one really returned to the cache is not
  r = load(python_pickle(s));
  REQUIRE(r.ok);
  seeded = false;
  for (const auto& e : r.trace.seed) seeded |= e.address == static_cast<std::uint64_t>(kBase + 14 * MiB);
  CHECK_FALSE(seeded);
}

TEST_CASE("snapshot versions: sizes past any device are refused, and huge segment events do not overflow",
          "[formats][snapshot-versions][bad-input]") {
  Py s = snapshot(Shape::v2_3);
  s.at("segments").items[0].set("total_size", I(std::int64_t{1} << 62));
  auto r = load(python_pickle(s));
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("segments add up to more than 2^62 bytes") != std::string::npos);
  // Segment frees each below 2^63 whose sum is not: the recorded peak is computed without overflow.
  Py t = snapshot(Shape::v2_3);
  Py& list = t.at("device_traces").items[0];
  for (int n = 0; n < 4; ++n)
    list.items.push_back(D({{"action", S("segment_free")}, {"addr", I(kBase + 64 * MiB)},
                            {"size", I(std::numeric_limits<std::int64_t>::max())}, {"stream", I(0)},
                            {"time_us", I(1800000000000000 + n)}}));
  r = load(python_pickle(t));
  INFO(r.error);
  REQUIRE(r.ok);
  REQUIRE(!r.trace.recorded_peak_reserved.empty());
  REQUIRE(r.trace.recorded_peak_reserved[0].has_value());
  CHECK(*r.trace.recorded_peak_reserved[0] > 0);
}

TEST_CASE("snapshot versions: frees and no allocation name skip_actions", "[formats][snapshot-versions]") {
  // With an address freed twice too: the caching allocator reuses addresses, so with the allocations skipped a
  // second free of one follows the first with no allocation between (refused as a double free until a review
  // of 2026-12-06).
  const Py again = D({{"action", S("free_completed")}, {"addr", I(kBase)}, {"size", I(MiB)}, {"stream", I(0)},
                      {"time_us", I(1700000000009999)}});
  for (bool reused : {false, true}) {
    INFO("an address freed twice: " << reused);
    Py s = snapshot(Shape::v2_3);
    Py kept = L();
    for (const Py& e : s.at("device_traces").items[0].items)
      if (e.kv[0].second.s != "alloc") kept.items.push_back(e);
    if (reused) kept.items.push_back(again);
    s.at("device_traces").items[0] = kept;
    auto r = load(python_pickle(s));
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(r.warning.find("no 'alloc' (recorded with _record_memory_history(skip_actions=[\"alloc\"])?)") !=
          std::string::npos);
  }
  // With the allocations recorded, the same second free is refused as a double free.
  Py whole = snapshot(Shape::v2_3);
  whole.at("device_traces").items[0].items.push_back(again);
  auto refused = load(python_pickle(whole));
  CHECK_FALSE(refused.ok);
  CHECK(refused.error.find("a second free of 0x7f0000000000") != std::string::npos);
}

TEST_CASE("snapshot versions: skip_actions leaves free_completed or free_requested alone, and both free",
          "[formats][snapshot-versions]") {
  for (const char* skipped : {"free_requested", "free_completed"}) {
    INFO("skip_actions=[" << skipped << "]");
    Py snap = snapshot(Shape::v2_3);
    auto& list = snap.at("device_traces").items[0].items;
    for (std::size_t n = list.size(); n-- > 0;)
      if (list[n].at("action").s == skipped) list.erase(list.begin() + static_cast<std::ptrdiff_t>(n));
    auto r = load(python_pickle(snap));
    INFO(r.error);
    REQUIRE(r.ok);
    std::size_t frees = 0, requested = 0;
    for (const auto& e : r.trace.events) frees += e.op == Op::free, requested += e.op == Op::free_requested;
    CHECK(requested == 0);
    // Both free A; free_completed alone also frees X (from before the window), which free_requested did not record.
    const bool completed_kept = std::string(skipped) == "free_requested";
    CHECK(frees == (completed_kept ? 2u : 1u));
    CHECK(r.trace.seed.size() == (completed_kept ? 2u : 1u));
    REQUIRE(r.trace.events.size() >= 3);
    CHECK(r.trace.events[2].op == Op::free);
    CHECK(r.trace.events[2].address == static_cast<std::uint64_t>(kBase));
    CHECK(r.warning.find("has not freed") == std::string::npos);
    if (std::string(skipped) == "free_completed")
      CHECK(r.warning.find("no free_completed (recorded with skip_actions=[\"free_completed\"]?)") != std::string::npos);
    else
      CHECK(r.warning.empty());
  }
}

TEST_CASE("snapshot versions: a trace without any frees says the replay holds freed memory", "[formats][snapshot-versions]") {
  // skip_actions=["free_requested", "free_completed"], and A's address allocated again after its (unrecorded) free.
  Py snap = snapshot(Shape::v2_3);
  auto& list = snap.at("device_traces").items[0].items;
  for (std::size_t n = list.size(); n-- > 0;)
    if (list[n].at("action").s.rfind("free_", 0) == 0) list.erase(list.begin() + static_cast<std::ptrdiff_t>(n));
  list.push_back(D({{"action", S("alloc")}, {"addr", I(kBase)}, {"size", I(MiB)}, {"stream", I(0)}, {"time_us", I(1700000000009999)}}));
  auto r = load(python_pickle(snap));
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.warning.find("device 0: 1 allocation at an address the trace has not freed") != std::string::npos);
}

TEST_CASE("snapshot versions: several devices, and segments of a device without a trace list",
          "[formats][snapshot-versions]") {
  for (bool torchscript : {false, true}) {
    Py snap = snapshot(Shape::v2_3, 2);
    for (auto& s : dump_segments(Shape::v2_3, 2, kBase + 2 * (std::int64_t{1} << 36))) snap.at("segments").items.push_back(s);
    auto r = load(torchscript ? TorchScriptPickler().run(snap) : python_pickle(snap));
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(r.trace.devices() == 3);
    check_window(r.trace, 0);
    check_window(r.trace, 1);
    // Device 2 recorded nothing: its live blocks are its seed, its segments what it held, its reserved the dump's.
    std::size_t seeds2 = 0, pre2 = 0;
    for (const auto& s : r.trace.seed) seeds2 += s.device == 2;
    for (const auto& s : r.trace.pre_segments) pre2 += s.device == 2;
    CHECK(seeds2 == 4);
    CHECK(pre2 == 2);
    REQUIRE(r.trace.recorded_peak_reserved.size() == 3);
    CHECK(r.trace.recorded_peak_reserved[2] == std::optional<std::uint64_t>(22 * MiB));
  }
}

TEST_CASE("snapshot versions: expandable segments roll back through segment_map and segment_unmap",
          "[formats][snapshot-versions]") {
  // Mapped 20 MiB, unmapped its last 6 MiB; the dump holds the 14 MiB still mapped.
  Py snap = snapshot(Shape::v2_3);
  Py seg = segment(Shape::v2_3, 0, kBase, 14 * MiB, {{12 * MiB, 0, "inactive"}, {2 * MiB, 2 * MiB, "active_allocated"}});
  seg.set("is_expandable", B(true));
  snap.set("segments", L({seg}));
  auto entry = [](const char* action, std::int64_t addr, std::int64_t size) {
    return D({{"action", S(action)}, {"addr", I(addr)}, {"size", I(size)}, {"stream", I(0)}, {"time_us", I(addr & 0xffff)}});
  };
  snap.set("device_traces", L({L({entry("segment_map", kBase, 20 * MiB), entry("alloc", kBase, 0),
                                  entry("free_completed", kBase, 0), entry("segment_unmap", kBase + 14 * MiB, 6 * MiB),
                                  entry("alloc", kBase + 12 * MiB, 2 * MiB)})}));
  auto r = load(python_pickle(snap));
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.trace.pre_segments.empty());  // nothing was mapped before the window
  CHECK(r.trace.recorded_peak_reserved[0] == std::optional<std::uint64_t>(20 * MiB));
  // PyTorch unmaps only when its cache is emptied (Note [Releases the program asked for]): the call comes first.
  REQUIRE(r.trace.events.size() == 6);
  CHECK(r.trace.events[0].op == Op::segment_map);
  CHECK(r.trace.events[3].op == Op::empty_cache);
  CHECK(r.trace.events[4].op == Op::segment_unmap);
  CHECK(r.trace.events[1].size == 0);  // an entry of size 0 is an allocation like any other
  CHECK(r.trace.events[5].block_size == 2 * MiB);
}

TEST_CASE("snapshot versions: actions of a newer PyTorch are skipped and named in a warning", "[formats][snapshot-versions]") {
  Py snap = snapshot(Shape::nightly);
  auto& list = snap.at("device_traces").items[0].items;
  list.insert(list.begin() + 2, D({{"action", S("segment_defragment")}, {"addr", I(kBase)}, {"size", I(MiB)}, {"stream", I(0)}}));
  auto r = load(python_pickle(snap));
  INFO(r.error);
  REQUIRE(r.ok);
  check_window(r.trace, 0);
  CHECK(r.warning.find("actions this reader does not know were skipped: 'segment_defragment' (1)") != std::string::npos);
}

TEST_CASE("snapshot versions: a malformed field is refused with its entry and key named", "[formats][snapshot-versions][bad-input]") {
  using Edit = void (*)(Py&);
  const std::pair<Edit, const char*> cases[] = {
      {[](Py& s) { s.at("device_traces").items[0].items[0].erase("action"); }, "device_traces[0][0]: no 'action'"},
      {[](Py& s) { s.at("device_traces").items[0].items[0].set("action", I(3)); }, "device_traces[0][0]: 'action' is an int, not a str"},
      {[](Py& s) { s.at("device_traces").items[0].items[1].set("size", S("8")); }, "device_traces[0][1] ('alloc'): 'size' is a str, not an int"},
      {[](Py& s) { s.at("device_traces").items[0].items[1].set("size", I(-5)); }, "'size' is -5, outside [0, 2^63)"},
      {[](Py& s) { s.at("device_traces").items[0].items[1].set("size", F(8.5)); }, "'size' is a float, not an int"},
      {[](Py& s) { s.at("device_traces").items[0].items[1].set("size", U(~std::uint64_t{0})); }, "outside [0, 2^63)"},
      {[](Py& s) { s.at("device_traces").items[0].items[3].erase("addr"); }, "device_traces[0][3] ('free_completed'): no 'addr'"},
      {[](Py& s) { s.at("device_traces").items[0].items[1].set("addr", I(-64)); }, "'addr' is -64, negative"},
      {[](Py& s) { s.at("device_traces").items[0].items[1].set("addr", U(~std::uint64_t{0} - 100)); }, "addr + size is past 2^64"},
      {[](Py& s) { s.at("device_traces").items[0].items[1].set("time_us", S("soon")); }, "'time_us' is a str, not an int"},
      {[](Py& s) { s.at("device_traces").items[0].items[2].set("time_us", I(1)); },
       "device_traces[0][2] ('free_requested'): 'time_us' 1 is "},
      {[](Py& s) { s.at("device_traces").items[0].items[1] = I(7); }, "device_traces[0][1] is an int, not a dict"},
      {[](Py& s) { s.at("device_traces").items[0] = D({}); }, "device_traces[0] is a dict, not a list"},
      {[](Py& s) { s.set("device_traces", I(1)); }, "'device_traces' is an int, not a list"},
      {[](Py& s) { s.set("device_traces", L(std::vector<Py>(4097, L()))); }, "'device_traces' has 4097 lists, more than 4096 devices"},
      {[](Py& s) { s.at("segments").items[0].erase("address"); }, "segments[0]: no 'address'"},
      {[](Py& s) { s.at("segments").items[1].set("total_size", S("2")); }, "segments[1]: 'total_size' is a str, not an int"},
      {[](Py& s) { s.at("segments").items[0].set("device", I(std::int64_t{1} << 40)); }, "segments[0]: device 1099511627776 is out of range"},
      {[](Py& s) { s.at("segments").items[0].set("device", I(-1)); }, "segments[0]: 'device' is -1, outside [0, 2^63)"},
      {[](Py& s) { s.at("segments").items[0].set("blocks", I(0)); }, "segments[0]: 'blocks' is an int, not a list"},
      {[](Py& s) { s.at("segments").items[0].at("blocks").items[2] = S("x"); }, "segments[0].blocks[2] is a str, not a dict"},
      {[](Py& s) { s.at("segments").items[0].at("blocks").items[1].erase("size"); }, "segments[0].blocks[1]: no 'size'"},
      {[](Py& s) { s.at("segments").items[0].at("blocks").items[1].erase("state"); }, "segments[0].blocks[1]: no 'state'"},
      {[](Py& s) { s.at("segments").items[0].set("address", U(~std::uint64_t{0} - MiB)); }, "segments[0]: address + total_size is past 2^64"},
      {[](Py& s) { s.at("segments").items[0] = L(); }, "segments[0] is a list, not a dict"},
      // Memory the snapshot gives twice: blocks over one another, a block past its segment, segments that overlap.
      {[](Py& s) { s.at("segments").items[0].at("blocks").items[2].set("address", I(kBase + 6 * MiB)); },
       "segments[0].blocks[2]: it begins at 0x7f0000600000, before 0x7f0000c00000, where the block before it ends"},
      {[](Py& s) { s.at("segments").items[0].at("blocks").items[4].set("size", I(40 * MiB)); },
       "segments[0].blocks[4]: its range [0x7f0001000000, 0x7f0003800000) reaches past its segment's"},
      {[](Py& s) { s.at("segments").items[1].set("address", I(kBase + 16 * MiB)); },
       "segments[1]: its range [0x7f0001000000, 0x7f0001200000) overlaps device 0's segment at [0x7f0000000000, "},
      {[](Py& s) { s.at("segments").items.push_back(s.at("segments").items[1]); },
       "segments[2]: its range [0x7f0002000000, 0x7f0002200000) overlaps device 0's segment at [0x7f0002000000, "},
      {[](Py& s) { s.set("segments", D({})); }, "not a PyTorch memory snapshot ('segments' is a dict, not a list)"},
      {[](Py& s) { s = I(5); }, "not a PyTorch memory snapshot (the top level is an int, neither a dict nor a list)"},
  };
  for (const auto& [edit, want] : cases) {
    for (bool torchscript : {false, true}) {
      Py snap = snapshot(Shape::v2_3);
      edit(snap);
      auto r = load(torchscript ? TorchScriptPickler().run(snap) : python_pickle(snap));
      INFO(want << (torchscript ? " (TorchScript's pickler)" : "") << " -> " << (r.ok ? "loaded" : r.error));
      CHECK_FALSE(r.ok);
      CHECK(r.error.find(std::string("snap.pickle: ")) == 0);
      CHECK(r.error.find(want) != std::string::npos);
    }
  }
}

TEST_CASE("pickle: memo indices past the written ones are read as Python reads them, one slot each",
          "[formats][bad-input]") {
  // 5, LONG_BINPUT 0x7fffffff, POP, LONG_BINGET 0x7fffffff: Python's unpickler keeps its memo in a dict.
  const std::string far = bin("\x80\x02K\x05r\xff\xff\xff\x7f" "0j\xff\xff\xff\x7f.");
  auto r = read_pickle(far);
  INFO(r.error);
  REQUIRE(r.value);
  CHECK(r.value->as_int() == 5);
  // Many far puts cost what they are: a few bytes of input, one slot each (no vector sized by the index).
  std::string many = bin("\x80\x02K\x01");
  for (std::uint32_t n = 0; n < 20000; ++n) {
    const std::uint32_t idx = 0xfffff000u - n * 4096u;
    many += 'r';
    for (int b = 0; b < 4; ++b) many += static_cast<char>(idx >> (8 * b) & 0xff);
  }
  many += '.';
  auto m = read_pickle(many);
  INFO(m.error);
  CHECK(m.value);
  auto undefined = read_pickle(bin("\x80\x02K\x05r\x01\x00\x00\x00" "0j\x02\x00\x00\x00."));
  CHECK_FALSE(undefined.value);
  CHECK(undefined.error.find("memo index 2 not defined") != std::string::npos);
  auto bad = read_pickle(bin("(dp0\nVk\npx\n"));
  CHECK_FALSE(bad.value);
  CHECK(bad.error.find("bad memo index 'x'") != std::string::npos);
}

TEST_CASE("pickle: lists under a count-only key keep their length and drop their items", "[formats]") {
  // {'frames': L, 'again': L, 'keep': [7, 8]} with L = [1, 2, 3] memoised and fetched back for 'again'.
  const std::string p = bin("\x80\x02}q\x00(X\x06\x00\x00\x00" "frames]q\x01(K\x01K\x02K\x03" "e"
                            "X\x05\x00\x00\x00" "againh\x01X\x04\x00\x00\x00" "keep](K\x07K\x08" "eu.");
  auto whole = read_pickle(p);
  INFO(whole.error);
  REQUIRE(whole.value);
  CHECK(whole.value->get("frames")->items.size() == 3);
  CHECK(whole.value->get("frames")->dropped == 0);
  ReadOptions o;
  o.count_only = {"frames"};
  auto counted = read_pickle(p, o);
  INFO(counted.error);
  REQUIRE(counted.value);
  const PyValue* f = counted.value->get("frames");
  REQUIRE(f);
  CHECK(f->items.empty());
  CHECK(f->dropped == 3);
  CHECK(counted.value->get("again") == f);  // the same list, through the memo: its length stays
  CHECK(counted.value->get("keep")->items.size() == 2);
  CHECK(counted.value->get("keep")->dropped == 0);
}

TEST_CASE("pickle: protocol 0 and 1 strings decoded as Python writes them", "[formats]") {
  // pickle.dumps({'k': 'a\nb\\é€😀 x'}, 0): raw-unicode-escape, latin-1 bytes for code points below 256.
  const std::string p0 = std::string("(dp0\nVk\np1\nVa\\u000ab\\u005c\xe9\\u20ac\\U0001f600 x\np2\ns.");
  auto r = read_pickle(p0);
  INFO(r.error);
  REQUIRE(r.value);
  const PyValue* k = r.value->get("k");
  REQUIRE(k);
  CHECK(k->s == "a\nb\\\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 x");
  // Python 2's STRING: a quoted literal.
  auto s = read_pickle(std::string("S'it\\'s\\n\\x41'\np0\n."));
  INFO(s.error);
  REQUIRE(s.value);
  CHECK(s.value->s == "it's\nA");
  auto bad = read_pickle(std::string("S'open\np0\n."));
  CHECK_FALSE(bad.value);
  CHECK(bad.error.find("not a quoted literal") != std::string::npos);
  auto future = read_pickle(bin("\x80\x06N."));
  CHECK_FALSE(future.value);
  CHECK(future.error.find("unsupported pickle protocol 6 (this reader knows 0 to 5) at byte 0") != std::string::npos);
}

TEST_CASE("snapshot versions: Python's pickle.dump at every protocol, frames memoised, loads one trace",
          "[formats][snapshot-versions]") {
  // The real pickler: memo (MEMOIZE, BINPUT, PUT), FRAME, BINUNICODE/SHORT_BINUNICODE, LONG1, text ints.
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("fragless_snapshot_versions_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string script = R"PY(
import pickle, sys
MiB = 1 << 20
base = 0x7f0000000000
frames = [{"filename": "train\u00e9.py", "line": 10, "name": "step"}]
trace = []
for n in range(300):
    trace.append({"action": "alloc", "addr": base + n * MiB, "size": MiB - n, "stream": 0, "time_us": 1700000000000000 + n,
                  "frames": frames, "compile_context": "N/A", "user_metadata": ""})
    if n % 3:
        trace.append({"action": "free_completed", "addr": base + n * MiB, "size": MiB - n, "stream": 0,
                      "time_us": 1700000000000000 + n, "frames": frames})
snap = {"segments": [{"device": 0, "address": base, "total_size": 300 * MiB, "stream": 0, "blocks": [
            {"address": base, "size": 300 * MiB, "requested_size": 0, "state": "inactive", "frames": []}]}],
        "device_traces": [trace], "allocator_settings": {"max_split_size": -1}, "external_annotations": []}
for p in range(6):
    with open(sys.argv[1] + "/p%d.pickle" % p, "wb") as f:
        pickle.dump(snap, f, protocol=p)
)PY";
  const fs::path py = dir / "write.py";
  std::ofstream(py) << script;
  const std::string cmd = "python3 " + py.string() + " " + dir.string();
  INFO(cmd);
  REQUIRE(std::system(cmd.c_str()) == 0);  // python3 is a build dependency (tools/install_deps.sh)
  for (int p = 0; p <= 5; ++p) {
    INFO("protocol " << p);
    std::ifstream in(dir / ("p" + std::to_string(p) + ".pickle"), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto r = load(bytes);
    INFO(r.error);
    REQUIRE(r.ok);
    CHECK(r.trace.events.size() == 500);
    std::size_t allocs = 0;
    for (const auto& e : r.trace.events) allocs += e.op == Op::alloc;
    CHECK(allocs == 300);
    CHECK(r.trace.events.back().time_us == 1700000000000299);
    CHECK(r.dropped == "stack frames (500 events, 0 blocks, 0 segments)");
    // Strings decode to the same UTF-8 at every protocol (protocol 0 writes raw-unicode-escape).
    auto pr = read_pickle(bytes);
    REQUIRE(pr.value);
    const PyValue* e0 = pr.value->get("device_traces")->items[0]->items[0].get();
    CHECK(e0->get("frames")->items[0]->get("filename")->s == "train\xc3\xa9.py");
  }
  fs::remove_all(dir);
}

TEST_CASE("pickle: a file cut short is said to be, at the byte it ends", "[formats][bad-input]") {
  // BININT (J) wants a 4-byte argument; two are there.
  auto r = read_pickle(bin("\x80\x02J\x01\x02"));
  CHECK_FALSE(r.value);
  CHECK(r.error == "pickle: input ends inside an instruction's 4-byte argument (truncated file) at byte 2");
  // SHORT_BINUNICODE (\x8c) of 9 bytes, three there: a declared length, which a corrupt file may also give.
  r = read_pickle(bin("\x80\x02\x8c\x09" "abc"));
  CHECK_FALSE(r.value);
  CHECK(r.error == "pickle: declared length 9 runs past the end of the input (a truncated or corrupt file) at byte 2");
}

// From a review of the readers against PyTorch's snapshots (docs/RELIABILITY.md, "Hostile reviews (2026-12-06,
// fourth)"): Note [Releases the program asked for], snapshot_import.cpp.
TEST_CASE("snapshot versions: each run of segment releases is an empty_cache call unless PyTorch may release on its own",
          "[formats][snapshot-versions]") {
  // The window ends with the small segment's block freed and the segment released alone (an empty_cache() in a
  // loop), then a range of an expandable segment mapped and unmapped alone.
  auto make = [](int settings_kind) {  // 0: PyTorch's defaults, 1: garbage collection on, 2: no allocator_settings
    Py snap = snapshot(Shape::v2_3);
    auto& segs = snap.at("segments").items;
    segs.erase(segs.begin() + 1);  // the small segment is gone at the dump
    auto& list = snap.at("device_traces").items[0].items;
    std::int64_t time = 1700000000001000;
    auto entry = [&](const char* action, std::int64_t addr, std::int64_t size) {
      list.push_back(D({{"action", S(action)}, {"addr", I(addr)}, {"size", I(size)}, {"stream", I(0)},
                        {"time_us", I(time += 5)}}));
    };
    entry("free_completed", kBase + 32 * MiB, 100);
    entry("segment_free", kBase + 32 * MiB, 2 * MiB);
    entry("segment_map", kBase + 64 * MiB, 2 * MiB);
    entry("segment_unmap", kBase + 64 * MiB, 2 * MiB);
    if (settings_kind == 1) snap.at("allocator_settings").set("garbage_collection_threshold", F(0.6));
    if (settings_kind == 2) snap.erase("allocator_settings");
    return snap;
  };
  for (int kind : {0, 1, 2}) {
    INFO("settings " << kind);
    auto r = load(python_pickle(make(kind)));
    INFO(r.error);
    REQUIRE(r.ok);
    std::size_t calls = 0;
    for (std::size_t n = 0; n < r.trace.events.size(); ++n)
      if (r.trace.events[n].op == Op::empty_cache) {
        ++calls;
        REQUIRE(n + 1 < r.trace.events.size());  // each just before the release it stands for
        CHECK((r.trace.events[n + 1].op == Op::segment_free || r.trace.events[n + 1].op == Op::segment_unmap));
      }
    CHECK(calls == (kind == 1 ? 0u : 2u));
    if (kind == 0) CHECK(r.warning.find("single segment release") == std::string::npos);
    if (kind == 1)
      CHECK(r.warning.find("device 0: 2 single segment releases taken as PyTorch's own (garbage_collection_threshold "
                           "or max_split_size_mb is set), not replayed") != std::string::npos);
    if (kind == 2)
      CHECK(r.warning.find("device 0: 2 single segment releases taken as empty_cache calls (the snapshot records no "
                           "allocator_settings") != std::string::npos);
  }
}

TEST_CASE("snapshot versions: segment entries that do not hold the live blocks give no recorded peak reserved",
          "[formats][snapshot-versions]") {
  // A 64 MiB tensor made and freed in the window, in a segment the window made and released; with the segment
  // entries skipped (skip_actions=["segment_alloc", "segment_free"]), rolling the dump's reserved back gives a
  // figure below what was live then.
  for (bool segments_kept : {true, false}) {
    INFO("segment entries kept: " << segments_kept);
    Py snap = snapshot(Shape::v2_3);
    auto& list = snap.at("device_traces").items[0].items;
    std::int64_t time = 1700000000001000;
    auto entry = [&](const char* action, std::int64_t addr, std::int64_t size) {
      list.push_back(D({{"action", S(action)}, {"addr", I(addr)}, {"size", I(size)}, {"stream", I(0)},
                        {"time_us", I(time += 5)}}));
    };
    const std::int64_t big = kBase + 128 * MiB;
    if (segments_kept) entry("segment_alloc", big, 64 * MiB);
    entry("alloc", big, 64 * MiB);
    entry("free_completed", big, 64 * MiB);
    if (segments_kept) entry("segment_free", big, 64 * MiB);
    auto r = load(python_pickle(snap));
    INFO(r.error);
    REQUIRE(r.ok);
    REQUIRE(r.trace.recorded_peak_reserved.size() == 1);
    if (segments_kept) {
      REQUIRE(r.trace.recorded_peak_reserved[0].has_value());
      CHECK(*r.trace.recorded_peak_reserved[0] == static_cast<std::uint64_t>(22 * MiB + 64 * MiB));
      CHECK(r.warning.find("do not account") == std::string::npos);
    } else {
      CHECK_FALSE(r.trace.recorded_peak_reserved[0].has_value());
      CHECK(r.warning.find("device 0: its segment entries do not account for the memory its blocks held") !=
            std::string::npos);
    }
  }
}
