#include "snapshot_layout.h"

#include <cstring>
#include <string>

namespace fragless::formats::layout {

namespace {
// Note [Frames written once]
// Each frame is written once and referred to wherever it recurs, as PyTorch's snapshots share theirs: most
// stacks of a history share most of their frames (a snapshot of 100,000 events with C++ stacks was 276 MB
// written out in full). A frame is found again by its content (the memo key: its fields with their lengths),
// and, cheaper, by its address: the frames the caller hands over stay put while the snapshot is written, and
// the C ABI hands every event that captured the same stack the same vector (capi.cpp, DeviceSink::collect),
// so after its first event a stack costs a lookup per frame, not a key built from its strings.
void write_frames(PickleWriter& w, const std::vector<Frame>* frames) {
  w.str("frames");
  w.begin_list();
  if (frames)
    for (const Frame& f : *frames) {
      if (w.recall_object(&f)) continue;  // this very frame, met in a stack written before
      std::string key = std::to_string(f.filename.size()) + ':' + f.filename;  // lengths: no two frames alike
      key += std::to_string(f.name.size()) + ':' + f.name;
      key += std::to_string(f.line);
      const bool fresh = w.begin_shared_dict(key);
      w.also_known_as(&f);
      if (!fresh) continue;
      w.shared_str("filename");
      w.shared_str(f.filename);
      w.shared_str("line");
      w.integer(f.line);
      w.shared_str("name");
      w.shared_str(f.name);
      w.end_dict();
    }
  w.end_list();
}
}  // namespace

void begin_segment(PickleWriter& w, const SegmentHeader& s) {
  w.begin_dict();
  w.kv_int("device", s.device);
  w.kv_uint("address", s.address);
  w.kv_uint("total_size", s.total_size);
  w.kv_uint("allocated_size", s.allocated_size);
  w.kv_uint("active_size", s.active_size);
  w.kv_uint("requested_size", s.requested_size);
  w.kv_uint("stream", s.stream);
  w.kv("segment_type", s.small ? "small" : "large");
  w.str("segment_pool_id");
  w.begin_tuple();
  w.uinteger(s.pool_first);
  w.uinteger(s.pool_second);
  w.end_tuple();
  w.str("is_expandable");
  w.boolean(s.expandable);
  if (s.exported_bytes) w.kv_uint("exported_bytes", s.exported_bytes);
  write_frames(w, s.frames);
  w.str("blocks");
  w.begin_list();
}

void end_segment(PickleWriter& w) {
  w.end_list();
  w.end_dict();
}

void block(PickleWriter& w, std::uint64_t address, std::uint64_t size, std::uint64_t requested, const char* state,
           const std::vector<Frame>* frames, const Hold* hold) {
  w.begin_dict();
  w.kv_uint("address", address);
  w.kv_uint("size", size);
  w.kv_uint("requested_size", requested);
  w.kv("state", state);
  write_frames(w, frames);
  if (hold) {
    w.kv_uint("exported_bytes", hold->exported_bytes);
    w.kv_uint("leases", hold->leases);
    w.kv_int("registrations", hold->registrations);
    w.str("owner_freed");
    w.boolean(hold->owner_freed);
  }
  w.end_dict();
}

void trace_entry(PickleWriter& w, const char* action, std::uint64_t address, std::uint64_t size, std::uint64_t stream,
                 std::int64_t time_us, const std::vector<Frame>* frames) {
  w.begin_dict();
  w.kv("action", action);
  w.kv_uint(std::strcmp(action, "oom") == 0 ? "device_free" : "addr", address);
  w.kv_uint("size", size);
  w.kv_uint("stream", stream);
  if (time_us >= 0) w.kv_int("time_us", time_us);
  write_frames(w, frames);
  w.end_dict();
}

void end_snapshot(PickleWriter& w, const std::string& settings, bool converted) {
  w.str("allocator_settings");
  w.begin_dict();
  w.kv("PYTORCH_CUDA_ALLOC_CONF", settings);
  w.kv("allocator", "fragless");
  if (converted) {
    w.str("fragless_converted");  // segments reconstructed from a trace, not what an allocator recorded
    w.boolean(true);
  }
  w.end_dict();
  w.str("external_annotations");
  w.begin_list();
  w.end_list();
  w.end_dict();
}

}  // namespace fragless::formats::layout
