// fragless-replay --window (window.h).
#include "window.h"

#include <cmath>
#include <cstdlib>
#include <map>
#include <utility>

namespace fragless::replay {

namespace {

bool parse_fraction(const std::string& s, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (*end || !std::isfinite(v) || v < 0 || v > 1) return false;
  *out = v;
  return true;
}

}  // namespace

bool parse_window(const std::string& text, Window* out, std::string* error) {
  const auto colon = text.find(':');
  Window w;
  if (colon == std::string::npos || !parse_fraction(text.substr(0, colon), &w.from) ||
      !parse_fraction(text.substr(colon + 1), &w.to)) {
    *error = "--window needs FROM:TO, two fractions of the trace's events in [0, 1] (0.5:1 = its second half), not '" +
             text + "'";
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
  const std::size_t n = t->events.size();
  const auto lo = static_cast<std::size_t>(std::floor(w.from * static_cast<double>(n)));
  const auto hi = std::min(n, static_cast<std::size_t>(std::floor(w.to * static_cast<double>(n))));
  // What is live at event lo, by (device, address), in the order it was allocated (the seed's order is the
  // order in which the replay allocates it).
  using Key = std::pair<std::int32_t, std::uint64_t>;
  std::map<Key, std::size_t> live;  // -> index in `order`
  std::vector<formats::Event> order;
  std::vector<bool> gone;
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
  for (const auto& s : t->seed) add(s);
  for (std::size_t i = 0; i < lo; ++i) {
    const auto& e = t->events[i];
    if (e.op == formats::Op::alloc) {
      add(e);
    } else if (e.op == formats::Op::free) {
      if (auto it = live.find({e.device, e.address}); it != live.end()) {
        gone[it->second] = true;
        live.erase(it);
      }
    }
  }
  std::vector<formats::Event> seed;
  for (std::size_t i = 0; i < order.size(); ++i)
    if (!gone[i]) seed.push_back(order[i]);
  t->seed = std::move(seed);
  if (lo > 0) t->pre_segments.clear();
  t->recorded_peak_reserved.clear();
  t->events = std::vector<formats::Event>(t->events.begin() + static_cast<std::ptrdiff_t>(lo),
                                          t->events.begin() + static_cast<std::ptrdiff_t>(hi));
  if (!t->model_time_us.empty())
    t->model_time_us = std::vector<std::int64_t>(t->model_time_us.begin() + static_cast<std::ptrdiff_t>(lo),
                                                 t->model_time_us.begin() + static_cast<std::ptrdiff_t>(hi));
  t->source += "@" + text;
}

}  // namespace fragless::replay
