// fragless-config: checks a FRAGLESS_CONF string (argument, or the environment) and prints what it means;
// `--table` prints the options table as Markdown (the README's table is checked against it by a test).
#include <cstdio>
#include <cstring>
#include <string>

#include "fragless/config.h"

using namespace fragless;

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--table") == 0) {
    std::printf("| key | type | default | meaning |\n|---|---|---|---|\n");
    for (const auto& o : option_table())
      std::printf("| `%.*s` | %.*s | %.*s | %.*s |\n", static_cast<int>(o.key.size()), o.key.data(),
                  static_cast<int>(o.type.size()), o.type.data(), static_cast<int>(o.default_value.size()),
                  o.default_value.data(), static_cast<int>(o.meaning.size()), o.meaning.data());
    return 0;
  }
  if (argc > 1 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0)) {
    std::printf("usage: fragless-config [CONF | --table]\n  checks CONF (default: $FRAGLESS_CONF), a list of "
                "key:value separated by ','\n  --table  prints the keys as a Markdown table\nkeys:\n");
    for (const auto& o : option_table())
      std::printf("  %-30.*s %.*s (default %.*s)\n", static_cast<int>(o.key.size()), o.key.data(),
                  static_cast<int>(o.type.size()), o.type.data(), static_cast<int>(o.default_value.size()),
                  o.default_value.data());
    return 0;
  }
  const ConfigResult r = argc > 1 ? parse_config(argv[1]) : config_from_environment();
  if (!r.ok) {
    std::fprintf(stderr, "%s\n", r.error.c_str());
    return 2;
  }
  const Options& o = r.options;
  std::printf("policy: %s\ndriver: %s\n", policy_name(o.policy), driver_kind_name(o.driver));
  if (o.max_split_size == SIZE_MAX) std::printf("max_split_size: unlimited\n");
  else std::printf("max_split_size: %zu bytes\n", o.max_split_size);
  std::printf("max_non_split_rounding_size: %zu bytes\n", o.max_non_split_rounding_size);
  std::printf("garbage_collection_threshold: %g\nper_process_memory_fraction: %g\n", o.garbage_collection_threshold,
              o.per_process_memory_fraction);
  std::printf("roundup_power2_divisions:");
  for (auto d : o.roundup_power2_divisions) std::printf(" %zu", d);
  std::printf("\npage_size: %zu bytes\ncapacity: %zu bytes%s\n", o.page_size, o.capacity,
              o.capacity ? "" : " (driver default)");
  return 0;
}
