#!/usr/bin/env bash
# Builds, on a CPU machine, everything the GPU check needs into one folder (default gpu-bundle/, ignored by
# git; at most 64 MiB, so the device run can carry it): Release, the cuda driver, no sanitizers, no tests.
#   tools/gpu_bundle.sh [OUT]
# Contents: bin/fragless-gpu-probe, bin/fragless-gpu-tests, bin/fragless-replay, lib/libfragless.so, lib/libfragless_preload.so,
# lib/fragless_kernels.cubin (tools/gpu_kernels.ptx assembled by ptxas for sm_90, the H100's and H200's; the
# probe and the tests load it first and the same PTX, built into them, where it does not load), python/fragless
# (the helper), gpu_check.sh, gpu_train.py, MANIFEST (what was built, from which commit, the kernels, the glibc
# the binaries need and the libstdc++ the libraries need). Then, on the device: bash OUT/gpu_check.sh OUT
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/gpu-bundle}" && cd "${1:-$root/gpu-bundle}" && pwd)"
build="${FRAGLESS_BUNDLE_BUILD:-$out.build}"
jobs="$(nproc 2>/dev/null || echo 2)"
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
. "$root/tools/progress.sh"
mkdir -p "$build"
quiet_step "gpu_bundle: configure" "$build/configure.log" \
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DFRAGLESS_BUILD_TESTS=OFF -DFRAGLESS_BUILD_BENCH=ON \
  -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" "${launcher[@]}"
quiet_step "gpu_bundle: build" "$build/build.log" \
  cmake --build "$build" -j"$jobs" --target fragless fragless_preload fragless-gpu-probe fragless-gpu-tests fragless-replay
rm -rf "$out/bin" "$out/lib" "$out/python"
mkdir -p "$out/bin" "$out/lib" "$out/python"
cp "$build/bin/fragless-gpu-probe" "$build/bin/fragless-gpu-tests" "$build/bin/fragless-replay" "$out/bin/"
cp "$build/lib/libfragless.so" "$build/lib/libfragless_preload.so" "$out/lib/"
cp -r "$root/torch_plugin/python/fragless" "$out/python/"
rm -rf "$out/python/fragless/__pycache__"
cp "$root/tools/gpu_check.sh" "$root/tools/gpu_train.py" "$out/"
cp "$root/tests/python/test_torch_share.py" "$root/tests/python/checks.py" "$out/"
# The kernels: PTX of ISA 7.0, built into the probe and the tests, which any driver from CUDA 11.0 on compiles;
# a cubin of it for sm_90 as well where ptxas is here, which needs no JIT compiler on the GPU machine (a
# driver older than this ptxas may refuse it: the PTX is loaded then).
ptxas="${PTXAS:-$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)}"
if [ -x "$ptxas" ] && "$ptxas" -arch=sm_90 -o "$out/lib/fragless_kernels.cubin" "$root/tools/gpu_kernels.ptx"; then
  kernel="tools/gpu_kernels.ptx (ISA 7.0) built into the programs; lib/fragless_kernels.cubin, sm_90 ($("$ptxas" --version | tail -1)), tried first"
else
  rm -f "$out/lib/fragless_kernels.cubin"
  kernel="tools/gpu_kernels.ptx (ISA 7.0) built into the programs; no cubin (no ptxas here)"
fi
# The glibc the binaries need: the newest GLIBC_ symbol version they import (gpu_check.sh checks it at start).
glibc="$(objdump -T "$out"/bin/* "$out"/lib/*.so 2>/dev/null | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)"
# The libstdc++ the libraries need: the newest GLIBCXX_ and CXXABI_ symbol versions they import (the programs
# link theirs statically). The libraries keep the shared libstdc++: they are loaded into PyTorch's process and
# fragless_malloc throws into PyTorch's code, which a second, static copy of the C++ runtime would not make
# safe; gpu_check.sh checks the machine's instead, at start.
cxx=""
for series in GLIBCXX CXXABI; do
  v="$(objdump -T "$out"/lib/*.so 2>/dev/null | grep -o "${series}_[0-9][0-9.]*" | sort -uV | tail -1)"
  cxx="$cxx${v:+ $v}"
done
{
  echo "fragless GPU bundle"
  echo "built: $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -m), from $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "kernel: $kernel"
  echo "glibc: ${glibc:-unknown (no objdump on the build machine)} or newer (the newest symbol version the binaries import)"
  if [ -n "$cxx" ]; then
    echo "libstdc++:$cxx or newer (the newest symbol versions lib/*.so import; the programs in bin/ carry their own)"
  else
    echo "libstdc++: unknown (no objdump on the build machine)"
  fi
} > "$out/MANIFEST"
size=$(du -sb "$out" | cut -f1)
if [ "$size" -gt $((64 << 20)) ]; then
  echo "gpu_bundle: $out is $((size >> 20)) MiB, over the 64 MiB a device run can carry" >&2
  exit 1
fi
echo "gpu_bundle: $out ($((size >> 10)) KiB); on the device: bash $(basename "$out")/gpu_check.sh $(basename "$out")"
