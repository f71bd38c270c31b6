"""fragless.torch.enable() inside PyTorch: needs torch with CUDA and a GPU. Exits 77 (skipped) otherwise."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "torch_plugin", "python"))
try:
    import torch
except ImportError:
    print("SKIPPED: PyTorch is not installed for %s" % sys.executable)
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIPPED: PyTorch has no usable CUDA device here (%s, torch %s)" % (sys.executable, torch.__version__))
    sys.exit(77)
import fragless.torch as ft  # noqa: E402
from checks import check  # noqa: E402
print("interpreter: %s, torch %s" % (sys.executable, torch.__version__))

ft.enable()
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
y = x + 1
s = ft.memory_stats(torch.cuda.current_device())
check(s["allocated_bytes.all.current"] >= 128 << 20, s)
del x, y
ft.empty_cache()
try:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    raise AssertionError("1 PiB was allocated")
except torch.cuda.OutOfMemoryError as e:  # not just RuntimeError: the thrower enable() built
    check(str(e).startswith("CUDA out of memory. Tried to allocate"), e)
print("fragless.torch.enable(): OK")
