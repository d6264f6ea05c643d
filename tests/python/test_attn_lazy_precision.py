"""tools/attn_lazy_precision.py: the emulation behind wgmma_ws_lazy's test bounds is right, so the
error ratio and distance it prints rest on correct algebra (a wrong mask, base or rescale gives
errors of order 1): its bf16 rounds to nearest even; without any bf16 rounding both softmax forms
(standard, and lazy with its stale bases and rare rescales) equal the fp64 softmax to fp32
precision; with the kernels' roundings both stay within the kernels' tolerance."""
import sys

import numpy as np

from server_util import REPO

sys.path.insert(0, str(REPO / "tools"))
import attn_lazy_precision as alp  # noqa: E402


def test_bf16_rounds_to_nearest_even():
    one = np.float32(1.0)
    ulp = np.float32(2.0**-7)  # bf16 spacing at 1
    x = np.array([1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-9, 1 + 3 * 2.0**-8, -2.5, 0.0, -np.inf],
                 np.float32)
    got = alp.bf16(x)
    want = np.array([1.0, 1.0, one + ulp, one + 2 * ulp, -2.5, 0.0, -np.inf], np.float32)
    np.testing.assert_array_equal(got, want)


def test_both_forms_are_the_softmax_without_rounding():
    saved = alp.bf16
    try:
        alp.bf16 = lambda x: np.asarray(x, np.float32)
        rng = np.random.default_rng(4)
        # Several tiles (the lazy bases go stale, some rows rescale), a partial last tile, and
        # causal rows that see 1..kv keys.
        for q_len, kv_len in ((1, 1), (65, 65), (40, 700)):
            ref, std, lazy = alp.fixture(rng, q_len, kv_len)
            assert alp.norm_err(std, ref) < 2e-6, (q_len, kv_len)
            assert alp.norm_err(lazy, ref) < 2e-6, (q_len, kv_len)
    finally:
        alp.bf16 = saved


def test_lazy_base_really_goes_stale():
    # Scores rising by far more than tau over the tiles make the lazy form rescale, and scores
    # within tau leave its base behind the true max: both paths of softmax_rows run, and still
    # give the softmax (no rounding here, as above).
    saved = alp.bf16
    try:
        alp.bf16 = lambda x: np.asarray(x, np.float32)
        kv = 256
        s = np.zeros((2, kv), np.float32)
        s[0] = np.arange(kv, dtype=np.float32)            # rises ~0.09 log2 per key: stale bases
        s[1] = np.repeat(np.arange(4) * 200.0, 64)        # +18 log2 per tile: a raise every tile
        v = np.random.default_rng(0).normal(0, 1, (kv, alp.HD)).astype(np.float32)
        n_keys = np.array([kv, kv])
        got = alp.softmax_rows(s, v, n_keys, lazy=True)
        w = np.exp((s.astype(np.float64) - s.max(axis=1, keepdims=True)) / 16.0)
        ref = (w @ v.astype(np.float64)) / w.sum(axis=1, keepdims=True)
        assert alp.norm_err(got, ref) < 2e-6
    finally:
        alp.bf16 = saved


def test_rounded_forms_within_the_kernel_tolerance():
    ratio, dist = alp.run(6, seed=2, quiet=True)
    assert np.isfinite(ratio) and ratio < 1.5, ratio
    assert dist < 5e-3, dist
