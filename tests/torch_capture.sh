#!/usr/bin/env bash
# LibTorch end to end: the same CPU training run (variable-length batches, 3 epochs of 20 steps,
# empty_cache between epochs) under LibTorch's default allocator and under fragless with each policy;
# the losses must be identical bit for bit, and the captured trace must load and replay.
# Usage: torch_capture.sh BIN_DIR
set -uo pipefail
bin="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
out=$("$bin/fragless-capture" --help) && grep -q "usage" <<<"$out" || { echo "FAIL: fragless-capture --help"; exit 1; }
args=(--steps 20 --epochs 3 --seed 7 --layers 2 --d-model 64 --heads 4 --batch 4 --min-len 8 --max-len 96)
"$bin/fragless-capture" --allocator default "${args[@]}" >"$work/default.txt" || { echo "FAIL: default run"; exit 1; }
[ "$(wc -l <"$work/default.txt")" -eq 60 ] || { echo "FAIL: expected 60 steps"; exit 1; }
for p in classic expandable fragless; do
  "$bin/fragless-capture" --policy "$p" --trace "$work/$p-%p.fgt" "${args[@]}" >"$work/$p.txt" 2>"$work/$p.err" \
    || { echo "FAIL: $p run"; cat "$work/$p.err"; exit 1; }
  if cmp -s "$work/default.txt" "$work/$p.txt"; then echo "ok: $p losses identical to LibTorch's allocator (60 steps)"
  else echo "FAIL: $p losses differ"; diff "$work/default.txt" "$work/$p.txt" | head; exit 1; fi
  cat "$work/$p.err"
  trace=$(ls "$work/$p"-*.fgt)
  "$bin/fragless-trace" info "$trace" | tee "$work/$p.info" || { echo "FAIL: fragless-trace info $trace"; exit 1; }
  grep -q "empty_cache 3" "$work/$p.info" || { echo "FAIL: the trace lacks the 3 empty_cache calls"; exit 1; }
  "$bin/fragless-replay" --policy "$p" "$trace" >/dev/null || { echo "FAIL: the captured trace does not replay"; exit 1; }
done
echo "ok: traces captured, loaded and replayed"
