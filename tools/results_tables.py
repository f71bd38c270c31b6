#!/usr/bin/env python3
"""Prints the markdown tables of docs/RESULTS.md from fragless-replay --json runs.

  tools/results_tables.py replay   FILES...   one row per trace, device and policy
  tools/results_tables.py fidelity FILES...   classic's peak reserved vs PyTorch's recorded peak
  tools/results_tables.py validate DATA_DIR   generated vs real Wedsonlin training peak live
  tools/results_tables.py published DIR       the STAlloc artifact's published figures (context only)
  tools/results_tables.py targets  FILES...   the fragless policy against the targets, per input
  tools/results_tables.py params   FILES...   the fragless policy's settings, one row each (ablation)
  tools/results_tables.py variants            workload variants beyond the defaults (dtype, checkpointing, ...)
  tools/results_tables.py handles  FILES...   the fragless handle shapes side by side, per input, and in total
  tools/results_tables.py zoo                 the pattern zoo at its defaults: every policy, the targets
  tools/results_tables.py fit      FILES...   the smallest device per policy (--fit, steps 1/4 and 1/16 GiB)
  tools/results_tables.py maxbatch            the largest batch per policy on 24, 40, 80 and 141 GiB devices
  tools/results_tables.py fits     FILES...   both of the above, in that order (docs/RESULTS.md, "What fits")
  tools/results_tables.py driver   [--costs PROBE.json] [--conf KEY:VALUE,...] FILES...   the eleven built-in
                                 workloads and FILES: peak reserved, driver calls, alloc-path and background
                                 driver time per policy, and the start-up targets (docs/RESULTS.md, "Driver
                                 time on the allocation path")
  tools/results_tables.py floor    FILES...   the eleven built-in workloads and FILES: the page floor of each policy's
                                 placement (fragless-replay --peak-detail) against what fragless holds and the
                                 overhead target (docs/RESULTS.md, "The page floor")
  tools/results_tables.py general  [--conf KEY:VALUE,...] [--seed N] [--draws N] [FILES...]   the start-up targets
                                 beyond the driver table's inputs: every trace cut into windows (quarters,
                                 halves) and random draws of the built-in workloads (docs/RESULTS.md,
                                 "Beyond the inputs at hand")
  tools/results_tables.py steady   [--conf KEY:VALUE,...]   repeated steps of one shape (no length drawn anew):
                                 per workload and policy, the driver calls and modelled driver time of each
                                 step after warm-up (docs/RESULTS.md, "Repeated steps")
  tools/results_tables.py headline FILES...   the README introduction's figures: over the inputs of `targets`
                                 and `zoo` together, fragless's mean and largest overhead over live and the
                                 inputs where it holds more than classic or expandable
  tools/results_tables.py check    DOC...     every `python3 tools/results_tables.py ...` command quoted in DOCs
                                 (inline code or a code block, run from the repository's root) is accepted as
                                 written, and each one that names no placeholder (a capital letter alone,
                                 FILE, DIR, PROBE.json, an ellipsis) is run: every table it prints must stand
                                 in the DOCs line for line. Exit 1 naming each command and table that does
                                 not; 77 (skipped) when an input a command names is not there
FILES are traces; the eight default workloads (four sequence-length distributions, training and inference)
are added to `targets` and `params`.
Uses the fragless-replay of the build beside this script (build/bin/ under the repository's root), or
$FRAGLESS_REPLAY."""
import argparse
import json
import os
import re
import subprocess
import sys

# Found from this script's own place, so the tables can be made from any directory.
REPLAY = os.environ.get("FRAGLESS_REPLAY") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "bin", "fragless-replay")


def replay_command():
    """REPLAY, or exit naming where it was looked for."""
    if not os.access(REPLAY, os.X_OK):
        sys.exit(f"results_tables.py: no fragless-replay at {REPLAY} (build the repository first, or set "
                 f"FRAGLESS_REPLAY to one)")
    return REPLAY


def replay_failed(args, p):
    """Ends the script with the replay's own error first, then the command that met it (cut when long)."""
    command = "fragless-replay --json " + " ".join(args)
    if len(command) > 300:
        command = command[:300] + " ... (%d arguments)" % len(args)
    sys.exit(f"{p.stderr.strip() or 'no message'}\n(exit {p.returncode} from: {command})")


def run(args, empty_ok=False):
    """The results of fragless-replay --json ARGS; with empty_ok, none where no input has an allocation to replay
    (a --window that holds none)."""
    p = subprocess.run([replay_command(), "--json", *args], capture_output=True, text=True)
    if empty_ok and p.returncode == 2 and "nothing to replay" in p.stderr:
        return []
    if p.returncode != 0:
        replay_failed(args, p)
    return json.loads(p.stdout)["results"]


def run_search(args):
    """A --fit or --max-of run: exit 1 (a search without an answer) still has its JSON, the answer null."""
    p = subprocess.run([replay_command(), "--json", *args], capture_output=True, text=True)
    if p.returncode not in (0, 1):
        replay_failed(args, p)
    return json.loads(p.stdout)


def header(*columns):
    """A markdown table's header row and its separator."""
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")


def best_other(p):
    """The smaller peak reserved of classic and expandable, given an input's results by policy."""
    return min(p["classic"]["peak_reserved_bytes"], p["expandable"]["peak_reserved_bytes"])


def mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def replay_table(files):
    header("trace", "policy", "peak live MiB", "peak reserved MiB", "overhead over live", "frag at peak", "creates",
           "maps", "unmaps", "forced syncs", "modelled driver ms", "driver / trace time", "PyTorch recorded peak MiB")
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
    header("trace", "classic peak reserved MiB", "PyTorch recorded MiB", "difference")
    for r in run(["--policy", "classic", *files]):
        theirs = r["pytorch_recorded_peak_reserved_bytes"]
        if theirs is None:
            continue
        ours = r["peak_reserved_bytes"]
        print(f"| {os.path.basename(r['input'])} | {mib(ours)} | {mib(theirs)} | {100 * (ours - theirs) / theirs:+.2f}% |")


def validate_table(data):
    header("context", "real peak live MiB", "generated peak live MiB", "ratio")
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
    header("workload", "allocator", "group 1 reserved GB", "group 1 allocated GB",
           "group 1 utilisation (as published)", "group 2 reserved GB", "group 2 allocated GB",
           "group 2 utilisation (as published)")
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


WORKLOADS = [f"workload:transformer-{kind}:seqlen={dist}"
             for dist in ("sharegpt", "azure-conv", "azure-code", "arxiv") for kind in ("train", "infer")]


def overhead_limit(live):
    """The issue's target: 2% over peak live from 1 GiB of peak live up, 2% + 4 MiB below (one stream)."""
    return 0.02 if live >= 2**30 else 0.02 + 4 * 2**20 / live


def limit_bytes(live):
    """The overhead target's limit in bytes of peak reserved for a peak live of `live` bytes."""
    return live * (1 + overhead_limit(live)) if live else 0


def lowest_floor(p):
    """The lowest page floor (fragless-replay --peak-detail) of an input's results by policy."""
    return min(p[k]["page_floor_bytes"] for k in ("classic", "expandable", "fragless"))


def by_input(results):
    out = {}
    for r in results:
        out.setdefault((r["input"], r["device"]), {})[r["policy"]] = r
    return out


def targets_table(files):
    rows = by_input(run([*files, *WORKLOADS]))
    header("input", "peak live MiB", "fragless overhead", "limit", "best other policy MiB", "fragless MiB",
           "forced syncs", "driver / trace time", "met")
    for (name, dev), p in rows.items():
        f = p["fragless"]
        live = f["peak_live_bytes"]
        best = best_other(p)
        ov, lim = f["overhead_over_live"], overhead_limit(live)
        dur = f["trace_duration_us"]
        share = f["modelled_driver_us"] / dur if dur else None
        misses = [m for m, bad in (("overhead", ov > lim), ("worse than another policy", f["peak_reserved_bytes"] > best),
                                   ("driver time", share is not None and share > 0.01)) if bad]
        print(f"| {os.path.basename(name)} | {mib(live)} | {100 * ov:.2f}% | {100 * lim:.2f}% | {mib(best)} | "
              f"{mib(f['peak_reserved_bytes'])} | {f['forced_syncs']} | "
              f"{'-' if share is None else f'{100 * share:.2f}%'} | {'yes' if not misses else 'no: ' + ', '.join(misses)} |")


PARAMS = ["", "lend_pages:False", "lend_across_streams:False", "small_in_remnants:False", "reserve_slack:0",
          "reserve_slack:0.0625", "handles:ends,handle_max_mb:8", "handles:ends,handle_max_mb:32",
          "handles:ends,handle_max_mb:8,chunk_size_mb:64", "handles:whole"]

HANDLES = [("pages", "handles:pages"), ("ends 8 MiB", "handles:ends,handle_max_mb:8"),
           ("ends 32 MiB", "handles:ends,handle_max_mb:32"), ("whole", "handles:whole")]
ZOO = ["workload:unet2d", "workload:unet3d", "workload:moe", "workload:serving", "workload:fsdp", "workload:pipeline",
       "workload:random", "workload:random:streams=1", "workload:ckpt-accum", "workload:rl"]


def handles_table(files):
    """Per input: peak reserved, creates, maps, unmaps, set-access calls and modelled driver time for every
    handle shape, with expandable (one 20 MiB handle per page) as the reference; same cost model for all."""
    inputs = [*files, *WORKLOADS, *ZOO]
    ref = by_input(run(["--policy", "expandable", *inputs]))
    cols = [(name, by_input(run(["--policy", "fragless", "--conf", conf, *inputs]))) for name, conf in HANDLES]
    header("input", "expandable MiB / creates / driver ms",
           *(f"{n} MiB / creates / maps / unmaps / set-access / driver ms" for n, _ in cols))
    totals = {n: [0, 0, 0.0, 0] for n, _ in cols}
    etot = [0, 0.0]
    for key, p in ref.items():
        e = p["expandable"]
        etot[0] += e["driver_calls"]["create"]
        etot[1] += e["modelled_driver_us"]
        cells = []
        for n, rows in cols:
            f = rows[key]["fragless"]
            d = f["driver_calls"]
            cells.append(f"{mib(f['peak_reserved_bytes'])} / {d['create']} / {d['map']} / {d['unmap']} / "
                         f"{d['set_access']} / {f['modelled_driver_us'] / 1000:.1f}")
            t = totals[n]
            t[0] += f["peak_reserved_bytes"] > e["peak_reserved_bytes"]
            t[1] += d["create"]
            t[2] += f["modelled_driver_us"]
            t[3] = max(t[3], f["overhead_over_live"])
        print(f"| {os.path.basename(key[0])} | {mib(e['peak_reserved_bytes'])} / {e['driver_calls']['create']} / "
              f"{e['modelled_driver_us'] / 1000:.1f} | " + " | ".join(cells) + " |")
    print()
    header("handle shape", "inputs above expandable", "largest overhead over live", "cuMemCreate calls",
           "modelled driver ms")
    print(f"| (expandable) | - | - | {etot[0]} | {etot[1] / 1000:.0f} |")
    for n, _ in cols:
        t = totals[n]
        print(f"| {n} | {t[0]} of {len(ref)} | {100 * t[3]:.2f}% | {t[1]} | {t[2] / 1000:.0f} |")


