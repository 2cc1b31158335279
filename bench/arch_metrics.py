#!/usr/bin/env python3
"""bench/arch_metrics.py [--max-file N] [--max-fn N]: the architecture issue's size
measures, per crate of the workspace.

- lines and files per crate (src/, tests/, benches/; Rust only);
- Rust files over --max-file lines (default 1200), tests included;
- functions over --max-fn lines (default 200): from a line declaring `fn NAME` to the first
  later line at the same indentation that starts with `}` (a declaration without a body is
  skipped);

Prints everything found and exits 1 when a file or a function is over its bound. Module
import cycles are the test passes/tests/module_cycles.rs (petgraph's SCCs, a ratchet):
`cargo test -p nnscaler-passes --test module_cycles -- --nocapture` prints them."""
import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["dialects", "passes", "runtime", "frontends", "tools", "plugin", "codegen", "rt"]
FN = re.compile(r"^(\s*)(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
                r"(?:extern\s+\"[^\"]*\"\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)")


def rust_files(crate):
    out = []
    for sub in ("src", "tests", "benches"):
        base = os.path.join(ROOT, crate, sub)
        for d, _, files in os.walk(base):
            out += [os.path.join(d, f) for f in files if f.endswith(".rs")]
    return sorted(out)


def long_functions(path, limit):
    lines = open(path, encoding="utf-8").read().split("\n")
    found = []
    for i, line in enumerate(lines):
        m = FN.match(line)
        if not m or line.rstrip().endswith(";"):
            continue
        indent = m.group(1)
        for j in range(i + 1, len(lines)):
            nxt = lines[j]
            if nxt.startswith(indent + "}") and not nxt.startswith(indent + " "):
                if j - i + 1 > limit:
                    found.append((m.group(2), i + 1, j - i + 1))
                break
            if nxt.strip() and not nxt.startswith(indent) and j > i + 1:
                break  # a signature without a body at this indentation
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-file", type=int, default=1200)
    ap.add_argument("--max-fn", type=int, default=200)
    a = ap.parse_args()
    bad = 0
    total_lines = total_files = 0
    print(f"{'crate':10} {'files':>6} {'lines':>8}")
    big, longf = [], []
    for c in CRATES:
        files = rust_files(c)
        lines = sum(len(open(p, encoding="utf-8").read().split("\n")) - 1 for p in files)
        total_lines += lines
        total_files += len(files)
        print(f"{c:10} {len(files):6} {lines:8}")
        for p in files:
            n = len(open(p, encoding="utf-8").read().split("\n")) - 1
            if n > a.max_file:
                big.append((n, os.path.relpath(p, ROOT)))
            for name, line, length in long_functions(p, a.max_fn):
                longf.append((length, f"{os.path.relpath(p, ROOT)}:{line} {name}"))
    print(f"{'all':10} {total_files:6} {total_lines:8}")
    print(f"\nfiles over {a.max_file} lines: {len(big)}")
    for n, p in sorted(big, reverse=True):
        print(f"  {n:6} {p}")
    print(f"functions over {a.max_fn} lines: {len(longf)}")
    for n, f in sorted(longf, reverse=True):
        print(f"  {n:6} {f}")
    bad |= bool(big) or bool(longf)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
