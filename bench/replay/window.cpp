// fragless-replay --window (window.h).
#include "window.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <unordered_set>
#include <utility>

#include "replay.h"

namespace fragless::replay {

namespace {

// A fraction in [0, 1] written as digits with at most one point (no sign, exponent, hex or spaces: the text
// becomes part of the input's name).
bool parse_fraction(const std::string& s, double* out) {
  if (s.empty() || s.size() > 32 || s.find_first_not_of("0123456789.") != std::string::npos ||
      std::count(s.begin(), s.end(), '.') > 1 || s == ".")
    return false;
  const double v = std::strtod(s.c_str(), nullptr);
  if (!(v >= 0 && v <= 1)) return false;
  *out = v;
  return true;
}

// floor(f * n), with a margin for the fraction's binary rounding (0.29 * 100 is 28.999...).
std::size_t index_at(double f, std::size_t n) {
  return std::min(n, static_cast<std::size_t>(std::floor(f * static_cast<double>(n) + 1e-6)));
}

}  // namespace

bool parse_window(const std::string& text, Window* out, std::string* error) {
  const auto colon = text.find(':');
  Window w;
  if (colon == std::string::npos || !parse_fraction(text.substr(0, colon), &w.from) ||
      !parse_fraction(text.substr(colon + 1), &w.to)) {
    *error = "--window needs FROM:TO, two fractions of the trace's events in [0, 1], written as digits with at most "
             "one point (they name the window: no sign or exponent; 0.5:1 = its second half), not '" + text + "'";
    return false;
  }
  if (!(w.from < w.to)) {
    *error = "--window " + text + ": FROM must be less than TO";
    return false;
  }
  *out = w;
  return true;
}

void cut_window(formats::Trace* t, const Window& w, const std::string& text) {
  if (w.whole()) return;
  // Each device's events are cut at the fractions of its own: a snapshot holds one device's events after
  // another's, so fractions of the whole list would cut by device.
  std::map<std::int32_t, std::size_t> count;
  std::vector<std::size_t> nth(t->events.size());  // the event's index among its device's
  for (std::size_t i = 0; i < t->events.size(); ++i) nth[i] = count[t->events[i].device]++;
  std::map<std::int32_t, std::pair<std::size_t, std::size_t>> bounds;  // device -> [lo, hi) of its events
  for (const auto& [d, n] : count) {
    const std::size_t lo = index_at(w.from, n);
    bounds[d] = {lo, std::max(lo, index_at(w.to, n))};
  }
  auto before = [&](std::size_t i) { return nth[i] < bounds[t->events[i].device].first; };
  auto inside = [&](std::size_t i) {
    const auto [lo, hi] = bounds[t->events[i].device];
    return nth[i] >= lo && nth[i] < hi;
  };
  // What is live at event lo, by (device, address), in the order it was allocated (the seed's order is the
  // order in which the replay allocates it), by the replay's own rules: a `free` frees, a free_requested
  // marks a block whose `free` may come at an empty_cache (Note [Frees an empty_cache completes]).
  using Key = std::pair<std::int32_t, std::uint64_t>;
  std::map<Key, std::size_t> live;  // -> index in `order`
  std::vector<formats::Event> order;
  std::vector<bool> gone;
  std::map<std::int32_t, std::unordered_set<std::uint64_t>> requested;  // per device, as the replay keeps them
  std::set<Key> freed_early;  // freed at an empty_cache before the window: their `free` records are skipped
  auto add = [&](const formats::Event& e) {
    formats::Event s = e;
    s.op = formats::Op::alloc;
    s.time_us = -1;
    // A second allocation at a live address replaces it in the map, as in the replay, whose free then
    // frees the newer block: the older one stays allocated.
    live[{e.device, e.address}] = order.size();
    order.push_back(s);
    gone.push_back(false);
  };
  auto release = [&](const Key& k) {
    if (auto it = live.find(k); it != live.end()) {
      gone[it->second] = true;
      live.erase(it);
    }
  };
  for (const auto& s : t->seed) add(s);
  for (std::size_t i = 0; i < t->events.size(); ++i) {
    if (!before(i)) continue;
    const auto& e = t->events[i];
    const Key k{e.device, e.address};
    if (e.op == formats::Op::alloc) {
      add(e);
    } else if (e.op == formats::Op::free_requested) {
      requested[e.device].insert(e.address);
    } else if (e.op == formats::Op::free) {
      requested[e.device].erase(e.address);
      if (!freed_early.erase(k)) release(k);
    } else if (e.op == formats::Op::empty_cache) {
      for (std::uint64_t a : completed_by_empty_cache(*t, i, e.device, requested[e.device])) {
        release({e.device, a});
        freed_early.insert({e.device, a});
      }
    }
  }
  std::vector<formats::Event> seed;
  for (std::size_t i = 0; i < order.size(); ++i)
    if (!gone[i]) seed.push_back(order[i]);
  t->seed = std::move(seed);
  // Classic's cache before the trace is known at its start only.
  std::erase_if(t->pre_segments, [&](const formats::Event& e) { return bounds[e.device].first > 0; });
  t->recorded_peak_reserved.clear();
  // The window: first the free_requested marks still pending (an empty_cache in the window may complete
  // them), at the window's first time; then its events, less the `free` records of blocks an empty_cache
  // before it already freed.
  std::vector<formats::Event> events;
  std::vector<std::int64_t> times;
  const bool modelled = !t->model_time_us.empty();
  std::map<std::int32_t, std::int64_t> first_time;  // per device, its window's first event's time
  for (std::size_t i = t->events.size(); i-- > 0;)
    if (inside(i)) first_time[t->events[i].device] = modelled ? t->model_time_us[i] : t->events[i].time_us;
  for (const auto& [device, addrs] : requested)
    for (std::uint64_t a : addrs) {
      if (!live.count({device, a})) continue;
      const auto ft = first_time.find(device);
      const std::int64_t t0 = ft == first_time.end() ? -1 : ft->second;
      formats::Event m;
      m.op = formats::Op::free_requested;
      m.device = device;
      m.address = a;
      m.time_us = modelled ? -1 : t0;
      events.push_back(m);
      if (modelled) times.push_back(t0);
    }
  for (std::size_t i = 0; i < t->events.size(); ++i) {
    if (!inside(i)) continue;
    const auto& e = t->events[i];
    if (e.op == formats::Op::free && freed_early.erase({e.device, e.address})) continue;
    events.push_back(e);
    if (modelled) times.push_back(t->model_time_us[i]);
  }
  t->events = std::move(events);
  if (modelled) t->model_time_us = std::move(times);
  t->source += "@" + text;
  t->window = true;
}

}  // namespace fragless::replay
