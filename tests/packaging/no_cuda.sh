#!/usr/bin/env bash
# A build on a machine without CUDA's headers (the README's quick start on a fresh Debian machine: nothing
# installs them): a tree configured with CMake's CUDAToolkit hidden, the LD_PRELOAD interposer and its test
# programs built, and every LD_PRELOAD test of that tree run. The interposer has no driver half there
# (torch_plugin/preload_nodriver.cpp answers for it); a symbol it lacks fails the link (--no-undefined).
#   no_cuda.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
root="$1"
build="$2"
. "$root/tools/progress.sh"
quiet_step "no_cuda: configure" "$build.configure.log" \
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DFRAGLESS_NESTED=ON
grep -q "CUDA headers not found" "$build.configure.log" || { echo "FAIL: the tree found CUDA's headers"; exit 1; }
quiet_step "no_cuda: build" "$build.build.log" \
  cmake --build "$build" -j2 --target fragless_preload fragless_fakecudart fragless-preload-program fragless-preload-ipc \
  fragless-dlsym-next fragless_dlsym_next_a fragless_dlsym_next_b
ctest --test-dir "$build" --output-on-failure -R "LD_PRELOAD"
