// The snapshot reader's work on events already read (snapshot_window.h).
#include "snapshot_window.h"

#include <algorithm>
#include <iterator>
#include <vector>

#include "pickle.h"

namespace fragless::formats::snapshot_window {

namespace {
bool is_release(Op op) { return op == Op::segment_free || op == Op::segment_unmap; }
}  // namespace

// Note [Releases the program asked for]
// PyTorch releases cached memory (segment_free entries for classic segments, segment_unmap for an expandable
// segment's pages) in release_cached_blocks, which torch.cuda.empty_cache() calls, and so does the OOM retry
// (the program's allocation asked for memory PyTorch then freed its cache for); both release every free
// segment, one entry after another under the allocator's lock. Only two settings make PyTorch release on its
// own, a segment at a time: garbage_collection_threshold (garbage_collect_cached_blocks) and max_split_size_mb
// (release_available_cached_blocks). So each run of consecutive release entries is one empty_cache call, given
// to every replayed policy there, when the snapshot's allocator_settings (PyTorch 2.3 and later) show both
// off, and also when it has none (older snapshots, where those settings were rare; a note says how many
// single releases were taken so). With either on, a release of PyTorch's own and a call cannot be told apart
// (the frames could, but the reader does not keep them): runs of two or more are taken as calls, a lone
// release as PyTorch's own, and a note says so. A run of one entry is common: an empty_cache() in a loop
// whose cache holds one segment. Not told apart either: a private pool's release (torch.cuda.MemPool's
// destructor empties that pool alone), which the replay takes for a call that empties every pool.
OwnReleases own_releases(const PyValue& root) {
  const PyValue* st = root.type == PyValue::Type::dict ? root.get("allocator_settings") : nullptr;
  if (!st || st->type != PyValue::Type::dict) return OwnReleases::unknown;
  const PyValue* split = st->get("max_split_size");
  const PyValue* gc = st->get("garbage_collection_threshold");
  if (!split || !gc) return OwnReleases::unknown;
  const bool split_on = split->type == PyValue::Type::integer ? split->i >= 0 : true;  // -1: unlimited
  const bool gc_on = gc->type == PyValue::Type::real ? gc->f > 0 : gc->type == PyValue::Type::integer ? gc->i > 0 : true;
  return split_on || gc_on ? OwnReleases::possible : OwnReleases::off;
}

// Returns the lone releases taken as calls (OwnReleases::unknown) or left as PyTorch's own (::possible).
std::size_t add_empty_cache_calls(Trace& t, std::size_t first_event, OwnReleases own) {
  std::vector<Event> with_calls;
  with_calls.reserve(t.events.size() - first_event + 16);
  std::size_t lone = 0;
  for (std::size_t i = first_event; i < t.events.size(); ++i) {
    const Event& ev = t.events[i];
    if (is_release(ev.op) && (i == first_event || !is_release(t.events[i - 1].op))) {
      const bool run = i + 1 < t.events.size() && is_release(t.events[i + 1].op);
      lone += !run;
      if (run || own != OwnReleases::possible) {
        Event call = ev;
        call.op = Op::empty_cache;
        call.address = call.size = 0;
        with_calls.push_back(call);
      }
    }
    with_calls.push_back(ev);
  }
  t.events.resize(first_event);
  t.events.insert(t.events.end(), with_calls.begin(), with_calls.end());
  return own == OwnReleases::off ? 0 : lone;
}

// What the allocator held before the window: the dump's segments and mapped ranges rolled back through the
// window's segment events (undo a map: cut the range out; an unmap: add it back, merged with the ranges it
// touches; an alloc: drop the segment; a free: add it). Classic segments are segment_alloc entries, mapped
// ranges segment_map ones.
void add_pre_segments(Trace& t, std::size_t first_event, std::size_t dev, const std::map<std::uint64_t, DumpSeg>& at_dump) {
  std::map<std::uint64_t, DumpSeg> held = at_dump;
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
  // Classic segments the window frees first, in the order it frees them (the replay recreates them in this
  // order), then the rest by address.
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

}  // namespace fragless::formats::snapshot_window
