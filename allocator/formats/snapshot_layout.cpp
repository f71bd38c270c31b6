#include "snapshot_layout.h"

#include <cstring>
#include <string>

namespace fragless::formats::layout {

namespace {
// Note [Names written once]
// A snapshot repeats the same few keys in every dict, and the same actions and states: a million-entry history
// written with each one spelt out took Python's pickle.loads 9 s to read (6 s with its collector off), most of it
// making and hashing six new strings per entry. Python's pickler writes a string it meets again as a reference
// to the first (MEMOIZE, BINGET), as PyTorch's snapshots are; so do these. Keys are this file's literals, found
// again by address; values by content (shared_str), since a caller's text need not stay put.
void key(PickleWriter& w, const char* literal) {
  if (w.recall_object(literal)) return;
  w.shared_str(literal);
  w.also_known_as(literal);
}

// Note [Frames written once]
// Each frame is written once and referred to wherever it recurs, as PyTorch's snapshots share theirs: most
// stacks of a history share most of their frames (a snapshot of 100,000 events with C++ stacks was 276 MB
// written out in full). A frame is found again by its content (the memo key: its fields with their lengths),
// and, cheaper, by its address: the frames the caller hands over stay put while the snapshot is written, and
// the C ABI hands every event that captured the same stack the same vector (capi.cpp, DeviceSink::collect),
// so after its first event a stack costs a lookup per frame, not a key built from its strings.
void write_frames(PickleWriter& w, const std::vector<Frame>* frames) {
  key(w, "frames");
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
  key(w, "device");
  w.integer(s.device);
  key(w, "address");
  w.uinteger(s.address);
  key(w, "total_size");
  w.uinteger(s.total_size);
  key(w, "allocated_size");
  w.uinteger(s.allocated_size);
  key(w, "active_size");
  w.uinteger(s.active_size);
  key(w, "requested_size");
  w.uinteger(s.requested_size);
  key(w, "stream");
  w.uinteger(s.stream);
  key(w, "segment_type");
  w.shared_str(s.small ? "small" : "large");
  key(w, "segment_pool_id");
  w.begin_tuple();
  w.uinteger(s.pool_first);
  w.uinteger(s.pool_second);
  w.end_tuple();
  key(w, "is_expandable");
  w.boolean(s.expandable);
  if (s.exported_bytes) {
    key(w, "exported_bytes");
    w.uinteger(s.exported_bytes);
  }
  write_frames(w, s.frames);
  key(w, "blocks");
  w.begin_list();
}

void end_segment(PickleWriter& w) {
  w.end_list();
  w.end_dict();
}

void block(PickleWriter& w, std::uint64_t address, std::uint64_t size, std::uint64_t requested, const char* state,
           const std::vector<Frame>* frames, const Hold* hold) {
  w.begin_dict();
  key(w, "address");
  w.uinteger(address);
  key(w, "size");
  w.uinteger(size);
  key(w, "requested_size");
  w.uinteger(requested);
  key(w, "state");
  w.shared_str(state);
  write_frames(w, frames);
  if (hold) {
    key(w, "exported_bytes");
    w.uinteger(hold->exported_bytes);
    key(w, "leases");
    w.uinteger(hold->leases);
    key(w, "registrations");
    w.integer(hold->registrations);
    key(w, "owner_freed");
    w.boolean(hold->owner_freed);
  }
  w.end_dict();
}

void trace_entry(PickleWriter& w, const char* action, std::uint64_t address, std::uint64_t size, std::uint64_t stream,
                 std::int64_t time_us, const std::vector<Frame>* frames) {
  w.begin_dict();
  key(w, "action");
  w.shared_str(action);
  key(w, std::strcmp(action, "oom") == 0 ? "device_free" : "addr");
  w.uinteger(address);
  key(w, "size");
  w.uinteger(size);
  key(w, "stream");
  w.uinteger(stream);
  if (time_us >= 0) {
    key(w, "time_us");
    w.integer(time_us);
  }
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
