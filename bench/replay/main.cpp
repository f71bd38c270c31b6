// fragless-replay: replays traces (PyTorch snapshots, RMM logs) or built-in workloads through each policy
// on the sim driver and prints a side-by-side table (or --json).
//
//   fragless-replay [--policy classic,expandable,fragless] [--capacity-gib N] [--json] [--plot FILE.png]
//                   [--seqlen-file CSV] INPUT...
//   fragless-replay --fit [--fit-step GIB] INPUT...             smallest device per policy (fit.h)
//   fragless-replay --max-batch | --max-of KEY --capacity-gib N workload:...   largest value per policy
//   INPUT = a trace file (format detected from content) or workload:NAME[:key=value,...]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <unistd.h>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "costs.h"
#include "fit.h"
#include "replay.h"
#include "workload.h"
#include "zoo.h"

using namespace fragless;
using namespace fragless::replay;

namespace {

int usage(const char* msg) {
  if (msg) std::fprintf(stderr, "fragless-replay: %s\n", msg);
  std::fprintf(msg ? stderr : stdout,
               "usage: fragless-replay [--policy classic,expandable,fragless] [--capacity-gib N] [--json]\n"
               "                       [--conf KEY:VALUE,...] [--jobs N] [--costs PROBE.json]\n"
               "                       [--plot FILE.png [--plot-x time|event|auto]] [--seqlen-file CSV] INPUT...\n"
               "       fragless-replay --fit [--fit-step GIB] [options] INPUT...\n"
               "       fragless-replay --max-batch | --max-of KEY --capacity-gib N [options] workload:...\n"
               "  INPUT: a fragless native trace, PyTorch memory snapshot pickle or RMM log CSV (detected from\n"
               "         content), or workload:NAME[:key=value,...]\n"
               "  --capacity-gib: the device's memory; without it the capacity is unlimited (1 TiB). An\n"
               "         allocation that runs out of memory is a result, counted in the OOMs column and skipped\n"
               "  --plot: live/allocated/reserved over time per policy, drawn by gnuplot into a PNG (with --fit,\n"
               "         at each policy's fitted capacity; with --max-of, at its largest value); each point is the\n"
               "         largest value of its stretch of events, so no peak is lost; what the window began with\n"
               "         (allocations live before it, classic's cached segments) is drawn as already there.\n"
               "         FILE.gp writes the gnuplot script with its data instead (gnuplot FILE.gp draws it)\n"
               "  --plot-x: the x axis: trace time, event index, or auto (default: time, unless the trace has\n"
               "         none or its busy part would be squeezed into a corner)\n"
               "  --fit: per input, device and policy, the smallest device capacity (a multiple of --fit-step,\n"
               "         default 0.25 GiB) on which the replay has no OOM, found by bisection; the answer is\n"
               "         replayed with zero OOMs and one step below it with at least one\n"
               "  --max-batch: with --capacity-gib, the largest batch per workload and policy that replays with\n"
               "         no OOM on that device, and its ratios to classic and expandable; --max-of KEY searches\n"
               "         another numeric workload key (max_seq, micro, tokens, max_batch, ...) the same way\n"
               "  --jobs: replays run at once (default: the number of cores)\n"
               "  --costs: the driver's call costs measured by fragless-gpu-probe (its JSON, or the GPU check's\n"
               "         gpu_check.json, which holds it) instead of the A100 model: a line through the medians\n"
               "         per handle size for each VMM call\n"
               "  exit status: 0 answered, 1 a search found no answer (the reason on stderr), 2 bad usage or\n"
               "         input\n"
               "  --conf: allocator settings in FRAGLESS_CONF grammar (the README's table): policy tuning keys\n"
               "          (handles, handle_max_mb, chunk_size_mb, reserve_slack, lend_pages, ...), PyTorch's keys\n"
               "          (max_split_size_mb, roundup_power2_divisions, ...), page_size_mb; policy (or\n"
               "          expandable_segments:True) selects the policy as --policy does. The replay runs the sim\n"
               "          driver on a device of --capacity-gib: driver, capacity_mb, trace, peer_access,\n"
               "          shareable_handles and on_oom are refused\n"
               "  --seqlen-file: sequence lengths for the workloads (a CSV column, see the README)\n"
               "%s"
               "  ckpt-accum: transformer-train with checkpointing and gradient accumulation (ckpt=1,accum=4,\n"
               "        steps=12); every transformer key applies\n"
               "%s",
               fragless::replay::transformer_help().c_str(), fragless::replay::zoo_help().c_str());
  return msg ? 2 : 0;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') { o += '\\'; o += c; }
    else if (static_cast<unsigned char>(c) < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); o += b; }
    else o += c;
  }
  return o;
}

