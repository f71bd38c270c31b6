// fragless-replay: replays traces (PyTorch snapshots, RMM logs) or built-in workloads through each policy
// on the sim driver and prints a side-by-side table (or --json).
//
//   fragless-replay [--policy classic,expandable,fragless] [--capacity-gib N] [--json] [--plot FILE.png]
//                   [--seqlen-file CSV] INPUT...
//   INPUT = a trace file (format detected from content) or workload:NAME[:key=value,...]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <unistd.h>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

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
               "                       [--conf KEY:VALUE,...]\n"
               "                       [--plot FILE.png] [--seqlen-file CSV] INPUT...\n"
               "  INPUT: a fragless native trace, PyTorch memory snapshot pickle or RMM log CSV (detected from\n"
               "         content), or workload:NAME[:key=value,...]\n"
               "  --capacity-gib: the device's memory; without it the capacity is unlimited (1 TiB). An\n"
               "         allocation that runs out of memory is a result, counted in the OOMs column and skipped\n"
               "  --plot: live/allocated/reserved over time per policy, drawn by gnuplot into a PNG\n"
               "  --conf: allocator settings in FRAGLESS_CONF grammar (policy tuning keys such as handles,\n"
               "          handle_max_mb, chunk_size_mb, reserve_slack, lend_pages); policy and driver are set by\n"
               "          the replay\n"
               "  --seqlen-file: sequence lengths for the workloads (a CSV column, see the README)\n"
               "  NAME: transformer-train | transformer-infer; keys: layers d_model heads d_ff vocab batch steps\n"
               "        seqlen (sharegpt|azure-conv|azure-code|arxiv|fixed:N) max_seq dtype (fp32|bf16) ckpt\n"
               "        accum seed\n"
               "  ckpt-accum: transformer-train with checkpointing and gradient accumulation (ckpt=1,accum=4,\n"
               "        steps=12); every transformer key applies\n"
               "%s",
               fragless::replay::zoo_help().c_str());
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

// Live, allocated and reserved over time, one panel per input and device, one colour per policy; drawn by
// gnuplot (pngcairo, else png) from inline data blocks.
bool draw_plot(const std::string& path, const std::vector<ReplayResult>& results, std::string* error) {
  std::vector<std::pair<std::string, int>> panels;
  for (auto& r : results)
    if (std::find(panels.begin(), panels.end(), std::make_pair(r.input, r.device)) == panels.end())
      panels.emplace_back(r.input, r.device);
  std::string script;
  auto quote = [](std::string s) {
    std::string o;
    for (char c : s) {
      if (c == '"' || c == '\\') o += '\\';
      o += c;
    }
    return "\"" + o + "\"";
  };
  std::size_t block = 0;
  for (auto& r : results) {
    script += "$d" + std::to_string(block++) + " << EOD\n";
    for (auto& p : r.curve) {
      char line[128];
      std::snprintf(line, sizeof line, "%.6f %.3f %.3f %.3f\n", p.x, mib(p.live), mib(p.allocated), mib(p.reserved));
      script += line;
    }
    script += "EOD\n";
  }
  const int rows = static_cast<int>(panels.size());
  script += "set terminal pngcairo size 1200," + std::to_string(320 * rows) + " noenhanced\n";
  script += "set output " + quote(path) + "\n";
  script += "set multiplot layout " + std::to_string(rows) + ",1\n";
  script += "set key outside right\nset ylabel \"MiB\"\nset grid\n";
  const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c"};
  for (auto& [input, dev] : panels) {
    bool seconds = false;
    std::string plots;
    bool live_drawn = false;
    block = 0;
    for (auto& r : results) {
      const std::size_t b = block++;
      if (r.input != input || r.device != dev) continue;
      seconds = r.curve_in_seconds;
      const std::string d = "$d" + std::to_string(b);
      const char* c = colours[static_cast<int>(r.policy) % 3];
      if (!live_drawn) {
        plots += d + " using 1:2 with lines lw 2 lc rgb \"black\" title \"live\", ";
        live_drawn = true;
      }
      plots += d + " using 1:4 with lines lw 2 lc rgb \"" + c + "\" title \"" + policy_name(r.policy) + " reserved\", ";
      plots += d + " using 1:3 with lines dt 2 lc rgb \"" + c + "\" title \"" + policy_name(r.policy) + " allocated\", ";
    }
    script += "set title " + quote(short_name(input) + " (device " + std::to_string(dev) + ")") + "\n";
    script += std::string("set xlabel \"") + (seconds ? "trace time (s)" : "event") + "\"\n";
    script += "plot " + plots.substr(0, plots.size() - 2) + "\n";
  }
  script += "unset multiplot\n";
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

}  // namespace

