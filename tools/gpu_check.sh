#!/usr/bin/env bash
# The GPU check, run on a GPU machine from a bundle built on a CPU one (tools/gpu_bundle.sh), without building:
#   bash gpu-bundle/gpu_check.sh [BUNDLE]       (BUNDLE: default, the folder this script is in, or gpu-bundle/)
# 1. the driver probe (tools/gpu_probe.cpp): granularity, VMM attributes, call costs, the contract's questions;
# 2. the real-driver tests (tests/gpu/gpu_tests.cpp: conformance, OOM, integrity with patterns through cuMemcpy,
#    record_stream proved physically with a kernel that writes at its end, a graph of real kernels replayed on
#    another stream and released while it runs), every policy;
# 3. the built-in workloads replayed with the measured costs instead of the A100 model;
# 4. when PyTorch with CUDA is there: training over batches whose shapes really vary under native,
#    native + expandable_segments, fragless (CUDAPluggableAllocator) and fragless (LD_PRELOAD), plus the
#    memory API, a snapshot and a CUDA graph under each (tools/gpu_train.py);
# 5. then a CUDA tensor fragless allocated sent to a second process through torch.multiprocessing under
#    fragless.torch.enable() (tests/python/test_torch_share.py).
# Writes exactly two files into $OUT if it is set, else into the current folder:
# gpu_check.json (every step's result, exit status, time, and its stderr) and gpu_check.log (what it printed).
# gpu_check.json is rewritten after every step, so a run cut short still hands back what it did. The step
# limits add up to the 8-minute budget (480 s). Exit status: 0 when every step that ran passed, 77 only when
# there is no GPU driver or device (within seconds), 1 when a step failed or timed out, a real-driver test
# failed, or the bundle cannot run here (its glibc, MANIFEST; or the libstdc++ its libraries need: then the
# steps that load them are not run, named, and the others are). FRAGLESS_LIBCUDA points it at another libcuda
# (the test double, in CI).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$PWD}"
mkdir -p "$out"
if [ -z "${FRAGLESS_GPU_CHECK_LOGGED:-}" ]; then  # everything printed goes to gpu_check.log as well
  FRAGLESS_GPU_CHECK_LOGGED=1 bash "$0" "$@" 2>&1 | tee "$out/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
bundle="${1:-}"
if [ -z "$bundle" ]; then
  if [ -x "$here/bin/fragless-gpu-probe" ]; then bundle="$here"; else bundle="$here/../gpu-bundle"; fi
fi
steps="${FRAGLESS_GPU_STEPS:-40}"
work="$(mktemp -d "${TMPDIR:-/tmp}/fragless-gpu-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# Step limits in seconds: 60 (the probe) + 100 (the tests) + 40 (the replay) + 4 x 60 (training) + 20 (the
# CUDA tensor exchange) + 20 (assembling the report) = 480. The probe's own work takes seconds (cuInit, a few
# hundred VMM calls, three 200 ms kernels) and the replay under one here; a training run imports PyTorch (from a
# cold disk, the first), builds a 218M-parameter model, runs 40 deterministic steps and, under fragless,
# enable() may compile its small C++ shim. A step still running at its limit gets SIGTERM, and SIGKILL 10 s
# later (timeout -k 10); these programs end on SIGTERM.
t_probe=60 t_tests=100 t_replay=40 t_torch=60 t_share=20 t_report=20
kill_after=10

if [ ! -x "$bundle/bin/fragless-gpu-probe" ]; then
  echo "gpu_check: no bundle at $bundle (run tools/gpu_bundle.sh on a build machine first)"
  exit 1
fi
bundle="$(cd "$bundle" && pwd)"
echo "== $(date -u +%Y-%m-%dT%H:%MZ) bundle: $(sed -n 2p "$bundle/MANIFEST" 2>/dev/null)"

