// The command line of fragless-replay: its options, parsed and checked into one struct, and its usage text.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fragless/config.h"
#include "window.h"

namespace fragless::replay {

// --plot-x: the x axis of the plot's panels.
enum class PlotX { auto_, time, event };

struct CommandLine {
  std::vector<PolicyKind> policies = {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless};
  std::uint64_t capacity = 0;           // --capacity-gib in bytes; 0 = unlimited
  std::uint64_t fit_step = 1ull << 28;  // --fit-step in bytes
  bool json = false, fit = false;
  bool peak_detail = false;             // --peak-detail
  unsigned jobs = 1;                    // --jobs; default the number of cores
  PlotX plot_x = PlotX::auto_;
  std::string plot, seqlen_file, costs_file;
  Window window;                        // --window; whole by default
  std::string window_text;              // as given, for the inputs' names
  std::string max_key;                  // --max-batch (batch) or --max-of KEY; empty: no --max search
  Options base;                         // --conf, its policy left at the default (selected per run)
  std::vector<std::string> inputs;
};

// --plot FILE.gp writes the gnuplot script with its data instead of drawing the PNG.
bool plot_is_script(const std::string& path);

// Parses and checks argv into *out. nullopt: run; otherwise the exit status to end with (0 after --help;
// 2 after bad usage, the reason and the usage text on stderr).
std::optional<int> parse_command_line(int argc, char** argv, CommandLine* out);

}  // namespace fragless::replay
