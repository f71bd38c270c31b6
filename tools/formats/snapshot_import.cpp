// PyTorch memory snapshot (torch.cuda.memory._dump_snapshot) → Trace.
#include <algorithm>
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
  // Blocks live at dump time, per device: address -> (requested, stream).
  std::vector<std::map<std::uint64_t, std::pair<std::uint64_t, std::uint64_t>>> live_at_dump(reserved_end.size());
  std::vector<std::vector<std::tuple<std::uint64_t, std::uint64_t, bool>>> segments_at_dump(reserved_end.size());
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
      segments_at_dump[dev].emplace_back(static_cast<std::uint64_t>(num(seg->get("address"))),
                                         static_cast<std::uint64_t>(num(seg->get("total_size"))),
                                         ex && ex->type == PyValue::Type::boolean && ex->i != 0);
    }
    const PyValue* blocks = seg->get("blocks");
    if (!blocks || blocks->type != PyValue::Type::list) continue;
    std::uint64_t addr = static_cast<std::uint64_t>(num(seg->get("address")));
    for (const auto& bp : blocks->items) {
      const PyValue* b = bp.get();
      const auto size = static_cast<std::uint64_t>(num(b->get("size")));
      const std::uint64_t baddr = b->get("address") ? static_cast<std::uint64_t>(num(b->get("address"))) : addr;
      if (str(b->get("state")) == "active_allocated")
        live_at_dump[dev][baddr] = {static_cast<std::uint64_t>(num(b->get("requested_size"), static_cast<std::int64_t>(size))),
                                    static_cast<std::uint64_t>(num(seg->get("stream")))};
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
    // Classic segments alive before the window: freed in it without being created in it, or alive at the
    // dump and never seen in it.
    {
      std::set<std::uint64_t> created, seen;
      for (std::size_t i = first_event; i < t.events.size(); ++i) {
        const Event& ev = t.events[i];
        if (ev.op == Op::segment_alloc) created.insert(ev.address), seen.insert(ev.address);
        if (ev.op == Op::segment_free) {
          if (!converted && !created.erase(ev.address) && !seen.count(ev.address)) t.pre_segments.push_back(ev);
          seen.insert(ev.address);
        }
      }
      for (const auto& [addr, size, expandable] : segments_at_dump[dev])
        if (!converted && !expandable && !seen.count(addr)) {
          Event s;
          s.op = Op::segment_alloc;
          s.device = static_cast<std::int32_t>(dev);
          s.address = addr;
          s.size = size;
          t.pre_segments.push_back(s);
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
        s.size = rs.first;
        s.stream = rs.second;
        t.seed.push_back(s);
      }
    // PyTorch's reserved over the window: the dump's reserved rolled back through the segment events.
    running = static_cast<std::int64_t>(reserved_end[dev]) - seg_delta;
    peak = running;
    for (auto d : deltas) peak = std::max(peak, running += d);
    if (!converted) t.recorded_peak_reserved[dev] = static_cast<std::uint64_t>(std::max<std::int64_t>(peak, 0));
  }
  return r;
}

}  // namespace fragless::formats