def zoo_table(_):
    rows = by_input(run(ZOO))
    header("workload", "peak live MiB", "classic", "expandable", "fragless", "fragless vs best other",
           "fragless creates (expandable)", "forced syncs", "target met")
    for (name, _), p in rows.items():
        f = p["fragless"]
        live = f["peak_live_bytes"]
        ov = {k: 100 * p[k]["overhead_over_live"] for k in ("classic", "expandable", "fragless")}
        best = best_other(p)
        diff = f["peak_reserved_bytes"] - best
        misses = [m for m, bad in (("overhead", f["overhead_over_live"] > overhead_limit(live)),
                                   ("worse than another policy", diff > 0)) if bad]
        print(f"| {name.split(':', 1)[1]} | {mib(live)} | {ov['classic']:.2f}% | {ov['expandable']:.2f}% | "
              f"{ov['fragless']:.2f}% | {'+' if diff > 0 else ''}{diff / 2**20:.0f} MiB | {f['driver_calls']['create']} "
              f"({p['expandable']['driver_calls']['create']}) | {f['forced_syncs']} | "
              f"{'yes' if not misses else 'no: ' + ', '.join(misses)} |")


def headline(files):
    """The README introduction's memory figures, over the inputs of `targets` (FILES and the eight default
    workloads) and of `zoo` together: one replay of each."""
    rows = by_input(run([*files, *WORKLOADS, *ZOO]))
    over = [p["fragless"]["overhead_over_live"] for p in rows.values()]
    above = []
    for (name, _), p in rows.items():
        diff = p["fragless"]["peak_reserved_bytes"] - best_other(p)
        if diff > 0:
            over_peers = [(q, p["fragless"]["peak_reserved_bytes"] - p[q]["peak_reserved_bytes"])
                          for q in ("expandable", "classic")]
            said = ", ".join(f"+{d / 2**20:.0f} MiB over {q}" for q, d in over_peers if d > 0)
            above.append((os.path.basename(name), said, diff / best_other(p)))
    traces = sum(1 for (name, _) in rows if not name.startswith("workload:"))
    print(f"{len(rows)} inputs ({traces} traces, {len(WORKLOADS)} transformer workloads, {len(ZOO)} zoo patterns): "
          f"fragless holds a mean {100 * sum(over) / len(over):.2f}% more than is live, at most {100 * max(over):.2f}%; "
          f"more than classic or expandable on {len(above)} of them:")
    for name, said, frac in above:
        print(f"- {name}: {said} ({100 * frac:.2f}% over the lower of the two)")


def params_table(files):
    inputs = [*files, *WORKLOADS]
    base = by_input(run(["--policy", "classic,expandable", *inputs]))
    header("fragless settings", "inputs over the overhead target", "inputs above expandable or classic",
           "mean overhead over live", "largest overhead", "forced syncs (all inputs)", "cuMemCreate calls",
           "mean driver / trace time")
    for conf in PARAMS:
        rows = run(["--policy", "fragless", *(["--conf", conf] if conf else []), *inputs])
        over = worse = syncs = creates = 0
        ovs, shares = [], []
        for r in rows:
            p = base[(r["input"], r["device"])]
            live = r["peak_live_bytes"]
            ovs.append(r["overhead_over_live"])
            over += r["overhead_over_live"] > overhead_limit(live)
            worse += r["peak_reserved_bytes"] > best_other(p)
            syncs += r["forced_syncs"]
            creates += r["driver_calls"]["create"]
            if r["trace_duration_us"]:
                shares.append(r["modelled_driver_us"] / r["trace_duration_us"])
        print(f"| {conf or 'defaults'} | {over} of {len(rows)} | {worse} | {100 * sum(ovs) / len(ovs):.2f}% | "
              f"{100 * max(ovs):.2f}% | {syncs} | {creates} | {100 * sum(shares) / len(shares):.1f}% |")


def variants_table(_):
    """Workload variants the targets do not name, to show where fragless is not the best policy."""
    cfgs = [f"workload:transformer-{kind}:seqlen={dist},{extra}"
            for dist in ("sharegpt", "azure-code", "arxiv") for kind in ("train", "infer")
            for extra in ("dtype=bf16", "ckpt=1", "layers=12,d_model=768,heads=12,batch=16", "seed=7,batch=2",
                          "dtype=bf16,ckpt=1,seed=3")
            if not (kind == "infer" and "ckpt" in extra)]
    rows = by_input(run(cfgs))
    header("workload", "peak live MiB", "classic", "expandable", "fragless", "fragless vs best other")
    for (name, _), p in rows.items():
        live = p["fragless"]["peak_live_bytes"]
        ov = {k: 100 * p[k]["overhead_over_live"] for k in ("classic", "expandable", "fragless")}
        best = best_other(p)
        diff = p["fragless"]["peak_reserved_bytes"] - best
        print(f"| {name.split(':', 1)[1]} | {mib(live)} | {ov['classic']:.2f}% | {ov['expandable']:.2f}% | "
              f"{ov['fragless']:.2f}% | {'+' if diff > 0 else ''}{diff / 2**20:.0f} MiB |")


def gib(b):
    return "-" if b is None else f"{b / 2**30:.4g}"


