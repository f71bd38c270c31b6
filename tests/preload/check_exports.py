#!/usr/bin/env python3
"""Checks that the interposer's export lists agree (Note [One list of entry points], preload_driver.h).

  - every driver entry point of FRAGLESS_DRIVER_ENTRY_POINTS (torch_plugin/preload_driver.h, the list the
    dlsym and cuGetProcAddress tables are built from) is in torch_plugin/preload.map, and every driver
    symbol (cuXxx) of preload.map is in that list;
  - with LIBRARY: the symbols the built library defines in its dynamic table (nm -D --defined-only) are
    exactly preload.map's global ones (a name missing from the map is not exported, and a program linked
    against libcuda would silently call the driver's own).

Usage: check_exports.py REPO_ROOT [LIBRARY [NM]]   prints each disagreement; exit 1 if any.
"""
import os
import re
import subprocess
import sys


def map_symbols(path):
    text = re.sub(r"/\*.*?\*/", "", open(path).read(), flags=re.S)
    m = re.search(r"global:(.*?)local:", text, flags=re.S)
    if not m:
        sys.exit(f"{path}: no global: ... local: section")
    return {s.strip() for s in m.group(1).split(";") if s.strip()}


def listed_entry_points(path):
    text = open(path).read()
    m = re.search(r"#define FRAGLESS_DRIVER_ENTRY_POINTS\(X\)(.*?)\n\n", text, flags=re.S)
    if not m:
        sys.exit(f"{path}: no FRAGLESS_DRIVER_ENTRY_POINTS(X) list")
    return re.findall(r"\bX\((\w+),", m.group(1))


def exported_symbols(library, nm):
    out = subprocess.run([nm, "-D", "--defined-only", library], check=True, capture_output=True, text=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[-2] not in ("A",):  # absolute symbols are version nodes, not code
            names.add(parts[-1].split("@")[0])
    return names


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(argv) >= 2 else 2
    root = argv[1]
    map_path = os.path.join(root, "torch_plugin", "preload.map")
    list_path = os.path.join(root, "torch_plugin", "preload_driver.h")
    mapped = map_symbols(map_path)
    listed = listed_entry_points(list_path)
    problems = []
    dups = sorted({s for s in listed if listed.count(s) > 1})
    problems += [f"{s}: listed twice in FRAGLESS_DRIVER_ENTRY_POINTS" for s in dups]
    problems += [f"{s}: in FRAGLESS_DRIVER_ENTRY_POINTS, not in preload.map" for s in sorted(set(listed) - mapped)]
    problems += [f"{s}: a driver symbol in preload.map, not in FRAGLESS_DRIVER_ENTRY_POINTS"
                 for s in sorted(s for s in mapped - set(listed) if re.match(r"cu[A-Z]", s))]
    checked = f"{len(listed)} driver entry points, {len(mapped)} names in preload.map"
    if len(argv) >= 3:
        nm = argv[3] if len(argv) >= 4 else "nm"
        exported = exported_symbols(argv[2], nm)
        problems += [f"{s}: in preload.map, not defined in {os.path.basename(argv[2])}" for s in sorted(mapped - exported)]
        problems += [f"{s}: exported by {os.path.basename(argv[2])}, not in preload.map" for s in sorted(exported - mapped)]
        checked += f", {len(exported)} dynamic symbols of the library"
    for p in problems:
        print("FAIL:", p)
    print(f"{'FAIL' if problems else 'ok'}: {checked}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
