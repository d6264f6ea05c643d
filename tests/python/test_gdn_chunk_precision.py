"""tools/gdn_chunk_precision.py: its bf16 rounding is round-to-nearest-even, and both chunked forms
of the GDN prompt rule it emulates (today's U - W h and the fused T (V - K h)) stay within the
stated error of the fp64 token recurrence, so the numbers it prints for a fused kernel's tolerance
rest on a correct emulation (a wrong decay, mask or sign gives errors of order 1)."""
import sys

import numpy as np

from server_util import REPO

sys.path.insert(0, str(REPO / "tools"))
import gdn_chunk_precision as gcp  # noqa: E402


def test_bf16_rounds_to_nearest_even():
    one = np.float32(1.0)
    ulp = np.float32(2.0**-7)  # bf16 spacing at 1
    x = np.array([1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-9, 1 + 3 * 2.0**-8, -2.5, 0.0], np.float32)
    got = gcp.bf16(x)
    want = np.array([1.0, 1.0, one + ulp, one + 2 * ulp, -2.5, 0.0], np.float32)
    np.testing.assert_array_equal(got, want)


def test_chunked_forms_match_the_recurrence():
    # 200 tokens: three full chunks and a partial one.
    rows = gcp.run(200, 3, seed=5)
    assert len(rows) == 6
    for r in rows:
        assert np.isfinite(r["o_rel"]) and np.isfinite(r["s_rel"]), r
        assert r["o_rel"] < 1e-2 and r["s_rel"] < 1e-2, r
    # The forms against each other (the fused kernel's test bound rests on this): close, not equal.
    cross = [r for r in rows if "o_vs_unfused" in r]
    assert len(cross) == 3
    for r in cross:
        assert 0 < r["o_vs_unfused"] < 1e-2 and 0 <= r["s_vs_unfused"] < 1e-2, r
    # The fp32 chunked form without any bf16 rounding is exact to fp32 precision: the emulation's
    # algebra (decay, masks, T, the state update) is right, not just close.
    rng = np.random.default_rng(9)
    q, k, v, g, beta = gcp.make_head(rng, 130, 128)
    saved = gcp.bf16
    try:
        gcp.bf16 = lambda x: np.asarray(x, np.float32)
        for fused in (False, True):
            o, s = gcp.chunked(q, k, v, g, beta, fused)
            o_ref, s_ref = gcp.recurrence(q, k, v, g, beta)
            assert gcp.rel(o, o_ref) < 1e-4 and gcp.rel(s, s_ref) < 1e-4, fused
    finally:
        gcp.bf16 = saved
