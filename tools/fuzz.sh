#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for SECONDS (default 60), seeded
# from ../shared/data when it is beside the repository and from small generated samples otherwise.
# A crash stops the run with the reproducer saved under BUILD/crashes/; turn it into a regression test.
#   tools/fuzz.sh [SECONDS] [BUILD_DIR]
set -euo pipefail
secs="${1:-60}"
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${2:-$root/build-fuzz}"
mkdir -p "$build"
build="$(cd "$build" && pwd)"
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is not installed (apt-get install clang libclang-rt-14-dev)"; exit 77; }
. "$root/tools/progress.sh"
quiet_step "fuzz.sh: configure" "$build/configure.log" \
  cmake -S "$root" -B "$build" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
  -DFRAGLESS_FUZZ=ON -DFRAGLESS_BUILD_TESTS=OFF -DFRAGLESS_BUILD_BENCH=OFF
quiet_step "fuzz.sh: build" "$build/build.log" cmake --build "$build" -j"$(nproc)"
corpus="$build/corpus"
mkdir -p "$corpus"/{config,pickle,csv,native,any,engine} "$build/crashes"
printf 'policy:fragless,max_split_size_mb:256' >"$corpus/config/a"
printf 'roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:True' >"$corpus/config/b"
printf 'garbage_collection_threshold:0.6,per_process_memory_fraction:0.5,trace:/tmp/x-%%p' >"$corpus/config/c"
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.000001,allocate,0x1000,512,0\n1,00:00:00.000002,free,0x1000,512,0\n' >"$corpus/csv/a"
printf '\x00\x01\x02\x03\x04\x05\x06\x07\x08' >"$corpus/engine/a"
data="$root/../shared/data/traces/torch"
if [ -d "$data" ]; then
  # The smallest real snapshots (the fuzzer truncates larger inputs anyway).
  for f in $(ls -S "$data"/*.pickle | tail -n 4); do cp "$f" "$corpus/pickle/"; cp "$f" "$corpus/any/"; done
fi
"$build/bin/fuzz-native" -runs=0 >/dev/null 2>&1 || true
cp "$corpus/csv/a" "$corpus/any/"
run() {
  local target="$1" dir="$2" rc=0
  echo "fuzz.sh: $target for ${secs}s"
  (cd "$build/crashes" && "$build/bin/$target" -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 "$corpus/$dir" >"$build/$target.log" 2>&1) || rc=$?
  grep -E "stat::number_of_executed_units|ERROR|SUMMARY|Done" "$build/$target.log" || true
  if [ "$rc" -ne 0 ] || ls "$build/crashes"/crash-* "$build/crashes"/timeout-* "$build/crashes"/oom-* >/dev/null 2>&1; then
    echo "fuzz.sh: $target failed (exit $rc); log: $build/$target.log; inputs:"; ls "$build/crashes"; tail -30 "$build/$target.log"
    exit 1
  fi
}
run fuzz-config config
run fuzz-pickle pickle
run fuzz-csv csv
run fuzz-native native
run fuzz-any-trace any
run fuzz-engine engine
echo "fuzz.sh: no crashes"
