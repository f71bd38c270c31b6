#!/usr/bin/env python3
"""Writes a large PyTorch-shaped memory snapshot, to measure what reading one costs (docs/RELIABILITY.md).

    make_big_snapshot.py ALLOCS OUT.pickle [--frames N]

The file has the shape torch.cuda.memory._snapshot() gives since PyTorch 2.1 and is written by Python's own
pickle (protocol 4), so it is memoised the way PyTorch's files are: the dict keys, the action strings and the
frame dicts (a pool of 400, shared between entries as PyTorch's symbolizer shares them) are written once and
referred to afterwards; integers are never memoised. ALLOCS allocations on one stream, each freed later
(free_requested then free_completed), at most 2,000 live at once, sizes from 512 B to 40 MiB, N frames per
entry (default 40). Deterministic: the same arguments give the same bytes.
"""
import argparse
import pickle
import random


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("allocs", type=int)
    ap.add_argument("out")
    ap.add_argument("--frames", type=int, default=40)
    a = ap.parse_args()
    if a.allocs < 1 or a.frames < 0:
        ap.error("ALLOCS must be at least 1 and --frames at least 0")
    rng = random.Random(1)
    pool = [{"filename": f"/src/model_{i % 7}.py", "line": i, "name": f"fn_{i}"} for i in range(400)]
    entries, live = [], []
    t, addr, allocs = 0, 1 << 40, 0

    def entry(action, a_, size, frames):
        return {"action": action, "addr": a_, "size": size, "stream": 0, "time_us": t, "frames": frames,
                "compile_context": "", "user_metadata": ""}

    while allocs < a.allocs or live:
        t += rng.randint(1, 50)
        if live and (allocs >= a.allocs or len(live) >= 2000 or rng.random() < 0.5):
            a_, size, _ = live.pop(rng.randrange(len(live)))
            for action in ("free_requested", "free_completed"):
                entries.append(entry(action, a_, size, [pool[rng.randrange(400)] for _ in range(a.frames)]))
        else:
            size = rng.choice([512, 4096, 1 << 20, 3 << 20, 40 << 20])
            addr += size + (2 << 20)
            frames = [pool[rng.randrange(400)] for _ in range(a.frames)]
            live.append((addr, size, frames))
            entries.append(entry("alloc", addr, size, frames))
            allocs += 1
    snapshot = {"segments": [], "device_traces": [entries], "allocator_settings": {}}
    with open(a.out, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    print(f"{a.out}: {len(entries)} trace entries")


if __name__ == "__main__":
    main()
