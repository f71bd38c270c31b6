"""The Python helper without a GPU and without PyTorch: loading libfragless.so, the ctypes binding, stats
keys, snapshots in PyTorch's layout. Run with FRAGLESS_LIBRARY and FRAGLESS_LIBCUDA (the libcuda double)
set; the PyTorch part is a separate test, reported skipped where torch is missing."""
import ctypes
import os
import pickle
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "torch_plugin", "python"))
import fragless  # noqa: E402
from checks import check  # noqa: E402

lib = fragless.library()
check(fragless.library_path() == os.environ["FRAGLESS_LIBRARY"])
check(fragless.device_count() == 2, fragless.device_count())
fragless.record_history(1000)

# 0x100 stands for a stream the CUDA runtime created on device 0: the libcuda double refuses unknown streams.
_fake = ctypes.CDLL(os.environ["FRAGLESS_LIBCUDA"])
check(_fake.fakecuda_adopt_stream(ctypes.c_void_p(0x100), 0) == 1)
stream = ctypes.c_void_p(0x100)
ptrs = [lib.fragless_malloc(size, 0, stream) for size in (512, 3 << 20, 24 << 20)]
check(all(ptrs), fragless.last_error())
stats = fragless.memory_stats(0)
for key in ("allocated_bytes.all.current", "reserved_bytes.all.peak", "active_bytes.large_pool.current",
            "num_alloc_retries", "num_ooms", "segment.all.current", "requested_bytes.all.current",
            "fragless.live_bytes.current"):
    check(key in stats, key)
check(stats["allocation.all.current"] == 3)
check(stats["allocated_bytes.all.current"] >= (27 << 20))
check(list(stats) == sorted(stats))

snap = fragless.snapshot()
check(set(snap) >= {"segments", "device_traces"})
check(len(snap["device_traces"]) == 2)
actions = [e["action"] for e in snap["device_traces"][0]]
check(actions.count("alloc") == 3, actions)
check("snapshot" not in actions, actions)
# Each snapshot marks the history after copying it, as PyTorch's does: the next one shows a snapshot entry,
# at address 0, with the bytes of the active blocks the first one showed.
active = sum(b["size"] for s in snap["segments"] if s["device"] == 0 for b in s["blocks"]
             if b["state"] in ("active_allocated", "active_pending_free"))
marks = [e for e in fragless.snapshot()["device_traces"][0] if e["action"] == "snapshot"]
check(len(marks) == 1 and marks[0]["addr"] == 0 and marks[0]["size"] == active > 0, (marks, active))
# The segment stats count the mapped ranges the snapshot shows (Note [Mapped ranges are segments]).
stats = fragless.memory_stats(0)
ranges = sum(1 for s in snap["segments"] if s["device"] == 0)
check(stats["segment.all.current"] == ranges > 0, (stats["segment.all.current"], ranges))
check(stats["segment.all.current"] == stats["segment.all.allocated"] - stats["segment.all.freed"], stats)
live = sum(b["state"] == "active_allocated" for s in snap["segments"] for b in s["blocks"])
check(live == 3, live)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "snap.pickle")
    fragless.dump_snapshot(path)
    with open(path, "rb") as f:
        check(pickle.load(f)["segments"])

for p, size in zip(ptrs, (512, 3 << 20, 24 << 20)):
    lib.fragless_free(p, size, 0, stream)
# A driver call of empty_cache that fails raises, naming it; what it could not give back stays cached, and
# the next empty_cache gives it back.
_fake.fakecuda_fail(b"cuStreamSynchronize", 1, 999)
try:
    fragless.empty_cache()
    raise AssertionError("a failed stream synchronisation in empty_cache raised nothing")
except RuntimeError as e:
    check("cuStreamSynchronize" in str(e), e)
check(fragless.memory_stats(0)["reserved_bytes.all.current"] > 0)
_fake.fakecuda_reset_failures()
fragless.empty_cache()
# The history keeps the last max_entries entries as the snapshot shows them (Note [The history counts
# snapshot entries]): an empty_cache and the physical handles take no place, a free is its two entries.
for n in (1, 2, 5, 7):
    fragless.record_history(n, clear_history=True)
    ptrs = [lib.fragless_malloc(30 << 20, 0, stream) for _ in range(4)]
    for p in ptrs:
        lib.fragless_free(p, 30 << 20, 0, stream)
    fragless.empty_cache()
    entries = [e["action"] for e in fragless.snapshot()["device_traces"][0]]
    check(len(entries) == n, (n, entries))
    check(entries[-1] in ("segment_unmap", "segment_free", "free_completed"), (n, entries))
fragless.record_history(1000)
stats = fragless.memory_stats(0)
check(stats["allocated_bytes.all.current"] == 0)
check(stats["reserved_bytes.all.current"] == 0, stats["reserved_bytes.all.current"])
print(fragless.memory_summary(0))

try:
    fragless.memory_stats(5)
    raise AssertionError("an invalid device was accepted")
except RuntimeError as e:
    check("invalid device 5" in str(e), e)

try:
    import torch  # noqa: F401
    have_torch = True
except ImportError:
    have_torch = False
