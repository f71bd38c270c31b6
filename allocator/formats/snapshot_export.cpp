// Trace → PyTorch memory snapshot (the layout of torch.cuda.memory._dump_snapshot), so that
// torch.cuda._memory_viz and pytorch.org/memory_viz draw fragless traces.
#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <unordered_set>

#include "pickle.h"
#include "snapshot_layout.h"
#include "trace_model.h"

namespace fragless::formats {

namespace {

struct LiveBlock {
  std::uint64_t requested = 0, size = 0, stream = 0;
};

struct SegOut {
  std::uint64_t address = 0, size = 0, stream = 0;
  bool expandable = false;
};

std::uint64_t round512(std::uint64_t n) { return n == 0 ? 512 : (n + 511) / 512 * 512; }

// The segments alive at the end of the trace on one device, with their blocks.
std::vector<std::pair<SegOut, std::vector<std::pair<std::uint64_t, LiveBlock>>>> end_state(const Trace& t, int dev) {
  std::map<std::uint64_t, LiveBlock> live;
  std::map<std::uint64_t, SegOut> segs;  // classic segments and mapped ranges (merged when adjacent)
  bool any_segment_events = false;
  for (const auto& e : t.events) any_segment_events |= e.device == dev && is_segment_op(e.op);
  // What the allocator held before the window, then the window's own segment events.
  for (const auto& e : t.pre_segments)
    if (e.device == dev) {
      segs[e.address] = {e.address, e.size, e.stream, e.op == Op::segment_map};
      any_segment_events = true;
    }
  for (const auto& e : t.seed)
    if (e.device == dev) live[e.address] = {e.size, e.block_size ? e.block_size : round512(e.size), e.stream};
  for (const auto& e : t.events) {
    if (e.device != dev) continue;
    switch (e.op) {
      case Op::alloc: live[e.address] = {e.size, e.block_size ? e.block_size : round512(e.size), e.stream}; break;
      case Op::free: live.erase(e.address); break;
      case Op::segment_alloc: segs[e.address] = {e.address, e.size, e.stream, false}; break;
      case Op::segment_free: segs.erase(e.address); break;
      case Op::segment_map: {
        SegOut s{e.address, e.size, e.stream, true};
        auto it = segs.lower_bound(e.address);
        if (it != segs.begin()) {  // merge with the range ending where this one starts
          auto prev = std::prev(it);
          if (prev->second.expandable && prev->first + prev->second.size == e.address) {
            s.address = prev->first;
            s.size += prev->second.size;
            segs.erase(prev);
          }
        }
        it = segs.find(e.address + e.size);
        if (it != segs.end() && it->second.expandable) {
          s.size += it->second.size;
          segs.erase(it);
        }
        segs[s.address] = s;
        break;
      }
      case Op::segment_unmap: {
        // Cut [a, b) out of whichever mapped range holds it.
        const std::uint64_t a = e.address, b = e.address + e.size;
        auto it = segs.upper_bound(a);
        if (it == segs.begin()) break;
        --it;
        const SegOut s = it->second;
        if (!s.expandable || s.address + s.size < b) break;
        segs.erase(it);
        if (a > s.address) segs[s.address] = {s.address, a - s.address, s.stream, true};
        if (b < s.address + s.size) segs[b] = {b, s.address + s.size - b, s.stream, true};
        break;
      }
      default: break;
    }
  }
  // Without segment events the trace does not say which segments held the blocks. PyTorch's viewer needs
  // every block it draws, at every event, inside a segment: one segment per run of address space that blocks
  // of the trace ever used (overlapping or touching extents merged), held throughout.
  if (!any_segment_events) {
    std::map<std::uint64_t, std::uint64_t> extent;  // start -> end
    auto use = [&](const Event& e) {
      const std::uint64_t end = e.address + (e.block_size ? e.block_size : round512(e.size));
      auto [it, fresh] = extent.emplace(e.address, end);
      if (!fresh) it->second = std::max(it->second, end);
    };
    for (const auto& e : t.seed)
      if (e.device == dev) use(e);
    for (const auto& e : t.events)
      if (e.device == dev && (e.op == Op::alloc || e.op == Op::free)) use(e);
    std::uint64_t lo = 0, hi = 0;
    bool open = false;
    for (auto [a, b] : extent) {
      if (open && a <= hi) {
        hi = std::max(hi, b);
        continue;
      }
      if (open) segs[lo] = {lo, hi - lo, 0, false};
      lo = a, hi = b, open = true;
    }
    if (open) segs[lo] = {lo, hi - lo, 0, false};
  }
  using Out = std::pair<SegOut, std::vector<std::pair<std::uint64_t, LiveBlock>>>;
  std::vector<Out> out;
  for (auto& [addr, s] : segs) out.push_back({s, {}});
  // Blocks no recorded segment holds (allocated before any segment event) get segments of their own, kept
  // apart until every block is placed: `out` stays sorted for the search.
  std::vector<Out> own;
  for (auto l = live.begin(); l != live.end(); ++l) {
    const std::uint64_t addr = l->first;
    // A block's size the trace does not give (an RMM log's) is guessed as PyTorch's rounding of the request,
    // which may reach past the next live block (RMM places 256-byte allocations 256 bytes apart): every block
    // ends by the next one's address, so blocks, and the segments of their own below, stay disjoint.
    LiveBlock b = l->second;
    if (const auto next = std::next(l); next != live.end()) b.size = std::min(b.size, next->first - addr);
    auto it = std::upper_bound(out.begin(), out.end(), addr,
                               [](std::uint64_t a, const Out& seg) { return a < seg.first.address; });
    if (it != out.begin()) {
      auto& seg = *std::prev(it);
      if (addr < seg.first.address + seg.first.size) {
        LiveBlock c = b;
        c.size = std::min(c.size, seg.first.address + seg.first.size - addr);
        if (seg.second.empty() || seg.second.back().first + seg.second.back().second.size <= addr) {
          seg.second.push_back({addr, c});
          continue;
        }
      }
    }
    // Its own segment ends where the next segment (recorded, or of the block after it) begins: segments
    // are disjoint ranges in PyTorch's snapshots, and its viewer draws them so.
    LiveBlock c = b;
    if (it != out.end()) c.size = std::min(c.size, it->first.address - addr);
    own.push_back({SegOut{addr, c.size, c.stream, false}, {{addr, c}}});
  }
  out.insert(out.end(), own.begin(), own.end());
  std::sort(out.begin(), out.end(), [](const Out& x, const Out& y) { return x.first.address < y.first.address; });
  return out;
}

}  // namespace

std::string trace_to_snapshot(const Trace& t) {
  const int ndev = t.devices();
  PickleWriter w;
  w.begin_dict();
  w.str("segments");
  w.begin_list();
  for (int dev = 0; dev < ndev; ++dev) {
    for (auto& [seg, blocks] : end_state(t, dev)) {
      layout::SegmentHeader h;
      h.device = dev;
      h.address = seg.address;
      h.total_size = seg.size;
      for (auto& [a, b] : blocks) {
        h.allocated_size += b.size;
        h.requested_size += b.requested;
      }
      h.active_size = h.allocated_size;
      h.stream = seg.stream;
      h.small = seg.size <= (2u << 20) && !seg.expandable;
      h.expandable = seg.expandable;
      layout::begin_segment(w, h);
      // Blocks tile the segment: live blocks, inactive gaps between them.
      std::uint64_t at = seg.address;
      for (auto& [a, b] : blocks) {
        if (a > at) layout::block(w, at, a - at, 0, "inactive");
        layout::block(w, a, b.size, b.requested, "active_allocated");
        at = a + b.size;
      }
      if (at < seg.address + seg.size) layout::block(w, at, seg.address + seg.size - at, 0, "inactive");
      layout::end_segment(w);
    }
  }
  w.end_list();
  w.str("device_traces");
  w.begin_list();
  for (int dev = 0; dev < ndev; ++dev) {
    w.begin_list();
    std::unordered_set<std::uint64_t> requested;  // frees already announced by free_requested
    for (const auto& e : t.events) {
      if (e.device != dev) continue;
      // An oom entry's size is the rounded request, as PyTorch records it: a native trace keeps it as the
      // event's block size (its size is the bytes asked); one read from a snapshot has it as its size.
      const std::uint64_t size = e.op == Op::oom && e.block_size ? e.block_size : e.size;
      auto entry = [&](const char* action) { layout::trace_entry(w, action, e.address, size, e.stream, e.time_us); };
      switch (e.op) {
        case Op::free_requested:
          requested.insert(e.address);
          entry("free_requested");
          break;
        case Op::free:
          if (!requested.erase(e.address)) entry("free_requested");
          entry("free_completed");
          break;
        case Op::phys_create:
        case Op::phys_release:
        case Op::empty_cache: break;  // no PyTorch counterpart
        default: entry(op_name(e.op)); break;
      }
    }
    w.end_list();
  }
  w.end_list();
  layout::end_snapshot(w, "", /*converted=*/true);
  return w.finish();
}

}  // namespace fragless::formats
