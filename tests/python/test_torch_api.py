"""PyTorch's own memory API under fragless.torch.enable(), called exactly as user code calls it, on any
PyTorch (Debian's CPU build in CI) with fragless's host driver: two devices of 1 GiB. Blocks are allocated
through fragless's C ABI (what PyTorch's CUDA caching hooks call on a GPU); every torch.cuda function must
then answer from fragless, with PyTorch's key names and return shapes, per device. Exits 77 (skipped) where
PyTorch is not importable. Run with FRAGLESS_LIBRARY set."""
import collections
import ctypes
import os
import pickle
import tempfile
import warnings

from torch_prologue import announce, check, torch  # exits 77 (skipped) without PyTorch
import fragless  # noqa: E402
announce()
import fragless.torch  # noqa: E402

MiB = 1 << 20
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fragless.torch.enable("driver:host,capacity_mb:1024,policy:fragless")
if not torch.cuda.is_available():
    check(any("fragless is not its allocator" in str(w.message) for w in caught), [str(w.message) for w in caught])

lib = fragless.library()
lib.fragless_init(2)  # what PyTorch's init hook passes: its device count (two host-driver devices here)
check(fragless.device_count() == 2)
stream = ctypes.c_void_p(0)


def alloc(n, device=0):
    p = lib.fragless_malloc(n, device, stream)
    check(p, fragless.last_error())
    return p


# Nothing allocated yet.
check(torch.cuda.memory_allocated() == 0)
check(torch.cuda.memory_reserved() == 0)
ptrs = [(alloc(n), n) for n in (512, 3 * MiB, 100 * MiB)]
big = alloc(200 * MiB, device=1)

# memory_stats: PyTorch's flat key names, an OrderedDict, per device.
s = torch.cuda.memory_stats()
check(isinstance(s, collections.OrderedDict))
for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "allocated_bytes.small_pool.current",
            "reserved_bytes.all.current", "active_bytes.all.current", "requested_bytes.all.current",
            "allocation.all.current", "segment.all.current", "num_alloc_retries", "num_ooms"):
    check(key in s, key)
check(s["allocation.all.current"] == 3)
check(torch.cuda.memory_stats(device=0) == s)
check(torch.cuda.memory_stats("cuda:1")["allocation.all.current"] == 1)
check(torch.cuda.memory_stats(torch.device("cuda", 1))["allocated_bytes.all.current"] >= 200 * MiB)

# The single-number functions, with each way of naming a device.
allocated = torch.cuda.memory_allocated()
check(allocated == s["allocated_bytes.all.current"] >= 103 * MiB, allocated)
check(torch.cuda.memory_allocated(0) == torch.cuda.memory_allocated("cuda:0") == allocated)
check(torch.cuda.memory.memory_allocated(torch.device("cuda:0")) == allocated)
check(torch.cuda.max_memory_allocated() >= allocated)
check(torch.cuda.memory_reserved() >= allocated)
check(torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved())
check(torch.cuda.memory_allocated(1) >= 200 * MiB)
check(torch.cuda.memory_cached() == torch.cuda.memory_reserved())

nested = torch.cuda.memory_stats_as_nested_dict()
check(nested["allocated_bytes"]["all"]["current"] == allocated)
check(nested["num_ooms"] == s["num_ooms"])

# Peaks: free the 100 MiB block, the peak stays until reset_peak_memory_stats.
lib.fragless_free(ptrs[2][0], ptrs[2][1], 0, stream)
peak = torch.cuda.max_memory_allocated()
check(peak >= allocated and torch.cuda.memory_allocated() < allocated)
torch.cuda.reset_peak_memory_stats()
check(torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated())
check(torch.cuda.max_memory_allocated(1) >= 200 * MiB)  # device 1 untouched by the reset of device 0
torch.cuda.reset_accumulated_memory_stats()
check(torch.cuda.memory_stats()["allocation.all.allocated"] == 0)
check(torch.cuda.memory_stats()["allocation.all.current"] == 2)

# memory_summary: PyTorch's table, from fragless's numbers.
text = torch.cuda.memory_summary()
stats = torch.cuda.memory_stats()


def summary_cells(name):
    """The four cells (current, peak, allocated, freed) of the table row named `name`."""
    rows = [[c.strip() for c in line.strip(" |").split("|")] for line in text.splitlines()]  # "| a | b |" or " a | b "
    rows = [r for r in rows if r[0] == name]
    check(len(rows) == 1, "%d rows named %r in the summary:\n%s" % (len(rows), name, text))
    check(len(rows[0]) == 5, rows[0])
    return rows[0][1:]


