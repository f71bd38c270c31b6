// The text tables of fragless-replay (output.h).
#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "output.h"

namespace fragless::replay {
namespace {

// The table's columns, in one line under it.
constexpr const char* kLegend =
    "columns: events = alloc, free and empty_cache events replayed on the device; live, alloc, reserv = peaks "
    "(MiB: requested bytes, blocks handed out, physical memory held); "
    "overhead = peak reserved / peak live - 1; frag@pk = 1 - peak allocated / peak reserved (each peak taken on "
    "its own, not at one moment); tw-frag = 1 - time integral of allocated / that of reserved; OOMs = allocations "
    "that did not fit --capacity-gib; x@OOM = external fragmentation when they failed, 1 - largest free range / "
    "total free, the mean over the OOMs ('-' without one); create, map, unmap = driver "
    "calls; syncs = synchronisations forced; path ms, bg ms = the calls' modelled time (A100 costs, or --costs) "
    "inside allocation and free calls, and done by the background worker; "
    "Mev/s = replay speed; pytorch MiB = PyTorch's own peak reserved, where the snapshot tells it";

// PyTorch's own peak reserved in MiB, or "-" where the snapshot does not tell it.
void pytorch_cell(const ReplayResult& r, char (&cell)[32]) {
  if (r.pytorch_recorded_peak_reserved)
    std::snprintf(cell, sizeof cell, "%.1f", mib(static_cast<std::int64_t>(*r.pytorch_recorded_peak_reserved)));
}

// The line under a --fit or --max-of table that says how its answers were checked: only of the searches
// that found one (a search without an answer, `none` in the table, was checked for nothing).
std::string checked_answers(std::size_t searches, int failed, const char* neighbour, const char* also = "") {
  const std::size_t found = searches - std::min(searches, static_cast<std::size_t>(std::max(0, failed)));
  if (found == 0) return "no search found an answer, so none was checked (the reasons are on stderr)";
  const std::string of = " found (of " + std::to_string(searches) + " searches)";
  const std::string which = found == searches ? "every answer"
                            : found == 1      ? "the one answer" + of
                                              : "each of the " + std::to_string(found) + " answers" + of;
  return which + " was replayed with 0 OOMs" + also + ", " + neighbour + " with at least 1";
}

// A path's file name (a workload spec as it is).
std::string file_name(const std::string& s) {
  const auto slash = s.find_last_of('/');
  return slash == std::string::npos ? s : s.substr(slash + 1);
}

// Under a table: the inputs whose names were cut to fit the first column, in full, once each (two draws of
// one workload can differ only in the middle of their specs, which the cut drops).
void print_cut_names(const std::vector<std::string>& inputs) {
  std::vector<std::string> said;
  for (const auto& in : inputs) {
    const std::string base = file_name(in);
    if (short_name(in) == base || std::find(said.begin(), said.end(), in) != said.end()) continue;
    if (said.empty()) std::printf("names cut above, in full:\n");
    std::printf("  %s = %s\n", short_name(in).c_str(), base.c_str());
    said.push_back(in);
  }
}

}  // namespace

std::string short_name(const std::string& s) {
  std::string n = file_name(s);
  if (n.size() > 44) n = n.substr(0, 20) + "…" + n.substr(n.size() - 23);
  return n;
}

double mib(std::int64_t b) { return static_cast<double>(b) / (1 << 20); }
double gib(std::uint64_t b) { return static_cast<double>(b) / (1ull << 30); }

void print_error(const std::string& message) { std::fprintf(stderr, "fragless-replay: %s\n", message.c_str()); }

int fail(const std::string& message) {
  print_error(message);
  return 2;
}

void print_replay_table(const std::vector<ReplayResult>& results) {
  std::printf("%-44s %3s %-10s %9s %11s %11s %11s %9s %8s %8s %5s %7s %7s %7s %7s %6s %9s %9s %8s %11s\n", "input",
              "dev", "policy", "events", "live MiB", "alloc MiB", "reserv MiB", "overhead", "frag@pk", "tw-frag", "OOMs",
              "x@OOM", "create", "map", "unmap", "syncs", "path ms", "bg ms", "Mev/s", "pytorch MiB");
  for (const auto& r : results) {
    char pyt[32] = "-", ext[32] = "-";
    pytorch_cell(r, pyt);
    if (r.ooms) std::snprintf(ext, sizeof ext, "%.2f%%", 100 * r.external_fragmentation_at_oom_mean);
    // A tiny trace (one 100-byte allocation in a 2 MiB page) can be millions of percent over live: shown in
    // three significant digits past 99,999%, so that the columns stay aligned (--json has the exact ratio).
    char over[32];
    const double pct = 100 * r.overhead_over_live;
    std::snprintf(over, sizeof over, pct < 1e5 ? "%.2f%%" : "%.3g%%", pct);
    std::printf("%-44s %3d %-10s %9" PRIu64 " %11.1f %11.1f %11.1f %9s %7.2f%% %7.2f%% %5" PRIu64 " %7s %7" PRIu64
                " %7" PRIu64 " %7" PRIu64 " %6" PRId64 " %9.2f %9.2f %8.2f %11s\n",
                short_name(r.input).c_str(), r.device, policy_name(r.policy), r.events, mib(r.peak_live),
                mib(r.peak_allocated), mib(r.peak_reserved), over, 100 * r.fragmentation_at_peak,
                100 * r.time_weighted_fragmentation, r.ooms, ext, r.driver[DriverCall::create], r.driver[DriverCall::map],
                r.driver[DriverCall::unmap], r.forced_syncs, r.alloc_path_driver_us() / 1000,
                r.background_driver_us() / 1000, r.events_per_second / 1e6, pyt);
    if (const auto& p = r.at_peak)  // --peak-detail
      std::printf("  at its peak (event %" PRIu64 "): %.1f MiB reserved = %.1f allocated (%.1f live) + %.1f free in "
                  "%" PRIu64 " blocks (%.1f in whole pages, %.1f in partial pages) + %.1f idle; small pool %.1f "
                  "reserved, %.1f free\n",
                  p->event, mib(p->reserved), mib(p->allocated), mib(p->live), mib(p->free), p->free_blocks,
                  mib(p->free_in_whole_pages), mib(p->free_in_partial_pages), mib(p->idle), mib(p->small_reserved),
                  mib(p->small_free));
    if (r.page_floor) {  // --peak-detail
      char over[32] = "";
      if (r.peak_live > 0)
        std::snprintf(over, sizeof over, " (%.2f%% over peak live)",
                      100.0 * (static_cast<double>(*r.page_floor) / static_cast<double>(r.peak_live) - 1));
      std::printf("  page floor %.1f MiB%s: the most pages holding allocated bytes at one moment; no policy that "
                  "places blocks as this one did and backs whole pages holds less\n",
                  mib(*r.page_floor), over);
    }
  }
  std::vector<std::string> inputs;
  for (const auto& r : results) inputs.push_back(r.input);
  print_cut_names(inputs);
  std::printf("%s\n", kLegend);
}

void print_fit_table(const std::vector<formats::Trace>& traces, const std::vector<Task>& tasks,
                     const Searches<FitResult>& fits, std::uint64_t step) {
  const auto& found = fits.answers;
  // The classic answer for the same input and device, for the ratio column.
  auto classic_of = [&](std::size_t k) -> const FitResult* {
    for (std::size_t j = 0; j < tasks.size(); ++j)
      if (tasks[j].input == tasks[k].input && tasks[j].device == tasks[k].device &&
          tasks[j].policy == PolicyKind::classic && found[j].error.empty())
        return &found[j];
    return nullptr;
  };
  std::printf("%-44s %3s %-10s %10s %12s %8s %8s %11s %8s %8s %11s\n", "input", "dev", "policy", "live MiB",
              "fits on GiB", "÷live", "÷classic", "reserv MiB", "OOMs", "replays", "pytorch MiB");
  for (std::size_t k = 0; k < found.size(); ++k) {
    const auto& f = found[k];
    const auto& t = tasks[k];
    if (!f.error.empty()) {
      std::printf("%-44s %3d %-10s %10s %12s\n", short_name(traces[t.input].source).c_str(), t.device,
                  policy_name(t.policy), "-", "no answer");
      continue;
    }
    char pyt[32] = "-", vs[32] = "-";
    pytorch_cell(f.at, pyt);
    if (const FitResult* c = classic_of(k)) std::snprintf(vs, sizeof vs, "%.3f", gib(f.min_capacity) / gib(c->min_capacity));
    std::printf("%-44s %3d %-10s %10.1f %12.4g %8.3f %8s %11.1f %8" PRIu64 " %8d %11s\n",
                short_name(traces[t.input].source).c_str(), t.device, policy_name(t.policy), mib(f.peak_live),
                gib(f.min_capacity), static_cast<double>(f.min_capacity) / static_cast<double>(std::max<std::int64_t>(1, f.peak_live)),
                vs, mib(f.at.peak_reserved), f.recorded_ooms, f.replays, pyt);
  }
  std::vector<std::string> inputs;
  for (const auto& t : tasks) inputs.push_back(traces[t.input].source);
  print_cut_names(inputs);
  std::printf("fit: %zu searches, %d replays, step %.4g GiB, %.2f s\n", found.size(), fits.replays, gib(step), fits.seconds);
  std::printf("OOMs: the ones the trace itself recorded; %s\n",
              checked_answers(found.size(), fits.failed, "one step below (where it is above 0 bytes)",
                              " with every step above it up to where its policy runs as without a limit")
                  .c_str());
}

void print_max_table(const std::vector<std::string>& inputs, const std::vector<MaxTask>& tasks,
                     const Searches<MaxResult>& search, const std::string& key, std::uint64_t capacity) {
  const auto& found = search.answers;
  // fragless's largest value over policy p's, for the same workload, as text: '-' where either has no
  // answer or both are the largest value the workload accepts; an answer at that limit is a lower bound of
  // the value that fits, so a ratio with one is a bound too ('>' when fragless's is, '<' when p's is).
  auto ratio = [&](std::size_t k, PolicyKind p) -> std::string {
    auto answer = [&](PolicyKind q) -> const MaxResult* {
      for (std::size_t j = 0; j < tasks.size(); ++j)
        if (tasks[j].input == tasks[k].input && tasks[j].policy == q && found[j].error.empty()) return &found[j];
      return nullptr;
    };
    const MaxResult* f = answer(PolicyKind::fragless);
    const MaxResult* b = answer(p);
    if (!f || !b || b->max_value <= 0 || (f->at_limit && b->at_limit)) return "-";
    char v[32];
    std::snprintf(v, sizeof v, "%s%.2f", f->at_limit ? ">" : b->at_limit ? "<" : "",
                  static_cast<double>(f->max_value) / static_cast<double>(b->max_value));
    return v;
  };
  std::printf("%-44s %7s %-10s %-8s %8s %9s %9s %10s %11s %8s\n", "workload", "GiB", "policy", "key", "largest",
              "÷classic", "÷expand", "live MiB", "reserv MiB", "replays");
  for (std::size_t k = 0; k < found.size(); ++k) {
    const auto& f = found[k];
    if (!f.error.empty()) {
      std::printf("%-44s %7.4g %-10s %-8s %8s\n", short_name(inputs[tasks[k].input]).c_str(), gib(capacity),
                  policy_name(tasks[k].policy), key.c_str(), "none");
      continue;
    }
    std::string vc = "-", ve = "-";
    if (tasks[k].policy == PolicyKind::fragless) {
      vc = ratio(k, PolicyKind::classic);
      ve = ratio(k, PolicyKind::expandable);
    }
    const std::string value = std::to_string(f.max_value) + (f.at_limit ? "*" : "");
    std::printf("%-44s %7.4g %-10s %-8s %8s %9s %9s %10.1f %11.1f %8d\n", short_name(inputs[tasks[k].input]).c_str(),
                gib(capacity), policy_name(tasks[k].policy), key.c_str(), value.c_str(), vc.c_str(), ve.c_str(), mib(f.at.peak_live),
                mib(f.at.peak_reserved), f.replays);
  }
  const auto at_limit = std::count_if(found.begin(), found.end(), [](const MaxResult& f) { return f.error.empty() && f.at_limit; });
  std::vector<std::string> cut;
  for (const auto& t : tasks) cut.push_back(inputs[t.input]);
  print_cut_names(cut);
  std::printf("max: %zu searches, %d replays, %.2f s; %s%s\n", found.size(), search.replays, search.seconds,
              checked_answers(found.size(), search.failed, "one above it").c_str(),
              at_limit ? ("; except the " + std::to_string(at_limit) + " marked '*': the largest value the workload "
                          "accepts, which fits, with no value above it (a ratio with one is a bound: > or <)").c_str()
                       : "");
}

}  // namespace fragless::replay
