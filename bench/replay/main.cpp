// fragless-replay: replays traces (PyTorch snapshots, RMM logs) or built-in workloads through each policy
// on the sim driver and prints a side-by-side table (or --json).
//
//   fragless-replay [--policy classic,expandable,fragless] [--capacity-gib N] [--json] [--plot FILE.png]
//                   [--seqlen-file CSV] [--window FROM:TO] INPUT...
//   fragless-replay --fit [--fit-step GIB] INPUT...             smallest device per policy (fit.h)
//   fragless-replay --max-batch | --max-of KEY --capacity-gib N workload:...   largest value per policy
//   INPUT = a trace file (format detected from content) or workload:NAME[:key=value,...]
//
// The command line is cli.h's, the modes modes.h's, the outputs (table, --json, --plot) output.h's.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli.h"
#include "costs.h"
#include "modes.h"
#include "output.h"
#include "window.h"
#include "workload.h"

using namespace fragless;
using namespace fragless::replay;

namespace {

// Each input's trace: a file's, loaded (its warning on stderr), or a workload's, generated. False after
// naming the first input that fails on stderr.
bool load_inputs(const std::vector<std::string>& inputs, const std::vector<int>* lengths, const CommandLine& cl,
                 std::vector<formats::Trace>* traces, std::vector<std::string>* warnings) {
  traces->resize(inputs.size());
  warnings->assign(inputs.size(), "");
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::string err;
    if (inputs[i].rfind("workload:", 0) == 0) {
      if (!make_workload(inputs[i], &(*traces)[i], &err, lengths)) return fail(err), false;
    } else {
      auto lr = formats::load_trace(inputs[i]);
      if (!lr.ok) return fail(lr.error), false;
      (*warnings)[i] = lr.warning;  // said by replay_tasks, with whether the input is skipped
      (*traces)[i] = std::move(lr.trace);
    }
    cut_window(&(*traces)[i], cl.window, cl.window_text);  // --window
  }
  return true;
}

// One task per input, device with an allocation of more than 0 bytes, and policy; for a --window, also a
// device whose window only frees blocks live at its start (the run goes on there). An input with none is
// skipped, said on stderr: its rows would be zeros, or, for a snapshot whose history holds no allocation (the
// legacy one-entry history: its reader says so), the blocks live at the dump and nothing else, and a search
// would answer nothing.
std::vector<Task> replay_tasks(const std::vector<formats::Trace>& traces, const std::vector<std::string>& warnings,
                               const std::vector<PolicyKind>& policies) {
  std::vector<Task> tasks;
  for (std::size_t i = 0; i < traces.size(); ++i) {
    bool input_has_allocs = false;
    for (int d = 0; d < traces[i].devices(); ++d) {
      bool any = false, frees = false, held = false;
      for (auto& e : traces[i].events) {
        any |= e.device == d && e.op == formats::Op::alloc && e.size > 0;
        frees |= e.device == d && e.op == formats::Op::free;
      }
      for (auto& e : traces[i].seed) held |= e.device == d && e.size > 0;
      if (!any && !(traces[i].window && frees && held)) continue;
      input_has_allocs = true;
      for (PolicyKind p : policies) tasks.push_back({i, d, p});
    }
    // One line per input: its reader's warning, and that it is skipped when it is (the reader's warning may
    // already say why, as for a snapshot whose history holds no allocation).
    const std::string skipped = "no allocation events to replay (no allocation of more than 0 bytes" +
                                std::string(traces[i].window ? ", nor a free of a block live when the window begins" : "") +
                                "): skipped";
    if (!warnings[i].empty())
      print_error("warning: " + warnings[i] + (input_has_allocs ? "" : "; " + skipped));
    else if (!input_has_allocs)
      print_error("warning: " + traces[i].source + " has " + skipped);
  }
  return tasks;
}

}  // namespace

int run(int argc, char** argv) {
  CommandLine cl;
  if (const auto status = parse_command_line(argc, argv, &cl)) return *status;
  std::vector<int> lengths;
  std::string err;
  std::string column_note;
  if (!cl.seqlen_file.empty() && !read_seqlen_file(cl.seqlen_file, &lengths, &err, &column_note)) return fail(err);
  if (!column_note.empty()) print_error(column_note);
  const std::vector<int>* seqlens = cl.seqlen_file.empty() ? nullptr : &lengths;
  if (seqlens && cl.max_key != "max_seq")  // (a search of max_seq tries many)
    for (const std::string& in : cl.inputs)
      if (const std::string note = seqlen_file_note(in, lengths, cl.seqlen_file); !note.empty()) print_error(note);
  CostModel costs;
  std::string unmeasured;
  if (!cl.costs_file.empty() && !load_costs(cl.costs_file, &costs, &err, &unmeasured)) return fail(err);
  if (!unmeasured.empty())
    print_error("note: --costs " + cl.costs_file + " has no measurement of " + unmeasured +
                ": the A100 model's figures stand for them");
  ReplayOptions ro;
  if (!cl.costs_file.empty()) ro.costs = &costs;
  ro.capacity = cl.capacity;
  ro.curve_points = cl.plot.empty() ? 0 : 2000;
  ro.base = cl.base;
  ro.peak_detail = cl.peak_detail;
  if (!cl.max_key.empty()) return run_max(cl, ro, seqlens);
  std::vector<formats::Trace> traces;
  std::vector<std::string> warnings;
  if (!load_inputs(cl.inputs, seqlens, cl, &traces, &warnings)) return 2;
  const std::vector<Task> tasks = replay_tasks(traces, warnings, cl.policies);
  // Every input was skipped (each said why above): an empty table would read as an answer.
  if (tasks.empty()) return fail("nothing to replay: no input has an allocation event");
  return cl.fit ? run_fit(traces, tasks, cl, ro) : run_replays(traces, tasks, cl, ro);
}

// What was printed on stdout is the answer: one that could not be written whole (a full disk, a file size
// limit) fails, said on stderr, as fragless-trace does (Note [Output that could not be written], trace_tool.cpp).
int main(int argc, char** argv) {
  const int rc = run(argc, argv);
  if (std::fflush(stdout) != 0 || std::ferror(stdout))
    return fail(std::string("cannot write the output to stdout (") + std::strerror(errno) + ")");
  return rc;
}
