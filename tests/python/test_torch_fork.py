"""A DataLoader whose workers are forked, with libfragless.so (host driver) as PyTorch's CPU allocator (the probe,
FRAGLESS_CPU_PROBE, tests/python/oom_probe.cpp): the workers make their tensors from the cache they inherited
while the parent makes its own from the same cache, and neither side's bytes reach the other (Note [Host
memory across fork]). Checked: every sample is the value its worker wrote, after the worker waited while the
parent wrote; every tensor the parent made while the workers ran keeps its value; a tensor live at the fork
keeps its value though each worker overwrote its own copy; the workers' releases (their cache emptied) take
nothing of the parent's. Exits 77 (skipped) without PyTorch or the probe. Run with FRAGLESS_LIBRARY and
FRAGLESS_CPU_PROBE set."""
import time

from torch_prologue import check, fragless_as_cpu_allocator, torch  # exits 77 (skipped) without PyTorch
lib = fragless_as_cpu_allocator()  # exits 77 without the probe; a hang fails with every thread's stack
import fragless  # noqa: E402
torch.set_num_threads(1)
N = 1 << 20  # 4 MiB tensors: fragless's pages, not PyTorch's small-object paths

shared = torch.full((N,), -1.0)  # live at the fork: each worker overwrites its copy, the parent must not see it


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        shared.fill_(float(i))  # the worker's copy only
        t = torch.full((N,), float(i))  # from the cache the worker inherited
        time.sleep(0.01)  # the parent writes its own tensors meanwhile
        if not bool((t == float(i)).all()):
            raise RuntimeError("sample %d was overwritten in the worker" % i)
        del t
        out = torch.full((N,), float(i))
        if i % 5 == 4:
            fragless.empty_cache()  # the worker gives its memory back: none of it is the parent's
        return out


# A cache for both sides to take from: blocks freed before the fork.
warm = [torch.empty(N) for _ in range(16)]
del warm
before = fragless.memory_stats(0)
check(before["reserved_bytes.all.current"] >= 16 * 4 * N, before["reserved_bytes.all.current"])

loader = torch.utils.data.DataLoader(Samples(), batch_size=2, num_workers=2, multiprocessing_context="fork")
ours = []
seen = []
for k, batch in enumerate(loader):
    seen += [int(v) for v in batch[:, 0].tolist()]
    for j in range(batch.shape[0]):
        v = float(batch[j, 0])
        check(bool((batch[j] == v).all()), "a sample's bytes are not all its value %s" % v)
    mine = torch.full((N,), 1000.0 + k)  # from the same cache the workers are taking from
    ours.append((mine, 1000.0 + k))
    time.sleep(0.01)
    for t, v in ours:
        check(bool((t == v).all()), "a tensor the parent made while the workers ran changed (%s)" % v)
    check(bool((shared == -1.0).all()), "the tensor live at the fork shows a worker's writes")
check(sorted(seen) == list(range(24)), seen)
del loader
for t, v in ours:
    check(bool((t == v).all()), "a tensor the parent made changed after the workers ended (%s)" % v)
check(bool((shared == -1.0).all()), "the tensor live at the fork changed after the workers ended")
print("ok: 24 samples from 2 forked workers, %d parent tensors intact" % len(ours))

