"""tools/hf_compare.py rebuilds the engine's synthetic weights with torch integer arithmetic instead
of reading a 51 GB checkpoint: here its generator must reproduce, bit for bit, every tensor that
`deltaserve make-tiny` writes (make_synthetic_weights, the same per-tensor specs as the CUDA
engine's device generator), and HF's model filled by it must equal HF's model loaded from that
checkpoint. The per-tensor specs (seed from the tensor name, init kind, mean, std) are derived here
as model/weight_table.cpp does; on the GPU the C++ test writes them instead (weights.json)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from server_util import BIN, REPO

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")
sys.path.insert(0, str(REPO / "tools"))
import hf_compare  # noqa: E402

M64 = (1 << 64) - 1


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def fnv1a(s):
    h = 0xCBF29CE484222325
    for ch in s.encode():
        h = ((h ^ ch) * 0x100000001B3) & M64
    return h


# weight_table.cpp's init rules: (kind, mean, std); std 0 = 1 / sqrt(fan_in); log-uniform on [1, 16].
INIT = {"embed_tokens.weight": ("normal", 0.0, 0.02), "norm.weight": ("normal", 0.0, 0.1),
        "input_layernorm.weight": ("normal", 0.0, 0.1), "post_attention_layernorm.weight": ("normal", 0.0, 0.1),
        "self_attn.q_norm.weight": ("normal", 0.0, 0.1), "self_attn.k_norm.weight": ("normal", 0.0, 0.1),
        "linear_attn.dt_bias": ("normal", 0.0, 0.1), "linear_attn.A_log": ("log_uniform", 0.0, 0.0),
        "linear_attn.norm.weight": ("normal", 1.0, 0.1)}


def spec_of(name, shape, model_seed):
    suffix = name.split(".", 2)[2] if name.startswith("layers.") else name
    kind, mean, std = INIT.get(suffix, ("normal", 0.0, 0.0))
    if kind == "normal" and std == 0.0:
        std = float(np.float32(1.0) / np.sqrt(np.float32(shape[-1])))
    seed = mix64(mix64(model_seed ^ 0x5EED5EED5EED5EED) ^ fnv1a(name))
    return {"name": name, "shape": list(shape), "seed": str(seed), "kind": kind, "mean": mean,
            "std": float(np.float32(std)), "lo": 1.0, "hi": 16.0, "samples": []}


def test_generator_reproduces_make_tiny_bit_for_bit(tmp_path):
    from safetensors.torch import load_file
    model = tmp_path / "m"
    subprocess.run([str(BIN), "make-tiny", "--out", str(model), "--seed", "5", "--vocab", "1024"], check=True,
                   capture_output=True, timeout=300)
    tensors = load_file(str(model / "model.safetensors"))
    specs = []
    for key, t in tensors.items():
        name = key[len("model."):] if key.startswith("model.") else key
        spec = spec_of(name, t.shape, 5)
        got = hf_compare.synthetic_bf16(spec, 0, t.numel(), "cpu")
        assert torch.equal(got.view(torch.int16), t.reshape(-1).view(torch.int16)), name
        n = t.numel()
        spec["samples"] = [[i, int(t.reshape(-1)[i].view(torch.int16)) & 0xFFFF] for i in sorted({0, n // 2, n - 1})]
        specs.append(spec)
    assert any(s["kind"] == "log_uniform" for s in specs)
    # Filled in chunks (as on the GPU), checked against samples, in HF's own model.
    cfg = json.loads((model / "config.json").read_text())
    hf = hf_compare.build_hf_model(cfg, specs, device="cpu")
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).state_dict()
    for n, p in hf.named_parameters():
        assert torch.equal(p.data.view(torch.int16), ref[n].view(torch.int16)), n
    # A wrong sample is caught and named.
    specs[0]["samples"][0][1] ^= 1
    with pytest.raises(SystemExit, match="differ from the host generator"):
        hf_compare.build_hf_model(cfg, specs, device="cpu")


def test_compare_reports_agreement_and_decisive_rows():
    ref = torch.randn(64, 500)
    res = hf_compare.compare(ref + 1e-3 * torch.randn_like(ref), ref, 48)
    g = res["groups"]["all"]
    assert g["rows"] == 64 and res["groups"]["decode"]["rows"] == 16
    assert g["rel_l2_p99"] < 1e-2 and g["kl_mean"] < 1e-4
    assert g["top1_decisive"] == 1.0 and g["decisive_rows"] > 32
    bad = hf_compare.compare(torch.randn_like(ref), ref, 48)["groups"]["all"]
    assert bad["rel_l2_p50"] > 0.5  # an unrelated output is far outside the gate