def fit_table(files):
    """Per trace and device: the smallest capacity each policy replays on with no OOM, at two resolutions."""
    coarse = run_search(["--fit", *files])
    fine = run_search(["--fit", "--fit-step", "0.0625", *files])
    rows = {}
    for step, doc in (("coarse", coarse), ("fine", fine)):
        for r in doc["results"]:
            key = (os.path.basename(r["input"]), r["device"])
            row = rows.setdefault(key, {"live": r.get("peak_live_bytes"),
                                        "pytorch": r.get("pytorch_recorded_peak_reserved_bytes")})
            row[(step, r["policy"])] = r["min_capacity_bytes"]
    pols = ("classic", "expandable", "fragless")
    header("trace", "dev", "peak live GiB", "classic (1/4 GiB)", "expandable", "fragless", "classic (1/16 GiB)",
           "expandable", "fragless", "fragless ÷ classic (1/16)", "PyTorch recorded peak reserved GiB")
    # The totals add up the rows every policy answered, so that they compare the same traces; a row without
    # an answer (no capacity fits, shown "-") is left out of them, and counted.
    total = {p: 0 for p in pols}
    unanswered = 0
    for (name, dev), row in sorted(rows.items()):
        c = [gib(row.get(("coarse", p))) for p in pols]
        f = [gib(row.get(("fine", p))) for p in pols]
        fine_all = [row.get(("fine", p)) for p in pols]
        if all(v is not None for v in fine_all):
            for p in pols:
                total[p] += row[("fine", p)]
        else:
            unanswered += 1
        fr, cl = row.get(("fine", "fragless")), row.get(("fine", "classic"))
        ratio = "-" if fr is None or not cl else f"{fr / cl:.3f}"
        print(f"| {name} | {dev} | {gib(row['live'])} | {' | '.join(c)} | {' | '.join(f)} | {ratio} | "
              f"{gib(row['pytorch'])} |")
    print(f"| **total** | | | | | | {' | '.join(gib(total[p]) for p in pols)} | "
          f"{total['fragless'] / total['classic'] if total['classic'] else float('nan'):.3f} | |")
    if unanswered:
        print(f"\n{unanswered} row(s) where a policy found no capacity (\"-\") are left out of the totals.")
    print()
    print(f"Searches: {len(coarse['results'])} at 1/4 GiB in {coarse['seconds']:.2f} s ({coarse['replays']} replays), "
          f"{len(fine['results'])} at 1/16 GiB in {fine['seconds']:.2f} s ({fine['replays']} replays).")


MAX_WORKLOADS = [(f"workload:{w}:seqlen={d}", w, d, "batch")
                 for w in ("transformer-train", "transformer-infer", "ckpt-accum")
                 for d in ("sharegpt", "azure-conv", "azure-code", "arxiv")] + \
                [(f"workload:{w}", w, "(its own)", k) for w, k in
                 (("unet2d", "batch"), ("unet3d", "batch"), ("fsdp", "batch"), ("pipeline", "batch"), ("moe", "tokens"))]


def maxbatch_table(_):
    """The largest batch (moe: tokens per step) per policy, per workload and distribution, per device size."""
    header("workload", "lengths", "key", "GiB", "classic", "expandable", "fragless", "fragless ÷ classic",
           "fragless ÷ expandable")
    seconds = replays = 0
    for key in ("batch", "tokens"):
        specs = [w for w in MAX_WORKLOADS if w[3] == key]
        for cap in (24, 40, 80, 141):
            doc = run_search(["--max-of", key, "--capacity-gib", str(cap), *[w[0] for w in specs]])
            seconds += doc["seconds"]
            replays += doc["replays"]
            found = {(r["input"], r["policy"]): r["max_value"] for r in doc["results"]}
            for spec, name, dist, _ in specs:
                v = {p: found.get((spec, p)) for p in ("classic", "expandable", "fragless")}
                def ratio(b):
                    return "-" if not v["fragless"] or not v[b] else f"{v['fragless'] / v[b]:.2f}"
                at_limit = {(r["input"], r["policy"]) for r in doc["results"] if r.get("at_limit")}
                shown = {p: "does not fit" if v[p] is None else str(v[p]) + (" (the workload's largest)" if (spec, p) in at_limit else "")
                         for p in v}
                print(f"| {name} | {dist} | {key} | {cap} | {shown['classic']} | {shown['expandable']} | "
                      f"{shown['fragless']} | {ratio('classic')} | {ratio('expandable')} |")
    print()
    print(f"{replays} replays in {seconds:.1f} s of searching.")


BUILTINS = ["workload:transformer-train", "workload:transformer-infer", "workload:ckpt-accum", "workload:unet2d",
            "workload:unet3d", "workload:moe", "workload:serving", "workload:fsdp", "workload:pipeline",
            "workload:random", "workload:rl"]


def targets_missed(p):
    """The start-up targets an input's fragless result misses (the driver table's three), as
    (driver ms over, overhead over its limit, MiB over the better peer), each 0 when met."""
    c, e, f = p["classic"], p["expandable"], p["fragless"]
    live = f["peak_live_bytes"]
    best = min(c["peak_reserved_bytes"], e["peak_reserved_bytes"])
    return (max(0.0, (f["alloc_path_driver_us"] - e["modelled_driver_us"]) / 1000),
            max(0.0, f["overhead_over_live"] - overhead_limit(live)) if live else 0.0,
            max(0, f["peak_reserved_bytes"] - best) / 2**20)


