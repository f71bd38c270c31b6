"""Every snapshot the project writes, checked against the rules of PyTorch's memory viewer (viewer_rules.py):

- the engine's own snapshots (fragless.snapshot(), what _dump_snapshot writes under fragless) under every
  policy, after a random workload over several streams with sizes from sub-page to hundreds of MiB, blocks
  freed and reused, empty_cache in the middle; and one with 1,000,000 history entries (it must load: lists
  are pickled in batches of at most 1000);
- `fragless-trace convert` of every real snapshot in ../shared/data, straight to a snapshot and through the
  native format and back: the segments, live blocks and allocation events of the original are kept, times
  never go backwards, and what the conversion cannot keep (frames, ...) is named.

  viewer_snapshots.py BIN_DIR                          the engine's snapshots and its tracer's traces
  viewer_snapshots.py BIN_DIR --million                the million-entry snapshot alone
  viewer_snapshots.py BIN_DIR --only-conversions DATA  the conversions of the real snapshots in DATA
  (FRAGLESS_LIBRARY set to libfragless.so)
"""
import os
import pickle
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import viewer_rules  # noqa: E402

WORKLOAD = r"""
import ctypes, random, sys
sys.path.insert(0, %(pkg)r)
import fragless
lib = fragless.library()
fragless.record_history(%(entries)d)
rng = random.Random(%(seed)d)
streams = [ctypes.c_void_p(0), ctypes.c_void_p(0x100), ctypes.c_void_p(0x200)]
live = []
for step in range(%(ops)d):
    if live and (rng.random() < 0.5 or len(live) > 60):
        p, n, s = live.pop(rng.randrange(len(live)))
        lib.fragless_free(p, n, 0, s)
    else:
        n = int(10 ** rng.uniform(2, 8.5)) if %(ops)d < 100000 else 512
        s = rng.choice(streams)
        p = lib.fragless_malloc(n, 0, s)
        if not p:
            raise AssertionError(fragless.last_error())
        live.append((p, n, s))
    if step == %(ops)d // 2:
        fragless.empty_cache()
fragless.dump_snapshot(%(out)r)
"""


def engine_snapshots(bin_dir, work, problems, checked, million):
    pkg = os.path.join(HERE, "..", "..", "torch_plugin", "python")
    runs = [(p, 4000, 2000, 7) for p in ("classic", "expandable", "fragless")]
    if million:  # a full million-entry history (an alloc and a free: 3)
        runs = [("fragless", 1_000_000, 680_000, 3)]
    for policy, entries, ops, seed in runs:
        out = os.path.join(work, f"engine-{policy}-{entries}.pickle")
        trace = os.path.join(work, f"trace-{policy}-{entries}")
        conf = f"policy:{policy},driver:host,capacity_mb:4096"
        if entries < 1_000_000:
            conf += f",trace:{trace}.fgt"  # the tracer's own trace, converted below
        env = dict(os.environ, FRAGLESS_CONF=conf)
        code = WORKLOAD % {"pkg": pkg, "entries": entries, "ops": ops, "seed": seed, "out": out}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            problems.append(f"engine snapshot under {policy}: the workload failed: {r.stderr.strip()[-400:]}")
            continue
        found = viewer_rules.check(out)
        checked.append(out)
        with open(out, "rb") as f:
            snap = pickle.load(f)
        n = sum(len(t) for t in snap["device_traces"])
        print(f"engine snapshot, {policy}, {n} trace entries, {len(snap['segments'])} segments: "
              f"{'the viewer rules hold' if not found else str(len(found)) + ' problem(s)'}")
        if entries >= 1_000_000 and n < 999_000:
            problems.append(f"the million-entry snapshot holds only {n} entries")
        problems += [f"engine snapshot under {policy}: {p}" for p in found]
        if entries < 1_000_000:
            converted = trace + ".pickle"
            r = subprocess.run([os.path.join(bin_dir, "fragless-trace"), "convert", trace + ".fgt", converted],
                               capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"the {policy} trace did not convert: {r.stderr.strip()}")
                continue
            found = viewer_rules.check(converted)
            checked.append(converted)
            print(f"the tracer's trace under {policy}, converted: "
                  f"{'the viewer rules hold' if not found else str(len(found)) + ' problem(s)'}")
            problems += [f"converted {policy} trace: {p}" for p in found]


