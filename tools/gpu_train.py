#!/usr/bin/env python3
"""One GPU training run for tools/gpu_check.sh: a GPT-style model over variable-length batches for a fixed
number of steps under one allocator, printed as one JSON line.

  gpu_train.py --mode native|expandable|fragless|preload [--steps N] [--seed S]

native: PyTorch's caching allocator; expandable: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by
the caller); fragless: fragless.torch.enable() (CUDAPluggableAllocator); preload: PyTorch without caching
(PYTORCH_NO_CUDA_MEMORY_CACHING=1) under LD_PRELOAD=libfragless_preload.so (set by the caller).

Peaks are the allocator's own high-water marks over the measured steps, read the same way in every mode:
torch.cuda.reset_peak_memory_stats() after the warm-up steps (the ones the median step time leaves out),
torch.cuda.max_memory_reserved() and max_memory_allocated() after the last step, so a peak inside a forward
or backward pass counts. Under native and expandable those are PyTorch's statistics; under fragless,
enable() routes the same names to fragless's (reserved_bytes.all.peak, allocated_bytes.all.peak). Under
preload PyTorch's allocator is bypassed and its statistics stay at 0, so the interposer's
fragless_preload_reset_peak_memory and fragless_preload_peak_memory give the same two statistics of
fragless's. "peak_source" in the JSON says which. Fragmentation at peak is 1 - peak allocated / peak
reserved, fragless's own figure (DeviceStats::fragmentation_at_peak).

Then PyTorch's memory API, a snapshot and a CUDA graph are checked under the allocator. A check that does not
pass exits 1 (after the JSON line), unless its mode and check are in KNOWN_UNSUPPORTED and it failed with the
error that names why (a wrong answer there fails as anywhere); those are reported in the JSON and on stderr and
fail nothing. A peak reserved of 0 read back (the peaks were not this allocator's) exits 1 before the checks. Exits 3, running nothing, when PyTorch has no CUDA
here (torch.cuda.is_available() is False)."""
import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

WARMUP = 5  # steps left out of the median step time and of the peaks
MODES = ("native", "expandable", "fragless", "preload")
CHECKS = ("memory_stats", "dump_snapshot", "cuda_graph")

# (mode, check) -> (why it is known not to work there, the texts of the error that failure gives). Only an
# error naming one of those texts is excused (reported, not failing the run): a wrong answer (False) or any
# other error is a failure there as anywhere.
KNOWN_UNSUPPORTED = {
    ("preload", "cuda_graph"): (
        "PYTORCH_NO_CUDA_MEMORY_CACHING=1 bypasses PyTorch's caching allocator and with it the private pool a "
        "capture needs: PyTorch then calls cudaMalloc during the capture, which it does not support",
        ("not permitted when stream is capturing", "cudaErrorStreamCaptureUnsupported",
         "cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture"),
    ),
}


