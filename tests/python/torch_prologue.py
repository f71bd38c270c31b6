"""The prologue of the PyTorch tests run from this folder (test_frames_torch.py, test_torch_errors.py,
test_torch_api.py, test_torch_oom.py): imported first, it puts the helper's package (torch_plugin/python) and
this folder on sys.path and imports torch, or ends the test as skipped (exit 77) where this Python cannot
import it. announce() prints the interpreter and the torch the test runs with; fragless_as_cpu_allocator() makes
libfragless.so (host driver) PyTorch's CPU allocator through the probe (FRAGLESS_CPU_PROBE), or ends the test
as skipped where no probe was built."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "torch_plugin", "python"))
sys.path.insert(0, HERE)
from checks import check  # noqa: E402,F401  (the tests take it from here)
try:
    import torch
except ImportError as e:
    print("SKIPPED: PyTorch is not importable by %s (%s)" % (sys.executable, e))
    sys.exit(77)


def announce():
    print("interpreter: %s, torch %s" % (sys.executable, torch.__version__))


def fragless_as_cpu_allocator(conf="driver:host,capacity_mb:1024", watchdog_s=120):
    """Makes fragless (configured by `conf`) PyTorch's CPU allocator; returns the library (ctypes). A test that
    hangs past `watchdog_s` fails with every thread's stack."""
    import ctypes
    import faulthandler
    probe_path = os.environ.get("FRAGLESS_CPU_PROBE")
    if not probe_path or not os.path.exists(probe_path):
        print("SKIPPED: no CPU-allocator probe (FRAGLESS_CPU_PROBE; built where PyTorch's C++ headers are found)")
        sys.exit(77)
    announce()
    faulthandler.dump_traceback_later(watchdog_s, exit=True)
    os.environ["FRAGLESS_CONF"] = conf
    import fragless
    lib = fragless.library()
    probe = ctypes.CDLL(probe_path)
    probe.probe_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    probe.probe_install(ctypes.cast(lib.fragless_malloc, ctypes.c_void_p),
                        ctypes.cast(lib.fragless_free, ctypes.c_void_p))
    return lib
