"""The prologue of the PyTorch tests run from this folder (test_frames_torch.py, test_torch_errors.py,
test_torch_api.py, test_torch_oom.py): imported first, it puts the helper's package (torch_plugin/python) and
this folder on sys.path and imports torch, or ends the test as skipped (exit 77) where this Python cannot
import it. announce() prints the interpreter and the torch the test runs with."""
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