# The bundle's binaries need the glibc its MANIFEST names (the build machine's newest symbol version).
need="$(sed -n 's/^glibc: \([0-9.]*\).*/\1/p' "$bundle/MANIFEST" 2>/dev/null)"
have="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')"
if [ -n "$need" ] && [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
  echo "gpu_check: this bundle needs glibc $need or newer (MANIFEST); this machine has glibc $have: build the bundle on a machine with glibc $have or older"
  exit 1
fi
[ -n "$need" ] || echo "gpu_check: the MANIFEST names no glibc; going on"

# The libraries (lib/*.so, loaded into PyTorch's process; the programs in bin/ carry their own libstdc++) need
# the libstdc++ symbol versions the MANIFEST names: checked in the libstdc++.so.6 the dynamic linker gives
# them here. Without them the steps that load the libraries are not run, named, and the check fails; the probe,
# the tests and the replay still run.
libs_ok=1
need_cxx="$(sed -n 's/^libstdc++: \([A-Z0-9_. ]*\) or newer.*/\1/p' "$bundle/MANIFEST" 2>/dev/null)"
if [ -n "$need_cxx" ]; then
  stdcxx="$(ldd "$bundle/lib/libfragless.so" 2>/dev/null | sed -n 's/^[[:space:]]*libstdc++\.so\.6 => \(\/[^ ]*\) .*/\1/p')"
  if [ -z "$stdcxx" ]; then
    echo "gpu_check: FAILED: no libstdc++.so.6 for the bundle's libraries here (ldd $bundle/lib/libfragless.so:"
    ldd "$bundle/lib/libfragless.so" 2>&1 | sed 's/^/  /'
    echo "); they need $need_cxx or newer (MANIFEST): the runs that load them will not run"
    libs_ok=0
  else
    lacking=""
    for v in $need_cxx; do grep -qazxF "$v" "$stdcxx" || lacking="$lacking $v"; done
    # What ldd finds alone is not always what PyTorch's interpreter loads (a conda python's RPATH brings its own,
    # newer libstdc++): the libstdc++ the interpreter the runs use has mapped once it has loaded the library is
    # checked too, and has the last word.
    if [ -n "$lacking" ]; then
      py_stdcxx="$(timeout -k 5 20 env FRAGLESS_CONF=driver:host python3 -c 'import ctypes, sys
ctypes.CDLL(sys.argv[1])
print(next((l.split()[-1] for l in open("/proc/self/maps") if "/libstdc++.so" in l), ""))' "$bundle/lib/libfragless.so" 2>/dev/null)"
      if [ -n "$py_stdcxx" ] && [ "$py_stdcxx" != "$stdcxx" ]; then
        py_lacking=""
        for v in $need_cxx; do grep -qazxF "$v" "$py_stdcxx" || py_lacking="$py_lacking $v"; done
        if [ -z "$py_lacking" ]; then
          echo "gpu_check: ldd gives $stdcxx, which lacks$lacking, but python3 loads $py_stdcxx, which has them: going on"
          lacking=""
        fi
      fi
    fi
    if [ -n "$lacking" ]; then
      echo "gpu_check: FAILED: the bundle's libraries need libstdc++ with$lacking (MANIFEST: $need_cxx or newer), which $stdcxx lacks: the runs that load them (fragless, LD_PRELOAD, the CUDA tensor exchange) will not run; build the bundle with an older GCC or give this machine a newer libstdc++"
      libs_ok=0
    fi
  fi
else
  echo "gpu_check: the MANIFEST names no libstdc++ versions; going on"
fi

# run NAME LIMIT CMD...: one step, its stdout to $work/NAME.out, stderr to $work/NAME.err (and printed),
# its exit status and time to $work/NAME.status.
run() {
  local name="$1" limit="$2"; shift 2
  local t0 rc; t0=$(date +%s)
  timeout -k "$kill_after" "$limit" "$@" > "$work/$name.out" 2> "$work/$name.err"
  rc=$?
  cat "$work/$name.err" >&2
  echo "$rc $(( $(date +%s) - t0 )) $limit" > "$work/$name.status"
  return $rc
}

# Assembles gpu_check.json from what the steps left in $work.
report() {
  timeout -k "$kill_after" "$t_report" python3 - "$work" "$out/gpu_check.json" "$bundle" <<'PY'
import json, os, sys
work, dest, bundle = sys.argv[1], sys.argv[2], sys.argv[3]
def text(name):
    try:
        return open(os.path.join(work, name), errors="replace").read()
    except OSError:
        return None
def load(name):
    t = text(name)
    try:
        return json.loads(t) if t else None
    except ValueError:
        return None
steps = {}
for f in sorted(os.listdir(work)):
    if f.endswith(".status"):
        name = f[:-len(".status")]
        rc, secs, limit = (int(x) for x in text(f).split())
        steps[name] = {"exit": rc, "seconds": secs, "limit_s": limit, "timed_out": rc in (124, 137),
                       "stderr": (text(name + ".err") or "")[-20000:]}
torch_rows = []
for name in ("native", "expandable", "fragless", "preload"):
    t = text("torch_%s.out" % name) or ""
    rows = [json.loads(l) for l in t.splitlines() if l.startswith("{")]
    torch_rows += rows[-1:]
try:
    manifest = open(os.path.join(bundle, "MANIFEST")).read()
except OSError:
    manifest = None
doc = {"schema": "fragless-gpu-check/2", "manifest": manifest, "steps": steps, "probe": load("probe.json"),
       "real_driver_tests": load("tests.json"), "replay_with_measured_costs": load("replay.out"), "torch": torch_rows}
tmp = dest + ".tmp"
json.dump(doc, open(tmp, "w"), indent=1)
os.replace(tmp, dest)
PY
}

failed=$((1 - libs_ok))
step_failed() { echo "gpu_check: $1"; failed=1; }

# 1. The driver probe. 77: no driver or no device (any other failure of cuInit is 1, named on stderr).
kernel="$bundle/lib/fragless_kernels.cubin"  # the probe and the tests fall back on the PTX built into them
[ -f "$kernel" ] || kernel=""
run probe "$t_probe" "$bundle/bin/fragless-gpu-probe" ${kernel:+--kernel "$kernel"} --out "$work/probe.json"
rc=$?
if [ $rc -eq 77 ]; then
  cat "$work/probe.out"
  echo "SKIPPED: no GPU here; nothing was measured"
  report
  exit 77
fi
cat "$work/probe.out"
[ $rc -eq 0 ] || step_failed "the probe failed (exit $rc); going on with what it wrote"
report

# 2. The real-driver tests.
run tests "$t_tests" "$bundle/bin/fragless-gpu-tests" ${kernel:+--kernel "$kernel"} --json "$work/tests.json"
rc=$?
cat "$work/tests.out"
[ $rc -eq 0 ] || step_failed "real-driver tests failed or did not finish (exit $rc)"
report

# 3. The built-in workloads with the measured costs, against the A100 model.
if [ -s "$work/probe.json" ]; then
  run replay "$t_replay" "$bundle/bin/fragless-replay" --json --costs "$work/probe.json" \
    workload:transformer-train workload:transformer-infer
  rc=$?
  [ $rc -eq 0 ] || step_failed "the replay with measured costs failed (exit $rc)"
else
  step_failed "no probe results: the replay with measured costs was not run"
fi
report

# 4. PyTorch, when it is installed (looked up without importing it: the first run pays for the import, within
#    its limit) and has CUDA here: the native run exits 3 when torch.cuda.is_available() is False.
if timeout -k 5 10 python3 -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("torch") else 1)' 2>/dev/null; then
  lib="$bundle/lib"
  train() {  # train MODE [ENV...]; its exit status
    local mode="$1"; shift
    run "torch_$mode" "$t_torch" env "$@" PYTHONPATH="$bundle/python" FRAGLESS_LIBRARY="$lib/libfragless.so" \
      python3 "$bundle/gpu_train.py" --mode "$mode" --steps "$steps"
    local rc=$?
    tail -1 "$work/torch_$mode.out"
    if [ $rc -eq 3 ] && [ "$mode" = native ]; then  # PyTorch without CUDA here: no step, no failure
      rm -f "$work/torch_$mode.status"
      return 3
    fi
    [ $rc -eq 0 ] || step_failed "training under $mode failed or did not finish (exit $rc)"
    report
  }
  if train native; [ $? -eq 3 ]; then
    echo "== PyTorch here has no CUDA (above): the training comparison was not run"
  else
    train expandable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    if [ $libs_ok -eq 1 ]; then
      train fragless
      train preload PYTORCH_NO_CUDA_MEMORY_CACHING=1 LD_PRELOAD="$lib/libfragless_preload.so"
      # 5. torch.multiprocessing sends a CUDA tensor fragless allocated to a second process under
      #    fragless.torch.enable() (tests/python/test_torch_share.py: bytes both ways, the receiver's close).
      run torch_share "$t_share" env PYTHONPATH="$bundle/python" FRAGLESS_LIBRARY="$lib/libfragless.so" \
        python3 "$bundle/test_torch_share.py"
      rc=$?
      tail -3 "$work/torch_share.out"
      [ $rc -eq 0 ] || step_failed "the two-process CUDA tensor exchange failed or did not finish (exit $rc)"
      report
    else
      step_failed "fragless, LD_PRELOAD and the CUDA tensor exchange not run: this libstdc++ cannot load the bundle's libraries (above)"
    fi
  fi
