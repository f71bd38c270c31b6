// The --plot of fragless-replay (output.h).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "output.h"
#include "trace_model.h"

namespace fragless::replay {
namespace {

// The x axis of one panel: trace time, unless the trace has none or (auto) its busy part would be squeezed
// into a corner (the middle 90% of its events within a fifth of its time span), then the event index.
bool panel_in_seconds(const ReplayResult& r, PlotX mode) {
  if (mode == PlotX::event || !r.curve_in_seconds || r.curve.size() < 2) return false;
  if (mode == PlotX::time) return true;
  const auto& c = r.curve;
  auto at = [&](double q) { return c[static_cast<std::size_t>(q * static_cast<double>(c.size() - 1))].seconds; };
  const double span = c.back().seconds - std::max(0.0, c.front().seconds);
  return span <= 0 || at(0.95) - at(0.05) >= 0.2 * span;
}

}  // namespace

// Live, allocated and reserved over time, one panel per input and device, one colour per policy; drawn by
// gnuplot (pngcairo) from inline data blocks. Reserved is a thick solid line per policy, allocated a thin
// dashed one in the same colour, live a thin black line drawn last so it stays visible; the legend sits
// below the panel, out of the data's way.
// notes: as output.h says.
bool draw_plot(const std::string& path, const std::vector<ReplayResult>& results,
               const std::vector<std::string>& notes, PlotX mode, std::string* error) {
  std::vector<std::pair<std::string, int>> panels;
  for (auto& r : results)
    if (std::find(panels.begin(), panels.end(), std::make_pair(r.input, r.device)) == panels.end())
      panels.emplace_back(r.input, r.device);
  std::vector<bool> seconds(panels.size());
  for (std::size_t k = 0; k < panels.size(); ++k)
    for (auto& r : results)
      if (std::make_pair(r.input, r.device) == panels[k]) {
        seconds[k] = panel_in_seconds(r, mode);
        break;
      }
  auto panel_of = [&](const ReplayResult& r) {
    return static_cast<std::size_t>(std::find(panels.begin(), panels.end(), std::make_pair(r.input, r.device)) - panels.begin());
  };
  std::string script;
  auto quote = [](std::string s) {
    std::string o;
    for (char c : s) {
      if (c == '"' || c == '\\') o += '\\';
      o += c;
    }
    return "\"" + o + "\"";
  };
  // Note [The state before the window in a plot]
  // What a trace's window began with (the allocations live before it; for classic, the segments PyTorch
  // held) is drawn as already present: each curve starts a little before x = 0 at the window's starting
  // state, and a dashed line marks where the window begins, rather than appearing as memory that arrived
  // at the first instant.
  std::vector<double> lead(panels.size(), 0);
  for (auto& r : results) {
    if (!r.pre_window || r.curve.empty()) continue;
    const std::size_t k = panel_of(r);
    const double end = seconds[k] ? r.curve.back().seconds : r.curve.back().index;
    lead[k] = std::max(lead[k], 0.03 * std::max(end, 1e-9));
  }
  // Each panel's extent, taken as its data is written: one point (a trace of one event) is drawn over
  // [x - 1, x + 1], and values all 0 MiB over [0, 1], where gnuplot's autoscale would warn of an empty range.
  std::vector<double> x_lo(panels.size(), 1e300), x_hi(panels.size(), -1e300), y_hi(panels.size(), 0);
  std::size_t block = 0;
  for (auto& r : results) {
    const std::size_t k = panel_of(r);
    const bool secs = seconds[k];
    script += "$d" + std::to_string(block++) + " << EOD\n";
    if (const double l = lead[k]; l > 0) {
      const auto& w = r.window_start;
      x_lo[k] = std::min(x_lo[k], -l);
      x_hi[k] = std::max(x_hi[k], 0.0);
      y_hi[k] = std::max({y_hi[k], mib(w.live), mib(w.reserved)});
      char line[160];
      std::snprintf(line, sizeof line, "%.6f %.3f %.3f %.3f\n%.6f %.3f %.3f %.3f\n", -l, mib(w.live), mib(w.allocated),
                    mib(w.reserved), 0.0, mib(w.live), mib(w.allocated), mib(w.reserved));
      script += line;
    }
    for (auto& p : r.curve) {
      if (secs && p.seconds < 0) continue;
      const double x = secs ? p.seconds : p.index;
      x_lo[k] = std::min(x_lo[k], x);
      x_hi[k] = std::max(x_hi[k], x);
      y_hi[k] = std::max({y_hi[k], mib(p.live), mib(p.allocated), mib(p.reserved)});
      char line[128];
      std::snprintf(line, sizeof line, "%.6f %.3f %.3f %.3f\n", x, mib(p.live), mib(p.allocated), mib(p.reserved));
      script += line;
    }
    script += "EOD\n";
  }
  const int rows = static_cast<int>(panels.size());
  script += "set terminal pngcairo size 1200," + std::to_string(420 * rows) + " noenhanced\n";
  const bool script_only = plot_is_script(path);
  // The PNG is drawn into a temporary file beside its target and renamed over it, as every output is
  // written (Note [Writing an output file], formats.cpp): through a symbolic link, never over a FIFO or device.
  std::string target;
  if (!script_only && !formats::output_target(path, &target, error)) {
    *error = "--plot " + *error;
    return false;
  }
  const std::string drawn = target + ".tmp" + std::to_string(::getpid()) + ".png";
  script += "set output " + quote(script_only ? path.substr(0, path.size() - 3) + ".png" : drawn) + "\n";
  script += "set multiplot layout " + std::to_string(rows) + ",1\n";
  script += "set key below horizontal maxrows 3\nset ylabel \"MiB\"\nset grid\n";  // each panel sets its ranges
  const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c"};
  for (std::size_t k = 0; k < panels.size(); ++k) {
    const auto& [input, dev] = panels[k];
    std::string plots, live;
    block = 0;
    for (auto& r : results) {
      const std::size_t b = block++;
      if (r.input != input || r.device != dev) continue;
      const std::string d = "$d" + std::to_string(b);
      const char* c = colours[static_cast<int>(r.policy) % 3];
      const std::string note = b < notes.size() && !notes[b].empty() ? " " + notes[b] : "";
      if (live.empty()) live = d + " using 1:2 with lines lw 1.5 lc rgb \"black\" title \"live\", ";
      plots += d + " using 1:4 with lines lw 2.5 lc rgb \"" + c + "\" title " + quote(policy_name(r.policy) + std::string(" reserved") + note) + ", ";
      plots += d + " using 1:3 with lines lw 1 dt 2 lc rgb \"" + c + "\" title \"" + policy_name(r.policy) + " allocated\", ";
      if (r.capacity && !note.empty()) {
        char line[96];
        std::snprintf(line, sizeof line, "%.3f with lines dt 3 lw 1 lc rgb \"%s\" notitle, ", mib(static_cast<std::int64_t>(r.capacity)), c);
        plots += line;
      }
    }
    plots += live;
    script += "set title " + quote(short_name(input) + " (device " + std::to_string(dev) + ")") + "\n";
    script += lead[k] > 0 ? "set arrow 1 from 0, graph 0 to 0, graph 1 nohead dt 2 lc rgb \"gray40\"\n"
                            "set label 1 \"window start\" at 0, graph 0.04 offset 0.5, 0 tc rgb \"gray40\"\n"
                          : "unset arrow 1\nunset label 1\n";
    script += std::string("set xlabel \"") + (seconds[k] ? "trace time (s)" : "trace entry (every kind and device)") + "\"\n";
    if (x_lo[k] == x_hi[k]) {
      char range[96];
      std::snprintf(range, sizeof range, "set xrange [%.6f:%.6f]\n", x_lo[k] - 1, x_hi[k] + 1);
      script += range;
    } else {
      script += "set autoscale x\n";
    }
    script += y_hi[k] > 0 ? "set yrange [0:*]\n" : "set yrange [0:1]\n";
    script += "plot " + plots.substr(0, plots.size() - 2) + "\n";
  }
  script += "unset multiplot\n";
  if (script_only) {  // the script itself, with its data: `gnuplot FILE.gp` draws it
    if (!formats::write_file(path, script, error)) {
      *error = "--plot " + *error;
      return false;
    }
    return true;
  }
  std::FILE* g = popen("gnuplot 1>&2", "w");
  if (!g) {
    *error = "--plot: cannot start gnuplot";
    return false;
  }
  std::fwrite(script.data(), 1, script.size(), g);
  const int status = pclose(g);
  if (status != 0) {  // pclose gives a wait status: say gnuplot's exit code, or the signal that ended it
    const std::string how = status == -1          ? "could not be waited for"
                            : WIFEXITED(status)   ? "exited with code " + std::to_string(WEXITSTATUS(status))
                            : WIFSIGNALED(status) ? "was killed by signal " + std::to_string(WTERMSIG(status))
                                                  : "ended with status " + std::to_string(status);
    *error = "--plot: gnuplot " + how + " drawing " + path + " (its own message is above it on stderr)";
    std::remove(drawn.c_str());
    return false;
  }
  if (std::rename(drawn.c_str(), target.c_str()) != 0) {
    *error = "--plot " + path + ": cannot write " + target + " (" + std::strerror(errno) + ")";
    std::remove(drawn.c_str());
    return false;
  }
  return true;
}

}  // namespace fragless::replay
