"""fragless from Python: the ctypes binding of libfragless.so and PyTorch-shaped helpers.

    import fragless.torch
    fragless.torch.enable()            # before CUDA is initialised
    ...
    fragless.torch.memory_stats()      # torch.cuda.memory_stats() key names
    fragless.torch.dump_snapshot("snap.pickle")   # open at pytorch.org/memory_viz

The library is found through FRAGLESS_LIBRARY, inside this package (where `pip install` puts it), in the
repository's build/lib, or on the loader path, in that order.
"""
import ctypes
import ctypes.util
import io
import json
import numbers
import operator
import os
import pickle

__all__ = ["library", "library_path", "preload_library_path", "build_info", "check_config", "check_driver", "settings", "same_config", "memory_stats",
           "memory_summary", "snapshot", "dump_snapshot", "empty_cache", "record_history", "memory_fraction", "last_error",
           "device_count", "Shared", "share", "open_shared", "close_shared", "reap_shared"]

_lib = None
_path = None


def _candidates():
    env = os.environ.get("FRAGLESS_LIBRARY")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libfragless.so")
    yield os.path.normpath(os.path.join(here, "..", "..", "..", "build", "lib", "libfragless.so"))
    found = ctypes.util.find_library("fragless")
    if found:
        yield found


def library_path():
    """The libfragless.so this process uses (loading it if needed)."""
    library()
    return _path


def preload_library_path():
    """libfragless_preload.so, beside the libfragless.so this process uses (for LD_PRELOAD)."""
    return os.path.join(os.path.dirname(os.path.abspath(library_path())), "libfragless_preload.so")


