"""Out of memory under fragless.torch.enable() is a torch.cuda.OutOfMemoryError, with PyTorch's first sentence.

enable() builds a thrower against the running PyTorch (torch_plugin/python/fragless/torch_oom.cpp) and hands
it to libfragless.so. Without a GPU the path is exercised through PyTorch's CPU allocator: a probe
(oom_probe.cpp) makes libfragless.so (host driver) PyTorch's CPU allocator, so torch.empty calls
fragless_malloc, which throws through PyTorch's bindings exactly as it does from CUDAPluggableAllocator.
Exits 77 (skipped) without PyTorch, its headers or a compiler."""
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "torch_plugin", "python"))
try:
    import torch
except ImportError:
    print("SKIPPED: PyTorch is not installed for %s" % sys.executable)
    sys.exit(77)
root = os.path.dirname(torch.__file__)
cxx = shutil.which("c++") or shutil.which("g++")
if not cxx or not os.path.exists(os.path.join(root, "include", "c10", "core", "Allocator.h")):
    print("SKIPPED: no C++ compiler or no PyTorch C++ headers here")
    sys.exit(77)

import fragless  # noqa: E402
import fragless.torch as ft  # noqa: E402
from checks import check  # noqa: E402

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ft.enable()
check(ft._oom_shim is not None, "the thrower was not built: %s" % [str(w.message) for w in caught])

# The probe: libfragless.so as PyTorch's CPU allocator.
work = tempfile.mkdtemp(prefix="fragless-oom-")
probe = os.path.join(work, "probe.so")
libdir = os.path.join(root, "lib")
cmd = [cxx, "-O1", "-std=c++17", "-shared", "-fPIC",
       "-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI),
       "-I", os.path.join(root, "include"), os.path.join(os.path.dirname(__file__), "oom_probe.cpp"),
       "-o", probe, "-L", libdir, "-lc10", "-Wl,-rpath," + libdir]
r = subprocess.run(cmd, capture_output=True, text=True)
check(r.returncode == 0, r.stderr[-3000:])
lib = fragless.library()
p = ctypes.CDLL(probe)
p.probe_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
p.probe_install(ctypes.cast(lib.fragless_malloc, ctypes.c_void_p), ctypes.cast(lib.fragless_free, ctypes.c_void_p))

before = fragless.memory_stats(0)["num_alloc_retries"]
x = torch.ones(1 << 20)
check(float(x.sum()) == float(1 << 20))
check(fragless.memory_stats(0)["allocated_bytes.all.current"] >= 4 << 20)  # the tensor is fragless memory

try:
    torch.empty(1 << 40, dtype=torch.uint8)
    raise AssertionError("1 TiB was allocated")
except torch.cuda.OutOfMemoryError as e:
    msg = str(e)
check(msg.startswith("CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has a total capacity of "), msg)
check("fragless" in msg, msg)
check(fragless.memory_stats(0)["num_alloc_retries"] == before + 1)  # the retry chain ran first

# Without the thrower the same failure is a plain RuntimeError: the thrower is what makes the type.
lib.fragless_set_oom_thrower(None)
try:
    torch.empty(1 << 40, dtype=torch.uint8)
    raise AssertionError("1 TiB was allocated")
except torch.cuda.OutOfMemoryError:
    raise AssertionError("OutOfMemoryError without the thrower")
except RuntimeError as e:
    check("CUDA out of memory. Tried to allocate" in str(e), e)
del x
shutil.rmtree(work)
print("OOM under fragless.torch.enable(): torch.cuda.OutOfMemoryError, message as PyTorch's")
