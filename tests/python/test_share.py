"""fragless.share / open_shared / close_shared between two Python processes on the host driver: the share
travels through a multiprocessing Queue (its descriptors as descriptors), the child is started with spawn
(a fresh interpreter: nothing inherited but what the share carries). Run with FRAGLESS_LIBRARY set; sets its
own FRAGLESS_CONF (driver:host, shareable_handles:True)."""
import ctypes
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "torch_plugin", "python"))
sys.path.insert(0, os.path.dirname(__file__))
os.environ["FRAGLESS_CONF"] = "driver:host,shareable_handles:True,capacity_mb:64"
import fragless  # noqa: E402
from checks import check  # noqa: E402
import viewer_rules  # noqa: E402

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
    stats = fragless.memory_stats()
    check(stats["imported_bytes.all.current"] >= N, "imported bytes counted")
    check(stats["imported_bytes.large_pool.current"] == stats["imported_bytes.all.current"], "in the large pool")
    check(stats["imported_bytes.small_pool.current"] == 0 and stats["reserved_bytes.all.current"] == 0,
          "imported bytes are in no pool of this process's own")
    imported = fragless.snapshot()["imported"]
    check(len(imported) == 1, "one imported mapping in the snapshot: %r" % imported)
    im = imported[0]
    check(im["address"] == ptr and im["size"] == size and im["exporter_pid"] == os.getppid(), repr(im))
    check(im["mapped_size"] == stats["imported_bytes.all.current"] and im["segment_type"] == "large", repr(im))
    check(im["mapped_address"] <= ptr < im["mapped_address"] + im["mapped_size"], repr(im))
    check(fragless.snapshot()["segments"] == [], "an imported mapping is in no segment")
    q_out.put("written")
    if q_in.get() == "hold":  # stay open until killed
        q_out.put("holding")
        time.sleep(600)
    fragless.close_shared(ptr)
    stats = fragless.memory_stats()
    check(stats["imported_bytes.all.current"] == 0, "imported bytes back to 0")
    check(stats["imported_bytes.all.peak"] >= N, "the peak stays")
    check(fragless.snapshot()["imported"] == [], "no imported mapping left in the snapshot")
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


def held_block(ptr):
    """The snapshot's block at ptr and its segment; the snapshot must pass the viewer's rules."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "shared.pickle")
        fragless.dump_snapshot(path)
        problems = viewer_rules.check(path)
        check(problems == [], "PyTorch's viewer reads a snapshot with a shared block: %s" % problems)
    for seg in fragless.snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["address"] == ptr:
                return seg, b
    check(False, "no block at the shared pointer")


def check_exported(ptr, owner_freed):
    stats = fragless.memory_stats()
    exported = stats["exported_bytes.all.current"]
    check(exported >= N and stats["exported_bytes.large_pool.current"] == exported, "exported bytes: %d" % exported)
    check(stats["exported_bytes.small_pool.current"] == 0, "no exported bytes in the small pool")
    seg, b = held_block(ptr)
    check(b["exported_bytes"] == exported and seg["exported_bytes"] == exported, "snapshot: %r" % b)
    check(b["leases"] >= 1 and b["registrations"] == 0 and b["owner_freed"] == owner_freed, "snapshot: %r" % b)
    check(b["state"] == "active_allocated", "a held block stays allocated")


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
    check_exported(ptr, owner_freed=False)
    s.close()
    check(ctypes.string_at(ptr + N // 2, N - N // 2) == b"\xc3" * (N - N // 2), "the child's bytes, here")
    lib.fragless_free(ptr, N, 0, None)
    check(allocated() >= N, "freed while the other process has it: still held")
    check_exported(ptr, owner_freed=True)
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
    stats = fragless.memory_stats()
    check(stats["exported_bytes.all.current"] == 0, "exported bytes back to 0")
    check(stats["exported_bytes.all.peak"] >= N, "the peak stays")
    check(all("exported_bytes" not in b for seg in fragless.snapshot()["segments"] for b in seg["blocks"]),
          "no block marked exported any more")


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
