"""DataLoader workers forked, epoch after epoch, while another thread of the parent allocates all the time,
with libfragless.so (host driver) as PyTorch's CPU allocator (the probe, FRAGLESS_CPU_PROBE). That thread's
allocations grow (it empties the cache each time), so it spends its time inside fragless, in driver calls
under the device lock and without the GIL, and the main thread forks meanwhile. Checked: every worker gets
its samples (Note [Device locks across fork]: the prepare handler holds every device lock across the fork;
without it a worker waits for ever at its first allocation for the lock the other thread held, and the
DataLoader times out, as it did here before 2026-12-04). The background worker is off: nothing else then
makes the fork wait for the lock. History with C++ stacks is recorded and a third thread takes snapshots:
the history ring's lock and the stack tables' are held across the fork too (fragless::hold_across_fork),
which a snapshot or a stack capture on another thread would otherwise leave held in the child. Exits 77
(skipped) without PyTorch or the probe. Run with FRAGLESS_LIBRARY and FRAGLESS_CPU_PROBE set."""
import threading
import time

from torch_prologue import check, fragless_as_cpu_allocator, torch  # exits 77 (skipped) without PyTorch
lib = fragless_as_cpu_allocator("driver:host,capacity_mb:1024,background:False", watchdog_s=300)
import fragless  # noqa: E402
torch.set_num_threads(1)
N = 1 << 20  # 4 MiB tensors: fragless's pages, not PyTorch's small-object paths


class Small(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.full((N,), float(i))  # the worker's first allocations: they need the device lock


stop = threading.Event()
churned = [0]


def churn():
    while not stop.is_set():
        # Each allocation grows (the cache was emptied): driver calls under the device lock, without the GIL.
        t = torch.empty(N)
        del t
        fragless.empty_cache()
        churned[0] += 1


snapshots = [0]


def snap():
    while not stop.is_set():
        check(len(fragless.snapshot_bytes()) > 0, "a snapshot")
        snapshots[0] += 1
        time.sleep(0.002)


# C++ stacks: their capture takes the unwinder's table lock without the GIL (a Python fork holds the GIL, so
# no other thread can be inside the Python code-object table then).
fragless.record_history(max_entries=4096, context="all", stacks="cpp")
churner = threading.Thread(target=churn)
churner.start()
snapper = threading.Thread(target=snap)
snapper.start()
epochs = 8
try:
    for epoch in range(epochs):
        loader = torch.utils.data.DataLoader(Small(), batch_size=2, num_workers=2, multiprocessing_context="fork",
                                             timeout=30)
        got = sorted(int(v) for batch in loader for v in batch[:, 0].tolist())
        check(got == [0, 1, 2, 3], "epoch %d: %s" % (epoch, got))
        del loader
finally:
    stop.set()
    churner.join()
    snapper.join()
check(churned[0] > 0, churned[0])
check(snapshots[0] > 0, snapshots[0])
print("ok: %d epochs of 2 forked workers while another thread allocated %d times and a third took %d snapshots" %
      (epochs, churned[0], snapshots[0]))
