"""fragless.torch.enable() fails at once, with the message that says what is wrong, rather than at the first
memory call: a bad key or value raises ValueError naming it (as written); where libcuda cannot be loaded
(FRAGLESS_LIBCUDA points nowhere here) it raises RuntimeError saying so and naming driver:host for CPU
use, within a second; an option the driver never takes (shareable_handles:fabric on the host driver)
raises RuntimeError in the words of the first allocation; and then enable("driver:host") works, saying
that it does not use the environment's FRAGLESS_CONF; enable() again with other settings raises
RuntimeError naming the ones in effect. Exits 77 (skipped) without PyTorch. Run with FRAGLESS_LIBRARY set."""
import os
import time
import warnings

from torch_prologue import announce, check  # exits 77 (skipped) without PyTorch
announce()
os.environ["FRAGLESS_LIBCUDA"] = "/nonexistent/libcuda.so.1"
os.environ.pop("FRAGLESS_CONF", None)
import fragless  # noqa: E402
import fragless.torch as ft  # noqa: E402

for conf, want in (("policy:fragles", "'fragles' for key 'policy'"),
                   ("policy:fragless,max_split_size_mb:10", "at least 20"),
                   ("handles ends", "'handles ends'"),
                   ("polcy:classic", "unknown key 'polcy'"),
                   ("backend:cudaMallocAsync", "PyTorch's own allocator")):
    try:
        ft.enable(conf)
        raise AssertionError("enable(%r) did not raise" % conf)
    except ValueError as e:
        check(want in str(e), (conf, str(e)))
        check("FRAGLESS_CONF" not in str(e), (conf, str(e)))  # the string was enable()'s own
        print("enable(%r): ValueError: %s" % (conf, str(e)[:100]))
# From the environment, the message names where the string came from.
os.environ["FRAGLESS_CONF"] = "polcy:classic"
try:
    ft.enable()
    raise AssertionError("enable() took FRAGLESS_CONF=polcy:classic")
except ValueError as e:
    check("FRAGLESS_CONF: unknown key 'polcy'" in str(e), str(e))
finally:
    os.environ.pop("FRAGLESS_CONF")

# The default driver is cuda: without libcuda, enable() says so at once and names the host driver.
start = time.monotonic()
for conf in ("", "policy:classic"):
    try:
        ft.enable(conf)
        raise AssertionError("enable(%r) succeeded without libcuda" % conf)
    except RuntimeError as e:
        msg = str(e)
        check("driver:host" in msg and "libcuda" in msg, msg)
        check(msg.count("driver:host") == 1, msg)  # the advice once (the library's message gives it already)
check(time.monotonic() - start < 5, "enable() took %.1f s to fail" % (time.monotonic() - start))
print("enable() without libcuda: RuntimeError at once: %s" % msg[:160])

# A driver that refuses an option it never takes says so at enable(), in the words of the first allocation:
# the host driver cannot carry CUDA's fabric handles.
try:
    ft.enable("driver:host,shareable_handles:fabric")
    raise AssertionError("enable() took shareable_handles:fabric on the host driver")
except RuntimeError as e:
    check("shareable_handles:fabric needs the cuda driver" in str(e), str(e))
    check("For CPU use" not in str(e), str(e))  # the host driver is already there: no advice to take it
    print("enable('driver:host,shareable_handles:fabric'): RuntimeError: %s" % str(e)[:120])
check(ft._enabled is None)  # nothing was installed by the failed calls
check("FRAGLESS_CONF" not in os.environ, os.environ.get("FRAGLESS_CONF"))  # nor left in the environment

# A key given twice is refused, as any other mistake is (the first value would be silently dropped).
try:
    ft.enable("driver:host,policy:classic,policy:fragless")
    raise AssertionError("enable() took a key given twice")
except ValueError as e:
    check("'policy' is given more than once" in str(e), str(e))

# An explicit conf replaces the environment's FRAGLESS_CONF: enable() says so rather than dropping its keys.
# PyTorch's own allocator settings get a warning too: they configure the allocator fragless replaces.
os.environ["FRAGLESS_CONF"] = "policy:classic"
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
conf = "driver:host,capacity_mb:256"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = ft.enable(conf)
del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
said = [str(w.message) for w in caught if "FRAGLESS_CONF='policy:classic'" in str(w.message)]
check(len(said) == 1 and "not used" in said[0], [str(w.message) for w in caught])
pytorch_said = [str(w.message) for w in caught if "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'" in str(w.message)]
check(len(pytorch_said) == 1 and "do not apply" in pytorch_said[0], [str(w.message) for w in caught])
check(os.environ["FRAGLESS_CONF"] == conf, os.environ["FRAGLESS_CONF"])
check(fragless.memory_stats(0)["reserved_bytes.all.current"] == 0)
print("enable('driver:host') then works, warning that the environment's FRAGLESS_CONF is not used: %s" % said[0][:120])

