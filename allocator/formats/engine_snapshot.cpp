#include "engine_snapshot.h"

#include <algorithm>
#include <utility>

#include "pickle.h"
#include "snapshot_layout.h"

namespace fragless::formats {

namespace {
const char* block_state(BlockInfo::State s) {
  switch (s) {
    case BlockInfo::active_allocated: return "active_allocated";
    case BlockInfo::active_pending_free: return "active_pending_free";
    default: return "inactive";
  }
}
}  // namespace

std::string engine_snapshot_pickle(const std::vector<DeviceState>& devices, const std::string& settings) {
  PickleWriter w;
  w.begin_dict();
  w.str("segments");
  w.begin_list();
  for (const auto& d : devices)
    for (const auto& seg : d.segments) {
      layout::SegmentHeader h;
      h.device = d.device;
      h.address = seg.address;
      h.total_size = seg.total_size;
      h.allocated_size = seg.allocated_size;
      h.active_size = seg.active_size;
      h.requested_size = seg.requested_size;
      h.stream = seg.stream;
      h.small = seg.small;
      h.expandable = seg.expandable;
      h.pool_first = seg.pool.first;
      h.pool_second = seg.pool.second;
      h.exported_bytes = seg.exported_bytes;
      if (auto it = d.segment_frames.find(seg.address); it != d.segment_frames.end()) h.frames = it->second.get();
      layout::begin_segment(w, h);
      for (const auto& b : seg.blocks)
        if (b.state != BlockInfo::unmapped) {  // outside the mapped range: not part of a segment
          const std::vector<Frame>* frames = nullptr;
          if (b.state != BlockInfo::inactive)
            if (auto it = d.block_frames.find(b.address); it != d.block_frames.end() && it->second) frames = it->second.get();
          const layout::Hold hold{b.owner_freed, b.exported_bytes, b.leases, b.registrations};
          layout::block(w, b.address, b.size, b.requested_size, block_state(b.state), frames, b.held ? &hold : nullptr);
        }
      layout::end_segment(w);
    }
  w.end_list();
  w.str("device_traces");
  w.begin_list();
  int ndev = 0;
  for (const auto& d : devices) ndev = std::max(ndev, d.device + 1);
  for (int dev = 0; dev < ndev; ++dev) {
    w.begin_list();
    for (const auto& d : devices) {
      if (d.device != dev) continue;
      for (const auto& h : d.history) {
        auto entry = [&](const char* action) {
          layout::trace_entry(w, action, h.address, h.size, h.stream, h.time_us, h.frames.get());
        };
        if (h.action == TraceAction::free) {
          entry("free_requested");
          entry("free_completed");
        } else if (snapshot_has_entry(h.action)) {
          entry(trace_action_name(h.action));
        }
      }
    }
    w.end_list();
  }
  w.end_list();
  // fragless: other processes' blocks mapped here (open_shared), in no segment: the viewer ignores the key.
  w.str("imported");
  w.begin_list();
  for (const auto& d : devices)
    for (const ImportInfo& im : d.imports) {
      w.begin_dict();
      const std::pair<const char*, std::uint64_t> fields[] = {
          {"address", im.address}, {"size", im.size}, {"mapped_address", im.mapped_address},
          {"mapped_size", im.mapped_size}};
      w.kv_int("device", d.device);
      for (const auto& [key, value] : fields) w.kv_uint(key, value);
      w.kv_int("exporter_pid", im.exporter_pid);
      w.kv("segment_type", im.small ? "small" : "large");
      w.end_dict();
    }
  w.end_list();
  layout::end_snapshot(w, settings, /*converted=*/false);
  return w.finish();
}

}  // namespace fragless::formats
