"""bench/serve_http.py against `deltaserve serve` without a tokenizer (runs in any clean clone):
tokens are counted through return_token_ids (no logprobs, so the server does no per-token work
over the vocabulary), the engine's own TTFT / TPOT of the same requests come from /metrics, and
the HTTP overhead per token is their difference; --count logprobs still works, --count text
fails clearly when the server streams no text."""
import json
import subprocess
import sys

import pytest

from server_util import BIN, REPO, ServerProc

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")

SCRIPT = REPO / "bench" / "serve_http.py"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny") / "m"
    subprocess.run([str(BIN), "make-tiny", "--out", str(model), "--seed", "7", "--vocab", "1024"], check=True,
                   capture_output=True, timeout=300)
    srv = ServerProc(model, "--max-batch", 1, "--max-model-len", 512, log_path=tmp_path_factory.mktemp("log") / "s.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def run(server, tmp_path, *args):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--url", server.base, "--requests", "2", "--output-tokens", "6",
                        "--vocab", "1024", "--scale", "0.008", "--json", str(out), *args],
                       capture_output=True, text=True, timeout=300)
    return r, (json.loads(out.read_text()) if r.returncode == 0 else None)


IDS = "token_ids (return_token_ids)"


@pytest.mark.parametrize("count,label", [("auto", IDS), ("ids", IDS), ("logprobs", "logprobs")])
def test_counts_tokens_and_reads_engine_timings(server, tmp_path, count, label):
    before = server.metrics()["deltaserve_time_per_output_token_seconds_count"]
    r, doc = run(server, tmp_path, "--count", count)
    assert r.returncode == 0, r.stdout + r.stderr + server.log_text()
    assert doc["meta"]["token_counting"] == label
    assert "logprobs from here on" not in r.stdout  # auto needed no fallback
    for b in doc["serve"]["buckets"]:
        assert b["tpot_s"]["n"] == 2 and b["ttft_s"]["p50"] > 0
        assert b["engine_tpot_s"]["n"] == 2 and b["engine_ttft_s"]["n"] == 2
        # The engine's TTFT is measured from submission, inside the client's.
        assert b["engine_ttft_s"]["max"] <= b["ttft_s"]["max"]
        assert b["http_overhead_per_token_s"]["n"] == 2
        assert abs(b["http_overhead_per_token_s"]["mean"]) < 0.5  # seconds: a sanity bound only
    assert "HTTP +us/tok" in r.stdout
    assert server.metrics()["deltaserve_time_per_output_token_seconds_count"] >= before + 6


def test_text_counting_without_tokenizer_fails_clearly(server, tmp_path):
    r, _ = run(server, tmp_path, "--count", "text")
    assert r.returncode != 0 and "carried no token" in r.stderr
