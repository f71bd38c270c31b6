#!/usr/bin/env bash
# The docs' "The C ABI" table (docs/PYTORCH.md, moved there from README) has a row for each function libfragless.so
# exports, and no row for one it does not export. Before 2026-12-05 sixteen exports were documented nowhere.
# Usage: readme_abi.sh LIBFRAGLESS DOC
set -euo pipefail
lib="$1"
readme="$2"  # the document that holds the table
exported=$(nm -D --defined-only "$lib" | awk '$2 == "T" && $3 ~ /^fragless_/ {print $3}' | sort -u)
grep -qx fragless_malloc <<<"$exported" || { echo "FAIL: nm lists no fragless_malloc in $lib"; exit 1; }
# The rows of the section's first table: | `fragless_NAME(...)` | ... |
section=$(awk '/^### The C ABI$/ {on = 1; next} on && /^#/ {exit} on' "$readme")
[ -n "$section" ] || { echo "FAIL: $readme has no section '### The C ABI'"; exit 1; }
rows=$(grep -o '^| `fragless_[a-z0-9_]*(' <<<"$section" | sed 's/^| `//; s/($//' | sort -u)
missing=$(comm -23 <(echo "$exported") <(echo "$rows"))
extra=$(comm -13 <(echo "$exported") <(echo "$rows"))
[ -z "$missing" ] || { echo "FAIL: exported, but not in $readme's C ABI table:"; echo "$missing"; }
[ -z "$extra" ] || { echo "FAIL: in $readme's C ABI table, but not exported:"; echo "$extra"; }
[ -z "$missing$extra" ] || exit 1
echo "ok: $readme's C ABI table has a row for each of the $(wc -l <<<"$exported") exported functions"