std::string short_name(const std::string& s) {
  const auto slash = s.find_last_of('/');
  std::string n = slash == std::string::npos ? s : s.substr(slash + 1);
  if (n.size() > 44) n = n.substr(0, 20) + "…" + n.substr(n.size() - 23);
  return n;
}

double mib(std::int64_t b) { return static_cast<double>(b) / (1 << 20); }

// Note [Nothing in --conf is ignored]
// A key of --conf either changes what the replay does or is refused: `policy` (and expandable_segments:True
// without it, as in FRAGLESS_CONF) selects the policy, as --policy does; the keys of a real device (the
// driver, its size, tracing, peers, handle export, the OOM behaviour of libfragless.so) have no meaning in
// a replay on the sim driver, and --capacity-gib gives the device's size.
constexpr const char* kConfRefused[][2] = {
    {"driver", "the replay always runs the sim driver"},
    {"capacity_mb", "give the device's size with --capacity-gib"},
    {"trace", "the replay records no trace (fragless-trace converts traces)"},
    {"peer_access", "it configures the cuda driver, and the replay runs the sim driver"},
    {"shareable_handles", "it configures the cuda driver, and the replay runs the sim driver"},
    {"on_oom", "it configures libfragless.so; in a replay an OOM is a result (the OOMs column)"}};

// Applies one --conf string over *base; a policy it selects goes to *policy. False with *error naming the
// key it refuses.
bool apply_conf(const std::string& text, Options* base, std::optional<PolicyKind>* policy, std::string* error) {
  const auto cr = parse_config(text, *base);
  if (!cr.ok) {
    *error = cr.error;
    return false;
  }
  bool policy_key = false, expandable_key = false;
  for (const auto& k : cr.keys) {
    for (const auto& [key, why] : kConfRefused)
      if (k == key) {
        *error = "--conf " + k + ": not a replay setting (" + why + ")";
        return false;
      }
    policy_key |= k == "policy";
    expandable_key |= k == "expandable_segments";
  }
  if (policy_key || (expandable_key && cr.options.policy == PolicyKind::expandable)) *policy = cr.options.policy;
  *base = cr.options;
  base->policy = Options{}.policy;  // selected per run
  return true;
}

// The table's columns, in one line under it.
constexpr const char* kLegend =
    "columns: events = alloc, free and empty_cache events replayed on the device; live, reserv = peaks (MiB); "
    "overhead = reserved over live at the reserved peak; frag@pk = fragmentation at that peak; tw-frag = "
    "time-weighted fragmentation; OOMs = allocations that did not fit --capacity-gib; create, map, unmap = driver "
    "calls; syncs = synchronisations forced; path ms, bg ms = the calls' modelled time (A100 costs, or --costs) "
    "inside allocation and free calls, and done by the background worker; "
    "Mev/s = replay speed; pytorch MiB = PyTorch's own peak reserved, where the snapshot tells it";

enum class PlotX { auto_, time, event };

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

