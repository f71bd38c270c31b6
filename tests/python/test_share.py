"""fragless.share / open_shared / close_shared between two Python processes on the host driver: the share
travels through a multiprocessing Queue (its descriptors as descriptors), the child is started with spawn
(a fresh interpreter: nothing inherited but what the share carries). Run with FRAGLESS_LIBRARY set; sets its
own FRAGLESS_CONF (driver:host, shareable_handles:True)."""
import ctypes
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "torch_plugin", "python"))
sys.path.insert(0, os.path.dirname(__file__))
os.environ["FRAGLESS_CONF"] = "driver:host,shareable_handles:True,capacity_mb:64"
import fragless  # noqa: E402
from checks import check  # noqa: E402

MiB = 1 << 20
N = 3 * MiB + 4096


def child(q_in, q_out):
    s = q_in.get()
    ptr, size = fragless.open_shared(s)
    s.close()
    check(size >= N, "the block's size: %d" % size)
    data = ctypes.string_at(ptr, N)
    check(data == b"\x5a" * N, "the exporter's bytes")
    ctypes.memset(ptr + N // 2, 0xC3, N - N // 2)
    check(fragless.memory_stats()["fragless.imported_bytes.current"] >= N, "imported bytes counted")
    q_out.put("written")
    if q_in.get() == "hold":  # stay open until killed
        q_out.put("holding")
        time.sleep(600)
    fragless.close_shared(ptr)
    check(fragless.memory_stats()["fragless.imported_bytes.current"] == 0, "imported bytes back to 0")
    try:
        fragless.close_shared(ptr)
        check(False, "a second close_shared was accepted")
    except RuntimeError as e:
        check("open_shared did not return" in str(e), str(e))
    q_out.put("closed")


def wait_reaped():
    for _ in range(5000):
        if fragless.reap_shared():
            return True
        time.sleep(0.002)
    return False


def allocated():
    return fragless.memory_stats()["allocated_bytes.all.current"]


def run(hold):
    lib = fragless.library()
    ptr = lib.fragless_malloc(N, 0, None)
    ctypes.memset(ptr, 0x5A, N)
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q_in, q_out))
    p.start()
    s = fragless.share(ptr)
    q_in.put(s)
    check(q_out.get(timeout=60) == "written", "the child opened the share")
    s.close()
    check(ctypes.string_at(ptr + N // 2, N - N // 2) == b"\xc3" * (N - N // 2), "the child's bytes, here")
    lib.fragless_free(ptr, N, 0, None)
    check(allocated() >= N, "freed while the other process has it: still held")
    if hold:
        q_in.put("hold")
        check(q_out.get(timeout=60) == "holding", "the child holds the block")
        p.kill()
        p.join()
        check(p.exitcode is not None and p.exitcode < 0, "the child was killed")
    else:
        q_in.put("close")
        check(q_out.get(timeout=60) == "closed", "the child closed the share")
        p.join(60)
        check(p.exitcode == 0, "the child's exit code: %s" % p.exitcode)
    check(wait_reaped(), "the block went back once the other process let it go")
    check(allocated() == 0, "nothing left allocated: %d" % allocated())
    check(fragless.memory_stats()["fragless.exported_bytes.current"] == 0, "exported bytes back to 0")


def refusals():
    try:
        fragless.share(12345)
        check(False, "a pointer fragless did not allocate was shared")
    except RuntimeError as e:
        check("did not allocate" in str(e), str(e))
    lib = fragless.library()
    ptr = lib.fragless_malloc(MiB, 0, None)
    s = fragless.share(ptr)
    forged = fragless.Shared(s.description[:-1] + bytes([s.description[-1] ^ 1]), [os.dup(fd) for fd in s.fds])
    try:
        fragless.open_shared(forged)
        check(False, "a forged description was opened")
    except RuntimeError as e:
        check("forged" in str(e) and "nothing was mapped" in str(e), str(e))
    forged.close()
    s.close()
    try:
        fragless.open_shared(s)
        check(False, "a closed share was opened")
    except ValueError as e:
        check("closed" in str(e), str(e))
    lib.fragless_free(ptr, MiB, 0, None)
    check(allocated() == 0, "the share, closed unopened, released its block at once: %d" % allocated())


if __name__ == "__main__":
    fragless.library().fragless_malloc.restype = ctypes.c_void_p
    run(hold=False)
    run(hold=True)
    refusals()
    print("ok: two Python processes shared fragless memory through multiprocessing; forged shares refused")
