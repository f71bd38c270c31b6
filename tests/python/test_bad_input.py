"""The Python helper given bad input, on the host driver, without PyTorch: each refusal is raised where the
value is given, as the exception its kind calls for (TypeError for a value of the wrong type, ValueError for
one out of range), naming what was wrong; nothing reaches the C ABI that ctypes would wrap or truncate, and
the library's own messages come back whatever bytes they hold.

  record_history     max_entries outside [0, 2**64 - 1] (ctypes wrapped 2**64 to 0: history off)
  pointers           share, close_shared: an int that is not an address (ctypes wrapped 2**64 + p to p), or
                     no int at all; open_shared's device as the package's other calls check it (2**32 was
                     device 0)
  last_error         a byte of FRAGLESS_CONF that is not UTF-8 (the real error became UnicodeDecodeError)
  configurations     check_config, same_config and fragless.torch.enable take a str only (anything else was an
                     AttributeError about encode) with no NUL (ctypes cut the string there: "driver:host\\0,bogus:1"
                     passed)
  max_entries        torch.cuda.memory._record_memory_history's max_entries through fragless.torch: what
                     PyTorch's binding (a size_t) refuses is a TypeError (-5 was taken for 1); the legacy
                     form's trace_alloc_max_entries an int64 (2.7 was taken for 2, -3 for 1)
  record_history     a wrong type a TypeError naming the parameter (clear_history='no' cleared the history)
  dump_snapshot      a file name only (an int was opened as a file descriptor: the device's memory)

Usage: test_bad_input.py (FRAGLESS_LIBRARY names libfragless.so)"""
import ctypes
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "..", "..", "torch_plugin", "python")
sys.path.insert(0, PACKAGE)
sys.path.insert(0, HERE)
os.environ["FRAGLESS_CONF"] = "driver:host,shareable_handles:True,capacity_mb:64"
import fragless  # noqa: E402
import fragless.torch as ft  # noqa: E402 (imports without PyTorch; only enable() needs it)
from checks import check  # noqa: E402


def raises(exc, fn, *args, **kwargs):
    """The message of the `exc` that fn(*args, **kwargs) raises; an AssertionError when it raises nothing or
    another exception."""
    try:
        fn(*args, **kwargs)
    except exc as e:
        return str(e)
    except Exception as e:
        raise AssertionError("%s(%r, %r) raised %s (%s), not %s" % (getattr(fn, "__name__", fn), args, kwargs,
                                                                   type(e).__name__, e, exc.__name__))
    raise AssertionError("%s(%r, %r) raised no %s" % (getattr(fn, "__name__", fn), args, kwargs, exc.__name__))


lib = fragless.library()
lib.fragless_pool_malloc.restype = ctypes.c_void_p
lib.fragless_pool_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]


def traces():  # the entries but snapshot marks (each snapshot adds one)
    return len([e for e in fragless.snapshot()["device_traces"][0] if e["action"] != "snapshot"])


# record_history: max_entries is a size_t.
fragless.record_history(100)
p = lib.fragless_pool_malloc(1000, 0, None)
lib.fragless_free(p, 1000, 0, None)
before = traces()
check(before >= 2, before)
for bad in (2**64, 2**64 + 3, 2**70, -1):
    message = raises(ValueError, fragless.record_history, bad)
    check("max_entries must be an int in [0, 2**64 - 1]" in message and repr(bad) in message, message)
check(traces() == before, "a refused max_entries changed the history")
fragless.record_history(2**64 - 1)  # the largest a size_t holds: accepted
check(traces() == before, "the history was kept")
# A value of the wrong type is a TypeError naming the parameter; numpy's integers are ints.
for kwargs, words in (({"max_entries": 10.0}, "max_entries must be an int"), ({"max_entries": None}, "max_entries"),
                      ({"max_entries": True}, "max_entries"), ({"context": ["alloc"]}, "context must be one of"),
                      ({"stacks": 1}, "stacks must be one of"), ({"clear_history": "no"}, "clear_history must be")):
    args = dict({"max_entries": 10}, **kwargs)
    message = raises(TypeError, fragless.record_history, **args)
    check(words in message, message)
check(traces() == before, "a refused argument changed the history")
try:
    import numpy
    fragless.record_history(numpy.int64(100))
    check(traces() == before, "the history was kept")
except ImportError:
    print("numpy is not installed: a numpy integer's max_entries was not checked")
fragless.record_history(0)
# dump_snapshot: an int would be opened as a file descriptor (the host driver's device memory is one).
for bad in (3, 0, None, 1.5):
    message = raises(TypeError, fragless.dump_snapshot, bad)
    check("expected a file name (str or os.PathLike)" in message, message)

# Pointers and devices.
p = lib.fragless_pool_malloc(1 << 20, 0, None)
check(p, fragless.last_error())
s = fragless.share(p)
q, size = fragless.open_shared(s)
for bad in (2**64 + q, -1, -q, 2**70):
    message = raises(ValueError, fragless.close_shared, bad)
    check("is not an address" in message, message)
