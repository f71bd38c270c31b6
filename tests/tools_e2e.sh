#!/usr/bin/env bash
# End-to-end checks of the command-line tools: conversions between every pair of formats, the replay's
# table, JSON and plot, and clear errors (exit code 2) on bad input. Usage: tools_e2e.sh BIN_DIR
set -u
bin="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failures=0
check() {  # check DESCRIPTION COMMAND...: the command must succeed
  local what="$1"; shift
  if "$@" >"$work/out" 2>"$work/err"; then echo "ok: $what"; else echo "FAIL: $what"; cat "$work/err"; failures=$((failures + 1)); fi
}
check_error() {  # check_error DESCRIPTION EXPECTED_TEXT COMMAND...: exit code 2 and the text on stderr
  local what="$1" text="$2"; shift 2
  check_exit 2 "$what" "$text" "$@"
}
check_exit() {  # check_exit CODE DESCRIPTION EXPECTED_TEXT COMMAND...: that exit code and the text on stderr
  local code="$1" what="$2" text="$3"; shift 3
  "$@" >"$work/out" 2>"$work/err"
  local rc=$?
  if [ "$rc" -eq "$code" ] && grep -qF -- "$text" "$work/err"; then echo "ok: $what"
  else echo "FAIL: $what (exit $rc, wanted $code and '$text')"; cat "$work/err"; failures=$((failures + 1)); fi
}

# 128 MiB and 64 MiB live, the 128 MiB freed, 96 MiB allocated: classic splits the cached 128 MiB
# segment, so it reserves 192 MiB for a peak of 192 MiB live.
cat >"$work/oracle.csv" <<'CSV'
Thread,Time,Action,Pointer,Size,Stream
1,00:00:00.000001,allocate,0x10000000,134217728,0
1,00:00:00.000002,allocate,0x20000000,67108864,0
1,00:00:00.000003,free,0x10000000,134217728,0
1,00:00:00.000004,allocate,0x30000000,100663296,0
CSV
check "convert RMM CSV to native" "$bin/fragless-trace" convert "$work/oracle.csv" "$work/o.fgt"
check "convert native to snapshot" "$bin/fragless-trace" convert "$work/o.fgt" "$work/o.pickle"
check "convert snapshot to RMM CSV" "$bin/fragless-trace" convert "$work/o.pickle" "$work/back.csv"
check "round trip keeps every row" diff <(cut -d, -f3- "$work/oracle.csv" | tail -n +2) \
  <(cut -d, -f3- "$work/back.csv" | tail -n +2 | sed 's/,0$/,0/')
check "info names the format" grep -q "format native" <("$bin/fragless-trace" info "$work/o.fgt")
check "summary --json has the peak" grep -q '"peak_live_bytes":201326592' <("$bin/fragless-trace" summary --json "$work/o.pickle")
check "classic reserves 192 MiB on the RMM log" grep -q '"policy":"classic".*"peak_reserved_bytes":201326592' \
  <("$bin/fragless-replay" --policy classic --json "$work/oracle.csv")
check "the same from the converted snapshot" grep -q '"peak_reserved_bytes":201326592' \
  <("$bin/fragless-replay" --policy classic --json "$work/o.pickle" | grep -o '"peak_reserved_bytes":[0-9]*')
if command -v python3 >/dev/null; then
  check "Python's unpickler reads our snapshot in PyTorch's layout" python3 "$(dirname "$0")/python/check_snapshot.py" "$work/o.pickle"
else
  echo "SKIPPED (loudly): python3 is not installed, the snapshot was not checked by Python's unpickler"
fi
if command -v gnuplot >/dev/null; then
  check "--plot writes a PNG" "$bin/fragless-replay" --plot "$work/p.png" "workload:transformer-infer:steps=2,layers=2"
  check "the plot is a PNG" grep -q PNG <(head -c 8 "$work/p.png")
else
  echo "SKIPPED (loudly): gnuplot is not installed, --plot was not checked"
fi
# --conf reaches the policy: with lend_pages:False a same-stream re-backing synchronises first.
check "--conf changes a fragless setting" test "$("$bin/fragless-replay" --policy fragless --json \
  --conf lend_pages:False "workload:transformer-infer" | grep -o '"forced_syncs":[0-9]*')" != '"forced_syncs":0'
printf 'len\n100\n2000\n700\n' >"$work/lens.csv"
check "--seqlen-file drives the workload" "$bin/fragless-replay" --seqlen-file "$work/lens.csv" "workload:transformer-train:steps=2,layers=2"

