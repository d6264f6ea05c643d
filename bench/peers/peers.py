#!/usr/bin/env python3
"""Peers measured in the same run as `deltaserve bench` (PERF.md "Peers"), on the GPU machine.

Model peer: HF transformers' Qwen3.5 at the real 27B shapes, ALL 64 layers, bf16 on the GPU,
random weights, flash-linear-attention kernels for GDN when importable (else HF's torch path, said
in the output), SDPA attention, batch 1. TTFT per prompt length of `bench prefill` (4K / 8K / 16K
/ 32K random tokens: one forward with the KV / GDN cache, logits of the last token only, as
generate() does), and TPOT at the `bench decode` contexts (the median of 16 single-token steps
right after that prompt, each synchronised: what a batch-1 generate loop pays). Wall clock with
torch.cuda.synchronize(). Before each timed prompt, an untimed prefill of the same length and two
decode steps (FLA's Triton kernels compile and autotune per sequence length; cuDNN plans).

Kernel peers on the shapes of `deltaserve bench kernels` (Qwen3.5-27B):
  - flash-linear-attention chunk_gated_delta_rule on 64 / 512 / 4096-token prompt chunks with a
    carried fp32 state (and 4096 with a fresh one), fused_recurrent_gated_delta_rule for one
    decode token at batch 1 / 4 / 16;
  - torch SDPA, cuDNN and flash backends, hd 256, 24 query / 4 kv heads: prompt chunks of 4096 /
    3072 / 512 tokens after 0 / 8K / 16K / 32K cached tokens (bottom-right causal: query i sees
    keys 0..cached+i), and one decode query at batch 1 / 16 against 4K..32K;
  - cuBLAS through torch.nn.functional.linear on every decode GEMM shape at m = 1 / 16.
Kernel timing as our bench's: a CUDA graph of many launches replayed between CUDA events, the
median per launch; inputs rotated over enough sets to exceed 3x the L2 (so small operands are read
from memory, not from L2); triton.testing.do_bench (median) where a call cannot be captured. The
row says which ("graph" / "do_bench"). Inputs random, never zeros.

Output: a table and --json FILE (meta, kernels, ttft, tpot, notes), saved after every part.
Usage: peers.py [--json FILE] [--budget S] [--quick] [--skip-model] [--skip-kernels] [--warm-only]
--warm-only calls the flash-linear-attention kernels once at every shape used here (Triton compiles
them into its on-disk cache) and exits: run it in the background while something else uses the
GPU for correctness work, so that the timed run later finds them compiled (each process still
autotunes itself, uncontended).
--budget bounds the wall time: no new measurement starts after S seconds (default 150).
Needs the fla-core and flash-linear-attention wheels for the GDN rows (scripts/gpu_bench.sh
installs the carried .whl/ folder).
"""
import argparse
import json
import math
import os
import sys
import time

T0 = time.time()
RESULT = {"meta": {}, "kernels": [], "ttft": {}, "tpot": {}, "notes": []}

# Qwen3.5-27B shapes (configs/qwen3.5-27b.json); fused rows as our engine multiplies them.
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


class Budget:
    def __init__(self, seconds):
        self.seconds = seconds
        self.spent_noted = False

    def over(self, what):
        if self.seconds > 0 and time.time() - T0 > self.seconds:
            if not self.spent_noted:
                note(f"time budget of {self.seconds:.0f} s spent: {what} and later measurements skipped")
                self.spent_noted = True
            return True
        return False


def add(family, impl, shape, ms, bytes_=0.0, flops=0.0, method=""):
    row = {"family": family, "impl": impl, "shape": shape, "time_s": ms * 1e-3, "bytes": bytes_, "flops": flops,
           "method": method}
    RESULT["kernels"].append(row)
    gbs = bytes_ / (ms * 1e-3) / 1e9 if ms > 0 else 0
    tf = flops / (ms * 1e-3) / 1e12 if ms > 0 else 0
    print(f"  {family:<12} {impl:<30} {shape:<34} {ms * 1e3:10.2f} us {gbs:7.0f} GB/s {tf:6.1f} TFLOP/s  {method}",
          flush=True)


