// fragless-config: checks a FRAGLESS_CONF string (argument, or the environment) and prints what it means
// (every key, with the value in effect: set by the string, or its default);
// `--table` prints the options table as Markdown (the README's table is checked against it by a test).
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fragless/config.h"
#include "fragless/host_driver.h"
#include "fragless/sim_driver.h"

using namespace fragless;

namespace {

std::string number(double d) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", d + 0.0);  // + 0.0: never "-0"
  return b;
}

std::string mib(std::size_t bytes) { return std::to_string(bytes >> 20); }

const char* boolean(bool b) { return b ? "True" : "False"; }

// roundup_power2_divisions as the grammar writes it: one number when every interval has the same, else
// the list of the intervals [1 MB, 2 MB, 4 MB, ..., > the last] (0 = off).
std::string divisions(const Options& o) {
  const auto& d = o.roundup_power2_divisions;
  if (std::all_of(d.begin(), d.end(), [&](std::size_t x) { return x == d[0]; }))
    return std::to_string(d[0]);
  std::string s = "[";
  for (std::size_t j = 0; j + 1 < d.size(); ++j) s += std::to_string(std::size_t{1} << j) + ":" + std::to_string(d[j]) + ",";
  return s + ">:" + std::to_string(d.back()) + "]";
}

// The value of one key in effect in `o`, as the key's value is written; "" for a key not known here.
std::string value_of(const std::string& key, const Options& o) {
  if (key == "policy") return policy_name(o.policy);
  if (key == "expandable_segments") return boolean(o.expandable_segments);
  if (key == "max_split_size_mb") return o.max_split_size == SIZE_MAX ? "unlimited" : mib(o.max_split_size);
  if (key == "max_non_split_rounding_mb") return mib(o.max_non_split_rounding_size);
  if (key == "roundup_power2_divisions") return divisions(o);
  if (key == "garbage_collection_threshold") return number(o.garbage_collection_threshold);
  if (key == "per_process_memory_fraction") return number(o.per_process_memory_fraction);
  if (key == "driver") return driver_kind_name(o.driver);
  if (key == "page_size_mb") return mib(o.page_size);
  if (key == "capacity_mb") {
    if (o.capacity) return mib(o.capacity);
    // The drivers' own defaults (HostDriverOptions, SimDriverOptions), which capacity 0 leaves in place.
    if (o.driver == DriverKind::host) return mib(HostDriverOptions{}.capacity);
    if (o.driver == DriverKind::sim) return mib(SimDriverOptions{}.capacity);
    return "the device's memory";
  }
  if (key == "on_oom") return "throw";
  if (key == "peer_access") return boolean(o.peer_access);
  if (key == "shareable_handles") return o.fabric_handles ? "fabric" : boolean(o.shareable_handles);
  if (key == "handles") {
    switch (o.handle_shape) {
      case HandleShape::pages: return "pages";
      case HandleShape::ends: return "ends";
      case HandleShape::whole: return "whole";
      case HandleShape::cells: return "cells";
    }
  }
  if (key == "handle_max_mb") return mib(o.handle_max);
  if (key == "chunk_size_mb") return mib(o.chunk_size);
  if (key == "reserve_slack") return number(o.reserve_slack);
  if (key == "lend_pages") return boolean(o.lend_pages);
  if (key == "lend_across_streams") return boolean(o.lend_across_streams);
  if (key == "small_in_remnants") return boolean(o.small_in_remnants);
  if (key == "growth_reserve") return boolean(o.growth_reserve);
  if (key == "background") return o.background == BackgroundMode::thread ? "True" : o.background == BackgroundMode::off ? "False" : "manual";
  if (key == "trace") return o.trace.empty() ? "off" : o.trace;
  return {};
}

}  // namespace