def driver_table(args):
    """Per input (the built-in workloads at their defaults, then FILES): what each policy holds and what its
    driver calls cost, split into the time a caller waits for (alloc path) and the time spent off it
    (background), under the A100 model or a measured --costs file; then the targets per input and in total."""
    options = []
    while args and args[0] in ("--costs", "--conf"):
        options, args = options + args[:2], args[2:]
    rows = by_input(run([*options, *BUILTINS, *args]))
    header("input", "peak live MiB", "reserved MiB classic / expandable / fragless", "fragless overhead",
           "creates expandable / fragless (background)", "maps", "set-access", "expandable driver ms",
           "fragless alloc-path ms", "fragless background ms", "targets missed")
    met = 0
    tot = {"e": 0.0, "path": 0.0, "bg": 0.0}
    for (name, _), p in rows.items():
        c, e, f = p["classic"], p["expandable"], p["fragless"]
        live = f["peak_live_bytes"]
        de, df, bg = e["driver_calls"], f["driver_calls"], f["background_calls"]
        d, o, a = targets_missed(p)
        misses = [m for m in (d and f"driver +{d:.1f} ms", o and f"overhead (limit {100 * overhead_limit(live):.2f}%)",
                              a and f"+{a:.0f} MiB over a peer") if m]
        met += not misses
        tot["e"] += e["modelled_driver_us"]
        tot["path"] += f["alloc_path_driver_us"]
        tot["bg"] += f["background_driver_us"]
        label = name.split(":", 1)[1] if name.startswith("workload:") else os.path.basename(name)
        print(f"| {label} | {mib(live)} | {mib(c['peak_reserved_bytes'])} / {mib(e['peak_reserved_bytes'])} / "
              f"{mib(f['peak_reserved_bytes'])} | {100 * f['overhead_over_live']:.2f}% | {de['create']} / "
              f"{df['create']} ({bg['create']}) | {de['map']} / {df['map']} | {de['set_access']} / {df['set_access']} "
              f"| {e['modelled_driver_us'] / 1000:.1f} | {f['alloc_path_driver_us'] / 1000:.1f} | "
              f"{f['background_driver_us'] / 1000:.1f} | {', '.join(misses) or 'none'} |")
    print()
    print(f"{met} of {len(rows)} inputs meet every target. Modelled driver time over all inputs: expandable "
          f"{tot['e'] / 1000:.0f} ms; fragless {tot['path'] / 1000:.0f} ms on the allocation path and "
          f"{tot['bg'] / 1000:.0f} ms in the background.")


def floor_table(files):
    """Per input (the built-in workloads at their defaults, then FILES): the page floor (fragless-replay
    --peak-detail; Note [The page floor] in bench/replay/replay.cpp) of each policy's placement, against what
    fragless holds at its peak and the overhead target's limit."""
    rows = by_input(run(["--peak-detail", *BUILTINS, *files]))
    header("input", "peak live MiB", "overhead limit MiB", "page floor MiB classic / expandable / fragless",
           "fragless reserved MiB", "fragless above its floor MiB", "the limit against the floors")
    under = 0
    for (name, dev), p in rows.items():
        c, e, f = p["classic"], p["expandable"], p["fragless"]
        live = f["peak_live_bytes"]
        limit = limit_bytes(live)
        low = lowest_floor(p)
        under += low > limit
        label = name.split(":", 1)[1] if name.startswith("workload:") else os.path.basename(name)
        if any(d != 0 for (n, d) in rows if n == name):
            label += f" (device {dev})"
        print(f"| {label} | {mib(live)} | {mib(limit)} | {mib(c['page_floor_bytes'])} / {mib(e['page_floor_bytes'])} / "
              f"{mib(f['page_floor_bytes'])} | {mib(f['peak_reserved_bytes'])} | "
              f"{mib(f['peak_reserved_bytes'] - f['page_floor_bytes'])} | "
              f"{'below every floor' if low > limit else 'above a floor'} |")
    print()
    print(f"On {under} of {len(rows)} inputs the overhead target's limit is below the page floor of every "
          f"policy's placement.")


# Random draws of the built-in workloads: each key from a few values that scale the workload down or up and
# reshape it (the zoo's property test's spaces, and the transformer's).
DRAW_SPACES = {
    "transformer-train": {"layers": [4, 12, 24], "d_model": [512, 1024, 2048], "batch": [1, 4, 8],
                          "max_seq": [512, 2048, 4096], "seqlen": ["sharegpt", "azure-conv", "arxiv"],
                          "dtype": ["fp32", "bf16"], "ckpt": [0, 1], "steps": [3, 6]},
    "transformer-infer": {"layers": [4, 12, 24], "d_model": [512, 1024, 2048], "batch": [1, 4, 16],
                          "max_seq": [512, 2048, 4096], "seqlen": ["sharegpt", "azure-code"], "dtype": ["fp32", "bf16"]},
    "unet2d": {"base": [16, 32, 64], "res": [128, 256, 384, 512], "levels": [3, 4, 5], "batch": [1, 2, 4, 8]},
    "unet3d": {"base": [8, 16, 32], "res": [64, 96, 128, 192], "batch": [1, 2], "train": [0, 1]},
    "moe": {"layers": [2, 4, 8], "experts": [4, 8, 32, 64], "tokens": [1024, 4096, 16384], "skew": [1.25, 3.25]},
    "serving": {"layers": [8, 16, 32], "max_batch": [4, 16, 64], "block": [1, 16, 64], "steps": [100, 300]},
    "fsdp": {"layers": [4, 12, 24], "d_model": [1024, 2048, 4096], "world": [2, 8, 64], "batch": [1, 4, 8]},
    "pipeline": {"stages": [2, 4, 8], "rank": [0, 1, 3], "micro": [4, 8, 16], "d_model": [1024, 4096]},
    "random": {"min_bytes": [256, 512, 4096], "lifetime": [5, 40, 400], "streams": [1, 2, 4],
               "live_gib": [1, 4, 16], "ops": [2000]},
    "rl": {"layers": [4, 12, 24], "d_model": [1024, 2048, 4096], "prompts": [2, 8, 16], "group": [1, 4, 8],
           "max_new": [64, 256, 1024], "ref": [0, 1], "static_kv": [0, 1], "empty_cache": [0, 1]},
}
WINDOWS = ["0:0.25", "0.25:0.5", "0.5:0.75", "0.75:1", "0:0.5", "0.5:1"]


