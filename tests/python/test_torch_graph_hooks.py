"""fragless.torch.enable() installs the CUDA graph-pool hooks of the PyTorch it runs in, whichever names its
CUDAPluggableAllocator gives them, or refuses to become the allocator of a PyTorch whose graphs it cannot follow.
Each case runs in its own interpreter against a stand-in for torch (no PyTorch needed) whose pluggable
allocator offers the setters of one PyTorch and records what it is given; fragless runs on the host driver:

  2.3: set_begin_allocate_to_pool, set_end_allocate_to_pool_fn, set_release_pool (a filter of streams)
  2.1: set_begin_allocate_stream_to_pool, set_end_allocate_stream_to_pool_fn, set_release_pool (PyTorch 2.1
       and 2.2: the capture's stream). The functions installed are driven as CUDAGraph::capture_begin and
       capture_end of those versions drive them: a capture on one stream allocates from the graph's private
       pool, another stream meanwhile from the default pool, and the end takes the routing away.
  2.0: set_capture_begin_fn and the others (CUDA's capture id), and none: no graph-pool setter at all.
       enable() raises RuntimeError saying why, and makes nothing PyTorch's allocator.

Usage: test_torch_graph_hooks.py (FRAGLESS_LIBRARY names libfragless.so)"""
import ctypes
import os
import subprocess
import sys
import types
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "torch_plugin", "python"))
sys.path.insert(0, HERE)
from checks import check  # noqa: E402

COMMON = ["set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_base_alloc_fn", "set_record_stream_fn"]
SETTERS = {
    "2.3": COMMON + ["set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool"],
    "2.1": COMMON + ["set_begin_allocate_stream_to_pool", "set_end_allocate_stream_to_pool_fn", "set_release_pool"],
    "2.0": COMMON + ["set_capture_begin_fn", "set_capture_about_to_end_fn", "set_capture_ended_fn",
                     "set_capture_destroy_fn"],
    "none": COMMON,
}


class PoolId(ctypes.Structure):  # MempoolId_t's layout
    _fields_ = [("first", ctypes.c_ulonglong), ("second", ctypes.c_ulonglong)]


def stand_in_torch(version):
    """A module tree that enable() takes for PyTorch `version` with CUDA: its pluggable allocator offers that
    version's setters and records each call (setter, address) in torch.setter_calls, and change_current_allocator
    records the allocator in torch.allocators_changed."""
    torch = types.ModuleType("torch")
    torch.__version__ = version + ".0+stand-in"
    torch.__file__ = os.path.join(HERE, "no-torch-here", "torch", "__init__.py")  # no headers: no OOM shim built
    torch.setter_calls, torch.allocators_changed = [], []

    class Backend:
        pass

    for name in SETTERS[version]:
        setattr(Backend, name, lambda self, address, name=name: torch.setter_calls.append((name, address)))

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            self.functions = (path, alloc_fn_name, free_fn_name)
            self._backend = Backend()

        def allocator(self):
            return self._backend

    memory = types.ModuleType("torch.cuda.memory")
    memory.CUDAPluggableAllocator = CUDAPluggableAllocator
    memory.change_current_allocator = torch.allocators_changed.append
    cuda = types.ModuleType("torch.cuda")
    cuda.memory = memory
    cuda.is_available = lambda: True
    cuda.is_initialized = lambda: False
    cuda.current_device = lambda: 0
    cuda.OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
    torch.cuda = cuda
    torch._C = types.ModuleType("torch._C")
    torch._C._GLIBCXX_USE_CXX11_ABI = True
    torch._utils = types.ModuleType("torch._utils")
    torch.Tensor = type("Tensor", (), {})
    torch._tensor_classes = set()
    nn = types.ModuleType("torch.nn")
    nn.parameter = types.ModuleType("torch.nn.parameter")
    nn.parameter.Parameter = type("Parameter", (torch.Tensor,), {})
    torch.nn = nn
    mp = types.ModuleType("torch.multiprocessing")
    mp.reductions = types.ModuleType("torch.multiprocessing.reductions")
    mp.reductions.reduce_tensor = lambda tensor: None
    torch.multiprocessing = mp
    for module in (torch, cuda, memory, torch._C, torch._utils, nn, nn.parameter, mp, mp.reductions):
        sys.modules[module.__name__] = module
    return torch


def pool_of(fragless, ptr):
    """The pool of the segment holding ptr in fragless's snapshot."""
    for seg in fragless.snapshot()["segments"]:
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return tuple(seg["segment_pool_id"])
    raise AssertionError("no segment holds 0x%x" % ptr)


HOOK_FUNCTIONS = ["fragless_init", "fragless_empty_cache", "fragless_set_memory_fraction",
                  "fragless_get_base_allocation", "fragless_record_stream", "fragless_begin_allocate_to_pool",
                  "fragless_end_allocate_to_pool", "fragless_begin_allocate_stream_to_pool",
                  "fragless_end_allocate_stream_to_pool", "fragless_release_pool"]


def installed(torch, lib):
    """{setter: the name of the exported function whose address it was given}."""
    names = {}
    for setter, address in torch.setter_calls:
        match = [fn for fn in HOOK_FUNCTIONS if ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value == address]
        check(len(match) == 1, "%s was given 0x%x, which is none of %s" % (setter, address, HOOK_FUNCTIONS))
        check(setter not in names, "%s was called twice" % setter)
        names[setter] = match[0]
    return names


