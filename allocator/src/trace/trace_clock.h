// The tracer's clock (tracer.cpp): nanoseconds since the tracer's origin, made once per process.
//
// Note [The trace clock]
// A record's time is read on the allocation path, so it is the cheapest clock there is, read raw: the
// time-stamp counter on x86-64 (about 10 ns a read) when the processor says it is invariant (CPUID 0x80000007,
// EDX bit 8: it ticks at one rate whatever the core's frequency and sleep state) or the kernel has made it its
// clock source (a virtual machine may hide the bit), else the monotonic clock's nanoseconds (a vDSO call).
// The sink stores the raw ticks; the file's writer turns them into nanoseconds just before it writes them
// (to_ns, under the clock's mutex), so the allocation path does no arithmetic and no synchronisation for the
// time (but at exit, when each record is written as it is made: Note [Tracing at exit]).
//
// Ticks become nanoseconds by a line, ns = anchor_ns + (ticks - anchor_tick) * rate, fitted to the monotonic
// clock. The first line is measured over 2 ms when the clock is made, which leaves its rate off by 5 to 20 ppm
// (two clock reads' error over 2 ms): left alone, up to 72 ms an hour, and two ranks' traces of one run would
// drift apart. So the writers refit it (refine(), every 100 ms, which acts at most once per interval): after
// 1 s, then at intervals doubling up to 64 s, each time against a sample taken then, with the rate measured
// from the first sample to this one (two reads' error over the whole run so far) plus a slew that closes, by
// the next refit, what the old line had drifted from the monotonic clock. Each new line starts where the old
// one is at its anchor, so the map from ticks to nanoseconds stays continuous and increasing: times never step
// back. A line that is far behind (more than half the interval) steps forward at once; one that is ahead runs
// at no less than half the rate until it meets the monotonic clock. A sample is the (counter, monotonic) pair
// whose two counter reads around the monotonic one were closest, of 8 tries, so a thread preempted between its
// reads does not skew it.
//
// A record is converted by the line that held at its tick (the last kLines lines are kept; a record older than
// all of them, which only a writer stalled for minutes meets, takes the oldest line back: its time is then
// that line's, off from the monotonic clock by up to the rate error that line had). fork() holds the mutex
// after the device locks (hold_across_fork, from Tracing::open), so a child never inherits it held.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace fragless {

class TraceClock {
 public:
  // automatic: the counter where steady_tsc() says it ticks at one rate, else the monotonic clock; the
  // tests name one. first_refine: the first refit's interval (they double from there to 64 times it).
  enum class Source { automatic, tsc, monotonic };
  explicit TraceClock(Source source = Source::automatic,
                      std::chrono::nanoseconds first_refine = std::chrono::seconds(1));
  // Whether the time-stamp counter ticks at one rate (CPUID's invariant bit, or the kernel's clock source is
  // the counter); false off x86-64.
  static bool steady_tsc();

  std::uint64_t origin_unix_ns = 0;  // the wall-clock time of time 0

  // The raw time for a record: inline, on the allocation path.
  std::uint64_t ticks() const {
#if defined(__x86_64__)
    if (tsc_) return __rdtsc();
#endif
    return monotonic_now();
  }
  // Each record's time_ns, read by ticks(), becomes nanoseconds since the origin. Any thread.
  template <typename Record>
  void to_ns(Record* r, std::size_t n) {
    if (!tsc_ || n == 0) return;
    std::lock_guard lk(mu_);
    for (std::size_t i = 0; i < n; ++i) r[i].time_ns = convert(r[i].time_ns);
  }
  // Refits the line if its interval has passed (Note [The trace clock]); cheap otherwise. Any thread.
  void refine();
  bool uses_tsc() const { return tsc_; }
  // The monotonic clock's nanoseconds since the origin.
  std::uint64_t monotonic_now() const;
  // Nanoseconds since the origin now (ticks() converted at once), for the tests.
  std::uint64_t now() {
    struct { std::uint64_t time_ns; } r{ticks()};
    to_ns(&r, 1);
    return r.time_ns;
  }
  // Tests: the line's rate is made off by `ppm` from now on, as a poor first measure would leave it.
  void skew_for_test(double ppm);
  // Around fork() (the tracer's fork handlers): no child inherits the mutex held.
  void prepare_fork() { mu_.lock(); }
  void after_fork() { mu_.unlock(); }

 private:
  struct Sample {
    std::uint64_t tick;
    std::uint64_t mono_ns;  // since origin
  };
  // ns = ns + (t - tick) * mult / 2^32.
  struct Line {
    std::uint64_t tick, ns, mult;
    std::uint64_t at(std::uint64_t t) const;
  };
  static constexpr int kLines = 8;
  Sample sample() const;
  void push(Line l);                      // under mu_
  std::uint64_t convert(std::uint64_t t);  // under mu_

  bool tsc_ = false;
  std::chrono::steady_clock::time_point t0_;
  // Under mu_: the last kLines lines, oldest first, and refine's state.
  std::mutex mu_;
  Line lines_[kLines]{};
  int nlines_ = 0;
  Sample first_{};
  std::chrono::nanoseconds interval_;
  std::chrono::nanoseconds max_interval_;
  std::chrono::steady_clock::time_point next_refine_;
};

// Made by the first event or trace file, under std::call_once, not as a function's static: its 2 ms calibration
// may run while the C ABI's allocator is being made, and a child forked meanwhile must be able to run it
// again (Note [Making the allocator once]).
inline std::atomic<TraceClock*> g_trace_clock{nullptr};
inline TraceClock& trace_clock() {
  if (TraceClock* c = g_trace_clock.load(std::memory_order_acquire)) return *c;
  static std::once_flag once;
  std::call_once(once, [] { g_trace_clock.store(new TraceClock(), std::memory_order_release); });
  return *g_trace_clock.load(std::memory_order_acquire);
}

}  // namespace fragless
