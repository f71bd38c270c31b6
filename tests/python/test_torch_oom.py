"""Out of memory under fragless.torch.enable() is a torch.cuda.OutOfMemoryError, with PyTorch's first sentence.

enable() hands libfragless.so a thrower of c10::OutOfMemoryError built against the running PyTorch
(torch_plugin/python/fragless/torch_oom.cpp). Without a GPU the path is exercised through PyTorch's CPU
allocator: a probe (FRAGLESS_CPU_PROBE, oom_probe.cpp) makes libfragless.so (host driver) PyTorch's CPU
allocator, so torch.empty calls fragless_malloc, which throws through PyTorch's bindings exactly as it does
from CUDAPluggableAllocator. Three cases, each in its own interpreter:
  built     the thrower built with libfragless.so (CMake, as `pip install` does) is used: no compiler (CXX is
            /bin/false), nothing built into the cache;
  compiled  the one beside the library is for another PyTorch: one is built now into the cache;
  neither   no matching one and no compiler: RuntimeError, whose text says why, and enable() warns.
Exits 77 (skipped) without PyTorch or the probe. Run with FRAGLESS_LIBRARY and FRAGLESS_CPU_PROBE set."""
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

from torch_prologue import announce, check, torch  # exits 77 (skipped) without PyTorch
PROBE = os.environ.get("FRAGLESS_CPU_PROBE")
if not PROBE or not os.path.exists(PROBE):
    print("SKIPPED: no CPU-allocator probe (FRAGLESS_CPU_PROBE; built where PyTorch's C++ headers are found)")
    sys.exit(77)


def run_case(case):
    import fragless
    import fragless.torch as ft
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ft.enable("driver:host,capacity_mb:512")
    messages = [str(w.message) for w in caught]
    lib = fragless.library()
    p = ctypes.CDLL(PROBE)
    p.probe_install.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    p.probe_install(ctypes.cast(lib.fragless_malloc, ctypes.c_void_p), ctypes.cast(lib.fragless_free, ctypes.c_void_p))
    x = torch.ones(1 << 20)
    check(float(x.sum()) == float(1 << 20))
    check(fragless.memory_stats(0)["allocated_bytes.all.current"] >= 4 << 20)  # the tensor is fragless memory
    before = fragless.memory_stats(0)["num_alloc_retries"]
    # PyTorch's out-of-memory observers (torch._C._cuda_attach_out_of_memory_observer, which a pluggable
    # allocator does not support) are called before the error, with PyTorch's arguments; one that raises is
    # reported and does not change the error.
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(args))
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: 1 / 0)
    want = torch.cuda.OutOfMemoryError if case != "neither" else RuntimeError
    check(ft.oom_error_type() is want, (ft.oom_error_type(), messages))
    try:
        torch.empty(1 << 40, dtype=torch.uint8)
        raise AssertionError("1 TiB was allocated")
    except torch.cuda.OutOfMemoryError as e:
        check(case != "neither", "OutOfMemoryError without a thrower")
        msg = str(e)
    except RuntimeError as e:
        check(case == "neither", "RuntimeError although a thrower was there: %s" % messages)
        msg = str(e)
    check(msg.startswith("CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has a total capacity of "), msg)
    check("fragless" in msg, msg)
    check(fragless.memory_stats(0)["num_alloc_retries"] == before + 1)  # the retry chain ran first
    check(len(seen) == 1, seen)
    # 1 EiB or more is refused before any search, as PyTorch refuses it before its allocator (and its observers).
    try:
        torch.empty(1 << 61, dtype=torch.uint8)
        raise AssertionError("2 EiB were allocated")
    except RuntimeError as e:
        check("more than 1EB" in str(e), str(e))
    check(len(seen) == 1, seen)
    device, alloc, limit, free = seen[0]
    check(device == 0 and alloc == 1 << 40 and limit == 512 << 20 and 0 < free <= limit, seen)
    # A small request that does not fit: the observers get the size the message names (PyTorch's alloc_size,
    # 20 MiB for a request between 1 and 10 MiB), not the bytes asked, and the history's oom entry the rounded
    # request (PyTorch's params.size()), not the bytes asked either.
    fragless.record_history(100, clear_history=True)
    left = (512 << 20) - fragless.memory_stats(0)["reserved_bytes.all.current"]
    fill = torch.empty(left - (2 << 20), dtype=torch.uint8)
    try:
        torch.empty(3000000, dtype=torch.uint8)
        raise AssertionError("3,000,000 bytes fitted in what was left")
    except RuntimeError as e:
        check("Tried to allocate 20.00 MiB." in str(e), str(e))
    check(len(seen) == 2 and seen[1][1] == 20 << 20, seen)
    ooms = [e for e in fragless.snapshot()["device_traces"][0] if e["action"] == "oom"]
    check(len(ooms) == 1 and ooms[0]["size"] == 3000320, ooms)
    fragless.record_history(0)
    del fill
    try:
        torch._C._cuda_attach_out_of_memory_observer(42)
        raise AssertionError("a non-callable observer was accepted")
    except TypeError:
        pass
    if case == "neither":
        check(any("will raise RuntimeError" in m for m in messages), messages)
        check("not torch.cuda.OutOfMemoryError" in msg and "PyTorch" in msg, msg)  # the error says why
    else:
        check(not any("RuntimeError" in m for m in messages), messages)
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
    print("%s: %s, message as PyTorch's" % (case, want.__name__))


