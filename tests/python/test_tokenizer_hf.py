"""`deltaserve tokenize` / `detokenize` against the Hugging Face `tokenizers` library.

Both load the same tokenizer.json; ids and decoded text must be identical on a broad corpus
(scripts, emoji, NFC/NFD, code, digits, whitespace, special-token text, invalid UTF-8, empty
input, long pieces) and on 10,000 seeded random strings. Two tokenizers:
  - qwen3: the complete official Qwen3 tokenizer.json (../shared/data/tokenizers/qwen3);
  - qwen3.5: a test tokenizer.json built by tools/make_qwen35_test_tokenizer.py from the official
    Qwen3.5 merges.txt + tokenizer_config.json. Its ids 0..100665 are the official ids; ids above
    100665 are NOT the official ones (the official vocabulary has 201 merge-less tokens that
    shift later ids), so only the golden ids within that range are compared exactly.
Invalid UTF-8 on stdin is decoded as Python does with errors="replace" (each maximal ill-formed
subsequence -> U+FFFD) before encoding; the HF side is given that same str.
"""
import functools
import json
import os
import random
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data" / "tokenizers"
BUILD = Path(os.environ.get("DS_BUILD_DIR", REPO / "build"))
BIN = BUILD / "bin" / "deltaserve"

pytestmark = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"tokenizer test data {SHARED} is absent (../shared/data)")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
            "<|vision_pad|>", "<tool_response>"]

CORPUS = [
    "",
    " ",
    "a",
    "Hello world",
    "Hello, world! How's it going? I'm fine; we'll see. They've said: \"don't\".",
    "IT'S ALL CAPS AND I'LL SHOUT, WE'VE, THEY'RE, HE'D",
    "The quick brown fox jumps over the lazy dog. " * 20,
    "  leading and trailing spaces  ",
    "tabs\tand\t\ttabs\n\nnewlines\r\nwindows\r\n\r\n",
    "\n\n\n\n\n",
    "                                                   x",
    "a \n b  \n\n  c   \t\n",
    " \u00a0 \u2000\u2001 \u3000 \u0085 \u180e \u200b \u2028 \u2029 \u202f \u205f x",
    "我爱北京天安门。今天天气很好，我们去公园散步吧！",
    "女孩，杰作，无文字",
    "日本語のテキストです。カタカナとひらがな、漢字を混ぜます。",
    "한국어 텍스트입니다. 안녕하세요!",
    "\u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u1173\u11af",  # Hangul jamo (NFC composes)
    "مرحبا بالعالم، هذا نص عربي.",
    "Русский текст с цифрами 12345 и знаками препинания.",
    "Ελληνικά κείμενα και ελληνική γλώσσα",
    "हिन्दी पाठ का उदाहरण।",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "emoji 👋🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️ thumbs 👍🏿 rainbow 🏳️‍🌈",
    "café naïve résumé",  # precomposed
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301",  # NFD: must equal the NFC result
    "\u0041\u030a\u212b\u00c5 \u1e9b\u0323 \u0071\u0307\u0323",
    "e\u0301\u0301\u0301 \u0300start",
    "def foo(x: int) -> int:\n    return x ** 2  # square\n\nprint(foo(3))\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * c[i]; }\n",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "1234567890" * 10,
    "3.14159265358979 1,000,000 $5.99 50% 2024-01-01T12:00:00Z",
    "١٢٣٤٥ ０１２３ ⅠⅡⅢ ½ ²³",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHi!<|im_end|>",
    "text<|im_end|>text <|endoftext|> x<|im_start|>y",
    "<|im_end|<|im_end|>>",
    "<think>reasoning</think>answer <tool_call>{\"a\": 1}</tool_call>",
    "<|unknown_special|> <|im_end>",
    "'s 's 'S 'll 'LL 're 've 'm 'd 't ſ 'ſ",
    "!!!???...,,,;;;:::---___***",
    "\x00\x01\x02\x7f control \x1b[31mred\x1b[0m",
    "\ufeffBOM and \ufffd replacement and \uffff",
    "mixed 中文 English 日本語 한국어 العربية 123 😀",
]

