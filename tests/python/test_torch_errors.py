"""fragless.torch.enable() fails at once, with the message that says what is wrong, rather than at the first
memory call: a bad key or value raises ValueError naming it (as written); where libcuda cannot be loaded
(FRAGLESS_LIBCUDA points nowhere here) it raises RuntimeError saying so and naming driver:host for CPU
use, within a second; and then enable("driver:host") works. Exits 77 (skipped) without PyTorch. Run with
FRAGLESS_LIBRARY set."""
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
        print("enable(%r): ValueError: %s" % (conf, str(e)[:100]))

# The default driver is cuda: without libcuda, enable() says so at once and names the host driver.
start = time.monotonic()
for conf in ("", "policy:classic"):
    try:
        ft.enable(conf)
        raise AssertionError("enable(%r) succeeded without libcuda" % conf)
    except RuntimeError as e:
        msg = str(e)
        check("driver:host" in msg and "libcuda" in msg, msg)
check(time.monotonic() - start < 5, "enable() took %.1f s to fail" % (time.monotonic() - start))
print("enable() without libcuda: RuntimeError at once: %s" % msg[:160])
check(ft._enabled is None)  # nothing was installed by the failed calls

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ft.enable("driver:host,capacity_mb:256")
check(fragless.memory_stats(0)["reserved_bytes.all.current"] == 0)
print("enable('driver:host') then works: checks passed")
