// An engine's state (segments, blocks, recent events) as a PyTorch memory snapshot pickle: what
// torch.cuda.memory._snapshot() returns and _dump_snapshot() writes, so PyTorch's viewer draws it.
#pragma once
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "snapshot_layout.h"

#include "fragless/engine.h"
#include "fragless/trace.h"

namespace fragless::formats {

// Whether events of this action are entries of a snapshot's device_traces (a `free` is two:
// free_requested and free_completed); physical handles, empty_cache and a native trace's state records are not.
inline bool snapshot_has_entry(TraceAction a) {
  switch (a) {
    case TraceAction::phys_create:
    case TraceAction::phys_release:
    case TraceAction::empty_cache:
    case TraceAction::block_present:
    case TraceAction::segment_present: return false;
    default: return true;
  }
}

struct HistoryEntry {
  TraceAction action = TraceAction::alloc;
  std::uint64_t address = 0, size = 0;
  Stream stream = 0;
  std::int64_t time_us = 0;
  std::shared_ptr<const std::vector<Frame>> frames;  // null: none recorded
};

struct DeviceState {
  int device = 0;
  std::vector<SegmentInfo> segments;
  std::vector<ImportInfo> imports;  // other processes' blocks mapped here (the snapshot's "imported" list)
  std::vector<HistoryEntry> history;  // oldest first
  // Frames of the allocation of each live block, by address (what the viewer shows for a block).
  std::unordered_map<std::uint64_t, std::shared_ptr<const std::vector<Frame>>> block_frames;
  // Frames of the allocation that made the memory at each segment's start, by the segment's address (PyTorch's
  // context_when_segment_allocated; the viewer shows it for the segment).
  std::unordered_map<std::uint64_t, std::shared_ptr<const std::vector<Frame>>> segment_frames;
};

std::string engine_snapshot_pickle(const std::vector<DeviceState>& devices, const std::string& settings);

}  // namespace fragless::formats