RANDOM_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " ",
    "  \t\n\r\n",
    ".,;:!?'\"()[]{}<>/\\|-_+=*&^%$#@~`",
    "'s'S'll're've'm'd't",
    "éèêëàâäôöùûüçñÅåæøßÿ",
    "\u0300\u0301\u0302\u0303\u0308\u0323\u0327\u034f",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黑",
    "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコ",
    "가나다라마바사아자차카타파하한국어글안녕세요",
    "\u1100\u1101\u1161\u1162\u11a8\u11ab",
    "ابتثجحخدذرزسشصضطظعغفقكلمنهوي،؟",
    "абвгдежзийклмнопрстуфхцчшщъыьэюя",
    "😀😁😂🤣😃👍👋🏻🏼🏽🏾🏿\u200d\ufe0f❤🔥✨🎉👨👩👧👦🇫🇷",
    "\u00a0\u2000\u2003\u3000\u0085\u180e\u200b\u2028\u202f",
    "١٢٣٠١２３",
]
RANDOM_SPECIALS = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>", "</think>"]


def random_strings(n, seed=1234):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(0, 40)
        parts = []
        pools = rng.sample(RANDOM_POOLS, rng.randint(1, 4))
        for _ in range(k):
            if rng.random() < 0.02:
                parts.append(rng.choice(RANDOM_SPECIALS))
                continue
            pool = rng.choice(pools)
            run = rng.randint(1, 6)
            parts.append("".join(rng.choice(pool) for _ in range(run)))
        out.append("".join(parts))
    return out


def random_codepoint_strings(n, seed=4321):
    """Code points from the whole Unicode range (no surrogates), heavy on combining marks: checks
    that our character classes and NFC use the same Unicode data as HF (Unicode 16 classes,
    Unicode 9.0 NFC tables)."""
    rng = random.Random(seed)

    def one():
        r = rng.random()
        if r < 0.3:
            return chr(rng.randrange(0x80, 0x3000))
        if r < 0.5:
            return chr(rng.randrange(0x3000, 0xD800))
        if r < 0.6:
            return chr(rng.randrange(0x10000, 0x32000))
        if r < 0.8:
            return rng.choice("aAsS' \n\t1.,\u00e9")
        return chr(rng.randrange(0x300, 0x370))

    return ["".join(one() for _ in range(rng.randint(0, 20))) for _ in range(n)]


def run_cli(args, data):
    if not BIN.exists():
        pytest.fail(f"{BIN} not found: build the `deltaserve` target (DS_BUILD_DIR={BUILD})")
    return subprocess.run([str(BIN), *args], input=data, capture_output=True, timeout=600)


def cli_ok(args, data):
    r = run_cli(args, data)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout


def split_lines(out):
    # Not str.splitlines(): that also splits on U+2028, U+0085, ... inside the JSON strings.
    text = out.decode()
    assert text == "" or text.endswith("\n")
    return text.split("\n")[:-1]


def cli_encode_batch(tok_dir, texts, no_special=False):
    lines = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts).encode()
    args = ["tokenize", "--tokenizer", str(tok_dir), "--jsonl"] + (["--no-special"] if no_special else [])
    out = split_lines(cli_ok(args, lines))
    assert len(out) == len(texts)
    return [json.loads(x) for x in out]


def cli_decode_batch(tok_dir, id_lists, skip_special=False, stream=False):
    lines = "".join(json.dumps(ids) + "\n" for ids in id_lists).encode()
    args = ["detokenize", "--tokenizer", str(tok_dir), "--jsonl"]
    args += (["--skip-special"] if skip_special else []) + (["--stream"] if stream else [])
    out = split_lines(cli_ok(args, lines))
    assert len(out) == len(id_lists)
    return [json.loads(x) for x in out]


@pytest.fixture(scope="session")
def qwen35_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen35_test_tokenizer")
    subprocess.run([sys.executable, str(REPO / "tools" / "make_qwen35_test_tokenizer.py"),
                    str(SHARED / "qwen3.5"), str(out)], check=True)
    return out


@pytest.fixture(scope="session", params=["qwen3", "qwen3.5"])
def tok_dir(request, qwen35_dir):
    return SHARED / "qwen3" if request.param == "qwen3" else qwen35_dir


@functools.lru_cache(maxsize=None)
def hf_tokenizer(tok_dir, encode_special_tokens=False):
    t = tokenizers.Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    t.encode_special_tokens = encode_special_tokens
    return t


def hf_encode_batch(tok, texts):
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def long_texts():
    rng = random.Random(7)
    return [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(200_000)),  # one huge piece
        "".join(rng.choice(RANDOM_POOLS[7]) for _ in range(30_000)),  # CJK, no spaces
        "9" * 20_000,
        " " * 50_000 + "x",
        "\n" * 10_000 + "end",
    ]