def add_fail(family, impl, shape, e):
    note(f"{family} {impl} {shape}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def time_kernel(torch, make_inputs, fn, footprint_bytes, target_s=0.15):
    """Median ms per call. make_inputs(i) -> args of fn for rotated set i."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_sets = max(1, min(48, math.ceil(3 * l2 / max(footprint_bytes, 1))))
    sets = [make_inputs(i) for i in range(n_sets)]
    for s in sets[:2]:
        fn(*s)  # compile / autotune / plan outside the timing
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn(*sets[0])
    e1.record()
    e1.synchronize()
    one = max(e0.elapsed_time(e1), 1e-3)  # ms
    calls = max(n_sets, min(512, math.ceil(0.5 / one)))
    calls = math.ceil(calls / n_sets) * n_sets
    reps = max(3, min(20, math.ceil(target_s * 1e3 / (calls * one))))
    try:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*sets[0])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for c in range(calls):
                fn(*sets[c % n_sets])
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / calls)
        ts.sort()
        del g
        return ts[len(ts) // 2], f"graph x{calls}, {n_sets} sets"
    except Exception as e:  # noqa: BLE001 - capture unsupported: time plain launches instead
        torch.cuda.synchronize()
        from triton.testing import do_bench
        it = [0]

        def step():
            fn(*sets[it[0] % n_sets])
            it[0] += 1

        return do_bench(step, warmup=10, rep=50, return_mode="median"), f"do_bench ({type(e).__name__})"


def gdn_peers(a, torch, budget):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        note(f"flash-linear-attention not importable ({type(e).__name__}: {e}); GDN peers skipped")
        return
    dev = "cuda"
    state_bytes = NV * DK * DV * 4
    cases = [(4096, True)] if a.quick else [(4096, True), (4096, False), (512, True), (64, True)]
    for t, carried in cases:
        if budget.over("gdn_prefill"):
            return

        def make(i, t=t, carried=carried):
            g = torch.Generator(device=dev).manual_seed(100 + i)
            F = torch.nn.functional
            q = F.normalize(torch.randn(1, t, NK, DK, device=dev, generator=g), dim=-1).bfloat16()
            k = F.normalize(torch.randn(1, t, NK, DK, device=dev, generator=g), dim=-1).bfloat16()
            v = torch.randn(1, t, NV, DV, device=dev, generator=g).bfloat16()
            gg = -torch.rand(1, t, NV, device=dev, generator=g) * 0.1
            beta = torch.rand(1, t, NV, device=dev, generator=g).bfloat16()
            h0 = torch.randn(1, NV, DK, DV, device=dev, generator=g) * 0.05 if carried else None
            return q, k, v, gg, beta, h0

        def run(q, k, v, gg, beta, h0):
            return chunk_gated_delta_rule(q, k, v, gg, beta, initial_state=h0, output_final_state=True)

        shape = f"{t} tokens after 8192 (state carried)" if carried else f"{t} tokens after 0 (state fresh)"
        byts = t * (2 * NK * DK + 2 * NV * DV + 2 * NV) * 2 + (2 if carried else 1) * state_bytes
        flops = NV * t * (6 * DK * DV + 6 * 64 * DK + 4 * 64 * DV)
        try:
            ms, how = time_kernel(torch, make, run, byts)
            add("gdn_prefill", "fla chunk_gated_delta_rule", shape, ms, byts, flops, how)
        except Exception as e:  # noqa: BLE001
            add_fail("gdn_prefill", "fla chunk_gated_delta_rule", shape, e)
    for b in ([1] if a.quick else [1, 4, 16]):
        if budget.over("gdn_decode"):
            return

        def make(i, b=b):
            g = torch.Generator(device=dev).manual_seed(200 + i)
            F = torch.nn.functional
            q = F.normalize(torch.randn(b, 1, NK, DK, device=dev, generator=g), dim=-1).bfloat16()
            k = F.normalize(torch.randn(b, 1, NK, DK, device=dev, generator=g), dim=-1).bfloat16()
            v = torch.randn(b, 1, NV, DV, device=dev, generator=g).bfloat16()
            gg = -torch.rand(b, 1, NV, device=dev, generator=g) * 0.1
            beta = torch.rand(b, 1, NV, device=dev, generator=g).bfloat16()
            h0 = torch.randn(b, NV, DK, DV, device=dev, generator=g) * 0.05
            return q, k, v, gg, beta, h0

        def run(q, k, v, gg, beta, h0):
            return fused_recurrent_gated_delta_rule(q, k, v, g=gg, beta=beta, initial_state=h0,
                                                    output_final_state=True)

        shape = f"batch {b} (1 token each)"
        try:
            ms, how = time_kernel(torch, make, run, b * 2 * state_bytes)
            add("gdn_decode", "fla fused_recurrent", shape, ms, b * 2 * state_bytes, b * NV * DK * DV * 6, how)
        except Exception as e:  # noqa: BLE001
            add_fail("gdn_decode", "fla fused_recurrent", shape, e)


def sdpa_peers(a, torch, budget):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    dev = "cuda"
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]
    chunks = [4096] if a.quick else [4096, 3072, 512]
    cached = [0, 32768] if a.quick else [0, 8192, 16384, 32768]
    for qn in chunks:
        for c in cached:
            if budget.over("attn_prefill"):
                return
            kv = c + qn
            pairs = qn * c + qn * (qn + 1) / 2
            flops = 4 * NH * HD * pairs
            byts = (2 * qn * NH * HD + 2 * kv * NKV * HD) * 2
            shape = f"q {qn} after {c} cached"
            g = torch.Generator(device=dev).manual_seed(qn + c)
            q = torch.randn(1, NH, qn, HD, device=dev, generator=g).bfloat16()
            k = torch.randn(1, NKV, kv, HD, device=dev, generator=g).bfloat16()
            v = torch.randn(1, NKV, kv, HD, device=dev, generator=g).bfloat16()
            # GQA expanded beforehand (not timed): not every backend takes enable_gqa.
            ke, ve = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
            mask = None
            if c > 0:  # bottom-right causal as an explicit mask (cuDNN takes no lower-right bias)
                i = torch.arange(qn, device=dev)[:, None]
                j = torch.arange(kv, device=dev)[None, :]
                mask = j <= i + c
            for name, be in backends:
                variants = []
                if c > 0 and name == "flash":
                    from torch.nn.attention.bias import causal_lower_right
                    variants.append(("lower-right bias", lambda q, k, v: F.scaled_dot_product_attention(
                        q, k, v, attn_mask=causal_lower_right(qn, kv))))
                if c == 0:
                    variants.append(("is_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                                              is_causal=True)))
                else:
                    variants.append(("explicit mask", lambda q, k, v: F.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask)))
                done = False
                for how_mask, fn in variants:
                    if done:
                        break
                    try:
                        with sdpa_kernel([be]):
                            ms, how = time_kernel(torch, lambda i: (q, ke, ve), fn, 1 << 40)
                        add("attn_prefill", f"torch sdpa {name}", shape, ms, byts, flops, f"{how_mask}; {how}")
                        done = True
                    except Exception as e:  # noqa: BLE001
                        add_fail("attn_prefill", f"torch sdpa {name} ({how_mask})", shape, e)
            del q, k, v, ke, ve, mask
    for b in ([1] if a.quick else [1, 16]):
        for ctx in ([4096, 32768] if a.quick else [4096, 8192, 16384, 32768]):
            if budget.over("attn_decode"):
                return
            byts = 2 * b * ctx * NKV * HD * 2
            shape = f"batch {b} at context {ctx}"

            def make(i, b=b, ctx=ctx):
                g = torch.Generator(device=dev).manual_seed(300 + i)
                return (torch.randn(b, NH, 1, HD, device=dev, generator=g).bfloat16(),
                        torch.randn(b, NKV, ctx, HD, device=dev, generator=g).bfloat16(),
                        torch.randn(b, NKV, ctx, HD, device=dev, generator=g).bfloat16())

            try:
                ms, how = time_kernel(torch, make,
                                      lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), byts)
                add("attn_decode", "torch sdpa (gqa, default)", shape, ms, byts, 4 * NH * HD * b * ctx, how)
            except Exception as e:  # noqa: BLE001
                add_fail("attn_decode", "torch sdpa (gqa, default)", shape, e)


def gemv_peers(a, torch, budget):
    F = torch.nn.functional
    ops = [("gdn_in", GDN_IN, D), ("gdn_out", D, NV * DV), ("attn_qkv", QKV, D), ("attn_o", D, NH * HD),
           ("gate_up", 2 * D_FF, D), ("down", D, D_FF), ("lm_head", VOCAB, D)]
    for name, n, k in ops:
        if budget.over("gemm"):
            return
        for m in ([1] if a.quick else [1, 16]):
            byts = 2 * (n * k + m * k + m * n)

            def make(i, n=n, k=k, m=m):
                g = torch.Generator(device="cuda").manual_seed(400 + i)
                return (torch.randn(m, k, device="cuda", generator=g).bfloat16(),
                        (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16())

            shape = f"{name} m={m} n={n} k={k}" + (" (bf16 out)" if name == "lm_head" else "")
            try:
                ms, how = time_kernel(torch, make, lambda x, w: F.linear(x, w), byts)
                add("gemm", "cublas via torch F.linear", shape, ms, byts, 2 * m * n * k, how)
            except Exception as e:  # noqa: BLE001
                add_fail("gemm", "cublas via torch F.linear", shape, e)
        torch.cuda.empty_cache()


def model_peer(a, torch, budget):
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
    except Exception as e:  # noqa: BLE001
        note(f"transformers not importable ({e}); model peer skipped")
        return
    RESULT["meta"]["transformers"] = transformers.__version__
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "tools"))
    from hf_gdn import hf_gdn_impl  # tools/hf_gdn.py (shared with tools/hf_compare.py)
    with open(os.path.join(here, "..", "..", "configs", "qwen3.5-27b.json")) as f:
        base = json.load(f)
    fields = dict(base.get("text_config", base))
    fields.pop("model_type", None)
    fields.pop("architectures", None)
    prompts = [int(x) for x in a.prompts.split(",")]
    t = time.time()
    cfg = AutoConfig.for_model("qwen3_5_text", **fields)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    impl = hf_gdn_impl(model)
    RESULT["meta"]["hf_gdn_impl"] = impl
    print(f"  HF Qwen3.5 {cfg.num_hidden_layers} layers, {n_params / 1e9:.2f}B parameters, built in "
          f"{time.time() - t:.1f} s; GDN prompt path {impl}", flush=True)
    if "fla" in impl:
        gdn_label = "FLA"
    elif "torch" in impl:
        gdn_label = "torch GDN"
    else:  # transformers >= 5.17 binds the kernel lazily; it warns when it falls back to torch
        gdn_label = "FLA" if RESULT["meta"].get("fla") else "torch GDN (FLA not importable)"
    name = f"HF transformers {transformers.__version__} + {gdn_label}, bs 1, 64 layers"
    RESULT["ttft"][name], RESULT["tpot"][name] = [], []
    steps = 16
    with torch.no_grad():
        for p in prompts:
            if budget.over(f"model peer at {p} tokens"):
                break
            # An untimed prefill of this very length first: FLA's Triton kernels autotune per
            # sequence length (the first H200 run timed 10.5 s at 8K and 12.1 s at 16K without it).
            ids = torch.randint(0, VOCAB, (1, p), device="cuda")
            out = model(ids, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1)
            for _ in range(2):
                out = model(tok, past_key_values=out.past_key_values, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            del out
            torch.cuda.empty_cache()
            ids = torch.randint(0, VOCAB, (1, p), device="cuda")
            torch.cuda.synchronize()
            t = time.time()
            out = model(ids, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            ttft = time.time() - t
            RESULT["ttft"][name].append({"prompt": p, "ttft_s": ttft})
            pkv = out.past_key_values
            dts = []
            for _ in range(steps):
                torch.cuda.synchronize()
                t = time.time()
                out = model(tok, past_key_values=pkv, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                dts.append(time.time() - t)
            dts.sort()
            RESULT["tpot"][name].append({"context": p, "tpot_s": dts[len(dts) // 2], "tpot_p99_s": dts[-1],
                                         "steps": steps})
            print(f"  HF Qwen3.5 64 layers: prompt {p}: TTFT {ttft:.3f} s, TPOT p50 {dts[len(dts) // 2] * 1e3:.2f} ms "
                  f"(max {dts[-1] * 1e3:.2f}) over {steps} steps", flush=True)
            save(a.json)
            del out, pkv
            torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()


def warm_fla(torch):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        print(f"peers --warm-only: flash-linear-attention not importable ({e})")
        return
    F = torch.nn.functional
    for t, b in ((64, 1), (512, 1), (4096, 1), (1, 1), (1, 4), (1, 16)):
        for carried in (True, False):
            q = F.normalize(torch.randn(b, t, NK, DK, device="cuda"), dim=-1).bfloat16()
            k = F.normalize(torch.randn(b, t, NK, DK, device="cuda"), dim=-1).bfloat16()
            v = torch.randn(b, t, NV, DV, device="cuda").bfloat16()
            g = -torch.rand(b, t, NV, device="cuda") * 0.1
            beta = torch.rand(b, t, NV, device="cuda").bfloat16()
            h0 = torch.randn(b, NV, DK, DV, device="cuda") * 0.05 if carried else None
            if t == 1:
                fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)
            else:
                chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    print(f"peers --warm-only: FLA kernels compiled in {time.time() - T0:.1f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--prompts", default="4096,8192,16384,32768",
                    help="model peer prompt lengths = decode contexts")
    ap.add_argument("--budget", "--max-seconds", dest="budget", type=float, default=150)
    ap.add_argument("--warm-only", action="store_true")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("peers.py: torch is not installed")
    if not torch.cuda.is_available():
        sys.exit("peers.py: no CUDA device")
    budget = Budget(a.budget)
    if a.warm_only:
        warm_fla(torch)
        return
    RESULT["meta"].update({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": a.budget})
    try:
        import fla
        RESULT["meta"]["fla"] = getattr(fla, "__version__", "?")
    except Exception:  # noqa: BLE001
        RESULT["meta"]["fla"] = None
    parts = []
    if not a.skip_model:
        parts.append(model_peer)
    if not a.skip_kernels:
        parts += [sdpa_peers, gemv_peers, gdn_peers]
    for part in parts:
        if budget.over(part.__name__):
            break
        print(f"peers: {part.__name__}", flush=True)
        try:
            part(a, torch, budget)
        except Exception as e:  # noqa: BLE001
            note(f"{part.__name__} failed: {type(e).__name__}: {str(e)[:300]}")
        torch.cuda.empty_cache()
        save(a.json)
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
