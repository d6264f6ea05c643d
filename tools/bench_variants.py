#!/usr/bin/env python3
"""Every variant's time per case, over several `deltaserve bench kernels` logs.

`bench kernels` times every registered variant of a family on each case and prints them in a
note line just before the case's row (the row times the variant the dispatch picked, last):

    wgmma_ws_lazy: 643 TFLOP/s, generic 34 TFLOP/s; wgmma_ws_lean 5791.54 us (570 TFLOP/s; ...); ...
  attn_prefill.wgmma_ws_lazy   q 16384 after 0 cached, 24q/4kv hd 256   5130.91 us  (...)

This collects, per case, every timing of every variant across the logs given (the pick's row
and the other variants' note entries), and prints a markdown table: each variant's median (us)
and its samples, and each variant's median against a reference variant's (--ref). A/B sessions
run the same bench several times with the dispatch switched (DS_DISABLE_KERNELS): the picked
variant then changes from log to log, and a variant switched off in a log has no timing there.

  python3 tools/bench_variants.py LOG [LOG ...] [--family attn_prefill] [--ref wgmma_ws_lean]
      [--variants a,b,c]

Exit status 1 when no case was found (a wrong family or not a bench kernels log).
"""
import argparse
import re
import statistics
import sys

# A note line: "<indent><pick>: <n> TFLOP/s..., generic ...; <variant> <t> us (...); ..."
NOTE = re.compile(r"^\s+([A-Za-z_][\w]*): .*?generic")
ENTRY = re.compile(r"(?:^|; )([A-Za-z_][\w]*) ([0-9]+(?:\.[0-9]+)?) us \(")
ROW_US = re.compile(r"\s([0-9]+(?:\.[0-9]+)?) us\b")


def parse(text, family):
    """{case: {variant: [us, ...]}} of one log, cases in the order first seen."""
    out = {}
    note = None
    row = re.compile(r"^\s+" + re.escape(family) + r"\.([\w]+)\s{2,}(.+?)\s{2,}")
    for line in text.splitlines():
        if line.startswith("=== "):  # the next process's log in a concatenated file
            note = None
            continue
        m = NOTE.match(line)
        if m:
            note = (m.group(1), line[m.end():])
            continue
        r = row.match(line)
        if not r:
            continue
        pick, case = r.group(1), r.group(2).strip()
        t = ROW_US.search(line, r.end(2))
        d = out.setdefault(case, {})
        if t:
            d.setdefault(pick, []).append(float(t.group(1)))
        if note and note[0] == pick:
            for v, us in ENTRY.findall(note[1]):
                d.setdefault(v, []).append(float(us))
        note = None
    return out


def merge(parsed):
    cases = {}
    for p in parsed:
        for case, d in p.items():
            c = cases.setdefault(case, {})
            for v, ts in d.items():
                c.setdefault(v, []).extend(ts)
    return cases


def table(cases, ref=None, variants=None):
    names = variants or sorted({v for d in cases.values() for v in d},
                               key=lambda v: min(statistics.median(d[v]) for d in cases.values()
                                                 if v in d))
    head = ["case"] + [f"{v} (us)" for v in names]
    if ref:
        head += [f"{v} vs {ref}" for v in names if v != ref]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, d in cases.items():
        cells = [case]
        for v in names:
            ts = d.get(v)
            cells.append(f"{statistics.median(ts):.1f} ({' / '.join(f'{t:.0f}' for t in ts)})"
                         if ts else "-")
        if ref:
            r = d.get(ref)
            for v in names:
                if v == ref:
                    continue
                ts = d.get(v)
                cells.append(f"{statistics.median(ts) / statistics.median(r) - 1:+.1%}"
                             if ts and r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--family", default="attn_prefill")
    ap.add_argument("--ref", help="the variant the others are compared with")
    ap.add_argument("--variants", help="comma-separated: these columns, in this order")
    a = ap.parse_args(argv)
    parsed = []
    for path in a.logs:
        with open(path, encoding="utf-8", errors="replace") as f:
            parsed.append(parse(f.read(), a.family))
    cases = merge(parsed)
    if not cases:
        print(f"bench_variants: no {a.family} case in {', '.join(a.logs)}", file=sys.stderr)
        return 1
    variants = a.variants.split(",") if a.variants else None
    if a.ref and variants and a.ref not in variants:
        variants.append(a.ref)
    print(table(cases, a.ref, variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
