// The seed of a random or property test: FRAGLESS_SEED when set (CI runs the [seeded] tests once more with
// a new seed per run, tests/support/new_seed.sh, and prints it), else the test's own fixed seed. Each seeded test
// CAPTUREs its seed, so a failure names the run to replay: FRAGLESS_SEED=N fragless-tests "[seeded]".
#pragma once
#include <catch2/catch.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace fragless::test {

inline std::uint64_t test_seed(std::uint64_t fallback) {
  const char* s = std::getenv("FRAGLESS_SEED");
  if (!s || !*s) return fallback;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (errno != 0 || *end != '\0' || *s == '-') FAIL("FRAGLESS_SEED='" << s << "' is not a decimal number below 2^64");
  return v;
}

}  // namespace fragless::test
