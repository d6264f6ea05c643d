#!/usr/bin/env python3
"""The prompt-attention kernels' online softmax emulated in numpy, to size the tolerance of
attn_prefill.wgmma_ws_lazy's test (tests/cuda/cuda_attention_test.cpp, check_mma_variants).

Two forms of the per-row softmax over 64-key tiles, with the kernels' roundings:
  standard (wgmma_m128 / wgmma_ws*, softmax_tile): v = s * c in fp32, m = the running max of v,
      p = exp2(v - m) in fp32, P rounded to bf16 for P V, l += p (fp32, unrounded), O = O alpha +
      P V in fp32 whenever m moves;
  lazy (wgmma_ws_lazy, softmax_tile_lazy): m raised only when a tile's max c * max(s) exceeds it
      by more than tau, p = exp2(fma(s, c, -m)) (one rounding), the rest as above.
Both give O / l rounded to bf16 (the gate is left out: it scales both alike). The reference is
fp64. Inputs as the test's fixtures draw them: q ~ N(0, 1.5^2), k, v ~ N(0, 1), head dim 256,
bf16; queries bottom-right aligned against kv_len keys (query j of q_len sits at kv_len - q_len + j).

  python3 tools/attn_lazy_precision.py [--fixtures N] [--seed S]

prints, per fixture, each form's normalised error (||got - ref|| / ||ref||, test::norm_err) and
the two forms' distance; the summary gives the largest lazy / standard error ratio and the
largest distance, the numbers the test's bounds (ratio <= 1.5 plus 1e-4, distance < 5e-3) must
clear.
"""
import argparse

import numpy as np

HD = 256
TILE = 64
C = np.float32(0.0625 * 1.4426950408889634)  # 1/sqrt(256) * log2(e), as kScaleLog2
TAU = 8.0


def bf16(x):
    """Round float32 values to the nearest bf16 (ties to even), returned as float32."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    out = r.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(a), out, a)


def softmax_rows(s, v, n_keys, lazy):
    """O (fp32, before the bf16 store) of rows with scores s [rows, kv] (fp32) and values v
    [kv, HD] (bf16 values in fp32); row r sees keys 0 .. n_keys[r] - 1."""
    rows, kv = s.shape
    o = np.zeros((rows, HD), np.float32)
    m = np.full(rows, -np.inf, np.float32)
    l = np.zeros(rows, np.float32)
    key = np.arange(kv)
    with np.errstate(invalid="ignore", over="ignore"):
        for t0 in range(0, int(n_keys.max()), TILE):
            t1 = min(t0 + TILE, kv)
            st = s[:, t0:t1].copy()
            st[key[None, t0:t1] >= n_keys[:, None]] = -np.inf
            if lazy:
                ms = (np.max(st, axis=1) * C).astype(np.float32)
                mn = np.where(ms > m + np.float32(TAU), ms, m)
                arg = (st.astype(np.float64) * np.float64(C) -
                       np.where(np.isfinite(mn), mn, 0.0)[:, None]).astype(np.float32)
            else:
                sv = (st * C).astype(np.float32)
                mn = np.maximum(m, np.max(sv, axis=1))
                arg = (sv - np.where(np.isfinite(mn), mn, 0).astype(np.float32)[:, None])
            alpha = np.exp2(m - np.where(np.isfinite(mn), mn, 0)).astype(np.float32)
            alpha = np.where(np.isfinite(m) | np.isfinite(mn), alpha, 0).astype(np.float32)
            p = np.exp2(arg).astype(np.float32)
            p = np.where(np.isfinite(arg), p, 0).astype(np.float32)
            o = o * alpha[:, None] + bf16(p) @ v[t0:t1]
            l = l * alpha + p.sum(axis=1, dtype=np.float32)
            m = mn
    return o / l[:, None]


def fixture(rng, q_len, kv_len, rows_max=96):
    q = bf16(rng.normal(0, 1.5, (q_len, HD)).astype(np.float32))
    k = bf16(rng.normal(0, 1.0, (kv_len, HD)).astype(np.float32))
    v = bf16(rng.normal(0, 1.0, (kv_len, HD)).astype(np.float32))
    pick = np.unique(np.concatenate([[0, q_len - 1], rng.integers(0, q_len, rows_max)]))
    pick = pick[:rows_max]
    n_keys = kv_len - q_len + pick + 1
    s32 = (q[pick] @ k.T).astype(np.float32)
    s64 = q[pick].astype(np.float64) @ k.T.astype(np.float64)
    key = np.arange(kv_len)
    s64[key[None, :] >= n_keys[:, None]] = -np.inf
    w = np.exp((s64 - s64.max(axis=1, keepdims=True)) / 16.0)
    ref = (w @ v.astype(np.float64)) / w.sum(axis=1, keepdims=True)
    std = bf16(softmax_rows(s32, v, n_keys, lazy=False))
    lazy = bf16(softmax_rows(s32, v, n_keys, lazy=True))
    return ref, std, lazy


def norm_err(a, ref):
    return float(np.sqrt(((a.astype(np.float64) - ref) ** 2).sum() / max((ref ** 2).sum(), 1e-30)))


CASES = [(1, 1), (63, 63), (65, 65), (64, 101), (200, 1300), (512, 4096), (300, 8191),
         (21, 8214), (3, 12000), (1, 32768)]


def run(n_fixtures, seed, quiet=False):
    rng = np.random.default_rng(seed)
    worst_ratio, worst_dist = 0.0, 0.0
    for i in range(n_fixtures):
        q_len, kv_len = CASES[i % len(CASES)]
        ref, std, lazy = fixture(rng, q_len, kv_len)
        e_std, e_lazy, d = norm_err(std, ref), norm_err(lazy, ref), norm_err(lazy, std)
        worst_ratio = max(worst_ratio, (e_lazy - 1e-4) / e_std if e_std > 0 else
                          (0.0 if e_lazy <= 1e-4 else float("inf")))
        worst_dist = max(worst_dist, d)
        if not quiet:
            print(f"q {q_len:4d} kv {kv_len:5d}: standard {e_std:.3e}  lazy {e_lazy:.3e}  "
                  f"lazy vs standard {d:.3e}")
    if not quiet:
        print(f"largest (lazy - 1e-4) / standard error: {worst_ratio:.3f}; largest distance "
              f"{worst_dist:.3e}")
    return worst_ratio, worst_dist


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", type=int, default=len(CASES))
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    run(a.fixtures, a.seed)


if __name__ == "__main__":
    main()
