#!/usr/bin/env bash
# fragless-gpu-probe's --out on the libcuda double: the file appears whole or not at all (the atomic writer
# of the other tools, Note [Writing an output file]): written through a symbolic link to its target, a FIFO at
# the path refused with exit 1 and a message naming it, an earlier file left whole when the write fails.
# Usage: gpu_probe_out.sh PROBE LIBCUDA_DOUBLE
set -u
probe=$1 double=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAILED: $1"; fail=1; fi; }
run() { FRAGLESS_LIBCUDA="$double" timeout 60 "$probe" --quick --out "$@" >"$work/stdout" 2>"$work/stderr"; }

run "$work/costs.json"; rc=$?
check "a plain path is written (exit $rc)" '[ $rc -eq 0 ] && grep -q "\"schema\":\"fragless-gpu-probe/1\"" "$work/costs.json"'

ln -s costs-target.json "$work/link.json"
run "$work/link.json"; rc=$?
check "a symbolic link is followed to its target (exit $rc)" '[ $rc -eq 0 ] && [ -L "$work/link.json" ] && grep -q "fragless-gpu-probe/1" "$work/costs-target.json"'

mkfifo "$work/fifo.json"
run "$work/fifo.json"; rc=$?
check "a FIFO at the path is refused, named (exit $rc)" '[ $rc -eq 1 ] && grep -q "fifo.json" "$work/stderr" && [ -p "$work/fifo.json" ]'

cp "$work/costs.json" "$work/before.json"
mkdir "$work/ro" && cp "$work/costs.json" "$work/ro/costs.json" && chmod 555 "$work/ro"
if [ "$(id -u)" -ne 0 ]; then
  run "$work/ro/costs.json"; rc=$?
  check "a folder it cannot write to: exit 1, the old file whole (exit $rc)" '[ $rc -eq 1 ] && cmp -s "$work/ro/costs.json" "$work/before.json"'
else
  echo "SKIPPED: the read-only folder case (root writes anywhere)"
fi
chmod 755 "$work/ro"
exit $fail
