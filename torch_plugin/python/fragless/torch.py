"""fragless inside PyTorch: the allocator through CUDAPluggableAllocator (torch >= 2.1) with every hook, and
PyTorch's own memory API answering from fragless.

    import fragless.torch
    fragless.torch.enable("policy:fragless")   # before CUDA is initialised

Under CUDAPluggableAllocator PyTorch's memory functions raise (its getDeviceStats is not implemented for a
pluggable allocator) and its history sees nothing. enable() puts fragless's answers behind the public names,
with PyTorch's signatures, key names and return shapes, per device, so code that calls them (training
loops, Hugging Face Trainer, Lightning, accelerate) works unchanged:

    torch.cuda.memory_stats, memory_stats_as_nested_dict, memory_allocated, max_memory_allocated,
    memory_reserved, max_memory_reserved, memory_cached, max_memory_cached, reset_peak_memory_stats,
    reset_max_memory_allocated, reset_max_memory_cached, reset_accumulated_memory_stats, memory_summary,
    memory_snapshot, empty_cache, mem_get_info, get_per_process_memory_fraction, and
    torch.cuda.memory._record_memory_history, _snapshot, _dump_snapshot.

Each takes PyTorch's parameters (those of its newest release); a parameter fragless cannot honour
(augment_with_fx_traces on a PyTorch without FX augmentation, say) raises NotImplementedError rather than
being ignored.

Both torch.cuda.NAME and torch.cuda.memory.NAME are replaced; a name imported before enable() ran
(`from torch.cuda import memory_allocated`) keeps PyTorch's function. On a PyTorch without CUDA (a CPU build)
or without CUDAPluggableAllocator (Debian's 1.13) enable() installs no allocator, says so with a warning,
and still replaces the API: it then reports fragless's own devices (the host driver, say), which is how the
API is tested without a GPU. enable() configures a process once: again with other settings it raises.
"""
import collections
import ctypes
import operator
import os
import re
import threading
import sys
import warnings

import fragless as _f

memory_stats = _f.memory_stats
memory_summary = _f.memory_summary
snapshot = _f.snapshot
dump_snapshot = _f.dump_snapshot
empty_cache = _f.empty_cache
record_history = _f.record_history

_HOOKS = [  # (setter on torch._C._CUDAPluggableAllocator, exported function), each set where PyTorch has it
    ("set_init_fn", "fragless_init"),
    ("set_reset_fn", "fragless_empty_cache"),
    ("set_memory_fraction_fn", "fragless_set_memory_fraction"),
    ("set_base_alloc_fn", "fragless_get_base_allocation"),
    ("set_record_stream_fn", "fragless_record_stream"),
]

# The graph-pool hooks (torch.cuda.graph, MemPool), whose setters PyTorch renamed: a set per PyTorch, the first
# whose setters all exist installed whole. Without one a capture gets no private pool (memory freed during it
# goes to other tensors while the graph replays into it) and fragless never knows that a capture is under way
# (it would query events and synchronise inside it), so enable() raises on a PyTorch that has none of them.
_GRAPH_HOOKS = [
    ("allocate_to_pool", [  # PyTorch >= 2.3: begin(device, pool, filter of streams), end(device, pool)
        ("set_begin_allocate_to_pool", "fragless_begin_allocate_to_pool"),
        ("set_end_allocate_to_pool_fn", "fragless_end_allocate_to_pool"),
        ("set_release_pool", "fragless_release_pool"),
    ]),
    ("allocate_stream_to_pool", [  # PyTorch 2.1 and 2.2: begin(device, stream, pool), end(device, stream)
        ("set_begin_allocate_stream_to_pool", "fragless_begin_allocate_stream_to_pool"),
        ("set_end_allocate_stream_to_pool_fn", "fragless_end_allocate_stream_to_pool"),
        ("set_release_pool", "fragless_release_pool"),
    ]),
]

# After enable(): the name of the graph-pool hook set it installed ("allocate_to_pool" on PyTorch >= 2.3,
# "allocate_stream_to_pool" on 2.1 and 2.2); None before, or where fragless is not PyTorch's allocator.
graph_hooks = None

