// fragless-replay: replays traces (PyTorch snapshots, RMM logs) or built-in workloads through each policy
// on the sim driver and prints a side-by-side table (or --json).
//
//   fragless-replay [--policy classic,expandable,fragless] [--capacity-gib N] [--json] INPUT...
//   INPUT = a trace file (format detected from content) or workload:NAME[:key=value,...]
#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "replay.h"
#include "workload.h"

using namespace fragless;
using namespace fragless::replay;

namespace {

int usage(const char* msg) {
  if (msg) std::fprintf(stderr, "fragless-replay: %s\n", msg);
  std::fprintf(stderr,
               "usage: fragless-replay [--policy classic,expandable,fragless] [--capacity-gib N] [--json] INPUT...\n"
               "  INPUT: a PyTorch memory snapshot pickle or RMM log CSV, or workload:NAME[:key=value,...]\n"
               "  NAME: transformer-train | transformer-infer; keys: layers d_model heads d_ff vocab batch steps\n"
               "        seqlen (sharegpt|azure-conv|azure-code|arxiv|fixed:N) max_seq dtype (fp32|bf16) ckpt seed\n");
  return 2;
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

}  // namespace

int main(int argc, char** argv) {
  std::vector<PolicyKind> policies = {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless};
  std::uint64_t capacity = 0;
  bool json = false;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") json = true;
    else if (a == "-h" || a == "--help") return usage(nullptr), 0;
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
    } else if (!a.empty() && a[0] == '-') {
      return usage(("unknown option " + a).c_str());
    } else {
      inputs.push_back(a);
    }
  }
  if (inputs.empty()) return usage("no input");

  std::vector<formats::Trace> traces(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::string err;
    if (inputs[i].rfind("workload:", 0) == 0) {
      if (!make_workload(inputs[i], &traces[i], &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
    } else {
      auto lr = formats::load_trace(inputs[i]);
      if (!lr.ok) return std::fprintf(stderr, "fragless-replay: %s\n", lr.error.c_str()), 2;
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
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t k; (k = next++) < tasks.size();)
      results[k] = fragless::replay::replay(traces[tasks[k].input], tasks[k].device, tasks[k].policy, capacity);
  };
  std::vector<std::thread> pool;
  const unsigned n = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), static_cast<unsigned>(tasks.size())));
  for (unsigned t = 0; t < n; ++t) pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  for (auto& r : results)
    if (!r.error.empty()) return std::fprintf(stderr, "fragless-replay: %s\n", r.error.c_str()), 2;

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
