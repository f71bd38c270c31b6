#!/usr/bin/env bash
# What fragless-gpu-probe and fragless-gpu-tests do when the GPU cannot be used, on the libcuda double:
#   kernels  a driver with the kernel calls refuses every module (the module double, fake_modules.cpp, as a
#            CUDA 12 driver refuses PTX of a newer ISA): the probe exits 1 and the kernel tests FAIL (none is
#            SKIPPED), the CUresult's name and the JIT's log in what they print and write, a --kernel cubin's
#            refusal named beside the PTX's; what they handed the driver is tools/gpu_kernels.ptx, which
#            assembles with ptxas for sm_80 and sm_90 (when PTXAS names one);
#   init     cuInit's CUDA_ERROR_NO_DEVICE is "no GPU" (77, named), any other cuInit failure (803, 804, 999)
#            exits 1 with its name; a driver library that cannot be loaded is 77 with dlerror()'s words.
# Usage: gpu_failures.sh kernels|init PROBE TESTS DOUBLE MODULE_DOUBLE PTX_SOURCE [PTXAS]
set -u
scenario=$1 probe=$2 tests=$3 double=$4 modules=$5 ptx=$6 ptxas=${7:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAILED: $1"; fail=1; fi; }
show() { echo "--- $1"; cat "$1"; }

case "$scenario" in
kernels)
  export FRAGLESS_LIBCUDA="$modules" FAKECUDA_CAPACITY_MB=4096 FAKECUDA_MODULE_IMAGES="$work/images.ptx"
  timeout 120 "$tests" --json "$work/tests.json" > "$work/tests.out" 2>&1; rc=$?
  show "$work/tests.out"
  check "fragless-gpu-tests exits 1 (exit $rc)" '[ $rc -eq 1 ]'
  check "its six kernel tests FAILED, none SKIPPED" \
    '[ "$(grep -c "^FAILED .*CUDA_ERROR_UNSUPPORTED_PTX_VERSION (222): the module double refuses every PTX image" "$work/tests.out")" -eq 6 ] && ! grep -q "^SKIPPED" "$work/tests.out"'
  check "the other twelve PASSED" '[ "$(grep -c "^PASSED" "$work/tests.out")" -eq 12 ]'
  check "tests.json says why the kernels did not load" \
    'grep -q "\"kernels\":\"cannot load the kernels: the built-in PTX: cuModuleLoadDataEx: CUDA_ERROR_UNSUPPORTED_PTX_VERSION (222)" "$work/tests.json" && grep -q "\"failed\":6," "$work/tests.json"'
  check "the image handed to the driver is tools/gpu_kernels.ptx" 'cmp -s "$work/images.ptx" "$ptx"'
  if [ -n "$ptxas" ]; then
    for arch in sm_80 sm_90; do
      check "it assembles with ptxas -arch=$arch" '"$ptxas" -arch=$arch "$work/images.ptx" -o "$work/k.cubin"'
    done
  fi
  check "its ISA is 7.0 (CUDA 11.0), which every driver fragless runs on compiles" \
    '[ "$(grep -m1 "^\.version" "$ptx")" = ".version 7.0" ]'
  printf 'not a cubin' > "$work/bad.cubin"
  timeout 120 "$tests" --kernel "$work/bad.cubin" > "$work/tests2.out" 2>&1; rc=$?
  grep "^kernels:" "$work/tests2.out"
  check "with --kernel, both refusals are named (exit $rc)" \
    '[ $rc -eq 1 ] && grep -q "^kernels: cannot load the kernels: the built-in PTX: .*(222).* ($work/bad.cubin did not load: cuModuleLoadDataEx: .*(222): the module double refuses every binary image" "$work/tests2.out"'
  FAKECUDA_MODULE_ERROR=221 timeout 120 "$probe" --quick --out "$work/probe.json" > "$work/probe.out" 2>&1; rc=$?
  tail -3 "$work/probe.out"
  check "fragless-gpu-probe exits 1, naming the CUresult (exit $rc)" \
    '[ $rc -eq 1 ] && grep -q "fragless-gpu-probe: cannot load the kernels: the built-in PTX: cuModuleLoadDataEx: CUDA_ERROR_JIT_COMPILER_NOT_FOUND (221)" "$work/probe.out"'
  check "and writes its answers, the failure among them" \
    'grep -q "\"failure\":\"cannot load the kernels: the built-in PTX: cuModuleLoadDataEx: CUDA_ERROR_JIT_COMPILER_NOT_FOUND (221)" "$work/probe.json"'
  unset FAKECUDA_MODULE_IMAGES
  FRAGLESS_LIBCUDA="$double" timeout 120 "$tests" > "$work/double.out" 2>&1; rc=$?
  check "on the double itself (no kernel calls) the kernel tests are SKIPPED and the run passes (exit $rc)" \
    '[ $rc -eq 0 ] && [ "$(grep -c "^SKIPPED .*the libcuda double runs no kernels" "$work/double.out")" -eq 6 ]'
  ;;
init)
  export FRAGLESS_LIBCUDA="$double"
  for prog in "$probe" "$tests"; do
    name=$(basename "$prog")
    FAKECUDA_FAIL=cuInit:1:100 timeout 60 "$prog" > "$work/out" 2>&1; rc=$?
    check "$name: cuInit's CUDA_ERROR_NO_DEVICE is no GPU: 77, named (exit $rc)" \
      '[ $rc -eq 77 ] && grep -q "^SKIPPED: .*CUDA_ERROR_NO_DEVICE (100)" "$work/out"' || show "$work/out"
    for e in 803:CUDA_ERROR_SYSTEM_DRIVER_MISMATCH 804:CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE 999:CUDA_ERROR_UNKNOWN; do
      FAKECUDA_FAIL=cuInit:1:${e%%:*} timeout 60 "$prog" > "$work/out" 2>&1; rc=$?
      check "$name: cuInit's ${e#*:} exits 1, named (exit $rc)" \
        '[ $rc -eq 1 ] && grep -q "cuInit failed: ${e#*:} (${e%%:*})" "$work/out" && ! grep -q SKIPPED "$work/out"' || show "$work/out"
    done
    FRAGLESS_LIBCUDA="$work/none/libcuda.so.1" timeout 60 "$prog" > "$work/out" 2>&1; rc=$?
    check "$name: no driver library: 77 with dlerror's words (exit $rc)" \
      '[ $rc -eq 77 ] && grep -q "^SKIPPED: no GPU driver here (cannot load $work/none/libcuda.so.1: .*No such file" "$work/out"' || show "$work/out"
  done
  ;;
*)
  echo "usage: gpu_failures.sh kernels|init PROBE TESTS DOUBLE MODULE_DOUBLE PTX_SOURCE [PTXAS]" >&2
  exit 2
  ;;
esac
exit $fail