if not have_torch:
    import fragless.torch as ft
    try:
        ft.enable()
        raise AssertionError("enable() without PyTorch did not complain")
    except ImportError as e:
        check("needs PyTorch" in str(e), e)
# memory_summary counts the segments a snapshot shows, under every policy (each in its own process: the
# policy is read from FRAGLESS_CONF when the library loads).
import subprocess  # noqa: E402
probe = """
import ctypes, re, sys
sys.path.insert(0, %r)
import fragless
lib = fragless.library()
s = ctypes.c_void_p(0x100)
ptrs = [lib.fragless_malloc(n, 0, s) for n in (512, 3 << 20, 24 << 20, 100 << 20)]
if not all(ptrs):
    raise AssertionError(fragless.last_error())
want = sum(1 for seg in fragless.snapshot()["segments"] if seg["device"] == 0)
text = fragless.memory_summary(0)
got = int(re.search(r"segments (\\d+)", text).group(1))
if not (want > 0 and got == want):
    raise AssertionError((got, want, text))
print(got)
""" % os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "torch_plugin", "python")
for policy in ("classic", "expandable", "fragless"):
    env = dict(os.environ, FRAGLESS_CONF="policy:" + policy)
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    check(r.returncode == 0, (policy, r.stdout, r.stderr))
    print("memory_summary under %s: segments %s" % (policy, r.stdout.strip()))
# The driver's version bounds what cuGetProcAddress is asked for (R10), and an old driver is named; physical
# memory is shareable (a POSIX fd handle type) only when shareable_handles asks (R11). Each in its own
# process: libcuda is loaded once per process.
probe2 = """
import ctypes, sys
sys.path.insert(0, %r)
import fragless
try:
    n = fragless.device_count()
except RuntimeError as e:
    print("error:", e)
    sys.exit(0)
lib = fragless.library()
p = lib.fragless_malloc(4 << 20, 0, ctypes.c_void_p(0))
if not p:
    raise AssertionError(fragless.last_error())
fake = ctypes.CDLL(%r)
print("types", fake.fakecuda_last_handle_types())
""" % (os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "torch_plugin", "python"),
       os.environ["FRAGLESS_LIBCUDA"])


def run_probe(**env):
    r = subprocess.run([sys.executable, "-c", probe2], env=dict(os.environ, **env), capture_output=True, text=True)
    check(r.returncode == 0, (env, r.stdout, r.stderr))
    return r.stdout.strip()


# check_driver refuses what the driver would refuse at its start, in the same words, creating nothing.
try:
    fragless.check_driver("driver:host,shareable_handles:fabric")
    raise AssertionError("check_driver() took shareable_handles:fabric on the host driver")
except RuntimeError as e:
    check("shareable_handles:fabric needs the cuda driver" in str(e), str(e))
fragless.check_driver("driver:host,shareable_handles:True")
# ... and a trace file it could not write: a folder that is not there, a directory, a FIFO; a good path is
# not created by the check.
with tempfile.TemporaryDirectory() as tmp:
    os.mkfifo(os.path.join(tmp, "fifo"))
    for path, words in ((os.path.join(tmp, "none", "x.fgt"), "its folder '%s': No such file" % os.path.join(tmp, "none")),
                        (tmp, "is a directory (a trace is written to a regular file"),
                        (os.path.join(tmp, "fifo"), "is a FIFO"),
                        (os.path.join(tmp, "x" * 300 + ".fgt"), "File name too long (a name of 304 bytes"),
                        (os.path.join(tmp, *["d" * 200] * 21, "t.fgt"), "File name too long"),
                        ("/dev/full", "is a character device other than /dev/null")):
        try:
            fragless.check_driver("driver:host,trace:" + path)
            raise AssertionError("check_driver() took trace:" + path)
        except RuntimeError as e:
            check(words in str(e), str(e))
    fragless.check_driver("driver:host,trace:" + os.path.join(tmp, "t-%p.fgt"))
    fragless.check_driver("driver:host,trace:/dev/null")
    check(sorted(os.listdir(tmp)) == ["fifo"], os.listdir(tmp))
# A FRAGLESS_LIBRARY that names nothing is an error, not a reason to load another library.
r = subprocess.run([sys.executable, "-c", "import fragless; fragless.library()"], capture_output=True, text=True,
                   env=dict(os.environ, FRAGLESS_LIBRARY=os.path.join(os.path.dirname(fragless.library_path()), "nope.so"),
                            PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(fragless.__file__)))))
check(r.returncode != 0 and "FRAGLESS_LIBRARY names " in r.stderr and "which is not there" in r.stderr, r.stderr)

out = run_probe(FAKECUDA_DRIVER_VERSION="11020")
check("supports CUDA 11.2; fragless needs CUDA 11.3 or newer" in out, out)
check(run_probe(FAKECUDA_DRIVER_VERSION="11080") == "types 0")  # asked for 11.8 at most, else nothing resolves
check(run_probe() == "types 0", "a shareable handle type was requested without shareable_handles")
check(run_probe(FRAGLESS_CONF="shareable_handles:True") == "types 1")  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
print("python helper: all checks passed")