_enabled = None
_enabled_conf = None  # the FRAGLESS_CONF string in effect once enable() has succeeded
_api_installed = False
_originals = {}


def _same(a, b):
    """Whether two configuration strings select the same settings (fragless.same_config: every key's value,
    however spelled, a key at its default given or not); a string that is not valid is not the same."""
    try:
        return _f.same_config(a or "", b or "")
    except ValueError:
        return False


_enable_lock = threading.Lock()  # one enable() at a time: the check of what is enabled and the enabling are one step


def enable(conf=None):
    """Make fragless PyTorch's CUDA allocator and let torch.cuda's memory API answer from it. `conf` is a
    FRAGLESS_CONF string (else the environment's; given, it replaces the environment's, with a warning when
    FRAGLESS_CONF held other settings). Must run before PyTorch initialises CUDA; raises RuntimeError saying
    so otherwise. Everything that would fail later fails here: a bad `conf` raises ValueError naming the key;
    a driver that cannot start (no libcuda on a machine without a GPU) raises RuntimeError saying so, and
    naming driver:host for CPU use. Called again, it returns what the first call returned when `conf` is the
    one in effect (or None), and raises RuntimeError naming the one in effect when it differs: the allocator
    of a process cannot be reconfigured. Returns the torch.cuda.memory.CUDAPluggableAllocator, or None on a
    PyTorch without CUDAPluggableAllocator (before 2.0) or without CUDA. On a PyTorch whose CUDA graphs
    fragless cannot follow (2.0, whose pluggable allocator has none of the graph-pool hooks of 2.1 and later)
    it raises RuntimeError and makes no allocator PyTorch's; fragless.torch.graph_hooks names the graph-pool
    hooks it installed. Threads that call it at once are served one after the other."""
    if conf is not None:
        _f._conf_bytes(conf, "fragless.torch.enable")  # a TypeError or a NUL's ValueError now, torch or not
    with _enable_lock:
        return _enable(conf)


def _source(error, from_env):
    """A settings error as enable() reports it: the parser names FRAGLESS_CONF, which is right only when the
    string came from the environment; an explicit string is already quoted before the message (the C++ tools
    rename the source the same way: config_error_from)."""
    msg = str(error)
    return msg if from_env or not msg.startswith("FRAGLESS_CONF: ") else msg[len("FRAGLESS_CONF: "):]


