#!/usr/bin/env python3
"""Peers measured in the same run as `deltaserve bench` (PERF.md "Peers"), on the GPU machine.

Kernel peers, on the shapes of `deltaserve bench kernels` (Qwen3.5-27B):
  - flash-linear-attention chunked GDN (chunk_gated_delta_rule) at 64 / 512 / 4096 tokens with a
    carried fp32 state, and its fused recurrent kernel for one decode token at batch 1 / 4 / 16;
  - torch SDPA (cuDNN, then flash) for hd 256, 24 query / 4 kv heads: prompt chunks of 4096 /
    3072 / 512 tokens against 0 / 8K / 16K / 32K cached tokens (bottom-right causal mask), and
    one decode query against 4K..32K;
  - cuBLAS through torch.nn.functional.linear on every decode GEMM shape at batch 1 / 4 / 16.
Model peer: HF transformers' Qwen3.5 (27B shapes, random bf16 weights, the FLA kernels when
importable, SDPA attention), timed at 4 and 8 layers and extrapolated linearly to all 64 layers
(t64 = t4 + 15 * (t8 - t4): the per-layer slope times 60 more layers, fixed costs counted once):
TTFT per prompt length and TPOT at those contexts.

Times: triton.testing.do_bench medians (it flushes L2 between runs) for kernels; CUDA-synchronised
wall clock for the model. Inputs random, never zeros. Output: a table and --json FILE.
Usage: peers.py [--json FILE] [--quick] [--skip-model] [--max-seconds S]
Needs the fla-core and flash-linear-attention wheels (scripts/gpu_bench.sh --peers installs the
carried .whl/ folder); without them the GDN rows and the model's fast path are skipped.
"""
import argparse
import json
import math
import os
import sys
import time

T0 = time.time()
RESULT = {"meta": {}, "kernels": [], "ttft": {}, "tpot": {}, "notes": []}

# Qwen3.5-27B shapes (configs/qwen3.5-27b.json).
D, D_FF, VOCAB = 5120, 17408, 248320
NH, NKV, HD = 24, 4, 256
NK, NV, DK, DV = 16, 48, 128, 128
GDN_IN = 2 * NK * DK + NV * DV + NV * DV + 2 * NV
QKV = NH * HD * 2 + 2 * NKV * HD


def note(msg):
    print("note:", msg, flush=True)
    RESULT["notes"].append(msg)


def save(path):
    if path:
        RESULT["meta"]["wall_s"] = time.time() - T0
        with open(path, "w") as f:
            json.dump(RESULT, f, indent=1)


def over_budget(a):
    return a.max_seconds > 0 and time.time() - T0 > a.max_seconds


def add(family, impl, shape, ms, bytes_=0.0, flops=0.0):
    row = {"family": family, "impl": impl, "shape": shape, "time_s": ms * 1e-3, "bytes": bytes_, "flops": flops}
    RESULT["kernels"].append(row)
    gbs = bytes_ / (ms * 1e-3) / 1e9 if ms > 0 else 0
    tf = flops / (ms * 1e-3) / 1e12 if ms > 0 else 0
    print(f"  {family:<14} {impl:<28} {shape:<36} {ms * 1e3:10.2f} us  {gbs:7.0f} GB/s  {tf:6.1f} TFLOP/s", flush=True)


