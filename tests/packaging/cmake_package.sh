#!/usr/bin/env bash
# The CMake package from outside the tree: `cmake --install BUILD_DIR --prefix` into a temporary folder, then
# a project in another temporary folder (tests/packaging/consumer, copied there) finds it with
# find_package(fragless CONFIG REQUIRED) and links fragless::core, fragless::capi and, when the build has
# LibTorch, fragless::torch; each program runs.
#   cmake_package.sh BUILD_DIR on|off     (on: the installation must have fragless::torch)
set -euo pipefail
build="$1"
torch="$2"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" >"$work/install.log" || { cat "$work/install.log"; exit 1; }
for f in include/fragless/allocator.h include/fragless/engine.h include/fragless/fragless.h lib/libfragless_core.a \
         lib/libfragless.so lib/libfragless_preload.so lib/cmake/fragless/fragless-config.cmake; do
  [ -e "$prefix/$f" ] || { echo "FAIL: $f was not installed"; exit 1; }
done
echo "ok: installed into a temporary prefix ($(find "$prefix" -type f | wc -l) files)"
cp -r "$here/consumer" "$work/consumer"
cmake -S "$work/consumer" -B "$work/consumer/build" -DCMAKE_PREFIX_PATH="$prefix" -DEXPECT_TORCH="$torch" \
  >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer/build" -j2 >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$work/consumer/build/engine"
FRAGLESS_CONF=driver:host,capacity_mb:64 "$work/consumer/build/capi"
if [ "$torch" = on ]; then "$work/consumer/build/with_torch"; fi
grep -q "with_torch" "$work/build.log" || [ "$torch" != on ] || { echo "FAIL: fragless::torch was not built"; exit 1; }
echo "ok: find_package(fragless CONFIG REQUIRED) from outside the tree"
