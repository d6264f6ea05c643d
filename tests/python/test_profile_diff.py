"""tools/profile_diff.py on hand-written decode-profile logs (cuda_decode_profile_test's format):
the role tables and the by-layer-kind table are read, the per-step listing is not taken for a
role table, configurations pair across logs by their text with the context number removed (or by
--a / --b), and the table is ordered by the size of the difference."""
import sys

import pytest

from server_util import REPO

sys.path.insert(0, str(REPO / "tools"))
import profile_diff  # noqa: E402

LOG = """\
[ RUN      ] DecodeProfile.Synthetic27bInGraph
STEP batch 1 ctx {ctx}, fused_norm on: p50 12.640 ms, min 12.612, p90 12.753 (step_greedy, graph, 40 steps)
PROFILE batch 1 ctx {ctx}, fused_norm on [graph]: 341 kernels per step, in-graph span {span} ms (sum of kernel durations 17.548 ms), mean of 5 steps
PROFILE role: kernel                           n    dur us    gap us    adv us     dur ms     adv ms
PROFILE gate_up+silu: gemv_bulk_silu+norm     64     89.39     -6.03     83.36      5.721      {gu}
PROFILE down: gemv_narrow                     64     59.19    -18.53     40.66      3.788      2.602
PROFILE attn_split                            16     18.05     -7.97     10.10      0.289      {attn}
PROFILE batch 1 ctx {ctx}, fused_norm on [graph] by layer kind:
PROFILE   gate_up+silu: gemv_bulk_silu+norm @attn     16     90.00     -6.00     84.00      1.440      {gua}
PROFILE   gate_up+silu: gemv_bulk_silu+norm @gdn      48     89.00     -6.00     83.00      4.272      3.984
PROFILE batch 1 ctx {ctx}, fused_norm on [graph], one step, first 40 kernels (past the first attention layer): start us (from the step's first), duration, gap before, grid x block, shared memory, registers
PROFILE     0 gather_rows (embedding)             0.00     2.46     0.00     1 x  256       0 B   18
"""


def write(tmp_path, name, **kw):
    p = tmp_path / name
    p.write_text(LOG.format(**kw))
    return str(p)


def test_parse_reads_role_and_layer_kind_tables(tmp_path):
    log = write(tmp_path, "a.log", ctx=4096, span="12.530", gu="5.335", attn="0.167", gua="1.344")
    got = profile_diff.parse(open(log).read())
    cfg = "batch 1 ctx 4096, fused_norm on [graph]"
    assert list(got) == [cfg]
    assert got[cfg]["span"] == pytest.approx(12.530)
    assert got[cfg]["kernels"] == 341
    roles = got[cfg]["roles"]
    assert roles["gate_up+silu: gemv_bulk_silu+norm"] == (64, pytest.approx(5.335))
    assert roles["gate_up+silu: gemv_bulk_silu+norm @attn"] == (16, pytest.approx(1.344))
    assert roles["gate_up+silu: gemv_bulk_silu+norm @gdn"] == (48, pytest.approx(3.984))
    # the per-step listing is not a role table
    assert not any(r.startswith("0 ") or "gather_rows" in r for r in roles)


def test_diff_pairs_contexts_and_orders_by_difference(tmp_path, capsys):
    a = write(tmp_path, "a.log", ctx=4096, span="12.530", gu="5.335", attn="0.167", gua="1.344")
    b = write(tmp_path, "b.log", ctx=8192, span="12.421", gu="5.231", attn="0.218", gua="1.240")
    assert profile_diff.main([a, b]) == 0
    out = capsys.readouterr().out
    assert "B - A: -0.109 ms" in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("gate_up", "down", "attn"))]
    # largest |B - A| first: gate_up (-0.104), gate_up @attn (-0.104), attn_split (+0.051), ...
    assert rows[0].split()[0].startswith("gate_up")
    assert rows[0].rstrip().endswith("-0.104")
    assert any(ln.startswith("attn_split") and ln.rstrip().endswith("+0.051") for ln in rows)
    assert rows[-1].rstrip().endswith("+0.000")  # down and gate_up @gdn did not move


def test_named_configurations_and_errors(tmp_path, capsys):
    a = write(tmp_path, "a.log", ctx=4096, span="12.530", gu="5.335", attn="0.167", gua="1.344")
    assert profile_diff.main([a, a, "--a", "ctx 4096", "--b", "ctx 4096"]) == 0
    assert "B - A: +0.000 ms" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="matches 0 configurations"):
        profile_diff.main([a, a, "--a", "ctx 9999"])
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no 'PROFILE"):
        profile_diff.main([a, str(empty)])