def general_table(args):
    """The driver table's targets on inputs it does not hold: each trace cut into quarters and halves
    (fragless-replay --window), and random draws of every built-in workload, as a policy meant for the
    general case should meet them beyond the inputs it was measured on."""
    import random
    conf, seed, draws = [], 1, 3
    while args and args[0].startswith("--"):
        if args[0] == "--conf":
            conf = ["--conf", args[1]]
        elif args[0] == "--seed":
            seed = int(args[1])
        elif args[0] == "--draws":
            draws = int(args[1])
        else:
            sys.exit(f"general: unknown option {args[0]}")
        args = args[2:]
    rng = random.Random(seed)
    specs = []
    for name, space in DRAW_SPACES.items():
        for _ in range(draws):
            drawn = {k: rng.choice(v) for k, v in space.items()}
            if name == "pipeline":  # a stage of the pipeline drawn (the generator refuses rank >= stages)
                drawn["rank"] = min(drawn["rank"], drawn["stages"] - 1)
            keys = ",".join(f"{k}={v}" for k, v in drawn.items())
            specs.append(f"workload:{name}:{keys},seed={rng.randrange(1000000)}")
    groups = {"windows": [], "draws": []}
    for w in WINDOWS if args else []:
        groups["windows"] += by_input(run([*conf, "--peak-detail", "--window", w, *args], empty_ok=True)).items()
    groups["draws"] = list(by_input(run([*conf, "--peak-detail", *specs])).items())
    print(f"| inputs | count | meeting every target | driver (path > expandable) | overhead | of which below every "
          f"page floor | above a peer | path ms fragless / expandable | MiB above a peer |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = []
    for group, rows in groups.items():
        if not rows:
            continue
        met = drv = ovh = floored = peer = 0
        path = exp = above = 0.0
        for (name, _), p in rows:
            d, o, a = targets_missed(p)
            # Note [The page floor]: a limit below the floor of every policy's placement is out of reach of
            # any policy that places blocks as one of them does and backs whole pages.
            low = o and lowest_floor(p) > limit_bytes(p["fragless"]["peak_live_bytes"])
            met += not (d or o or a)
            drv += d > 0
            ovh += o > 0
            floored += bool(low)
            peer += a > 0
            above += a
            path += p["fragless"]["alloc_path_driver_us"] / 1000
            exp += p["expandable"]["modelled_driver_us"] / 1000
            if d or o or a:
                worst.append((name, d, o, a, low))
        print(f"| {group} | {len(rows)} | {met} | {drv} | {ovh} | {floored} | {peer} | {path:.0f} / {exp:.0f} | "
              f"{above:.0f} |")
    print()
    for name, d, o, a, low in worst:
        label = os.path.basename(name) if not name.startswith("workload:") else name
        over = o and f"overhead +{100 * o:.2f} points" + (" (the limit below every page floor)" if low else "")
        print(f"- {label}: " + ", ".join(m for m in (d and f"driver +{d:.1f} ms", over,
                                                          a and f"+{a:.0f} MiB over a peer") if m))


# Workloads whose steps all have one shape (no length, crop or token count drawn anew): the same step again,
# as a training loop at a fixed sequence length or image size runs it. Their steps=N is added.
STEADY_WORKLOADS = (
    [f"transformer-train:seqlen=fixed:{n},dtype={t},layers=8" for n in (256, 700, 1500) for t in ("fp32", "bf16")]
    + [f"transformer-infer:seqlen=fixed:{n},layers=8" for n in (300, 1000)]
    + ["ckpt-accum:seqlen=fixed:512,layers=8", "ckpt-accum:seqlen=fixed:1200,layers=8,dtype=bf16",
       "unet2d:jitter=0", "unet2d:jitter=0,res=384,seed=2", "unet2d:jitter=0,train=0,batch=4",
       "unet3d:jitter=0", "unet3d:jitter=0,res=128,seed=3"])
STEADY_WARM, STEADY_MORE = 64, 16  # steps of warm-up, then steps measured


def steady_table(args):
    """Per fixed-shape workload: each policy replayed for STEADY_WARM and for STEADY_WARM + STEADY_MORE steps; the
    difference is what the steps after warm-up cost. Calls: the replay's counted calls (reservations, creates,
    maps, set-access, unmaps, releases) and forced synchronisations; memory queries are left out (they change no
    mapping), and event calls are not counted by the replay's JSON (they are in the modelled time)."""
    conf = args  # [] or ["--conf", KEY:VALUE,...] (main builds it)
    ins = [f"workload:{w},steps={n}" for w in STEADY_WORKLOADS for n in (STEADY_WARM, STEADY_WARM + STEADY_MORE)]
    res = {(r["input"], r["policy"]): r for r in run([*conf, *ins])}
    quiet = ("memory_info",)

    def after(w, policy, key):
        a = res[(f"workload:{w},steps={STEADY_WARM}", policy)]
        b = res[(f"workload:{w},steps={STEADY_WARM + STEADY_MORE}", policy)]
        if key == "calls":
            return (sum(b["driver_calls"][k] - a["driver_calls"][k] for k in b["driver_calls"] if k not in quiet)
                    + b["forced_syncs"] - a["forced_syncs"])
        if key == "creates":
            return b["driver_calls"]["create"] - a["driver_calls"]["create"]
        return b[key] - a[key]

    header("workload (steps of one shape)", "peak live MiB", "reserved MiB classic / expandable / fragless",
           "calls and syncs per step classic / expandable / fragless", "fragless creates per step",
           "fragless alloc-path µs per step (share of the step)", "fragless background µs per step")
    zero = {p: 0 for p in ("classic", "expandable", "fragless")}
    path = bg = 0.0
    for w in STEADY_WORKLOADS:
        last = {p: res[(f"workload:{w},steps={STEADY_WARM + STEADY_MORE}", p)] for p in zero}
        calls = {p: after(w, p, "calls") / STEADY_MORE for p in zero}
        for p in zero:
            zero[p] += calls[p] == 0
        per_path = after(w, "fragless", "alloc_path_driver_us") / STEADY_MORE
        per_bg = after(w, "fragless", "background_driver_us") / STEADY_MORE
        step = after(w, "fragless", "model_duration_us") / STEADY_MORE  # the compute model's time of a step
        path += per_path
        bg += per_bg
        print(f"| {w} | {mib(last['fragless']['peak_live_bytes'])} | "
              f"{' / '.join(mib(last[p]['peak_reserved_bytes']) for p in zero)} | "
              f"{' / '.join(f'{calls[p]:.1f}' for p in zero)} | {after(w, 'fragless', 'creates') / STEADY_MORE:.1f} | "
              f"{per_path:.1f} ({100 * per_path / step:.2f}%) | {per_bg:.1f} |")
    total = {p: sum(res[(f"workload:{w},steps={STEADY_WARM + STEADY_MORE}", p)]["peak_reserved_bytes"]
                    for w in STEADY_WORKLOADS) for p in zero}
    print()
    print(f"Steps {STEADY_WARM + 1} to {STEADY_WARM + STEADY_MORE} without a driver call or a forced sync: classic "
          f"{zero['classic']}, expandable {zero['expandable']}, fragless {zero['fragless']} of "
          f"{len(STEADY_WORKLOADS)} workloads. fragless per step, summed over them: {path:.0f} µs on the allocation "
          f"path, {bg:.0f} µs in the background. Peak reserved summed: classic {mib(total['classic'])}, expandable "
          f"{mib(total['expandable'])}, fragless {mib(total['fragless'])} MiB.")


PLACEHOLDERS = {"FILE", "FILES", "FILE...", "FILES...", "DIR", "PROBE.json", "…", "..."}


def quoted_commands(text):
    """The `python3 tools/results_tables.py ...` commands a document quotes, in order: inline code (which may run
    over line breaks) and lines of fenced code blocks (a trailing # comment dropped), whitespace made single."""
    found = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and line.strip().startswith("python3 tools/results_tables.py"):
            found.append(line.split(" #")[0])
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [m for m in re.findall(r"`([^`]*)`", outside) if m.strip().startswith("python3 tools/results_tables.py")]
    return list(dict.fromkeys(" ".join(c.split()) for c in found))


def placeholder(token):
    """Whether a command's word stands for something the reader chooses (a capital letter alone, as a word or as
    a KEY:VALUE's value, FILE, DIR, PROBE.json, an ellipsis)."""
    return token in PLACEHOLDERS or bool(re.fullmatch(r"(.*[:=])?[A-Z]", token))


def table_blocks(text):
    """The markdown tables in text: runs of lines that begin with '|', trailing blanks dropped."""
    blocks, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line.rstrip())
        elif current:
            blocks.append(current)
            current = []
    return blocks