def shows(cell, value):
    """Whether a cell ("103 MiB", "512 B", "3 ", whatever units this PyTorch prints) shows value: the number
    scaled down by its unit's power of 1024 (or 1000 for counts), rounded down."""
    number, unit = (cell.split() + [""])[:2]
    power = {"": 0, "B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[:1]]
    base = 1024 if unit.endswith("B") else 1000
    return int(number) == value // base ** power


# PyTorch's table, from fragless's numbers: each "all" row shows the stats of its key (the segments row too:
# the mapped ranges a snapshot shows, checked below, where PyTorch's stat leaves expandable segments out).
for key, row in (("allocated_bytes", "Allocated memory"), ("active_bytes", "Active memory"),
                 ("reserved_bytes", "GPU reserved memory"), ("allocation", "Allocations"),
                 ("segment", "GPU reserved segments")):
    cells = summary_cells(row)
    for cell, what in zip(cells, ("current", "peak", "allocated", "freed")):
        check(shows(cell, stats["%s.all.%s" % (key, what)]),
              "%s %s: the summary shows %r, fragless's stats say %d" % (row, what, cell, stats["%s.all.%s" % (key, what)]))
check(shows(summary_cells("Allocated memory")[0], torch.cuda.memory_allocated()))
check(stats["allocated_bytes.all.current"] >= 3 * MiB)  # non-trivial figures: the row is not all zeros
segs_line = [line for line in text.splitlines() if "GPU reserved segments" in line]
check(segs_line and int(segs_line[0].split("|")[2].split()[0]) == \
    sum(1 for seg in fragless.snapshot()["segments"] if seg["device"] == 0), segs_line)
print(text)

# memory_snapshot: the segments; _record_memory_history / _snapshot / _dump_snapshot: the history.
segments = torch.cuda.memory_snapshot()
check(isinstance(segments, list) and segments and all("blocks" in seg for seg in segments))
torch.cuda.memory._record_memory_history(max_entries=1000)
extra = alloc(5 * MiB)
snap = torch.cuda.memory._snapshot()
actions = [e["action"] for e in snap["device_traces"][0]]
check("alloc" in actions, actions)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "snap.pickle")
    torch.cuda.memory._dump_snapshot(path)
    with open(path, "rb") as f:
        dumped = pickle.load(f)
    check(any(e["action"] == "alloc" and e["size"] == 5 * MiB for e in dumped["device_traces"][0]))
    # torch.cuda._memory_viz, as this PyTorch ships it, reads what _dump_snapshot wrote (its flamegraph
    # commands fetch a script from the network to draw: the lines they would draw are checked instead).
    import torch.cuda._memory_viz as viz
    lines = lambda x: x  # noqa: E731
    ran = []
    for name in ("stats", "segments", "memory", "trace", "segment_plot", "trace_plot"):
        fn = getattr(viz, name, None)
        if fn is None:
            print("SKIPPED (loudly): torch.cuda._memory_viz of PyTorch %s has no '%s'" % (torch.__version__, name))
            continue
        # PyTorch 1.13 reads the list of segments (memory_snapshot()'s layout), 2.0 and later the whole dict.
        data = dumped if hasattr(viz, "trace") else dumped["segments"]
        out = fn(data) if name in ("stats", "trace", "segment_plot", "trace_plot") else fn(data, lines)
        check(out, name)
        ran.append(name)
    check({"stats", "segments", "memory"} <= set(ran), ran)
    print("torch.cuda._memory_viz read the snapshot:", ", ".join(ran))
torch.cuda.memory._record_memory_history(enabled=None)
alloc_after = alloc(512)
check(len(torch.cuda.memory._snapshot()["device_traces"][0]) == len(fragless.snapshot()["device_traces"][0]))

# mem_get_info: the driver's free and total, as PyTorch documents it.
free, total = torch.cuda.mem_get_info()
check(total == 1024 * MiB, total)
check(free == total - torch.cuda.memory_reserved(), (free, total, torch.cuda.memory_reserved()))

# empty_cache: cached memory goes back; what is live stays.
for p, n in ptrs[:2]:
    lib.fragless_free(p, n, 0, stream)
lib.fragless_free(extra, 5 * MiB, 0, stream)
lib.fragless_free(alloc_after, 512, 0, stream)
torch.cuda.empty_cache()
check(torch.cuda.memory_allocated() == 0)
check(torch.cuda.memory_reserved() == 0)
check(torch.cuda.mem_get_info()[0] == total)
check(torch.cuda.memory_reserved(1) >= 200 * MiB)

# Bad devices: clear errors naming them.
for bad, want in ((5, "invalid device 5"), ("cpu", "Expected a cuda device"), (torch.device("cpu"), "cuda device")):
    try:
        torch.cuda.memory_allocated(bad)
        raise AssertionError("device %r was accepted" % (bad,))
    except (RuntimeError, ValueError) as e:
        check(want in str(e), (bad, e))
print("PyTorch %s memory API under fragless.torch.enable(): all checks passed" % torch.__version__)