def _enable(conf):
    global _enabled, _enabled_conf, graph_hooks
    if conf is not None:
        _f._conf_bytes(conf, "fragless.torch.enable")  # a TypeError or a NUL's ValueError now, torch or not
    if _enabled is not None:
        asked = os.environ.get("FRAGLESS_CONF", "") if conf is None else conf
        try:  # a bad string is named as such, not only as other settings than the ones in effect
            _f.check_config(asked)
        except ValueError as e:
            raise ValueError("fragless.torch.enable(%r): %s" % (asked, _source(e, conf is None))) from None
        if not _same(asked, _enabled_conf):
            raise RuntimeError("fragless.torch.enable(%r): fragless is already enabled in this process with %r, "
                               "and its configuration cannot change %s; call enable() "
                               "once, at the top of the script%s" % (
                                   asked, _enabled_conf, "once it is PyTorch's allocator" if _enabled else
                                   "in a process (fragless is not PyTorch's allocator here, as the first call "
                                   "warned, but torch.cuda's memory functions report its devices)",
                                   "" if conf is not None else
                                   " (FRAGLESS_CONF was changed after the first enable())"))
        return _enabled or None
    try:
        import torch
    except ImportError as e:
        raise ImportError("fragless.torch.enable() needs PyTorch (>= 2.1); it is not importable here: %s" % e)
    lib = _f.library()
    env = os.environ.get("FRAGLESS_CONF")
    from_env = conf is None
    if conf is None:
        conf = env or ""
    try:
        _f.check_config(conf)
    except ValueError as e:
        raise ValueError("fragless.torch.enable(%r): %s" % (conf, _source(e, from_env))) from None
    try:
        made = _f.settings()
    except RuntimeError as e:  # an earlier fragless call failed to make it, for good: enable() cannot either
        raise RuntimeError("fragless.torch.enable(%r): %s; an earlier fragless call tried to make it, and the "
                           "allocator is made once per process: call enable() before any other fragless call"
                           % (conf, e)) from None
    if made is not None and not _same(made, conf):
        raise RuntimeError("fragless.torch.enable(%r): fragless's allocator was already made in this process, by "
                           "an earlier fragless call (memory_stats, record_history, an allocation, ...), with "
                           "FRAGLESS_CONF=%r, and its configuration cannot change; call enable() before any "
                           "other fragless call" % (conf, made))
    if env and not _same(env, conf):
        warnings.warn("fragless.torch.enable(%r): FRAGLESS_CONF=%r is also set in the environment; its settings "
                      "are not used (the string given to enable() replaces it, in this process and the ones it "
                      "starts)" % (conf, env), RuntimeWarning, stacklevel=3)
    _check_driver(conf)
    _warn_pytorch_conf(conf)
    path = _f.library_path()
    pluggable = getattr(torch.cuda.memory, "CUDAPluggableAllocator", None)
    if not torch.cuda.is_available() or pluggable is None:
        warnings.warn("fragless.torch.enable(): this PyTorch (%s) %s, so fragless is not its allocator; "
                      "torch.cuda's memory functions now report fragless's own devices"
                      % (torch.__version__, "has no CUDA device" if pluggable else "has no CUDAPluggableAllocator"),
                      RuntimeWarning, stacklevel=3)
        os.environ["FRAGLESS_CONF"] = conf  # only now: a failed enable() leaves the environment as it was
        _install_api(torch)
        _install_oom_error(torch)
        _enabled, _enabled_conf = False, conf
        return None
    alloc = pluggable(path, "fragless_malloc", "fragless_free")
    backend = alloc.allocator()
    graph_set, graph_setters = _graph_hooks_of(torch, backend)
    for setter, fn in [h for h in _HOOKS if hasattr(backend, h[0])] + graph_setters:
        getattr(backend, setter)(ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value)
    # The allocator reads FRAGLESS_CONF when its first call makes it, which comes after this; set before
    # change_current_allocator (which allocates nothing) and taken back if it refuses.
    previous = os.environ.get("FRAGLESS_CONF")
    os.environ["FRAGLESS_CONF"] = conf
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        if previous is None:
            del os.environ["FRAGLESS_CONF"]
        else:
            os.environ["FRAGLESS_CONF"] = previous
        raise RuntimeError("fragless.torch.enable() must run before PyTorch initialises CUDA in this process "
                           "(PyTorch said: %s): before the first tensor is put on a GPU, and before "
                           "torch.cuda.set_device() or any other call that initialises CUDA. Call it at the top "
                           "of your script." % e) from None
    _install_api(torch)
    _install_oom_error(torch)
    from . import torch_share  # torch.multiprocessing sends fragless's CUDA tensors through fragless.share
    torch_share.install(torch)
    _enabled, _enabled_conf, graph_hooks = alloc, conf, graph_set
    return alloc


