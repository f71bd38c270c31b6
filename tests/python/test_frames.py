"""Stack frames in snapshots (fragless.record_history's context and stacks, what _record_memory_history asks
for): C++ frames of the allocating thread, and its Python frames whether it holds the GIL (ctypes.PyDLL
keeps it during the call) or released it (ctypes.CDLL, as PyTorch's generated bindings do: fragless takes
the GIL for the walk); none from a thread with no Python state (FRAGLESS_FRAMES_HELPER, a pure C++ thread),
none and no hang at interpreter shutdown; frames of frees only with context "all"; none when off. The
snapshots must still satisfy the viewer's rules. (The same through PyTorch's own bindings:
test_frames_torch.py.) Run with FRAGLESS_LIBRARY set; the host driver."""
import ctypes
import os
import subprocess
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
# Python frames among the C++ frames as PyTorch's CapturedTraceback symbolize puts them
# (torch/csrc/profiler/combined_traceback.cpp): each C++ frame of the interpreter's frame evaluator (a name
# containing PyEval_EvalFrame) is preceded by the next Python frame, innermost first; the rest follow the C++
# frames. Python frames are those with a .py file (C++ frames name a library).
is_python = [f["filename"].endswith(".py") for f in frames]
evals = [i for i, x in enumerate(n) if "PyEval_EvalFrame" in x and not is_python[i]]
if not evals:
    print("SKIPPED (loudly): no C++ frame of this Python (%s) is named PyEval_EvalFrame*: the Python frames all "
          "follow the C++ ones" % sys.executable)
else:
    check(n[evals[0] - 1] == "allocate_here", "the innermost Python frame must come just before the first "
          "frame evaluator: %s" % n)
    last_cpp = max(i for i, py in enumerate(is_python) if not py)
    check(sum(is_python[:last_cpp]) == min(len(evals), sum(is_python)),
          "one Python frame before each frame evaluator, the rest after the C++ frames: %s" % n)
    check(all(is_python[evals[k] - 1] for k in range(min(len(evals), sum(is_python)))), n)
before = len(history())
free_here(with_gil, p, 3 * MiB)
freed = the_frees(before, p)
check(any("free_here" in names(e["frames"]) for e in freed), freed)

# Without the GIL (ctypes.CDLL releases it for the call): fragless takes it to read the Python frames.
before = len(history())
p = allocate_from_a_caller(no_gil, MiB)
frames = the_alloc(before, p)["frames"]
n = names(frames)
check("allocate_here" in n and "allocate_from_a_caller" in n and any("fragless_malloc" in x for x in n), n)
here = [f for f in frames if f["name"] == "allocate_here"][0]
check(here["line"] == allocate_here.__code__.co_firstlineno + 1, here)
before = len(history())
free_here(no_gil, p, MiB)
check(any("free_here" in names(e["frames"]) for e in the_frees(before, p)), "no free_here frame on the free")

# The C++ frames reach the process's entry point: the unwinder walks the whole stack (PyTorch's viewer
# drops _start and __libc_start_main; they must be there to drop).
check(any(x in ("_start", "__libc_start_main") for x in n), n)

# A thread with no Python state gets C++ frames only (fragless never gives it one).
helper = os.environ.get("FRAGLESS_FRAMES_HELPER")
if helper:
    h = ctypes.CDLL(helper)
    h.helper_alloc_on_cpp_thread.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulong]
    before = len(history())
    check(h.helper_alloc_on_cpp_thread(ctypes.cast(no_gil.fragless_malloc, ctypes.c_void_p),
                                       ctypes.cast(no_gil.fragless_free, ctypes.c_void_p), 5 * MiB), "no allocation")
    a = [e for e in history()[before:] if e["action"] == "alloc" and e["size"] == 5 * MiB]
    check(len(a) == 1, a)
    n = names(a[0]["frames"])
    check(n and "<module>" not in n and not any(f["filename"].endswith(".py") for f in a[0]["frames"]), n)
    print("a C++ thread: %d C++ frames, no Python frame" % len(n))
else:
    print("SKIPPED (part): FRAGLESS_FRAMES_HELPER is not set, the pure C++ thread is not checked")

# Interpreter shutdown: daemon threads allocating without the GIL while the interpreter finalizes must
# neither hang nor crash the exit.
SHUTDOWN = r"""
import ctypes, sys, threading
sys.path.insert(0, %r)
import fragless
lib = fragless.library()
fragless.record_history(1000, context="all", stacks="all")
def loop():
    while True:
        lib.fragless_free(lib.fragless_malloc(4096, 0, None), 4096, 0, None)
for _ in range(4):
    threading.Thread(target=loop, daemon=True).start()
import time; time.sleep(0.3)
print("exiting")
"""
pkg = os.path.join(HERE, "..", "..", "torch_plugin", "python")
for attempt in range(5):
    r = subprocess.run([sys.executable, "-c", SHUTDOWN % pkg], capture_output=True, text=True, timeout=60)
    check(r.returncode == 0 and "exiting" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:]))
