"""Checks the files tools/gpu_check.sh writes (gpu_check.json, gpu_probe.json) against their schema, so a run
on a GPU cannot fail on a typo: every key the docs and fragless-replay --costs read is there, with its type.
Usage: check_gpu_json.py OUT_DIR"""
import json
import os
import sys
from checks import check  # noqa: E402

out = sys.argv[1]
gc = json.load(open(os.path.join(out, "gpu_check.json")))
check(gc["schema"] == "fragless-gpu-check/1", gc.get("schema"))
probe = gc["probe"]
check(probe == json.load(open(os.path.join(out, "gpu_probe.json"))))
check(probe["schema"] == "fragless-gpu-probe/1")
check(isinstance(probe["date"], str) and isinstance(probe["driver"]["version"], int))
dev = probe["device"]
for k in ("index", "total_bytes", "free_bytes", "granularity_min", "granularity_recommended"):
    check(isinstance(dev[k], int) and dev[k] >= 0, (k, dev[k]))
for k in ("vmm", "posix_fd_handles", "gpudirect_rdma_with_vmm"):
    check(isinstance(dev[k], bool), (k, dev[k]))
calls = ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
         "cuMemAddressFree")
for c in calls:
    by_size = probe["costs_us"][c]
    check(str(2 << 20) in by_size, (c, list(by_size)))
    for size, st in by_size.items():
        check(int(size) % dev["granularity_min"] == 0)
        check(st["n"] > 0 and 0 <= st["median"] <= st["p99"], (c, size, st))
for n in ("1", "8", "64"):
    st = probe["set_access_adjacent_us"][n]
    check(st["n"] > 0 and st["median"] >= 0, (n, st))
for k in ("event_record_query_us", "stream_synchronize_idle_us"):
    check(probe[k]["n"] > 0, k)
sem = probe["semantics"]
for k in ("map_nonzero_offset", "map_partial_handle", "unmap_several_mappings", "coherent_two_addresses",
          "unmap_waits_for_kernel", "release_waits_for_kernel", "set_access_waits_for_kernel"):
    check(k in sem and (sem[k] is None or isinstance(sem[k], bool)), (k, sem.get(k)))
check(sem["coherent_two_addresses"] is True and sem["unmap_several_mappings"] is True, sem)
check(isinstance(probe["notes"], list) and probe["failure"] is None, probe["failure"])
tests = gc["real_driver_tests"]
check(tests["failed"] == 0 and tests["passed"] >= 12, tests)
check(all(t["result"] in ("PASSED", "SKIPPED") for t in tests["tests"]), tests)
rows = gc["replay_with_measured_costs"]["results"]
check({r["policy"] for r in rows} == {"classic", "expandable", "fragless"}, rows)
check(all(r["modelled_driver_us"] > 0 for r in rows))
check(isinstance(gc["torch"], list))
for r in gc["torch"]:
    for k in ("mode", "peak_reserved", "median_step_s", "alloc_free_us", "distinct_shapes", "checks", "losses"):
        check(k in r, k)
print("gpu_check.json and gpu_probe.json follow their schema (%d cost rows, %d replay rows, %d torch rows)"
      % (sum(len(v) for v in probe["costs_us"].values()), len(rows), len(gc["torch"])))