NFC_NFD = ["café naïve résumé Ångström", "cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030angstro\u0308m"]
ENCODE_TEXTS = CORPUS + long_texts() + random_strings(10_000) + random_codepoint_strings(5_000) + NFC_NFD


@pytest.fixture(scope="session")
def encoded(tok_dir):
    """Our ids for ENCODE_TEXTS, with and without special-token matching (one CLI call each)."""
    return {no_special: cli_encode_batch(tok_dir, ENCODE_TEXTS, no_special)
            for no_special in (False, True)}


def assert_same(texts, ours, theirs, what):
    bad = [(t, o, h) for t, o, h in zip(texts, ours, theirs) if o != h]
    assert not bad, f"{what}: {len(bad)} of {len(texts)} differ; first: text={bad[0][0][:200]!r} " \
                    f"ours={bad[0][1][:50]} hf={bad[0][2][:50]}"


@pytest.mark.parametrize("no_special", [False, True])
def test_encode_matches_hf(tok_dir, encoded, no_special):
    # Corpus, long pieces, 10,000 seeded random strings, 5,000 of random code points.
    hf = hf_tokenizer(tok_dir, encode_special_tokens=no_special)
    assert_same(ENCODE_TEXTS, encoded[no_special], hf_encode_batch(hf, ENCODE_TEXTS),
                f"encode (no_special={no_special})")


def test_nfd_input_encodes_like_nfc(encoded):
    a, b = encoded[False][-2:]
    assert a == b


def test_special_text_is_plain_text_with_no_special(tok_dir, encoded):
    i = CORPUS.index("text<|im_end|>text <|endoftext|> x<|im_start|>y")
    im_end = hf_tokenizer(tok_dir).token_to_id("<|im_end|>")
    assert im_end in encoded[False][i]
    assert im_end not in encoded[True][i]


@pytest.fixture(scope="session")
def decode_inputs(tok_dir):
    hf = hf_tokenizer(tok_dir)
    id_lists = hf_encode_batch(hf, CORPUS + random_strings(2_000, seed=99))
    # Random id sequences (including special tokens) cut multi-byte characters apart.
    rng = random.Random(5)
    n = hf.get_vocab_size()
    specials = [hf.token_to_id(s) for s in SPECIALS if hf.token_to_id(s) is not None]
    for _ in range(2_000):
        id_lists.append([rng.choice(specials) if rng.random() < 0.1 else rng.randrange(n)
                         for _ in range(rng.randint(0, 12))])
    return id_lists


