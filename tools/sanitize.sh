#!/usr/bin/env bash
# Builds a sanitizer tree and runs tests in it.
#   tools/sanitize.sh asan [BUILD_DIR]   the whole test suite under AddressSanitizer + UndefinedBehaviorSanitizer
#   tools/sanitize.sh asan-build [BUILD_DIR]           the same tree, built only
#   tools/sanitize.sh asan-test [BUILD_DIR] fast|sweeps in a built tree: the fast tier, or the fault sweeps
#   tools/sanitize.sh tsan [BUILD_DIR]   the threaded tests under ThreadSanitizer: concurrency, conformance (streams,
#                                        events), tracer, and the cuda driver's lock and context tests on the double
# (CTest runs asan as the three steps, so that the fast tier and the sweeps run side by side.)
set -euo pipefail
kind="${1:?asan, asan-build, asan-test or tsan}"
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${2:-$root/build-$kind}"
mkdir -p "$build"
build="$(cd "$build" && pwd)"
jobs="${FRAGLESS_SANITIZE_JOBS:-2}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export FRAGLESS_WATCHDOG_S=900
# Note [Sanitizer trees at -O1 -g1]: the sanitizer trees build at -O1 with line tables only (-g1), as the
# sanitizers' own documentation advises, not at the plain tree's -O2 -g: a report still names every frame's
# file and line, and a test TU compiles in a third of the CPU time (measured on test_cuda_path.cpp under
# ASan: 24 s of CPU at -O2 -g, 9 s at -O1 -g1), which is most of CI's second tier.
san_flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
           "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG")
. "$root/tools/progress.sh"
asan_build() {
  quiet_step "sanitize.sh asan: configure" "$build/configure.log" \
    cmake -S "$root" -B "$build" "${san_flags[@]}" -DFRAGLESS_SANITIZE=ON -DFRAGLESS_NESTED=ON -DFRAGLESS_BUILD_BENCH=ON
  quiet_step "sanitize.sh asan: build" "$build/build.log" cmake --build "$build" -j"$jobs"
}
asan_test() {  # fast | sweeps
  # LD_PRELOAD puts the interposer before the ASan runtime: allowed for that test. Python is not built
  # with ASan, so the tests that load libfragless into an interpreter (the Python helper, the viewer rules
  # on the engine's snapshots, the PyTorch API) cannot check it here: they run in the plain build.
  export ASAN_OPTIONS="detect_leaks=1:verify_asan_link_order=0:abort_on_error=1"
  if [ "$1" = fast ]; then
    echo "sanitize.sh: the tests run by a Python interpreter are left out here (an uninstrumented interpreter cannot load an ASan library), and so is the docs' check (it replays every table of docs/RESULTS.md, which the plain build checks); they run in the plain build"
    # A program's exit stops the background workers before LeakSanitizer looks (capi.cpp, preload.cpp): a
    # worker thread still alive at exit made LeakSanitizer's own tracer die of signal 11 reading the thread's
    # dynamic TLS (seen on the C ABI program driven by dlopen, about one run in eight, and on every run of the
    # LD_PRELOAD program once its worker started).
    ctest --test-dir "$build" -j"$jobs" --output-on-failure -E "python|viewer rules|^docs:" -LE slow
  else
    # The fault sweeps take minutes each: verbose, so their progress lines show as they come.
    ctest --test-dir "$build" -j"$jobs" --output-on-failure -L slow --verbose
  fi
}
case "$kind" in
  asan)
    asan_build
    asan_test fast
    asan_test sweeps
    ;;
  asan-build) asan_build ;;
  asan-test)
    [ -f "$build/CMakeCache.txt" ] || { echo "sanitize.sh: $build is not built (sanitize.sh asan-build first)"; exit 2; }
    asan_test "${3:?fast or sweeps}"
    ;;
  tsan)
    quiet_step "sanitize.sh tsan: configure" "$build/configure.log" \
      cmake -S "$root" -B "$build" "${san_flags[@]}" -DFRAGLESS_TSAN=ON -DFRAGLESS_NESTED=ON -DFRAGLESS_BUILD_BENCH=ON
    quiet_step "sanitize.sh tsan: build" "$build/build.log" cmake --build "$build" -j"$jobs" --target fragless-tests
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
    "$build/bin/fragless-tests" -w NoTests --durations yes "[concurrency],[tracer],[conformance],[cuda][lock],[contexts]"
    ;;
  *) echo "usage: sanitize.sh asan|asan-build|tsan [BUILD_DIR], sanitize.sh asan-test BUILD_DIR fast|sweeps"; exit 2 ;;
esac
