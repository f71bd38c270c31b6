"""PyTorch's memory API under fragless.torch.enable() takes PyTorch's own parameters and keeps PyTorch's rules,
each read from PyTorch's source (named at each case). Every case runs, and the failures are listed together at
the end.
Host driver, blocks allocated through fragless's C ABI; exits 77 (skipped) where PyTorch is not importable.
Run with FRAGLESS_LIBRARY set."""
import ctypes
import os
import pickle
import sys
import tempfile
import threading
import traceback
import warnings

from torch_prologue import announce, check, torch  # exits 77 (skipped) without PyTorch
import fragless  # noqa: E402
announce()
import fragless.torch  # noqa: E402

MiB = 1 << 20
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fragless.torch.enable("driver:host,capacity_mb:1024,policy:fragless")
lib = fragless.library()
lib.fragless_init(2)
mem = torch.cuda.memory
failures = []


def case(fn):
    try:
        fn()
        print("ok:", fn.__name__)
    except Exception:
        failures.append(fn.__name__)
        print("FAILED:", fn.__name__)
        traceback.print_exc()
    return fn


def alloc(n, device=0):
    p = lib.fragless_malloc(n, device, None)
    check(p, fragless.last_error())
    return p


def free(p, n, device=0):
    lib.fragless_free(p, n, device, None)