def build_info():
    """What the build beside the loaded library has (fragless_build.json, written by CMake): the version,
    whether the cuda driver was built, and the OOM thrower's PyTorch version or why it was not built. {} for a
    library without the file."""
    path = os.path.join(os.path.dirname(os.path.abspath(library_path())), "fragless_build.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _conf_bytes(conf, caller):
    """A FRAGLESS_CONF string as the C ABI takes it: a str (anything else is a TypeError naming what was given)
    with no NUL character (C would end the string there, and check what comes before it alone: a ValueError),
    encoded as os.environ encodes (UTF-8, bytes that are not UTF-8 kept as they came)."""
    if not isinstance(conf, str):
        raise TypeError("%s: expected a str (a FRAGLESS_CONF string), got %s %r" % (caller, type(conf).__name__, conf))
    at = conf.find("\0")
    if at >= 0:
        raise ValueError("%s: the configuration %r has a NUL character at index %d, where C would take it to end"
                         % (caller, conf, at))
    return conf.encode("utf-8", "surrogateescape")


def _text(raw):
    """What the library wrote (an error message, settings), as text: a byte that is not UTF-8 (from
    FRAGLESS_CONF, a path) becomes U+FFFD rather than turning the message into a UnicodeDecodeError."""
    return raw.decode("utf-8", "replace")


def _check(fn, conf, caller):
    raw = _conf_bytes(conf, caller)
    need = fn(raw, None, 0)
    if need < 0:
        raise RuntimeError(last_error())
    if need == 0:
        return None
    buf = ctypes.create_string_buffer(need + 1)
    fn(raw, buf, need + 1)
    return _text(buf.value)


def _device(device):
    """A device index as the C ABI takes it (a C int): an int that does not fit is a ValueError, not another
    device (ctypes would wrap 2**32 to 0)."""
    if isinstance(device, bool):
        raise ValueError("expected a device index, got %r" % (device,))
    if not isinstance(device, int):
        try:
            device = operator.index(device)  # an int-like value (numpy's integers), as PyTorch takes them
        except TypeError:
            raise ValueError("expected a device index, got %r" % (device,)) from None
    if not -2**31 <= device < 2**31:
        raise ValueError("device index %d is out of range" % device)
    return device


def _pointer(ptr, caller):
    """An address as the C ABI takes it (a void*): an int, an int-like value or a ctypes.c_void_p (anything else
    is a TypeError) in [0, 2**64 - 1] (a ValueError outside: ctypes would wrap 2**64 + p to p)."""
    if isinstance(ptr, ctypes.c_void_p):
        return ptr.value or 0
    if isinstance(ptr, bool):
        raise TypeError("%s: expected a pointer (an int), got %r" % (caller, ptr))
    try:
        ptr = operator.index(ptr)
    except TypeError:
        raise TypeError("%s: expected a pointer (an int), got %s %r" % (caller, type(ptr).__name__, ptr)) from None
    if not 0 <= ptr < 2**(8 * ctypes.sizeof(ctypes.c_void_p)):
        raise ValueError("%s: pointer %#x is not an address (not in [0, 2**%d - 1])"
                         % (caller, ptr, 8 * ctypes.sizeof(ctypes.c_void_p)))
    return ptr


def settings():
    """The FRAGLESS_CONF string the process's allocator was made with, or None while it is not made yet (it is
    made by the first fragless call that needs it: an allocation, memory_stats, record_history, ...)."""
    n = library().fragless_settings(None, 0)
    if n == -2:
        raise RuntimeError("fragless's allocator could not be made in this process: %s" % last_error())
    if n < 0:
        return None
    buf = ctypes.create_string_buffer(n + 1)
    library().fragless_settings(buf, n + 1)
    return buf.value.decode("utf-8", "surrogateescape")  # as os.environ would hold it


def same_config(a, b):
    """Whether two FRAGLESS_CONF strings select the same settings (every key's value, however spelled, a key
    at its default given or not). A string that is not valid raises ValueError, and anything but a str
    TypeError, as check_config."""
    for conf in (a, b):
        check_config(conf, "fragless.same_config")
    n = library().fragless_same_config(_conf_bytes(a, "fragless.same_config"), _conf_bytes(b, "fragless.same_config"))
    if n < 0:
        raise ValueError(last_error())
    return n == 1


def check_config(conf, caller="fragless.check_config"):
    """Raises ValueError with the parser's message (naming the key, the value and the accepted forms) if
    `conf`, a FRAGLESS_CONF string, is not valid, or has a NUL character; TypeError when it is not a str;
    creates nothing."""
    error = _check(library().fragless_check_config, conf, caller)
    if error:
        raise ValueError(error)


def check_driver(conf):
    """For a valid `conf`: raises RuntimeError saying why its driver cannot start here (the cuda driver
    needs libcuda and a device; the host driver refuses shareable_handles:fabric), or why its trace file
    could not be written (a folder that is not there, a directory or FIFO at the path), in the words the
    first allocation would use, creating nothing (no engine, no CUDA context, no file)."""
    check_config(conf, "fragless.check_driver")
    error = _check(library().fragless_check_driver, conf, "fragless.check_driver")
    if error:
        raise RuntimeError(error)


def library():
    """The loaded libfragless.so, with argument and result types declared."""
    global _lib, _path
    if _lib is not None:
        return _lib
    env = os.environ.get("FRAGLESS_LIBRARY")
    if env and not os.path.isfile(env):
        # Named, but not there: loading another library instead would hide the mistake.
        raise OSError("fragless: FRAGLESS_LIBRARY names %s, which is %s" %
                      (env, "a directory" if os.path.isdir(env) else "not there"))
    tried = []
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path)
            continue
        lib = ctypes.CDLL(path)
        _lib, _path = lib, path
        break
    else:
        raise OSError("fragless: libfragless.so not found (tried: %s); build it with cmake or set FRAGLESS_LIBRARY"
                      % ", ".join(tried))
    c = ctypes
    _lib.fragless_malloc.restype = c.c_void_p
    _lib.fragless_malloc.argtypes = [c.c_size_t, c.c_int, c.c_void_p]
    _lib.fragless_free.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]
    _lib.fragless_init.argtypes = [c.c_int]
    _lib.fragless_memory_stats.restype = c.c_long
    _lib.fragless_memory_stats.argtypes = [c.c_int, c.c_char_p, c.c_size_t]
    _lib.fragless_snapshot.restype = c.c_long
    _lib.fragless_snapshot.argtypes = [c.c_char_p, c.c_size_t]
    _lib.fragless_snapshot_segments.restype = c.c_long
    _lib.fragless_snapshot_segments.argtypes = [c.c_char_p, c.c_size_t]
    _lib.fragless_record_history.argtypes = [c.c_size_t]
    _lib.fragless_record_history_ex.argtypes = [c.c_size_t, c.c_int, c.c_int]
    _lib.fragless_record_history_v2.argtypes = [c.c_size_t, c.c_int, c.c_int, c.c_int]
    _lib.fragless_get_memory_fraction.restype = c.c_double
    _lib.fragless_get_memory_fraction.argtypes = [c.c_int]
    _lib.fragless_set_memory_fraction.argtypes = [c.c_double, c.c_int]
    _lib.fragless_last_error.restype = c.c_char_p
    _lib.fragless_device_count.restype = c.c_int
    _lib.fragless_settings.argtypes = [c.c_char_p, c.c_size_t]
    _lib.fragless_settings.restype = c.c_long
    _lib.fragless_same_config.argtypes = [c.c_char_p, c.c_char_p]
    _lib.fragless_same_config.restype = c.c_int
    _lib.fragless_reset_peak_stats.argtypes = [c.c_int]
    _lib.fragless_reset_accumulated_stats.argtypes = [c.c_int]
    _lib.fragless_mem_get_info.argtypes = [c.c_int, c.POINTER(c.c_size_t), c.POINTER(c.c_size_t)]
    for fn in (_lib.fragless_check_config, _lib.fragless_check_driver):
        fn.restype = c.c_long
        fn.argtypes = [c.c_char_p, c.c_char_p, c.c_size_t]
    _lib.fragless_set_oom_thrower.argtypes = [c.c_void_p]
    _lib.fragless_set_oom_note.argtypes = [c.c_char_p]
    _lib.fragless_attach_oom_observer.argtypes = [c.c_void_p]
    _lib.fragless_attach_oom_observer.restype = c.c_int
    return _lib


