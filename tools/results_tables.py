#!/usr/bin/env python3
"""Prints the markdown tables of docs/RESULTS.md from fragless-replay --json runs.

  tools/results_tables.py replay   FILES...   one row per trace, device and policy
  tools/results_tables.py fidelity FILES...   classic's peak reserved vs PyTorch's recorded peak
  tools/results_tables.py validate DATA_DIR   generated vs real Wedsonlin training peak live
  tools/results_tables.py published DIR       the STAlloc artifact's published figures (context only)
Run from the repository root after building (uses build/bin/fragless-replay)."""
import json
import os
import subprocess
import sys

REPLAY = os.path.join("build", "bin", "fragless-replay")


def run(args):
    out = subprocess.run([REPLAY, "--json", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["results"]


def mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def replay_table(files):
    print("| trace | policy | peak live MiB | peak reserved MiB | overhead over live | frag at peak | creates | maps "
          "| unmaps | forced syncs | modelled driver ms | driver / trace time | PyTorch recorded peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in run(files):
        d = r["driver_calls"]
        dur = r["trace_duration_us"]
        share = "-" if not dur else f"{100 * r['modelled_driver_us'] / dur:.2f}%"
        print(f"| {os.path.basename(r['input'])} | {r['policy']} | {mib(r['peak_live_bytes'])} | "
              f"{mib(r['peak_reserved_bytes'])} | {100 * r['overhead_over_live']:.2f}% | "
              f"{100 * r['fragmentation_at_peak']:.2f}% | {d['create']} | {d['map']} | {d['unmap']} | "
              f"{r['forced_syncs']} | {r['modelled_driver_us'] / 1000:.2f} | {share} | "
              f"{mib(r['pytorch_recorded_peak_reserved_bytes'])} |")


def fidelity_table(files):
    print("| trace | classic peak reserved MiB | PyTorch recorded MiB | difference |")
    print("|---|---|---|---|")
    for r in run(["--policy", "classic", *files]):
        theirs = r["pytorch_recorded_peak_reserved_bytes"]
        if theirs is None:
            continue
        ours = r["peak_reserved_bytes"]
        print(f"| {os.path.basename(r['input'])} | {mib(ours)} | {mib(theirs)} | {100 * (ours - theirs) / theirs:+.2f}% |")


def validate_table(data):
    print("| context | real peak live MiB | generated peak live MiB | ratio |")
    print("|---|---|---|---|")
    for ctx in (128, 256, 512, 1024):
        real = run(["--policy", "classic",
                    f"{data}/cs336_wedsonlin_87b0864_results_medium_{ctx}_training_memory_snapshot.pickle"])[0]
        gen = run(["--policy", "classic", f"workload:transformer-train:seqlen=fixed:{ctx},layers=24,d_model=1024,"
                   "heads=16,d_ff=4096,vocab=10000,batch=4,steps=3,dropout=1"])[0]
        print(f"| {ctx} | {mib(real['peak_live_bytes'])} | {mib(gen['peak_live_bytes'])} | "
              f"{gen['peak_live_bytes'] / real['peak_live_bytes']:.3f} |")


def published_table(directory):
    """The STAlloc artifact's per-allocator figures (../shared/data/published): peak reserved, peak allocated
    and utilisation (allocated / reserved) per pipeline-stage group, as published."""
    import csv
    names = {"torch": "PyTorch 2.3", "segment": "expandable_segments", "gmlake": "GMLake", "alloc": "STAlloc"}
    print("| workload | allocator | group 1 reserved GB | group 1 allocated GB | group 1 utilisation (as published) "
          "| group 2 reserved GB | group 2 allocated GB | group 2 utilisation (as published) |")
    print("|---|---|---|---|---|---|---|---|")
    for f in sorted(os.listdir(directory)):
        if not f.endswith(".csv"):
            continue
        with open(os.path.join(directory, f)) as fh:
            for row in csv.DictReader(fh):
                who = next((v for k, v in names.items() if row["log_file"].startswith(k)), row["log_file"])
                print(f"| {f.split('_')[0]} | {who} | {row['group1_reserved'].rstrip('GB')} | "
                      f"{row['group1_allocated'].rstrip('GB')} | {row['group1_utilization']} | "
                      f"{row['group2_reserved'].rstrip('GB')} | {row['group2_allocated'].rstrip('GB')} | "
                      f"{row['group2_utilization']} |")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    {"replay": replay_table, "fidelity": fidelity_table,
     "validate": lambda a: validate_table(a[0]), "published": lambda a: published_table(a[0])}[sys.argv[1]](sys.argv[2:])
