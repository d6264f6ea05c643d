"""`deltaserve make-tiny` and `deltaserve inspect` from the command line.

make-tiny writes deterministic checkpoints (same seed, same bytes; layouts and shard counts as
asked) that HF `safetensors` reads; inspect reports the counts and the memory plan (text and
--json), also for a config.json alone (the 27B numbers of SPEC.md); bad input is a clear error.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DS_BUILD_DIR", REPO / "build"))
BIN = BUILD / "bin" / "deltaserve"
CONFIG_27B = REPO / "tests" / "data" / "model" / "qwen3_5_27b_config.json"

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")


def run(*args, check=True):
    p = subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    return p


def test_make_tiny_is_deterministic(tmp_path):
    run("make-tiny", "--out", tmp_path / "a", "--seed", 5)
    run("make-tiny", "--out", tmp_path / "b", "--seed", 5)
    run("make-tiny", "--out", tmp_path / "c", "--seed", 6)
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a != (tmp_path / "c" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()


def test_make_tiny_layouts_read_by_hf_safetensors(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    out = tmp_path / "m"
    p = run("make-tiny", "--out", out, "--seed", 1, "--vocab", 300, "--shards", 3, "--wrapper")
    assert "RANDOM" in p.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    shapes = {}
    for f in files:
        with safetensors.safe_open(str(out / f), framework="np") as st:  # bf16: shapes only in numpy
            for k in st.keys():
                assert index["weight_map"][k] == f
                shapes[k] = tuple(st.get_slice(k).get_shape())
                assert st.get_slice(k).get_dtype() == "BF16"
    assert set(shapes) == set(index["weight_map"])
    assert shapes["model.language_model.embed_tokens.weight"] == (300, 64)
    assert shapes["lm_head.weight"] == (300, 64)
    assert shapes["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == (160, 64)  # 2*2*16 + 6*16
    assert shapes["model.language_model.layers.0.linear_attn.conv1d.weight"] == (160, 1, 4)
    assert shapes["model.language_model.layers.3.self_attn.q_proj.weight"] == (384, 64)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5"
    assert cfg["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]


def test_make_tiny_refuses_non_empty_folder(tmp_path):
    run("make-tiny", "--out", tmp_path / "m", "--shards", 2)
    p = run("make-tiny", "--out", tmp_path / "m", check=False)
    assert p.returncode != 0 and "not empty" in p.stderr
    run("make-tiny", "--out", tmp_path / "m", "--force")
    names = sorted(x.name for x in (tmp_path / "m").iterdir())
    assert names == ["config.json", "model.safetensors"]  # old shards and index removed


def test_inspect_tiny_json(tmp_path):
    run("make-tiny", "--out", tmp_path / "m", "--vocab", 512, "--tied")
    j = json.loads(run("inspect", "--model", tmp_path / "m", "--json").stdout)
    assert j["has_weights"] is True
    assert j["config"]["n_full_layers"] == 1 and j["config"]["n_linear_layers"] == 3
    assert j["config"]["tie_word_embeddings"] is True
    assert j["parameters"]["embedding"] == 512 * 64
    assert j["parameters"]["lm_head"] == 0
    assert j["parameters"]["total"] == sum(v for k, v in j["parameters"].items() if k != "total")
    assert j["bytes"]["total"] == 2 * j["parameters"]["total"]
    assert j["checkpoint"]["text_tensors_by_dtype"] == {"BF16": j["checkpoint"]["text_tensors"]}
    assert j["memory_plan"]["kv_bytes_per_token"] == 1 * 2 * 32 * 2  # 1 attn layer, K+V, 1 kv head x 32, bf16


def test_inspect_27b_config_only(tmp_path):
    (tmp_path / "config.json").write_text(CONFIG_27B.read_text())
    j = json.loads(run("inspect", "--model", tmp_path, "--json", "--gpu-memory", 80, "--context", 4096).stdout)
    assert j["has_weights"] is False
    assert 26.8e9 < j["parameters"]["total"] < 27.0e9
    plan = j["memory_plan"]
    assert plan["kv_bytes_per_token"] == 64 * 1024
    assert plan["gdn_recurrent_state_bytes_per_layer"] == 3 * 1024 * 1024
    assert plan["gdn_state_bytes_per_seq"] == 48 * (3 * 1024 * 1024 + 4 * 10240 * 2)  # conv ring of 4 rows
    assert plan["budget_bytes"] == 80 * 1024**3
    assert plan["fits"] is True
    assert plan["max_seqs_at_context"] == plan["free_bytes"] // (plan["gdn_state_bytes_per_seq"] + 4096 * 64 * 1024)
    text = run("inspect", "--model", tmp_path).stdout
    assert "48 Gated DeltaNet + 16 gated attention" in text
    assert "64.00 KiB" in text


def test_inspect_errors(tmp_path):
    p = run("inspect", "--model", tmp_path / "nope", check=False)
    assert p.returncode == 1 and "nope" in p.stderr and "not a directory" in p.stderr
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_text", "hidden_size": -3}')
    p = run("inspect", "--model", tmp_path, check=False)
    assert p.returncode == 1 and "hidden_size" in p.stderr and "config.json" in p.stderr
    # A corrupt safetensors file is named.
    run("make-tiny", "--out", tmp_path / "m")
    st = tmp_path / "m" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-10])
    p = run("inspect", "--model", tmp_path / "m", check=False)
    assert p.returncode == 1 and str(st) in p.stderr and "past the end" in p.stderr


@pytest.mark.parametrize("wrapper", [False, True])
def test_make_tiny_loads_in_hf_transformers(tmp_path, wrapper):
    """HF transformers reads make-tiny's checkpoint as-is: no missing or unexpected text keys,
    every tensor equal. Needs torch (absent in CI: skipped there)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors")
    out = tmp_path / "m"
    run("make-tiny", "--out", out, "--seed", 3, "--shards", 2, *(["--wrapper"] if wrapper else []))
    cls = transformers.Qwen3_5ForConditionalGeneration if wrapper else transformers.Qwen3_5ForCausalLM
    model, info = cls.from_pretrained(str(out), output_loading_info=True, dtype=torch.bfloat16)
    assert [k for k in info["missing_keys"] if "visual" not in k] == []  # the wrapper has no vision tower
    assert not info["unexpected_keys"] and not info.get("mismatched_keys")
    sd = model.state_dict()
    n = 0
    for f in sorted(out.glob("*.safetensors")):
        with safetensors.safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                assert torch.equal(sd[k], st.get_tensor(k)), k
                n += 1
    assert n == len([k for k in sd if "visual" not in k])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.float()
    assert logits.shape == (1, 4, 1024) and 0.1 < float(logits.std()) < 10  # random but not degenerate
