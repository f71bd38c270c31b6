"""The cost of history and stack frames per allocation + free, through libfragless's C ABI called from
Python with the GIL held (ctypes.PyDLL, as PyTorch's bindings call the allocator), at a Python depth of 50
frames, on the sim driver. Prints one line per setting: microseconds per malloc+free pair, and the extra
over history off. Compare the differences, not the absolute numbers (they include ctypes' own call cost).

  FRAGLESS_LIBRARY=build/lib/libfragless.so python3 bench/frames_cost.py [PAIRS]
"""
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_plugin", "python"))
os.environ.setdefault("FRAGLESS_CONF", "driver:sim")
import fragless  # noqa: E402

lib = ctypes.PyDLL(fragless.library_path())
lib.fragless_malloc.restype = ctypes.c_void_p
lib.fragless_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.fragless_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
malloc, free = lib.fragless_malloc, lib.fragless_free
PAIRS = int(sys.argv[1]) if len(sys.argv) > 1 else 20000


def loop(n):
    t0 = time.perf_counter()
    for _ in range(n):
        free(malloc(4096, 0, None), 4096, 0, None)
    return time.perf_counter() - t0


def at_depth(d, n):
    return at_depth(d - 1, n) if d > 0 else loop(n)


settings = [("history off", None), ("history on, no frames", (None, "all")),
            ("frames: Python (context alloc)", ("alloc", "python")), ("frames: C++ (context alloc)", ("alloc", "cpp")),
            ("frames: Python + C++ (context alloc)", ("alloc", "all")), ("frames: Python + C++ (context all)", ("all", "all"))]
loop(2000)  # warm up
# The settings take turns, round after round, and each keeps its best round: drift on a noisy machine then
# touches every setting alike.
best = {name: float("inf") for name, _ in settings}
for _ in range(7):
    for name, s in settings:
        if s is None:
            fragless.record_history(0)
        else:
            fragless.record_history(100000, context=s[0], stacks=s[1])
        t = at_depth(48, PAIRS) / PAIRS * 1e6  # 48 + the two of the loop: 50 frames
        best[name] = min(best[name], t)
base = best[settings[0][0]]
for name, _ in settings:
    print("%-40s %8.2f us per malloc+free   +%6.2f us" % (name, best[name], best[name] - base))
