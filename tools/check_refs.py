#!/usr/bin/env python3
"""Checks that what a comment names exists in the tree.

  - a file named in a comment (`engine.cpp`, `allocator/formats/pickle.h`) is a tracked file: a path is a
    tracked file's path or the tail of one, a bare name any tracked file's name; in the docs, every path, or one of the outside files listed in OUTSIDE (CUDA's and PyTorch's), or lies under ../shared
    (`reference/...`, `data/...`);
  - a section named as `docs/NAME.md, "Heading"` (in code or in the docs) is a heading of that document;
  - every `Note [Title]` that is referred to is defined somewhere: a comment (or a docs line) that starts
    with `Note [Title]` alone or followed by ':'.

Usage: check_refs.py [REPO_ROOT]   prints every broken reference with its file and line; exit 1 if any.
"""
import os
import re
import subprocess
import sys

# Files outside this tree that comments name on purpose.
OUTSIDE = {
    "cuda.h",                      # CUDA's driver API header (its doc comments are the contract's source)
    "cuda_runtime_api.h",          # CUDA's runtime API header (the same, for the runtime calls interposed)
    "MemoryViz.js",                # PyTorch's memory viewer (torch/utils/viz)
    "CUDACachingAllocator.cpp",    # PyTorch's allocator
    "CUDACachingAllocator.h",
    "CUDAPluggableAllocator.cpp",
    "reductions.py",               # torch/multiprocessing/reductions.py
}
OUTSIDE_PREFIXES = ("c10/", "torch/", "aten/")  # PyTorch's own headers and modules
CODE = re.compile(r"\.(cpp|h|cu|py|sh|txt|cmake)$|(^|/)run$")
FILE_REF = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:cpp|h|py|sh|cu|md|map|js))\b")
SECTION_REF = re.compile(r'docs/([A-Z]+\.md),? "([^"]+)"')
NOTE = re.compile(r"Note \[([^\]]+)\]")
NOTE_DEF = re.compile(r"^\s*(?://|#|\*|-)?\s*Note \[([^\]]+)\](?::|\s*$)")


def comment_of(path, line):
    """The comment part of a line of code (after // or #), or None."""
    marker = "//" if re.search(r"\.(cpp|h|cu)$", path) else "#"
    i = line.find(marker)
    return None if i < 0 else line[i + len(marker):]


def headings(root, doc):
    try:
        with open(os.path.join(root, "docs", doc), encoding="utf-8") as f:
            return {l.lstrip("#").strip() for l in f if l.startswith("#")}
    except OSError:
        return None


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    try:
        files = subprocess.check_output(["git", "-C", root, "ls-files"], text=True,
                                        stderr=subprocess.DEVNULL).split()
    except (OSError, subprocess.CalledProcessError):
        print(f"check_refs: SKIPPED: {root} is not a git checkout (the tracked files are what is checked)")
        return 77
    known = set(files) | {os.path.basename(f) for f in files}
    shared = os.path.join(root, "..", "shared")
    problems, notes_used, notes_defined, docs = [], {}, set(), {}
    for rel in files:
        is_doc = rel.endswith(".md")
        if not (is_doc or CODE.search(rel)):
            continue
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                lines = f.read().split("\n")
        except (OSError, UnicodeDecodeError):
            continue
        for n, line in enumerate(lines, 1):
            text = line if is_doc else comment_of(rel, line)
            if text is None:
                continue
            where = f"{rel}:{n}"
            m = NOTE_DEF.match(text)
            if m:
                notes_defined.add(m.group(1))
            for title in NOTE.findall(text):
                notes_used.setdefault(title, where)
            for doc, section in SECTION_REF.findall(text):
                if doc not in docs:
                    docs[doc] = headings(root, doc)
                if docs[doc] is None:
                    problems.append(f"{where}: names docs/{doc}, which does not exist")
                elif section not in docs[doc]:
                    problems.append(f'{where}: names section "{section}" of docs/{doc}, which has no such heading')
            for ref in FILE_REF.findall(text):
                if is_doc and "/" not in ref:
                    continue  # the docs name files by path; a bare name there is prose
                if ref in OUTSIDE or ref.startswith(OUTSIDE_PREFIXES):
                    continue
                # A path is a tracked file's path or its tail (`policy/fragless/policy.cpp`); a bare name is any
                # tracked file's name.
                if ref in known if "/" not in ref else (ref in files or any(f.endswith("/" + ref) for f in files)):
                    continue
                if re.match(r"[A-Z_]+/|gpu-bundle/", ref):  # a placeholder or built folder (OUT/..., the GPU bundle)
                    continue
                if os.path.exists(os.path.join(shared, ref)):
                    continue
                if not os.path.isdir(shared) and ref.startswith(("reference/", "data/")):
                    continue  # ../shared is not beside this checkout: its files cannot be checked
                problems.append(f"{where}: names {ref}, which is not in the tree")
    for title, where in sorted(notes_used.items()):
        if title not in notes_defined:
            problems.append(f"{where}: refers to Note [{title}], which nothing defines")
    for p in problems:
        print(p)
    print(f"check_refs: {len(files)} tracked files, {len(notes_used)} notes, {len(problems)} broken reference(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