else
  echo "== PyTorch is not installed here: the training comparison was not run"
fi

# One table.
python3 - "$out/gpu_check.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
probe, tests, replay, torch_rows = doc["probe"], doc["real_driver_tests"], doc["replay_with_measured_costs"], doc["torch"]
for name, st in doc["steps"].items():
    print("step %-16s exit %3d in %4d s of %4d%s" % (name, st["exit"], st["seconds"], st["limit_s"],
          " (timed out)" if st["timed_out"] else ""))
if probe:
    d = probe["device"]
    print("device: %s, %.1f GiB, granularity %d / %d, driver %d" % (d["name"], d["total_bytes"] / 2**30,
          d["granularity_min"], d["granularity_recommended"], probe["driver"]["version"]))
    print("semantics:", ", ".join("%s=%s" % kv for kv in probe["semantics"].items()))
if tests:
    print("real-driver tests: %d passed, %d failed, %d skipped; kernels: %s" % (tests["passed"], tests["failed"],
          tests["skipped"], tests.get("kernels")))
if replay:
    rows = replay if isinstance(replay, list) else replay.get("results", [])
    for r in rows:
        print("replay %-28s %-10s driver %.1f ms (measured costs)" % (r.get("input", "?"), r.get("policy", "?"),
              r.get("modelled_driver_us", 0) / 1000))
