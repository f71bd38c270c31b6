// PyTorch memory snapshot (torch.cuda.memory._dump_snapshot) → Trace.
#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <tuple>

#include "pickle.h"
#include "trace_model.h"

namespace fragless::formats {

int Trace::devices() const {
  int n = 0;
  for (auto& e : events) n = std::max(n, e.device + 1);
  for (auto& e : seed) n = std::max(n, e.device + 1);
  return std::max(n, 1);
}

namespace {

std::int64_t num(const PyValue* v, std::int64_t fallback = 0) { return v && v->is_number() ? v->as_int() : fallback; }
std::string str(const PyValue* v) { return v && v->type == PyValue::Type::str ? v->s : std::string(); }

LoadResult fail(const std::string& name, const std::string& what) {
  LoadResult r;
  r.error = name + ": " + what;
  return r;
}

}  // namespace

LoadResult trace_from_snapshot_bytes(const std::string& bytes, const std::string& name) {
  PickleResult pr = read_pickle(bytes);
  if (!pr.value) return fail(name, pr.error);
  const PyValue* root = pr.value.get();
  const PyValue* segments = nullptr;
  const PyValue* traces = nullptr;
  if (root->type == PyValue::Type::list) {
    segments = root;  // old memory_snapshot() output: a list of segments
  } else if (root->type == PyValue::Type::dict) {
    segments = root->get("segments");
    traces = root->get("device_traces");
  } else {
    return fail(name, "not a PyTorch memory snapshot (top level is neither a dict nor a list)");
  }
  if (!segments || segments->type != PyValue::Type::list)
    return fail(name, "not a PyTorch memory snapshot (no 'segments' list)");
  LoadResult r;
  r.ok = true;
  Trace& t = r.trace;
  t.source = name;
  const std::size_t ndev = traces && traces->type == PyValue::Type::list ? traces->items.size() : 1;
  std::vector<std::uint64_t> reserved_end(std::max<std::size_t>(ndev, 1), 0);
  // Blocks live at dump time, per device: address -> (requested, stream, block size).
  std::vector<std::map<std::uint64_t, std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>>> live_at_dump(reserved_end.size());
  std::size_t framed_blocks = 0, framed_segments = 0, framed_events = 0, context_events = 0, metadata_events = 0;
  auto has_frames = [](const PyValue* v) {
    const PyValue* f = v ? v->get("frames") : nullptr;
    return f && f->type == PyValue::Type::list && !f->items.empty();
  };
  // Segments (classic) and mapped ranges (expandable) at dump time, per device: address -> (size, expandable, stream).
  struct DumpSeg { std::uint64_t size; bool expandable; std::uint64_t stream; std::size_t freed_at = SIZE_MAX; };
  std::vector<std::map<std::uint64_t, DumpSeg>> segments_at_dump(reserved_end.size());
  for (const auto& sp : segments->items) {
    const PyValue* seg = sp.get();
    if (seg->type != PyValue::Type::dict) return fail(name, "segment entry is not a dict");
    const auto dev = static_cast<std::size_t>(std::max<std::int64_t>(0, num(seg->get("device"))));
    if (dev >= reserved_end.size()) {
      reserved_end.resize(dev + 1, 0);
      live_at_dump.resize(dev + 1);
      segments_at_dump.resize(dev + 1);
    }
    reserved_end[dev] += static_cast<std::uint64_t>(num(seg->get("total_size")));
    {
      const PyValue* ex = seg->get("is_expandable");
      segments_at_dump[dev][static_cast<std::uint64_t>(num(seg->get("address")))] = {
          static_cast<std::uint64_t>(num(seg->get("total_size"))), ex && ex->type == PyValue::Type::boolean && ex->i != 0,
          static_cast<std::uint64_t>(num(seg->get("stream")))};
    }
    framed_segments += has_frames(seg);
    const PyValue* blocks = seg->get("blocks");
    if (!blocks || blocks->type != PyValue::Type::list) continue;
    std::uint64_t addr = static_cast<std::uint64_t>(num(seg->get("address")));
    for (const auto& bp : blocks->items) {
      const PyValue* b = bp.get();
      const auto size = static_cast<std::uint64_t>(num(b->get("size")));
      const std::uint64_t baddr = b->get("address") ? static_cast<std::uint64_t>(num(b->get("address"))) : addr;
      framed_blocks += has_frames(b);
      if (str(b->get("state")) == "active_allocated")
        live_at_dump[dev][baddr] = {static_cast<std::uint64_t>(num(b->get("requested_size"), static_cast<std::int64_t>(size))),
                                    static_cast<std::uint64_t>(num(seg->get("stream"))), size};
      addr = baddr + size;
    }
  }
  t.recorded_peak_reserved.assign(reserved_end.size(), std::nullopt);
  // Written by fragless-trace convert: the segments are reconstructed, so they say nothing about what an
  // allocator reserved.
  bool converted = false;
  if (root->type == PyValue::Type::dict)
    if (const PyValue* st = root->get("allocator_settings"))
      if (const PyValue* c = st->get("fragless_converted")) converted = c->type == PyValue::Type::boolean && c->i;
  for (std::size_t dev = 0; traces && dev < traces->items.size(); ++dev) {
    const PyValue* list = traces->items[dev].get();
    if (list->type != PyValue::Type::list) return fail(name, "device_traces[" + std::to_string(dev) + "] is not a list");
    std::set<std::uint64_t> allocated_in_window;
    const std::size_t first_event = t.events.size();
    std::int64_t seg_delta = 0, running = 0, peak = 0;
    std::vector<std::int64_t> deltas;
    std::size_t index = 0;
    for (const auto& ep : list->items) {
      const PyValue* e = ep.get();
      ++index;
      if (e->type != PyValue::Type::dict) return fail(name, "trace entry " + std::to_string(index) + " is not a dict");
      const std::string action = str(e->get("action"));
      framed_events += has_frames(e);
      if (const PyValue* c = e->get("compile_context"); c && c->type == PyValue::Type::str && !c->s.empty() && c->s != "N/A")
        ++context_events;
      if (const PyValue* m = e->get("user_metadata"); m && m->type == PyValue::Type::str && !m->s.empty()) ++metadata_events;
      Event ev;
      ev.device = static_cast<std::int32_t>(dev);
      ev.stream = static_cast<std::uint64_t>(num(e->get("stream")));
      ev.address = static_cast<std::uint64_t>(num(e->get("addr")));
      ev.size = static_cast<std::uint64_t>(num(e->get("size")));
      if (const PyValue* tu = e->get("time_us"); tu && tu->is_number()) {
        ev.time_us = tu->as_int();
        t.has_time = true;
      }
      if (action == "alloc") {
        ev.op = Op::alloc;
        allocated_in_window.insert(ev.address);
      } else if (action == "free_completed") {
        ev.op = Op::free;
        if (!allocated_in_window.count(ev.address)) {  // allocated before the window: seed it
          Event s = ev;
          s.op = Op::alloc;
          t.seed.push_back(s);
        }
        allocated_in_window.erase(ev.address);
      } else if (action == "segment_alloc" || action == "segment_map") {
        ev.op = action == "segment_alloc" ? Op::segment_alloc : Op::segment_map;
        deltas.push_back(static_cast<std::int64_t>(ev.size));
        seg_delta += static_cast<std::int64_t>(ev.size);
      } else if (action == "segment_free" || action == "segment_unmap") {
        ev.op = action == "segment_free" ? Op::segment_free : Op::segment_unmap;
        deltas.push_back(-static_cast<std::int64_t>(ev.size));
        seg_delta -= static_cast<std::int64_t>(ev.size);
      } else if (action == "free_requested") {
        ev.op = Op::free_requested;
      } else if (action == "oom") {
        ev.op = Op::oom;
        ev.address = static_cast<std::uint64_t>(num(e->get("device_free"), num(e->get("addr"))));
      } else if (action == "snapshot") {
        ev.op = Op::snapshot;
      } else {
        continue;  // an action of a newer PyTorch: nothing to replay
      }
      t.events.push_back(ev);
    }
    // A burst of consecutive segment_free entries is what torch.cuda.empty_cache() (or PyTorch's own
    // release-everything OOM retry) leaves in a snapshot: the program asked for its cache to be emptied, so
    // every replayed policy gets the same empty_cache call there. A lone segment_free (garbage
    // collection, an oversize release) is PyTorch's own decision and is not replayed.
    {
      std::vector<Event> with_calls;
      with_calls.reserve(t.events.size() - first_event + 16);
      for (std::size_t i = first_event; i < t.events.size(); ++i) {
        const Event& ev = t.events[i];
        if (ev.op == Op::segment_free && (i == first_event || t.events[i - 1].op != Op::segment_free) &&
            i + 1 < t.events.size() && t.events[i + 1].op == Op::segment_free) {
          Event call = ev;
          call.op = Op::empty_cache;
          call.address = call.size = 0;
          with_calls.push_back(call);
        }
        with_calls.push_back(ev);
      }
      t.events.resize(first_event);
      t.events.insert(t.events.end(), with_calls.begin(), with_calls.end());
    }
    // What the allocator held before the window: the dump's segments and mapped ranges rolled back through
    // the window's segment events (undo a map: cut the range out; an unmap: add it back, merged with the
    // ranges it touches; an alloc: drop the segment; a free: add it). Classic segments are segment_alloc
    // entries, mapped ranges segment_map ones.
    if (!converted) {
      std::map<std::uint64_t, DumpSeg> held = segments_at_dump[dev];
      for (std::size_t i = t.events.size(); i-- > first_event;) {
        const Event& ev = t.events[i];
        const std::uint64_t a = ev.address, b = ev.address + ev.size;
        if (ev.op == Op::segment_alloc) {
          held.erase(a);
        } else if (ev.op == Op::segment_free) {
          held[a] = {ev.size, false, ev.stream, i};
        } else if (ev.op == Op::segment_map) {
          auto it = held.upper_bound(a);
          if (it == held.begin()) continue;
          --it;
          const std::uint64_t s0 = it->first;
          const DumpSeg d = it->second;
          if (!d.expandable || s0 + d.size < b) continue;  // not a range this dump holds: nothing to undo
          held.erase(it);
          if (a > s0) held[s0] = {a - s0, true, d.stream};
          if (b < s0 + d.size) held[b] = {s0 + d.size - b, true, d.stream};
        } else if (ev.op == Op::segment_unmap) {
          std::uint64_t lo = a, hi = b;
          auto next = held.find(b);
          if (next != held.end() && next->second.expandable) hi += next->second.size, held.erase(next);
          auto it = held.lower_bound(a);
          if (it != held.begin()) {
            auto prev = std::prev(it);
            if (prev->second.expandable && prev->first + prev->second.size == a) lo = prev->first, held.erase(prev);
          }
          held[lo] = {hi - lo, true, ev.stream};
        }
      }
      // Classic segments the window frees first, in the order it frees them (the replay recreates them in
      // this order), then the rest by address.
      std::vector<std::pair<std::uint64_t, DumpSeg>> order(held.begin(), held.end());
      std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) { return x.second.freed_at < y.second.freed_at; });
      for (const auto& [addr, d] : order) {
        Event s;
        s.op = d.expandable ? Op::segment_map : Op::segment_alloc;
        s.device = static_cast<std::int32_t>(dev);
        s.address = addr;
        s.size = d.size;
        s.stream = d.stream;
        t.pre_segments.push_back(s);
      }
    }
    // A block the window allocated and the dump still holds: the dump tells its size after rounding (the
    // trace entry holds the size asked for).
    {
      std::set<std::uint64_t> settled;
      for (std::size_t i = t.events.size(); i-- > first_event;) {
        Event& ev = t.events[i];
        if ((ev.op != Op::alloc && ev.op != Op::free) || !settled.insert(ev.address).second) continue;
        if (ev.op == Op::alloc)
          if (auto it = live_at_dump[dev].find(ev.address); it != live_at_dump[dev].end()) ev.block_size = std::get<2>(it->second);
      }
    }
    // Blocks live at dump time that the window never allocated were live throughout: seed them too.
    std::set<std::uint64_t> allocated_ever;
    for (const auto& ev : t.events)
      if (ev.device == static_cast<std::int32_t>(dev) && ev.op == Op::alloc) allocated_ever.insert(ev.address);
    for (const auto& [addr, rs] : live_at_dump[dev])
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
    running = static_cast<std::int64_t>(reserved_end[dev]) - seg_delta;
    peak = running;
    for (auto d : deltas) peak = std::max(peak, running += d);
    if (!converted) t.recorded_peak_reserved[dev] = static_cast<std::uint64_t>(std::max<std::int64_t>(peak, 0));
  }
  {
    std::vector<std::string> lost;
    if (framed_events || framed_blocks || framed_segments)
      lost.push_back("stack frames (" + std::to_string(framed_events) + " events, " + std::to_string(framed_blocks) +
                     " blocks, " + std::to_string(framed_segments) + " segments)");
    if (context_events) lost.push_back("compile_context of " + std::to_string(context_events) + " events");
    if (metadata_events) lost.push_back("user_metadata of " + std::to_string(metadata_events) + " events");
    if (root->type == PyValue::Type::dict)
      if (const PyValue* a = root->get("external_annotations"); a && a->type == PyValue::Type::list && !a->items.empty())
        lost.push_back(std::to_string(a->items.size()) + " external_annotations");
    for (std::size_t i = 0; i < lost.size(); ++i) r.dropped += (i ? ", " : "") + lost[i];
  }
  return r;
}

}  // namespace fragless::formats
