#!/usr/bin/env bash
# Every planted defect of tools/mutants.sh still applies to the tree (exact context, any offset), so the
# set cannot rot unseen while the code it plants into moves. Whether the suite catches each one is
# tools/mutants.sh's question (minutes per defect); this one takes a second.
#   mutants_apply.sh REPO_ROOT       exit 0 all apply, 1 one does not, 77 not a git checkout (skipped)
set -uo pipefail
root="${1:?usage: mutants_apply.sh REPO_ROOT}"
if ! git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "SKIPPED: $root is not a git checkout (git apply --check needs one)"
  exit 77
fi
bad=0 n=0
for p in "$root"/tools/mutants/*.patch; do
  n=$((n + 1))
  if out=$(git -C "$root" apply --check "$p" 2>&1); then
    echo "applies: $(basename "$p")"
  else
    echo "DOES NOT APPLY: $(basename "$p") (update it where the code it changes now is): $out"
    bad=$((bad + 1))
  fi
done
[ "$n" -gt 0 ] || { echo "no patches found under $root/tools/mutants"; exit 1; }
echo "$((n - bad)) of $n planted defects apply"
[ "$bad" -eq 0 ]
