// The tracer's clock: Note [The trace clock] in trace_clock.h.
#include "trace/trace_clock.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace fragless {

bool TraceClock::steady_tsc() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0x80000000u, &a, &b, &c, &d) && a >= 0x80000007u && __get_cpuid(0x80000007u, &a, &b, &c, &d) &&
      (d & (1u << 8)))
    return true;
  // Many virtual machines hide the bit while their counter is sound; the kernel's own choice of the counter
  // as the clock source says it is (it checks the counter against other clocks and drops it if it drifts).
  char source[32] = {};
  if (FILE* f = std::fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "re")) {
    const bool read = std::fgets(source, sizeof source, f) != nullptr;
    std::fclose(f);
    return read && std::strncmp(source, "tsc\n", 4) == 0;
  }
  return false;
#else
  return false;
#endif
}

TraceClock::TraceClock(Source source, std::chrono::nanoseconds first_refine)
    : interval_(first_refine), max_interval_(first_refine * 64) {
  using namespace std::chrono;
  origin_unix_ns = static_cast<std::uint64_t>(duration_cast<nanoseconds>(system_clock::now().time_since_epoch()).count());
  t0_ = steady_clock::now();
#if defined(__x86_64__)
  tsc_ = source == Source::tsc || (source == Source::automatic && steady_tsc());
#else
  (void)source;
#endif
  next_refine_ = t0_ + interval_;
  if (!tsc_) return;
  first_ = sample();
  const auto until = steady_clock::now() + microseconds(2000);
  while (steady_clock::now() < until) {
  }
  const Sample s = sample();
  const std::uint64_t ticks = s.tick > first_.tick ? s.tick - first_.tick : 1;
  const auto mult = static_cast<std::uint64_t>((static_cast<unsigned __int128>(s.mono_ns - first_.mono_ns) << 32) / ticks);
  push({first_.tick, first_.mono_ns, std::max<std::uint64_t>(mult, 1)});
  next_refine_ = steady_clock::now() + interval_;
}

std::uint64_t TraceClock::monotonic_now() const {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count());
}

std::uint64_t TraceClock::Line::at(std::uint64_t t) const {
  if (t >= tick) return ns + static_cast<std::uint64_t>((static_cast<unsigned __int128>(t - tick) * mult) >> 32);
  const auto back = static_cast<std::uint64_t>((static_cast<unsigned __int128>(tick - t) * mult) >> 32);
  return back < ns ? ns - back : 0;
}

std::uint64_t TraceClock::convert(std::uint64_t t) {
  int i = nlines_ - 1;
  while (i > 0 && lines_[i].tick > t) --i;  // the line that held at t; the oldest for what is older still
  return lines_[i].at(t);
}

void TraceClock::push(Line l) {
  if (nlines_ == kLines) {
    std::copy(lines_ + 1, lines_ + kLines, lines_);
    --nlines_;
  }
  lines_[nlines_++] = l;
}

TraceClock::Sample TraceClock::sample() const {
  Sample best{ticks(), monotonic_now()};
  std::uint64_t width = UINT64_MAX;
  for (int i = 0; i < 8; ++i) {
    const std::uint64_t a = ticks();
    const std::uint64_t m = monotonic_now();
    const std::uint64_t b = ticks();
    if (b >= a && b - a < width) {
      width = b - a;
      best = {a + (b - a) / 2, m};
    }
  }
  return best;
}

void TraceClock::refine() {
  if (!tsc_) return;
  std::unique_lock lk(mu_, std::try_to_lock);
  if (!lk) return;  // another thread is converting or refitting: the next call refits
  const auto wall = std::chrono::steady_clock::now();
  if (wall < next_refine_) return;
  interval_ = std::min(interval_ * 2, max_interval_);
  next_refine_ = wall + interval_;
  const Sample s = sample();
  const Line& last = lines_[nlines_ - 1];
  if (s.tick <= last.tick || s.mono_ns <= first_.mono_ns) return;  // a counter that went back: keep the line
  const std::uint64_t at = last.at(s.tick);
  // The rate over the whole run so far, and the slew that closes the line's error by the next refit.
  const long double rate = static_cast<long double>(s.mono_ns - first_.mono_ns) / static_cast<long double>(s.tick - first_.tick);
  const long double error = static_cast<long double>(s.mono_ns) - static_cast<long double>(at);  // > 0: behind
  long double slew = error / static_cast<long double>(interval_.count());
  std::uint64_t anchor = at;
  if (slew > 0.5L) {  // far behind: step forward to the monotonic clock
    anchor = s.mono_ns;
    slew = 0;
  }
  slew = std::max(slew, -0.5L);  // ahead: at least half the rate until it meets it
  const long double mult = rate * (1 + slew) * 4294967296.0L;
  push({s.tick, anchor, static_cast<std::uint64_t>(std::max(mult, 1.0L))});
}

void TraceClock::skew_for_test(double ppm) {
  std::lock_guard lk(mu_);
  if (!tsc_) return;
  const std::uint64_t t = ticks();
  const Line& last = lines_[nlines_ - 1];
  const long double mult = static_cast<long double>(last.mult) * (1 + ppm * 1e-6L);
  push({t, last.at(t), static_cast<std::uint64_t>(std::max(mult, 1.0L))});
}

}  // namespace fragless
