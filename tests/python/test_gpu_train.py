"""tools/gpu_train.py's verdict, without PyTorch: a check that does not pass fails the run (its result kept,
an error's text or False) unless its mode and check are a KNOWN_UNSUPPORTED pair, reported with the reason;
every such pair names a mode and a check the script has; the script compiles and its --help runs without
PyTorch."""
import importlib.util
import os
import subprocess
import sys
from checks import check

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
path = os.path.join(root, "tools", "gpu_train.py")
spec = importlib.util.spec_from_file_location("gpu_train", path)
gt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gt)  # defines, runs nothing: main() only under __main__

passing = {name: True for name in gt.CHECKS}
for mode in gt.MODES:
    check(gt.verdict(mode, passing) == ({}, {}), mode)

failed, exempt = gt.verdict("fragless", dict(passing, cuda_graph=False, memory_stats="error: boom"))
check(failed == {"cuda_graph": False, "memory_stats": "error: boom"} and exempt == {}, (failed, exempt))
failed, exempt = gt.verdict("native", dict(passing, dump_snapshot="error: no such file"))
check(failed == {"dump_snapshot": "error: no such file"} and exempt == {}, (failed, exempt))
failed, exempt = gt.verdict("expandable", dict(passing, cuda_graph=None))  # anything but True fails
check(failed == {"cuda_graph": None}, failed)

check(("preload", "cuda_graph") in gt.KNOWN_UNSUPPORTED, gt.KNOWN_UNSUPPORTED)
failed, exempt = gt.verdict("preload", dict(passing, cuda_graph="error: operation not permitted when stream is capturing"))
check(failed == {} and list(exempt) == ["cuda_graph"], (failed, exempt))
check("PYTORCH_NO_CUDA_MEMORY_CACHING" in exempt["cuda_graph"] and "not permitted" in exempt["cuda_graph"], exempt)
# A wrong answer, or another error, in an unsupported pair is a failure all the same.
failed, exempt = gt.verdict("preload", dict(passing, memory_stats=False, cuda_graph=False))
check(failed == {"memory_stats": False, "cuda_graph": False} and exempt == {}, (failed, exempt))
failed, exempt = gt.verdict("preload", dict(passing, cuda_graph="error: an illegal memory access was encountered"))
check(list(failed) == ["cuda_graph"] and exempt == {}, (failed, exempt))

for (mode, name), (why, texts) in gt.KNOWN_UNSUPPORTED.items():
    check(mode in gt.MODES and name in gt.CHECKS and why and texts, (mode, name, why, texts))

r = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True)
check(r.returncode == 0 and "--mode" in r.stdout, (r.returncode, r.stdout, r.stderr))
r = subprocess.run([sys.executable, path, "--mode", "bogus"], capture_output=True, text=True)
check(r.returncode == 2, (r.returncode, r.stderr))
print("gpu_train.py: a failed check fails the run, %d known-unsupported pair(s) exempt and named"
      % len(gt.KNOWN_UNSUPPORTED))