def verdict(mode, checks):
    """(failed, exempt): the checks whose result is not True, by name with the result, but for the known
    failures of an unsupported pair (an error naming one of its texts), by name with the reason."""
    failed, exempt = {}, {}
    for name, result in checks.items():
        if result is True:
            continue
        known = KNOWN_UNSUPPORTED.get((mode, name))
        if known and isinstance(result, str) and any(t in result for t in known[1]):
            exempt[name] = "%s (got %r)" % (known[0], result)
        else:
            failed[name] = result
    return failed, exempt


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=MODES)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--alloc-loop", type=int, default=20000)
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_plugin", "python"))
    if args.mode == "fragless":
        import fragless.torch as ft
        ft.enable()
    preload_peak = preload_reset = None
    if args.mode == "preload":  # the interposer is in the process (LD_PRELOAD): its symbols are global
        try:
            process = ctypes.CDLL(None)
            preload_peak, preload_reset = process.fragless_preload_peak_memory, process.fragless_preload_reset_peak_memory
        except AttributeError:
            raise SystemExit("gpu_train.py: --mode preload needs LD_PRELOAD=libfragless_preload.so (one that exports "
                             "fragless_preload_peak_memory)")
        preload_peak.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        preload_peak.restype = ctypes.c_int
        preload_reset.argtypes = [ctypes.c_int]
        preload_reset.restype = ctypes.c_int
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if not torch.cuda.is_available():  # 3: tools/gpu_check.sh then runs no training, and fails nothing
        print("gpu_train.py: PyTorch %s (built for CUDA %s) has no GPU here: torch.cuda.is_available() is False"
              % (torch.__version__, torch.version.cuda), file=sys.stderr)
        return 3

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

    # The allocator's peaks: (reset, read () -> (peak allocated, peak reserved), what they are).
    if args.mode == "preload":
        def reset_peaks():
            if preload_reset(torch.cuda.current_device()) != 0:
                raise SystemExit("gpu_train.py: fragless_preload_reset_peak_memory failed: is the interposer off, or the device not its?")

        def read_peaks():
            a, r = ctypes.c_size_t(), ctypes.c_size_t()
            if preload_peak(torch.cuda.current_device(), ctypes.byref(a), ctypes.byref(r)) != 0:
                raise SystemExit("gpu_train.py: fragless_preload_peak_memory failed: is the interposer off, or the device not its?")
            return a.value, r.value
        peak_source = "fragless_preload_peak_memory (fragless's statistics; PyTorch's allocator is bypassed)"
    else:
        def reset_peaks():
            torch.cuda.reset_peak_memory_stats()

        def read_peaks():
            return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        peak_source = ("torch.cuda.max_memory_* (fragless's statistics, through enable())" if args.mode == "fragless"
                       else "torch.cuda.max_memory_* (PyTorch's statistics)")

    model = GPT().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(args.seed)
    losses, times, shapes = [], [], set()
    warmup = WARMUP if args.steps > WARMUP else 0
    for step in range(args.steps):
        if step == warmup:
            torch.cuda.synchronize()
            reset_peaks()
        # Variable-length batches padded to their longest sequence: log-normal lengths with a median of about
        # 270 tokens, so the longest of 8 ranges over most of [16, MAXLEN] and the shapes really vary (a median
        # near MAXLEN would clamp nearly every batch to one shape, and show nothing about fragmentation).
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
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item().hex())
        del logits, loss
    peak_alloc, peak_res = read_peaks()
    if peak_res <= 0:  # no peak read means the peaks were not this allocator's: a failure, not a 0% row
        print("gpu_train.py: mode %s: the peak reserved read back is %r after %d steps" % (args.mode, peak_res, len(times)),
              file=sys.stderr)
        return 1
    frag_at_peak = 1 - peak_alloc / peak_res

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

    # PyTorch's memory API, a snapshot and a CUDA graph under the allocator: True, False, or the error's text.
    checks = {}
    try:
        st = torch.cuda.memory_stats()
        checks["memory_stats"] = "allocated_bytes.all.current" in st and "reserved_bytes.all.peak" in st
    except Exception as e:  # noqa: BLE001 - a failed check, reported below
        checks["memory_stats"] = "error: %s" % e
    try:
        torch.cuda.memory._record_memory_history(max_entries=10000)
        y = torch.empty(3 << 20, device=dev)
        snap = os.path.join(tempfile.gettempdir(), "fragless_gpu_snapshot_%d_%s.pickle" % (os.getpid(), args.mode))
        torch.cuda.memory._dump_snapshot(snap)
        checks["dump_snapshot"] = os.path.getsize(snap) > 0
        os.unlink(snap)
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
    if sorted(checks) != sorted(CHECKS):
        raise SystemExit("gpu_train.py: the checks run (%s) are not CHECKS (%s)" % (sorted(checks), sorted(CHECKS)))
    failed, exempt = verdict(args.mode, checks)

    print(json.dumps({"mode": args.mode, "steps": args.steps, "warmup_steps": warmup, "peak_reserved": peak_res,
                      "peak_allocated": peak_alloc, "peak_source": peak_source, "fragmentation_at_peak": frag_at_peak,
                      "median_step_s": statistics.median(times[warmup:] or times), "alloc_free_us": alloc_us,
                      "distinct_shapes": len(shapes), "checks": checks, "failed_checks": sorted(failed),
                      "known_unsupported": exempt, "losses": losses}), flush=True)
    for name, why in sorted(exempt.items()):
        print("gpu_train.py: %s under %s did not pass, known unsupported: %s" % (name, args.mode, why), file=sys.stderr)
    for name, result in sorted(failed.items()):
        print("gpu_train.py: FAILED: %s under %s: %r" % (name, args.mode, result), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
