#!/usr/bin/env bash
# Installs the Debian packages fragless builds and tests with, when any is missing (idempotent).
set -euo pipefail
packages=(g++ cmake make catch2 libbenchmark-dev libmimalloc-dev libcli11-dev nlohmann-json3-dev gnuplot-nox python3 python3-pip python3-setuptools python3-wheel python3-venv clang libclang-rt-14-dev libtorch-dev python3-torch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  . "$(dirname "$0")/progress.sh"
  log="$(mktemp)"
  quiet_step "install_deps: apt-get update" "$log" apt-get update -qq
  quiet_step "install_deps: apt-get install" "$log" apt-get install -y -qq "${missing[@]}"
  rm -f "$log"
fi
