"""tools/gdn_fused_protocol.py: the model of the fused GDN state + output kernel's mbarrier
protocol (src/cuda/gdn_prefill_slice.cu, gdn_state_out_fused_kernel). Under random schedules the
protocol as built (one and two output warpgroups, with and without the gated norm's row-sum
exchange, 1-9 chunks) never deadlocks, never completes a wait on the wrong phase, never reads a
buffer after it was overwritten and never needs a transaction count below zero; and the model is
strong enough to catch each of six deliberate protocol errors."""
import random
import sys

import pytest

from server_util import REPO

sys.path.insert(0, str(REPO / "tools"))
import gdn_fused_protocol as gfp  # noqa: E402


def test_barrier_semantics():
    b = gfp.Barrier("b", 2)
    assert not b.ready(0)
    b.arrive()
    assert not b.ready(0) and b.phase == 0
    b.arrive(expect_tx=8)  # the last arrival, but 8 bytes outstanding
    assert b.phase == 0
    b.complete_tx(8)
    assert b.phase == 1 and b.ready(0) and not b.ready(1)
    b.check_success(0, "waiter")
    with pytest.raises(gfp.ProtocolError, match="aliased"):
        b.check_success(2, "waiter")  # same parity, two phases off
    with pytest.raises(gfp.ProtocolError, match="before they were expected"):
        b.complete_tx(4)
    c = gfp.Barrier("c", 1)
    c.arrive()
    assert c.phase == 1 and c.pending == 1


def test_protocol_as_built_holds_under_random_schedules():
    assert gfp.check(schedules=120, seed=7) == 120 * len(gfp.CONFIGS)


@pytest.mark.parametrize("mutation", ["xs_slots_2", "empty_count_4", "no_stg_wait",
                                      "early_empty", "no_rearm", "rearm_every_warp"])
def test_model_catches_protocol_errors(mutation):
    # Two output warpgroups with the norm: every mutation matters there.
    rng = random.Random(3)
    with pytest.raises(gfp.ProtocolError):
        for _ in range(200):
            for n in (3, 5, 9):
                gfp.simulate(n, 2, True, rng, mutate=(mutation,))


def test_cli():
    assert gfp.main(["--schedules", "5"]) == 0