def last_error():
    """The calling thread's last error from the library ("" if its last call had none)."""
    return _text(library().fragless_last_error())


def device_count():
    n = library().fragless_device_count()
    if n < 0:
        raise RuntimeError(last_error())
    return n


def _read(fn, *args):
    # The answer may grow between the call that sizes the buffer and the one that fills it (a background
    # job changes the segments, another thread allocates): then it is asked again, with room for the new size.
    need = fn(*args, None, 0)
    while True:
        if need < 0:
            raise RuntimeError(last_error())
        buf = ctypes.create_string_buffer(need + 1)
        got = fn(*args, buf, need + 1)
        if 0 <= got <= need:
            return buf.raw[:got]
        need = got


def memory_stats(device=0):
    """fragless's statistics for `device` with torch.cuda.memory_stats() key names, sorted."""
    stats = json.loads(_read(library().fragless_memory_stats, _device(device)).decode())
    return dict(sorted(stats.items()))


def memory_summary(device=0):
    """A short human-readable table of the main statistics. Segments are the mapped address ranges a
    snapshot reports, under every policy (PyTorch's `segment` stat leaves expandable segments out)."""
    s = memory_stats(device)
    segments = s.get("segment.all.current", 0)
    mib = lambda k: s.get(k, 0) / 2**20
    rows = [("allocated", "allocated_bytes.all"), ("reserved", "reserved_bytes.all"),
            ("active", "active_bytes.all"), ("requested", "requested_bytes.all"),
            ("live (fragless)", "fragless.live_bytes")]
    lines = ["fragless memory summary, device %d" % device, "%-18s %14s %14s" % ("", "current MiB", "peak MiB")]
    for name, key in rows:
        lines.append("%-18s %14.1f %14.1f" % (name, mib(key + ".current"), mib(key + ".peak")))
    lines.append("allocations %d, segments %d, OOMs %d, retries %d, forced syncs %d" % (
        s.get("allocation.all.current", 0), segments, s.get("num_ooms", 0),
        s.get("num_alloc_retries", 0), s.get("fragless.num_forced_syncs", 0)))
    return "\n".join(lines)


class _DataOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError("fragless snapshot refers to %s.%s" % (module, name))


def snapshot_bytes(include_traces=True):
    """The snapshot as the pickle torch.cuda.memory._dump_snapshot writes; without include_traces its
    device_traces are empty (the history is neither named nor written: quick with a long one)."""
    return _read(library().fragless_snapshot if include_traces else library().fragless_snapshot_segments)


def snapshot(include_traces=True):
    """A dict in PyTorch's snapshot layout: segments + device_traces (torch.cuda._memory_viz reads it)."""
    return _DataOnly(io.BytesIO(snapshot_bytes(include_traces))).load()