for bad in ("0x10", 1.5, None, True, b"\x00"):
    check("expected a pointer" in raises(TypeError, fragless.close_shared, bad), bad)
check("is not an address" in raises(ValueError, fragless.share, 2**64 + p))
check("expected a pointer" in raises(TypeError, fragless.share, float(p)))
for bad in (2**32, 2**31, -2**31 - 1):
    check("out of range" in raises(ValueError, fragless.open_shared, s, device=bad), bad)
check("expected a device index" in raises(ValueError, fragless.open_shared, s, device=True))
fragless.close_shared(ctypes.c_void_p(q))  # still open after every refusal: closed now
check("open_shared did not return" in raises(RuntimeError, fragless.close_shared, q))
s.close()
lib.fragless_free(p, 0, 0, None)
check(fragless.last_error() == "", fragless.last_error())

# Configuration strings.
for fn in (fragless.check_config, fragless.check_driver):
    for bad in (None, b"driver:host", 123, ["driver:host"]):
        message = raises(TypeError, fn, bad)
        check("expected a str (a FRAGLESS_CONF string), got %s" % type(bad).__name__ in message, message)
for a, b in ((None, ""), ("", None), (b"", ""), ("", 1)):
    check("expected a str" in raises(TypeError, fragless.same_config, a, b), (a, b))
for bad in ("driver:host\0,bogus:1", "\0", "policy:fragless\0"):
    message = raises(ValueError, fragless.check_config, bad)
    check("has a NUL character at index %d" % bad.index("\0") in message, message)
check("NUL" in raises(ValueError, fragless.same_config, "driver:host\0,bogus:1", "driver:host"))
check(fragless.same_config("driver:host", "driver:host,policy:fragless"))
check("policy" in raises(ValueError, fragless.same_config, "policy:fragles", ""))
for bad in (b"driver:host", 123):
    message = raises(TypeError, ft.enable, bad)
    check("fragless.torch.enable: expected a str" in message, message)
check("NUL" in raises(ValueError, ft.enable, "driver:host\0,bogus:1"))

# _record_memory_history's max_entries, as PyTorch's binding takes it (a size_t: anything else a TypeError),
# checked before the call does anything.
fragless.record_history(100)
p = lib.fragless_pool_malloc(1000, 0, None)
lib.fragless_free(p, 1000, 0, None)
before = traces()
for bad in (-5, -1, 2**64, "x", 1.5, None):
    message = raises(TypeError, ft._record_history_current, "all", max_entries=bad)
    check("incompatible function arguments: max_entries" in message, message)
    raises(TypeError, ft._record_history_current, None, max_entries=bad)  # converted before enabled is read
check(traces() == before, "a refused max_entries changed the history")
ft._record_history_current("all", context=None, max_entries=2**64 - 1)
ft._record_history_current(None)
check(traces() == 0)
# The legacy form's trace_alloc_max_entries, an int64 in PyTorch's binding: a TypeError for another type, a
# ValueError for a negative count (which PyTorch would turn into a huge size_t); clear_history a bool.
for bad in ("x", 2.7, 10**30, None):
    message = raises(TypeError, ft._record_history_legacy, True, trace_alloc_max_entries=bad)
    check("trace_alloc_max_entries must be an int (an int64)" in message, message)
check("must not be negative" in raises(ValueError, ft._record_history_legacy, True, trace_alloc_max_entries=-3))
check("clear_history must be a bool" in raises(TypeError, ft._record_history_current, "all", clear_history="no"))
ft._record_history_legacy(True, trace_alloc_max_entries=5, clear_history=0)  # a number is its truth, as in pybind11
ft._record_history_current(None)

# last_error(): a FRAGLESS_CONF byte that is not UTF-8 comes back as U+FFFD, in the library's own message.
probe = """
import sys
sys.path.insert(0, %r)
import fragless
try:
    fragless.device_count()
except RuntimeError as e:
    print("RuntimeError:", ascii(str(e)))
try:
    import os
    fragless.check_config(os.environ["FRAGLESS_CONF"])
except ValueError as e:
    print("ValueError:", ascii(str(e)))
""" % PACKAGE
env = dict(os.environb)
env[b"FRAGLESS_CONF"] = b"driver:host,policy:fragl\xffss"
out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, errors="replace")
check(out.returncode == 0, out.stderr)
lines = out.stdout.splitlines()
check(len(lines) == 2 and lines[0].startswith("RuntimeError:") and "policy" in lines[0] and "\\ufffd" in lines[0],
      out.stdout + out.stderr)
check(lines[1].startswith("ValueError:") and "policy" in lines[1], out.stdout + out.stderr)

print("python bad input: every refusal raised where it was given, naming what was wrong")
