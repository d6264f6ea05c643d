#!/usr/bin/env python3
"""Each role of an in-graph decode profile against its bytes at a read ceiling.

Reads the log `cuda_decode_profile_test` (DS_PROFILE=1) prints (parsed by profile_diff.py) and,
for each profiled configuration ("batch 1 ctx 4096, fused_norm on [graph]"), sets every role's
advance per launch against the time its bytes take at the read ceiling given (the same machine's
`bench ceilings` / `bench all` streaming read, TB/s). Prints the roles ordered by what they lose
per step, the sum of their floors and the span, so that a step's distance to its floor is split
by role without hand arithmetic (decode_gemv.md, "Session 30" and "Session 33" did it by hand):

    python3 tools/profile_floor.py inprof_4096.txt --read-tbps 4.61
    python3 tools/profile_floor.py inprof_4096.txt --read-tbps 4.61 --config "fused_norm on"

The bytes are those of the synthetic Qwen3.5-27B the profile test runs (SHAPES below): every
projection's bf16 weight once per launch whatever the batch; the attention split the cached K and
V of its layer (batch x context x kv heads x head_dim x 2 x 2 bytes; the merge none); gdn_decode
its recurrent state read and written in fp32. Roles with no bytes here (norms, argmax, gathers,
the merge) count their whole advance as lost. The floors are computed, not measured: the report
says what a role would take at the ceiling, not what it can reach.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_diff  # noqa: E402

# Qwen3.5-27B (../shared/SPEC.md; the engine's synthetic "27b" config).
SHAPES = {
    "27b": dict(d_model=5120, d_ff=17408, vocab=248320, n_heads=24, n_kv_heads=4, head_dim=256,
                n_v_heads=48, n_k_heads=16, d_k=128, d_v=128),
}

# "batch 1 ctx 4096, fused_norm on [graph]"
CFG = re.compile(r"batch (\d+) ctx (\d+)")


def role_bytes(role, batch, ctx, s):
    """Bytes one launch of `role` ("gate_up+silu: gemv_bulk_silu+norm") must move, or 0."""
    name = role.split(":")[0].strip()
    d = s["d_model"]
    q_dim = s["n_heads"] * s["head_dim"]
    kv_dim = s["n_kv_heads"] * s["head_dim"]
    gdn_qkv = 2 * s["n_k_heads"] * s["d_k"] + s["n_v_heads"] * s["d_v"]
    gdn_z = s["n_v_heads"] * s["d_v"]
    weights = {
        "gate_up": 2 * s["d_ff"] * d,
        "gate_up+silu": 2 * s["d_ff"] * d,
        "down": s["d_ff"] * d,
        "gdn_in": (gdn_qkv + gdn_z + 2 * s["n_v_heads"]) * d,  # [qkv | z | b | a]
        "gdn_out": d * gdn_z,
        "attn_qkv": (2 * q_dim + 2 * kv_dim) * d,  # [q | gate] per head, k, v
        "attn_o": d * q_dim,
        "lm_head": s["vocab"] * d,
    }
    if name in weights:
        return 2 * weights[name]
    if name == "attn_split":
        return batch * ctx * kv_dim * 2 * 2
    if name == "gdn_decode":
        return batch * s["n_v_heads"] * s["d_v"] * s["d_k"] * 4 * 2
    return 0


def report(cfg, prof, read_tbps, shapes):
    m = CFG.search(cfg)
    if not m:
        raise SystemExit(f"profile_floor: no 'batch B ctx C' in the configuration '{cfg}'")
    batch, ctx = int(m.group(1)), int(m.group(2))
    rows = []
    for role, (n, adv_ms) in prof["roles"].items():
        if "@" in role or n <= 0:  # the by-layer-kind rows repeat the roles
            continue
        adv_us = adv_ms * 1e3 / n
        floor_us = role_bytes(role, batch, ctx, shapes) / (read_tbps * 1e12) * 1e6
        rows.append((role, n, adv_us, floor_us, (adv_us - floor_us) * n / 1e3))
    rows.sort(key=lambda r: -r[4])
    floors = sum(r[3] * r[1] for r in rows) / 1e3
    lost = sum(r[4] for r in rows)
    out = [f"{cfg}: span {prof['span']:.3f} ms, {prof['kernels']} kernels per step; "
           f"floors at {read_tbps:.2f} TB/s",
           f"| role | launches | adv us per launch | floor us | lost per step ms |",
           "|---|---|---|---|---|"]
    for role, n, adv, fl, ls in rows:
        out.append(f"| {role} | {n:.0f} | {adv:.2f} | {fl:.2f} | {ls:.3f} |")
    out.append(f"sum of the roles' floors {floors:.3f} ms, of their losses {lost:.3f} ms; "
               f"span - floors {prof['span'] - floors:.3f} ms (the advances sum to the span, so "
               f"the two agree up to the table's rounding)")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--read-tbps", type=float, required=True,
                   help="the streaming-read ceiling of the same machine, TB/s")
    p.add_argument("--config", help="substring naming one configuration (default: every one)")
    p.add_argument("--model", default="27b", choices=sorted(SHAPES))
    args = p.parse_args(argv)
    if not args.read_tbps > 0:
        raise SystemExit(f"profile_floor: --read-tbps must be positive, got {args.read_tbps}")
    prof = profile_diff.parse(open(args.log, encoding="utf-8", errors="replace").read())
    if not prof:
        raise SystemExit(f"profile_floor: no 'PROFILE ... kernels per step' table in {args.log}")
    cfgs = [profile_diff.pick(prof, args.config)] if args.config else list(prof)
    for cfg in cfgs:
        print(report(cfg, prof[cfg], args.read_tbps, SHAPES[args.model]))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
