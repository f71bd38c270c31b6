// The start of a seeded test run once per policy: the policy (a Catch2 generator, so the macro stands in
// the TEST_CASE itself), the test's seed (seed.h) and a CAPTURE of both, so a failure names the run to replay.
#pragma once
#include "helpers.h"
#include "seed.h"

#define FRAGLESS_SEEDED_POLICIES(policy, seed, fallback)                                                \
  const ::fragless::PolicyKind policy = GENERATE(::fragless::PolicyKind::classic,                       \
                                                 ::fragless::PolicyKind::expandable,                    \
                                                 ::fragless::PolicyKind::fragless);                     \
  const std::uint64_t seed = ::fragless::test::test_seed(fallback);                                    \
  CAPTURE(::fragless::test::name(policy), seed)
