#!/usr/bin/env python3
"""Builds a Qwen3.5 *test* tokenizer.json from the official Qwen3.5 merges.txt.

The official Qwen3.5 vocab.json / tokenizer.json are not available here, so the vocabulary is
reconstructed: ids 0..255 are the GPT-2 byte alphabet (in bytes_to_unicode order, as in every
Qwen vocabulary), then token(256 + i) = left + right of merge i. Normaliser (NFC) and split regex
are Qwen3.5's (from tokenizer_config.json `pretokenize_regex`, identical to SPEC.md); added tokens
come from tokenizer_config.json `added_tokens_decoder`.

NOTE: ids up to 100665 equal the official ones; beyond that the official vocabulary holds 201
extra tokens that have no merge, so ids above 100665 are NOT the official ids (they are shifted
by up to 201). The encode/decode *machinery* is still exercised exactly. Those 201 tokens are
stood in for by unreachable placeholders `<|qwen35_test_unused_N|>` (ids 247843..248043), so the
vocabulary has the official size and the added tokens their official ids (248044..248076).

Usage: make_qwen35_test_tokenizer.py SRC_DIR OUT_DIR
  SRC_DIR holds merges.txt + tokenizer_config.json (../shared/data/tokenizers/qwen3.5);
  OUT_DIR receives tokenizer.json and a copy of tokenizer_config.json.
"""
import json
import os
import shutil
import sys

QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_alphabet():
    """GPT-2 bytes_to_unicode, in its id order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def build(src_dir, out_dir):
    with open(os.path.join(src_dir, "merges.txt"), encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f]
    merges = [ln for ln in lines if ln and not ln.startswith("#version")]
    with open(os.path.join(src_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)

    vocab = {}
    for i, ch in enumerate(byte_alphabet()):
        vocab[ch] = i
    pairs = []
    for i, ln in enumerate(merges):
        a, b = ln.split(" ")
        merged = a + b
        if merged in vocab:
            raise SystemExit(f"merges.txt line {i + 1}: {merged!r} is produced twice")
        vocab[merged] = 256 + i
        pairs.append([a, b])
    # A few merges use a token that a *later* merge produces (27 in Qwen3.5); every part must
    # exist somewhere in the vocabulary.
    for i, (a, b) in enumerate(pairs):
        if a not in vocab or b not in vocab:
            raise SystemExit(f"merges.txt line {i + 1}: token not in the vocabulary: {a!r} {b!r}")

    # Pad to the official model vocabulary size (the first added token's id) with placeholder
    # tokens no merge can produce, so that added tokens keep their official ids: HF tokenizers
    # renumbers added tokens that would leave a gap after the model vocabulary.
    first_added = min((int(k) for k in config.get("added_tokens_decoder", {})), default=len(vocab))
    n_pad = first_added - len(vocab)
    if n_pad < 0:
        raise SystemExit(f"vocabulary ({len(vocab)}) overlaps the added tokens ({first_added})")
    for i in range(n_pad):
        vocab[f"<|qwen35_test_unused_{i}|>"] = len(vocab)

    regex = config.get("pretokenize_regex", QWEN35_SPLIT_REGEX)
    if regex != QWEN35_SPLIT_REGEX:
        raise SystemExit("tokenizer_config.json pretokenize_regex differs from SPEC.md")

    added = []
    for key, tok in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
        added.append({
            "id": int(key),
            "content": tok["content"],
            "single_word": tok.get("single_word", False),
            "lstrip": tok.get("lstrip", False),
            "rstrip": tok.get("rstrip", False),
            "normalized": tok.get("normalized", False),
            "special": tok.get("special", False),
        })

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": vocab, "merges": pairs,
        },
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    shutil.copyfile(os.path.join(src_dir, "tokenizer_config.json"),
                    os.path.join(out_dir, "tokenizer_config.json"))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    build(sys.argv[1], sys.argv[2])