int main(int argc, char** argv) {
  std::vector<PolicyKind> policies = {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless};
  std::uint64_t capacity = 0;
  bool json = false;
  std::string plot, seqlen_file;
  Options base;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") json = true;
    else if (a == "-h" || a == "--help") return usage(nullptr);
    else if (a == "--policy" && i + 1 < argc) {
      policies.clear();
      std::stringstream ss(argv[++i]);
      std::string p;
      while (std::getline(ss, p, ',')) {
        if (p == "classic") policies.push_back(PolicyKind::classic);
        else if (p == "expandable") policies.push_back(PolicyKind::expandable);
        else if (p == "fragless") policies.push_back(PolicyKind::fragless);
        else return usage(("unknown policy '" + p + "' (classic, expandable, fragless)").c_str());
      }
    } else if (a == "--capacity-gib" && i + 1 < argc) {
      char* end = nullptr;
      const double g = std::strtod(argv[++i], &end);
      if (*end || !(g > 0) || g > 1e6) return usage("--capacity-gib needs a positive number");
      capacity = static_cast<std::uint64_t>(g * (1ull << 30));
    } else if (a == "--plot" && i + 1 < argc) {
      plot = argv[++i];
    } else if (a == "--seqlen-file" && i + 1 < argc) {
      seqlen_file = argv[++i];
    } else if (a == "--conf" && i + 1 < argc) {
      const auto cr = parse_config(argv[++i], base);
      if (!cr.ok) return usage(cr.error.c_str());
      base = cr.options;
    } else if (!a.empty() && a[0] == '-') {
      return usage(("unknown option " + a).c_str());
    } else {
      inputs.push_back(a);
    }
  }
  if (inputs.empty()) return usage("no input");

  if (!plot.empty() && std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    return usage("--plot needs gnuplot on the PATH (Debian: apt-get install gnuplot-nox)");
  std::vector<int> lengths;
  if (!seqlen_file.empty()) {
    std::string err;
    if (!read_seqlen_file(seqlen_file, &lengths, &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
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
  struct Task { std::size_t input; int device; PolicyKind policy; };
  std::vector<Task> tasks;
  for (std::size_t i = 0; i < traces.size(); ++i)
    for (int d = 0; d < traces[i].devices(); ++d) {
      bool any = false;
      for (auto& e : traces[i].events) any |= e.device == d && e.op == formats::Op::alloc;
      if (!any) continue;
      for (PolicyKind p : policies) tasks.push_back({i, d, p});
    }
  std::vector<ReplayResult> results(tasks.size());
  std::atomic<std::size_t> next{0}, done{0};
  std::atomic<std::uint64_t> progress{0};
  std::uint64_t total_events = 0;
  for (auto& t : tasks) total_events += traces[t.input].events.size();
  ReplayOptions ro;
  ro.capacity = capacity;
  ro.curve_points = plot.empty() ? 0 : 2000;
  ro.progress = &progress;
  ro.base = base;
  auto worker = [&] {
    for (std::size_t k; (k = next++) < tasks.size(); ++done)
      results[k] = fragless::replay::replay(traces[tasks[k].input], tasks[k].device, tasks[k].policy, ro);
  };
  std::vector<std::thread> pool;
  const unsigned n = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), static_cast<unsigned>(tasks.size())));
  for (unsigned t = 0; t < n; ++t) pool.emplace_back(worker);
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
  for (auto& t : pool) t.join();
  for (auto& r : results)
    if (!r.error.empty()) return std::fprintf(stderr, "fragless-replay: %s\n", r.error.c_str()), 2;
  if (!plot.empty()) {
    std::string err;
    if (!draw_plot(plot, results, &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
  }

  if (json) {
    std::printf("{\"results\":[");
    for (std::size_t k = 0; k < results.size(); ++k) {
      const auto& r = results[k];
      auto c = [&](DriverCall dc) { return r.driver[dc]; };
      std::printf("%s\n{\"input\":\"%s\",\"device\":%d,\"policy\":\"%s\",\"events\":%" PRIu64
                  ",\"peak_live_bytes\":%" PRId64 ",\"peak_allocated_bytes\":%" PRId64 ",\"peak_reserved_bytes\":%" PRId64
                  ",\"fragmentation_at_peak\":%.6f,\"overhead_over_live\":%.6f,\"time_weighted_fragmentation\":%.6f"
                  ",\"ooms\":%" PRIu64 ",\"driver_calls\":{\"reserve\":%" PRIu64 ",\"create\":%" PRIu64 ",\"map\":%" PRIu64
                  ",\"set_access\":%" PRIu64 ",\"unmap\":%" PRIu64 ",\"release\":%" PRIu64 "},\"forced_syncs\":%" PRId64
                  ",\"modelled_driver_us\":%.2f,",
                  k ? "," : "", json_escape(r.input).c_str(), r.device, policy_name(r.policy), r.events, r.peak_live,
                  r.peak_allocated, r.peak_reserved, r.fragmentation_at_peak, r.overhead_over_live,
                  r.time_weighted_fragmentation, r.ooms, c(DriverCall::reserve), c(DriverCall::create),
                  c(DriverCall::map), c(DriverCall::set_access), c(DriverCall::unmap), c(DriverCall::release),
                  r.forced_syncs, r.driver.modelled_us);
      if (r.trace_duration_us) std::printf("\"trace_duration_us\":%.0f,", *r.trace_duration_us);
      else std::printf("\"trace_duration_us\":null,");
      std::printf("\"replay_seconds\":%.6f,\"events_per_second\":%.0f,", r.replay_seconds, r.events_per_second);
      if (r.pytorch_recorded_peak_reserved) std::printf("\"pytorch_recorded_peak_reserved_bytes\":%" PRIu64 "}", *r.pytorch_recorded_peak_reserved);
      else std::printf("\"pytorch_recorded_peak_reserved_bytes\":null}");
    }
    std::printf("\n]}\n");
    return 0;
  }
  std::printf("%-44s %3s %-10s %9s %11s %11s %9s %8s %8s %5s %7s %7s %7s %6s %10s %8s %11s\n", "input", "dev", "policy",
              "events", "live MiB", "reserv MiB", "overhead", "frag@pk", "tw-frag", "OOMs", "create", "map", "unmap",
              "syncs", "driver ms", "Mev/s", "pytorch MiB");
  for (const auto& r : results) {
    char pyt[32] = "-";
    if (r.pytorch_recorded_peak_reserved) std::snprintf(pyt, sizeof pyt, "%.1f", mib(static_cast<std::int64_t>(*r.pytorch_recorded_peak_reserved)));
    std::printf("%-44s %3d %-10s %9" PRIu64 " %11.1f %11.1f %8.2f%% %7.2f%% %7.2f%% %5" PRIu64 " %7" PRIu64 " %7" PRIu64
                " %7" PRIu64 " %6" PRId64 " %10.2f %8.2f %11s\n",
                short_name(r.input).c_str(), r.device, policy_name(r.policy), r.events, mib(r.peak_live),
                mib(r.peak_reserved), 100 * r.overhead_over_live, 100 * r.fragmentation_at_peak,
                100 * r.time_weighted_fragmentation, r.ooms, r.driver[DriverCall::create], r.driver[DriverCall::map],
                r.driver[DriverCall::unmap], r.forced_syncs, r.driver.modelled_us / 1000, r.events_per_second / 1e6, pyt);
  }
  return 0;
}
