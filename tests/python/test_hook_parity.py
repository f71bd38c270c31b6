"""fragless::torch::install() (C++) and fragless.torch.enable() (Python) must register the same hooks with
the same functions: every setter the Python helper calls on torch._C._CUDAPluggableAllocator is called in
torch_cuda.cpp with a function that calls the same exported fragless_* function, and the other way round;
the allocation and free functions are the same too. Usage: test_hook_parity.py SOURCE_DIR"""
import ast
import os
import re
import sys
from checks import check  # noqa: E402

root = sys.argv[1]
py = open(os.path.join(root, "torch_plugin", "python", "fragless", "torch.py")).read()
cpp = re.sub(r"//[^\n]*", "", open(os.path.join(root, "torch_plugin", "torch_cuda.cpp")).read())

# Python: _HOOKS = [(setter, exported function), ...], _GRAPH_HOOKS = [(name, [(setter, exported function),
# ...]), ...] (a set per PyTorch, the first that fits installed) and CUDAPluggableAllocator(path, malloc, free).
hooks, graph_sets = None, None
for node in ast.walk(ast.parse(py)):
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_HOOKS" for t in node.targets):
        hooks = {elt.elts[0].value: elt.elts[1].value for elt in node.value.elts}
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_GRAPH_HOOKS" for t in node.targets):
        graph_sets = [(elt.elts[0].value, [(h.elts[0].value, h.elts[1].value) for h in elt.elts[1].elts])
                      for elt in node.value.elts]
check(hooks, "torch.py has no _HOOKS list")
check(graph_sets, "torch.py has no _GRAPH_HOOKS list")
for name, pairs in graph_sets:
    for setter, fn in pairs:
        check(hooks.get(setter, fn) == fn, "%s binds %s here and %s elsewhere in torch.py" % (setter, fn, hooks.get(setter)))
        hooks[setter] = fn
py_alloc = re.search(r"pluggable\(path, \"(\w+)\", \"(\w+)\"\)", py)
check(py_alloc, "torch.py does not create CUDAPluggableAllocator(path, MALLOC, FREE)")


def argument_of(text, open_paren):
    """The text between the parenthesis at open_paren and the one that closes it."""
    depth = 0
    for i in range(open_paren, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_paren + 1:i]
    raise AssertionError("unbalanced parentheses after offset %d of torch_cuda.cpp" % open_paren)


def called(fragment):
    return sorted(set(re.findall(r"\b(fragless_\w+)\s*\(", fragment)))


# C++: each p->set_X(...) and the fragless_* function its argument calls (exactly one).
bound = {}
for m in re.finditer(r"->\s*(set_\w+)\s*\(", cpp):
    fns = called(argument_of(cpp, m.end() - 1))
    check(len(fns) == 1, "install()'s %s binds %s, not one fragless_* function" % (m.group(1), fns or "nothing"))
    check(m.group(1) not in bound, "install() calls %s twice" % m.group(1))
    bound[m.group(1)] = fns[0]
create = re.search(r"createCustomAllocator\s*\(", cpp)
check(create, "torch_cuda.cpp does not call createCustomAllocator")
cpp_alloc = called(argument_of(cpp, create.end() - 1))

missing = sorted(set(hooks) - set(bound))
extra = sorted(set(bound) - set(hooks))
check(not missing, "install() does not set %s (the Python helper does)" % missing)
check(not extra, "install() sets %s, which the Python helper does not" % extra)
differ = ["%s: install() binds %s, enable() %s" % (s, bound[s], hooks[s]) for s in sorted(hooks) if bound[s] != hooks[s]]
check(not differ, "the same setter is given another function: %s" % "; ".join(differ))
# install() tries the sets in the helper's order (the first setter of each set names it in the source).
firsts = [(cpp.find("->" + pairs[0][0] + "("), name) for name, pairs in graph_sets]
check(all(at >= 0 for at, _ in firsts) and firsts == sorted(firsts),
      "install() does not try the graph-pool hook sets in torch.py's order %s" % [n for _, n in firsts])
check(cpp_alloc == sorted(py_alloc.groups()),
      "allocation functions differ: install() %s, enable() %s" % (cpp_alloc, sorted(py_alloc.groups())))
print("install() and enable() bind the same %d hooks to the same functions: %s; allocator %s"
      % (len(hooks), ", ".join("%s=%s" % kv for kv in sorted(hooks.items())), ", ".join(cpp_alloc)))
