"""tools/profile_floor.py on a hand-written decode-profile log (cuda_decode_profile_test's format):
each role's advance per launch against its bytes at the read ceiling given, with the 27B shapes'
bytes (weights once per launch, the attention's K / V at the log's batch and context, the GDN state
in and out), ordered by the loss per step; roles without bytes lose their whole advance; the
by-layer-kind rows are not counted twice; bad arguments and logs are refused."""
import subprocess
import sys

import pytest

from server_util import REPO

sys.path.insert(0, str(REPO / "tools"))
import profile_floor  # noqa: E402

LOG = """\
PROFILE batch {batch} ctx {ctx}, fused_norm on [graph]: 341 kernels per step, in-graph span 1.000 ms (sum of kernel durations 2.000 ms), mean of 5 steps
PROFILE role: kernel                           n    dur us    gap us    adv us     dur ms     adv ms
PROFILE gate_up+silu: gemv_bulk_silu+norm     64     87.37     -5.62     81.75      5.592      5.232
PROFILE attn_split                            16     17.36     -7.27     10.07      0.278      0.16112
PROFILE gdn_decode                            48     42.58    -40.60      1.97      2.044      0.09456
PROFILE argmax                                 1     13.06      0.26     13.26      0.013      0.01326
PROFILE batch {batch} ctx {ctx}, fused_norm on [graph] by layer kind:
PROFILE   gate_up+silu: gemv_bulk_silu+norm @attn    16     89.54     -5.65     83.90      1.433      1.342
PROFILE batch {batch} ctx {ctx}, fused_norm on [graph], one step, first 40 kernels (past the first attention layer): start us (from the step's first), duration, gap before, grid x block, shared memory, registers
PROFILE     0 gather_rows (embedding)             0.00     2.09     0.00     1 x  256       0 B   18
"""


def write(tmp_path, batch=1, ctx=4096):
    p = tmp_path / "inprof.txt"
    p.write_text(LOG.format(batch=batch, ctx=ctx))
    return str(p)


def rows(out):
    """{role: (launches, adv us, floor us, lost ms)} from the printed table."""
    got = {}
    for ln in out.splitlines():
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if ln.startswith("| ") and len(cells) == 5 and cells[1].isdigit():
            got[cells[0]] = (int(cells[1]), float(cells[2]), float(cells[3]), float(cells[4]))
    return got


def test_role_bytes_of_the_27b_shapes():
    s = profile_floor.SHAPES["27b"]
    assert profile_floor.role_bytes("gate_up+silu: gemv_bulk_silu+norm", 1, 4096, s) == \
        2 * 2 * 17408 * 5120
    assert profile_floor.role_bytes("gdn_in: gemv_bulk+norm", 1, 4096, s) == 2 * 16480 * 5120
    assert profile_floor.role_bytes("attn_qkv: gemv_bulk+norm", 16, 4096, s) == 2 * 14336 * 5120
    assert profile_floor.role_bytes("gdn_out: gemv_bulk", 1, 4096, s) == 2 * 5120 * 6144
    assert profile_floor.role_bytes("lm_head: gemv_bulk(f32)", 1, 4096, s) == 2 * 248320 * 5120
    # the K / V of one attention layer: batch x context x 4 kv heads x 256 x (K, V) x 2 bytes
    assert profile_floor.role_bytes("attn_split", 2, 4096, s) == 2 * 4096 * 4 * 256 * 2 * 2
    assert profile_floor.role_bytes("gdn_decode", 16, 4096, s) == 16 * 48 * 128 * 128 * 4 * 2
    assert profile_floor.role_bytes("attn_merge", 1, 4096, s) == 0
    assert profile_floor.role_bytes("add_rmsnorm (post)", 1, 4096, s) == 0


def test_report_orders_roles_by_loss(tmp_path, capsys):
    assert profile_floor.main([write(tmp_path), "--read-tbps", "4.61"]) == 0
    out = capsys.readouterr().out
    got = rows(out)
    assert set(got) == {"gate_up+silu: gemv_bulk_silu+norm", "attn_split", "gdn_decode", "argmax"}
    n, adv, floor, lost = got["gate_up+silu: gemv_bulk_silu+norm"]
    assert n == 64 and adv == pytest.approx(81.75, abs=0.01)
    assert floor == pytest.approx(2 * 2 * 17408 * 5120 / 4.61e12 * 1e6, abs=0.01)  # 77.34
    assert lost == pytest.approx((81.75 - 77.34) * 64 / 1e3, abs=0.002)
    assert got["attn_split"][2] == pytest.approx(4096 * 1024 * 4 / 4.61e12 * 1e6, abs=0.01)
    assert got["argmax"][2] == 0 and got["argmax"][3] == pytest.approx(0.013, abs=0.001)
    order = [ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("| ")][1:]
    assert order == ["gate_up+silu: gemv_bulk_silu+norm", "attn_split", "gdn_decode", "argmax"]
    assert "span 1.000 ms" in out and "floors at 4.61 TB/s" in out


def test_context_and_batch_come_from_the_configuration(tmp_path, capsys):
    profile_floor.main([write(tmp_path, batch=2, ctx=8192), "--read-tbps", "4.0"])
    got = rows(capsys.readouterr().out)
    assert got["attn_split"][2] == pytest.approx(2 * 8192 * 1024 * 4 / 4.0e12 * 1e6, abs=0.01)
    assert got["gdn_decode"][2] == pytest.approx(2 * 48 * 128 * 128 * 8 / 4.0e12 * 1e6, abs=0.01)


def test_refuses_bad_arguments_and_logs(tmp_path):
    script = str(REPO / "tools" / "profile_floor.py")
    empty = tmp_path / "empty.txt"
    empty.write_text("nothing here\n")
    for args, why in (([write(tmp_path), "--read-tbps", "0"], "must be positive"),
                      ([str(empty), "--read-tbps", "4.6"], "no 'PROFILE"),
                      ([write(tmp_path), "--read-tbps", "4.6", "--config", "batch 16"],
                       "matches 0 configurations")):
        r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0 and why in r.stderr, r.stderr
    r = subprocess.run([sys.executable, script, write(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--read-tbps" in r.stderr
