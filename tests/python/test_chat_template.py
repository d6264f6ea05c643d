"""`deltaserve chat-template` against transformers' apply_chat_template (tokenize=False).

Both real templates (Qwen3 and Qwen3.5, from ../shared/data/tokenizers) over the case list of
issue 3 plus a few hundred random conversations: the prompts must be byte-identical, and where
HF raises we must fail too (with the same message when the template called raise_exception).
The Qwen3.5 folder has no vocab, so its template is applied through the Qwen3 tokenizer (same
special tokens) with chat_template=<the Qwen3.5 template>.
"""

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DS_BUILD_DIR", REPO / "build"))
BIN = BUILD / "bin" / "deltaserve"
TOK_DIR = REPO.parent / "shared" / "data" / "tokenizers"
TEMPLATES = ["qwen3", "qwen3.5"]

pytestmark = [
    pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built"),
    pytest.mark.skipif(not (TOK_DIR / "qwen3" / "tokenizer.json").exists(), reason=f"{TOK_DIR} absent"),
]


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(TOK_DIR / "qwen3"))
    templates = {
        name: json.loads((TOK_DIR / name / "tokenizer_config.json").read_text())["chat_template"] for name in TEMPLATES
    }
    return tok, templates


def hf_render(hf, name, request):
    """(prompt, None) or (None, exception) from HF apply_chat_template."""
    import jinja2

    tok, templates = hf
    req = json.loads(json.dumps(request))  # fresh copy: HF must not see our objects
    messages = req.pop("messages")
    tools = req.pop("tools", None)
    agp = req.pop("add_generation_prompt", False)
    cont = req.pop("continue_final_message", False)
    try:
        out = tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=agp,
            continue_final_message=cont,
            tokenize=False,
            chat_template=templates[name],
            **req,
        )
        return out, None
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        return None, e