// Live, allocated and reserved over time, one panel per input and device, one colour per policy; drawn by
// gnuplot (pngcairo) from inline data blocks. Reserved is a thick solid line per policy, allocated a thin
// dashed one in the same colour, live a thin black line drawn last so it stays visible; the legend sits
// below the panel, out of the data's way.
// notes: per result, text added to its policy's legend entries (the fitted capacity, the largest value);
// a result replayed on a capacity also gets that capacity as a dotted line in its colour.
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
  std::size_t block = 0;
  for (auto& r : results) {
    const bool secs = seconds[panel_of(r)];
    script += "$d" + std::to_string(block++) + " << EOD\n";
    if (const double l = lead[panel_of(r)]; l > 0) {
      const auto& w = r.window_start;
      char line[160];
      std::snprintf(line, sizeof line, "%.6f %.3f %.3f %.3f\n%.6f %.3f %.3f %.3f\n", -l, mib(w.live), mib(w.allocated),
                    mib(w.reserved), 0.0, mib(w.live), mib(w.allocated), mib(w.reserved));
      script += line;
    }
    for (auto& p : r.curve) {
      if (secs && p.seconds < 0) continue;
      char line[128];
      std::snprintf(line, sizeof line, "%.6f %.3f %.3f %.3f\n", secs ? p.seconds : p.index, mib(p.live),
                    mib(p.allocated), mib(p.reserved));
      script += line;
    }
    script += "EOD\n";
  }
  const int rows = static_cast<int>(panels.size());
  script += "set terminal pngcairo size 1200," + std::to_string(420 * rows) + " noenhanced\n";
  const bool script_only = path.size() > 3 && path.compare(path.size() - 3, 3, ".gp") == 0;
  script += "set output " + quote(script_only ? path.substr(0, path.size() - 3) + ".png" : path) + "\n";
  script += "set multiplot layout " + std::to_string(rows) + ",1\n";
  script += "set key below horizontal maxrows 3\nset ylabel \"MiB\"\nset grid\nset yrange [0:*]\n";
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
    script += std::string("set xlabel \"") + (seconds[k] ? "trace time (s)" : "event index") + "\"\n";
    script += "plot " + plots.substr(0, plots.size() - 2) + "\n";
  }
  script += "unset multiplot\n";
  if (script_only) {  // the script itself, with its data: `gnuplot FILE.gp` draws it
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f || std::fwrite(script.data(), 1, script.size(), f) != script.size() || std::fclose(f) != 0) {
      *error = "--plot: cannot write " + path;
      return false;
    }
    return true;
  }
  std::FILE* g = popen("gnuplot 2>&1", "w");
  if (!g) {
    *error = "--plot: cannot start gnuplot";
    return false;
  }
  std::fwrite(script.data(), 1, script.size(), g);
  const int rc = pclose(g);
  if (rc != 0) {
    *error = "--plot: gnuplot failed (exit " + std::to_string(rc) + ") drawing " + path;
    return false;
  }
  return true;
}


// The fields of one result in the --json schema (without the braces).
std::string json_fields(const ReplayResult& r) {
  auto c = [&](DriverCall dc) { return r.driver[dc]; };
  char b[2048];
  std::snprintf(b, sizeof b,
                "\"input\":\"%s\",\"device\":%d,\"policy\":\"%s\",\"capacity_bytes\":%" PRIu64 ",\"events\":%" PRIu64
                ",\"peak_live_bytes\":%" PRId64 ",\"peak_allocated_bytes\":%" PRId64 ",\"peak_reserved_bytes\":%" PRId64
                ",\"fragmentation_at_peak\":%.6f,\"overhead_over_live\":%.6f,\"time_weighted_fragmentation\":%.6f"
                ",\"ooms\":%" PRIu64 ",\"driver_calls\":{\"reserve\":%" PRIu64 ",\"create\":%" PRIu64 ",\"map\":%" PRIu64
                ",\"set_access\":%" PRIu64 ",\"unmap\":%" PRIu64 ",\"release\":%" PRIu64 "},\"forced_syncs\":%" PRId64
                ",\"modelled_driver_us\":%.2f,\"alloc_path_driver_us\":%.2f,\"background_driver_us\":%.2f,"
                "\"background_calls\":{\"create\":%" PRIu64 ",\"map\":%" PRIu64 ",\"set_access\":%" PRIu64
                ",\"unmap\":%" PRIu64 ",\"release\":%" PRIu64 "},",
                json_escape(r.input).c_str(), r.device, policy_name(r.policy),
                r.capacity ? r.capacity : kUnlimitedCapacity, r.events, r.peak_live, r.peak_allocated, r.peak_reserved,
                r.fragmentation_at_peak, r.overhead_over_live, r.time_weighted_fragmentation, r.ooms,
                c(DriverCall::reserve), c(DriverCall::create), c(DriverCall::map), c(DriverCall::set_access),
                c(DriverCall::unmap), c(DriverCall::release), r.forced_syncs, r.driver.modelled_us,
                r.alloc_path_driver_us(), r.background_driver_us(), r.driver.background(DriverCall::create),
                r.driver.background(DriverCall::map), r.driver.background(DriverCall::set_access),
                r.driver.background(DriverCall::unmap), r.driver.background(DriverCall::release));
  std::string o = b;
  if (r.trace_duration_us) std::snprintf(b, sizeof b, "\"trace_duration_us\":%.0f,", *r.trace_duration_us);
  else std::snprintf(b, sizeof b, "\"trace_duration_us\":null,");
  o += b;
  if (r.model_duration_us) std::snprintf(b, sizeof b, "\"model_duration_us\":%.0f,", *r.model_duration_us);
  else std::snprintf(b, sizeof b, "\"model_duration_us\":null,");
  o += b;
  o += r.background_clock ? "\"background_clock\":true," : "\"background_clock\":false,";
  std::snprintf(b, sizeof b, "\"replay_seconds\":%.6f,\"events_per_second\":%.0f,", r.replay_seconds, r.events_per_second);
  o += b;
  if (r.pytorch_recorded_peak_reserved)
    std::snprintf(b, sizeof b, "\"pytorch_recorded_peak_reserved_bytes\":%" PRIu64, *r.pytorch_recorded_peak_reserved);
  else std::snprintf(b, sizeof b, "\"pytorch_recorded_peak_reserved_bytes\":null");
  return o + b;
}

