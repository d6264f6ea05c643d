"""The benchmark tools without a GPU: `deltaserve bench` on the CPU reference with a tiny random
model writes the JSON the plot / results scripts read (floors null: no ceilings), results_md.py
tabulates it, serve_http.py runs the serving workload (scaled down) against `deltaserve serve`,
and the GPU benches refuse clearly where there is no GPU."""
import json
import shutil
import subprocess
import sys

import pytest

from server_util import BIN, REPO, ServerProc

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")


def has_gpu():
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def test_engine_benches_on_cpu_write_json(tmp_path):
    common = ["--device", "cpu", "--synthetic", "tiny"]
    pre, dec = tmp_path / "p.json", tmp_path / "d.json"
    for args, out in ((["prefill", "--prompt", "32,64", "--repeats", "1,2"], pre),
                      (["decode", "--cases", "1@32,2@48", "--steps", "4", "--warmup", "1"], dec)):
        r = subprocess.run([str(BIN), "bench", *args, *common, "--json", str(out)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(pre.read_text())
    assert [p["prompt"] for p in d["prefill"]] == [32, 64]
    assert [p["ttft_s"]["n"] for p in d["prefill"]] == [1, 2]
    assert all(p["floor_s"] is None and p["ratio"] is None for p in d["prefill"])  # no ceilings on a CPU
    assert any("CPU run" in n for n in d["notes"])
    d = json.loads(dec.read_text())
    assert [(x["batch"], x["context"]) for x in d["decode"]] == [(1, 32), (2, 48)]
    for x in d["decode"]:
        assert x["tpot_s"]["n"] == 4 and x["tpot_s"]["p50"] > 0
        assert x["context"] <= x["context_mean"] <= x["context"] + 8
        assert x["bytes"]["weights"] > 0 and x["ratio_p50"] is None
    assert "kernels" not in d and "serve" not in d
    md = subprocess.run([sys.executable, str(REPO / "bench" / "results_md.py"), str(dec)], capture_output=True,
                        text=True, check=True).stdout
    assert "## Decode" in md and "| 2 | 48 |" in md


def test_gpu_benches_refuse_without_a_gpu(tmp_path):
    if has_gpu():
        pytest.skip("a GPU is present")
    r = subprocess.run([str(BIN), "bench", "ceilings"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no CUDA device" in r.stderr
    r = subprocess.run([str(BIN), "bench", "kernels", "--device", "cpu"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "needs a GPU" in r.stderr
    r = subprocess.run([str(BIN), "bench", "decode", "--device", "cpu", "--synthetic", "tiny", "--cases", "1@x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--cases" in r.stderr


def test_serve_http_against_a_tiny_server(tmp_path):
    model = tmp_path / "m"
    subprocess.run([str(BIN), "make-tiny", "--out", str(model), "--seed", "5", "--vocab", "1024"], check=True,
                   capture_output=True, timeout=300)
    srv = ServerProc(model, "--max-batch", 2, "--max-model-len", 512, log_path=tmp_path / "server.log")
    try:
        runs = []
        for i in range(2):
            out = tmp_path / f"s{i}.json"
            r = subprocess.run([sys.executable, str(REPO / "bench" / "serve_http.py"), "--url", srv.base,
                                "--requests", "2", "--output-tokens", "3", "--vocab", "1024", "--scale", "0.008",
                                "--json", str(out)], capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr + srv.log_text()
            runs.append(json.loads(out.read_text())["serve"])
        s = runs[0]
        assert [b["bucket"] for b in s["buckets"]] == ["4K-8K", "8K-16K", "16K-32K"]
        for b in s["buckets"]:
            assert len(b["prompts"]) == 2 and all(b["lo"] <= p < b["hi"] for p in b["prompts"])
            assert b["ttft_s"]["p50"] > 0 and b["tpot_s"]["n"] == 2 and b["throughput_tok_per_s"] > 0
        assert s["weighted_throughput_tok_per_s"] > 0
        # A fixed seed: the same requests every run.
        assert [b["prompts"] for b in runs[0]["buckets"]] == [b["prompts"] for b in runs[1]["buckets"]]
    finally:
        srv.stop()
