#!/usr/bin/env python3
"""One GPU training run for tools/gpu_check.sh: a GPT-style model over variable-length batches for a fixed
number of steps under one allocator, printed as one JSON line.

  gpu_train.py --mode native|expandable|fragless|preload [--steps N] [--seed S]

native: PyTorch's caching allocator; expandable: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by
the caller); fragless: fragless.torch.enable() (CUDAPluggableAllocator); preload: PyTorch without caching
(PYTORCH_NO_CUDA_MEMORY_CACHING=1) under LD_PRELOAD=libfragless_preload.so (set by the caller), whose allocated
and reserved bytes come from the interposer itself (fragless_preload_memory), not from total minus free."""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_plugin", "python"))

ap = argparse.ArgumentParser()
ap.add_argument("--mode", required=True, choices=["native", "expandable", "fragless", "preload"])
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--alloc-loop", type=int, default=20000)
args = ap.parse_args()

if args.mode == "fragless":
    import fragless.torch as ft
    ft.enable()
if args.mode == "preload":  # the interposer is in the process (LD_PRELOAD): its symbols are global
    import ctypes
    try:
        preload_memory = ctypes.CDLL(None).fragless_preload_memory
    except AttributeError:
        raise SystemExit("gpu_train.py: --mode preload needs LD_PRELOAD=libfragless_preload.so")
    preload_memory.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    preload_memory.restype = ctypes.c_int
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.manual_seed(args.seed)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.deterministic = True
torch.use_deterministic_algorithms(True, warn_only=True)
dev = torch.device("cuda")
V, D, L, H, MAXLEN, B = 32000, 1024, 12, 16, 2048, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / (D // H) ** 0.5
        att = att.masked_fill(torch.ones(s, s, device=x.device, dtype=torch.bool).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, D)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(MAXLEN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def usage():
    """(allocated, reserved) bytes as the active allocator reports them."""
    if args.mode == "fragless":
        s = ft.memory_stats(torch.cuda.current_device())
        return s["allocated_bytes.all.current"], s["reserved_bytes.all.current"]
    if args.mode == "preload":  # fragless's own bytes, from the interposer's C ABI
        a, r = ctypes.c_size_t(), ctypes.c_size_t()
        if preload_memory(torch.cuda.current_device(), ctypes.byref(a), ctypes.byref(r)) != 0:
            raise SystemExit("gpu_train.py: fragless_preload_memory failed: is libfragless_preload.so preloaded?")
        return a.value, r.value
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


model = GPT().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(args.seed)
losses, times, shapes = [], [], set()
peak_alloc = peak_res = 0
frag_at_peak = 0.0
for step in range(args.steps):
    # Variable-length batches padded to their longest sequence: log-normal lengths with a median of about 270
    # tokens, so the longest of 8 ranges over most of [16, MAXLEN] and the shapes really vary (a median near
    # MAXLEN would clamp nearly every batch to one shape, and show nothing about fragmentation).
    lens = torch.distributions.LogNormal(5.6, 0.9).sample((B,)).clamp(16, MAXLEN).long()
    s = int(lens.max())
    shapes.add(s)
    tokens = torch.randint(V, (B, s + 1), generator=gen).to(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    a, r = usage()
    opt.step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item().hex())
    a2, r2 = usage()
    for aa, rr in ((a, r), (a2, r2)):
        if rr > peak_res:
            peak_res = rr
            frag_at_peak = 1 - aa / rr if aa is not None and rr else float("nan")
        if aa is not None:
            peak_alloc = max(peak_alloc, aa)
    del logits, loss

# Host-side cost of one allocation: a torch.empty/free loop of a mid-size tensor. Deterministic mode fills
# every new tensor (a kernel per empty); it is off here, so the loop times the allocator and nothing else.
torch.use_deterministic_algorithms(False)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(args.alloc_loop):
    x = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    del x
torch.cuda.synchronize()
alloc_us = (time.perf_counter() - t0) / args.alloc_loop * 1e6

# PyTorch's memory API and a CUDA graph under the allocator.
checks = {}
try:
    st = torch.cuda.memory_stats()
    checks["memory_stats"] = "allocated_bytes.all.current" in st and "reserved_bytes.all.peak" in st
except Exception as e:  # noqa: BLE001 - reported, not fatal
    checks["memory_stats"] = "error: %s" % e
try:
    torch.cuda.memory._record_memory_history(max_entries=10000)
    y = torch.empty(3 << 20, device=dev)
    snap = "/tmp/fragless_gpu_snapshot_%s.pickle" % args.mode
    torch.cuda.memory._dump_snapshot(snap)
    checks["dump_snapshot"] = os.path.getsize(snap) > 0
    del y
except Exception as e:  # noqa: BLE001
    checks["dump_snapshot"] = "error: %s" % e
try:
    static_x = torch.randn(1024, 1024, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            static_x @ static_x
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = static_x @ static_x
    static_x.copy_(torch.randn(1024, 1024, device=dev))
    g.replay()
    torch.cuda.synchronize()
    checks["cuda_graph"] = bool(torch.allclose(static_y, static_x @ static_x, rtol=1e-3, atol=1e-3))
    del g, static_y
except Exception as e:  # noqa: BLE001
    checks["cuda_graph"] = "error: %s" % e

if args.mode == "native" or args.mode == "expandable":
    peak_res = max(peak_res, torch.cuda.max_memory_reserved())
    peak_alloc = max(peak_alloc, torch.cuda.max_memory_allocated())
print(json.dumps({"mode": args.mode, "steps": args.steps, "peak_reserved": peak_res, "peak_allocated": peak_alloc,
                  "fragmentation_at_peak": frag_at_peak, "median_step_s": statistics.median(times[5:] or times),
                  "alloc_free_us": alloc_us, "distinct_shapes": len(shapes), "checks": checks, "losses": losses}))
