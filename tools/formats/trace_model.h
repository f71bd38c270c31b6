// One event model for every trace format: what the replay consumes and the converters produce.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fragless::formats {

enum class Op : std::uint8_t { alloc, free, segment_alloc, segment_free, empty_cache };

struct Event {
  Op op = Op::alloc;
  std::int32_t device = 0;
  std::uint64_t stream = 0;
  std::uint64_t address = 0;  // the address the trace recorded (the key that pairs a free with its alloc)
  std::uint64_t size = 0;     // requested bytes (alloc, free) or segment bytes
  std::int64_t time_us = -1;  // -1 when the trace has no time
};

struct Trace {
  std::string source;                 // file name or workload spec
  std::vector<Event> events;          // in trace order
  // Allocations live before the window (frees of unknown addresses, blocks live at dump that the window
  // never allocated): replayed as allocations before the first event.
  std::vector<Event> seed;
  bool has_time = false;
  // PyTorch's own peak reserved over the window per device, when the snapshot tells it (segments at dump
  // time rolled back through the window's segment events); empty otherwise.
  std::vector<std::optional<std::uint64_t>> recorded_peak_reserved;
  int devices() const;
};

struct LoadResult {
  bool ok = false;
  Trace trace;
  std::string error;  // names the file and the position
};

// Reads a trace in any supported format, detected from content: PyTorch snapshot pickle or RMM CSV.
LoadResult load_trace(const std::string& path);
LoadResult trace_from_snapshot_bytes(const std::string& bytes, const std::string& name);
LoadResult trace_from_rmm_csv(const std::string& text, const std::string& name);
std::string trace_to_rmm_csv(const Trace& t, int device);

}  // namespace fragless::formats
