// The outputs of fragless-replay: the text tables, the --json documents and the --plot, for each mode
// (modes.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "modes.h"

namespace fragless::replay {

std::string short_name(const std::string& path);  // the file's name, cut to fit a 44-column cell
double mib(std::int64_t bytes);
double gib(std::uint64_t bytes);
// "fragless-replay: MESSAGE" on stderr; fail returns the exit status of bad input (2).
void print_error(const std::string& message);
int fail(const std::string& message);

// The text tables, with the lines under them (table.cpp).
void print_replay_table(const std::vector<ReplayResult>& results);
void print_fit_table(const std::vector<formats::Trace>& traces, const std::vector<Task>& tasks,
                     const Searches<FitResult>& fits, std::uint64_t step);
void print_max_table(const std::vector<std::string>& inputs, const std::vector<MaxTask>& tasks,
                     const Searches<MaxResult>& found, const std::string& key, std::uint64_t capacity);

// The --json documents (json_output.cpp), one result a line
// (Note [The precision of --json numbers]).
void print_replay_json(const std::vector<ReplayResult>& results);
void print_fit_json(const std::vector<formats::Trace>& traces, const std::vector<Task>& tasks,
                    const Searches<FitResult>& fits, std::uint64_t step);
void print_max_json(const std::vector<std::string>& inputs, const std::vector<MaxTask>& tasks,
                    const Searches<MaxResult>& found, const std::string& key, std::uint64_t capacity);

// --plot: live, allocated and reserved over time per input, device and policy, drawn by gnuplot (plot.cpp).
// notes: per result, text added to its policy's legend entries (the fitted capacity, the largest value);
// a result replayed on a capacity also gets that capacity as a dotted line in its colour. False with
// *error when the PNG (or the FILE.gp script) cannot be written.
bool draw_plot(const std::string& path, const std::vector<ReplayResult>& results,
               const std::vector<std::string>& notes, PlotX mode, std::string* error);

}  // namespace fragless::replay
