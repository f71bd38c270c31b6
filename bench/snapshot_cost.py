"""The cost of a snapshot with stack frames: the time fragless.snapshot_bytes() takes and the size of what it
returns, after EVENTS history entries of allocations made through PyTorch's own bindings (libfragless.so as
PyTorch's CPU allocator, through the probe built with the tests) at a Python depth of 20 frames, for C++
frames, Python frames and both (context "all"). Each setting runs in a fresh process, so no setting's tables
warm another's. A snapshot names every frame it holds (C++ ones with dladdr) and writes each frame once.

  FRAGLESS_LIBRARY=build/lib/libfragless.so FRAGLESS_CPU_PROBE=build/lib/libfragless_cpu_probe.so \\
      /usr/bin/python3 bench/snapshot_cost.py [EVENTS]
"""
import ctypes
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def one(events, stacks):
    sys.path.insert(0, os.path.join(HERE, "..", "torch_plugin", "python"))
    os.environ.setdefault("FRAGLESS_CONF", "driver:host,capacity_mb:1024,background:False")
    import fragless
    import torch
    lib = fragless.library()
    probe = ctypes.CDLL(os.environ["FRAGLESS_CPU_PROBE"])
    probe.probe_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    probe.probe_install(ctypes.cast(lib.fragless_malloc, ctypes.c_void_p), ctypes.cast(lib.fragless_free, ctypes.c_void_p))
    torch.set_num_threads(1)
    fragless.record_history(max_entries=events, context="all", stacks=stacks)
    keep = []

    def allocate(n):
        for _ in range(n):
            keep.append(torch.empty(1 << 16, dtype=torch.uint8))
            if len(keep) > 64:
                keep.pop(0)

    def at_depth(d, n):
        return at_depth(d - 1, n) if d > 0 else allocate(n)
    at_depth(18, events // 2 + 64)  # an allocation and a free per event pair: the ring is full
    t0 = time.perf_counter()
    data = fragless.snapshot_bytes()
    took = time.perf_counter() - t0
    print("%-8s %7d events  snapshot %7.2f s  %9.2f MB" % (stacks, events, took, len(data) / 1e6), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        one(int(sys.argv[1]), sys.argv[2])
        sys.exit(0)
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("snapshot_cost: no PyTorch for %s (use Debian's /usr/bin/python3)" % sys.executable)
    if not os.path.exists(os.environ.get("FRAGLESS_CPU_PROBE", "")):
        sys.exit("snapshot_cost: set FRAGLESS_CPU_PROBE to the probe built with the tests")
    events = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
    for stacks in ("python", "cpp", "all"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), str(events), stacks])
        if r.returncode != 0:
            sys.exit(r.returncode)
