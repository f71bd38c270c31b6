// The command line of fragless-replay (cli.h).
#include "cli.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

#include "replay.h"
#include "trace_model.h"
#include "workload.h"
#include "zoo.h"

namespace fragless::replay {
namespace {

// A number written in decimal: digits with at most one point, and an optional exponent (no sign, hex,
// inf, nan or spaces, which strtod would also read).
bool decimal(const char* text) {
  const char* p = text;
  bool digits = false, point = false;
  for (; *p && *p != 'e' && *p != 'E'; ++p) {
    if (*p == '.' && !point) point = true;
    else if (*p >= '0' && *p <= '9') digits = true;
    else return false;
  }
  if (!digits) return false;
  if (!*p) return true;
  ++p;
  if (*p == '+' || *p == '-') ++p;
  if (!*p) return false;
  for (; *p; ++p)
    if (*p < '0' || *p > '9') return false;
  return true;
}

// A usage error prints what was wrong and where the options are listed, not the whole help: the error would
// scroll off the screen above eighty lines of it.
int usage(const char* msg) {
  if (msg) {
    std::fprintf(stderr, "fragless-replay: %s\n(fragless-replay --help lists every option, workload and key)\n", msg);
    return 2;
  }
  std::fprintf(stdout,
               "usage: fragless-replay [--policy classic,expandable,fragless] [--capacity-gib N] [--json]\n"
               "                       [--conf KEY:VALUE,...] [--jobs N] [--costs PROBE.json]\n"
               "                       [--plot FILE.png [--plot-x time|event|auto]] [--seqlen-file CSV]\n"
               "                       [--peak-detail] [--window FROM:TO] INPUT...\n"
               "       fragless-replay --fit [--fit-step GIB] [options] INPUT...\n"
               "       fragless-replay --max-batch | --max-of KEY --capacity-gib N [options] workload:...\n"
               "  INPUT: a fragless native trace, PyTorch memory snapshot pickle or RMM log CSV (detected from\n"
               "         content), or workload:NAME[:key=value,...]\n"
               "  --capacity-gib: the device's memory, at most 1024 (no GPU holds more); without it, 1024: unlimited. An\n"
               "         allocation that runs out of memory is a result, counted in the OOMs column and skipped\n"
               "  --plot: live/allocated/reserved over time per policy, drawn by gnuplot into a PNG (with --fit,\n"
               "         at each policy's fitted capacity; with --max-of, at its largest value); each point is the\n"
               "         largest value of its stretch of events, so no peak is lost; what the window began with\n"
               "         (allocations live before it, classic's cached segments) is drawn as already there.\n"
               "         FILE.gp writes the gnuplot script with its data instead (gnuplot FILE.gp draws it).\n"
               "         The file is replaced atomically (a temporary file beside it, renamed over it); a symbolic\n"
               "         link is followed to its target; an existing FIFO, device or socket is refused\n"
               "  --plot-x: the x axis: trace time, event (the index of each entry of the trace, every kind and\n"
               "         device counted, as in the replay's error messages; more than its 'events' column, which\n"
               "         counts what is replayed), or auto (default: time, unless the trace has none or its busy\n"
               "         part would be squeezed into a corner)\n"
               "  --fit: per input, device and policy, the smallest device capacity (a multiple of --fit-step,\n"
               "         default 0.25 GiB) from which every larger multiple of the step replays with no OOM: every\n"
               "         step from the answer up to where the policy runs as without a limit (classic's and\n"
               "         expandable's peak reserved without one, fragless's twice it) is replayed with zero OOMs\n"
               "         and one step below it with at least one (OOMs are not monotone in capacity: a smaller\n"
               "         capacity may fit too, with some between it and the answer failing). The capacity is\n"
               "         all the memory the allocator may use: a real GPU's CUDA context takes its share first.\n"
               "         A search with more than 10000 steps between peak live and that top is refused, naming\n"
               "         them: a larger --fit-step answers it\n"
               "  --max-batch: with --capacity-gib, a batch per workload and policy that replays with no OOM on\n"
               "         that device while one more does not (found by doubling, then bisection; memory is not\n"
               "         always monotone in a workload's size, so smaller values are not all replayed), and its\n"
               "         ratios to classic and expandable; --max-of KEY searches another numeric workload key\n"
               "         whose memory grows with it (max_seq, micro, tokens, max_batch, ...) the same way, up to\n"
               "         the largest value the workload accepts (a seed: up to 1e15, though a transformer workload\n"
               "         takes seeds in [0, 2^64)). The values probed do not depend on --jobs\n"
               "  --jobs: replays run at once (default: the number of cores)\n"
               "  --peak-detail: what reserved memory held when it first reached its peak: allocated blocks,\n"
               "         free blocks (in whole pages, which could be moved, and in pages shared with a live\n"
               "         block), idle handles (fragless's reserve of pages too), the small pool's part (a line under\n"
               "         each row; at_peak in --json);\n"
               "         and the page floor, the most pages holding allocated bytes at one moment: no policy\n"
               "         placing blocks as that one did and backing whole pages holds less (page_floor_bytes)\n"
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
               "          shareable_handles and on_oom are refused, and so is expandable_segments:False\n"
               "          without policy (it selects none)\n"
               "  --seqlen-file: sequence lengths for the workloads (a CSV column, see docs/USAGE.md)\n"
               "  --window: replay each input's events from fraction FROM to fraction TO of them (0.5:1 = the\n"
               "         second half): what was live at the window's start is allocated first (in the peaks, its\n"
               "         driver calls not counted), as for a snapshot that starts mid-run; after the first event\n"
               "         every policy starts from those blocks alone (from it, classic recreates the recorded cache\n"
               "         first, as for the whole trace)\n"
               "%s"
               "  ckpt-accum: transformer-train with checkpointing and gradient accumulation (ckpt=1,accum=4,\n"
               "        steps=12); every transformer key applies\n"
               "%s",
               fragless::replay::transformer_help().c_str(), fragless::replay::zoo_help().c_str());
  return 0;
}

// Note [Nothing in --conf is ignored]
// A key of --conf either changes what the replay does or is refused: `policy` (and expandable_segments:True
// without it, as in FRAGLESS_CONF) selects the policy, as --policy does (expandable_segments:False without
// it selects nothing, and is refused); the keys of a real device (the
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
// *given: the keys of the --conf options before this one; a key given again is an error, as it is within one
// string (parse_config), not a silent replacement.
bool apply_conf(const std::string& text, Options* base, std::optional<PolicyKind>* policy,
                std::vector<std::string>* given, std::string* error) {
  const auto cr = parse_config(text, *base);
  if (!cr.ok) {
    *error = config_error_from(cr.error, "--conf");
    return false;
  }
  bool policy_key = false, expandable_key = false;
  for (const auto& k : cr.keys) {
    if (std::find(given->begin(), given->end(), k) != given->end()) {
      *error = "--conf " + k + ": the key is given again by a second --conf (give each key once)";
      return false;
    }
    given->push_back(k);
    for (const auto& [key, why] : kConfRefused)
      if (k == key) {
        *error = "--conf " + k + ": not a replay setting (" + why + ")";
        return false;
      }
    policy_key |= k == "policy";
    expandable_key |= k == "expandable_segments";
  }
  // expandable_segments:False alone selects nothing: an allocator keeps its policy, and the replay runs every
  // policy unless told which, expandable among them.
  if (expandable_key && !cr.options.expandable_segments && !policy_key) {
    *error = "--conf expandable_segments:False: selects no policy in a replay, which runs classic, expandable and "
             "fragless unless --policy (or policy:) names some; leave it out, or name the policies";
    return false;
  }
  if (policy_key || (expandable_key && cr.options.policy == PolicyKind::expandable)) *policy = cr.options.policy;
  *base = cr.options;
  base->policy = Options{}.policy;  // selected per run
  return true;
}

// --plot FILE: its folder must exist and take a new file, checked before any replay runs (gnuplot would
// otherwise fail only at the end, and say little).
bool plot_path_ok(const std::string& path, std::string* error) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty()) {
    *error = "--plot needs a file name (FILE.png, or FILE.gp for the script), not ''";
    return false;
  }
  if (path.back() == '/' || fs::is_directory(path, ec)) {
    *error = "--plot " + path + ": is a directory; --plot takes a file name (FILE.png, or FILE.gp for the script)";
    return false;
  }
  // Its folder (the target's, a symbolic link followed) must exist and take a new file; a FIFO or device is
  // refused (Note [Writing an output file]).
  std::string target;
  if (!formats::output_target(path, &target, error)) {
    *error = "--plot " + *error;
    return false;
  }
  const std::string ext = fs::path(path).extension().string();
  if (ext != ".png" && ext != ".gp") {  // gnuplot draws a PNG whatever the name says
    *error = "--plot " + path + ": draws a PNG (FILE.png) or writes its gnuplot script (FILE.gp), not a '" +
             (ext.empty() ? std::string("file without an extension") : ext + " file") + "'";
    return false;
  }
  return true;
}

}  // namespace