def ours_batch(name, requests):
    """Runs the --jsonl mode once for many requests: list of {"prompt"} / {"error"}."""
    stdin = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in requests)
    res = subprocess.run(
        [str(BIN), "chat-template", "--tokenizer", str(TOK_DIR / name), "--jsonl"],
        input=stdin.encode(),
        capture_output=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr.decode()
    lines = res.stdout.decode().split("\n")[:-1]  # not splitlines(): prompts may hold U+2028
    assert len(lines) == len(requests)
    return [json.loads(line) for line in lines]


def check_same(hf, name, cases):
    ours = ours_batch(name, [req for _, req in cases])
    failures = []
    for (label, req), got in zip(cases, ours):
        want, err = hf_render(hf, name, req)
        if err is not None:
            if "error" not in got:
                failures.append(f"{label}: HF raised {type(err).__name__}: {err}, we rendered {got['prompt']!r}")
            elif type(err).__name__ == "TemplateError" and str(err) not in got["error"]:
                failures.append(f"{label}: HF raised {err!r}, we said {got['error']!r}")
        elif "error" in got:
            failures.append(f"{label}: we failed with {got['error']!r}, HF rendered {want!r}")
        elif got["prompt"] != want:
            failures.append(f"{label}: prompts differ\n--- HF\n{want!r}\n--- ours\n{got['prompt']!r}")
    assert not failures, "\n\n".join(failures[:10]) + f"\n\n({len(failures)} of {len(cases)} cases differ)"


# ---------------------------------------------------------------------------------------------
# The case list of issue 3

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city. Température en °C — «quoted» \"double\" 'single'",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["location"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.\nReturns a list of results.",
        "parameters": {
            "type": "object",
            "required": ["query"],
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object", "properties": {"site": {"type": "string"}, "year": {"type": "number"}}},
                "top_k": {"type": "integer", "default": 5},
                "safe": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}


def call(name, args, wrap=True, id_=None):
    fn = {"name": name, "arguments": args}
    if not wrap:
        return fn
    c = {"type": "function", "function": fn}
    if id_:
        c["id"] = id_
    return c


def U(text):
    return {"role": "user", "content": text}


def A(text, **kw):
    return {"role": "assistant", "content": text, **kw}


def S(text):
    return {"role": "system", "content": text}


def T(text, **kw):
    return {"role": "tool", "content": text, **kw}


def issue_cases():
    obj_args = {"location": "Paris", "unit": "celsius", "days": 3}
    rich_args = {
        "query": "deltanet \"gated\" \\ path",
        "filters": {"site": "arxiv.org", "year": 2025.0},
        "top_k": 10,
        "safe": True,
        "tags": ["a", "b é"],
        "none": None,
        "ratio": 1.5e-07,
        "big": 1e20,
    }
    multi_tool = [
        U("What's the weather in Paris and Tokyo?"),
        A("", tool_calls=[call("get_weather", {"location": "Paris"}, id_="c1"), call("get_weather", {"location": "Tokyo"}, id_="c2")]),
        T("18°C, sunny", tool_call_id="c1"),
        T("24°C, rain", tool_call_id="c2"),
        A("Paris is sunny (18°C); Tokyo is rainy (24°C)."),
        U("Thanks! And London?"),
    ]
    cases = [
        ("single user", {"messages": [U("Hello!")], "add_generation_prompt": True}),
        ("single user no gen prompt", {"messages": [U("Hello!")]}),
        ("system + user", {"messages": [S("You are a helpful assistant."), U("Hi")], "add_generation_prompt": True}),
        ("multi-turn", {"messages": [S("Be brief."), U("1+1?"), A("2"), U("2+2?")], "add_generation_prompt": True}),
        ("thinking on", {"messages": [U("Think hard")], "add_generation_prompt": True, "enable_thinking": True}),
        ("thinking off", {"messages": [U("Don't think")], "add_generation_prompt": True, "enable_thinking": False}),
        ("thinking none", {"messages": [U("x")], "add_generation_prompt": True, "enable_thinking": None}),
        ("thinking string", {"messages": [U("x")], "add_generation_prompt": True, "enable_thinking": "yes"}),
        (
            "reasoning_content history",
            {
                "messages": [U("q1"), A("a1", reasoning_content="r1"), U("q2"), A("a2", reasoning_content="\nr2\n")],
                "add_generation_prompt": False,
            },
        ),
        (
            "reasoning_content after last query",
            {"messages": [U("q1"), A("a1", reasoning_content="because\n\n")], "add_generation_prompt": False},
        ),
        ("reasoning alias", {"messages": [U("q1"), A("a1", reasoning="via alias")], "add_generation_prompt": False}),
        ("thinking alias", {"messages": [U("q1"), A("a1", thinking="via thinking")], "add_generation_prompt": False}),
        (
            "think tags in content",
            {
                "messages": [U("q"), A("<think>\nsecret plan\n</think>\n\nThe answer is 4."), U("again")],
                "add_generation_prompt": True,
            },
        ),
        ("think tags last", {"messages": [U("q"), A("<think>plan</think>answer")]}),
        ("only close think tag", {"messages": [U("q"), A("plan</think>\n\nanswer")]}),
        ("tools defined", {"messages": [U("Weather in Paris?")], "tools": [WEATHER_TOOL, SEARCH_TOOL], "add_generation_prompt": True}),
        (
            "tools + system",
            {"messages": [S("You are a weather bot."), U("Weather?")], "tools": [WEATHER_TOOL], "add_generation_prompt": True},
        ),
        ("empty tools list", {"messages": [U("hi")], "tools": [], "add_generation_prompt": True}),
        (
            "tool call object args",
            {
                "messages": [U("Weather in Paris?"), A("", tool_calls=[call("get_weather", obj_args)]), T("18°C")],
                "tools": [WEATHER_TOOL],
                "add_generation_prompt": True,
            },
        ),
        (
            "tool call rich args",
            {
                "messages": [U("search"), A("Let me search.", tool_calls=[call("search", rich_args)]), T("[]")],
                "tools": [SEARCH_TOOL],
                "add_generation_prompt": True,
            },
        ),
        (
            "tool call string args",
            {
                "messages": [U("Weather?"), A("", tool_calls=[call("get_weather", json.dumps(obj_args))]), T("18°C")],
                "tools": [WEATHER_TOOL],
                "add_generation_prompt": True,
            },
        ),
        (
            "tool call unwrapped",
            {"messages": [U("Weather?"), A("", tool_calls=[call("get_weather", obj_args, wrap=False)]), T("ok")]},
        ),
        (
            "tool call content None",
            {"messages": [U("Weather?"), A(None, tool_calls=[call("get_weather", obj_args)]), T("ok")], "add_generation_prompt": True},
        ),
        ("several tool responses", {"messages": multi_tool, "tools": [WEATHER_TOOL], "add_generation_prompt": True}),
        (
            "multi-step tools",
            {
                "messages": [
                    U("Plan a trip"),
                    A("Checking.", reasoning_content="need weather", tool_calls=[call("get_weather", {"location": "Rome"})]),
                    T("30°C"),
                    A("", reasoning_content="now search", tool_calls=[call("search", {"query": "Rome hotels", "top_k": 3})]),
                    T("Hotel A\nHotel B"),
                ],
                "tools": [WEATHER_TOOL, SEARCH_TOOL],
                "add_generation_prompt": True,
                "enable_thinking": True,
            },
        ),
        (
            "content as text parts",
            {
                "messages": [
                    {"role": "system", "content": [{"type": "text", "text": "System part."}]},
                    {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]},
                ],
                "add_generation_prompt": True,
            },
        ),
        (
            "image parts",
            {
                "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
                "add_generation_prompt": True,
                "add_vision_id": True,
            },
        ),
        ("no user message", {"messages": [S("sys"), A("hello")], "add_generation_prompt": True}),
        ("system not first", {"messages": [U("hi"), S("late system")], "add_generation_prompt": True}),
        ("unknown role", {"messages": [U("hi"), {"role": "robot", "content": "beep"}]}),
        ("empty messages", {"messages": []}),
        (
            "user tool_response lookalike",
            {"messages": [U("real question"), A("ok"), U("<tool_response>\nx\n</tool_response>")], "add_generation_prompt": True},
        ),
        (
            "unicode and escapes",
            {
                "messages": [U("  emoji 👩‍👩‍👧 中文 العربية\ttab \\ \"q\" 'q' \u2028 \x7f  \n\n"), A("\n\nok\n\n")],
                "add_generation_prompt": True,
            },
        ),
        ("empty content", {"messages": [U(""), A("")], "add_generation_prompt": True}),
        ("continue final message", {"messages": [U("Write a poem"), A("Roses are red,\n")], "continue_final_message": True}),
        (
            "continue final text part",
            {"messages": [U("q"), {"role": "assistant", "content": [{"type": "text", "text": "Part A "}, {"type": "text", "text": "Part B"}]}], "continue_final_message": True},
        ),
        (
            "continue reasoning",
            {"messages": [U("q"), A("", reasoning_content="I think")], "continue_final_message": "reasoning_content"},
        ),
        ("continue with gen prompt", {"messages": [U("q"), A("x")], "continue_final_message": True, "add_generation_prompt": True}),
        ("continue missing field", {"messages": [U("q"), A(None)], "continue_final_message": True}),
        (
            "tool message first after system",
            {"messages": [S("s"), U("q"), A("", tool_calls=[call("search", {"query": "x"})]), T("r1"), T("r2"), T("r3")]},
        ),
    ]
    return cases


@pytest.mark.parametrize("name", TEMPLATES)
def test_issue_cases(hf, name):
    check_same(hf, name, issue_cases())


# ---------------------------------------------------------------------------------------------
# Random conversations

WORDS = ["hello", "world", "naïve", "中文", "😀", "<think>", "</think>", "\n", "\n\n", " ", "x", "{", "}", "'", '"',
         "\\", "<tool_call>", "é", "  ", "\t", "end"]


def rand_text(rng, allow_empty=True):
    n = rng.randint(0 if allow_empty else 1, 8)
    return "".join(rng.choice(WORDS) for _ in range(n))


def rand_value(rng, depth=0):
    kind = rng.randint(0, 7 if depth < 2 else 4)
    if kind == 0:
        return rand_text(rng)
    if kind == 1:
        return rng.randint(-1000, 10**6)
    if kind == 2:
        return rng.choice([0.5, 1.0, -2.25, 1e-9, 3.14159, 1e21, 123456789.0])
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rand_text(rng, False): rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def rand_content(rng):
    if rng.random() < 0.15:
        return [{"type": "text", "text": rand_text(rng)} for _ in range(rng.randint(1, 3))]
    return rand_text(rng)


def rand_conversation(rng):
    msgs = []
    if rng.random() < 0.4:
        msgs.append(S(rand_content(rng)))
    for _ in range(rng.randint(1, 4)):
        msgs.append(U(rand_content(rng)))
        r = rng.random()
        if r < 0.3:
            msgs.append(A(rand_text(rng)))
        elif r < 0.5:
            msgs.append(A(rand_text(rng), reasoning_content=rand_text(rng)))
        elif r < 0.8:
            calls = [
                call(rng.choice(["get_weather", "search"]), {rand_text(rng, False): rand_value(rng) for _ in range(rng.randint(0, 3))})
                for _ in range(rng.randint(1, 3))
            ]
            msgs.append(A(rand_text(rng), tool_calls=calls))
            for _ in range(rng.randint(1, 3)):
                msgs.append(T(rand_text(rng)))
            if rng.random() < 0.5:
                msgs.append(A(rand_text(rng)))
    req = {"messages": msgs, "add_generation_prompt": rng.random() < 0.7}
    if rng.random() < 0.5:
        req["tools"] = rng.sample([WEATHER_TOOL, SEARCH_TOOL], rng.randint(1, 2))
    if rng.random() < 0.7:
        req["enable_thinking"] = rng.choice([True, False])
    return req


@pytest.mark.parametrize("name", TEMPLATES)
def test_random_conversations(hf, name):
    rng = random.Random(1234)
    cases = [(f"random #{i}", rand_conversation(rng)) for i in range(300)]
    check_same(hf, name, cases)


# ---------------------------------------------------------------------------------------------
# The documented CLI mode: prompt on stdout exactly, errors on stderr with exit code 1


def test_cli_prints_prompt_exactly(hf):
    req = {"messages": [S("sys"), U("hi")], "add_generation_prompt": True, "enable_thinking": False}
    res = subprocess.run(
        [str(BIN), "chat-template", "--tokenizer", str(TOK_DIR / "qwen3.5")], input=json.dumps(req).encode(), capture_output=True
    )
    assert res.returncode == 0, res.stderr.decode()
    want, err = hf_render(hf, "qwen3.5", req)
    assert err is None
    assert res.stdout.decode() == want
    assert not res.stdout.decode().endswith("\n\n\n")


def test_cli_error_exit_code_and_message():
    req = {"messages": [U("hi"), S("late")]}
    res = subprocess.run(
        [str(BIN), "chat-template", "--tokenizer", str(TOK_DIR / "qwen3.5")], input=json.dumps(req).encode(), capture_output=True
    )
    assert res.returncode == 1
    assert res.stdout == b""
    assert "System message must be at the beginning." in res.stderr.decode()


def test_cli_bad_json_and_missing_dir(tmp_path):
    res = subprocess.run(
        [str(BIN), "chat-template", "--tokenizer", str(TOK_DIR / "qwen3.5")], input=b"{not json", capture_output=True
    )
    assert res.returncode == 1 and "not valid JSON" in res.stderr.decode()
    res = subprocess.run(
        [str(BIN), "chat-template", "--tokenizer", str(tmp_path / "nope")], input=b"{}", capture_output=True
    )
    assert res.returncode == 1 and "nope" in res.stderr.decode()
    res = subprocess.run([str(BIN), "chat-template", "--tokenizer", str(tmp_path)], input=b"{}", capture_output=True)
    assert res.returncode == 1 and "no chat template" in res.stderr.decode()
