#!/usr/bin/env python3
"""Checks the layering rules of docs/ARCHITECTURE.md ("Layers") against the tree.

  1. allocator/src has one folder per layer, lowest first: base, driver, trace, state, policy, engine, and
     the top (allocator.cpp, at the root of allocator/src). A file includes the public headers
     (fragless/...) and private headers of its own layer or of a lower one, never of a higher one.
  2. Nothing outside allocator/ and tests/ includes a private header of allocator/src.
  3. Nothing in allocator/ or torch_plugin/ includes a header under tools/; tools/ holds no library
     (no header).
  4. No file in allocator/ is over 600 lines.

Usage: check_layers.py [REPO_ROOT]   prints every broken rule with its file and line; exit 1 if any.
"""
import os
import re
import subprocess
import sys

LAYERS = ["base", "driver", "trace", "state", "policy", "engine", ""]  # "" is the top: allocator/src itself
MAX_LINES = 600
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(path):
    """The layer of a file under allocator/src ("" for the top), or None when it is in no known folder."""
    rel = os.path.relpath(path, "allocator/src")
    first = rel.split("/")[0] if "/" in rel else ""
    return first if first in LAYERS else None


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    os.chdir(root)
    try:
        files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        print(f"check_layers: SKIPPED: {os.getcwd()} is not a git checkout (the tracked files are what is checked)")
        return 77
    private = {f[len("allocator/src/"):] for f in files if f.startswith("allocator/src/") and f.endswith(".h")}
    problems = []
    for f in files:
        if f.startswith("allocator/") and f.endswith((".cpp", ".h", ".txt")):
            with open(f, errors="replace") as fh:
                n = sum(1 for _ in fh)
            if n > MAX_LINES:
                problems.append(f"{f}: {n} lines, over {MAX_LINES}")
        if f.startswith("tools/") and f.endswith(".h"):
            problems.append(f"{f}: a header under tools/ (tools/ holds programs and scripts only)")
        if f.startswith("allocator/src/") and layer_of(f) is None:
            problems.append(f"{f}: in no layer folder ({', '.join(l for l in LAYERS if l)} or the top)")
        if not f.endswith((".cpp", ".h", ".cu")):
            continue
        with open(f, errors="replace") as fh:
            lines = fh.read().split("\n")
        for i, line in enumerate(lines, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            inc = m.group(1)
            where = f"{f}:{i}"
            if f.startswith("allocator/src/"):
                mine = layer_of(f)
                if inc in private:
                    theirs = layer_of("allocator/src/" + inc)
                    if mine is not None and theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                        problems.append(f"{where}: layer '{mine or 'top'}' includes {inc} of the higher layer "
                                        f"'{theirs or 'top'}'")
                elif not inc.startswith("fragless/"):
                    problems.append(f"{where}: includes \"{inc}\", neither a public header (fragless/...) nor a "
                                    "private one by its path under allocator/src")
            elif not f.startswith(("allocator/", "tests/")) and inc in private:
                problems.append(f"{where}: includes {inc}, a private header of allocator/src")
            if f.startswith(("allocator/", "torch_plugin/")) and (inc.startswith("tools/") or
                                                                 os.path.exists(os.path.join("tools", inc))):
                problems.append(f"{where}: includes {inc}, a header under tools/")
    print("\n".join(problems + [f"check_layers: {len(files)} tracked files, {len(problems)} broken rule(s)"]))
    return 1 if problems else 0


sys.exit(main(sys.argv) if __name__ == "__main__" else 0)