def case(version):
    torch = stand_in_torch(version)
    import fragless
    import fragless.torch as ft
    check(ft.graph_hooks is None, "graph_hooks before enable(): %r" % ft.graph_hooks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no OOM thrower can be built for the stand-in: said by a warning
        try:
            alloc = ft.enable("driver:host,capacity_mb:256")
        except RuntimeError as e:
            if version in ("2.3", "2.1"):
                raise
            text = str(e)
            for word in ("none of the CUDA graph hooks", "private pool", "PyTorch 2.1 or later", torch.__version__,
                         "set_begin_allocate_stream_to_pool", "set_begin_allocate_to_pool"):
                check(word in text, "the error does not say %r: %s" % (word, text))
            check(torch.setter_calls == [], "hooks were installed before enable() raised: %s" % torch.setter_calls)
            check(torch.allocators_changed == [], "enable() raised but changed PyTorch's allocator")
            check(ft.graph_hooks is None, "graph_hooks after a refusal: %r" % ft.graph_hooks)
            print("PyTorch %s: enable() refuses (%s...)" % (version, text[:90]))
            return
    check(version in ("2.3", "2.1"), "enable() made fragless the allocator of a PyTorch (%s) whose graphs it "
                                     "cannot follow" % version)
    check(torch.allocators_changed == [alloc], "change_current_allocator was not given enable()'s allocator")
    lib = fragless.library()
    names = installed(torch, lib)
    expect_graph = {
        "2.3": {"set_begin_allocate_to_pool": "fragless_begin_allocate_to_pool",
                "set_end_allocate_to_pool_fn": "fragless_end_allocate_to_pool"},
        "2.1": {"set_begin_allocate_stream_to_pool": "fragless_begin_allocate_stream_to_pool",
                "set_end_allocate_stream_to_pool_fn": "fragless_end_allocate_stream_to_pool"},
    }[version]
    for setter, fn in dict(expect_graph, set_release_pool="fragless_release_pool").items():
        check(names.get(setter) == fn, "%s was given %s, not %s (installed: %s)" % (setter, names.get(setter), fn, names))
    check(len(names) == len(SETTERS[version]), "not every setter was called once: %s" % names)
    check(ft.graph_hooks == {"2.3": "allocate_to_pool", "2.1": "allocate_stream_to_pool"}[version],
          "graph_hooks: %r" % ft.graph_hooks)
    print("PyTorch %s: enable() installed %s" % (version, ", ".join("%s=%s" % kv for kv in sorted(names.items()))))
    if version != "2.1":
        return

    # The installed functions, called as PyTorch 2.1's CUDAGraph calls them through their addresses.
    address = dict(torch.setter_calls)
    begin = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, PoolId)(address["set_begin_allocate_stream_to_pool"])
    end = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p)(address["set_end_allocate_stream_to_pool_fn"])
    release = ctypes.CFUNCTYPE(None, ctypes.c_int, PoolId)(address["set_release_pool"])
    capture, other = 0x5000, 0x6000  # the capture's stream, and one the capture does not use
    graph_pool = PoolId(1, 0)  # CUDAGraph's own id, {id_, 0}
    size = 3 << 20
    begin(0, capture, graph_pool)
    check(fragless.last_error() == "", fragless.last_error())
    inside = lib.fragless_malloc(size, 0, capture)
    beside = lib.fragless_malloc(size, 0, other)
    check(pool_of(fragless, inside) == (1, 0), "the capture's allocation is in pool %s" % (pool_of(fragless, inside),))
    check(pool_of(fragless, beside) == (0, 0), "another stream's is in pool %s" % (pool_of(fragless, beside),))
    lib.fragless_free(inside, size, 0, capture)  # freed during the capture: still the graph's memory
    end(0, capture)
    check(fragless.last_error() == "", fragless.last_error())
    after = lib.fragless_malloc(size, 0, capture)
    check(after != inside, "after the capture, the capture's stream was given the graph's freed block")
    check(pool_of(fragless, after) == (0, 0), "after the capture, allocations are in pool %s"
          % (pool_of(fragless, after),))
    end(0, capture)  # a second end: no routing to end, reported, nothing changed
    check("allocates to no pool" in fragless.last_error(), "a second end: %r" % fragless.last_error())
    for p, s in ((beside, other), (after, capture)):
        lib.fragless_free(p, size, 0, s)
    release(0, graph_pool)  # the graph's reset(): the pool's memory goes back
    fragless.empty_cache()
    stats = fragless.memory_stats(0)
    check(stats["reserved_bytes.all.current"] == 0, "memory kept after release_pool and empty_cache: %s"
          % stats["reserved_bytes.all.current"])
    print("PyTorch 2.1: a capture begun through the stream hooks allocates from its private pool and ends")


if __name__ == "__main__":
    if len(sys.argv) == 2:
        case(sys.argv[1])
        sys.exit(0)
    failed = []
    for version in SETTERS:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), version])
        if r.returncode != 0:
            failed.append(version)
    if failed:
        print("FAILED for the setters of PyTorch %s" % ", ".join(failed))
        sys.exit(1)
    print("every case passed")
