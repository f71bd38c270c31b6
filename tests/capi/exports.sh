#!/usr/bin/env bash
# libfragless.so exports its C ABI (fragless_*) and nothing else. nm's own status is checked and its list
# must name fragless_malloc, so a missing or failing nm fails the test rather than passing on an empty list.
# Usage: exports.sh LIBFRAGLESS
set -euo pipefail
lib="$1"
syms=$(nm -D --defined-only "$lib")
grep -q ' T fragless_malloc$' <<<"$syms" || { echo "FAIL: nm lists no fragless_malloc in $lib"; exit 1; }
others=$(grep -v ' fragless_' <<<"$syms" || true)
[ -z "$others" ] || { echo "FAIL: $lib exports more than its C ABI:"; echo "$others"; exit 1; }
echo "ok: $(wc -l <<<"$syms") exported symbols, every one fragless_*"
