#!/usr/bin/env python3
"""Numerical error of two chunked forms of the GDN prompt rule, against the fp64 token recurrence.

The CUDA prompt path (src/cuda/gdn_prefill_sm90.cu + gdn_prefill_slice.cu) forms W = T (beta e^gamma
K) and U = T (beta V) in bf16 and then V_new = U - W h per chunk. A fused kernel in FlashInfer's
layout (docs/perf/gdn_prefill.md, session 21) never forms W and U: it applies T diag(beta) to
(V - e^gamma K h). The two are equal in exact arithmetic and round at different points. This tool
emulates both with bf16 rounding where the kernels round (numpy, fp32 accumulation) on random
Qwen3.5-27B-like heads (d_k = d_v = 128, 64-token chunks) and prints the error of the outputs and of
the final state of each against the fp64 recurrence, so that a fused kernel can be gated by a
stated tolerance.

    python3 tools/gdn_chunk_precision.py [--tokens 4096] [--heads 4] [--seed 0]
"""
import argparse
import sys

import numpy as np

CHUNK = 64


def bf16(x):
    """x rounded to bfloat16 (round to nearest even), returned as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return r.view(np.float32)


def make_head(rng, n_tokens, d):
    """One head's bf16 q, k (l2-normalised, q scaled by d^-1/2), v and fp32 gates g, beta."""
    q = rng.standard_normal((n_tokens, d))
    k = rng.standard_normal((n_tokens, d))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    q = bf16(q / np.sqrt(d))
    k = bf16(k)
    v = bf16(0.5 * rng.standard_normal((n_tokens, d)))
    # Qwen3.5's gate: g = -exp(A_log) softplus(a + dt_bias), A = exp(A_log) in (0, 16], dt from
    # the log-uniform init; beta = sigmoid(b).
    a_log = np.log(rng.uniform(1.0, 16.0))
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1)))
    dt_bias = dt + np.log(-np.expm1(-dt))
    a = rng.standard_normal(n_tokens)
    g = (-np.exp(a_log) * np.logaddexp(0.0, a + dt_bias)).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal(n_tokens)))).astype(np.float32)
    return q, k, v, g, beta


def recurrence(q, k, v, g, beta):
    """fp64 token by token: S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q. S is [d_k, d_v]."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    s = np.zeros((k.shape[1], v.shape[1]))
    o = np.empty_like(v)
    for t in range(len(g)):
        s *= np.exp(g[t])
        s += np.outer(k[t], beta[t] * (v[t] - s.T @ k[t]))
        o[t] = s.T @ q[t]
    return o, s


def chunked(q, k, v, g, beta, fused):
    """The chunked rule with the kernels' rounding points; fused=False: V_new = U - W h (today's
    kernels), fused=True: V_new = T diag(beta) (V - e^gamma K h) (FlashInfer's order)."""
    n, dk = k.shape
    h = np.zeros((dk, v.shape[1]), np.float32)
    o = np.empty(v.shape, np.float32)
    for c0 in range(0, n, CHUNK):
        sl = slice(c0, min(c0 + CHUNK, n))
        qc, kc, vc, bc = q[sl], k[sl], v[sl], beta[sl]
        m = len(bc)
        gam = np.cumsum(g[sl], dtype=np.float32)
        # e^(gamma_i - gamma_j) on and below the diagonal only (above it the exponent is positive
        # and may overflow: the kernels mask before the exp)
        on_below = np.tril(np.ones((m, m), dtype=bool))
        decay = np.exp(np.where(on_below, gam[:, None] - gam[None, :], -np.inf)).astype(np.float32)
        lower = np.tril(np.ones((m, m), np.float32), -1)
        a = (bc[:, None] * (kc @ kc.T) * decay * lower).astype(np.float32)
        t = np.linalg.inv(np.eye(m, dtype=np.float32) + a).astype(np.float32)
        hb = bf16(h)  # the snapshot h_c, the bf16 operand of every product with h
        if fused:
            vp = bf16(vc - np.exp(gam)[:, None] * (kc @ hb))
            v_new = bf16(bf16(t * bc[None, :]) @ vp)
        else:
            # (the WY kernel's T fragments carry the column scales: bf16(T diag(s)) times K / V)
            w = bf16(bf16(t * (bc * np.exp(gam))[None, :]) @ kc)
            u = bf16(bf16(t * bc[None, :]) @ vc)
            v_new = bf16(u - w @ hb)
        p = bf16((qc @ kc.T) * decay)
        o[sl] = np.exp(gam)[:, None] * (qc @ hb) + p @ v_new
        vs = bf16(v_new * np.exp(gam[-1] - gam)[:, None])
        h = (np.exp(gam[-1]) * h + kc.T @ vs).astype(np.float32)
    return o, h


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run(n_tokens, n_heads, seed, out=sys.stdout):
    """Per head and form: relative L2 error and max abs error of o and of the final state."""
    rng = np.random.default_rng(seed)
    rows = []
    for head in range(n_heads):
        q, k, v, g, beta = make_head(rng, n_tokens, 128)
        o_ref, s_ref = recurrence(q, k, v, g, beta)
        got = {}
        for fused in (False, True):
            o, s = chunked(q, k, v, g, beta, fused)
            got[fused] = (o, s)
            rows.append({"head": head, "form": "T(V - K h)" if fused else "U - W h",
                         "o_rel": rel(o, o_ref), "o_max": float(np.abs(o - o_ref).max()),
                         "o_ref_max": float(np.abs(o_ref).max()),
                         "s_rel": rel(s, s_ref), "s_max": float(np.abs(s - s_ref).max())})
        # The two forms against each other: what a test of the fused kernel against today's
        # path sees, before the gated norm (session 34's flash form and its test, removed in
        # session 36: docs/perf/gdn_prefill.md).
        rows[-1]["o_vs_unfused"] = rel(got[True][0], got[False][0])
        rows[-1]["s_vs_unfused"] = rel(got[True][1], got[False][1])
    print(f"{n_tokens} tokens, {n_heads} heads, seed {seed}: error against the fp64 recurrence",
          file=out)
    print(f"{'head':>4} {'form':>12} {'o rel L2':>10} {'o max abs':>10} {'of max':>8} "
          f"{'state rel':>10} {'state max':>10}", file=out)
    for r in rows:
        print(f"{r['head']:>4} {r['form']:>12} {r['o_rel']:10.2e} {r['o_max']:10.2e} "
              f"{r['o_ref_max']:8.3f} {r['s_rel']:10.2e} {r['s_max']:10.2e}", file=out)
    print("the fused form against U - W h (relative L2): "
          + ", ".join(f"head {r['head']} o {r['o_vs_unfused']:.2e} state {r['s_vs_unfused']:.2e}"
                      for r in rows if "o_vs_unfused" in r), file=out)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.tokens < 1 or a.heads < 1:
        ap.error("--tokens and --heads must be at least 1")
    run(a.tokens, a.heads, a.seed)


if __name__ == "__main__":
    main()
