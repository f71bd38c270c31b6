"""fragless::torch::install() (C++) and fragless.torch.enable() (Python) must register the same hooks: every
setter the Python helper calls on torch._C._CUDAPluggableAllocator appears as a call in torch_cuda.cpp, and
the other way round."""
import ast
import os
import re
import sys

root = sys.argv[1]
py = open(os.path.join(root, "torch_plugin", "python", "fragless", "torch.py")).read()
cpp = open(os.path.join(root, "torch_plugin", "torch_cuda.cpp")).read()

hooks = None
for node in ast.walk(ast.parse(py)):
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_HOOKS" for t in node.targets):
        hooks = [elt.elts[0].value for elt in node.value.elts]
assert hooks, "torch.py has no _HOOKS list"
called = set(re.findall(r"->\s*(set_\w+)\s*\(", re.sub(r"//[^\n]*", "", cpp)))
missing = [h for h in hooks if h not in called]
extra = sorted(called - set(hooks))
assert not missing, "install() does not set %s (the Python helper does)" % missing
assert not extra, "install() sets %s, which the Python helper does not" % extra
print("install() and enable() set the same %d hooks: %s" % (len(hooks), ", ".join(hooks)))
