#!/usr/bin/env bash
# The GPU check, run on a GPU machine from a bundle built on a CPU one (tools/gpu_bundle.sh), without building:
#   bash gpu-bundle/gpu_check.sh [BUNDLE]       (BUNDLE: default, the folder this script is in, or gpu-bundle/)
# 1. the driver probe (tools/gpu_probe.cpp): granularity, VMM attributes, call costs, the contract's questions;
# 2. the real-driver tests (tools/gpu_tests.cpp: conformance, OOM, integrity with patterns through cuMemcpy,
#    record_stream with a real kernel on two streams, a graph capture on a real stream), every policy;
# 3. the built-in workloads replayed with the measured costs instead of the A100 model;
# 4. when PyTorch with CUDA is importable: training over batches whose shapes really vary under native,
#    native + expandable_segments, fragless (CUDAPluggableAllocator) and fragless (LD_PRELOAD), plus the
#    memory API, a snapshot and a CUDA graph under each (tools/gpu_train.py).
# Writes gpu_check.json (and gpu_probe.json) into $OUT when set (the device tool's output folder), else the
# current folder, and prints one table. At most about 8 minutes on one GPU; without a GPU it says so and
# exits 77 within seconds. It builds from source only when the bundle is missing and a compiler is there.
# FRAGLESS_LIBCUDA points it at another libcuda (the test double, in CI).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bundle="${1:-}"
if [ -z "$bundle" ]; then
  if [ -x "$here/bin/fragless-gpu-probe" ]; then bundle="$here"; else bundle="$here/../gpu-bundle"; fi
fi
out="${OUT:-$PWD}"
mkdir -p "$out"
steps="${FRAGLESS_GPU_STEPS:-40}"
t_start=$(date +%s)
left() { echo $((480 - ($(date +%s) - t_start))); }  # seconds of the 8-minute budget left

if [ ! -x "$bundle/bin/fragless-gpu-probe" ]; then
  src="$(cd "$here/.." 2>/dev/null && pwd)"
  if [ -f "$src/tools/gpu_bundle.sh" ] && command -v cmake >/dev/null && command -v c++ >/dev/null; then
    echo "== no bundle at $bundle: building one from $src"
    bash "$src/tools/gpu_bundle.sh" "$bundle" || { echo "gpu_check: building the bundle failed"; exit 1; }
  else
    echo "gpu_check: no bundle at $bundle and no compiler to build one (run tools/gpu_bundle.sh first)"
    exit 1
  fi
fi
bundle="$(cd "$bundle" && pwd)"
echo "== $(date -u +%Y-%m-%dT%H:%MZ) bundle: $(sed -n 2p "$bundle/MANIFEST" 2>/dev/null)"

# 1. The driver probe. 77: no driver or no device.
kernel="$bundle/lib/fragless_kernels.fatbin"
[ -f "$kernel" ] || kernel=""
timeout 240 "$bundle/bin/fragless-gpu-probe" ${kernel:+--kernel "$kernel"} --out "$out/gpu_probe.json"
rc=$?
if [ $rc -eq 77 ]; then
  echo "SKIPPED: no GPU here; nothing was measured"
  exit 77
fi
[ $rc -eq 0 ] || echo "gpu_check: the probe failed (exit $rc); going on with what it wrote"

# 2. The real-driver tests.
timeout 180 "$bundle/bin/fragless-gpu-tests" ${kernel:+--kernel "$kernel"} --json "$out/gpu_tests.json" ||
  echo "gpu_check: real-driver tests failed (see above)"

# 3. The built-in workloads with the measured costs, against the A100 model.
replay_json="$out/gpu_replay.json"
if [ -s "$out/gpu_probe.json" ]; then
  timeout 120 "$bundle/bin/fragless-replay" --json --costs "$out/gpu_probe.json" \
    workload:transformer-train workload:transformer-infer > "$replay_json" 2>"$out/gpu_replay.err" ||
    echo "gpu_check: the replay with measured costs failed (see gpu_replay.err)"
fi

# 4. PyTorch, when it is importable with CUDA.
torch_json="$out/gpu_torch.jsonl"
: > "$torch_json"
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  lib="$bundle/lib"
  run() {  # run MODE [ENV...]
    local mode="$1"; shift
    local budget; budget=$(( $(left) / 2 ))
    [ "$budget" -gt 20 ] || { echo "gpu_check: no time left for $mode"; return; }
    env "$@" PYTHONPATH="$bundle/python" FRAGLESS_LIBRARY="$lib/libfragless.so" \
      timeout "$budget" python3 "$bundle/gpu_train.py" --mode "$mode" --steps "$steps" 2>"$out/gpu_$mode.err" |
      tail -1 >> "$torch_json" || true
  }
  run native
  run expandable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  run fragless
  run preload PYTORCH_NO_CUDA_MEMORY_CACHING=1 LD_PRELOAD="$lib/libfragless_preload.so"
else
  echo "== PyTorch with CUDA is not importable here: the training comparison was not run"
fi

# One JSON and one table.
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    try:
        return json.load(open(p))
    except Exception:
        return None
probe = load("gpu_probe.json")
tests = load("gpu_tests.json")
replay = load("gpu_replay.json")
torch_rows = []
p = os.path.join(out, "gpu_torch.jsonl")
if os.path.exists(p):
    for line in open(p):
        if line.startswith("{"):
            torch_rows.append(json.loads(line))
json.dump({"schema": "fragless-gpu-check/1", "probe": probe, "real_driver_tests": tests,
           "replay_with_measured_costs": replay,
           "torch": torch_rows}, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
if probe:
    d = probe["device"]
    print("device: %s, %.1f GiB, granularity %d / %d, driver %d" % (d["name"], d["total_bytes"] / 2**30,
          d["granularity_min"], d["granularity_recommended"], probe["driver"]["version"]))
    print("semantics:", ", ".join("%s=%s" % kv for kv in probe["semantics"].items()))
if tests:
    print("real-driver tests: %d passed, %d failed, %d skipped" % (tests["passed"], tests["failed"], tests["skipped"]))
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
print("written:", os.path.join(out, "gpu_check.json"))
PY