# Bad input: exit code 2, the file and the position named.
head -c 100 "$work/o.fgt" >"$work/cut.fgt"
check "a native trace cut mid-record still reads, with a warning" "$bin/fragless-trace" info "$work/cut.fgt"
cp "$work/err" "$work/warning"
check "the warning names the byte" grep -q "partial record at byte 64" "$work/warning"
printf 'garbage' >"$work/g.bin"
check_error "unknown format" "unknown trace format" "$bin/fragless-trace" info "$work/g.bin"
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,0,explode,0x1,5,0\n' >"$work/bad.csv"
check_error "unknown CSV action names the line" "bad.csv:2: unknown action 'explode'" "$bin/fragless-replay" "$work/bad.csv"
printf 'Thread,Time,Action,Pointer,Size,Stream\n1,0,free,0x1,5,0\n' >"$work/free.csv"
check_error "free of an unknown address" "that was never allocated" "$bin/fragless-replay" "$work/free.csv"
check_error "missing input file" "cannot open" "$bin/fragless-trace" summary "$work/none.pickle"
check_error "bad output extension" "use --to" "$bin/fragless-trace" convert "$work/o.fgt" "$work/o.xyz"
check_error "unknown policy" "unknown policy 'best'" "$bin/fragless-replay" --policy best "$work/o.fgt"
check_error "bad workload" "unknown workload 'gpt'" "$bin/fragless-replay" workload:gpt
check_error "bad --conf value" "bad value '7' for key 'reserve_slack'" "$bin/fragless-replay" --conf reserve_slack:7 "$work/o.fgt"

# What fits: --fit and --max-batch / --max-of, their JSON, and their errors.
small="workload:transformer-infer:layers=4,steps=3"
check "--fit --json gives min_capacity_bytes per policy" test "$("$bin/fragless-replay" --fit --fit-step 0.0625 --json \
  "$small" | grep -o '"min_capacity_bytes":[0-9]*' | wc -l)" -eq 3
check "--fit table names the step" grep -q "step 0.25 GiB" <("$bin/fragless-replay" --fit "$small")
check "--max-batch --json gives max_value and the key" test "$("$bin/fragless-replay" --max-batch --capacity-gib 4 --json \
  "$small" | grep -o '"key":"batch","max_value":[0-9]*' | wc -l)" -eq 3
check "--max-of max_seq" grep -q "max_seq" <("$bin/fragless-replay" --max-of max_seq --capacity-gib 2 "$small,batch=8")
if command -v gnuplot >/dev/null 2>&1; then
  check "--fit --plot draws at the fitted capacity" "$bin/fragless-replay" --fit --plot "$work/fit.png" "$small"
  check "the fit plot is a PNG" test -s "$work/fit.png"
  check "--plot-x event" "$bin/fragless-replay" --plot "$work/ev.png" --plot-x event "$work/oracle.csv"
else
  echo "SKIPPED (loudly): --fit --plot needs gnuplot, which is not on the PATH"
fi
check_error "--max-of a key that is not numeric" "key 'dtype' is not numeric" \
  "$bin/fragless-replay" --max-of dtype --capacity-gib 8 "$small"
check_error "--max-of on a trace" "this input is a trace" "$bin/fragless-replay" --max-batch --capacity-gib 8 "$work/o.fgt"
check_error "--max-batch needs a capacity" "need the device's size" "$bin/fragless-replay" --max-batch "$small"
check_error "--fit with a capacity" "drop --capacity-gib" "$bin/fragless-replay" --fit --capacity-gib 8 "$small"
check_error "--fit-step without --fit" "--fit-step applies to --fit" "$bin/fragless-replay" --fit-step 1 "$small"
check_error "--plot-x with a bad axis" "expected time, event or auto" "$bin/fragless-replay" --plot-x days "$small"
check_error "--fit-step too fine" "--fit-step needs" "$bin/fragless-replay" --fit --fit-step 0 "$small"
check_exit 1 "a capacity too small for the smallest batch" "does not fit at its smallest batch=1" \
  "$bin/fragless-replay" --max-batch --capacity-gib 0.01 "$small"
check_exit 1 "a search that cannot converge" "cannot converge" \
  "$bin/fragless-replay" --policy classic --max-of seed --capacity-gib 8 "workload:transformer-infer:layers=2,steps=2"
check "--help exits 0 and documents --fit" grep -q -- "--fit" <("$bin/fragless-replay" --help)
# Every tool answers --help with its usage on stdout and exit 0.
for tool in fragless-replay fragless-trace fragless-config fragless-oracles fragless-capture; do
  if [ -x "$bin/$tool" ]; then
    check "$tool --help exits 0 with its usage" bash -c 'out=$("$1" --help) && grep -qi usage <<<"$out"' _ "$bin/$tool"
  else
    echo "SKIPPED (loudly): $tool was not built"
  fi
done

[ "$failures" -eq 0 ] || { echo "$failures check(s) failed"; exit 1; }
