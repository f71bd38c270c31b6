#!/usr/bin/env bash
# fragless-bench-preload under the interposer, on the libcuda double and the runtime double of the tests:
#   bash bench/run_preload.sh [BUILD_DIR] [benchmark options...]
set -euo pipefail
build="${1:-build}"
[ $# -gt 0 ] && shift
for f in "$build/bin/fragless-bench-preload" "$build/lib/libfragless_preload.so" "$build/lib/libfragless_fakecuda.so"; do
  [ -e "$f" ] || { echo "run_preload.sh: $f is missing (build with the CUDA headers present)" >&2; exit 2; }
done
exec env LD_PRELOAD="$build/lib/libfragless_preload.so" FRAGLESS_LIBCUDA="$build/lib/libfragless_fakecuda.so" \
  "$build/bin/fragless-bench-preload" "$@"