def raises(exc, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        return str(e)
    raise AssertionError("%s(%r, %r) raised no %s" % (getattr(fn, "__name__", fn), args, kwargs, exc.__name__))


def trace():
    return mem._snapshot()["device_traces"][0]


keep = [alloc(2 * MiB), alloc(512)]


@case
def memory_snapshot_takes_a_pool_and_include_traces():
    # torch/cuda/memory.py: memory_snapshot(mempool_id=None, include_traces=True); MemPool.snapshot() calls
    # memory_snapshot(self.id, include_traces=include_traces); (0, 0) is every pool, as None is.
    every = torch.cuda.memory_snapshot()
    check(every and all(tuple(s["segment_pool_id"]) == (0, 0) for s in every), [s["segment_pool_id"] for s in every])
    check(torch.cuda.memory_snapshot(None, include_traces=False) == every)
    check(torch.cuda.memory_snapshot((0, 0), include_traces=True) == every)
    check(torch.cuda.memory_snapshot(mempool_id=(3, 4)) == [], "segments of another pool were returned")
    check("mempool_id" in raises(ValueError, torch.cuda.memory_snapshot, (1, 2, 3)))
    for bad in ("ab", 5, (1, "x")):  # not a pair of ints: named, not int()'s or iteration's own error
        check("mempool_id must be a pair of ints" in raises(TypeError, torch.cuda.memory_snapshot, bad), bad)
    check("empty_cache() takes 0 positional arguments" in raises(TypeError, torch.cuda.empty_cache, 0))


@case
def a_snapshot_without_traces_leaves_the_history_out():
    # include_traces=False (and memory_summary) build the segments only: the history is neither named nor
    # written, as PyTorch's "lightweight" snapshot promises.
    import fragless
    mem._record_memory_history(max_entries=1000)
    p = alloc(3 * MiB)
    full, light = fragless.snapshot(), fragless.snapshot(include_traces=False)
    check(len(full["device_traces"][0]) > 0, full["device_traces"])
    check(all(t == [] for t in light["device_traces"]), light["device_traces"])
    check(light["segments"] == full["segments"])
    del p
    mem._record_memory_history(enabled=None)


@case
def snapshot_functions_take_augment_with_fx_traces():
    # torch/cuda/memory.py: _snapshot(device=None, augment_with_fx_traces=False) and
    # _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False), which apply
    # torch._utils._augment_memory_snapshot_stack_traces when the flag is set.
    check("segments" in mem._snapshot(None, False))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.pickle")
        mem._dump_snapshot(path, augment_with_fx_traces=False)
        with open(path, "rb") as f:
            check("segments" in pickle.load(f))
        if hasattr(torch._utils, "_augment_memory_snapshot_stack_traces"):
            check("segments" in mem._snapshot(augment_with_fx_traces=True))
            mem._dump_snapshot(path, augment_with_fx_traces=True)
        else:  # an error naming what is missing, never the flag dropped
            for call in (lambda: mem._snapshot(augment_with_fx_traces=True),
                         lambda: mem._dump_snapshot(path, augment_with_fx_traces=True)):
                check("augment_with_fx_traces" in raises(NotImplementedError, call))
    raises(TypeError, mem._snapshot, None, False, "a third argument")
    raises(TypeError, mem._snapshot, augment_fx=True)


@case
def state_keeps_one_entry():
    # torch/csrc/cuda/memory_snapshot.cpp: max_entries = (enabled && *enabled == "all") ? max_entries : 1
    mem._record_memory_history("state", max_entries=1000)
    ps = [alloc(MiB) for _ in range(4)]
    t = trace()
    check(len(t) == 1 and t[0]["action"] == "alloc" and t[0]["addr"] == ps[-1], [e["action"] for e in t])
    for p in ps:
        free(p, MiB)
    mem._record_memory_history(None)


@case
def legacy_form_defaults_to_one_entry():
    # torch/cuda/memory.py: _record_memory_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
    # ...)
    mem._record_memory_history(True)
    ps = [alloc(MiB) for _ in range(4)]
    t = trace()
    check(len(t) == 1 and t[0]["action"] == "alloc" and t[0]["addr"] == ps[-1], [e["action"] for e in t])
    for p in ps:
        free(p, MiB)
    mem._record_memory_history(False)
    check(trace() == [], "turning history off keeps its entries")


@case
def legacy_form_positional():
    # _record_memory_history(enabled, *args, **kwargs) hands *args to the legacy form for a bool:
    # (True, record_context, trace_alloc_max_entries, trace_alloc_record_context)
    mem._record_memory_history(True, True, 1000, True)
    p = alloc(MiB)
    free(p, MiB)
    t = trace()
    check(len(t) >= 2, [e["action"] for e in t])
    allocs = [e for e in t if e["action"] == "alloc" and e["addr"] == p]
    check(allocs and allocs[0]["frames"], "trace_alloc_record_context=True records frames on allocations")
    mem._record_memory_history(False)


@case
def legacy_record_context_is_state():
    # torch/csrc/cuda/memory_snapshot.cpp, legacy: RecordContext ALLOC with trace_alloc_record_context, else
    # STATE with record_context: frames for live blocks, none on trace entries.
    mem._record_memory_history(True, trace_alloc_max_entries=100)
    p = alloc(3 * MiB)
    check(all(not e["frames"] for e in trace()), "frames on %s" % [e["action"] for e in trace() if e["frames"]])
    blocks = [b for s in mem._snapshot()["segments"] for b in s["blocks"] if b["address"] == p]
    check(blocks and blocks[0]["frames"], "the live block has no frames")
    free(p, 3 * MiB)
    mem._record_memory_history(False)


@case
def context_state_has_no_frames_on_entries():
    # c10/cuda/CUDACachingAllocator.cpp, record_trace: a trace entry keeps its context only when
    # record_context_ >= RecordContext::ALLOC; STATE keeps it for the block (context_when_allocated).
    mem._record_memory_history("all", context="state", max_entries=1000)
    p = alloc(3 * MiB)
    entries = [e for e in trace() if e["action"] == "alloc" and e["addr"] == p]
    check(entries and not entries[0]["frames"], "%d alloc entries, frames on the first: %d" % (
        len(entries), len(entries[0]["frames"]) if entries else 0))
    blocks = [b for s in mem._snapshot()["segments"] for b in s["blocks"] if b["address"] == p]
    check(blocks and blocks[0]["frames"], "a live block keeps its frames with context 'state'")
    free(p, 3 * MiB)
    mem._record_memory_history("all", context="alloc", max_entries=1000)
    p = alloc(3 * MiB)
    entries = [e for e in trace() if e["action"] == "alloc" and e["addr"] == p]
    check(entries and entries[-1]["frames"], "%d alloc entries, none with frames" % len(entries))
    free(p, 3 * MiB)
    mem._record_memory_history(None)


@case
def clear_history_clears():
    # c10/cuda/CUDACachingAllocator.cpp, recordHistory: if (!enabled || clearHistory) the ring is cleared.
    mem._record_memory_history(max_entries=1000)
    p = alloc(MiB)
    free(p, MiB)
    check(len(trace()) >= 2)
    mem._record_memory_history(max_entries=1000)
    check(len(trace()) >= 2, "enabling again without clear_history keeps the entries")
    mem._record_memory_history(max_entries=1000, clear_history=True)
    check(trace() == [], [e["action"] for e in trace()])
    mem._record_memory_history(None)


@case
def unknown_keywords_raise():
    # Each form has its own signature in torch/cuda/memory.py: a keyword it does not have is a TypeError.
    raises(TypeError, mem._record_memory_history, "all", max_entires=10)
    raises(TypeError, mem._record_memory_history, True, trace_alloc_max_entires=10)
    raises(TypeError, mem._record_memory_history, "all", trace_alloc_max_entries=10)
    check("expected context" in raises(RuntimeError, mem._record_memory_history, "all", context="everything"))
    check("expected stacks" in raises(RuntimeError, mem._record_memory_history, "all", stacks="cpp"))
    # max_entries is a size_t in PyTorch's binding (pybind11): a negative, too large or non-int one is a TypeError.
    for bad in (-5, 2**64, "x", 1.5):
        raises(TypeError, mem._record_memory_history, max_entries=bad)
    # What fragless does not record is an error, not ignored.
    check("compile_context" in raises(NotImplementedError, mem._record_memory_history, compile_context=True))
    check("skip_actions" in raises(NotImplementedError, mem._record_memory_history, skip_actions=["alloc"]))
    mem._record_memory_history(max_entries=10, device=0, clear_history=False, skip_actions=[])  # accepted
    mem._record_memory_history(None)
    # The C ABI refuses a context or stacks value it does not know, keeping what was set, and says why.
    mem._record_memory_history(max_entries=1000)
    p = alloc(MiB)
    free(p, MiB)
    # (Each snapshot adds a snapshot entry: those are left out of the count.)
    events = lambda: [e for e in trace() if e["action"] != "snapshot"]
    kept = len(events())
    for context, stacks in ((7, 0), (-1, 0), (2, 4)):
        lib.fragless_record_history_v2(5, context, stacks, 1)
        check("nothing was changed" in fragless.last_error(), fragless.last_error())
        check(len(events()) == kept, "a refused call cleared the history")
    mem._record_memory_history(None)


@case
def memory_fraction_is_fragless_own():
    # torch/cuda/memory.py: get_per_process_memory_fraction(device=None) -> _cuda_getMemoryFraction, which a
    # pluggable allocator does not implement; fragless answers with its own.
    get = torch.cuda.get_per_process_memory_fraction
    check(get() == 1.0 and get(1) == 1.0, (get(), get(1)))
    lib.fragless_set_memory_fraction(0.25, 1)  # what torch.cuda.set_per_process_memory_fraction's hook calls
    check(get("cuda:1") == 0.25 and get(0) == 1.0, (get(1), get(0)))
    check(mem.get_per_process_memory_fraction(torch.device("cuda", 1)) == 0.25)
    lib.fragless_set_memory_fraction(1.0, 1)
    check("invalid device" in raises(RuntimeError, get, 7))
    # The setter too, with PyTorch's rules (torch/cuda/memory.py: a float, in [0, 1]), where the CPU build's own
    # would assert that CUDA is not compiled in.
    torch.cuda.set_per_process_memory_fraction(0.5, "cuda:1")
    check(get(1) == 0.5, get(1))
    check("must be `float`" in raises(TypeError, torch.cuda.set_per_process_memory_fraction, 1, 1))
    check("Allowed range: 0~1" in raises(ValueError, torch.cuda.set_per_process_memory_fraction, 1.5, 1))
    check(get(1) == 0.5, get(1))
    torch.cuda.set_per_process_memory_fraction(1.0, 1)


@case
def memory_summary_changes_nothing_shared():
    # memory_summary must answer from fragless without replacing torch.cuda.memory.memory_stats for the
    # duration: another thread's memory_stats(1) meanwhile answers for device 1.
    if torch.cuda.memory.memory_summary.__doc__ is None or "fragless" not in torch.cuda.memory.memory_summary.__doc__:
        raise AssertionError("memory_summary is not fragless's")
    ours = torch.cuda.memory.memory_stats
    seen = []

    def watch(frame, event, arg):
        if event == "call" and torch.cuda.memory.memory_stats is not ours:
            seen.append(frame.f_code.co_name)

    sys.setprofile(watch)
    try:
        torch.cuda.memory_summary(0)
    finally:
        sys.setprofile(None)
    check(not seen, "torch.cuda.memory.memory_stats was replaced while %s ran" % seen[:3])
    big = alloc(200 * MiB, device=1)
    want = torch.cuda.memory_stats(1)["allocated_bytes.all.current"]
    wrong = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            got = torch.cuda.memory.memory_stats(1)["allocated_bytes.all.current"]
            if got != want:
                wrong.append(got)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(50):
            torch.cuda.memory_summary(0)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
        free(big, 200 * MiB, device=1)
    check(not wrong, "memory_stats(1) answered %d times with another device's stats" % len(wrong))


for p, n in zip(keep, (2 * MiB, 512)):
    free(p, n)
if failures:
    print("FAILED: %s" % ", ".join(failures))
    sys.exit(1)
print("PyTorch %s memory API parity under fragless.torch.enable(): all checks passed" % torch.__version__)
