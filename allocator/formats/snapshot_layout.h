// The pieces of PyTorch's snapshot layout (reference §13), written once for both snapshot writers: the
// converter (snapshot_export.cpp) and the engine's live snapshot (engine_snapshot.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "pickle.h"

namespace fragless::formats {
// One stack frame in PyTorch's layout: {"filename", "line", "name"}.
struct Frame {
  std::string filename, name;
  std::int64_t line = 0;
};
}  // namespace fragless::formats

namespace fragless::formats::layout {

struct SegmentHeader {
  int device = 0;
  std::uint64_t address = 0, total_size = 0, allocated_size = 0, active_size = 0, requested_size = 0, stream = 0;
  bool small = false, expandable = false;
  std::uint64_t pool_first = 0, pool_second = 0;
  std::uint64_t exported_bytes = 0;  // fragless: bytes of its blocks' shares (written when not 0)
  const std::vector<Frame>* frames = nullptr;  // the stack of the allocation that made it, if recorded
};

// fragless's fields of a block held for other processes or NCCL (docs/PYTORCH.md, "Sharing across processes"),
// written after PyTorch's own: the viewer reads only the keys it knows.
struct Hold {
  bool owner_freed = false;
  std::uint64_t exported_bytes = 0, leases = 0;
  std::int64_t registrations = 0;
};

// `frames` (a block's, an entry's) must stay alive and unchanged until the writer is finished: a frame is
// found again by its address (Note [Frames written once], snapshot_layout.cpp).
// Opens a segment dict and its "blocks" list; write its blocks, then end_segment.
void begin_segment(PickleWriter& w, const SegmentHeader& s);
void end_segment(PickleWriter& w);
void block(PickleWriter& w, std::uint64_t address, std::uint64_t size, std::uint64_t requested, const char* state,
           const std::vector<Frame>* frames = nullptr, const Hold* hold = nullptr);
// One device_traces entry; an OOM entry carries the device's free bytes as "device_free". time_us < 0: none.
void trace_entry(PickleWriter& w, const char* action, std::uint64_t address, std::uint64_t size,
                 std::uint64_t stream, std::int64_t time_us, const std::vector<Frame>* frames = nullptr);
// allocator_settings and external_annotations, then closes the top-level dict.
void end_snapshot(PickleWriter& w, const std::string& settings, bool converted);

}  // namespace fragless::formats::layout
