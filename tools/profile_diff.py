#!/usr/bin/env python3
"""Compare the in-graph decode profiles of two runs role by role.

Reads the logs that `cuda_decode_profile_test` (DS_PROFILE=1) prints: for each profiled
configuration ("batch 1 ctx 4096, fused_norm on [graph]") its span, its per-role table
(launches, mean duration, gap and advance per launch, and their totals per step) and, since
session 23, the same roles split by layer kind ("... by layer kind:", roles suffixed @attn /
@gdn). Prints, for every configuration present in both logs (or the pair named with --a / --b),
each role's advance per step in A and B and the difference, largest first, so that where two
contexts, builds or switches differ is one table:

    python3 tools/profile_diff.py inprof_4096.log inprof_8192.log
    python3 tools/profile_diff.py run.log run.log --a "ctx 4096, fused_norm on" \\
        --b "ctx 8192, fused_norm on"
"""
import argparse
import re
import sys

# "PROFILE batch 1 ctx 4096, fused_norm on [graph]: 341 kernels per step, in-graph span 12.530 ms"
HEAD = re.compile(r"^PROFILE (.+?): (\d+) kernels per step, in-graph span ([0-9.]+) ms")
KIND = re.compile(r"^PROFILE (.+?) by layer kind:$")
# "PROFILE gate_up+silu: gemv_bulk_silu+norm     64     89.39     -6.03     83.36      5.721      5.335"
ROW = re.compile(r"^PROFILE\s+(\S.*?)\s+(\d+)\s+(-?[0-9.]+)\s+(-?[0-9.]+)\s+(-?[0-9.]+)"
                 r"\s+(-?[0-9.]+)\s+(-?[0-9.]+)$")


def parse(text):
    """{config: {"span": ms, "kernels": n, "roles": {role: (n, adv_ms)}}}"""
    out = {}
    cur = None
    kind_of = None
    for line in text.splitlines():
        line = line.rstrip()
        m = HEAD.match(line)
        if m:
            cur = m.group(1)
            kind_of = None
            out[cur] = {"span": float(m.group(3)), "kernels": int(m.group(2)), "roles": {}}
            continue
        m = KIND.match(line)
        if m and m.group(1) in out:
            kind_of = m.group(1)
            cur = kind_of
            continue
        if line.startswith("PROFILE ") and "first" in line and "kernels" in line:
            cur = None  # the per-kernel listing of one step follows: not a role table
            continue
        m = ROW.match(line)
        if m and cur is not None and cur in out:
            role = m.group(1).strip()
            if role.startswith("role:"):
                continue
            out[cur]["roles"][role] = (float(m.group(2)), float(m.group(7)))
    return out


def pick(cfgs, want):
    hits = [c for c in cfgs if want in c]
    if len(hits) != 1:
        raise SystemExit(f"profile_diff: '{want}' matches {len(hits)} configurations: "
                         f"{sorted(cfgs)}")
    return hits[0]


def table(name_a, a, name_b, b):
    lines = [f"A: {name_a}: span {a['span']:.3f} ms, {a['kernels']} kernels per step",
             f"B: {name_b}: span {b['span']:.3f} ms, {b['kernels']} kernels per step",
             f"B - A: {b['span'] - a['span']:+.3f} ms",
             f"{'role':44s} {'n A':>5s} {'n B':>5s} {'adv A ms':>9s} {'adv B ms':>9s} "
             f"{'B - A':>8s}"]
    roles = sorted(set(a["roles"]) | set(b["roles"]),
                   key=lambda r: -abs(b["roles"].get(r, (0, 0))[1] - a["roles"].get(r, (0, 0))[1]))
    for r in roles:
        na, aa = a["roles"].get(r, (0, 0.0))
        nb, ab = b["roles"].get(r, (0, 0.0))
        lines.append(f"{r:44s} {na:5.0f} {nb:5.0f} {aa:9.3f} {ab:9.3f} {ab - aa:+8.3f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log_a")
    p.add_argument("log_b")
    p.add_argument("--a", help="substring naming log A's configuration")
    p.add_argument("--b", help="substring naming log B's configuration")
    args = p.parse_args(argv)
    pa = parse(open(args.log_a, encoding="utf-8", errors="replace").read())
    pb = parse(open(args.log_b, encoding="utf-8", errors="replace").read())
    if not pa or not pb:
        raise SystemExit("profile_diff: no 'PROFILE ... kernels per step' table in "
                         + (args.log_a if not pa else args.log_b))
    if args.a or args.b:
        pairs = [(pick(pa, args.a or args.b), pick(pb, args.b or args.a))]
    else:
        # the same configuration text with the context number removed
        norm = lambda c: re.sub(r"ctx \d+", "ctx *", c)  # noqa: E731
        bkeys = {norm(c): c for c in pb if not c.endswith(" by layer kind")}
        pairs = [(c, bkeys[norm(c)]) for c in pa if norm(c) in bkeys]
        if not pairs:
            raise SystemExit("profile_diff: no configuration in both logs; name them with "
                             "--a / --b")
    for ca, cb in pairs:
        print(table(ca, pa[ca], cb, pb[cb]))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
