// What fragless-replay does with its inputs: replays them through each policy, or searches what fits
// (--fit, --max-batch / --max-of; the searches themselves are fit.h's).
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "cli.h"
#include "fit.h"
#include "replay.h"

namespace fragless::replay {

// One replay (or --fit search): an input, one of its devices, a policy.
struct Task { std::size_t input; int device; PolicyKind policy; };
// One --max search: a workload and a policy.
struct MaxTask { std::size_t input; PolicyKind policy; };

// The answers of a search mode, one per task in the tasks' order (FitResult or MaxResult).
template <class Answer>
struct Searches {
  std::vector<Answer> answers;
  double seconds = 0;  // all searches, wall time
  int replays = 0;     // all searches together
  int failed = 0;      // searches without an answer
};

// Each mode prints its output (the table or --json, and the --plot) and returns the exit status.
// ro: the settings of every replay (--capacity-gib, --conf, --costs, the plot's curve points).
int run_replays(const std::vector<formats::Trace>& traces, const std::vector<Task>& tasks, const CommandLine& cl,
                const ReplayOptions& ro);
int run_fit(const std::vector<formats::Trace>& traces, const std::vector<Task>& tasks, const CommandLine& cl,
            const ReplayOptions& ro);
// lengths: --seqlen-file's lengths (null without one).
int run_max(const CommandLine& cl, const ReplayOptions& ro, const std::vector<int>* lengths);

}  // namespace fragless::replay
