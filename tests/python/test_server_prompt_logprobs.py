"""Prompt logprobs over HTTP on the HF-made golden checkpoint (its own small tokenizer, so these run
without ../shared): OpenAI's `echo` with `logprobs` (the lm-eval loglikelihood request) and vLLM's
`prompt_logprobs`, checked against the log-softmax of HF's logits of every position, with the
rows cut to a few per step (--max-logit-rows) or not; streaming echo equals the non-streaming one;
bad requests are clear 400s."""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")

from server_util import BIN, ServerProc  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "data" / "golden" / "qwen35_other_ratios"
MODEL = GOLDEN / "text"
# HF's logits agree with the CPU forward to 1e-4 of their largest (test_cli_score.py); a logprob
# adds the log-sum-exp's error to the logit's.
TOL = 2e-3

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")


@pytest.fixture(scope="module", params=["default", "cut"])
def server(request, tmp_path_factory):
    # "cut": 7 rows per step and 16-token chunks, so a 100-token prompt takes 15 steps.
    extra = [] if request.param == "default" else ["--max-logit-rows", "7", "--chunk-size", "16"]
    log = tmp_path_factory.mktemp("srv") / "server.log"
    s = ServerProc(MODEL, *extra, log_path=log)
    yield s
    s.stop()


def golden():
    g = json.loads((GOLDEN / "golden.json").read_text())
    logits = np.load(GOLDEN / "logits.npy").astype(np.float64)
    return g["tokens"], g, logits


def log_softmax(l):
    m = l.max(axis=-1, keepdims=True)
    return l - m - np.log(np.exp(l - m).sum(axis=-1, keepdims=True))


def post(server, path, body):
    status, raw = server.request("POST", path, body)
    return status, json.loads(raw)


def test_echo_logprobs_match_hf(server):
    tokens, g, logits = golden()
    lp = log_softmax(logits)
    status, r = post(server, "/v1/completions", {
        "prompt": tokens, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
        "return_token_ids": True})
    assert status == 200, r
    ch = r["choices"][0]
    got = ch["logprobs"]
    n = len(tokens)
    assert len(got["tokens"]) == len(got["token_logprobs"]) == len(got["top_logprobs"]) == n + 1
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    want = np.array([lp[j - 1, tokens[j]] for j in range(1, n)])
    have = np.array(got["token_logprobs"][1:n])
    assert np.abs(have - want).max() < TOL, np.abs(have - want).max()
    # The prompt's entries then the generated token's, the echo's text first.
    assert ch["token_ids"] == [g["greedy"][0]]
    assert abs(got["token_logprobs"][n] - lp[n - 1, g["greedy"][0]]) < TOL
    assert got["text_offset"][0] == 0 and got["text_offset"] == sorted(got["text_offset"])
    # lm-eval's loglikelihood: the sum over a continuation, and whether it is the greedy one
    # (each token the top entry where HF's margin makes that certain).
    ctx = 60
    assert abs(sum(got["token_logprobs"][ctx:n]) - want[ctx - 1:].sum()) < TOL * (n - ctx)
    # Each position's top entries: the best one and the token itself (OpenAI's legacy format and
    # vLLM's: up to logprobs + 1), keyed by their text.
    for j in range(1, n + 1):
        top = got["top_logprobs"][j]
        assert 1 <= len(top) <= 2, top
        assert abs(top[got["tokens"][j]] - got["token_logprobs"][j]) < 1e-6 or len(top) == 1
        if j == n:
            continue
        row = logits[j - 1]
        best = int(row.argmax())
        if np.sort(row)[-1] - np.sort(row)[-2] > 1e-3:
            assert abs(max(top.values()) - lp[j - 1, best]) < TOL
            assert (best == tokens[j]) == (abs(max(top.values()) - got["token_logprobs"][j]) < 1e-6)
            if best != tokens[j] and len(top) == 2:
                assert abs(top[got["tokens"][j]] - lp[j - 1, tokens[j]]) < TOL