@pytest.mark.parametrize("skip_special", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_decode_matches_hf(tok_dir, decode_inputs, skip_special, stream):
    ours = cli_decode_batch(tok_dir, decode_inputs, skip_special, stream)
    theirs = hf_tokenizer(tok_dir).decode_batch(decode_inputs, skip_special_tokens=skip_special)
    assert_same(decode_inputs, ours, theirs, f"decode (skip_special={skip_special}, stream={stream})")


def test_token_strings_match_hf(tok_dir):
    """`detokenize --token-strs` (Tokenizer::token_string, the strings of the server's /tokenize
    return_token_strs) for every id of the vocabulary: HF's id_to_token (None where no token)."""
    hf = hf_tokenizer(tok_dir)
    n = hf.get_vocab_size(with_added_tokens=True)
    ids = list(range(n))
    ours = json.loads(cli_ok(["detokenize", "--tokenizer", str(tok_dir), "--token-strs"], json.dumps(ids).encode()))
    theirs = [hf.id_to_token(i) for i in ids]
    bad = [(i, a, b) for i, a, b in zip(ids, ours, theirs) if a != b]
    assert not bad, f"{len(bad)} of {n} differ, first {bad[:5]}"
    assert sum(s is not None for s in ours) > 100_000
    lines = cli_ok(["detokenize", "--tokenizer", str(tok_dir), "--token-strs", "--jsonl"], b"[0, 1]\n[2]\n")
    assert [json.loads(x) for x in split_lines(lines)] == [theirs[:2], theirs[2:3]]


def test_roundtrip(tok_dir, encoded):
    texts = ENCODE_TEXTS[len(CORPUS) + 5:len(CORPUS) + 5 + 3_000]
    ids = encoded[False][len(CORPUS) + 5:len(CORPUS) + 5 + 3_000]
    # The NFC normaliser is part of encoding (e.g. U+2000 becomes U+2002).
    assert cli_decode_batch(tok_dir, ids) == [unicodedata.normalize("NFC", t) for t in texts]


INVALID_UTF8 = [
    b"\xff",
    b"abc\x80def",
    b"\xc3 x",  # truncated 2-byte sequence
    b"\xe4\xb8 x \xe4\xb8\xad",
    b"\xed\xa0\x80 surrogate",
    b"\xc0\xaf overlong",
    b"\xf4\x90\x80\x80 too big",
    b"\xf0\x9f\x98 broken emoji \xf0\x9f\x98\x80",
    b"<|im_end|>\xfe<|im_start|>",
]


@pytest.mark.parametrize("data", [
    b" | ".join(INVALID_UTF8),
    b"ends in a truncated character \xe4\xb8",
    b"",
    "h\u00e9llo\n".encode(),
])
def test_raw_stdin_bytes_match_hf(tok_dir, data):
    # Raw stdin (not --jsonl): bytes are decoded like Python's errors="replace".
    hf = hf_tokenizer(tok_dir)
    ours = json.loads(cli_ok(["tokenize", "--tokenizer", str(tok_dir)], data))
    assert ours == hf.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids


def test_detokenize_plain_output_has_no_trailing_newline(tok_dir):
    hf = hf_tokenizer(tok_dir)
    ids = hf.encode("Hello\nworld", add_special_tokens=False).ids
    out = cli_ok(["detokenize", "--tokenizer", str(tok_dir)], json.dumps(ids).encode())
    assert out == b"Hello\nworld"


def test_qwen35_golden_ids(qwen35_dir):
    # From ../shared/data/tokenizers/README.md (official Qwen3.5 ids).
    golden = {
        "girl, ": [27620, 11, 220],
        "1girl, masterpiece, no text": [16, 27620, 11, 56744, 11, 874, 1414],
        "女孩，杰作，无文字": [100665, 3709, 140724, 3709, 95979, 99943],
    }
    token_counts = json.loads((SHARED / "qwen3.5" / "qwen35_token_golden.json").read_text())
    texts = list(golden) + [g["text"] for g in token_counts]
    ours = cli_encode_batch(qwen35_dir, texts)
    for text, got in zip(golden, ours):
        want = golden[text]
        assert len(got) == len(want), (text, got, want)
        for g, w in zip(got, want):
            if w <= 100665:
                assert g == w, (text, got, want)
            else:
                # Beyond 100665 the test vocabulary lacks the official merge-less tokens, so
                # the id is lower by their count before it (0 < shift <= 201).
                assert 0 < w - g <= 201, (text, got, want)
    for g, ids in zip(token_counts, ours[len(golden):]):
        assert len(ids) == g["tokens"], (g["text"], ids)
    hf = hf_tokenizer(qwen35_dir)
    for name, want in [("<|endoftext|>", 248044), ("<|im_start|>", 248045), ("<|im_end|>", 248046),
                       ("<think>", 248068), ("</think>", 248069)]:
        assert hf.token_to_id(name) == want


def test_vocab_json_merges_txt_fallback_matches_tokenizer_json(qwen35_dir, tmp_path):
    # Same tokenizer from vocab.json + merges.txt + tokenizer_config.json (no tokenizer.json).
    j = json.loads((qwen35_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (tmp_path / "vocab.json").write_text(json.dumps(j["model"]["vocab"], ensure_ascii=False),
                                         encoding="utf-8")
    (tmp_path / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in j["model"]["merges"]), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_bytes((qwen35_dir / "tokenizer_config.json").read_bytes())
    texts = CORPUS + random_strings(1_000, seed=11)
    hf = hf_tokenizer(qwen35_dir)
    assert_same(texts, cli_encode_batch(tmp_path, texts), hf_encode_batch(hf, texts), "fallback")


@pytest.mark.parametrize("stdin,needle", [
    (b"[1, 2, 99999999]", b"out of range"),
    (b"[-1]", b"out of range"),
    (b"[1, \"x\"]", b"not an integer"),
    (b"{not json", b"not valid JSON"),
])
def test_detokenize_errors(stdin, needle):
    r = run_cli(["detokenize", "--tokenizer", str(SHARED / "qwen3")], stdin)
    assert r.returncode == 1
    assert needle in r.stderr, r.stderr


def test_missing_tokenizer_dir_error(tmp_path):
    r = run_cli(["tokenize", "--tokenizer", str(tmp_path / "nope")], b"x")
    assert r.returncode == 1 and b"does not exist" in r.stderr
    r = run_cli(["tokenize", "--tokenizer", str(tmp_path)], b"x")
    assert r.returncode == 1 and b"neither tokenizer.json nor vocab.json" in r.stderr