def main():
    built = os.path.join(os.path.dirname(os.environ["FRAGLESS_LIBRARY"]), "libfragless_torch_oom.so")
    if not os.path.exists(built):
        print("SKIPPED: no thrower beside %s (no PyTorch with headers at build time)" % os.environ["FRAGLESS_LIBRARY"])
        return 77
    announce()
    work = tempfile.mkdtemp(prefix="fragless-oom-")
    # A library whose thrower is recorded as built for another PyTorch.
    other = os.path.join(work, "other")
    os.makedirs(other)
    lib = os.environ["FRAGLESS_LIBRARY"]
    shutil.copy2(lib, other)
    shutil.copy2(built, other)
    with open(os.path.join(os.path.dirname(lib), "fragless_build.json")) as f:
        info = json.load(f)
    info["torch_oom"]["torch"] = "0.0.1-another"
    with open(os.path.join(other, "fragless_build.json"), "w") as f:
        json.dump(info, f)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    cases = [("built", lib, "/bin/false"), ("neither", os.path.join(other, "libfragless.so"), "/bin/false")]
    if cxx and os.path.exists(os.path.join(os.path.dirname(torch.__file__), "include", "c10", "util", "Exception.h")):
        cases.insert(1, ("compiled", os.path.join(other, "libfragless.so"), cxx))
    else:
        print("SKIPPED (part): no C++ compiler or no PyTorch headers: the 'compiled' case is not run")
    for case, library, compiler in cases:
        cache = os.path.join(work, "cache-" + case)
        os.makedirs(cache)
        env = dict(os.environ, FRAGLESS_LIBRARY=library, CXX=compiler, XDG_CACHE_HOME=cache)
        r = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True, text=True, timeout=300)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            print(r.stderr[-3000:])
            print("FAIL: case %s" % case)
            return 1
        built_now = os.listdir(os.path.join(cache, "fragless")) if os.path.isdir(os.path.join(cache, "fragless")) else []
        if case == "compiled":
            check(any(n.endswith(".so") for n in built_now), "nothing was built into the cache: %s" % built_now)
        else:
            check(not built_now, "%s: something was built at run time: %s" % (case, built_now))
    shutil.rmtree(work)
    print("OOM under fragless.torch.enable(): torch.cuda.OutOfMemoryError from the built thrower, a compiled one, "
          "and a RuntimeError that says why where neither can be had")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
    else:
        sys.exit(main())
