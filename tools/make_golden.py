#!/usr/bin/env python3
"""Builds the golden fixtures of the CPU reference tests with HF transformers itself.

For each config it makes a small random Qwen3.5 text model (Qwen3_5ForCausalLM), rounds every
weight through bf16 (so the bf16 checkpoint holds exactly what HF computes with), runs HF in fp32
on a fixed token sequence and records:
  logits.npy   [T, vocab] float32: the logits of every position of `tokens`
  hidden.npy   [n_layers, T, d_model] float32: the residual stream after each decoder layer
  golden.json  the tokens, a 16-token greedy continuation (HF, with its cache: decode path),
               the top-1 / top-2 margin of each greedy step, and the config name
and writes the checkpoint twice, sharded into several safetensors files on purpose:
  text/        HF's own save_pretrained of Qwen3_5ForCausalLM (model_type qwen3_5_text, `model.*`)
  wrapper/     the vision-language layout of the released checkpoints (model_type qwen3_5 with
               `text_config`, `model.language_model.*`, plus a few fake `model.visual.*` and
               `mtp.*` tensors that a text-only loader must skip)
Both layouts also get a small byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json,
trained here with the Qwen3.5 split regex) so `generate --prompt` can be tested on the fixtures.

Usage: python3 tools/make_golden.py [--out tests/data/golden]
Needs torch, transformers (>= 5 with qwen3_5), safetensors, tokenizers, numpy. Deterministic
for a given torch version (CPU, fp32).
"""
import argparse
import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5TextConfig

VOCAB = 512
N_TOKENS = 100  # > 64: the chunked GDN form crosses a chunk boundary
N_GREEDY = 16

# (a) the 27B ratios: GQA 6, 3 value heads per key head, head_dim = 2 x d_k, partial rotary 0.25,
#     every 4th layer full attention. (b) other ratios and an explicit, irregular layer pattern.
CONFIGS = {
    "qwen35_27b_ratios": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1], mrope_interleaved=True),
        seed=1234,
    ),
    "qwen35_other_ratios": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=5,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                     "full_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                             mrope_section=[2, 1, 1], mrope_interleaved=True),
        seed=4321,
    ),
    # (c) odd sizes everywhere (no dimension a multiple of 4 or 8, conv kernel 3, d_k != d_v): the
    # remainder paths of vectorised code.
    "qwen35_odd_dims": dict(
        hidden_size=38,
        intermediate_size=90,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=14,
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        linear_key_head_dim=10,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.43,
                             mrope_section=[1, 1, 1], mrope_interleaved=True),
        seed=999,
        shard_kb=60,
    ),
}

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TOKENIZER_TEXT = """\
The quick brown fox jumps over the lazy dog. Hello, world! Gated DeltaNet layers keep a fixed-size
recurrent state, while the gated attention layers keep a key-value cache that grows with the
context. 1234567890 numbers are split one digit at a time. Caf\u00e9, na\u00efve, r\u00e9sum\u00e9:
accents survive NFC. \u4f60\u597d\uff0c\u4e16\u754c\u3002 Emoji too: \U0001f600 \U0001f680.
def forward(x):\n    return x * 2\n\nThe user asked a question and the assistant answered it.
What is the capital of France? The capital of France is Paris. Tell me a story about a robot.
Once upon a time there was a small robot who wanted to learn how to paint the sea at night.
"""

QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def make_tokenizer(out_dir):
    """A small byte-level BPE shaped like Qwen3.5's tokenizer.json (NFC, split regex, byte level)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert max(ids.values()) < VOCAB
    tcfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 262144,
        "added_tokens_decoder": {
            str(i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False, "special": True} for s, i in ids.items()
        },
        "chat_template": ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
                          "message.content + '<|im_end|>\\n' }}{%- endfor %}"
                          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2)
    return ids


@torch.no_grad()
def randomise(model, seed):
    """Weights with unit-scale activations (HF's 0.02 init gives near-constant logits), rounded to bf16."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            # Decay rates from slow (A ~ 0.02) to fast (A ~ 8) so the state matters across chunks.
            a = torch.exp(torch.empty(p.shape).uniform_(np.log(0.02), np.log(8.0), generator=g))
            p.copy_(torch.log(a))
        elif name.endswith("dt_bias"):
            p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=g))
        elif name.endswith("norm.weight"):
            # zero-centred norms: (1 + w); the GDN gated norm (linear_attn.norm) is plain w around 1
            base = 1.0 if "linear_attn.norm" in name else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith("conv1d.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, generator=g))
        else:  # [out, in] matrices
            p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
        p.copy_(p.to(torch.bfloat16).to(torch.float32))


def write_sharded(tensors, out_dir, n_shards):
    """Writes `tensors` (name -> bf16 tensor) as n_shards safetensors files + HF index json."""
    names = list(tensors)
    per = (len(names) + n_shards - 1) // n_shards
    weight_map, total = {}, 0
    for s in range(n_shards):
        part = names[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(out_dir, fname),
                  metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


@torch.no_grad()
def build(name, spec, out_root):
    spec = dict(spec)
    seed = spec.pop("seed")
    shard_kb = spec.pop("shard_kb", 300)
    torch.manual_seed(seed)
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    tok_dir = os.path.join(out, "_tok")
    special_ids = make_tokenizer(tok_dir)

    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, rms_norm_eps=1e-6, max_position_embeddings=4096,
                            tie_word_embeddings=False, eos_token_id=special_ids["<|im_end|>"],
                            pad_token_id=special_ids["<|endoftext|>"], **spec)
    cfg._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    randomise(model, seed)
    layer_kinds = set(cfg.layer_types)
    assert layer_kinds == {"linear_attention", "full_attention"}, layer_kinds

    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, special_ids["<|endoftext|>"], (N_TOKENS,), generator=g)
    ids = tokens[None, :]
    # Residual stream after every decoder layer (hooks), to find the first layer where two paths part.
    hidden = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: hidden.append(
        (out[0] if isinstance(out, tuple) else out)[0].float().clone())) for layer in model.model.layers]
    logits = model(input_ids=ids, use_cache=False).logits[0].float().numpy()
    for h in hooks:
        h.remove()
    assert len(hidden) == cfg.num_hidden_layers
    np.save(os.path.join(out, "logits.npy"), logits.astype(np.float32))
    np.save(os.path.join(out, "hidden.npy"), torch.stack(hidden).numpy().astype(np.float32))

    # Greedy continuation with HF's cache (prefill in the chunked form, then recurrent decode).
    greedy, margins = [], []
    cache_out = model(input_ids=ids, use_cache=True)
    cache = cache_out.cache if hasattr(cache_out, "cache") else cache_out.past_key_values
    step_logits = cache_out.logits[0, -1]
    for _ in range(N_GREEDY):
        top2 = torch.topk(step_logits, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        nxt = int(top2.indices[0])
        greedy.append(nxt)
        o = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = o.cache if hasattr(o, "cache") else o.past_key_values
        step_logits = o.logits[0, -1]
    # Cross-check: the same continuation recomputed without a cache.
    full = torch.cat([tokens, torch.tensor(greedy)])[None, :]
    ref = model(input_ids=full, use_cache=False).logits[0, N_TOKENS - 1:-1].argmax(-1).tolist()
    assert ref == greedy, (name, ref, greedy)

    # text-only layout: HF's own save_pretrained, sharded.
    text_dir = os.path.join(out, "text")
    model.to(torch.bfloat16).save_pretrained(text_dir, max_shard_size=f"{shard_kb}KB", safe_serialization=True)
    n_text_shards = len([f for f in os.listdir(text_dir) if f.endswith(".safetensors")])
    assert n_text_shards >= 2, n_text_shards

    # wrapper layout: qwen3_5 config with text_config, model.language_model.* names.
    wrap_dir = os.path.join(out, "wrapper")
    os.makedirs(wrap_dir)
    sd = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    tensors = {}
    gv = torch.Generator().manual_seed(seed + 2)
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 4, 4, generator=gv).to(torch.bfloat16)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 16, generator=gv).to(torch.bfloat16)
    for k, v in sd.items():
        tensors[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
    tensors["mtp.fc.weight"] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size, generator=gv).to(torch.bfloat16)
    tensors["mtp.norm.weight"] = torch.zeros(cfg.hidden_size, dtype=torch.bfloat16)
    write_sharded(tensors, wrap_dir, 3)
    text_dict = cfg.to_dict()
    vision = dict(model_type="qwen3_5_vision", depth=1, hidden_size=16, intermediate_size=32,
                  num_heads=2, out_hidden_size=cfg.hidden_size, patch_size=4, temporal_patch_size=2)
    wcfg = Qwen3_5Config(text_config=text_dict, vision_config=vision).to_dict()
    wcfg["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    with open(os.path.join(wrap_dir, "config.json"), "w") as f:
        json.dump(wcfg, f, indent=2, sort_keys=True)

    for d in (text_dir, wrap_dir):
        for fn in os.listdir(tok_dir):
            shutil.copy(os.path.join(tok_dir, fn), os.path.join(d, fn))
    shutil.rmtree(tok_dir)

    golden = {
        "config": name,
        "tokens": tokens.tolist(),
        "greedy": greedy,
        "greedy_margins": margins,
        "vocab_size": VOCAB,
        "special_ids": special_ids,
        "logits_file": "logits.npy",
        "hidden_file": "hidden.npy",
        "logits_max_abs": float(np.abs(logits).max()),
        "torch": torch.__version__,
    }
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
    print(f"{name}: layers {cfg.layer_types}; logits max |x| {golden['logits_max_abs']:.3f}; "
          f"greedy {greedy}; min top-2 margin {min(margins):.4f}; text shards {n_text_shards}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "golden"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    for name, spec in CONFIGS.items():
        build(name, spec, args.out)


if __name__ == "__main__":
    main()