# Called again: the same settings (however spelled, or none: the environment's, which enable() set) return
# what the first call returned; other settings are an error naming the ones in effect.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    check(ft.enable(conf) is first)
    check(ft.enable(" capacity_mb:256, driver:host") is first)
    check(ft.enable() is first)
check(not caught, [str(w.message) for w in caught])
for other in ("driver:host,capacity_mb:512", "driver:host"):
    try:
        ft.enable(other)
        raise AssertionError("enable(%r) after enable(%r) did not raise" % (other, conf))
    except RuntimeError as e:
        check("already enabled" in str(e) and repr(conf) in str(e) and repr(other) in str(e), str(e))
        # Without CUDAPluggableAllocator or a device, the first call warned that fragless is not PyTorch's
        # allocator; the error does not say it is.
        check(("once it is PyTorch's allocator" in str(e)) == bool(first), str(e))
        check(("not PyTorch's allocator here" in str(e)) == (not first), str(e))
        print("enable(%r) again: RuntimeError: %s" % (other, str(e)[:140]))
try:  # a bad string the second time is named as bad, not only as other settings
    ft.enable("driver:host,bogus:1")
    raise AssertionError("enable('driver:host,bogus:1') again did not raise")
except ValueError as e:
    check("unknown key 'bogus'" in str(e), str(e))
    # The string was enable()'s, not the environment's: the message does not send the user to FRAGLESS_CONF.
    check("FRAGLESS_CONF" not in str(e) and str(e).startswith("fragless.torch.enable('driver:host,bogus:1'): "),
          str(e))

# Device arguments are PyTorch's: a torch.cuda.device object names its index; an int that does not fit a C int
# is an error, not device 0 (ctypes would wrap 2**32 to 0); record_history takes no negative size.
import torch  # noqa: E402
check(torch.cuda.memory_allocated(torch.cuda.device(0)) == torch.cuda.memory_allocated(0))
for bad in (lambda: fragless.memory_stats(2**32), lambda: torch.cuda.memory_allocated(2**32),
            lambda: fragless.record_history(-1)):
    try:
        bad()
        raise AssertionError("accepted")
    except (ValueError, RuntimeError) as e:
        print("refused: %s" % e)

# numpy's integers are device indices, as PyTorch takes them.
try:
    import numpy  # noqa: E402
    check(fragless.memory_stats(numpy.int64(0)) == fragless.memory_stats(0))
except ImportError:
    print("numpy is not here: its integers as device indices not checked")

# A first enable() after another fragless call made the allocator: with other settings it raises (they cannot
# apply), with the same ones (however spelled) it works. In a fresh process.
import subprocess  # noqa: E402
import sys  # noqa: E402


def fresh(script, want, **extra):
    """Runs `script` in a fresh interpreter (the package as this one finds it, no FRAGLESS_CONF) and checks
    that it succeeds and prints `want`; returns what it printed."""
    env = dict(os.environ)
    env.pop("FRAGLESS_CONF", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    check(r.returncode == 0 and want in r.stdout, (r.returncode, r.stdout, r.stderr))
    return r.stdout.strip()


script = r"""
import os, fragless, fragless.torch as ft
os.environ["FRAGLESS_CONF"] = "driver:host,capacity_mb:64"
fragless.memory_stats(0)  # makes the allocator
if fragless.settings() != "driver:host,capacity_mb:64":
    raise SystemExit("settings: %r" % fragless.settings())
try:
    ft.enable("driver:host,capacity_mb:128")
    raise SystemExit("enable() with other settings did not raise")
except RuntimeError as e:
    if "already made" not in str(e) or "capacity_mb:64" not in str(e):
        raise SystemExit(str(e))
import warnings
warnings.simplefilter("ignore")
ft.enable("capacity_mb:64, driver:host,policy:fragless")  # the same settings, spelled otherwise
print("made first:", fragless.settings())
"""
print("enable() after another call made the allocator: %s" % fresh(script, "made first: driver:host,capacity_mb:64"))

# An earlier call that failed to make the allocator (here: no libcuda for the default cuda driver) fixed
# the process without one: enable() says so instead of passing.
script = r"""
import fragless, fragless.torch as ft
try:
    fragless.memory_stats(0)
except RuntimeError:
    pass
try:
    ft.enable("driver:host")
    raise SystemExit("enable() passed after a failed making")
except RuntimeError as e:
    if "could not be made" not in str(e) or "libcuda" not in str(e):
        raise SystemExit(str(e))
    print("failed first:", str(e)[:100])
"""
print("enable() after a failed making: %s" % fresh(script, "failed first:", FRAGLESS_LIBCUDA="/nonexistent/libcuda.so.1"))
print("checks passed")