print("interpreter shutdown with threads allocating: 5 clean exits")

# stacks "python": Python frames only; context "alloc": a free's entries carry the allocation's frames, not the
# free's own, as PyTorch's (free() and free_block() pass context_when_allocated when no context was gathered).
fragless.record_history(1000, context="alloc", stacks="python")
before = len(history())
p = allocate_from_a_caller(with_gil, MiB)
n = names(the_alloc(before, p)["frames"])
check(n[0] == "allocate_here" and not any("fragless_malloc" in x for x in n), n)
before = len(history())
free_here(with_gil, p, MiB)
freed = the_frees(before, p)
check(freed and all(names(e["frames"])[:1] == ["allocate_here"] for e in freed),
      [names(e["frames"])[:2] for e in freed])

# The segment an allocation makes carries that allocation's frames (PyTorch records the malloc's context on
# its segment_alloc and segment_map entries, c10/cuda/CUDACachingAllocator.cpp), so the viewer names its
# allocator; none with context "state", as on the allocation itself.
fragless.empty_cache()
for context, want in (("alloc", True), ("state", False)):
    fragless.record_history(1000, context=context, stacks="python")
    before = len(history())
    p = allocate_from_a_caller(with_gil, 40 * MiB)  # larger than anything cached: a new segment or mapping
    made = [e for e in history()[before:] if e["action"] in ("segment_alloc", "segment_map")]
    check(made, "no segment made for the 40 MiB allocation: %s" % [e["action"] for e in history()[before:]])
    check(all(("allocate_here" in names(e["frames"])) == want for e in made),
          "context %r: frames of the segment entries %s" % (context, [names(e["frames"])[:2] for e in made]))
    # ...and the snapshot's segment that starts there keeps them, with either context (live state): Note
    # [Segment frames] in capi.cpp.
    starts = {e["addr"] for e in made}
    segs = [s for s in fragless.snapshot()["segments"] if s["address"] in starts]
    check(segs, "no segment of the snapshot starts where the 40 MiB allocation's memory was made")
    check(all("allocate_here" in names(s["frames"]) for s in segs),
          "context %r: frames of the segment %s" % (context, [names(s["frames"])[:2] for s in segs]))
    before = len(history())
    free_here(with_gil, p, 40 * MiB)
    fragless.empty_cache()
    # Its release carries them too (PyTorch's segment_free and segment_unmap pass context_when_segment_allocated).
    gone = [e for e in history()[before:] if e["action"] in ("segment_free", "segment_unmap") and e["addr"] in starts]
    check(gone, "no release of the segment at %s: %s" % (starts, [e["action"] for e in history()[before:]]))
    check(all(("allocate_here" in names(e["frames"])) == want for e in gone),
          "context %r: frames of the segment's release %s" % (context, [names(e["frames"])[:2] for e in gone]))

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

# Each frame is written once and shared wherever it recurs, as PyTorch's snapshots share theirs: the 40
# allocations from one call site carry equal frames that are one object each after unpickling, and the
# snapshot is far smaller than its frames written out one by one (it was about 2.7 KB an event).
snap = fragless.snapshot()
allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and "allocate_from_a_caller" in names(e["frames"])]
check(len(allocs) >= 40, len(allocs))
here = [next(f for f in e["frames"] if f["name"] == "allocate_here") for e in allocs]
check(len({id(f) for f in here}) == 1 and all(f == here[0] for f in here), "the frame allocate_here: %d objects" % len({id(f) for f in here}))
frames_total = sum(len(e["frames"]) for e in snap["device_traces"][0])
frame_bytes = sum(len(f["filename"]) + len(f["name"]) for e in snap["device_traces"][0] for f in e["frames"])
size = len(fragless.snapshot_bytes())
check(size < frame_bytes / 2, "a snapshot of %d frames (%d bytes of names) takes %d bytes" % (frames_total, frame_bytes, size))

# A snapshot names each distinct stack once and shares its frames between the events that captured it: stacks
# that differ in one Python line only must still keep their own line (two allocations per call, 50 calls, with
# and without the GIL).
def two_lines(lib, n):
    first = lib.fragless_malloc(n, 0, None)
    second = lib.fragless_malloc(n + 4096, 0, None)
    return first, second


fragless.record_history(500, context="alloc", stacks="python")
made = [two_lines(with_gil if i % 2 else no_gil, MiB) for i in range(50)]
by_addr = {e["addr"]: e for e in fragless.snapshot()["device_traces"][0] if e["action"] == "alloc"}
first_line = two_lines.__code__.co_firstlineno
for first, second in made:
    for p, offset in ((first, 1), (second, 2)):
        f = by_addr[p]["frames"][0]
        check(f["name"] == "two_lines" and f["line"] == first_line + offset, (offset, f))
    free_here(with_gil, first, MiB)
    free_here(with_gil, second, MiB + 4096)
print("stacks that differ in one line: 100 allocations, each with its own line")
print("stack frames in snapshots: all checks passed")
