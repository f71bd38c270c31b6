"""Stack frames in snapshots (fragless.record_history's context and stacks, what _record_memory_history asks
for): C++ frames of the allocating thread, and its Python frames when it holds the GIL (ctypes.PyDLL keeps
the GIL during the call, as PyTorch's bindings do); frames of frees only with context "all"; none when off.
The snapshots must still satisfy the viewer's rules. Run with FRAGLESS_LIBRARY set; the host driver."""
import ctypes
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "torch_plugin", "python"))
sys.path.insert(0, HERE)
os.environ["FRAGLESS_CONF"] = "driver:host,capacity_mb:512"
import fragless  # noqa: E402
import viewer_rules  # noqa: E402
from checks import check  # noqa: E402

with_gil = ctypes.PyDLL(fragless.library_path())
with_gil.fragless_malloc.restype = ctypes.c_void_p
with_gil.fragless_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
with_gil.fragless_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
no_gil = fragless.library()  # ctypes.CDLL: the GIL is released during the call
MiB = 1 << 20


def allocate_here(lib, n):
    return lib.fragless_malloc(n, 0, None)


def allocate_from_a_caller(lib, n):
    return allocate_here(lib, n)


def free_here(lib, p, n):
    lib.fragless_free(p, n, 0, None)


def history():
    trace = fragless.snapshot()["device_traces"][0]
    check(len(trace) < 1000, "the history is full: older entries were dropped, positions moved")
    return trace


def since(before, actions, addr):
    """The entries the last operations added (after the first `before` entries) for the block at addr."""
    return [e for e in history()[before:] if e["action"] in actions and e["addr"] == addr]


def the_alloc(before, addr):
    got = since(before, ("alloc",), addr)
    check(len(got) == 1, "%d alloc entries for %#x, wanted the one just made" % (len(got), addr))
    return got[0]


def the_frees(before, addr):
    got = since(before, ("free_requested", "free_completed"), addr)
    check(got, "no free entry for %#x" % addr)
    return got


def names(frames):
    return [f["name"] for f in frames]


# context "all", stacks "all": C++ and Python frames at allocation and at free.
fragless.record_history(1000, context="all", stacks="all")
before = len(history())
p = allocate_from_a_caller(with_gil, 3 * MiB)
frames = the_alloc(before, p)["frames"]
n = names(frames)
check("allocate_here" in n and "allocate_from_a_caller" in n, n)
check(n.index("allocate_here") < n.index("allocate_from_a_caller"), "innermost first: %s" % n)
check(any("fragless_malloc" in x for x in n), "no C++ frame names fragless_malloc: %s" % n)
here = [f for f in frames if f["name"] == "allocate_here"][0]
check(here["filename"].endswith("test_frames.py") and here["line"] == allocate_here.__code__.co_firstlineno + 1, here)
check(all(set(f) == {"filename", "line", "name"} for f in frames), frames[0])
block = [b for s in fragless.snapshot()["segments"] for b in s["blocks"] if b["state"] == "active_allocated"][0]
check("allocate_here" in names(block["frames"]), block)
before = len(history())
free_here(with_gil, p, 3 * MiB)
freed = the_frees(before, p)
check(any("free_here" in names(e["frames"]) for e in freed), freed)

# Without the GIL (ctypes.CDLL) there are no Python frames, the C++ ones remain.
before = len(history())
p = allocate_from_a_caller(no_gil, MiB)
n = names(the_alloc(before, p)["frames"])
check("allocate_here" not in n and any("fragless_malloc" in x for x in n), n)
no_gil.fragless_free(p, MiB, 0, None)

# stacks "python": Python frames only; context "alloc": no frames on frees.
fragless.record_history(1000, context="alloc", stacks="python")
before = len(history())
p = allocate_from_a_caller(with_gil, MiB)
n = names(the_alloc(before, p)["frames"])
check(n[0] == "allocate_here" and not any("fragless_malloc" in x for x in n), n)
before = len(history())
free_here(with_gil, p, MiB)
freed = the_frees(before, p)
check(all(e["frames"] == [] for e in freed), freed)

# Off (context None): events, no frames.
fragless.record_history(1000)
before = len(history())
p = allocate_from_a_caller(with_gil, MiB)
check(the_alloc(before, p)["frames"] == [])
before = len(history())
free_here(with_gil, p, MiB)
check(all(e["frames"] == [] for e in the_frees(before, p)))

# Bad arguments are clear errors.
for kw, want in (({"context": "some"}, "context must be"), ({"stacks": "java"}, "stacks must be")):
    try:
        fragless.record_history(10, **kw)
        raise AssertionError("%r was accepted" % (kw,))
    except ValueError as e:
        check(want in str(e), e)

# A snapshot with frames still satisfies the viewer.
fragless.record_history(5000, context="all", stacks="all")
live = [allocate_from_a_caller(with_gil, (i % 7 + 1) * MiB // 3) for i in range(40)]
for i, q in enumerate(live[::2]):
    free_here(with_gil, q, ((2 * i) % 7 + 1) * MiB // 3)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "frames.pickle")
    fragless.dump_snapshot(path)
    problems = viewer_rules.check(path)
    check(not problems, problems[:5])
print("stack frames in snapshots: all checks passed")
