#!/usr/bin/env bash
# The random and property tests ([seeded]) once more, with a new seed each run (their CTests use the fixed
# seeds), so that each run explores another draw. Run by hand: not yet a CTest, because new seeds still find
# the draws docs/RELIABILITY.md ("Seeds") lists as open. The seed is printed with the command that replays it.
# Usage: new_seed.sh FRAGLESS_TESTS   (FRAGLESS_SEED, when set, is used instead of a new one)
set -euo pipefail
tests="$1"
seed="${FRAGLESS_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
echo "FRAGLESS_SEED=$seed (a failure replays with: FRAGLESS_SEED=$seed $tests '[seeded]')"
FRAGLESS_SEED="$seed" "$tests" -w NoTests "[seeded]" || { echo "FAILED with FRAGLESS_SEED=$seed"; exit 1; }
