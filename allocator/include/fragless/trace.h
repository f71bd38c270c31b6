// The one narrow hook through which tracing observes the engine. The engine calls `on_event` at each
// point below when a sink is installed; with none installed the cost is one predictable branch.
#pragma once
#include <cstdint>

#include "fragless/driver.h"

namespace fragless {

enum class TraceAction : std::uint8_t {
  alloc = 1,           // address, requested size, block size
  free_requested = 2,  // free() called; the block may wait for events
  free_completed = 3,  // the block went back to the cache
  segment_alloc = 4,   // classic segment created (cudaMalloc equivalent)
  segment_free = 5,    // classic segment released
  segment_map = 6,     // pages mapped into a growable segment
  segment_unmap = 7,   // pages unmapped from a growable segment
  phys_create = 8,     // physical memory created (cuMemCreate)
  phys_release = 9,    // physical memory released (cuMemRelease)
  oom = 10,            // allocation failed; address = free device bytes
  snapshot = 11,
  empty_cache = 12,    // empty_cache() called
  free = 13,           // free_requested and free_completed at once (no stream uses to wait for)
  // State when the trace began (written first, at its start time): what was there before the window, not
  // something the window did. Converters use them so a trace of a window keeps what came before it.
  block_present = 14,    // a block live when the trace began
  segment_present = 15,  // a classic segment (block = 0) or a mapped growable range (block = 1) held then
};
inline constexpr int kTraceActionMax = 15;
const char* trace_action_name(TraceAction a);

// The sink stamps the time: the engine does not read a clock when tracing is off.
struct TraceEvent {
  TraceAction action = TraceAction::alloc;
  std::int32_t device = 0;
  Stream stream = 0;
  DevicePtr address = 0;
  std::uint64_t requested_size = 0;
  std::uint64_t block_size = 0;
};

class EventSink {
 public:
  virtual ~EventSink() = default;
  virtual void on_event(const TraceEvent& e) = 0;  // called with the device lock held: keep it short
  virtual void flush() {}                           // called with the device lock held
};

}  // namespace fragless