def _warn_pytorch_conf(conf):
    """PyTorch's own allocator settings (PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF, as PyTorch reads
    them) configure the allocator fragless replaces: say so, rather than let them look applied."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        value = os.environ.get(name)
        if value:
            warnings.warn("fragless.torch.enable(%r): %s=%r configures PyTorch's own CUDA allocator, which fragless "
                          "replaces: those settings do not apply. FRAGLESS_CONF takes PyTorch's keys "
                          "(max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold with "
                          "policy:classic, expandable_segments:True for PyTorch's expandable segments); give them "
                          "there to have them" % (conf, name, value), RuntimeWarning, stacklevel=4)
            return


def _graph_hooks_of(torch, backend):
    """The graph-pool hook set this PyTorch's pluggable allocator takes: (its name, its [(setter, function)]).
    Raises RuntimeError, before anything is installed, where it takes none: PyTorch 2.0, whose capture hooks
    (set_capture_begin_fn and the others) name CUDA's capture id, which fragless does not follow, or a later
    PyTorch that renamed them again."""
    for name, hooks in _GRAPH_HOOKS:
        if all(hasattr(backend, setter) for setter, _ in hooks):
            return name, hooks
    raise RuntimeError(
        "fragless.torch.enable(): this PyTorch (%s) has none of the CUDA graph hooks fragless follows (%s); under "
        "it a graph capture would get no private pool, and memory freed during a capture would be handed to other "
        "tensors while the graph replays into it. fragless needs PyTorch 2.1 or later; it was not made PyTorch's "
        "allocator." % (torch.__version__, "; ".join(" + ".join(s for s, _ in hooks) for _, hooks in _GRAPH_HOOKS)))


def _check_driver(conf):
    """A driver that cannot start here is an error of enable(), not of the first allocation (nothing is
    created: no engine, no CUDA context)."""
    try:
        _f.check_driver(conf)
    except RuntimeError as e:
        # The way to CPU use, where the settings keep the cuda driver (a trace path refused under the host
        # driver needs no such advice, nor a message that already gives it).
        hint = "" if re.search(r"(^|,)\s*driver\s*:\s*(host|sim)\s*(,|$)", conf or "") or "driver:host" in str(e) else (
            ". For CPU use (a machine without a GPU or without libcuda), fragless runs on host memory with the host "
            "driver: fragless.torch.enable(\"driver:host\")")
        raise RuntimeError("fragless.torch.enable(): %s%s" % (str(e).rstrip("."), hint)) from None


def _thrower_in_package(torch):
    """The thrower built with the package (next to libfragless.so; fragless_build.json names the PyTorch it
    was built for). Returns (path, None) when it matches the running PyTorch, else (None, why not)."""
    info = _f.build_info().get("torch_oom") or {}
    here = os.path.dirname(os.path.abspath(_f.library_path()))
    path = os.path.join(here, "libfragless_torch_oom.so")
    if not info.get("built") or not os.path.exists(path):
        return None, "this fragless was built without one (%s)" % (info.get("reason") or "no fragless_build.json")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    if info.get("torch") != torch.__version__ or int(info.get("cxx11_abi", -1)) != abi:
        return None, "the one built with fragless is for PyTorch %s (C++11 ABI %s), this is %s (%d)" % (
            info.get("torch"), info.get("cxx11_abi"), torch.__version__, abi)
    return path, None


def _oom_shim_path(torch):
    """Builds (once per PyTorch install, cached) the library whose fragless_throw_torch_oom throws
    c10::OutOfMemoryError, against the running PyTorch's headers and libc10 with its C++ ABI. Returns its path;
    raises OSError when it cannot be built (no compiler, no headers)."""
    import hashlib
    import shutil
    import subprocess
    import tempfile
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_oom.cpp")
    root = os.path.dirname(os.path.abspath(torch.__file__))
    include, libdir = os.path.join(root, "include"), os.path.join(root, "lib")
    if not os.path.exists(os.path.join(include, "c10", "util", "Exception.h")):
        raise OSError("this PyTorch ships no C++ headers (%s)" % include)
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    with open(src, "rb") as f:
        key = hashlib.sha256(f.read() + ("%s|%s|%d" % (torch.__version__, root, abi)).encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                         "fragless")
    out = os.path.join(cache, "libfragless_torch_oom-%s.so" % key)
    if os.path.exists(out):
        return out
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise OSError("no C++ compiler found (set CXX)")
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".oom-", suffix=".so", dir=cache)
    os.close(fd)
    cmd = [cxx, "-O1", "-std=c++17", "-shared", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi, "-I", include, src,
           "-o", tmp, "-L", libdir, "-lc10", "-Wl,-rpath," + libdir]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise OSError("building the OOM shim failed: %s\n%s" % (" ".join(cmd), r.stderr[-2000:]))
    os.replace(tmp, out)  # atomic: several ranks may build at once
    return out


_oom_shim = None


def _install_oom_error(torch):
    """Makes fragless's out-of-memory a torch.cuda.OutOfMemoryError (so `except torch.cuda.OutOfMemoryError`
    catches it) by handing libfragless.so a thrower of c10::OutOfMemoryError built against this PyTorch: the
    one built with the package when it matches this PyTorch (no compiler needed), else one built now into
    the cache (a compiler and PyTorch's headers needed). Where neither is possible out of memory stays a
    RuntimeError with the same text; a warning here and the error's own text say why. Returns whether it
    worked."""
    global _oom_shim
    if _oom_shim is not None:
        return True
    lib = _f.library()
    packaged, why_not = _thrower_in_package(torch)
    shim = None
    if packaged:
        try:
            shim = ctypes.CDLL(packaged)
        except OSError as e:
            why_not = "the one built with fragless does not load (%s)" % e
    if shim is None:
        try:
            shim = ctypes.CDLL(_oom_shim_path(torch))
        except OSError as e:
            why = "%s, and none could be built here: %s" % (why_not, e)
            lib.fragless_set_oom_note(("(a RuntimeError, not torch.cuda.OutOfMemoryError: %s)" % why).encode())
            warnings.warn("fragless.torch: out of memory will raise RuntimeError, not torch.cuda.OutOfMemoryError: "
                          "%s" % why, RuntimeWarning, stacklevel=3)
            return False
    lib.fragless_set_oom_thrower(ctypes.cast(shim.fragless_throw_torch_oom, ctypes.c_void_p))
    lib.fragless_set_oom_note(None)
    _oom_shim = shim
    return True


def oom_error_type():
    """The exception fragless's out of memory raises after enable(): torch.cuda.OutOfMemoryError where a
    thrower for this PyTorch could be had, else RuntimeError."""
    import torch
    return torch.cuda.OutOfMemoryError if _oom_shim is not None else RuntimeError


def _device_index(torch, device):
    """PyTorch's reading of a device argument: None / 'cuda' = the current device, 'cuda:N', N, a
    torch.device. Anything that is not a CUDA device is a ValueError naming it."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    if isinstance(device, bool):
        raise ValueError("Expected a cuda device, but got: %r" % (device,))
    if isinstance(device, int):
        return device
    if isinstance(device, torch.cuda.device):  # torch.cuda.device(0), as torch.cuda._utils reads it
        return device.idx
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError("Expected a cuda device, but got: %s" % device)
        if device.index is None:
            return _device_index(torch, None)
        return device.index
    raise ValueError("Expected a cuda device, but got: %r" % (device,))


class _ZeroMissing(dict):
    """The stats for PyTorch's own memory_summary, which reads some keys fragless has no counterpart for."""

    def __missing__(self, key):
        return 0


def _with_globals(fn, **names):
    """A copy of the function `fn` whose global names are its module's, with `names` put over them: the
    module itself is not changed."""
    import types
    copy = types.FunctionType(fn.__code__, dict(fn.__globals__, **names), fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _augment_with_fx_traces(torch, snapshot):
    """PyTorch's augment_with_fx_traces (torch._utils._augment_memory_snapshot_stack_traces, which maps frames
    of FX-generated code back to the model's source), applied to fragless's snapshot; an error where this
    PyTorch has none, never a snapshot silently left as it was."""
    augment = getattr(torch._utils, "_augment_memory_snapshot_stack_traces", None)
    if augment is None:
        raise NotImplementedError("augment_with_fx_traces=True needs torch._utils._augment_memory_snapshot_stack_"
                                  "traces, which this PyTorch (%s) does not have" % torch.__version__)
    return augment(snapshot)


def _history_refused(what):
    raise NotImplementedError("fragless.torch: _record_memory_history(%s) is not supported by fragless's history "
                              "(PyTorch's own allocator records it; fragless would silently record something "
                              "else)" % what)


def _record_history_current(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, device=None,
                            clear_history=False, compile_context=False, global_record_annotations=False,
                            skip_actions=None, record_pinned_host_memory=False, record_cuda=True):
    """torch.cuda.memory._record_memory_history's current form, with PyTorch's rules
    (torch/csrc/cuda/memory_snapshot.cpp): enabled None / 'state' / 'all', the history's length max_entries
    only with 'all' (1 with 'state'), context None / 'state' / 'alloc' / 'all', stacks 'python' / 'all', and
    max_entries a size_t (anything else a TypeError, whatever `enabled` is). As in PyTorch, `device` is not used
    (every device records). What fragless cannot record raises NotImplementedError."""
    max_entries = _size_t(max_entries, "max_entries")
    if enabled is not None and enabled not in ("state", "all"):
        raise RuntimeError("expected state to be 'state', 'all', or None")
    if context is not None and context not in ("state", "alloc", "all"):
        raise RuntimeError("expected context to be 'state', 'alloc', 'all', or None")
    if stacks not in ("python", "all"):
        raise RuntimeError("expected stacks to be 'python', or 'all'")
    if enabled is None:
        _f.record_history(0)
        return
    _refuse_unrecorded(compile_context, global_record_annotations, skip_actions, record_pinned_host_memory,
                       record_cuda)
    entries = max_entries if enabled == "all" else 1
    _f.record_history(max(1, min(entries, 1 << 40)), context=context, stacks=stacks,
                      clear_history=_bool_arg(clear_history, "clear_history"))


_INCOMPATIBLE = "_record_memory_history(): incompatible function arguments"


def _bool_arg(value, name):
    """A bool argument of PyTorch's binding (fragless._bool_arg's rule), said as the binding says it."""
    return _f._bool_arg(value, name, _INCOMPATIBLE)


def _c_integer(value, name, lo, hi, described):
    """An argument PyTorch's binding takes as a C integer (through pybind11): an int in [lo, hi), anything else a
    TypeError there, raised before the call does anything; `described` says what it must be."""
    n = _f._as_index(value)
    if n is None or not lo <= n < hi:
        raise TypeError("%s: %s must be %s, got %r" % (_INCOMPATIBLE, name, described, value))
    return n


def _int64(value, name):
    """torch._C._cuda_record_memory_history_legacy's trace_alloc_max_entries, an int64. A negative count, which
    PyTorch's allocator would turn into a huge size_t, is refused as nonsense."""
    n = _c_integer(value, name, -2**63, 2**63, "an int (an int64)")
    if n < 0:
        raise ValueError("_record_memory_history(): %s must not be negative, got %d" % (name, n))
    return n


def _size_t(value, name):
    """torch._C._cuda_record_memory_history's max_entries, a size_t. Before 2026-12-05 a negative max_entries was
    taken for 1."""
    return _c_integer(value, name, 0, 2**64, "an int in [0, 2**64 - 1] (PyTorch's binding takes a size_t)")


def _refuse_unrecorded(compile_context, global_record_annotations, skip_actions, record_pinned_host_memory,
                       record_cuda):
    """The history options of both forms that fragless does not record: an error, never ignored."""
    if compile_context:
        _history_refused("compile_context=True")
    if global_record_annotations:
        _history_refused("global_record_annotations=True")
    if skip_actions:
        _history_refused("skip_actions=%r" % (list(skip_actions),))
    if record_pinned_host_memory:
        _history_refused("record_pinned_host_memory=True")
    if not record_cuda:
        _history_refused("record_cuda=False")


def _record_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                           trace_alloc_record_context=False, device=None, record_context_cpp=False,
                           clear_history=False, compile_context=False, global_record_annotations=False,
                           skip_actions=None, record_pinned_host_memory=False, record_cuda=True):
    """The legacy form (first argument a bool), with PyTorch's defaults and rules
    (torch/csrc/cuda/memory_snapshot.cpp): frames of live blocks with record_context ('state'), on the
    history's allocations too with trace_alloc_record_context ('alloc'); C++ frames only with
    record_context_cpp; the history keeps trace_alloc_max_entries events (1 by default)."""
    entries = _int64(trace_alloc_max_entries, "trace_alloc_max_entries")
    if not enabled:
        _f.record_history(0)
        return
    _refuse_unrecorded(compile_context, global_record_annotations, skip_actions, record_pinned_host_memory,
                       record_cuda)
    context = "alloc" if trace_alloc_record_context else "state" if record_context else None
    stacks = "all" if record_context_cpp and context else "python"
    _f.record_history(max(1, min(entries, 1 << 40)), context=context, stacks=stacks,
                      clear_history=_bool_arg(clear_history, "clear_history"))


def _install_api(torch):
    global _api_installed
    if _api_installed:
        return
    mem = torch.cuda.memory
    index = lambda device: _device_index(torch, device)  # noqa: E731

    def memory_stats(device=None):
        return collections.OrderedDict(_f.memory_stats(index(device)))

    def memory_stats_as_nested_dict(device=None):
        nested = {}
        for key, value in _f.memory_stats(index(device)).items():
            node = nested
            parts = key.split(".")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = value
        return nested

    def stat(key):
        def read(device=None):
            return _f.memory_stats(index(device)).get(key, 0)
        read.__name__ = key
        return read

    def reset_peak_memory_stats(device=None):
        _f.reset_peak_stats(index(device))

    def reset_accumulated_memory_stats(device=None):
        _f.reset_accumulated_stats(index(device))

    def summary(device=None, abbreviated=False):
        d = index(device)
        # "GPU reserved segments" counts the mapped ranges a snapshot shows, also under the expandable and
        # fragless policies (Note [Mapped ranges are segments], allocator/src/policy/growable.h).
        stats = _ZeroMissing(_f.memory_stats(d))
        original = _originals.get("memory_summary")
        if original is not None:
            # PyTorch's table, run with its module's names as they are but memory_stats answering these stats:
            # a copy of the function over a copy of its globals, so that nothing shared is changed (another
            # thread's torch.cuda.memory.memory_stats(device) meanwhile answers for its own device).
            try:  # a table that is not a plain function (wrapped), or reads what fragless cannot give: fragless's
                table = _with_globals(original, memory_stats=lambda device=None: stats)
                return table(device=d, abbreviated=abbreviated)
            except Exception:
                pass
        return _f.memory_summary(d)

    def snapshot_of(mempool_id, include_traces):
        """The snapshot, its segments those of the pool `mempool_id` when one is named ((0, 0) or None: every
        pool, as in PyTorch), its device_traces empty without include_traces."""
        s = _f.snapshot(include_traces)
        if mempool_id is not None:
            try:
                pool = tuple(operator.index(x) for x in mempool_id) if not isinstance(mempool_id, (str, bytes)) else None
            except TypeError:
                pool = None
            if pool is None or len(pool) != 2:  # not ints: a TypeError; ints, but not two: a ValueError
                raise (TypeError if pool is None else ValueError)(
                    "mempool_id must be a pair of ints (a MemPool's id), got %r" % (mempool_id,))
            if pool != (0, 0):
                s["segments"] = [seg for seg in s["segments"] if tuple(seg.get("segment_pool_id", (0, 0))) == pool]
        if not include_traces:
            s["device_traces"] = [[] for _ in s.get("device_traces", [])]
        return s

    def memory_snapshot(mempool_id=None, include_traces=True):
        return snapshot_of(mempool_id, include_traces)["segments"]

    def record_memory_history(enabled="all", *args, **kwargs):
        # PyTorch's dispatch (torch/cuda/memory.py): a bool is the legacy form (1.13-2.0), anything else the
        # current one; each form's own signature, so a misspelled keyword is a TypeError there as here.
        if isinstance(enabled, bool):
            return _record_history_legacy(enabled, *args, **kwargs)
        return _record_history_current(enabled, *args, **kwargs)

    def snapshot_(device=None, augment_with_fx_traces=False):
        s = _f.snapshot()
        if augment_with_fx_traces:
            s = _augment_with_fx_traces(torch, s)
        return s

    def dump_snapshot_(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
        if not isinstance(filename, (str, bytes, os.PathLike)):  # an int would be taken for a file descriptor
            raise TypeError("_dump_snapshot: expected a file name (str or os.PathLike), got %s %r"
                            % (type(filename).__name__, filename))
        if augment_with_fx_traces:
            s = snapshot_(augment_with_fx_traces=True)
            import pickle
            with open(filename, "wb") as f:
                pickle.dump(s, f)
        else:
            _f.dump_snapshot(filename)

    def get_per_process_memory_fraction(device=None):
        return _f.memory_fraction(index(device))

    def set_per_process_memory_fraction(fraction, device=None):
        _f.set_memory_fraction(fraction, index(device))

    def empty_cache_():
        _f.empty_cache()

    def mem_get_info(device=None):
        return _f.mem_get_info(index(device))

    api = {
        "memory_stats": memory_stats,
        "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "memory_allocated": stat("allocated_bytes.all.current"),
        "max_memory_allocated": stat("allocated_bytes.all.peak"),
        "memory_reserved": stat("reserved_bytes.all.current"),
        "max_memory_reserved": stat("reserved_bytes.all.peak"),
        "memory_cached": stat("reserved_bytes.all.current"),
        "max_memory_cached": stat("reserved_bytes.all.peak"),
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_max_memory_allocated": reset_peak_memory_stats,
        "reset_max_memory_cached": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
        "memory_summary": summary,
        "memory_snapshot": memory_snapshot,
        "empty_cache": empty_cache_,
        "mem_get_info": mem_get_info,
        "get_per_process_memory_fraction": get_per_process_memory_fraction,
        "set_per_process_memory_fraction": set_per_process_memory_fraction,
    }
    private = {"_record_memory_history": record_memory_history, "_snapshot": snapshot_,
               "_dump_snapshot": dump_snapshot_}
    for name, fn in api.items():
        _originals.setdefault(name, getattr(mem, name, None))
        fn.__doc__ = "fragless: PyTorch's torch.cuda.%s, answered by fragless." % name
        if list(api.values()).count(fn) == 1:  # a wrong call's TypeError names PyTorch's function, not ours
            fn.__name__ = fn.__qualname__ = name
        setattr(mem, name, fn)
        setattr(torch.cuda, name, fn)
    for name, fn in private.items():
        _originals.setdefault(name, getattr(mem, name, None))
        setattr(mem, name, fn)
    # PyTorch's "dump a snapshot on out of memory" hook, which a pluggable allocator does not support
    # (attachOutOfMemoryObserver raises): fragless calls the observers before it raises, with PyTorch's
    # arguments (device, bytes asked for, the memory limit or the device's total, the device's free bytes).
    _originals.setdefault("_cuda_attach_out_of_memory_observer",
                          getattr(torch._C, "_cuda_attach_out_of_memory_observer", None))
    torch._C._cuda_attach_out_of_memory_observer = attach_out_of_memory_observer
    _api_installed = True


_OOM_OBSERVER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)
_oom_observers = []  # the ctypes wrappers, kept alive: libfragless.so holds them for the process


def attach_out_of_memory_observer(observer):
    """fragless: torch._C._cuda_attach_out_of_memory_observer. `observer(device, alloc, device_limit,
    device_free)` is called when an allocation runs out of memory, before torch.cuda.OutOfMemoryError is raised,
    as PyTorch calls it; an exception it raises is printed and the out-of-memory error raised as usual. At most
    64 per process, never removed."""
    if not callable(observer):
        raise TypeError("_cuda_attach_out_of_memory_observer: the observer must be callable, not %s"
                        % type(observer).__name__)

    def call(device, alloc, limit, free):
        try:
            observer(device, alloc, limit, free)
        except BaseException:  # an exception must not cross into the allocator's C++ frames
            import traceback
            traceback.print_exc()

    wrapped = _OOM_OBSERVER(call)
    if _f.library().fragless_attach_oom_observer(ctypes.cast(wrapped, ctypes.c_void_p)) != 0:
        raise RuntimeError(_f.last_error())
    _oom_observers.append(wrapped)
