#!/usr/bin/env bash
# LibTorch end to end: the same CPU training run (variable-length batches, 3 epochs of 20 steps,
# empty_cache between epochs) under LibTorch's default allocator and under fragless with a policy; the
# losses must be identical bit for bit, and the captured trace must load and replay.
# Usage: torch_capture.sh BIN_DIR WORK_DIR default     LibTorch's own allocator: WORK_DIR/default.txt
#        torch_capture.sh BIN_DIR WORK_DIR POLICY      fragless with POLICY, compared with WORK_DIR/default.txt
# (CTest runs the default run once as a fixture and each policy as its own test.)
set -uo pipefail
bin="$1"
dir="$2"
run="$3"
mkdir -p "$dir"
args=(--steps 20 --epochs 3 --seed 7 --layers 2 --d-model 64 --heads 4 --batch 4 --min-len 8 --max-len 96)
if [ "$run" = default ]; then
  out=$("$bin/fragless-capture" --help) && grep -q "usage" <<<"$out" || { echo "FAIL: fragless-capture --help"; exit 1; }
  "$bin/fragless-capture" --allocator default "${args[@]}" >"$dir/default.txt" || { echo "FAIL: default run"; exit 1; }
  [ "$(wc -l <"$dir/default.txt")" -eq 60 ] || { echo "FAIL: expected 60 steps"; exit 1; }
  echo "ok: LibTorch's allocator, 60 steps"
  # A tracer or a policy asked for with LibTorch's own allocator is refused (exit 2, named), not ignored.
  for opt in "--trace $dir/never.fgt" "--policy classic"; do
    err=$("$bin/fragless-capture" --allocator default $opt --steps 1 --epochs 1 2>&1 >/dev/null); rc=$?
    { [ $rc -eq 2 ] && grep -q -- "${opt%% *} needs --allocator fragless" <<<"$err"; } \
      || { echo "FAIL: --allocator default $opt: exit $rc: $err"; exit 1; }
  done
  [ ! -e "$dir/never.fgt" ] || { echo "FAIL: a refused run wrote a trace"; exit 1; }
  echo "ok: --trace and --policy refused with LibTorch's own allocator"
  # A broken rule is named with the values given (it listed every rule, and --steps 0 trained nothing, exit 0).
  for bad in "--min-len 100 --max-len 10|--max-len 10 is below --min-len 100" "--steps 0|--steps 0: at least one step" \
             "--d-model 10 --heads 4|--d-model 10 is not a positive multiple of --heads 4"; do
    err=$("$bin/fragless-capture" --allocator default ${bad%%|*} 2>&1 >/dev/null); rc=$?
    { [ $rc -eq 2 ] && grep -qF -- "${bad#*|}" <<<"$err"; } || { echo "FAIL: ${bad%%|*}: exit $rc: $err"; exit 1; }
  done
  echo "ok: bad model and run settings refused, each named"
  exit 0
fi
[ -s "$dir/default.txt" ] || { echo "FAIL: $dir/default.txt is missing (run with 'default' first)"; exit 1; }
p="$run"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$bin/fragless-capture" --policy "$p" --trace "$work/$p-%p.fgt" "${args[@]}" >"$work/$p.txt" 2>"$work/$p.err" \
  || { echo "FAIL: $p run"; cat "$work/$p.err"; exit 1; }
if cmp -s "$dir/default.txt" "$work/$p.txt"; then echo "ok: $p losses identical to LibTorch's allocator (60 steps)"
else echo "FAIL: $p losses differ"; diff "$dir/default.txt" "$work/$p.txt" | head; exit 1; fi
cat "$work/$p.err"
trace=$(ls "$work/$p"-*.fgt)
"$bin/fragless-trace" info "$trace" | tee "$work/$p.info" || { echo "FAIL: fragless-trace info $trace"; exit 1; }
grep -q "empty_cache 3" "$work/$p.info" || { echo "FAIL: the trace lacks the 3 empty_cache calls"; exit 1; }
"$bin/fragless-replay" --policy "$p" "$trace" >/dev/null || { echo "FAIL: the captured trace does not replay"; exit 1; }
echo "ok: trace captured, loaded and replayed"
