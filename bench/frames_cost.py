"""The cost of history and stack frames per allocation + free, at a Python depth of 50 frames, on the host
driver, for each setting of fragless.record_history, in three ways of calling the allocator:

  held      libfragless's C ABI through ctypes.PyDLL: the caller holds the GIL during the call;
  released  through ctypes.CDLL, which releases the GIL, as PyTorch's generated bindings do: fragless takes
            the GIL to read the Python frames (Note [Taking the GIL for Python frames], stacks.cpp);
  torch     torch.empty(...) through PyTorch's own bindings, libfragless.so as PyTorch's CPU allocator
            (needs PyTorch and the probe built with the tests: FRAGLESS_CPU_PROBE=build/lib/libfragless_cpu_probe.so).

Prints microseconds per malloc+free pair and the extra over history off, per way and setting. Compare the
differences, not the absolute numbers (they include ctypes' or PyTorch's own call cost). The settings take
turns, round after round, and each keeps its best round, so drift on a noisy machine touches all alike.

  FRAGLESS_LIBRARY=build/lib/libfragless.so [FRAGLESS_CPU_PROBE=...] /usr/bin/python3 bench/frames_cost.py [PAIRS]
"""
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_plugin", "python"))
os.environ.setdefault("FRAGLESS_CONF", "driver:host,capacity_mb:1024")
import fragless  # noqa: E402

PAIRS = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
DEPTH = 48  # + the loop and the module: 50 Python frames


def ctypes_pair(lib):
    lib.fragless_malloc.restype = ctypes.c_void_p
    lib.fragless_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.fragless_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    malloc, free = lib.fragless_malloc, lib.fragless_free

    def loop(n):
        t0 = time.perf_counter()
        for _ in range(n):
            free(malloc(4096, 0, None), 4096, 0, None)
        return time.perf_counter() - t0
    return loop


def torch_pair():
    probe = os.environ.get("FRAGLESS_CPU_PROBE")
    try:
        import torch
    except ImportError:
        return None, "no PyTorch for %s" % sys.executable
    if not probe or not os.path.exists(probe):
        return None, "no FRAGLESS_CPU_PROBE"
    lib = fragless.library()
    p = ctypes.CDLL(probe)
    p.probe_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    p.probe_install(ctypes.cast(lib.fragless_malloc, ctypes.c_void_p), ctypes.cast(lib.fragless_free, ctypes.c_void_p))
    empty, u8 = torch.empty, torch.uint8

    def loop(n):
        t0 = time.perf_counter()
        for _ in range(n):
            empty(4096, dtype=u8)  # allocated and, at once, freed
        return time.perf_counter() - t0
    return loop, None


def at_depth(d, fn, n):
    return at_depth(d - 1, fn, n) if d > 0 else fn(n)


ways = [("held", ctypes_pair(ctypes.PyDLL(fragless.library_path()))),
        ("released", ctypes_pair(ctypes.CDLL(fragless.library_path())))]
t, why = torch_pair()
if t:
    ways.append(("torch", t))
else:
    print("torch: not measured (%s)" % why)
settings = [("history off", None), ("history on, no frames", (None, "all")),
            ("frames: Python (context alloc)", ("alloc", "python")), ("frames: C++ (context alloc)", ("alloc", "cpp")),
            ("frames: Python + C++ (context alloc)", ("alloc", "all")), ("frames: Python + C++ (context all)", ("all", "all"))]
for _, fn in ways:
    fn(2000)  # warm up
best = {(w, name): float("inf") for w, _ in ways for name, _ in settings}
for _ in range(5):
    for name, s in settings:
        if s is None:
            fragless.record_history(0)
        else:
            fragless.record_history(100000, context=s[0], stacks=s[1])
        for w, fn in ways:
            best[(w, name)] = min(best[(w, name)], at_depth(DEPTH, fn, PAIRS) / PAIRS * 1e6)
fragless.record_history(0)
for w, _ in ways:
    base = best[(w, settings[0][0])]
    print("%s:" % w)
    for name, _ in settings:
        print("  %-40s %8.2f us per malloc+free   +%6.2f us" % (name, best[(w, name)], best[(w, name)] - base))