bool plot_is_script(const std::string& path) { return path.size() > 3 && path.compare(path.size() - 3, 3, ".gp") == 0; }

std::optional<int> parse_command_line(int argc, char** argv, CommandLine* out) {
  CommandLine& cl = *out;
  cl.jobs = std::max(1u, std::thread::hardware_concurrency());
  bool fit_step_given = false, policy_given = false, plot_x_given = false;
  std::optional<PolicyKind> conf_policy;
  std::vector<std::string> conf_keys;  // every key of every --conf so far
  std::vector<std::string> valued;     // the options with a value given so far (each once; --conf may repeat)
  bool plot_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    // An option's second value would silently replace its first: each is given once (--conf may repeat,
    // its keys are checked one by one instead).
    static const char* const kValued[] = {"--max-of", "--fit-step", "--jobs", "--policy", "--capacity-gib",
                                          "--plot", "--plot-x", "--window", "--seqlen-file", "--costs"};
    if (has_value && std::any_of(std::begin(kValued), std::end(kValued), [&](const char* o) { return a == o; })) {
      if (std::find(valued.begin(), valued.end(), a) != valued.end())
        return usage((a + " is given twice: give it once").c_str());
      valued.push_back(a);
    }
    if (a == "--json") cl.json = true;
    else if (a == "-h" || a == "--help") return usage(nullptr);
    else if (a == "--fit") cl.fit = true;
    else if (a == "--peak-detail") cl.peak_detail = true;
    else if (a == "--max-batch") {
      if (!cl.max_key.empty() && cl.max_key != "batch") return usage("--max-batch and --max-of name different keys");
      cl.max_key = "batch";
    } else if (a == "--max-of" && has_value) {
      const std::string k = argv[++i];
      if (k.empty()) return usage("--max-of needs a workload key (batch, max_seq, ...)");
      if (!cl.max_key.empty() && cl.max_key != k) return usage("--max-batch and --max-of name different keys");
      cl.max_key = k;
    } else if (a == "--fit-step" && has_value) {
      char* end = nullptr;
      const double g = decimal(argv[++i]) ? std::strtod(argv[i], &end) : 0.0;
      if ((end && *end) || !(g >= 1.0 / 1024) || g > 1024)
        return usage(("--fit-step needs a number of GiB in [1/1024, 1024], not '" + std::string(argv[i]) + "'").c_str());
      cl.fit_step = static_cast<std::uint64_t>(g * (1ull << 30));
      fit_step_given = true;
    } else if (a == "--jobs" && has_value) {
      const std::string v = argv[++i];
      const long n = !v.empty() && v.size() <= 4 && v.find_first_not_of("0123456789") == std::string::npos
                         ? std::strtol(v.c_str(), nullptr, 10) : 0;
      if (n < 1 || n > 1024) return usage(("--jobs needs a whole number in [1, 1024], not '" + v + "'").c_str());
      cl.jobs = static_cast<unsigned>(n);
    } else if (a == "--policy" && has_value) {
      cl.policies.clear();
      policy_given = true;
      const std::string list = argv[++i];
      if (list.empty()) return usage("--policy needs at least one policy");
      // Every name between commas counts: an empty one ('classic,' or 'a,,b') is an error, as in --conf.
      for (std::size_t at = 0;;) {
        const std::size_t comma = list.find(',', at);
        const std::string p = list.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
        if (p.empty()) return usage(("--policy '" + list + "': an empty policy name between commas").c_str());
        const auto kind = policy_from_name(p);
        if (!kind) return usage(("unknown policy '" + p + "' (classic, expandable, fragless)").c_str());
        if (std::find(cl.policies.begin(), cl.policies.end(), *kind) != cl.policies.end())
          return usage(("--policy '" + list + "': policy " + p + " is named twice").c_str());
        cl.policies.push_back(*kind);
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
    } else if (a == "--capacity-gib" && has_value) {
      char* end = nullptr;
      const double g = decimal(argv[++i]) ? std::strtod(argv[i], &end) : 0.0;
      // At most the device that stands for unlimited memory (kUnlimitedCapacity, 1 TiB): no GPU holds more, and the
      // capacity bounds what a trace's allocations make the replay model in host memory page by page (a three-line
      // log of a 900 TB allocation, on a capacity that took it, had the replay killed at 20 GB).
      if ((end && *end) || !(g > 0) || g > static_cast<double>(kUnlimitedCapacity >> 30))
        return usage(("--capacity-gib needs a number of GiB greater than 0 and at most " +
                      std::to_string(kUnlimitedCapacity >> 30) + " (the replay's largest device), not '" +
                      std::string(argv[i]) + "'").c_str());
      cl.capacity = static_cast<std::uint64_t>(g * (1ull << 30));
      if (cl.capacity == 0)  // 0 is how the replay says "unlimited"
        return usage(("--capacity-gib " + std::string(argv[i]) + ": less than one byte").c_str());
    } else if (a == "--plot" && has_value) {
      cl.plot = argv[++i];
      plot_given = true;
    } else if (a == "--plot-x" && has_value) {
      const std::string v = argv[++i];
      plot_x_given = true;
      if (v == "time") cl.plot_x = PlotX::time;
      else if (v == "event") cl.plot_x = PlotX::event;
      else if (v == "auto") cl.plot_x = PlotX::auto_;
      else return usage(("--plot-x: expected time, event or auto, got '" + v + "'").c_str());
    } else if (a == "--window" && has_value) {
      cl.window_text = argv[++i];
      std::string err;
      if (!parse_window(cl.window_text, &cl.window, &err)) return usage(err.c_str());
    } else if (a == "--seqlen-file" && has_value) {
      cl.seqlen_file = argv[++i];
    } else if (a == "--costs" && has_value) {
      cl.costs_file = argv[++i];
    } else if (a == "--conf" && has_value) {
      std::string err;
      if (!apply_conf(argv[++i], &cl.base, &conf_policy, &conf_keys, &err)) return usage(err.c_str());
    } else if (a == "--policy" || a == "--capacity-gib" || a == "--plot" || a == "--seqlen-file" || a == "--conf" ||
               a == "--max-of" || a == "--fit-step" || a == "--jobs" || a == "--plot-x" || a == "--costs" || a == "--window") {
      return usage(("missing value after " + a).c_str());
    } else if (!a.empty() && a[0] == '-') {
      return usage(("unknown option " + a).c_str());
    } else {
      cl.inputs.push_back(a);
    }
  }
  if (cl.inputs.empty()) return usage("no input");
  if (conf_policy) {
    if (policy_given && (cl.policies.size() != 1 || cl.policies[0] != *conf_policy))
      return usage(("--conf policy:" + std::string(policy_name(*conf_policy)) + " and --policy name different policies").c_str());
    cl.policies = {*conf_policy};
  }
  if (cl.peak_detail && (cl.fit || !cl.max_key.empty()))
    return usage("--peak-detail describes one replay's peak: not with --fit, --max-batch or --max-of");
  if (!cl.window.whole() && !cl.max_key.empty())
    return usage("--window cuts the inputs' traces: not with --max-batch or --max-of, which generate their own");
  if (cl.fit && !cl.max_key.empty()) return usage("--fit finds a capacity and --max-of a value: ask one at a time");
  if (cl.fit && cl.capacity) return usage("--fit searches the capacity: drop --capacity-gib");
  if (fit_step_given && !cl.fit) return usage("--fit-step applies to --fit");
  if (plot_x_given && cl.plot.empty()) return usage("--plot-x applies to --plot");
  // What the inputs are is said before what the command lacks: a trace cannot be searched at any capacity.
  if (!cl.max_key.empty())
    for (const auto& in : cl.inputs) {
      long long lo, hi;
      std::string err;
      if (!workload_key_range(in, cl.max_key, &lo, &hi, &err)) return std::fprintf(stderr, "fragless-replay: %s\n", err.c_str()), 2;
    }
  if (!cl.max_key.empty() && !cl.capacity) return usage("--max-batch / --max-of need the device's size (--capacity-gib N)");
  if (!cl.seqlen_file.empty() && std::none_of(cl.inputs.begin(), cl.inputs.end(), draws_seqlen_file))
    return usage("--seqlen-file: no input draws its lengths from it (it applies to workload:transformer-train, "
                 "transformer-infer and ckpt-accum without a seqlen= key)");
  if (plot_given) {
    std::string err;
    if (!plot_path_ok(cl.plot, &err)) return usage(err.c_str());
    // Note [An output never replaces an input]: the traces, and the files options read.
    std::vector<std::string> read = cl.inputs;
    for (const std::string* f : {&cl.seqlen_file, &cl.costs_file})
      if (!f->empty()) read.push_back(*f);
    if (!formats::output_spares_inputs(cl.plot, read, &err)) return usage(("--plot " + err).c_str());
  }
  if (!cl.plot.empty() && !plot_is_script(cl.plot) && std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    return usage("--plot needs gnuplot on the PATH (Debian: apt-get install gnuplot-nox)");
  return std::nullopt;
}

}  // namespace fragless::replay
