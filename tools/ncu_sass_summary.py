#!/usr/bin/env python3
"""Summarise Nsight Compute's SASS source counters, kernel by kernel.

Input: the CSV that `ncu -i REPORT --page source --csv --print-source sass` prints (one block per
profiled kernel: a "Kernel Name" line, a header line starting with "Address", then one line per SASS
instruction). Output, per kernel: its SASS instruction count and how many never executed (code that
still has to be fetched: session 16 found a decode kernel 2x slower from that alone), the warp-stall
samples by reason (percent of the kernel's samples), and the instructions with the most samples and
their main reasons. Kernels that appear several times (one block per launch) are summarised once
per distinct name unless --all is given.

Usage: ncu_sass_summary.py SASS.csv [--top N] [--all]   (SASS.csv may be xz-compressed: *.xz)
Standard library only.
"""
import argparse
import collections
import csv
import io
import lzma
import sys


def read_blocks(text):
    """[(kernel name, header, rows)] from the CSV text."""
    blocks = []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            blocks.append([row[1] if len(row) > 1 else "?", None, []])
        elif blocks and row[0] == "Address":
            blocks[-1][1] = row
        elif blocks and blocks[-1][1] is not None:
            blocks[-1][2].append(row)
    return [tuple(b) for b in blocks if b[1] is not None]


def num(x):
    try:
        return float(x) if x not in ("", None) else 0.0
    except ValueError:
        return 0.0


def summarise(name, header, rows, top):
    col = {h: i for i, h in enumerate(header)}
    need = ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")
    missing = [h for h in need if h not in col]
    if missing:
        raise ValueError(f"kernel {name}: the CSV has no column {missing[0]!r} (was it made with "
                         "--page source --print-source sass and the SourceCounters section?)")
    i_src, i_smp, i_exe = (col[h] for h in need)
    stalls = [h for h in header if h.startswith("stall_") and "(" not in h]

    def cell(r, i):
        return r[i] if i < len(r) else ""

    total = sum(num(cell(r, i_smp)) for r in rows)
    never = sum(1 for r in rows if num(cell(r, i_exe)) == 0)
    by_reason = collections.Counter()
    for r in rows:
        for s in stalls:
            by_reason[s] += num(cell(r, col[s]))
    out = [f"{name}", f"  SASS instructions {len(rows)}, never executed {never}, stall samples "
                      f"{total:.0f}"]
    if total > 0:
        parts = [f"{s[6:]} {100 * v / total:.0f}%" for s, v in by_reason.most_common(8) if v > 0]
        out.append("  by reason: " + ", ".join(parts))
        ranked = sorted(range(len(rows)), key=lambda i: -num(cell(rows[i], i_smp)))[:top]
        for i in ranked:
            r = rows[i]
            smp = num(cell(r, i_smp))
            if smp <= 0:
                break
            why = sorted(((num(cell(r, col[s])), s[6:]) for s in stalls), reverse=True)[:2]
            why_s = ", ".join(f"{w} {v:.0f}" for v, w in why if v > 0)
            out.append(f"  #{i:<5d} {smp:6.0f}  {cell(r, i_src).strip()[:48]:<48s}  {why_s}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=10, help="instructions listed per kernel")
    ap.add_argument("--all", action="store_true", help="every launch, not one per kernel name")
    a = ap.parse_args(argv)
    opener = lzma.open if a.csv.endswith(".xz") else open
    with opener(a.csv, "rt", newline="") as f:
        blocks = read_blocks(f.read())
    if not blocks:
        print(f"{a.csv}: no kernel blocks (expected ncu --page source --csv output)", file=sys.stderr)
        return 1
    seen = set()
    for name, header, rows in blocks:
        if not a.all and name in seen:
            continue
        seen.add(name)
        try:
            print(summarise(name, header, rows, a.top))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