def dump_state(snap):
    segs = sorted((s["device"], s["address"], s["total_size"]) for s in snap["segments"])
    live = []
    for s in snap["segments"]:
        addr = s["address"]
        for b in s["blocks"]:  # older snapshots give no block address: the blocks tile the segment
            if b["state"] == "active_allocated":
                live.append((s.get("device", 0), b.get("address", addr), b["size"], b.get("requested_size", b["size"])))
            addr = b.get("address", addr) + b["size"]
    live.sort()
    allocs = [sum(1 for e in t if e["action"] == "alloc") for t in snap["device_traces"]]
    while allocs and allocs[-1] == 0:  # the viewer offers only devices with events or segments
        allocs.pop()
    return segs, live, allocs


def conversions(bin_dir, data, work, problems, checked):
    tool = os.path.join(bin_dir, "fragless-trace")
    for name in sorted(os.listdir(data)):
        if not name.endswith(".pickle"):
            continue
        src = os.path.join(data, name)
        with open(src, "rb") as f:
            original = pickle.load(f)
        direct = os.path.join(work, "direct-" + name)
        native = os.path.join(work, name + ".fgt")
        back = os.path.join(work, "back-" + name)
        notes = ""
        for a, b in ((src, direct), (src, native), (native, back)):
            r = subprocess.run([tool, "convert", a, b], capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"convert {a} -> {b}: {r.stderr.strip()}")
                break
            notes += r.stderr
        else:
            had_frames = any(e.get("frames") for t in original["device_traces"] for e in t)
            if had_frames and "not kept" not in notes:
                problems.append(f"{name}: its frames were dropped without a note")
            want = dump_state(original)
            for out in (direct, back):
                found = viewer_rules.check(out)
                checked.append(out)
                problems += [f"{os.path.basename(out)}: {p}" for p in found]
                with open(out, "rb") as f:
                    got = dump_state(pickle.load(f))
                for what, w, g in zip(("segments", "live blocks", "allocation events"), want, got):
                    if w != g:
                        problems.append(f"{os.path.basename(out)}: the {what} differ from the original "
                                        f"({len(w) if isinstance(w, list) else w} vs {len(g) if isinstance(g, list) else g})")
            print(f"converted {name}: direct and through native, checked")


def main(argv):
    usage = len(argv) == 1 or argv[1:] == ["--million"] or (len(argv) == 3 and argv[1] == "--only-conversions")
    if not argv or argv[0] in ("-h", "--help") or not usage:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    bin_dir = argv[0]
    problems, checked = [], []
    with tempfile.TemporaryDirectory() as work:
        if len(argv) == 3:
            conversions(bin_dir, argv[2], work, problems, checked)
            # Two conversions of each real snapshot in DATA.
            want = 2 * sum(1 for n in os.listdir(argv[2]) if n.endswith(".pickle"))
        else:
            million = argv[1:] == ["--million"]
            engine_snapshots(bin_dir, work, problems, checked, million)
            # the engine's snapshots, and the tracer's traces of the three policies converted (or the million)
            want = 1 if million else 3 + 3
    if not checked:
        problems.append("no snapshot was checked")
    elif len(checked) != want:
        problems.append(f"{len(checked)} snapshots checked, {want} expected")
    for p in problems[:60]:
        print("FAIL: " + p)
    print(f"{len(checked)} snapshot(s) checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    random.seed(1)
    sys.exit(main(sys.argv[1:]))
