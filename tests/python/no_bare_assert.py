"""The Python tests check with checks.check(), never a bare `assert`: python -O (or PYTHONOPTIMIZE in the
environment) removes assert statements, which would turn every check into a pass. Fails naming each file
and line that starts an assert, in code or in the code strings the tests run in a child interpreter.
Usage: no_bare_assert.py DIR"""
import os
import re
import sys

ASSERT = re.compile(r"^\s*assert\b")


def main(folder):
    found = []
    names = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
    for name in names:
        with open(os.path.join(folder, name)) as f:
            for number, line in enumerate(f, 1):
                if ASSERT.match(line):
                    found.append("%s:%d: %s" % (name, number, line.strip()))
    for f in found:
        print("FAIL: a bare assert (use checks.check): " + f)
    if not names:
        print("FAIL: no Python files in " + folder)
        return 1
    print("%d file(s), %d bare assert(s)" % (len(names), len(found)))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