def test_vllm_prompt_logprobs_completions(server):
    tokens, _, logits = golden()
    lp = log_softmax(logits)
    status, r = post(server, "/v1/completions", {
        "prompt": tokens, "prompt_logprobs": 3, "max_tokens": 2, "temperature": 0})
    assert status == 200, r
    pl = r["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(tokens) and pl[0] is None
    assert r["choices"][0]["logprobs"] is None  # not asked for
    for j in range(1, len(tokens)):
        row = logits[j - 1]
        e = pl[j]
        mine = e[str(tokens[j])]
        assert abs(mine["logprob"] - lp[j - 1, tokens[j]]) < TOL
        assert isinstance(mine["decoded_token"], str)
        gaps = np.abs(row - row[tokens[j]])
        gaps[tokens[j]] = np.inf
        if gaps.min() > 1e-3:  # no near-tie: the rank is certain
            assert mine["rank"] == int((row >= row[tokens[j]]).sum())
        order = np.argsort(-row, kind="stable")
        assert 3 <= len(e) <= 4
        if row[order[2]] - row[order[3]] > 1e-3 and row[order[0]] - row[order[1]] > 1e-3 \
                and row[order[1]] - row[order[2]] > 1e-3:
            for k in range(3):
                t = str(int(order[k]))
                assert t in e
                if int(order[k]) != tokens[j]:
                    assert e[t]["rank"] == k + 1
                assert abs(e[t]["logprob"] - lp[j - 1, order[k]]) < TOL


def test_vllm_prompt_logprobs_chat_against_score(server, tmp_path):
    msgs = [{"role": "user", "content": "hello there, how are you today?"}]
    status, t = post(server, "/tokenize", {"messages": msgs})
    assert status == 200, t
    ids = t["tokens"]
    out = tmp_path / "logits.npy"
    subprocess.run([str(BIN), "score", "--model", str(MODEL), "--prompt-ids", ",".join(map(str, ids)),
                    "--logits-out", str(out)], check=True, capture_output=True, timeout=300)
    lp = log_softmax(np.load(out).astype(np.float64))
    status, r = post(server, "/v1/chat/completions", {
        "messages": msgs, "prompt_logprobs": 0, "max_tokens": 1, "temperature": 0})
    assert status == 200, r
    pl = r["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for j in range(1, len(ids)):
        assert list(pl[j].keys()) == [str(ids[j])]
        assert abs(pl[j][str(ids[j])]["logprob"] - lp[j - 1, ids[j]]) < TOL


def test_stream_echo_logprobs_equal_the_whole_response(server):
    tokens, _, _ = golden()
    body = {"prompt": tokens[:40], "echo": True, "logprobs": 2, "max_tokens": 5, "temperature": 0}
    status, whole = post(server, "/v1/completions", body)
    assert status == 200, whole
    status, raw = server.request("POST", "/v1/completions", dict(body, stream=True))
    assert status == 200
    text, lps = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ch = json.loads(line[6:])["choices"][0]
        text += ch["text"]
        if ch["logprobs"]:
            for k in lps:
                lps[k] += ch["logprobs"][k]
    w = whole["choices"][0]
    assert text == w["text"]
    assert lps == w["logprobs"]
    assert len(lps["tokens"]) == 45 and lps["token_logprobs"][0] is None
    # text_offset counts characters token by token through the echo and the output (as vLLM).
    offs, toks = lps["text_offset"], lps["tokens"]
    assert offs[0] == 0
    assert all(b == a + len(t) for a, b, t in zip(offs, offs[1:], toks)), (offs, toks)


@pytest.mark.parametrize("body,param", [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "3"}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs(server, body, param):
    status, r = post(server, "/v1/completions", dict({"prompt": [1, 2, 3], "max_tokens": 1}, **body))
    assert status == 400, r
    assert r["error"]["param"] == param
    assert server.healthy()
