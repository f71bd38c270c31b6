// What fragless-replay does with its inputs (modes.h).
#include "modes.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

#include "output.h"
#include "replay.h"
#include "workload.h"

namespace fragless::replay {
namespace {

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

// What --fit and --max have in common: n searches run side by side (each with its share of the --jobs for
// its own replays), a search without an answer named on stderr, the --plot of the answers' replays (note:
// an answer's text in the legend), then the mode's own output (print: the table or --json). Exit status 1
// when a search found no answer, 2 when the plot failed.
template <class Answer>
int run_searches(std::size_t n, const CommandLine& cl, const ReplayOptions& ro,
                 const std::function<Answer(std::size_t, const SearchOptions&)>& search,
                 const std::function<std::string(const Answer&)>& note,
                 const std::function<void(const Searches<Answer>&)>& print) {
  Searches<Answer> s;
  s.answers.resize(n);
  SearchOptions so;
  so.replay = ro;
  so.parallel = std::max(1u, cl.jobs / static_cast<unsigned>(std::max<std::size_t>(1, n)));
  const auto t0 = std::chrono::steady_clock::now();
  run_tasks(n, cl.jobs, [&](std::size_t k) { s.answers[k] = search(k, so); });
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (auto& a : s.answers) {
    s.replays += a.replays;
    if (!a.error.empty()) ++s.failed, print_error(a.error);
  }
  if (!cl.plot.empty()) {
    std::vector<ReplayResult> rs;
    std::vector<std::string> notes;
    for (auto& a : s.answers)
      if (a.error.empty()) {
        rs.push_back(a.at);
        notes.push_back(note(a));
      }
    std::string err;
    if (!draw_plot(cl.plot, rs, notes, cl.plot_x, &err)) return fail(err);
  }
  print(s);
  return s.failed ? 1 : 0;
}

}  // namespace

int run_replays(const std::vector<formats::Trace>& traces, const std::vector<Task>& tasks, const CommandLine& cl,
                const ReplayOptions& options) {
  ReplayOptions ro = options;
  std::vector<ReplayResult> results(tasks.size());
  std::atomic<std::size_t> done{0};
  std::atomic<std::uint64_t> progress{0};
  std::uint64_t total_events = 0;
  for (auto& t : tasks) total_events += traces[t.input].events.size();
  ro.progress = &progress;
  std::thread runner([&] {
    run_tasks(tasks.size(), cl.jobs, [&](std::size_t k) {
      results[k] = replay(traces[tasks[k].input], tasks[k].device, tasks[k].policy, ro);
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
    if (!r.error.empty()) return fail(r.error);
  // Without --capacity-gib the device stands for unlimited memory: an OOM there (the trace asking for more than
  // the largest capacity the replay models, or placing it badly near that size) leaves allocations out of the
  // table's figures, and is said.
  for (auto& r : results)
    if (r.ooms && !cl.capacity)
      print_error("warning: " + r.input + " (device " + std::to_string(r.device) + ", " + policy_name(r.policy) +
                  "): " + std::to_string(r.ooms) + (r.ooms == 1 ? " allocation" : " allocations") + " failed on " +
                  std::to_string(kUnlimitedCapacity >> 30) + " GiB, the largest device the replay models (it stands for unlimited "
                  "memory); the figures leave them out");
  if (!cl.plot.empty()) {
    std::string err;
    if (!draw_plot(cl.plot, results, {}, cl.plot_x, &err)) return fail(err);
  }
  if (cl.json) print_replay_json(results);
  else print_replay_table(results);
  return 0;
}

// --fit: one search per input, device and policy.
int run_fit(const std::vector<formats::Trace>& traces, const std::vector<Task>& tasks, const CommandLine& cl,
            const ReplayOptions& ro) {
  return run_searches<FitResult>(
      tasks.size(), cl, ro,
      [&](std::size_t k, const SearchOptions& so) {
        return fit_capacity(traces[tasks[k].input], tasks[k].device, tasks[k].policy, cl.fit_step, so);
      },
      [](const FitResult& f) {
        char n[64];
        std::snprintf(n, sizeof n, "(fits %.4g GiB)", gib(f.min_capacity));
        return std::string(n);
      },
      [&](const Searches<FitResult>& fits) {
        if (cl.json) print_fit_json(traces, tasks, fits, cl.fit_step);
        else print_fit_table(traces, tasks, fits, cl.fit_step);
      });
}

// --max-of KEY: one search per workload and policy.
int run_max(const CommandLine& cl, const ReplayOptions& ro, const std::vector<int>* lengths) {
  // Each spec must build at its own values before any search starts.
  for (const auto& in : cl.inputs) {
    formats::Trace t;
    std::string err;
    if (!make_workload(in, &t, &err, lengths)) return fail(err);
  }
  std::vector<MaxTask> tasks;
  for (std::size_t i = 0; i < cl.inputs.size(); ++i)
    for (PolicyKind p : cl.policies) tasks.push_back({i, p});
  return run_searches<MaxResult>(
      tasks.size(), cl, ro,
      [&](std::size_t k, const SearchOptions& so) {
        return max_value(cl.inputs[tasks[k].input], cl.max_key, tasks[k].policy, cl.capacity, so, lengths);
      },
      [&](const MaxResult& f) { return "(" + cl.max_key + "=" + std::to_string(f.max_value) + ")"; },
      [&](const Searches<MaxResult>& found) {
        if (cl.json) print_max_json(cl.inputs, tasks, found, cl.max_key, cl.capacity);
        else print_max_table(cl.inputs, tasks, found, cl.max_key, cl.capacity);
      });
}

}  // namespace fragless::replay
