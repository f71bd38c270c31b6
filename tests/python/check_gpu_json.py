"""Checks what tools/gpu_check.sh hands back against its schema, so a run on a GPU cannot fail on a typo:
exactly gpu_check.json and gpu_check.log in OUT_DIR, every step with its exit status, time, limit and stderr,
and every key the docs and fragless-replay --costs read, with its type.
Usage: check_gpu_json.py OUT_DIR [--expect-failure]  (the latter: a run in which a real-driver test was made
to fail: the files and the failure must be there)"""
import json
import os
import sys
from checks import check  # noqa: E402

out = sys.argv[1]
expect_failure = "--expect-failure" in sys.argv[2:]
check(sorted(os.listdir(out)) == ["gpu_check.json", "gpu_check.log"], os.listdir(out))
gc = json.load(open(os.path.join(out, "gpu_check.json")))
check(gc["schema"] == "fragless-gpu-check/2", gc.get("schema"))
check(isinstance(gc["manifest"], str) and "glibc: " in gc["manifest"], gc.get("manifest"))
steps = gc["steps"]
check({"probe", "tests", "replay"} <= set(steps), list(steps))
check(sum(st["limit_s"] for st in steps.values()) <= 460, steps)  # 460 s of steps + 20 s for the report
for name, st in steps.items():
    for k, t in (("exit", int), ("seconds", int), ("limit_s", int), ("timed_out", bool), ("stderr", str)):
        check(isinstance(st[k], t), (name, k, st.get(k)))
    check(st["seconds"] <= st["limit_s"] + 5, (name, st))
log = open(os.path.join(out, "gpu_check.log")).read()
check("real-driver tests:" in log, log[-2000:])
tests = gc["real_driver_tests"]
if expect_failure:
    check(tests["failed"] >= 1 and steps["tests"]["exit"] != 0, (tests, steps["tests"]))
    check("gpu_check: FAILED" in log, log[-2000:])
    print("a failed real-driver test is in gpu_check.json and gpu_check.log (%d failed)" % tests["failed"])
    sys.exit(0)
check(all(st["exit"] == 0 for st in steps.values()), steps)
check("gpu_check: every step that ran passed" in log, log[-2000:])
probe = gc["probe"]
check(probe["schema"] == "fragless-gpu-probe/1", probe.get("schema"))
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
for k in ("event_record_query_us", "stream_synchronize_idle_us", "mem_get_info_us"):
    check(probe[k]["n"] > 0, k)
sem = probe["semantics"]
for k in ("map_nonzero_offset", "map_partial_handle", "unmap_several_mappings", "coherent_two_addresses",
          "unmap_waits_for_kernel", "release_waits_for_kernel", "set_access_waits_for_kernel"):
    check(k in sem and (sem[k] is None or isinstance(sem[k], bool)), (k, sem.get(k)))
check(sem["coherent_two_addresses"] is True and sem["unmap_several_mappings"] is True, sem)
check(isinstance(probe["notes"], list) and probe["failure"] is None, probe["failure"])
check(tests["failed"] == 0 and tests["passed"] >= 12, tests)
check(all(t["result"] in ("PASSED", "SKIPPED") for t in tests["tests"]), tests)
rows = gc["replay_with_measured_costs"]["results"]
check({r["policy"] for r in rows} == {"classic", "expandable", "fragless"}, rows)
check(all(r["modelled_driver_us"] > 0 for r in rows))
check(isinstance(gc["torch"], list))
for r in gc["torch"]:
    for k in ("mode", "peak_reserved", "median_step_s", "alloc_free_us", "distinct_shapes", "checks", "losses"):
        check(k in r, k)
print("gpu_check.json and gpu_check.log follow their schema (%d cost rows, %d replay rows, %d torch rows)"
      % (sum(len(v) for v in probe["costs_us"].values()), len(rows), len(gc["torch"])))
