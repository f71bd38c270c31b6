#!/usr/bin/env bash
# Planted defects the fast test tier must catch. Each tools/mutants/NN-NAME.patch is one small defect (its
# first line says which). The working tree (the files git tracks or would track) is copied to a throwaway
# folder outside it; the copy is built there and must pass the fast tier as it is; then, one defect at a time,
# the defect is applied to the copy, the copy is rebuilt (incrementally: one source file changed), the fast
# tier runs until its first failing test, and the defect is taken out again. A defect no test catches is a
# hole in the suite.
#
#   tools/mutants.sh [--all] [--no-baseline] [NAME...]
#     NAME           only the defects whose file names contain NAME (default: every one)
#     --all          run the whole tier under each defect and name every test that fails (slower)
#     --no-baseline  do not first check that the copy without a defect passes (a copy checked before)
#   FRAGLESS_MUTANTS_DIR  where the copy and its build live (default ${TMPDIR:-/tmp}/fragless-mutants; kept,
#                         so the next run builds incrementally); FRAGLESS_MUTANTS_JOBS (default 2)
#
# The fast tier is `ctest -LE slow` where tests are labelled slow, else the suite without the sanitizer, fuzz,
# GPU-bundle and fault-sweep tests. Prints, for each defect, the tests that caught it, then
# "caught N of M in T". Exit status: 0 when every defect was caught, 1 when one was missed, 2 when a defect
# no longer applies or does not build (update its patch), 3 when the copy fails without any defect.
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="${FRAGLESS_MUTANTS_DIR:-${TMPDIR:-/tmp}/fragless-mutants}"
jobs="${FRAGLESS_MUTANTS_JOBS:-2}"
stop=(--stop-on-failure)
baseline=1
names=()
for arg in "$@"; do
  case "$arg" in
    --all) stop=() ;;
    --no-baseline) baseline=0 ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "mutants.sh: unknown option $arg (see --help)"; exit 2 ;;
    *) names+=("$arg") ;;
  esac
done
mkdir -p "$work"
work="$(cd "$work" && pwd)"
case "$work/" in "$src/"*) echo "mutants.sh: $work is inside the tree; the copy must be outside it"; exit 2 ;; esac
tree="$work/src"
build="$work/build"
log="$work/log"
mkdir -p "$tree" "$log"
t0=$(date +%s)
elapsed() { local s=$(( $(date +%s) - $1 )); echo "$((s / 60)) min $((s % 60)) s"; }

# The copy: files whose content differs from the tree's are copied (with a new time, so they rebuild); the
# others keep theirs, so an earlier copy builds incrementally, and a defect left behind by an interrupted run
# is overwritten.
echo "mutants.sh: copying $src to $tree"
(cd "$src" && git ls-files -z --cached --others --exclude-standard) | while IFS= read -r -d '' f; do
  [ -f "$src/$f" ] || continue
  if ! cmp -s "$src/$f" "$tree/$f"; then
    mkdir -p "$tree/$(dirname "$f")"
    cp "$src/$f" "$tree/$f"
  fi
done

launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
build_copy() {  # build_copy LOG: configure (once) and build; false when the build fails
  { [ -f "$build/CMakeCache.txt" ] || cmake -S "$tree" -B "$build" "${launcher[@]}"; } >"$1" 2>&1 &&
    cmake --build "$build" -j"$jobs" >>"$1" 2>&1
}
echo "mutants.sh: building the copy in $build"
build_copy "$log/build.txt" || { echo "mutants.sh: the copy does not build (see $log/build.txt)"; tail -20 "$log/build.txt"; exit 3; }

tier=(-LE slow)
if ! ctest --test-dir "$build" -N -L slow | grep -q "Total Tests: [1-9]"; then
  tier=(-E "sanitizers|fuzz smoke|gpu bundle|gpu check|fault sweep")
fi
echo "mutants.sh: the fast tier is ctest ${tier[*]}"
run_tier() {  # run_tier LOG [ctest options]: the tier in declaration order (unit tests first); failures listed
  rm -f "$build/Testing/Temporary/CTestCostData.txt" "$build/Testing/Temporary/LastTestsFailed.log"
  local out="$1"; shift
  ctest --test-dir "$build" "${tier[@]}" -j"$jobs" --timeout 900 "$@" >"$out" 2>&1 || true
  [ -f "$build/Testing/Temporary/LastTestsFailed.log" ] && sed 's/^[0-9]*://' "$build/Testing/Temporary/LastTestsFailed.log"
  return 0
}

if [ "$baseline" = 1 ]; then
  t=$(date +%s)
  failed=$(run_tier "$log/baseline.txt")
  if [ -n "$failed" ]; then
    echo "mutants.sh: the copy fails its fast tier with no defect planted (see $log/baseline.txt):"
    echo "$failed" | sed 's/^/  /'
    exit 3
  fi
  echo "mutants.sh: the copy passes its fast tier ($(elapsed "$t"))"
fi

caught=0 total=0 broken=0
summary=()
for patch in "$src"/tools/mutants/*.patch; do
  name="$(basename "$patch" .patch)"
  if [ "${#names[@]}" -gt 0 ]; then
    want=0
    for n in "${names[@]}"; do [[ "$name" == *"$n"* ]] && want=1; done
    [ "$want" = 1 ] || continue
  fi
  total=$((total + 1))
  t=$(date +%s)
  echo
  echo "== $name: $(head -n 1 "$patch" | sed 's/^Planted defect: //')"
  if ! patch -d "$tree" -p1 -F0 --dry-run --forward -s <"$patch" >/dev/null 2>&1; then
    echo "   DOES NOT APPLY: the code it changes has moved; update $patch"
    broken=$((broken + 1)); summary+=("$name: does not apply"); continue
  fi
  patch -d "$tree" -p1 -F0 --forward -s --no-backup-if-mismatch <"$patch"
  if ! build_copy "$log/$name.build.txt"; then
    echo "   DOES NOT BUILD (see $log/$name.build.txt)"
    broken=$((broken + 1)); summary+=("$name: does not build")
  else
    failed=$(run_tier "$log/$name.txt" "${stop[@]}")
    if [ -n "$failed" ]; then
      caught=$((caught + 1))
      echo "   caught in $(elapsed "$t") by:"
      echo "$failed" | sed 's/^/     /'
      first=$(head -n 1 <<<"$failed")
      more=$(( $(wc -l <<<"$failed") - 1 ))
      if [ "$more" -gt 0 ]; then summary+=("$name: caught by $first, and $more more"); else summary+=("$name: caught by $first"); fi
    else
      echo "   MISSED: the fast tier passes with this defect ($(elapsed "$t"))"
      summary+=("$name: MISSED")
    fi
  fi
  patch -d "$tree" -p1 -F0 -R -s --no-backup-if-mismatch <"$patch"
done

echo
echo "mutants.sh: summary"
for line in "${summary[@]}"; do echo "  $line"; done
echo "mutants.sh: caught $caught of $total in $(elapsed "$t0") (logs in $log)"
[ "$broken" -eq 0 ] || exit 2
[ "$caught" -eq "$total" ] || exit 1
