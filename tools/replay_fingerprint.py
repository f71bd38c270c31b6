#!/usr/bin/env python3
"""The replay's answers on every built-in workload and every real trace, without its timings.

A change that claims to keep behaviour (a restructuring, a refactor) keeps this file byte for byte:

  replay_fingerprint.py BIN_DIR OUT.json                 write the fingerprint
  replay_fingerprint.py BIN_DIR OUT.json --against OLD   write it and compare with OLD; exit 1 on a
                                                         difference, naming the input, policy and field

Inputs: each workload fragless-replay --help lists (at its defaults) and each file under
../shared/data/traces/torch (when that folder is beside the checkout; said when it is not). Every policy.
Removed before comparing: the fields that measure the machine rather than the allocator (replay_seconds,
events_per_second). Everything else, the modelled driver times included, is deterministic.
"""
import json
import os
import re
import subprocess
import sys

TIMING = {"replay_seconds", "events_per_second"}


def workloads(replay):
    usage = subprocess.run([replay, "--help"], capture_output=True, text=True, check=True).stdout
    names = []
    for line in usage.split("\n"):
        m = re.match(r"^  ([a-z][a-z0-9-]*(?:, [a-z][a-z0-9-]*)*):", line)
        if m:
            names += m.group(1).split(", ")
    if not names:
        sys.exit("replay_fingerprint: fragless-replay --help lists no workload (its format changed?)")
    return [f"workload:{n}" for n in names]


def traces(root):
    folder = os.path.join(root, "..", "shared", "data", "traces", "torch")
    if not os.path.isdir(folder):
        print("replay_fingerprint: no ../shared/data/traces/torch beside the checkout: workloads only")
        return []
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if not f.startswith("."))


def strip(value):
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def fingerprint(replay, inputs):
    rows = {}
    for inp in inputs:
        run = subprocess.run([replay, "--json", inp], capture_output=True, text=True)
        if run.returncode == 2 and "nothing to replay" in run.stderr:  # an input without history: no rows
            continue
        if run.returncode != 0:
            sys.exit(f"replay_fingerprint: fragless-replay {inp} exited {run.returncode}: {run.stderr.strip()}")
        for r in json.loads(run.stdout)["results"]:
            key = f"{os.path.basename(r['input'])} | device {r['device']} | {r['policy']}"
            row = strip(r)
            row["input"] = os.path.basename(row["input"])  # where the checkout is is not behaviour
            rows[key] = row
    return rows


def compare(new, old):
    problems = []
    for key in sorted(set(new) | set(old)):
        if key not in new or key not in old:
            problems.append(f"{key}: only in the {'old' if key in old else 'new'} fingerprint")
            continue
        for field in sorted(set(new[key]) | set(old[key])):
            a, b = old[key].get(field), new[key].get(field)
            if a != b:
                problems.append(f"{key}: {field} was {json.dumps(a)}, is {json.dumps(b)}")
    return problems


def main(argv):
    if len(argv) not in (3, 5) or (len(argv) == 5 and argv[3] != "--against"):
        sys.exit(__doc__)
    replay = os.path.join(argv[1], "fragless-replay")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    inputs = workloads(replay) + traces(root)
    rows = fingerprint(replay, inputs)
    with open(argv[2], "w") as f:
        json.dump(rows, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"replay_fingerprint: {len(inputs)} inputs, {len(rows)} rows written to {argv[2]}")
    if len(argv) == 5:
        with open(argv[4]) as f:
            old = json.load(f)
        for row in old.values():
            row["input"] = os.path.basename(row["input"])
        problems = compare(rows, old)
        for p in problems[:50]:
            print(p)
        print(f"replay_fingerprint: {len(problems)} difference(s) from {argv[4]}")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
