#!/usr/bin/env bash
# The random and property tests ([seeded]) once more, with a new seed each run (their CTests above use the
# fixed seeds), so every CI run explores another draw. The seed is printed with the command that replays it.
# Usage: new_seed.sh FRAGLESS_TESTS   (FRAGLESS_SEED, when set, is used instead of a new one)
set -euo pipefail
tests="$1"
seed="${FRAGLESS_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
echo "FRAGLESS_SEED=$seed (a failure replays with: FRAGLESS_SEED=$seed $tests '[seeded]')"
FRAGLESS_SEED="$seed" "$tests" -w NoTests "[seeded]" || { echo "FAILED with FRAGLESS_SEED=$seed"; exit 1; }
