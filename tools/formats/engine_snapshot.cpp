#include "engine_snapshot.h"

#include "pickle.h"

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
      w.begin_dict();
      w.kv_int("device", d.device);
      w.kv_uint("address", seg.address);
      w.kv_uint("total_size", seg.total_size);
      w.kv_uint("allocated_size", seg.allocated_size);
      w.kv_uint("active_size", seg.active_size);
      w.kv_uint("requested_size", seg.requested_size);
      w.kv_uint("stream", seg.stream);
      w.kv("segment_type", seg.small ? "small" : "large");
      w.str("segment_pool_id");
      w.begin_tuple();
      w.uinteger(seg.pool.first);
      w.uinteger(seg.pool.second);
      w.end_tuple();
      w.str("is_expandable");
      w.boolean(seg.expandable);
      w.str("frames");
      w.begin_list();
      w.end_list();
      w.str("blocks");
      w.begin_list();
      for (const auto& b : seg.blocks) {
        if (b.state == BlockInfo::unmapped) continue;  // outside the mapped range: not part of a segment
        w.begin_dict();
        w.kv_uint("address", b.address);
        w.kv_uint("size", b.size);
        w.kv_uint("requested_size", b.requested_size);
        w.kv("state", block_state(b.state));
        w.str("frames");
        w.begin_list();
        w.end_list();
        w.end_dict();
      }
      w.end_list();
      w.end_dict();
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
      auto entry = [&](const HistoryEntry& h, const char* action) {
        w.begin_dict();
        w.kv("action", action);
        w.kv_uint(h.action == TraceAction::oom ? "device_free" : "addr", h.address);
        w.kv_uint("size", h.size);
        w.kv_uint("stream", h.stream);
        w.kv_int("time_us", h.time_us);
        w.str("frames");
        w.begin_list();
        w.end_list();
        w.end_dict();
      };
      for (const auto& h : d.history) {
        switch (h.action) {
          case TraceAction::free:
            entry(h, "free_requested");
            entry(h, "free_completed");
            break;
          case TraceAction::phys_create:
          case TraceAction::phys_release:
          case TraceAction::empty_cache: break;
          default: entry(h, trace_action_name(h.action)); break;
        }
      }
    }
    w.end_list();
  }
  w.end_list();
  w.str("allocator_settings");
  w.begin_dict();
  w.kv("PYTORCH_CUDA_ALLOC_CONF", settings);
  w.kv("allocator", "fragless");
  w.end_dict();
  w.str("external_annotations");
  w.begin_list();
  w.end_list();
  w.end_dict();
  return w.finish();
}

}  // namespace fragless::formats