def dump_snapshot(path="dump_snapshot.pickle"):
    """Writes snapshot_bytes() to the file `path` (a str or os.PathLike). An int is refused: open() would take
    it for a file descriptor, and write the pickle over whatever that descriptor is (the host driver's device
    memory, a trace file)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError("dump_snapshot: expected a file name (str or os.PathLike), got %s %r"
                        % (type(path).__name__, path))
    with open(path, "wb") as f:
        f.write(snapshot_bytes())


_CONTEXT = {None: 0, "state": 1, "alloc": 2, "all": 3}  # PyTorch's RecordContext
_STACKS = {"python": 1, "cpp": 2, "all": 3}


def record_history(max_entries=100000, context=None, stacks="all", clear_history=False):
    """Keep the last `max_entries` allocator events per device for snapshot()'s device_traces (0: off, and
    what was kept is dropped). context: None (no stack frames), "state" (frames of the live blocks'
    allocations only, none on the events), "alloc" (frames of each allocation) or "all" (of each free too);
    stacks: "python" (the calling thread's frames, the GIL taken for the walk if it released it), "cpp" or "all". clear_history: drop the events
    kept so far. Frames are kept as addresses and code objects and turned into names only when a snapshot is
    taken."""
    # A wrong type is a TypeError, a value out of range a ValueError, each naming the parameter.
    n = None if isinstance(max_entries, bool) else _as_index(max_entries)
    if n is None:
        raise TypeError("record_history: max_entries must be an int (a size_t; 0: off), got %s %r"
                        % (type(max_entries).__name__, max_entries))
    if not 0 <= n < 2**64:
        raise ValueError("record_history: max_entries must be an int in [0, 2**64 - 1] (a size_t; 0: off), got %r"
                         % (max_entries,))
    for name, value, allowed in (("context", context, _CONTEXT), ("stacks", stacks, _STACKS)):
        if not (value is None or isinstance(value, str)):
            raise TypeError("record_history: %s must be one of %s, got %s %r"
                            % (name, ", ".join(map(repr, allowed)), type(value).__name__, value))
        if value not in allowed:
            raise ValueError("record_history: %s must be one of %s, got %r" % (name, ", ".join(map(repr, allowed)), value))
    clear = _bool_arg(clear_history, "clear_history", "record_history")
    library().fragless_record_history_v2(n, _CONTEXT[context], _STACKS[stacks], 1 if clear else 0)


def _as_index(value):
    """`value` as an int where Python takes it as one (int, numpy's integers: operator.index), else None."""
    try:
        return operator.index(value)
    except TypeError:
        return None


def _bool_arg(value, name, where):
    """A bool argument as PyTorch's bindings (pybind11's bool caster) take it: None is False, a number its truth;
    anything else (a str, a list) is a TypeError naming the parameter, said as `where` says it."""
    if value is None or isinstance(value, numbers.Number):
        return bool(value)
    raise TypeError("%s: %s must be a bool (True, False, None or a number), got %s %r"
                    % (where, name, type(value).__name__, value))


def memory_fraction(device=0):
    """The device's memory fraction: the last one set (PyTorch's set_per_process_memory_fraction, through the
    allocator's hook), else the configuration's per_process_memory_fraction."""
    f = library().fragless_get_memory_fraction(_device(device))
    if f < 0:
        raise RuntimeError(last_error())
    return f


def set_memory_fraction(fraction, device=0):
    """Caps the device's memory at `fraction` of its total (PyTorch's set_per_process_memory_fraction, with
    its rules: a float, in [0, 1])."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0 <= fraction <= 1:
        raise ValueError("Invalid fraction value: {}. Allowed range: 0~1".format(fraction))
    lib = library()
    lib.fragless_set_memory_fraction(fraction, _device(device))
    if last_error():
        raise RuntimeError(last_error())


def empty_cache():
    """Gives the cached memory no allocation uses back to the driver, on every device in use. A driver call
    that failed (a wait for a stream's work, an unmap, a release) raises RuntimeError naming it; what it
    could not give back stays cached."""
    library().fragless_empty_cache()
    error = last_error()
    if error:
        raise RuntimeError(error)


def reset_peak_stats(device=0):
    if library().fragless_reset_peak_stats(_device(device)) < 0:
        raise RuntimeError(last_error())


def reset_accumulated_stats(device=0):
    """Zeroes the counters that only grow (allocations and frees made, retries, OOMs)."""
    if library().fragless_reset_accumulated_stats(_device(device)) < 0:
        raise RuntimeError(last_error())


def mem_get_info(device=0):
    """(free, total) bytes of the device as the driver reports them (what cudaMemGetInfo says)."""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    if library().fragless_mem_get_info(_device(device), ctypes.byref(free), ctypes.byref(total)) < 0:
        raise RuntimeError(last_error())
    return free.value, total.value


from .share import Shared, share, open_shared, close_shared, reap_shared  # noqa: E402 (needs library() above)