def check_docs(docs):
    """Each command the docs quote is accepted as written; each without a placeholder is run from the
    repository's root and every table it prints must stand in the docs, line for line."""
    import glob
    import io
    from contextlib import redirect_stderr
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    texts = {}
    for d in docs:
        try:
            with open(d, encoding="utf-8") as f:
                texts[d] = f.read()
        except OSError as e:
            sys.exit(f"check: cannot read {d}: {e.strerror}")
    doc_tables = [b for t in texts.values() for b in table_blocks(t)]

    def stands_in_docs(block):  # as a whole table of the docs: no row more, none less
        return block in doc_tables

    def paragraphs_quoting(command):
        return [p for t in texts.values() for p in re.split(r"\n\s*\n", t) if command in " ".join(p.split())]

    def figures_stand(output, command):
        """A command that prints no table: every figure of its first line must be in a paragraph that quotes
        it, as printed or rounded to fewer decimals (0.89 as 0.9, 3.80 as 3.8); the figures missing."""
        first = output.strip().splitlines()[0] if output.strip() else ""
        paragraphs = " ".join(paragraphs_quoting(command))
        said = set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?", paragraphs.replace(",", "")))
        missing = []
        for figure in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", first):
            forms = {figure}
            if "." in figure:
                decimals = figure.split(".")[1]
                forms |= {f"{float(figure):.{k}f}" for k in range(1, len(decimals))}  # a decimal kept
                forms |= {f.rstrip("0").rstrip(".") for f in list(forms)}
            if not forms & said:
                missing.append(figure)
        return first, missing

    commands = list(dict.fromkeys(c for t in texts.values() for c in quoted_commands(t)))
    if not commands:
        sys.exit(f"check: no `python3 tools/results_tables.py ...` command in {', '.join(docs)}")
    failed = skipped = ran = 0
    for command in commands:
        words = command.split()[2:]
        # Accepted as written: the parser reads the words, each placeholder standing for a value ("1").
        sample = [re.sub(r"(^|[:=])[A-Z]$", r"\g<1>1", w) for w in words if w not in ("…", "...")]
        if not sample:  # `python3 tools/results_tables.py ...`: the script named, no command
            print(f"names no command, not run: `{command}`")
            continue
        complaint = io.StringIO()
        try:
            with redirect_stderr(complaint):
                make_parser().parse_args(sample)
        except SystemExit:
            failed += 1
            print(f"FAILED: `{command}` is not accepted: {complaint.getvalue().strip().splitlines()[-1]}")
            continue
        if any(placeholder(w) for w in words):
            print(f"accepted, not run (it names a placeholder): `{command}`")
            continue
        if words and words[0] == "check":  # this check itself: running it would run it again
            print(f"accepted, not run (it is this check): `{command}`")
            continue
        args, missing = [], []
        for w in words:
            if any(ch in w for ch in "*?["):
                matches = sorted(glob.glob(os.path.join(root, w)))
                args += [os.path.relpath(m, root) for m in matches] or [w]
                missing += [] if matches else [w]
            else:
                args.append(w)
                if ("/" in w or w.endswith((".json", ".pickle", ".csv", ".fgt"))) and \
                        not os.path.exists(os.path.join(root, w)):
                    missing.append(w)
        if missing:
            skipped += 1
            print(f"SKIPPED: `{command}`: {', '.join(missing)} not found (run from {root})")
            continue
        p = subprocess.run([sys.executable, os.path.abspath(__file__), *args], cwd=root, capture_output=True,
                           text=True)
        ran += 1
        if p.returncode != 0:
            failed += 1
            print(f"FAILED: `{command}` exited {p.returncode}: {p.stderr.strip()}")
            continue
        blocks = table_blocks(p.stdout)
        if not blocks:
            first, missing = figures_stand(p.stdout, command)
            if missing or not first:
                failed += 1
                print(f"FAILED: `{command}` prints no table, and the docs' paragraph quoting it lacks "
                      f"{', '.join(missing) if missing else 'its output (it printed nothing)'}:\n  now:  {first}")
            else:
                print(f"ok (every figure of its first line is in the paragraph quoting it): `{command}`")
        wrong = [b for b in blocks if not stands_in_docs(b)]
        if blocks and not wrong:
            print(f"ok ({len(blocks)} table{'s' if len(blocks) > 1 else ''}): `{command}`")
        for block in wrong:
            failed += 1
            print(f"FAILED: `{command}` prints a table the docs do not hold; its header:\n  {block[0]}")
            same = [t for t in doc_tables if t[0] == block[0]]
            if not same:
                print("  no table in the docs has that header")
                continue
            near = min(same, key=lambda t: len(set(t) ^ set(block)))
            for row in [r for r in near if r not in block][:8]:
                print(f"  docs: {row}")
            for row in [r for r in block if r not in near][:8]:
                print(f"  now:  {row}")
    print(f"check: {len(commands)} commands in {', '.join(docs)}: {ran} run, {failed} failed, {skipped} skipped")
    sys.exit(1 if failed else 77 if skipped else 0)


