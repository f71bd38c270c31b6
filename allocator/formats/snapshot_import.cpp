// PyTorch memory snapshot (torch.cuda.memory._dump_snapshot) → Trace.
//
// Note [Snapshot versions]
// Every shape PyTorch has written since 2.0 is read, and each field the trace model needs is checked: a
// missing or mistyped one is an error that names the segment, block or trace entry and the key.
//  - The top level is a dict (segments, device_traces; allocator_settings and external_annotations from
//    2.1) or a bare list of segments (torch.cuda.memory_snapshot()). device_traces holds one list per device
//    the process saw (also empty ones); it is absent from the list form and from some hand-made dumps.
//  - Pickles come from Python's pickle (_dump_snapshot: protocol 4, or 5 under Python 3.14) or from
//    TorchScript's pickler (torch/csrc/cuda/memory_snapshot.cpp, _memory_snapshot_pickled: protocol 2, every
//    string memoised); pickle.cpp reads both.
//  - Blocks: 'address' from 2.1, else the segment's address plus the sizes of the blocks before it. Live at
//    the dump are those in state active_allocated and active_pending_free (freed by the program, their
//    memory held until other streams' work on them completes).
//    'requested_size' when written, else (the oldest dumps) the newest 'history' entry's 'real_size' (history
//    lists are newest first, as torch/cuda/_memory_viz.py reads them), else the block size.
//  - Trace entries: 'time_us' from 2.2; an oom names the free device memory 'device_free', not 'addr';
//    'frames', 'cpp_frames' (2.0), 'compile_context' and 'user_metadata' (2.4+) are counted as dropped.
//  - A free is free_completed. A device whose trace has free_requested entries and not one free_completed was
//    recorded with _record_memory_history(skip_actions=["free_completed"]): its free_requested entries are
//    the frees (the block's return to the cache is what was skipped), said in a warning. A trace that
//    allocates again at an address it has not freed lost its frees altogether: a warning says so.
//  - Without history (recording off, or the legacy _record_memory_history(True), which keeps one entry)
//    there are no alloc entries: the blocks live at the dump still load (as the seed), and a warning says
//    that there is nothing to replay and how to record a trace. Actions of a newer PyTorch are skipped, and
//    a warning names them.
#include <algorithm>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <set>
#include <tuple>

#include "pickle.h"
#include "snapshot_window.h"
#include "trace_model.h"

