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



for p, n in zip(keep, (2 * MiB, 512)):
    free(p, n)
if failures:
    print("FAILED: %s" % ", ".join(failures))
    sys.exit(1)
print("PyTorch %s memory API parity under fragless.torch.enable(): all checks passed" % torch.__version__)