if torch_rows:
    base = next((r for r in torch_rows if r["mode"] == "native"), None)
    print("%-11s %12s %12s %9s %9s %13s %7s %s" % ("allocator", "peak res MiB", "peak all MiB", "frag@pk", "step ms",
          "alloc+free us", "shapes", "losses == native; checks"))
    for r in torch_rows:
        same = base is not None and r["losses"] == base["losses"]
        pa = "-" if not r["peak_allocated"] else "%.0f" % (r["peak_allocated"] / 2**20)
        print("%-11s %12.0f %12s %8.2f%% %9.1f %13.2f %7d %s; %s" % (r["mode"], r["peak_reserved"] / 2**20, pa,
              100 * r["fragmentation_at_peak"], 1000 * r["median_step_s"], r["alloc_free_us"],
              r.get("distinct_shapes", 0), same, r.get("checks")))
    # Where each row's peaks come from (gpu_train.py: after the warm-up steps, inside every step), and what
    # did not pass where it is known not to work.
    for r in torch_rows:
        print("%s: peaks over steps %d to %d from %s" % (r["mode"], r.get("warmup_steps", 0) + 1, r.get("steps", 0),
              r.get("peak_source", "?")))
        for name, why in sorted((r.get("known_unsupported") or {}).items()):
            print("%s: %s did not pass, known unsupported: %s" % (r["mode"], name, why))
        if r.get("failed_checks"):
            print("%s: FAILED checks: %s" % (r["mode"], ", ".join(r["failed_checks"])))
print("written:", sys.argv[1])
PY
if [ $failed -ne 0 ]; then
  echo "gpu_check: FAILED (see the steps above and gpu_check.json)"
  exit 1
fi
echo "gpu_check: every step that ran passed"
exit 0
