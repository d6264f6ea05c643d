"""`deltaserve score` on the HF-made golden fixtures: the logits .npy equals HF's logits of every
position (max abs error / max abs ref < 1e-4), the mean NLL / perplexity equal the values
computed from HF's logits, for both layouts and several chunk sizes; bad input is a clear error.
"""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "data" / "golden"
BUILD = Path(os.environ.get("DS_BUILD_DIR", REPO / "build"))
BIN = BUILD / "bin" / "deltaserve"

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")


def run(*args, check=True):
    p = subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    return p


def ref_nll(logits, tokens):
    l = logits[:-1].astype(np.float64)
    m = l.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(l - m).sum(axis=1, keepdims=True)))[:, 0]
    return float(np.mean(lse - l[np.arange(len(tokens) - 1), tokens[1:]]))


@pytest.mark.parametrize("config", ["qwen35_27b_ratios", "qwen35_other_ratios", "qwen35_odd_dims"])
@pytest.mark.parametrize("layout", ["text", "wrapper"])
@pytest.mark.parametrize("chunk", [1, 64, 512])
def test_score_logits_match_hf(tmp_path, config, layout, chunk):
    g = json.loads((GOLDEN / config / "golden.json").read_text())
    ref = np.load(GOLDEN / config / "logits.npy")
    out = tmp_path / "logits.npy"
    p = run("score", "--model", GOLDEN / config / layout, "--prompt-ids", ",".join(map(str, g["tokens"])),
            "--logits-out", out, "--chunk-size", chunk, "--json")
    res = json.loads(p.stdout)
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == ref.shape
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 1e-4, err
    nll = ref_nll(ref, np.array(g["tokens"]))
    assert res["tokens"] == len(g["tokens"]) and res["scored"] == len(g["tokens"]) - 1
    assert abs(res["mean_nll"] - nll) < 1e-4
    assert abs(res["perplexity"] - math.exp(nll)) < 1e-4 * math.exp(nll)


def test_score_text_output_and_file_input(tmp_path):
    g = json.loads((GOLDEN / "qwen35_other_ratios" / "golden.json").read_text())
    f = tmp_path / "ids.txt"
    f.write_text(" ".join(map(str, g["tokens"][:50])) + "\n")
    p = run("score", "--model", GOLDEN / "qwen35_other_ratios" / "text", "--prompt-ids", f)
    assert "tokens 50 | scored 49 | mean NLL" in p.stdout
    ref = np.load(GOLDEN / "qwen35_other_ratios" / "logits.npy")[:50]
    nll = ref_nll(ref, np.array(g["tokens"][:50]))
    got = float(p.stdout.split("mean NLL ")[1].split()[0])
    assert abs(got - nll) < 1e-4


@pytest.mark.parametrize("ids,message", [
    ("5", "need at least 2 tokens"),
    ("5,512", "outside the model's vocabulary"),
    ("5,-1", "is not a token id"),
])
def test_score_bad_input(ids, message):
    p = run("score", "--model", GOLDEN / "qwen35_other_ratios" / "text", "--prompt-ids", ids, check=False)
    assert p.returncode == 1
    assert message in p.stderr, p.stderr