def make_parser():
    # No abbreviations: a command quoted in the docs (check) must name each option in full.
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, function in (("replay", replay_table), ("fidelity", fidelity_table), ("targets", targets_table),
                           ("params", params_table), ("handles", handles_table), ("headline", headline),
                           ("fit", fit_table), ("floor", floor_table)):
        command = sub.add_parser(name, allow_abbrev=False)
        command.add_argument("files", nargs="+", metavar="FILE")
        command.set_defaults(run=function)
    fits = sub.add_parser("fits", allow_abbrev=False)
    fits.add_argument("files", nargs="+", metavar="FILE")
    fits.set_defaults(run=lambda a: (fit_table(a), print(), maxbatch_table(a)))
    for name, function in (("variants", variants_table), ("zoo", zoo_table), ("maxbatch", maxbatch_table)):
        sub.add_parser(name, allow_abbrev=False).set_defaults(run=function, files=[])
    for name, function in (("validate", validate_table), ("published", published_table)):
        command = sub.add_parser(name, allow_abbrev=False)
        command.add_argument("directory", metavar="DIR")
        command.set_defaults(run=lambda a, f=function: f(a[0]), files=None)
    driver = sub.add_parser("driver", allow_abbrev=False)
    driver.add_argument("--costs", metavar="PROBE.json")
    driver.add_argument("--conf", metavar="KEY:VALUE,...")
    driver.add_argument("files", nargs="*", metavar="FILE")
    driver.set_defaults(run=driver_table)
    general = sub.add_parser("general", allow_abbrev=False)
    general.add_argument("--conf", metavar="KEY:VALUE,...")
    general.add_argument("--seed", type=int, default=1)
    general.add_argument("--draws", type=int, default=3)
    general.add_argument("files", nargs="*", metavar="FILE")
    general.set_defaults(run=general_table)
    steady = sub.add_parser("steady", allow_abbrev=False)
    steady.add_argument("--conf", metavar="KEY:VALUE,...")
    steady.set_defaults(run=steady_table, files=[])
    check = sub.add_parser("check", allow_abbrev=False)
    check.add_argument("docs", nargs="+", metavar="DOC")
    check.set_defaults(run=check_docs, files=[])
    return parser


def main():
    parser = make_parser()
    a = parser.parse_args()
    if a.command == "general" and a.draws < 0:
        parser.error("general: --draws must be 0 or more")
    if a.command == "check":
        args = a.docs
    elif a.files is None:
        args = [a.directory]
    elif a.command == "driver":
        args = (["--costs", a.costs] if a.costs else []) + (["--conf", a.conf] if a.conf else []) + a.files
    elif a.command == "steady":
        args = ["--conf", a.conf] if a.conf else []
    elif a.command == "general":
        args = (["--conf", a.conf] if a.conf else []) + ["--seed", str(a.seed), "--draws", str(a.draws)] + a.files
    else:
        args = a.files
    a.run(args)


if __name__ == "__main__":
    main()
