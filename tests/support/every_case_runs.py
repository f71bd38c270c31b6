#!/usr/bin/env python3
"""Every Catch2 case of fragless-tests runs in some CTest of the build.

  every_case_runs.py CTEST BUILD_DIR FRAGLESS_TESTS

The cases are what `FRAGLESS_TESTS --list-test-names-only` lists (hidden [.] cases, which other tests run in a
child process, are not listed). Each CTest that runs FRAGLESS_TESTS directly (`ctest --show-only=json-v1`) runs
the cases its test spec selects (a disabled CTest, or one that only lists or prints help, selects none); a case
no CTest selects runs in no tier, and fails this check by name. The
tiers' own filters (CTest labels, the sanitizer trees' regular expressions) are not this check's business: a
case is covered when the build registers it at all."""
import json
import os
import subprocess
import sys


# Catch2 options after which the binary runs no case at all (it lists, or prints its help).
NO_RUN = ("-h", "-?", "--help", "-l", "--list-tests", "-t", "--list-tags", "--list-test-names-only",
          "--list-reporters")


def names(tests, spec):
    p = subprocess.run([tests, "--list-test-names-only", *spec], capture_output=True, text=True)
    if p.returncode < 0:
        sys.exit(f"every_case_runs: {tests} --list-test-names-only {' '.join(spec)}: killed by signal {-p.returncode}")
    # Catch2 v2 exits with the number of cases listed; anything but a listing is a failure.
    if p.stderr.strip() or (not p.stdout.strip() and p.returncode != 0):
        sys.exit(f"every_case_runs: {tests} --list-test-names-only {' '.join(spec)} failed ({p.returncode}): "
                 f"{p.stderr.strip()}")
    return {line for line in p.stdout.splitlines() if line.strip()}


def disabled(test):
    return any(prop.get("name") == "DISABLED" and str(prop.get("value")).upper() in ("1", "ON", "TRUE", "YES", "Y")
               for prop in test.get("properties") or [])


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    ctest, build, tests = sys.argv[1:]
    p = subprocess.run([ctest, "--test-dir", build, "--show-only=json-v1"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"every_case_runs: ctest --show-only failed ({p.returncode}): {p.stderr.strip()}")
    every = names(tests, [])
    if not every:
        sys.exit(f"every_case_runs: {tests} lists no test case")
    covered, runners = set(), 0
    for t in json.loads(p.stdout)["tests"]:
        command = t.get("command") or []
        if not command or os.path.realpath(command[0]) != os.path.realpath(tests) or disabled(t):
            continue
        if any(a in NO_RUN for a in command[1:]):
            continue
        runners += 1
        args, spec, i = command[1:], [], 0
        while i < len(args):  # Catch2 options that take a value, then the test spec
            if args[i] in ("-w", "--warn", "-r", "--reporter", "-o", "--out", "--rng-seed", "-c", "--section"):
                i += 2
            elif args[i].startswith("-"):
                i += 1
            else:
                spec.append(args[i])
                i += 1
        covered |= names(tests, spec) if spec else every
    missing = sorted(every - covered)
    print(f"every_case_runs: {len(every)} cases, {runners} CTests run {os.path.basename(tests)}, "
          f"{len(every) - len(missing)} cases covered")
    for name in missing:
        print(f"  in no CTest: {name}")
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
