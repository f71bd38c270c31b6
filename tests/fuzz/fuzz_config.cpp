// libFuzzer: the FRAGLESS_CONF parser never crashes, and what it accepts it accepts again unchanged.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fragless/config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto r = fragless::parse_config(text);
  if (!r.ok && r.error.empty()) __builtin_trap();  // a refusal always says why
  if (r.ok) {
    auto again = fragless::parse_config(text);
    if (!again.ok || again.options.policy != r.options.policy || again.options.max_split_size != r.options.max_split_size)
      __builtin_trap();
  }
  return 0;
}
