// Emitting trace events from the engine: one predictable branch when no sink is installed.
#pragma once
#include "state/engine_state.h"
#include "fragless/trace.h"

namespace fragless {

[[gnu::noinline]] inline void emit_event(DeviceEngine::State& s, TraceAction a, Stream stream, DevicePtr addr,
                                         std::uint64_t requested, std::uint64_t size) {
  TraceEvent e;
  e.action = a;
  e.device = s.driver->device();
  e.stream = stream;
  e.address = addr;
  e.requested_size = requested;
  e.block_size = size;
  s.sink->on_event(e);
}

inline void emit(DeviceEngine::State& s, TraceAction a, Stream stream, DevicePtr addr, std::uint64_t requested,
                 std::uint64_t size) {
  if (__builtin_expect(s.sink != nullptr, 0)) emit_event(s, a, stream, addr, requested, size);
}

}  // namespace fragless
