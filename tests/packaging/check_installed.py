"""Run by pip_install.sh with an environment's interpreter, from a folder outside the source tree: the
installed fragless package is the one imported, with no sys.path edit and no FRAGLESS_LIBRARY; it loads the
libfragless.so inside it; fragless.torch.enable() works; and where the package has the OOM thrower, out of
memory through PyTorch's bindings is torch.cuda.OutOfMemoryError with no compiler at run time (CXX is
/bin/false and the cache empty: the thrower inside the package is what is used)."""
import json
import os
import sys
import warnings

import fragless


def check(condition, message=""):  # not a bare assert: python -O would remove it
    if not condition:
        raise AssertionError(message)



pkg = os.path.dirname(os.path.abspath(fragless.__file__))
check(pkg.startswith(sys.prefix), "fragless was imported from %s, not from the environment %s" % (pkg, sys.prefix))
check(fragless.library_path() == os.path.join(pkg, "libfragless.so"), fragless.library_path())
check(os.path.exists(fragless.preload_library_path()), fragless.preload_library_path())
with open(os.path.join(pkg, "fragless_build.json")) as f:
    built = json.load(f)
print("installed: %s, %s" % (pkg, built))
try:
    import torch
except ImportError:
    print("ok: the installed package loads its library (no torch in this environment)")
    sys.exit(0)
import fragless.torch as ft  # noqa: E402

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ft.enable("driver:host,capacity_mb:256")
messages = [str(w.message) for w in caught]
check(built["torch_oom"]["built"], "the package was built without the OOM thrower: %s" % built["torch_oom"]["reason"])
check(built["torch_oom"]["torch"] == torch.__version__, built)
check(ft.oom_error_type() is torch.cuda.OutOfMemoryError, (ft.oom_error_type(), messages))
check(not any("OutOfMemoryError" in m for m in messages), messages)
probe = os.environ.get("FRAGLESS_CPU_PROBE")
if probe:  # libfragless.so as PyTorch's CPU allocator: the OOM goes through PyTorch's bindings
    import ctypes
    lib = fragless.library()
    p = ctypes.CDLL(probe)
    p.probe_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    p.probe_install(ctypes.cast(lib.fragless_malloc, ctypes.c_void_p), ctypes.cast(lib.fragless_free, ctypes.c_void_p))
    x = torch.ones(1 << 18)
    check(fragless.memory_stats(0)["allocated_bytes.all.current"] >= 1 << 20)
    try:
        torch.empty(1 << 40, dtype=torch.uint8)
        raise AssertionError("1 TiB was allocated")
    except torch.cuda.OutOfMemoryError as e:
        check(str(e).startswith("CUDA out of memory. Tried to allocate"), e)
    del x
    print("ok: out of memory through PyTorch's bindings is torch.cuda.OutOfMemoryError (the packaged thrower)")
print("ok: the installed package, its library and its thrower, used from outside the tree")