def bench_ms(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def gdn_peers(a, torch):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        note(f"flash-linear-attention not importable ({type(e).__name__}: {e}); GDN peers skipped")
        return
    dev = "cuda"
    state_bytes = NV * DK * DV * 4
    for t in ([4096] if a.quick else [64, 512, 4096]):
        q = torch.nn.functional.normalize(torch.randn(1, t, NK, DK, device=dev, dtype=torch.bfloat16), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(1, t, NK, DK, device=dev, dtype=torch.bfloat16), dim=-1)
        v = torch.randn(1, t, NV, DV, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(1, t, NV, device=dev, dtype=torch.float32) * 0.1
        beta = torch.rand(1, t, NV, device=dev, dtype=torch.bfloat16)
        h0 = torch.randn(1, NV, DK, DV, device=dev, dtype=torch.float32) * 0.05
        fn = lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
        ms = bench_ms(fn)
        byts = t * (2 * NK * DK + 2 * NV * DV + 2 * NV) * 2 + 2 * state_bytes
        flops = NV * t * (6 * DK * DV + 6 * 64 * DK + 4 * 64 * DV)
        add("gdn_prefill", "fla chunk_gated_delta_rule", f"{t} tokens after 8192 (state carried)", ms, byts, flops)
    for b in ([1] if a.quick else [1, 4, 16]):
        q = torch.nn.functional.normalize(torch.randn(b, 1, NK, DK, device=dev, dtype=torch.bfloat16), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(b, 1, NK, DK, device=dev, dtype=torch.bfloat16), dim=-1)
        v = torch.randn(b, 1, NV, DV, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(b, 1, NV, device=dev, dtype=torch.float32) * 0.1
        beta = torch.rand(b, 1, NV, device=dev, dtype=torch.bfloat16)
        h0 = torch.randn(b, NV, DK, DV, device=dev, dtype=torch.float32) * 0.05
        fn = lambda: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,  # noqa: E731
                                                      output_final_state=True)
        ms = bench_ms(fn)
        add("gdn_decode", "fla fused_recurrent", f"batch {b} (1 token each)", ms, b * 2 * state_bytes,
            b * NV * DK * DV * 6)


def sdpa_peers(a, torch):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    dev = "cuda"
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]
    chunks = [4096] if a.quick else [4096, 3072, 512]
    cached = [0, 32768] if a.quick else [0, 8192, 16384, 32768]
    for qn in chunks:
        for c in cached:
            if over_budget(a):
                return
            kv = c + qn
            q = torch.randn(1, NH, qn, HD, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, NKV, kv, HD, device=dev, dtype=torch.bfloat16)
            v = torch.randn(1, NKV, kv, HD, device=dev, dtype=torch.bfloat16)
            # GQA expanded beforehand (not timed): not every backend takes enable_gqa.
            ke, ve = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
            pairs = qn * c + qn * (qn + 1) / 2
            flops = 4 * NH * HD * pairs
            byts = (2 * qn * NH * HD + 2 * kv * NKV * HD) * 2
            mask = None
            if c > 0:  # bottom-right causal: query j sees keys 0..c+j
                i = torch.arange(qn, device=dev)[:, None]
                j = torch.arange(kv, device=dev)[None, :]
                mask = (j <= i + c)
            for name, be in backends:
                try:
                    with sdpa_kernel([be]):
                        if mask is None:
                            fn = lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True)  # noqa: E731
                        else:
                            fn = lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)  # noqa: E731
                        fn()
                        ms = bench_ms(fn)
                    add("attn_prefill", f"torch sdpa {name}", f"q {qn} after {c} cached", ms, byts, flops)
                except Exception as e:  # noqa: BLE001
                    add_fail("attn_prefill", f"torch sdpa {name}", f"q {qn} after {c} cached", e)
    for b in ([1] if a.quick else [1, 4, 16]):
        for ctx in ([4096, 32768] if a.quick else [4096, 8192, 16384, 32768]):
            q = torch.randn(b, NH, 1, HD, device=dev, dtype=torch.bfloat16)
            k = torch.randn(b, NKV, ctx, HD, device=dev, dtype=torch.bfloat16)
            v = torch.randn(b, NKV, ctx, HD, device=dev, dtype=torch.bfloat16)
            byts = 2 * b * ctx * NKV * HD * 2
            try:
                fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                fn()
                ms = bench_ms(fn)
                add("attn_decode", "torch sdpa (gqa, default)", f"batch {b} at context {ctx}", ms, byts,
                    4 * NH * HD * b * ctx)
            except Exception as e:  # noqa: BLE001
                add_fail("attn_decode", "torch sdpa (gqa, default)", f"batch {b} at context {ctx}", e)


def add_fail(family, impl, shape, e):
    msg = f"{family} {impl} {shape}: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    note(msg)


def gemv_peers(a, torch):
    F = torch.nn.functional
    ops = [("gdn_in", GDN_IN, D), ("gdn_out", D, NV * DV), ("attn_qkv", QKV, D), ("attn_o", D, NH * HD),
           ("gate_up", 2 * D_FF, D), ("down", D, D_FF), ("lm_head", VOCAB, D)]
    for name, n, k in ops:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in ([1] if a.quick else [1, 4, 16]):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = bench_ms(lambda: F.linear(x, w))
            add("gemm", "cublas via torch F.linear", f"{name} m={m} n={n} k={k}", ms, 2 * (n * k + m * k + m * n),
                2 * m * n * k)
        del w


