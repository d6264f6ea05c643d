"""`deltaserve generate` on the HF-made golden fixtures (tests/data/golden, tools/make_golden.py).

Greedy ids equal HF's greedy continuation (both configs, both checkpoint layouts, several prompt
chunk sizes); EOS stops generation; text output equals HF `tokenizers` decoding of the same ids;
--prompt encodes like HF; seeded sampling is reproducible; bad input gives a clear error.
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "data" / "golden"
BUILD = Path(os.environ.get("DS_BUILD_DIR", REPO / "build"))
BIN = BUILD / "bin" / "deltaserve"
CONFIGS = ["qwen35_27b_ratios", "qwen35_other_ratios", "qwen35_odd_dims"]

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")


def golden(config):
    return json.loads((GOLDEN / config / "golden.json").read_text())


def run(*args, check=True):
    p = subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    return p


def ids_arg(ids):
    return ",".join(map(str, ids))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", ["text", "wrapper"])
@pytest.mark.parametrize("chunk", [7, 64, 512])
def test_greedy_matches_hf(config, layout, chunk):
    g = golden(config)
    p = run("generate", "--model", GOLDEN / config / layout, "--prompt-ids", ids_arg(g["tokens"]),
            "--max-tokens", len(g["greedy"]), "--output", "ids", "--ignore-eos", "--chunk-size", chunk)
    assert json.loads(p.stdout) == g["greedy"]
    assert "stop: length" in p.stderr


def test_prompt_ids_from_file(tmp_path):
    g = golden("qwen35_other_ratios")
    f = tmp_path / "ids.json"
    f.write_text(json.dumps(g["tokens"]))
    p = run("generate", "--model", GOLDEN / "qwen35_other_ratios" / "text", "--prompt-ids", f,
            "--max-tokens", 4, "--output", "ids", "--ignore-eos", "-q")
    assert json.loads(p.stdout) == g["greedy"][:4]
    assert p.stderr == ""


def test_stops_at_config_eos(tmp_path):
    g = golden("qwen35_other_ratios")
    model = tmp_path / "m"
    shutil.copytree(GOLDEN / "qwen35_other_ratios" / "text", model)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (model / f).unlink(missing_ok=True)
    cfg = json.loads((model / "config.json").read_text())
    cfg["eos_token_id"] = g["greedy"][3]
    (model / "config.json").write_text(json.dumps(cfg))
    p = run("generate", "--model", model, "--prompt-ids", ids_arg(g["tokens"]), "--max-tokens", 16)
    assert json.loads(p.stdout) == g["greedy"][:3]  # no tokenizer: ids; the EOS itself not printed
    assert f"stop: eos (token {g['greedy'][3]})" in p.stderr
    p = run("generate", "--model", model, "--prompt-ids", ids_arg(g["tokens"]), "--max-tokens", 16,
            "--ignore-eos")
    assert json.loads(p.stdout) == g["greedy"]


def test_text_output_matches_hf_decode():
    tokenizers = pytest.importorskip("tokenizers")
    g = golden("qwen35_other_ratios")
    model = GOLDEN / "qwen35_other_ratios" / "wrapper"
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    p = run("generate", "--model", model, "--prompt-ids", ids_arg(g["tokens"]), "--max-tokens",
            len(g["greedy"]), "--ignore-eos")
    expect = tok.decode([i for i in g["greedy"] if i < tok.get_vocab_size()], skip_special_tokens=False)
    assert p.stdout == expect + "\n"


def test_prompt_text_encodes_like_hf():
    tokenizers = pytest.importorskip("tokenizers")
    model = GOLDEN / "qwen35_27b_ratios" / "text"
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    text = "Hello, world! The capital of France is Paris. 12345 caf\u00e9 <|im_end|>"
    ids = tok.encode(text, add_special_tokens=False).ids
    a = run("generate", "--model", model, "--prompt", text, "--max-tokens", 8, "--output", "ids",
            "--ignore-eos", "-q")
    b = run("generate", "--model", model, "--prompt-ids", ids_arg(ids), "--max-tokens", 8, "--output",
            "ids", "--ignore-eos", "-q")
    assert json.loads(a.stdout) == json.loads(b.stdout)
    assert len(json.loads(a.stdout)) == 8


def test_seeded_sampling_is_reproducible():
    model = GOLDEN / "qwen35_27b_ratios" / "text"
    args = ["generate", "--model", model, "--prompt-ids", "1,2,3,4,5", "--max-tokens", 32, "--output",
            "ids", "--ignore-eos", "--temperature", "1.5", "-q"]
    a = json.loads(run(*args, "--seed", 11).stdout)
    b = json.loads(run(*args, "--seed", 11).stdout)
    c = json.loads(run(*args, "--seed", 12).stdout)
    assert a == b
    assert a != c
    greedy = json.loads(run(*args[:-3], "-q").stdout)
    assert a != greedy
    topk1 = json.loads(run(*args, "--seed", 13, "--top-k", 1).stdout)
    assert topk1 == greedy


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,2,x"], "'x' (item 3) is not a token id"),
    (["--prompt-ids", "1,2,600"], "outside the model's vocabulary [0, 512)"),
    (["--prompt-ids", ""], "no token ids given"),
    (["--prompt-ids", "1", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt-ids", "1", "--max-tokens", "5000"], "max_position_embeddings"),
])
def test_bad_input_is_a_clear_error(args, message):
    p = run("generate", "--model", GOLDEN / "qwen35_other_ratios" / "text", *args, check=False)
    assert p.returncode != 0
    assert message in p.stderr, p.stderr


def test_missing_model_and_tokenizer(tmp_path):
    p = run("generate", "--model", tmp_path / "nope", "--prompt-ids", "1", check=False)
    assert p.returncode == 1 and "not a directory" in p.stderr
    model = tmp_path / "m"
    shutil.copytree(GOLDEN / "qwen35_other_ratios" / "text", model)
    (model / "tokenizer.json").unlink()
    p = run("generate", "--model", model, "--prompt", "hello", check=False)
    assert p.returncode == 1 and "--prompt needs a tokenizer" in p.stderr
    # A truncated shard: the error names the file.
    shard = sorted(model.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    p = run("generate", "--model", model, "--prompt-ids", "1", check=False)
    assert p.returncode == 1 and shard.name in p.stderr, p.stderr


def test_cuda_device_without_cuda_build():
    p = run("generate", "--model", GOLDEN / "qwen35_other_ratios" / "text", "--prompt-ids", "1",
            "--device", "cuda", check=False)
    if p.returncode == 0:
        pytest.skip("this binary has the CUDA backend")
    assert "CUDA backend is not built" in p.stderr or "cuda" in p.stderr.lower()


def test_readme_run_path_make_tiny_then_generate(tmp_path):
    """What scripts/run.sh does without a checkpoint: make-tiny, then generate on the CPU."""
    model = tmp_path / "tiny"
    run("make-tiny", "--out", model, "--seed", 1)
    a = run("generate", "--model", model, "--device", "cpu", "--prompt-ids", "1,2,3,4", "--max-tokens", 16)
    ids = json.loads(a.stdout)  # no tokenizer in the folder: ids
    assert len(ids) == 16 and all(isinstance(i, int) for i in ids)
    b = run("generate", "--model", model, "--prompt-ids", "1,2,3,4", "--max-tokens", 16, "--chunk-size", 1)
    assert json.loads(b.stdout) == ids
    s = run("score", "--model", model, "--prompt-ids", ids_arg([1, 2, 3, 4] + ids), "--json")
    assert json.loads(s.stdout)["scored"] == 19