namespace fragless::formats {

int Trace::devices() const {
  int n = 0;
  for (auto& e : events) n = std::max(n, e.device + 1);
  for (auto& e : seed) n = std::max(n, e.device + 1);
  return std::max(n, 1);
}

namespace {
using namespace snapshot_window;

// (A device index above trace_model.h's kMaxDevices is a corrupt file, refused before anything is sized by it.)
// More memory than any device has (4 EiB): a device's segments adding up to more are a corrupt file, and the
// reserved-bytes arithmetic below stays far from overflow.
constexpr std::uint64_t kMaxReserved = std::uint64_t{1} << 62;

struct Bad {
  std::string what;
};
[[noreturn]] void bad(std::string what) { throw Bad{std::move(what)}; }

const char* type_name(const PyValue& v) {
  switch (v.type) {
    case PyValue::Type::none: return "None";
    case PyValue::Type::boolean: return "a bool";
    case PyValue::Type::integer: return "an int";
    case PyValue::Type::real: return "a float";
    case PyValue::Type::str: return "a str";
    case PyValue::Type::bytes: return "bytes";
    case PyValue::Type::list: return "a list";
    case PyValue::Type::tuple: return "a tuple";
    case PyValue::Type::dict: return "a dict";
    case PyValue::Type::set: return "a set";
  }
  return "?";
}

// A dict's value under `key`; None counts as absent.
const PyValue* field(const PyValue& d, const char* key) {
  const PyValue* v = d.get(key);
  return v && v->type != PyValue::Type::none ? v : nullptr;
}

// What an integer field may hold: sizes and device indices are in [0, 2^63) (PyTorch writes them as int64);
// addresses are any 64-bit value (fragless writes them unsigned), never negative; streams are handles,
// any 64-bit pattern.
enum class Int { size, address, handle };

std::uint64_t integer(const PyValue& v, Int kind, const std::string& where, const char* key) {
  if (v.type != PyValue::Type::integer)
    bad(where + ": '" + key + "' is " + type_name(v) + ", not an int");
  if ((kind == Int::size && (v.wide || v.i < 0)) || (kind == Int::address && !v.wide && v.i < 0))
    bad(where + ": '" + key + "' is " + v.int_text() + (kind == Int::size ? ", outside [0, 2^63)" : ", negative"));
  return v.as_uint();
}
std::uint64_t need(const PyValue& d, const char* key, Int kind, const std::string& where) {
  const PyValue* v = field(d, key);
  if (!v) bad(where + ": no '" + std::string(key) + "'");
  return integer(*v, kind, where, key);
}
std::uint64_t opt(const PyValue& d, const char* key, Int kind, const std::string& where, std::uint64_t fallback) {
  const PyValue* v = field(d, key);
  return v ? integer(*v, kind, where, key) : fallback;
}
std::string text(const PyValue& d, const char* key, const std::string& where) {
  const PyValue* v = field(d, key);
  if (!v) bad(where + ": no '" + std::string(key) + "'");
  if (v->type != PyValue::Type::str) bad(where + ": '" + key + "' is " + type_name(*v) + ", not a str");
  return v->s;
}
const PyValue* list_or_null(const PyValue& d, const char* key, const std::string& where) {
  const PyValue* v = field(d, key);
  if (v && v->type != PyValue::Type::list) bad(where + ": '" + key + "' is " + type_name(*v) + ", not a list");
  return v;
}
std::size_t device_index(std::uint64_t d, const std::string& where) {
  if (d >= static_cast<std::uint64_t>(kMaxDevices))
    bad(where + ": device " + std::to_string(d) + " is out of range (at most " + std::to_string(kMaxDevices) + " devices)");
  return static_cast<std::size_t>(d);
}

bool has_frames(const PyValue& v) {
  const PyValue* f = v.get("frames");
  if (f && f->type == PyValue::Type::list && (!f->items.empty() || f->dropped > 0)) return true;
  const PyValue* c = v.get("cpp_frames");  // 2.0: C++ frames as one string
  return c && c->type == PyValue::Type::str && !c->s.empty();
}

// A block allocated at dump time: (requested, stream, block size). Segments (classic) and mapped ranges
// (expandable) at dump time are DumpSegs (snapshot_window.h), by address.
using LiveBlock = std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>;

struct Device {
  std::uint64_t reserved_end = 0;
  std::map<std::uint64_t, LiveBlock> live_at_dump;
  std::map<std::uint64_t, DumpSeg> segments_at_dump;
};

// Note [Work bounded by the input]
// A pickle refers back to an object it already wrote in two bytes, so a small file can name one segment a
// thousand times, each holding a thousand references to one block with a long history: the reader builds
// each object once (Note [The unpickler's memory budget]), but the import would read every reference of
// every reference. PyTorch pickles each segment, block and trace entry as a dict of its own, at least a few
// bytes each, so the import reads at most one block, history record or entry per byte of input, or
// kVisitFloor (2^22) for small files where that is more; past that it stops with an error instead of working for minutes.
constexpr std::uint64_t kVisitFloor = std::uint64_t{1} << 22;

struct Counts {
  std::size_t framed_blocks = 0, framed_segments = 0, framed_events = 0, context_events = 0, metadata_events = 0;
  std::size_t entries = 0, allocs = 0, frees = 0, live_blocks = 0;
  std::map<std::string, std::size_t> unknown_actions;
  std::vector<std::string> notes;  // warnings
  std::uint64_t visits = 0, visit_limit = kVisitFloor;  // Note [Work bounded by the input]
  void visit(std::uint64_t n, const std::string& where) {
    visits += n;
    if (visits > visit_limit)
      bad(where + ": the snapshot names more than " + std::to_string(visit_limit) + " blocks, history records and " +
          "trace entries (one per byte of the file, at least " + std::to_string(kVisitFloor) +
          "), through references to the same objects: not a snapshot PyTorch writes");
  }
};

void read_segment(const PyValue& seg, const std::string& where, std::vector<Device>& devs, Counts& c) {
  if (seg.type != PyValue::Type::dict) bad(where + " is " + type_name(seg) + ", not a dict");
  const std::size_t dev = device_index(opt(seg, "device", Int::size, where, 0), where);
  if (dev >= devs.size()) devs.resize(dev + 1);
  Device& d = devs[dev];
  const std::uint64_t address = need(seg, "address", Int::address, where);
  const std::uint64_t total = need(seg, "total_size", Int::size, where);
  if (address + total < address) bad(where + ": address + total_size is past 2^64");
  const std::uint64_t stream = opt(seg, "stream", Int::handle, where, 0);
  if (d.reserved_end > kMaxReserved - std::min(total, kMaxReserved))
    bad(where + ": the device's segments add up to more than 2^62 bytes");
  d.reserved_end += total;
  // Segments are disjoint ranges of one device's memory: one that starts inside another, or holds another's
  // start, contradicts it, and nothing read after could say which one holds the blocks.
  const auto range = [](std::uint64_t a, std::uint64_t n) {
    return "[" + address_text(a) + ", " + address_text(a + n) + ")";
  };
  auto overlapped = [&](const auto& other) {
    bad(where + ": its range " + range(address, total) + " overlaps device " + std::to_string(dev) +
        "'s segment at " + range(other.first, other.second.size));
  };
  auto next = d.segments_at_dump.lower_bound(address);
  if (next != d.segments_at_dump.end() && (next->first == address || next->first < address + total)) overlapped(*next);
  if (next != d.segments_at_dump.begin() && std::prev(next)->first + std::prev(next)->second.size > address)
    overlapped(*std::prev(next));
  const PyValue* ex = seg.get("is_expandable");
  d.segments_at_dump[address] = {total, ex && ex->type == PyValue::Type::boolean && ex->i != 0, stream};
  c.framed_segments += has_frames(seg);
  const PyValue* blocks = list_or_null(seg, "blocks", where);
  if (!blocks) return;
  std::uint64_t at = address;
  std::size_t index = 0;
  for (const auto& bp : blocks->items) {
    const PyValue& b = *bp;
    const std::string bw = where + ".blocks[" + std::to_string(index++) + "]";
    if (b.type != PyValue::Type::dict) bad(bw + " is " + type_name(b) + ", not a dict");
    const std::uint64_t size = need(b, "size", Int::size, bw);
    const std::uint64_t baddr = opt(b, "address", Int::address, bw, at);
    // A segment's blocks tile it in address order: one that begins before the block before it ends, or
    // reaches past its segment, contradicts the rest (two live blocks over one byte of memory).
    if (baddr < at)
      bad(bw + ": it begins at " + address_text(baddr) + ", before " + address_text(at) + ", where " +
          (index == 1 ? "its segment begins" : "the block before it ends"));
    if (baddr + size < baddr || baddr + size > address + total)
      bad(bw + ": its range " + range(baddr, size) + " reaches past its segment's " + range(address, total));
    const PyValue* history = list_or_null(b, "history", bw);
    c.visit(1 + (history ? history->items.size() : 0), bw);
    bool framed = has_frames(b);
    if (history)
      for (const auto& h : history->items) framed |= h->type == PyValue::Type::dict && has_frames(*h);
    c.framed_blocks += framed;
    // A block the program freed whose free waits for work of other streams (record_stream) still holds its
    // memory at the dump: PyTorch writes it as active_pending_free, and it is live like an allocated one.
    if (const std::string state = text(b, "state", bw); state == "active_allocated" || state == "active_pending_free") {
      std::uint64_t requested = size;
      if (field(b, "requested_size")) {
        requested = need(b, "requested_size", Int::size, bw);
      } else if (history && !history->items.empty() && history->items[0]->type == PyValue::Type::dict) {
        requested = opt(*history->items[0], "real_size", Int::size, bw + ".history[0]", size);
      }
      d.live_at_dump[baddr] = {requested, stream, size};
      ++c.live_blocks;
    }
    at = baddr + size;
  }
}

// One device's trace entries → events appended to t.events.
void read_trace(const PyValue& list, std::size_t dev, const std::string& where, Trace& t, Counts& c) {
  if (list.type != PyValue::Type::list) bad(where + " is " + type_name(list) + ", not a list");
  // skip_actions=["free_completed"]: the free_requested entries are the frees.
  bool any_completed = false, any_requested = false, any_alloc = false;
  for (const auto& ep : list.items)
    if (ep->type == PyValue::Type::dict)
      if (const PyValue* a = ep->get("action"); a && a->type == PyValue::Type::str) {
        any_completed |= a->s == "free_completed";
        any_requested |= a->s == "free_requested";
        any_alloc |= a->s == "alloc";
      }
  const bool requested_frees = any_requested && !any_completed;
  // skip_actions=["alloc"] (or a trace that kept only frees): an address the allocator reused is freed again
  // with no allocation between, which is no double free here. The first free of each address frees a block
  // live before the window; the later ones free blocks whose allocations were skipped, and are left out
  // (the note on a trace with no allocation says what was recorded).
  const bool frees_only = !any_alloc;
  std::size_t taken = 0, reallocated = 0;
  std::set<std::uint64_t> allocated_in_window;
  std::map<std::uint64_t, std::string> freed_in_window;  // address -> the entry that freed it, until reallocated
  std::int64_t latest = -1;  // the latest time_us read, and its entry
  std::string latest_entry;
  std::size_t index = 0;
  for (const auto& ep : list.items) {
    const PyValue& e = *ep;
    const std::string ew = where + "[" + std::to_string(index++) + "]";
    c.visit(1, ew);
    if (e.type != PyValue::Type::dict) bad(ew + " is " + type_name(e) + ", not a dict");
    const std::string action = text(e, "action", ew);
    ++c.entries;
    c.framed_events += has_frames(e);
    if (const PyValue* x = e.get("compile_context"); x && x->type == PyValue::Type::str && !x->s.empty() && x->s != "N/A")
      ++c.context_events;
    if (const PyValue* m = e.get("user_metadata"); m && m->type == PyValue::Type::str && !m->s.empty()) ++c.metadata_events;
    static const std::set<std::string> known = {"alloc", "free_requested", "free_completed", "segment_alloc",
                                                "segment_free", "segment_map", "segment_unmap", "snapshot", "oom"};
    if (!known.count(action)) {  // an action of a newer PyTorch: nothing to replay
      ++c.unknown_actions[action];
      continue;
    }
    const std::string aw = ew + " ('" + action + "')";
    Event ev;
    ev.device = static_cast<std::int32_t>(dev);
    ev.stream = opt(e, "stream", Int::handle, aw, 0);
    // A failed request may have asked any 64-bit size (event_out_of_bounds): never negative, never placed.
    ev.size = need(e, "size", action == "oom" ? Int::address : Int::size, aw);
    if (action == "oom")  // the free device memory, under its own key (older hand-made dumps: 'addr')
      ev.address = field(e, "device_free") ? need(e, "device_free", Int::size, aw) : opt(e, "addr", Int::size, aw, 0);
    else
      ev.address = need(e, "addr", Int::address, aw);
    if (const PyValue* tu = field(e, "time_us")) {
      if (tu->type != PyValue::Type::integer) bad(aw + ": 'time_us' is " + std::string(type_name(*tu)) + ", not an int");
      if (tu->wide || tu->i < 0 || tu->i > kMaxTimeUs)
        bad(aw + ": 'time_us' is " + tu->int_text() + ", outside [0, " + std::to_string(kMaxTimeUs) + "] (2^64 ns)");
      ev.time_us = tu->as_int();
      t.has_time = true;
      // Entries are recorded in order under the allocator's lock: a time more than a second before an earlier
      // entry's is a clock set back or an edited file (the RMM reader's rule, Note [Times of day in an RMM log]).
      if (ev.time_us + kOutOfOrderUs < latest)
        bad(aw + ": 'time_us' " + std::to_string(ev.time_us) + " is " + seconds_text(latest - ev.time_us) +
            " s before " + latest_entry + "'s; entries may be out of order by at most 1 s");
      if (ev.time_us > latest) {
        latest = ev.time_us;
        latest_entry = ew;
      }
    }
    if (action != "oom" && action != "snapshot" && ev.address + ev.size < ev.address)
      bad(aw + ": addr + size is past 2^64");
    const bool null = holds_nothing(ev);
    if (action == "alloc") {
      ev.op = Op::alloc;
      reallocated += !null && !allocated_in_window.insert(ev.address).second;
      freed_in_window.erase(ev.address);
      ++c.allocs;
    } else if (action == "free_completed" || (action == "free_requested" && requested_frees)) {
      ev.op = Op::free;
      ++c.frees;
      taken += action == "free_requested";
      if (!null && !allocated_in_window.count(ev.address)) {
        // A block the window freed and has not allocated again: the entries free it twice. (A window loses only
        // its oldest entries, and skip_actions a whole kind, so no lost entry explains a second free.)
        if (const auto was = freed_in_window.find(ev.address); was != freed_in_window.end()) {
          if (frees_only) continue;
          bad(aw + ": a second free of " + address_text(ev.address) + ", which " + was->second +
              " freed with no allocation there since");
        }
        Event s = ev;  // allocated before the window: seed it
        s.op = Op::alloc;
        t.seed.push_back(s);
      }
      allocated_in_window.erase(ev.address);
      if (!null) freed_in_window[ev.address] = ew;
    } else if (action == "free_requested") {
      ev.op = Op::free_requested;
    } else if (action == "segment_alloc" || action == "segment_map") {
      ev.op = action == "segment_alloc" ? Op::segment_alloc : Op::segment_map;
    } else if (action == "segment_free" || action == "segment_unmap") {
      ev.op = action == "segment_free" ? Op::segment_free : Op::segment_unmap;
    } else if (action == "oom") {
      ev.op = Op::oom;
    } else {
      ev.op = Op::snapshot;
    }
    t.events.push_back(ev);
  }
  if (taken)
    c.notes.push_back("device " + std::to_string(dev) + "'s trace has " + std::to_string(taken) +
                      " free_requested entries and no free_completed (recorded with skip_actions=[\"free_completed\"]?): "
                      "the free_requested entries are taken as the frees");
  if (reallocated)  // a window records every entry after its first: only skip_actions loses a free
    c.notes.push_back("device " + std::to_string(dev) + ": " + std::to_string(reallocated) + " allocation" +
                      (reallocated == 1 ? "" : "s") + " at an address the trace has not freed: the frees are missing "
                      "(recorded with skip_actions?), so the replay holds memory the program had freed");
}

LoadResult import(const PyValue& root, const std::string& name, std::uint64_t input_bytes) {
  const PyValue* segments = nullptr;
  const PyValue* traces = nullptr;
  if (root.type == PyValue::Type::list) {
    segments = &root;  // old memory_snapshot() output: a list of segments
  } else if (root.type == PyValue::Type::dict) {
    segments = root.get("segments");
    if (!segments || segments->type != PyValue::Type::list)
      bad(std::string("not a PyTorch memory snapshot (") +
          (segments ? std::string("'segments' is ") + type_name(*segments) + ", not a list" : "no 'segments' list") + ")");
    traces = list_or_null(root, "device_traces", "the snapshot");
  } else {
    bad(std::string("not a PyTorch memory snapshot (the top level is ") + type_name(root) + ", neither a dict nor a list)");
  }
  if (traces && traces->items.size() > static_cast<std::size_t>(kMaxDevices))
    bad("'device_traces' has " + std::to_string(traces->items.size()) + " lists, more than " + std::to_string(kMaxDevices) +
        " devices");
  LoadResult r;
  Trace& t = r.trace;
  t.source = name;
  Counts c;
  c.visit_limit = std::max(kVisitFloor, input_bytes);
  std::vector<Device> devs(std::max<std::size_t>(traces ? traces->items.size() : 0, 1));
  for (std::size_t i = 0; i < segments->items.size(); ++i)
    read_segment(*segments->items[i], "segments[" + std::to_string(i) + "]", devs, c);
  // Written by fragless-trace convert: the segments are reconstructed, so they say nothing about what an
  // allocator reserved.
  bool converted = false;
  if (root.type == PyValue::Type::dict)
    if (const PyValue* st = root.get("allocator_settings"))
      if (const PyValue* cv = st->get("fragless_converted")) converted = cv->type == PyValue::Type::boolean && cv->i;
  const OwnReleases own = converted ? OwnReleases::off : own_releases(root);  // Note [Releases the program asked for]
  t.recorded_peak_reserved.assign(devs.size(), std::nullopt);
  for (std::size_t dev = 0; dev < devs.size(); ++dev) {
    const std::size_t first_event = t.events.size();
    if (traces && dev < traces->items.size())
      read_trace(*traces->items[dev], dev, "device_traces[" + std::to_string(dev) + "]", t, c);
    if (const std::size_t lone = add_empty_cache_calls(t, first_event, own))
      c.notes.push_back(
          "device " + std::to_string(dev) + ": " + std::to_string(lone) + " single segment release" +
          (lone == 1 ? "" : "s") +
          (own == OwnReleases::unknown
               ? " taken as empty_cache calls (the snapshot records no allocator_settings; with "
                 "garbage_collection_threshold or max_split_size_mb set PyTorch also releases a segment on its own)"
               : " taken as PyTorch's own (garbage_collection_threshold or max_split_size_mb is set), not replayed; "
                 "runs of two or more releases are taken as empty_cache calls"));
    if (!converted) add_pre_segments(t, first_event, dev, devs[dev].segments_at_dump);
    // A block the window allocated and the dump still holds: the dump tells its size after rounding (the
    // trace entry holds the size asked for).
    const auto& live = devs[dev].live_at_dump;
    std::set<std::uint64_t> settled, allocated_ever;
    for (std::size_t i = t.events.size(); i-- > first_event;) {
      Event& ev = t.events[i];
      if (ev.op == Op::alloc) allocated_ever.insert(ev.address);
      if ((ev.op != Op::alloc && ev.op != Op::free) || !settled.insert(ev.address).second) continue;
      if (ev.op == Op::alloc)
        if (auto it = live.find(ev.address); it != live.end()) ev.block_size = std::get<2>(it->second);
    }
    // Blocks live at dump time that the window never allocated were live throughout: seed them too.
    for (const auto& [addr, rs] : live)
      if (!allocated_ever.count(addr)) {
        Event s;
        s.device = static_cast<std::int32_t>(dev);
        s.address = addr;
        s.size = std::get<0>(rs);
        s.stream = std::get<1>(rs);
        s.block_size = std::get<2>(rs);
        t.seed.push_back(s);
      }
    // PyTorch's reserved over the window: the dump's reserved rolled back through the segment events.
    // In 128 bits: each event's size is below 2^63, and a hostile trace may hold many.
    __int128 running = static_cast<__int128>(devs[dev].reserved_end), peak = 0;
    for (std::size_t i = first_event; i < t.events.size(); ++i) {
      const Event& ev = t.events[i];
      if (ev.op == Op::segment_alloc || ev.op == Op::segment_map) running -= static_cast<__int128>(ev.size);
      if (ev.op == Op::segment_free || ev.op == Op::segment_unmap) running += static_cast<__int128>(ev.size);
    }
    peak = running;
    // Reserved bytes hold the live blocks at every moment: where the rolled-back reserved falls below the
    // bytes live then, the segment entries are incomplete (skip_actions of the segment actions, or a hand-
    // trimmed trace), and the figure would be no peak of PyTorch's: it is not reported.
    std::unordered_map<std::uint64_t, std::uint64_t> live_now;
    __int128 live_bytes = 0;
    for (const Event& s : t.seed)
      if (s.device == static_cast<std::int32_t>(dev) && live_now.emplace(s.address, s.size).second) live_bytes += s.size;
    bool short_of_live = running < live_bytes;
    for (std::size_t i = first_event; i < t.events.size(); ++i) {
      const Event& ev = t.events[i];
      if (ev.op == Op::segment_alloc || ev.op == Op::segment_map) running += static_cast<__int128>(ev.size);
      if (ev.op == Op::segment_free || ev.op == Op::segment_unmap) running -= static_cast<__int128>(ev.size);
      if (ev.op == Op::alloc && !holds_nothing(ev) && live_now.emplace(ev.address, ev.size).second) live_bytes += ev.size;
      if (ev.op == Op::free)
        if (auto it = live_now.find(ev.address); it != live_now.end()) live_bytes -= it->second, live_now.erase(it);
      short_of_live |= running < live_bytes;
      peak = std::max(peak, running);
    }
    if (short_of_live && !converted) {
      c.notes.push_back("device " + std::to_string(dev) + ": its segment entries do not account for the memory its " +
                        "blocks held (recorded with skip_actions of segment_alloc/segment_free?): PyTorch's peak " +
                        "reserved is not known");
    } else if (!converted)
      t.recorded_peak_reserved[dev] =
          static_cast<std::uint64_t>(std::clamp<__int128>(peak, 0, static_cast<__int128>(UINT64_MAX)));
  }
  if (!c.allocs) {
    std::string held = std::to_string(c.live_blocks) + " block" + (c.live_blocks == 1 ? "" : "s") + " live at the dump";
    if (c.frees)  // each was live before the window too (fragless-trace info counts both)
      held += " and the " + std::to_string(c.frees) + " its history frees";
    std::string why;
    if (root.type == PyValue::Type::list)
      why = "a list of segments (torch.cuda.memory_snapshot()) records no history";
    else if (!traces)
      why = "the snapshot has no 'device_traces'";
    else if (!c.entries)
      why = "its device_traces are empty (history was not recorded)";
    else if (c.frees > 1)  // the legacy history keeps one entry; more frees and no alloc: allocs were skipped
      why = "its device_traces hold " + std::to_string(c.frees) + " free" + (c.frees == 1 ? "" : "s") +
            " and no 'alloc' (recorded with _record_memory_history(skip_actions=[\"alloc\"])?)";
    else
      why = "its device_traces hold " + std::to_string(c.entries) + " entr" + (c.entries == 1 ? "y" : "ies") +
            " and no 'alloc' (history kept only the last entries: the legacy _record_memory_history(True) keeps one)";
    const bool one = c.live_blocks + c.frees == 1;
    c.notes.push_back("no allocation history to replay: " + why + "; only the " + held + (one ? " is" : " are") +
                      " known. Call torch.cuda.memory._record_memory_history(max_entries=100000) before the "
                      "work, then dump the snapshot");
  }
  if (!c.unknown_actions.empty()) {
    std::string list;
    for (const auto& [a, n] : c.unknown_actions) list += (list.empty() ? "'" : ", '") + a + "' (" + std::to_string(n) + ")";
    c.notes.push_back("trace entries of actions this reader does not know were skipped: " + list);
  }
  for (std::size_t i = 0; i < c.notes.size(); ++i) r.warning += (i ? "; " : name + ": ") + c.notes[i];
  std::vector<std::string> lost;
  if (c.framed_events || c.framed_blocks || c.framed_segments)
    lost.push_back("stack frames (" + std::to_string(c.framed_events) + " events, " + std::to_string(c.framed_blocks) +
                   " blocks, " + std::to_string(c.framed_segments) + " segments)");
  if (c.context_events) lost.push_back("compile_context of " + std::to_string(c.context_events) + " events");
  if (c.metadata_events) lost.push_back("user_metadata of " + std::to_string(c.metadata_events) + " events");
  if (root.type == PyValue::Type::dict)
    if (const PyValue* a = root.get("external_annotations"); a && a->type == PyValue::Type::list && !a->items.empty())
      lost.push_back(std::to_string(a->items.size()) + " external_annotations");
  for (std::size_t i = 0; i < lost.size(); ++i) r.dropped += (i ? ", " : "") + lost[i];
  r.ok = true;
  return r;
}

}  // namespace

LoadResult trace_from_snapshot_bytes(const std::string& bytes, const std::string& name) {
  // Stack frames are only counted (the trace model does not keep them): a frame list's references are let go
  // once read (the frame dicts themselves stay, shared through the memo), about 16 bytes per frame of every
  // trace entry.
  ReadOptions options;
  options.count_only = {"frames"};
  PickleResult pr = read_pickle(bytes, options);
  LoadResult r;
  if (!pr.value) {
    r.error = name + ": " + pr.error;
    return r;
  }
  try {
    LoadResult loaded = import(*pr.value, name, bytes.size());
    if (loaded.ok && pr.end < bytes.size())  // Python's pickle.load stops at STOP too; said, not passed over
      loaded.warning += (loaded.warning.empty() ? name + ": " : std::string("; ")) + std::to_string(bytes.size() - pr.end) +
                        " bytes after the pickle's end (byte " + std::to_string(pr.end) + ") are not read";
    return loaded;
  } catch (const Bad& b) {
    r.error = name + ": " + b.what;
    return r;
  }
}

}  // namespace fragless::formats
