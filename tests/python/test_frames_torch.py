"""Python frames where PyTorch records them: through PyTorch's own generated bindings, which release the GIL
around the operator that allocates. libfragless.so (host driver) is made PyTorch's CPU allocator by a probe
(FRAGLESS_CPU_PROBE, tests/python/oom_probe.cpp), so torch.empty, torch.randn, torch.ones and arithmetic
call fragless_malloc from inside PyTorch exactly as CUDAPluggableAllocator does on a GPU. Checked: every
tensor a named Python function makes carries that function's frame with the line that made it; frees carry
frames with context "all" and none with "alloc"; no deadlock while another Python thread holds the GIL and
allocates (the run has a watchdog). Exits 77 (skipped) without PyTorch or the probe. Run with
FRAGLESS_LIBRARY and FRAGLESS_CPU_PROBE set."""
import ctypes
import faulthandler
import threading
import time

from torch_prologue import check, fragless_as_cpu_allocator, torch  # exits 77 (skipped) without PyTorch
lib = fragless_as_cpu_allocator()  # exits 77 without the probe; a hang fails with every thread's stack
import fragless  # noqa: E402
N = 1 << 18  # elements: every tensor below is at least 1 MiB, larger than anything PyTorch allocates besides


def make_tensors():
    a = torch.empty(N)
    b = torch.randn(N)
    c = torch.ones(N, dtype=torch.float64)
    d = a + b
    e = torch.zeros(N, dtype=torch.int32)
    f = c * 2
    return [a, b, c, d, e, f]


first = make_tensors.__code__.co_firstlineno
WANT_LINES = [first + 1 + i for i in range(6)]


def tensor_allocs(trace):
    return [e for e in trace if e["action"] == "alloc" and e["size"] >= N * 4]


def frames_of(entry, name):
    return [f for f in entry["frames"] if f["name"] == name]


# context "all", Python and C++ frames.
fragless.record_history(100000, context="all", stacks="all")
before = len(fragless.snapshot()["device_traces"][0])
tensors = make_tensors()
trace = fragless.snapshot()["device_traces"][0][before:]
allocs = tensor_allocs(trace)
check(len(allocs) == 6, [(e["size"], [f["name"] for f in e["frames"]][:4]) for e in allocs])
lines = []
for e in allocs:
    mine = frames_of(e, "make_tensors")
    check(mine, "an allocation made by make_tensors has no frame of it: %s" % [f["name"] for f in e["frames"]])
    check(mine[0]["filename"].endswith("test_frames_torch.py"), mine[0])
    lines.append(mine[0]["line"])
    check(frames_of(e, "<module>"), "the caller's frame is missing")
    check(any(f["name"] == "fragless_malloc" for f in e["frames"]), "no C++ frame")
check(lines == WANT_LINES, "lines %s, expected %s" % (lines, WANT_LINES))
print("6 tensors made through PyTorch's bindings: each has make_tensors's frame at its own line %s" % lines)


def drop(ts):
    ts.clear()


addresses = {e["addr"] for e in allocs}
drop(tensors)
trace = fragless.snapshot()["device_traces"][0]
frees = [e for e in trace if e["action"] in ("free_requested", "free_completed") and e["addr"] in addresses]
check(frees and all(frames_of(e, "drop") for e in frees), [[f["name"] for f in e["frames"]][:6] for e in frees])
print("their frees (context all): %d events, each with the frame of the function that dropped them" % len(frees))

# context "alloc": frames on allocations, and on frees the allocation's, not the free's own (PyTorch's free()
# passes context_when_allocated when it gathered none).
fragless.record_history(100000, context="alloc", stacks="python")
before = len(fragless.snapshot()["device_traces"][0])
tensors = make_tensors()
addresses = {e["addr"] for e in tensor_allocs(fragless.snapshot()["device_traces"][0][before:])}
drop(tensors)
trace = fragless.snapshot()["device_traces"][0][before:]
check(all(frames_of(e, "make_tensors") for e in tensor_allocs(trace)))
freed = [e for e in trace if e["action"] in ("free_requested", "free_completed") and e["addr"] in addresses]
check(freed and all(frames_of(e, "make_tensors") and not frames_of(e, "drop") for e in freed),
      [[f["name"] for f in e["frames"]][:6] for e in freed])
check(all(not any(f["name"] == "fragless_malloc" for f in e["frames"]) for e in tensor_allocs(trace)), "C++ frames")

# Another Python thread holds the GIL and allocates (ctypes.PyDLL keeps the GIL across the call) while this
# one allocates through PyTorch, which releases it: fragless takes the GIL with no lock of its own held.
fragless.record_history(100000, context="all", stacks="all")
with_gil = ctypes.PyDLL(fragless.library_path())
with_gil.fragless_malloc.restype = ctypes.c_void_p
with_gil.fragless_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
with_gil.fragless_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
stop = time.monotonic() + 3
counts = [0, 0]


def hold_gil_and_allocate():
    while time.monotonic() < stop:
        for _ in range(200):  # many calls per GIL switch interval, holding the GIL throughout each
            with_gil.fragless_free(with_gil.fragless_malloc(1 << 16, 0, None), 1 << 16, 0, None)
        counts[0] += 200


t = threading.Thread(target=hold_gil_and_allocate)
t.start()
while time.monotonic() < stop:
    x = torch.empty(N) + 1
    counts[1] += 1
t.join(timeout=60)
check(not t.is_alive(), "the GIL-holding thread did not finish")
check(counts[0] > 0 and counts[1] > 0, counts)
del x
print("no deadlock: %d allocations holding the GIL in one thread, %d tensor ops in another" % tuple(counts))
faulthandler.cancel_dump_traceback_later()
print("Python frames through PyTorch's bindings: all checks passed")
