// The tracer's clock (tracer.cpp): nanoseconds since the tracer's origin, made once per process.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace fragless {

// Nanoseconds since the tracer's origin from the cheapest clock available: the invariant TSC on x86-64
// (about 10 ns a read, calibrated against the monotonic clock once), the monotonic clock elsewhere.
struct TraceClock {
  std::uint64_t origin_unix_ns = 0;
#if defined(__x86_64__)
  std::uint64_t tick0 = 0;
  unsigned __int128 mult = 0;  // ns per tick << 32
  std::uint64_t now() const {
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(__rdtsc() - tick0) * mult) >> 32);
  }
#else
  std::chrono::steady_clock::time_point t0;
  std::uint64_t now() const {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }
#endif
  TraceClock() {
    using namespace std::chrono;
    origin_unix_ns = static_cast<std::uint64_t>(duration_cast<nanoseconds>(system_clock::now().time_since_epoch()).count());
#if defined(__x86_64__)
    const auto m0 = steady_clock::now();
    tick0 = __rdtsc();
    auto m1 = m0;
    while ((m1 = steady_clock::now()) - m0 < microseconds(2000)) {
    }
    const std::uint64_t tick1 = __rdtsc();
    const double ns = static_cast<double>(duration_cast<nanoseconds>(m1 - m0).count());
    const double ticks = static_cast<double>(tick1 - tick0);
    mult = static_cast<unsigned __int128>(ns / (ticks > 0 ? ticks : 1) * 4294967296.0);
#else
    t0 = steady_clock::now();
#endif
  }
};

// Made by the first event or trace file, under std::call_once, not as a function's static: its 2 ms calibration
// may run while the C ABI's allocator is being made, and a child forked meanwhile must be able to run it
// again (Note [Making the allocator once]).
inline std::atomic<const TraceClock*> g_trace_clock{nullptr};
inline const TraceClock& trace_clock() {
  if (const TraceClock* c = g_trace_clock.load(std::memory_order_acquire)) return *c;
  static std::once_flag once;
  std::call_once(once, [] { g_trace_clock.store(new TraceClock(), std::memory_order_release); });
  return *g_trace_clock.load(std::memory_order_acquire);
}

}  // namespace fragless