double gib(std::uint64_t b) { return static_cast<double>(b) / (1ull << 30); }

// Runs n tasks on up to `threads` threads.
void run_tasks(std::size_t n, unsigned threads, const std::function<void(std::size_t)>& f) {
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t k; (k = next++) < n;) f(k);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < std::max(1u, std::min<unsigned>(threads, static_cast<unsigned>(n))); ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

struct Task { std::size_t input; int device; PolicyKind policy; };

// --fit: one search per input, device and policy.
int run_fit(const std::vector<formats::Trace>& traces, const std::vector<Task>& tasks, std::uint64_t step,
            unsigned jobs, const ReplayOptions& ro, bool json, const std::string& plot, PlotX plot_x) {
  std::vector<FitResult> fits(tasks.size());
  SearchOptions so;
  so.replay = ro;
  so.parallel = std::max(1u, jobs / static_cast<unsigned>(std::max<std::size_t>(1, tasks.size())));
  const auto t0 = std::chrono::steady_clock::now();
  run_tasks(tasks.size(), jobs, [&](std::size_t k) {
    fits[k] = fit_capacity(traces[tasks[k].input], tasks[k].device, tasks[k].policy, step, so);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int replays = 0, failed = 0;
  for (auto& f : fits) {
    replays += f.replays;
    if (!f.error.empty()) ++failed, std::fprintf(stderr, "fragless-replay: %s\n", f.error.c_str());
  }
  // The classic answer for the same input and device, for the ratio column.
  auto classic_of = [&](std::size_t k) -> const FitResult* {
    for (std::size_t j = 0; j < tasks.size(); ++j)
      if (tasks[j].input == tasks[k].input && tasks[j].device == tasks[k].device &&
          tasks[j].policy == PolicyKind::classic && fits[j].error.empty())
        return &fits[j];
    return nullptr;
  };
  if (!plot.empty()) {
    std::vector<ReplayResult> rs;
    std::vector<std::string> notes;
    for (auto& f : fits)
      if (f.error.empty()) {
        rs.push_back(f.at);
        char n[64];
        std::snprintf(n, sizeof n, "(fits %.4g GiB)", gib(f.min_capacity));
        notes.push_back(n);
      }
    std::string err;
    if (!draw_plot(plot, rs, notes, plot_x, &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
  }
  if (json) {
    std::printf("{\"mode\":\"fit\",\"fit_step_bytes\":%" PRIu64 ",\"seconds\":%.3f,\"replays\":%d,\"results\":[", step,
                secs, replays);
    for (std::size_t k = 0; k < fits.size(); ++k) {
      const auto& f = fits[k];
      std::printf("%s\n{", k ? "," : "");
      if (f.error.empty()) {
        std::printf("%s,\"min_capacity_bytes\":%" PRIu64, json_fields(f.at).c_str(), f.min_capacity);
      } else {
        std::printf("\"input\":\"%s\",\"device\":%d,\"policy\":\"%s\",\"min_capacity_bytes\":null,\"error\":\"%s\"",
                    json_escape(traces[tasks[k].input].source).c_str(), tasks[k].device, policy_name(tasks[k].policy),
                    json_escape(f.error).c_str());
      }
      std::printf(",\"fit_replays\":%d,\"fit_seconds\":%.3f,\"recorded_ooms\":%" PRIu64 "}", f.replays, f.seconds,
                  f.recorded_ooms);
    }
    std::printf("\n]}\n");
  } else {
    std::printf("%-44s %3s %-10s %10s %12s %8s %8s %11s %8s %8s %11s\n", "input", "dev", "policy", "live MiB",
                "fits on GiB", "÷live", "÷classic", "reserv MiB", "OOMs", "replays", "pytorch MiB");
    for (std::size_t k = 0; k < fits.size(); ++k) {
      const auto& f = fits[k];
      const auto& t = tasks[k];
      if (!f.error.empty()) {
        std::printf("%-44s %3d %-10s %10s %12s\n", short_name(traces[t.input].source).c_str(), t.device,
                    policy_name(t.policy), "-", "no answer");
        continue;
      }
      char pyt[32] = "-", vs[32] = "-";
      if (f.at.pytorch_recorded_peak_reserved)
        std::snprintf(pyt, sizeof pyt, "%.1f", mib(static_cast<std::int64_t>(*f.at.pytorch_recorded_peak_reserved)));
      if (const FitResult* c = classic_of(k)) std::snprintf(vs, sizeof vs, "%.3f", gib(f.min_capacity) / gib(c->min_capacity));
      std::printf("%-44s %3d %-10s %10.1f %12.4g %8.3f %8s %11.1f %8" PRIu64 " %8d %11s\n",
                  short_name(traces[t.input].source).c_str(), t.device, policy_name(t.policy), mib(f.peak_live),
                  gib(f.min_capacity), static_cast<double>(f.min_capacity) / static_cast<double>(std::max<std::int64_t>(1, f.peak_live)),
                  vs, mib(f.at.peak_reserved), f.recorded_ooms, f.replays, pyt);
    }
    std::printf("fit: %zu searches, %d replays, step %.4g GiB, %.2f s\n", fits.size(), replays, gib(step), secs);
    std::printf("OOMs: the ones the trace itself recorded; every answer was replayed with 0 OOMs, one step below with at least 1\n");
  }
  return failed ? 1 : 0;
}

// --max-of KEY: one search per workload and policy.
int run_max(const std::vector<std::string>& inputs, const std::vector<PolicyKind>& policies, const std::string& key,
            std::uint64_t capacity, unsigned jobs, const ReplayOptions& ro, const std::vector<int>* lengths, bool json,
            const std::string& plot, PlotX plot_x) {
  struct MTask { std::size_t input; PolicyKind policy; };
  std::vector<MTask> tasks;
  for (std::size_t i = 0; i < inputs.size(); ++i)
    for (PolicyKind p : policies) tasks.push_back({i, p});
  std::vector<MaxResult> found(tasks.size());
  SearchOptions so;
  so.replay = ro;
  so.parallel = std::max(1u, jobs / static_cast<unsigned>(std::max<std::size_t>(1, tasks.size())));
  const auto t0 = std::chrono::steady_clock::now();
  run_tasks(tasks.size(), jobs, [&](std::size_t k) {
    found[k] = max_value(inputs[tasks[k].input], key, tasks[k].policy, capacity, so, lengths);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int replays = 0, failed = 0;
  for (auto& f : found) {
    replays += f.replays;
    if (!f.error.empty()) ++failed, std::fprintf(stderr, "fragless-replay: %s\n", f.error.c_str());
  }
  auto other = [&](std::size_t k, PolicyKind p) -> const MaxResult* {
    for (std::size_t j = 0; j < tasks.size(); ++j)
      if (tasks[j].input == tasks[k].input && tasks[j].policy == p && found[j].error.empty()) return &found[j];
    return nullptr;
  };
  auto ratio = [&](std::size_t k, PolicyKind p) -> double {
    const MaxResult* f = other(k, PolicyKind::fragless);
    const MaxResult* b = other(k, p);
    return f && b && b->max_value > 0 ? static_cast<double>(f->max_value) / static_cast<double>(b->max_value) : -1;
  };
  if (!plot.empty()) {
    std::vector<ReplayResult> rs;
    std::vector<std::string> notes;
    for (auto& f : found)
      if (f.error.empty()) {
        rs.push_back(f.at);
        notes.push_back("(" + key + "=" + std::to_string(f.max_value) + ")");
      }
    std::string err;
    if (!draw_plot(plot, rs, notes, plot_x, &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
  }
  if (json) {
    std::printf("{\"mode\":\"max\",\"key\":\"%s\",\"capacity_bytes\":%" PRIu64 ",\"seconds\":%.3f,\"replays\":%d,\"results\":[",
                json_escape(key).c_str(), capacity, secs, replays);
    for (std::size_t k = 0; k < found.size(); ++k) {
      const auto& f = found[k];
      std::printf("%s\n{", k ? "," : "");
      if (f.error.empty()) {
        std::printf("%s,\"key\":\"%s\",\"max_value\":%lld", json_fields(f.at).c_str(), json_escape(key).c_str(), f.max_value);
      } else {
        std::printf("\"input\":\"%s\",\"policy\":\"%s\",\"capacity_bytes\":%" PRIu64 ",\"key\":\"%s\",\"max_value\":null,"
                    "\"error\":\"%s\"",
                    json_escape(inputs[tasks[k].input]).c_str(), policy_name(tasks[k].policy), capacity,
                    json_escape(key).c_str(), json_escape(f.error).c_str());
      }
      std::printf(",\"search_replays\":%d,\"search_seconds\":%.3f}", f.replays, f.seconds);
    }
    std::printf("\n]}\n");
  } else {
    std::printf("%-44s %7s %-10s %-8s %8s %9s %9s %10s %11s %8s\n", "workload", "GiB", "policy", "key", "largest",
                "÷classic", "÷expand", "live MiB", "reserv MiB", "replays");
    for (std::size_t k = 0; k < found.size(); ++k) {
      const auto& f = found[k];
      if (!f.error.empty()) {
        std::printf("%-44s %7.4g %-10s %-8s %8s\n", short_name(inputs[tasks[k].input]).c_str(), gib(capacity),
                    policy_name(tasks[k].policy), key.c_str(), "none");
        continue;
      }
      char vc[32] = "-", ve[32] = "-";
      if (tasks[k].policy == PolicyKind::fragless) {
        if (double r = ratio(k, PolicyKind::classic); r > 0) std::snprintf(vc, sizeof vc, "%.2f", r);
        if (double r = ratio(k, PolicyKind::expandable); r > 0) std::snprintf(ve, sizeof ve, "%.2f", r);
      }
      std::printf("%-44s %7.4g %-10s %-8s %8lld %9s %9s %10.1f %11.1f %8d\n", short_name(inputs[tasks[k].input]).c_str(),
                  gib(capacity), policy_name(tasks[k].policy), key.c_str(), f.max_value, vc, ve, mib(f.at.peak_live),
                  mib(f.at.peak_reserved), f.replays);
    }
    std::printf("max: %zu searches, %d replays, %.2f s; every answer was replayed with 0 OOMs, one above it with at least 1\n",
                found.size(), replays, secs);
  }
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<PolicyKind> policies = {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless};
  std::uint64_t capacity = 0, fit_step = 1ull << 28;
  bool json = false, fit = false, fit_step_given = false;
  unsigned jobs = std::max(1u, std::thread::hardware_concurrency());
  PlotX plot_x = PlotX::auto_;
  std::string plot, seqlen_file, max_key, costs_file;
  Options base;
  std::optional<PolicyKind> conf_policy;
  bool policy_given = false;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--json") json = true;
    else if (a == "-h" || a == "--help") return usage(nullptr);
    else if (a == "--fit") fit = true;
    else if (a == "--max-batch") {
      if (!max_key.empty() && max_key != "batch") return usage("--max-batch and --max-of name different keys");
      max_key = "batch";
    } else if (a == "--max-of" && has_value) {
      const std::string k = argv[++i];
      if (k.empty()) return usage("--max-of needs a workload key (batch, max_seq, ...)");
      if (!max_key.empty() && max_key != k) return usage("--max-batch and --max-of name different keys");
      max_key = k;
    } else if (a == "--fit-step" && has_value) {
      char* end = nullptr;
      const double g = std::strtod(argv[++i], &end);
      if (*end || !(g >= 1.0 / 1024) || g > 1024) return usage("--fit-step needs a number of GiB in [1/1024, 1024]");
      fit_step = static_cast<std::uint64_t>(g * (1ull << 30));
      fit_step_given = true;
    } else if (a == "--jobs" && has_value) {
      char* end = nullptr;
      const long n = std::strtol(argv[++i], &end, 10);
      if (*end || n < 1 || n > 1024) return usage("--jobs needs a number in [1, 1024]");
      jobs = static_cast<unsigned>(n);
    } else if (a == "--policy" && has_value) {
      policies.clear();
      policy_given = true;
      std::stringstream ss(argv[++i]);
      std::string p;
      while (std::getline(ss, p, ',')) {
        if (p == "classic") policies.push_back(PolicyKind::classic);
        else if (p == "expandable") policies.push_back(PolicyKind::expandable);
        else if (p == "fragless") policies.push_back(PolicyKind::fragless);
        else return usage(("unknown policy '" + p + "' (classic, expandable, fragless)").c_str());
      }
      if (policies.empty()) return usage("--policy needs at least one policy");
    } else if (a == "--capacity-gib" && has_value) {
      char* end = nullptr;
      const double g = std::strtod(argv[++i], &end);
      if (*end || !(g > 0) || g > 1e6) return usage("--capacity-gib needs a positive number");
      capacity = static_cast<std::uint64_t>(g * (1ull << 30));
    } else if (a == "--plot" && has_value) {
      plot = argv[++i];
    } else if (a == "--plot-x" && has_value) {
      const std::string v = argv[++i];
      if (v == "time") plot_x = PlotX::time;
      else if (v == "event") plot_x = PlotX::event;
      else if (v == "auto") plot_x = PlotX::auto_;
      else return usage(("--plot-x: expected time, event or auto, got '" + v + "'").c_str());
    } else if (a == "--seqlen-file" && has_value) {
      seqlen_file = argv[++i];
    } else if (a == "--costs" && has_value) {
      costs_file = argv[++i];
    } else if (a == "--conf" && has_value) {
      std::string err;
      if (!apply_conf(argv[++i], &base, &conf_policy, &err)) return usage(err.c_str());
    } else if (a == "--policy" || a == "--capacity-gib" || a == "--plot" || a == "--seqlen-file" || a == "--conf" ||
               a == "--max-of" || a == "--fit-step" || a == "--jobs" || a == "--plot-x" || a == "--costs") {
      return usage(("missing value after " + a).c_str());
    } else if (!a.empty() && a[0] == '-') {
      return usage(("unknown option " + a).c_str());
    } else {
      inputs.push_back(a);
    }
  }
  if (inputs.empty()) return usage("no input");
  if (conf_policy) {
    if (policy_given && (policies.size() != 1 || policies[0] != *conf_policy))
      return usage(("--conf policy:" + std::string(policy_name(*conf_policy)) + " and --policy name different policies").c_str());
    policies = {*conf_policy};
  }
  if (fit && !max_key.empty()) return usage("--fit finds a capacity and --max-of a value: ask one at a time");
  if (fit && capacity) return usage("--fit searches the capacity: drop --capacity-gib");
  if (fit_step_given && !fit) return usage("--fit-step applies to --fit");
  if (!max_key.empty() && !capacity) return usage("--max-batch / --max-of need the device's size (--capacity-gib N)");
  if (!max_key.empty())
    for (const auto& in : inputs) {
      long long lo, hi;
      std::string err;
      if (!workload_key_range(in, max_key, &lo, &hi, &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
    }

  const bool plot_script = plot.size() > 3 && plot.compare(plot.size() - 3, 3, ".gp") == 0;
  if (!plot.empty() && !plot_script && std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    return usage("--plot needs gnuplot on the PATH (Debian: apt-get install gnuplot-nox)");
  std::vector<int> lengths;
  if (!seqlen_file.empty()) {
    std::string err;
    if (!read_seqlen_file(seqlen_file, &lengths, &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
  }
  CostModel costs;
  if (!costs_file.empty()) {
    std::string err;
    if (!load_costs(costs_file, &costs, &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
  }
  ReplayOptions ro;
  if (!costs_file.empty()) ro.costs = &costs;
  ro.capacity = capacity;
  ro.curve_points = plot.empty() ? 0 : 2000;
  ro.base = base;
  if (!max_key.empty()) {
    // Each spec must build at its own values before any search starts.
    for (const auto& in : inputs) {
      formats::Trace t;
      std::string err;
      if (!make_workload(in, &t, &err, seqlen_file.empty() ? nullptr : &lengths))
        return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
    }
    return run_max(inputs, policies, max_key, capacity, jobs, ro, seqlen_file.empty() ? nullptr : &lengths, json, plot, plot_x);
  }
  std::vector<formats::Trace> traces(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::string err;
    if (inputs[i].rfind("workload:", 0) == 0) {
      if (!make_workload(inputs[i], &traces[i], &err, seqlen_file.empty() ? nullptr : &lengths))
        return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
    } else {
      auto lr = formats::load_trace(inputs[i]);
      if (!lr.ok) return std::fprintf(stderr, "fragless-replay: %s\n", lr.error.c_str()), 2;
      if (!lr.warning.empty()) std::fprintf(stderr, "fragless-replay: warning: %s\n", lr.warning.c_str());
      traces[i] = std::move(lr.trace);
    }
  }
  std::vector<Task> tasks;
  for (std::size_t i = 0; i < traces.size(); ++i) {
    bool input_has_allocs = false;
    for (int d = 0; d < traces[i].devices(); ++d) {
      bool any = false;
      for (auto& e : traces[i].events) any |= e.device == d && e.op == formats::Op::alloc;
      if (!any) continue;
      input_has_allocs = true;
      for (PolicyKind p : policies) tasks.push_back({i, d, p});
    }
    if (!input_has_allocs)
      std::fprintf(stderr, "fragless-replay: warning: %s has no allocation events to replay (skipped)\n",
                   traces[i].source.c_str());
  }
  if (fit) return run_fit(traces, tasks, fit_step, jobs, ro, json, plot, plot_x);

  std::vector<ReplayResult> results(tasks.size());
  std::atomic<std::size_t> done{0};
  std::atomic<std::uint64_t> progress{0};
  std::uint64_t total_events = 0;
  for (auto& t : tasks) total_events += traces[t.input].events.size();
  ro.progress = &progress;
  std::thread runner([&] {
    run_tasks(tasks.size(), jobs, [&](std::size_t k) {
      results[k] = fragless::replay::replay(traces[tasks[k].input], tasks[k].device, tasks[k].policy, ro);
      ++done;
    });
  });
  // A progress line for long replays, only when a person is watching stderr.
  if (isatty(STDERR_FILENO)) {
    bool shown = false;
    const auto start = std::chrono::steady_clock::now();
    while (done.load() < tasks.size()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (secs < 1.0) continue;
      std::fprintf(stderr, "\rfragless-replay: %zu/%zu replays, %.1f/%.1f M events, %.0f s ", done.load(), tasks.size(),
                   static_cast<double>(progress.load()) / 1e6, static_cast<double>(total_events) / 1e6, secs);
      shown = true;
    }
    if (shown) std::fprintf(stderr, "\r\033[K");
  }
  runner.join();
  for (auto& r : results)
    if (!r.error.empty()) return std::fprintf(stderr, "fragless-replay: %s\n", r.error.c_str()), 2;
  if (!plot.empty()) {
    std::string err;
    if (!draw_plot(plot, results, {}, plot_x, &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
  }

  if (json) {
    std::printf("{\"results\":[");
    for (std::size_t k = 0; k < results.size(); ++k) std::printf("%s\n{%s}", k ? "," : "", json_fields(results[k]).c_str());
    std::printf("\n]}\n");
    return 0;
  }
  std::printf("%-44s %3s %-10s %9s %11s %11s %9s %8s %8s %5s %7s %7s %7s %6s %9s %9s %8s %11s\n", "input", "dev",
              "policy", "events", "live MiB", "reserv MiB", "overhead", "frag@pk", "tw-frag", "OOMs", "create", "map",
              "unmap", "syncs", "path ms", "bg ms", "Mev/s", "pytorch MiB");
  for (const auto& r : results) {
    char pyt[32] = "-";
    if (r.pytorch_recorded_peak_reserved) std::snprintf(pyt, sizeof pyt, "%.1f", mib(static_cast<std::int64_t>(*r.pytorch_recorded_peak_reserved)));
    std::printf("%-44s %3d %-10s %9" PRIu64 " %11.1f %11.1f %8.2f%% %7.2f%% %7.2f%% %5" PRIu64 " %7" PRIu64 " %7" PRIu64
                " %7" PRIu64 " %6" PRId64 " %9.2f %9.2f %8.2f %11s\n",
                short_name(r.input).c_str(), r.device, policy_name(r.policy), r.events, mib(r.peak_live),
                mib(r.peak_reserved), 100 * r.overhead_over_live, 100 * r.fragmentation_at_peak,
                100 * r.time_weighted_fragmentation, r.ooms, r.driver[DriverCall::create], r.driver[DriverCall::map],
                r.driver[DriverCall::unmap], r.forced_syncs, r.alloc_path_driver_us() / 1000,
                r.background_driver_us() / 1000, r.events_per_second / 1e6, pyt);
  }
  std::printf("%s\n", kLegend);
  return 0;
}