int run(int argc, char** argv) {
  // --help anywhere is the usage; --table takes nothing with it: a word beside it would otherwise be ignored.
  bool help = false;
  for (int i = 1; i < argc; ++i) help |= std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0;
  for (int i = 1; i < argc && !help; ++i)
    if (std::strcmp(argv[i], "--table") == 0 && argc > 2) {
      std::fprintf(stderr, "fragless-config: --table takes nothing else (got %d arguments): give it alone, or a "
                   "configuration string alone\n", argc - 1);
      return 2;
    }
  if (argc > 1 && std::strcmp(argv[1], "--table") == 0) {
    std::printf("| key | type | default | meaning |\n|---|---|---|---|\n");
    for (const auto& o : option_table())
      std::printf("| `%.*s` | %.*s | %.*s | %.*s |\n", static_cast<int>(o.key.size()), o.key.data(),
                  static_cast<int>(o.type.size()), o.type.data(), static_cast<int>(o.default_value.size()),
                  o.default_value.data(), static_cast<int>(o.meaning.size()), o.meaning.data());
    return 0;
  }
  if (help) {
    std::printf("usage: fragless-config [CONF | --table]\n  checks CONF (default: $FRAGLESS_CONF), a list of "
                "key:value separated by ',' (each key once),\n  and prints every key with the value in effect, marking "
                "'(default)' the keys CONF does not set\n  --table  prints the keys as a Markdown table\nkeys:\n");
    for (const auto& o : option_table())
      std::printf("  %-30.*s %.*s (default %.*s)\n", static_cast<int>(o.key.size()), o.key.data(),
                  static_cast<int>(o.type.size()), o.type.data(), static_cast<int>(o.default_value.size()),
                  o.default_value.data());
    return 0;
  }
  if (argc > 2) {  // a second string would otherwise be ignored (quote a string with spaces)
    std::fprintf(stderr, "fragless-config: one configuration string at a time, got %d (quote it: \"a:1, b:2\")\n",
                 argc - 1);
    return 2;
  }
  const ConfigResult r = argc > 1 ? parse_allocator_config(argv[1]) : config_from_environment();
  if (!r.ok) {  // the error names FRAGLESS_CONF, which is right only when the string came from it
    std::fprintf(stderr, "%s\n", (argc > 1 ? config_error_from(r.error, "fragless-config") : r.error).c_str());
    return 2;
  }
  const Options& o = r.options;
  auto given = [&](std::string_view k) { return std::find(r.keys.begin(), r.keys.end(), k) != r.keys.end(); };
  // Every key of the table, in its order, with the value in effect in the key's own units: what the string
  // set, and the default of every other key (marked so).
  for (const auto& row : option_table()) {
    const std::string key(row.key);
    const std::string v = value_of(key, o);
    if (v.empty()) {  // a key this tool cannot show: a new row of the table needs a line in value_of()
      std::fprintf(stderr, "fragless-config: internal error: no way to show key '%s'\n", key.c_str());
      return 3;
    }
    // Remarks after the value: where it came from, and what it means here.
    std::vector<std::string> remarks;
    if ((key == "roundup_power2_divisions" && v == "0") || (key == "garbage_collection_threshold" && v == "0"))
      remarks.push_back("off");
    if (given(key)) {
      // (A key that does nothing under this policy or driver was refused: Note [Keys that do nothing].)
    } else if (key == "policy" && given("expandable_segments") && o.policy == PolicyKind::expandable) {
      remarks.push_back("from expandable_segments:True");
    } else if (key == "capacity_mb" && o.driver != DriverKind::cuda) {
      remarks.push_back(std::string("default of the ") + driver_kind_name(o.driver) + " driver");
    } else {
      remarks.push_back("default");
    }
    // A key this configuration does not use is not in effect: setting it would be refused (Note [Keys that do
    // nothing]), so its default is shown as unused, with what it configures.
    if (!given(key) && row.applies)
      if (const char* what = row.applies(o)) remarks.push_back(std::string("not used here: it configures ") + what);
    std::string note;
    for (const auto& r : remarks) note += (note.empty() ? " (" : "; ") + r;
    if (!note.empty()) note += ")";
    std::printf("%s: %s%s\n", key.c_str(), v.c_str(), note.c_str());
  }
  return 0;
}

// What was printed on stdout is the answer: one that could not be written whole fails, said on stderr, as
// fragless-trace does (Note [Output that could not be written], trace_tool.cpp).
int main(int argc, char** argv) {
  const int rc = run(argc, argv);
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "fragless-config: cannot write the output to stdout (%s)\n", std::strerror(errno));
    return 2;
  }
  return rc;
}