def model_peer(a, torch):
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
    except Exception as e:  # noqa: BLE001
        note(f"transformers not importable ({e}); model peer skipped")
        return
    RESULT["meta"]["transformers"] = transformers.__version__
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "configs", "qwen3.5-27b.json")) as f:
        base = json.load(f)
    text = base.get("text_config", base)
    prompts = [4096] if a.quick else [4096, 16384]
    steps = 16
    times = {}
    for layers in (4, 8):
        if over_budget(a):
            note("time budget spent before the model peer finished")
            return
        fields = dict(text)
        fields.pop("model_type", None)
        fields.pop("architectures", None)
        fields["num_hidden_layers"] = layers
        fields["layer_types"] = text["layer_types"][:layers]
        try:
            cfg = AutoConfig.for_model("qwen3_5_text", **fields)
            cfg._attn_implementation = "sdpa"
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            model.eval()
        except Exception as e:  # noqa: BLE001
            note(f"HF Qwen3.5 model could not be built ({type(e).__name__}: {e}); model peer skipped")
            return
        with torch.no_grad():
            for p in prompts:
                ids = torch.randint(0, VOCAB, (1, p), device="cuda")
                model(ids[:, :512], use_cache=True)  # warm-up (Triton compiles, cuDNN plans)
                torch.cuda.synchronize()
                t = time.time()
                out = model(ids, use_cache=True)
                torch.cuda.synchronize()
                ttft = time.time() - t
                pkv = out.past_key_values
                tok = out.logits[:, -1:].argmax(-1)
                dts = []
                for _ in range(steps):
                    torch.cuda.synchronize()
                    t = time.time()
                    out = model(tok, past_key_values=pkv, use_cache=True)
                    tok = out.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    dts.append(time.time() - t)
                dts.sort()
                times[(layers, p)] = (ttft, dts[len(dts) // 2])
                print(f"  HF Qwen3.5 {layers} layers: prompt {p}: TTFT {ttft:.3f} s, TPOT {dts[len(dts) // 2] * 1e3:.2f} ms",
                      flush=True)
                del out, pkv
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    name = f"HF transformers {RESULT['meta'].get('transformers', '?')} + FLA, bs 1 (64 layers extrapolated)"
    RESULT["ttft"][name] = []
    RESULT["tpot"][name] = []
    for p in prompts:
        if (4, p) in times and (8, p) in times:
            (t4, d4), (t8, d8) = times[(4, p)], times[(8, p)]
            RESULT["ttft"][name].append({"prompt": p, "ttft_s": t4 + 15 * (t8 - t4)})
            RESULT["tpot"][name].append({"context": p, "tpot_s": d4 + 15 * (d8 - d4)})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=0)
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("peers.py: torch is not installed")
    if not torch.cuda.is_available():
        sys.exit("peers.py: no CUDA device")
    RESULT["meta"].update({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    try:
        import fla
        RESULT["meta"]["fla"] = getattr(fla, "__version__", "?")
    except Exception:  # noqa: BLE001
        pass
    print("peers: kernels", flush=True)
    for part in (sdpa_peers, gemv_peers, gdn_peers):  # the Triton (FLA) compiles last
        if over_budget(a):
            note(f"time budget spent; {part.__name__} and later skipped")
            break
        try:
            part(a, torch)
        except Exception as e:  # noqa: BLE001
            note(f"{part.__name__} failed: {type(e).__name__}: {e}")
        save(a.json)
    if not a.skip_model and not over_budget(a):
        print("peers: model", flush=True)
        try:
            model_peer(a, torch)
        except Exception as e:  # noqa: BLE001
            note(f"model peer failed: {type(e).__name__}: {e}")
    save(a.json)
    for name, pts in RESULT["ttft"].items():
        for p in pts:
            print(f"{name}: TTFT {p['prompt']} = {p['ttft_s']:.3f} s")
    for name, pts in RESULT["tpot"].items():
        for p in pts:
            print(f"{name}: TPOT at {p['context']} = {p['tpot_s'] * 1e3:.2f} ms")
    print(f"peers done in {time.time() - T0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
