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


def results_md(*args):
    """bench/results_md.py's Markdown for the given arguments (it must succeed)."""
    return subprocess.run([sys.executable, str(REPO / "bench" / "results_md.py"), *args], capture_output=True,
                          text=True, check=True).stdout


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
    md = results_md(str(dec))
    assert "## Decode" in md and "| 2 | 48 |" in md
    assert all(x["logits_to_host"] is False for x in d["decode"]) and "`step_greedy`" in md
    # --decode-logits times step() with the logits rows copied out instead, and says so.
    r = subprocess.run([str(BIN), "bench", "decode", "--cases", "1@32", "--steps", "2", "--warmup", "0",
                        "--decode-logits", *common, "--json", str(dec)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "logits copied to the host" in r.stdout
    assert [x["logits_to_host"] for x in json.loads(dec.read_text())["decode"]] == [True]


def test_decode_bench_prints_window_medians_on_long_runs():
    # 256 steps or more: one more line with the p50 of each 64-step window, in order (a drift over
    # the run shows there); shorter runs print only the summary.
    common = ["--device", "cpu", "--synthetic", "tiny", "--cases", "1@16", "--warmup", "0"]
    r = subprocess.run([str(BIN), "bench", "decode", *common, "--steps", "300"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "p50 of each 64-step window" in ln]
    assert len(lines) == 1, r.stdout
    values = [float(v) for v in lines[0].split("ms:")[1].split()]
    assert len(values) == 4 and all(v > 0 for v in values)  # 300 steps: 4 whole windows
    r = subprocess.run([str(BIN), "bench", "decode", *common, "--steps", "255"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TPOT p50" in r.stdout and "64-step window" not in r.stdout


def test_results_md_ceilings_table_shows_the_spread(tmp_path):
    # A GPU run's ceilings (made-up numbers): the median repetition is the ceiling the ratios use,
    # the p90-p10 repetitions give the spread (the GEMM's moves ~15% with the clock on an H200).
    ceil = {"device": "test GPU", "read_bytes_per_s": 4.5e12, "copy_bytes_per_s": 4.2e12, "gemm_flops_per_s": 7e14,
            "read_bytes": 2 * 2**30, "copy_bytes": 2**31, "gemm_flop": 2 * 8192**3,
            "read_s": {"p10": 2 * 2**30 / 4.6e12, "p50": 2 * 2**30 / 4.5e12, "p90": 2 * 2**30 / 4.4e12},
            "copy_s": {"p10": 0, "p50": 2**31 / 4.2e12, "p90": 0},
            "gemm_s": {"p10": 2 * 8192**3 / 7.9e14, "p50": 2 * 8192**3 / 7e14, "p90": 2 * 8192**3 / 6.8e14}}
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"meta": {"commit": "x"}, "ceilings": ceil}))
    md = results_md(str(j))
    assert "| streaming read (2 GiB bf16 sum) | 4.50 TB/s | 4.40-4.60 TB/s |" in md
    assert "| device-to-device copy (read + write) | 4.20 TB/s | - |" in md  # no spread recorded
    assert "| bf16 GEMM 8192^3 (cuBLASLt) | 700 TFLOP/s | 680-790 TFLOP/s |" in md


def test_results_md_decode_batch_scaling(tmp_path):
    # Issue 6's gate (batch 16 within 1.3x of batch 1) under the decode table: each batch > 1
    # against batch 1 at the same context (made-up numbers); a context without batch 1 is skipped.
    def row(batch, context, p50):
        return {"batch": batch, "context": context, "context_mean": context + 70,
                "tpot_s": {"p50": p50, "p99": p50}, "tok_per_s": batch / p50}
    dec = [row(1, 4096, 0.012320), row(4, 4096, 0.014154), row(16, 4096, 0.015996),
           row(1, 8192, 0.012180), row(4, 32768, 0.0150)]
    j = tmp_path / "d.json"
    j.write_text(json.dumps({"meta": {"commit": "x"}, "decode": dec}))
    md = results_md(str(j))
    assert ("Batch scaling (TPOT p50 / batch 1's at the same context; issue 6: batch 16 <= 1.3x): "
            "4096: batch 4 1.149x, 4096: batch 16 1.298x.") in md
    j.write_text(json.dumps({"meta": {"commit": "x"}, "decode": [row(1, 4096, 0.0123)]}))
    assert "Batch scaling" not in results_md(str(j))


def test_results_md_prefill_ratio_at_the_fastest_decile(tmp_path):
    # The GEMM ceiling is bimodal on a power-capped H200: the prefill table gives the ratio to the
    # median repetition (what the bench computed) and to the fastest decile (p10 repetition), so
    # runs whose median landed on different modes stay comparable. Made-up numbers: median 700,
    # p10 800 TFLOP/s; a 0.33 s prompt with a 0.30 s floor at 700 is 1.10x, at 800 1.10 x 8/7.
    flop = 2 * 8192**3
    ceil = {"gemm_flops_per_s": 7e14, "read_bytes_per_s": 4.5e12, "copy_bytes_per_s": 4.2e12,
            "gemm_flop": flop, "gemm_s": {"p10": flop / 8e14, "p50": flop / 7e14, "p90": flop / 6.9e14}}
    row = {"prompt": 4096, "ttft_s": {"n": 3, "p50": 0.33}, "tok_per_s": 12412.0, "tflops": 620.0,
           "floor_s": 0.30, "ratio": 1.1}
    j = tmp_path / "p.json"
    j.write_text(json.dumps({"meta": {"commit": "x"}, "ceilings": ceil, "prefill": [row]}))
    md = results_md(str(j))
    assert "The fastest decile of this run's GEMM ceiling: 800 TFLOP/s." in md
    assert "| 4096 | 3 | 330.000 | 12412 | 620.0 | 300.000 | 1.10x | 1.26x |" in md
    # Without ceilings (a CPU run) the column is there, empty.
    row.update(floor_s=None, ratio=None)
    j.write_text(json.dumps({"meta": {"commit": "x"}, "prefill": [row]}))
    md = results_md(str(j))
    assert "| 4096 | 3 | 330.000 | 12412 | 620.0 | - | - | - |" in md


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
        # --prompts-from: the very prompt lengths of an in-process run's JSON, bucket by bucket.
        given = {"serve": {"buckets": [{"bucket": "4K-8K", "prompts": [40, 33]}, {"bucket": "8K-16K", "prompts": [70]},
                                       {"bucket": "16K-32K", "prompts": [130]}]}}
        src = tmp_path / "bench.json"
        src.write_text(json.dumps(given))
        out = tmp_path / "same.json"
        r = subprocess.run([sys.executable, str(REPO / "bench" / "serve_http.py"), "--url", srv.base, "--output-tokens",
                            "2", "--vocab", "1024", "--prompts-from", str(src), "--json", str(out)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr + srv.log_text()
        got = json.loads(out.read_text())["serve"]
        assert [b["prompts"] for b in got["buckets"]] == [[40, 33], [70], [130]]
        bad = tmp_path / "bad.json"
        bad.write_text("{}")
        r = subprocess.run([sys.executable, str(REPO / "bench" / "serve_http.py"), "--url", srv.base, "--prompts-from",
                            str(bad)], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "--prompts-from" in r.stderr
    finally:
        srv.stop()


def _serve_doc(mode, ttft, tpot, thr, prompts):
    summ = lambda x: {"n": 1, "p50": x, "p99": x, "min": x, "max": x, "mean": x}  # noqa: E731
    buckets = [{"bucket": b, "lo": 1, "hi": 2, "weight": w, "prompts": p, "ttft_s": summ(ttft), "tpot_s": summ(tpot),
                "throughput_tok_per_s": thr} for (b, w), p in zip((("4K-8K", 0.2), ("8K-16K", 0.5), ("16K-32K", 0.3)),
                                                                   prompts)]
    return {"mode": mode, "output_tokens": 128, "buckets": buckets, "weighted_throughput_tok_per_s": thr}


def test_results_md_http_and_hf_compare_sections(tmp_path):
    """results_md.py puts the HTTP run beside the in-process one (ratios, same-prompt check) and
    renders hf_compare.py's summary; a missing optional file is named, not fatal."""
    bench = {"meta": {"date": "d", "commit": "c", "command": "bench serve"},
             "serve": _serve_doc("in-process", 1.0, 0.020, 40.0, [[5000], [9000], [20000]])}
    http = {"serve": _serve_doc("HTTP (x)", 1.02, 0.0202, 39.0, [[5000], [9000], [20001]])}
    grp = {"rows": 10, "top1": 0.9, "decisive_rows": 6, "top1_decisive": 1.0, "near_tie_rows_disagreeing": 1,
           "abs_err_max": 0.1, "abs_err_p999": 0.05, "abs_err_p99": 0.03, "abs_err_mean": 0.01, "rel_l2_p50": 0.01,
           "rel_l2_p99": 0.02, "rel_l2_max": 0.03, "kl_mean": 1e-4, "kl_p99": 2e-4, "kl_max": 3e-4,
           "margin_p10": 0.01, "margin_p50": 0.1}
    hfc = {"meta": {"tokens": 10, "n_prompt": 8, "transformers": "5", "torch": "2", "hf_gdn_impl": "torch"},
           "results": {"4": {"rows": 10, "n_prompt": 8, "logit_std": 1.0, "groups": {"all": grp, "decode": grp},
                             "gate_pass": True}}}
    paths = {}
    for name, doc in (("bench", bench), ("http", http), ("hfc", hfc)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(doc))
    md = subprocess.run([sys.executable, str(REPO / "bench" / "results_md.py"), str(paths["bench"]), "--serve-http",
                         str(paths["http"]), "--hf-compare", str(paths["hfc"]), "--peers", str(tmp_path / "none.json")],
                        capture_output=True, text=True)
    assert md.returncode == 0, md.stderr
    out = md.stdout
    assert "## Serving workload over HTTP" in out and "HTTP vs in-process" in out
    assert "| 4K-8K | yes | 1.020 | 1.010 | 0.975 |" in out
    assert "| 16K-32K | no |" in out  # another prompt length: flagged
    assert "| weighted | | | | 0.975 |" in out
    assert "## Against HF transformers" in out and "| 4 | 10 | 90.00% | 100.00% (6) |" in out
    assert "peers file unreadable" in md.stderr


def ab_table(stdout, cases):
    """gpu_decode_ab.sh's closing table: per arm line, {case: (values per round, median)}."""
    arms = []
    for ln in (ln for ln in stdout.splitlines() if ln.startswith("arm ")):
        cells = {}
        for case in cases:
            vals = ln.split(f" {case}: ")[1].split(" (median ")
            cells[case] = ([float(v) for v in vals[0].split()], float(vals[1].split(")")[0]))
        arms.append((ln, cells))
    return arms


def test_gpu_decode_ab_script_interleaves_arms_and_tabulates(tmp_path):
    """scripts/gpu_decode_ab.sh as a dry run on the CPU: every arm runs as its own bench process in
    every round (the env it was given reaches it), the table has one value per round and the median;
    a setting that is not VAR=value is refused before anything runs."""
    script = REPO / "scripts" / "gpu_decode_ab.sh"
    env = {"PATH": "/usr/bin:/bin", "BIN": str(BIN), "OUT": str(tmp_path)}
    r = subprocess.run(["bash", str(script), "--cases", "1@32,2@32", "--steps", "3", "--rounds", "2",
                        "--bench-args", "--device cpu --synthetic tiny", "-", "DS_GEMV_L2_NEXT=16 DS_X=1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    full = (tmp_path / "decode_ab.full.log").read_text()
    assert full.count("== round") == 4 and full.count("bench decode done") == 4
    assert "round 2 arm 1: DS_GEMV_L2_NEXT=16 DS_X=1" in full
    table = ab_table(r.stdout, ("1@32", "2@32"))
    assert len(table) == 2 and table[1][0].startswith("arm 1 [DS_GEMV_L2_NEXT=16 DS_X=1]:")
    for ln, cells in table:
        for rounds, med in cells.values():
            assert len(rounds) == 2 and min(rounds) <= med <= max(rounds)
        # batch 2 against batch 1 at the same context, from the two medians
        want = cells["2@32"][1] / cells["1@32"][1]
        got = float(ln.split("[2@32 / 1@32: ")[1].split("x]")[0])
        assert abs(got - want) <= 1e-3 * want + 5e-4, ln
    bad = subprocess.run(["bash", str(script), "--bench-args", "--device cpu", "DS_OK=1 notasetting"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "is not VAR=value" in bad.stderr


def test_gpu_decode_ab_script_prefill_mode(tmp_path):
    """scripts/gpu_decode_ab.sh --prefill as a dry run on the CPU: each arm runs `bench prefill`
    with the prompts and repeats given, once per round; the table has TTFT p50 per prompt length
    and round with the median; bad prompt lists and --repeats without --prefill are refused."""
    script = REPO / "scripts" / "gpu_decode_ab.sh"
    env = {"PATH": "/usr/bin:/bin", "BIN": str(BIN), "OUT": str(tmp_path)}
    r = subprocess.run(["bash", str(script), "--prefill", "64,96", "--repeats", "2,1", "--rounds", "3",
                        "--bench-args", "--device cpu --synthetic tiny", "-", "DS_X=1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    full = (tmp_path / "decode_ab.full.log").read_text()
    assert full.count("== round") == 6 and full.count("bench prefill done") == 6
    assert "round 3 arm 1: DS_X=1" in full
    assert "TTFT p50 ms per round, median of rounds (prompts 64,96, repeats 2,1, 3 rounds)" in r.stdout
    table = ab_table(r.stdout, ("64", "96"))
    assert len(table) == 2 and table[1][0].startswith("arm 1 [DS_X=1]:")
    for _, cells in table:
        for rounds, med in cells.values():
            assert len(rounds) == 3 and med == sorted(rounds)[1]
    for args, why in ((["--prefill", "64,x"], "takes prompt lengths"),
                      (["--repeats", "2"], "--repeats goes with --prefill")):
        bad = subprocess.run(["bash", str(script), *args, "--bench-args", "--device cpu", "-"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr


def test_gpu_pending_script_steps_dry_run(tmp_path):
    """scripts/gpu_pending.sh (the next device session's measurements) as a dry run: each step
    prints its commands, with the arms and filters the plan in docs/perf/prefill_gaps.md names;
    an unknown step is refused, and a real run without the packed binaries stops at once."""
    script = REPO / "scripts" / "gpu_pending.sh"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "DRY": "1"}
    out = {}
    for step in ("tests", "kernels", "decode", "prompts", "ncu", "attn", "wy", "early", "attno",
                 "ahead", "argmax", "tma", "quick"):
        r = subprocess.run(["bash", str(script), step], capture_output=True, text=True, env=env,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        out[step] = r.stdout
    assert "scripts/gpu_test.sh --pack" in out["tests"]
    assert out["kernels"].count("bench kernels --only attn_prefill") == 1
    assert "bench kernels --only gemm" in out["kernels"]
    assert "CudaGdn.PrefillStageTiming" in out["kernels"]
    assert "CudaGdn.WyPhaseTiming" in out["kernels"] and "CudaGdn.WyPhaseTiming" in out["wy"]
    assert "CudaGdn.WyBalancedBitExact" in out["wy"] and "DS_PERF=1" in out["wy"]
    # Session 32's early gdn_decode start: both tests, the profiles both ways, the A/B arm.
    assert "CudaGemvBulkNorm.EarlyRows" in out["early"]
    assert "Specialisations.GdnEarly" in out["early"]
    assert out["early"].count("DecodeProfile.Synthetic27bInGraph") == 2
    assert "DS_GDN_EARLY=0" in out["early"] and "DS_GDN_EARLY=1" in out["early"]
    # (on by default: off against the default)
    assert "--cases 1@4096,1@8192,1@32768,2@4096 --rounds 3 DS_GDN_EARLY=0 -" in out["early"]
    # Session 33's probe, attn_o off PDL: the engine test, the profiles both ways, the A/B arm.
    assert "Specialisations.AttnOPdl" in out["attno"]
    assert out["attno"].count("DecodeProfile.Synthetic27bInGraph") == 2
    assert "DS_ATTN_O_PDL=1" in out["attno"] and "DS_ATTN_O_PDL=0" in out["attno"]
    assert "--cases 1@4096,1@8192,1@32768,2@4096 --rounds 3 - DS_ATTN_O_PDL=0" in out["attno"]
    # Session 34's probe, own stages into L2 after the wait: both tests, the profiles, the arms.
    assert "CudaGemvBulkNorm.L2Ahead" in out["ahead"] and "CudaGemvTma.L2Ahead" in out["ahead"]
    assert "CudaGemvNarrow.L2Ahead" in out["ahead"]
    assert "Specialisations.GemvAhead" in out["ahead"]
    assert out["ahead"].count("DecodeProfile.Synthetic27bInGraph") == 2
    assert "DS_GEMV_AHEAD=0" in out["ahead"] and "DS_GEMV_AHEAD=80" in out["ahead"]
    assert ("--cases 1@4096,1@8192,1@16384,1@32768,2@4096,16@4096 --rounds 3 - DS_GEMV_AHEAD=80"
            " DS_GEMV_TMA_AHEAD=40") in out["ahead"]
    for arm in ("DS_MLP_FUSED=1", "DS_MLP_FUSED=2", "DS_MLP_FUSED=3", "DS_GEMV_NORM_EARLY=0",
                "DS_ATTN_DECODE=pdl_cluster"):
        assert arm in out["decode"]
    assert out["decode"].count("DecodeProfile.Synthetic27bInGraph") == 3
    assert "DS_GDN_STATE=tight" in out["prompts"] and "DS_GDN_STATE=fused" in out["prompts"]
    assert "DS_GDN_STATE=fused " in out["kernels"] and "DS_GDN_STATE=fused2 " in out["kernels"]
    assert out["kernels"].count("bench kernels --only gdn_prefill") == 3
    assert out["ncu"].count("scripts/gpu_ncu.sh --kernels gdn_state_out_fused") == 2
    assert "DS_GDN_STATE=fused2" in out["ncu"]
    lean = "DS_DISABLE_KERNELS=attn_prefill.wgmma_ws_lazy"
    assert lean + ",attn_prefill.wgmma_ws3_lean,attn_prefill.wgmma_ws_lean " in out["prompts"]
    # The prompt attention's default (wgmma_ws_lazy since session 30) against wgmma_ws_lean: the
    # test binaries, three bench processes each way, and whole prompts with lean and ulean.
    ulean = (lean + ",attn_prefill.wgmma_ws3_lean,attn_prefill.wgmma_ws_lean,"
             "attn_prefill.wgmma_ws3,attn_prefill.wgmma_ws,attn_prefill.wgmma_ws3_persist,"
             "attn_prefill.wgmma_ws3_lean_persist")
    assert "cuda_attention_test" in out["attn"]
    assert "AttnPrefillForms" in out["attn"]
    assert out["attn"].count("bench kernels --only attn_prefill") == 6
    assert out["attn"].count(lean + " ") == 3 + 1  # three bench processes, the prompt A/B arm
    assert ulean in out["attn"].split()
    assert "--prefill 2048,4096,8192,16384,32768" in out["attn"]
    assert "tools/bench_variants.py attn_kernels.txt --ref wgmma_ws_lean" in out["attn"]
    assert "DS_GEMV_ACC" not in "".join(out.values())  # removed in session 30
    assert "DS_NORM_DECODE" not in "".join(out.values())  # removed in session 31
    # Session 30-31's norm-form steps, and session 34's `tm` (the flash GDN form, removed in
    # session 36), removed with their forms.
    for gone in ("profile", "post", "tm"):
        r = subprocess.run(["bash", str(script), gone], capture_output=True, text=True, env=env,
                           timeout=60)
        assert r.returncode == 2 and "step must be" in r.stderr
    # Session 27's decode head: the three tests, the profiles both ways, the A/B arms.
    assert "CudaGemvBulk.ArgmaxFused" in out["argmax"]
    assert "CudaGemvBulkNorm.ArgmaxNorm" in out["argmax"]
    assert "Specialisations.FusedHead" in out["argmax"]
    assert out["argmax"].count("DecodeProfile.Synthetic27bInGraph") == 2
    assert "DS_ARGMAX_FUSED=0 DS_HEAD_NORM=0" in out["argmax"]
    assert ('- DS_ARGMAX_FUSED=1 "DS_ARGMAX_FUSED=1 DS_HEAD_NORM=1" '
            '"DS_ARGMAX_FUSED=1 DS_HEAD_NORM=1 DS_ARGMAX_CLUSTER=1"') in out["argmax"]
    assert "--cases 1@4096,2@4096,16@4096" in out["argmax"]
    # The one-call plan: the never-run forms' tests, the attention kernels both ways, the A/B.
    for binary in ("cuda_attention_test", "cuda_gemv_test", "cuda_gemv_norm_test",
                   "cuda_specialisation_test"):
        assert binary in out["quick"]
    assert "AttnPrefillForms" in out["quick"] and "FusedHead" in out["quick"]
    assert out["quick"].count("bench kernels --only attn_prefill") == 2
    assert "env " + ulean.replace(",", "\\,") + " " in out["quick"]  # printf %q escapes the commas
    assert '- "DS_ARGMAX_FUSED=1 DS_HEAD_NORM=1" DS_GEMV_TMA_KBOX=2' in out["quick"]
    # Session 27's wider TMA stages: the tests plain and with the switch at 2 and 4, the A/B.
    assert out["tma"].count("CudaGemvTma.") == 3
    assert "DS_GEMV_TMA_KBOX=2 " in out["tma"] and "DS_GEMV_TMA_KBOX=4 " in out["tma"]
    assert "cuda_batch_invariance_test" in out["tma"] and "bench kernels --only gemm" in out["tma"]
    assert "--cases 1@4096,8@4096,16@4096 --rounds 3 - DS_GEMV_TMA_KBOX=2 DS_GEMV_TMA_KBOX=4" \
        in out["tma"]
    bad = subprocess.run(["bash", str(script), "bogus"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert bad.returncode == 2 and "step must be" in bad.stderr
    r = subprocess.run(["bash", str(script), "prompts"], capture_output=True, text=True,
                       env={**env, "FUSED_FORM": "fused2"}, timeout=60)
    assert r.returncode == 0 and "DS_GDN_STATE=fused2" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["bash", str(script), "prompts"], capture_output=True, text=True,
                       env={**env, "SKIP_FUSED": "1"}, timeout=60)
    assert r.returncode == 0 and "fused" not in r.stdout, r.stdout + r.stderr
    bad = subprocess.run(["bash", str(script), "prompts"], capture_output=True, text=True,
                         env={**env, "FUSED_FORM": "fused3"}, timeout=60)
    assert bad.returncode == 2 and "FUSED_FORM" in bad.stderr
    env_real = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "ARCHIVE": str(tmp_path / "none.xz")}
    r = subprocess.run(["bash", str(script), "decode"], capture_output=True, text=True,
                       env=env_real, timeout=60)
    assert r.returncode == 2 and "not found" in r.stderr
