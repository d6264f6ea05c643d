"""`deltaserve serve` through the official `openai` client (CPU engine, tiny random checkpoint with
the Qwen3 tokenizer): models, completions and chat, streamed and not, stop strings, logprobs,
usage, n / several prompts, echo, tools, API key, return_token_ids, and outputs equal to
`deltaserve generate` for the same request (greedy and seeded sampling)."""
import json
import subprocess

import pytest

from server_util import BIN, DEVICE, TOKDIR, ServerProc, generate_cli, make_tiny_model, requires_server

pytestmark = requires_server

API_KEY = "sk-test-123"
PROMPTS = ["Hello, my name is", "The capital of France", "日本語のテキストと emoji 🎉 mixed"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ServerProc(model, "--max-batch", 4, "--max-model-len", 1024, "--chunk-size", 16, "--api-key", API_KEY,
                     "--served-model-name", "tiny", log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    code = srv.stop()
    assert code == 0, srv.log_text()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_generate(client, model, prompt):
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion"
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.text == generate_cli(model, prompt, 12)
    assert c.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_seeded_sampling_equals_generate(client, model):
    kw = dict(temperature=0.9, top_p=0.95, seed=1234)
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, extra_body={"top_k": 50}, **kw)
    expected = generate_cli(model, PROMPTS[0], 10, "--temperature", 0.9, "--top-p", 0.95, "--top-k", 50,
                            "--seed", 1234)
    assert r.choices[0].text == expected
    # Same seed, same text; another seed, (almost surely) another text.
    r2 = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, extra_body={"top_k": 50}, **kw)
    assert r2.choices[0].text == expected
    kw["seed"] = 99
    r3 = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, extra_body={"top_k": 50}, **kw)
    assert r3.choices[0].text != expected


def test_completion_stream_equals_nonstream(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    ids = {ch.id for ch in chunks}
    assert len(ids) == 1


def pick_stop(text: str):
    """A substring of `text` (whole characters) whose first occurrence is in the middle."""
    for start in range(3, len(text) - 2):
        for length in (3, 2):
            sub = text[start:start + length]
            if sub.strip() and text.find(sub) == start:
                return start, sub
    pytest.skip("no usable stop string in the generated text")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream, include):
    """The output ends before the first stop string; with vLLM's include_stop_str_in_output, after
    it (it still stops there)."""
    base = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0).choices[0].text
    at, stop = pick_stop(base)
    kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=["\x00never", stop],
              extra_body={"include_stop_str_in_output": True} if include else None)
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason][-1]
    else:
        r = client.completions.create(**kw)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert text == base[:at + len(stop) if include else at]
    assert reason == "stop"
    # vLLM's stop_reason: the stop string matched (in the last chunk when streamed).
    if stream:
        assert chunks[-1].model_dump()["choices"][0]["stop_reason"] == stop
    else:
        assert r.model_dump()["choices"][0]["stop_reason"] == stop


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_reason_and_text(client, server, stream):
    """A stop_token_ids stop: stop_reason is the id (vLLM's), its text is left out unless
    include_stop_str_in_output (as vLLM's detokenizer), and a length finish has stop_reason null."""
    base = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = base.model_dump()["choices"][0]["token_ids"]
    assert base.model_dump()["choices"][0]["stop_reason"] is None  # length
    k = next((i for i in range(2, len(ids)) if ids[i] not in ids[:i]), None)
    if k is None:
        pytest.skip("no fresh token to stop on")
    for include in (False, True):
        kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                  extra_body={"stop_token_ids": [ids[k]], "include_stop_str_in_output": include,
                              "return_token_ids": True, "ignore_eos": True})
        if stream:
            chunks = [ch.model_dump() for ch in client.completions.create(stream=True, **kw)]
            text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
            got_ids = sum((ch["choices"][0].get("token_ids") or [] for ch in chunks if ch["choices"]), [])
            last = chunks[-1]["choices"][0]
        else:
            last = client.completions.create(**kw).model_dump()["choices"][0]
            text, got_ids = last["text"], last["token_ids"]
        assert last["finish_reason"] == "stop" and last["stop_reason"] == ids[k]
        assert got_ids == ids[:k + 1]
        status, out = server.request("POST", "/detokenize",
                                     {"tokens": ids[:k + 1] if include else ids[:k]},
                                     headers={"Authorization": "Bearer " + API_KEY})
        assert status == 200, out
        want = json.loads(out)["prompt"]
        assert text == want, (include, text, want)


def test_continuous_usage_stats(client):
    """stream_options.continuous_usage_stats (with include_usage): every chunk carries its choice's
    usage so far, counting up to the final usage chunk's."""
    chunks = [ch.model_dump() for ch in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})]
    final = chunks[-1]
    assert not final["choices"] and final["usage"]["completion_tokens"] == 8
    seen = [ch["usage"] for ch in chunks[:-1]]
    assert seen and all(u is not None for u in seen)
    assert all(u["prompt_tokens"] == final["usage"]["prompt_tokens"] for u in seen)
    counts = [u["completion_tokens"] for u in seen]
    assert counts == sorted(counts) and counts[-1] == 8
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in seen)
    # Without continuous_usage_stats the chunks' usage stays null.
    chunks = [ch.model_dump() for ch in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert all(ch["usage"] is None for ch in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] > 0


def test_continue_final_message(client):
    """vLLM's continue_final_message: the prompt ends in the last (assistant) message's text, left
    open, with no generation prompt; together with add_generation_prompt it is a 400."""
    from tokenizers import Tokenizer
    import openai
    tk = Tokenizer.from_file(str(TOKDIR / "tokenizer.json"))
    messages = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "The answer is"}]
    kw = dict(model="tiny", messages=messages, max_tokens=3, temperature=0)
    r = client.chat.completions.create(extra_body={"continue_final_message": True, "return_token_ids": True},
                                       **kw).model_dump()
    prompt = tk.decode(r["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith("The answer is"), prompt
    r = client.chat.completions.create(extra_body={"return_token_ids": True}, **kw).model_dump()
    prompt = tk.decode(r["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n"), prompt
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(extra_body={"continue_final_message": True, "add_generation_prompt": True},
                                       **kw)
    assert e.value.body["param"] == "continue_final_message"


@pytest.mark.parametrize("extra,param", [
    ({"chat_template": "{{ raise_exception('boom') }}"}, "chat_template"),
    ({"echo": True}, "echo"),
])
def test_unsupported_options_are_refused(client, extra, param):
    """Options vLLM honours and this server cannot are refused by name, never silently ignored
    (echo false is the default and passes)."""
    import openai
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(extra_body=extra, **kw)
    assert e.value.body["param"] == param
    ok = {k: False for k in extra if k != "chat_template"}
    assert client.chat.completions.create(extra_body=ok, **kw).choices[0].finish_reason in ("stop", "length")


def test_logit_bias(client):
    """OpenAI's logit_bias: +100 on a token makes greedy pick it at every step, -100 on the greedy
    first token moves the first pick; streamed or not, and in chat too."""
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    ids = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0].model_dump()["token_ids"]
    assert len(ids) == 6
    forced = next(t for t in range(1000, 2000) if t not in ids)
    r = client.completions.create(**kw, logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].model_dump()["token_ids"] == [forced] * 6
    streamed = [t for ch in client.completions.create(**kw, stream=True, logit_bias={str(forced): 100},
                                                       extra_body={"return_token_ids": True})
                for c in ch.choices for t in (c.model_dump().get("token_ids") or [])]
    assert streamed == [forced] * 6
    r = client.completions.create(**kw, logit_bias={str(ids[0]): -100}, extra_body={"return_token_ids": True})
    assert r.choices[0].model_dump()["token_ids"][0] != ids[0]
    # Seeded sampling with the bias: still only the forced token (it dominates after temperature 1).
    r = client.completions.create(**{**kw, "temperature": 1.0}, seed=7, logit_bias={str(forced): 100},
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_dump()["token_ids"] == [forced] * 6
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logit_bias={str(forced): 100},
                                       extra_body={"return_token_ids": True})
    assert c.choices[0].model_dump()["token_ids"] == [forced] * 3


def test_allowed_token_ids_and_truncate_prompt_tokens(client):
    """vLLM's allowed_token_ids (only those ids are sampled, at any temperature) and
    truncate_prompt_tokens (the prompt's last k tokens, as if sent alone)."""
    import openai
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=8)
    allowed = [1000, 1001, 1002]
    for t in (0, 1.5):
        r = client.completions.create(**kw, temperature=t, seed=3,
                                      extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
        ids = r.choices[0].model_dump()["token_ids"]
        assert len(ids) == 8 and set(ids) <= set(allowed), ids
    full = client.completions.create(**kw, temperature=0, extra_body={"return_token_ids": True}).model_dump()
    prompt_ids = full["choices"][0]["prompt_token_ids"]
    assert len(prompt_ids) > 3
    cut = client.completions.create(**kw, temperature=0, extra_body={"return_token_ids": True,
                                                                      "truncate_prompt_tokens": 3}).model_dump()
    alone = client.completions.create(model="tiny", prompt=prompt_ids[-3:], max_tokens=8, temperature=0)
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["prompt_token_ids"] == prompt_ids[-3:]
    assert cut["choices"][0]["text"] == alone.choices[0].text
    # Past the context length: a 400 naming it.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"truncate_prompt_tokens": 1025})
    assert e.value.body["param"] == "truncate_prompt_tokens"
    # min_tokens with nothing allowed but stop ids: a 400, not a failed generation.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"allowed_token_ids": [151643], "min_tokens": 2})
    assert e.value.body["param"] == "allowed_token_ids"
    # Longer than the prompt, or -1 (the context length): the whole prompt.
    for k in (1000, -1):
        r = client.completions.create(**kw, temperature=0, extra_body={"truncate_prompt_tokens": k})
        assert r.usage.prompt_tokens == len(prompt_ids) and r.choices[0].text == full["choices"][0]["text"]


def test_min_tokens(client):
    """vLLM's min_tokens: the stop ids are not sampled and stop strings do not end the output until
    that many tokens are out."""
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    ids = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0].model_dump()["token_ids"]
    forced = next(t for t in range(1000, 2000) if t not in ids)
    body = {"return_token_ids": True, "stop_token_ids": [forced]}
    # The bias makes the stop id the greedy pick: without min_tokens it ends the output at once...
    r = client.completions.create(**kw, logit_bias={str(forced): 100}, extra_body=body).choices[0]
    assert r.model_dump()["token_ids"] == [forced] and r.finish_reason == "stop" and r.text == ""
    # ... with min_tokens 3 the first 3 picks are the unbiased greedy ones, the 4th the stop id.
    r = client.completions.create(**kw, logit_bias={str(forced): 100}, extra_body={**body, "min_tokens": 3})
    c = r.choices[0]
    assert c.model_dump()["token_ids"] == ids[:3] + [forced] and c.finish_reason == "stop"
    assert r.usage.completion_tokens == 4
    # min_tokens == max_tokens: no stop at all.
    c = client.completions.create(**kw, logit_bias={str(forced): 100},
                                  extra_body={**body, "min_tokens": 8}).choices[0]
    assert c.model_dump()["token_ids"] == ids and c.finish_reason == "length"
    # No bias: within min_tokens the stop id is banned, so greedy takes the next best there; the
    # stop id ends the output only after it (greedy, the unbiased continuation).
    stop_id = ids[2]
    c = client.completions.create(**kw, extra_body={"return_token_ids": True, "stop_token_ids": [stop_id]}).choices[0]
    assert c.model_dump()["token_ids"] == ids[:3] and c.finish_reason == "stop"
    c = client.completions.create(**kw, extra_body={"return_token_ids": True, "stop_token_ids": [stop_id],
                                                    "min_tokens": 3}).choices[0]
    got = c.model_dump()["token_ids"]
    assert got[:2] == ids[:2] and got[2] != stop_id and stop_id not in got[:3] and len(got) > 3
    # EOS is banned the same way (here made the greedy pick by a bias), unless ignore_eos.
    eos = 151643  # <|endoftext|>, an EOS id of the Qwen3 tokenizer
    c = client.completions.create(**kw, logit_bias={str(eos): 100},
                                  extra_body={"return_token_ids": True, "min_tokens": 2}).choices[0]
    assert c.model_dump()["token_ids"] == ids[:2] + [eos] and c.finish_reason == "stop"
    # A stop string inside the first min_tokens tokens' text does not stop the output, also when
    # that text was held back as the start of a longer stop string (the match must reach past it).
    lp = client.completions.create(**kw, logprobs=1).choices[0].logprobs
    first = lp.tokens[0]
    assert first, "the test prompt's first token must have text"
    base_text = "".join(lp.tokens)
    for stops in ([first[-1]], [first[-1], first[-1] + "\x00never"]):
        assert client.completions.create(**kw, stop=stops).choices[0].text == first[:-1]
        c = client.completions.create(**kw, stop=stops, extra_body={"min_tokens": 1}).choices[0]
        cut = base_text.find(first[-1], len(first))
        assert c.text == (base_text if cut < 0 else base_text[:cut]), stops
        assert c.finish_reason == ("length" if cut < 0 else "stop")


def test_logprobs_completions(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(val, abs=1e-6)  # greedy: the chosen token is the best
    assert lp.text_offset[0] == 0
    assert all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    # Sampled: each position's top entries hold the token itself besides the `logprobs` best
    # (OpenAI's legacy format, as vLLM): logprobs=0 gives just the token.
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.5,
                                  seed=1, logprobs=0)
    lp = r.choices[0].logprobs
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert list(top.keys()) == [tok]
        assert top[tok] == val
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.5,
                                  seed=1, logprobs=2)
    lp2 = r.choices[0].logprobs
    assert lp2.tokens == lp.tokens  # same seed, same tokens
    for tok, val, top in zip(lp2.tokens, lp2.token_logprobs, lp2.top_logprobs):
        assert 2 <= len(top) <= 3 and top[tok] == val
    # An echo whose text has a character split over tokens (each shown as U+FFFD): text_offset
    # counts token by token through the echo and the output alike, as vLLM (the output's offsets
    # used to start at the echo text's length, overlapping the echo's last token).
    r = client.completions.create(model="tiny", prompt="a\U0001d11e b", max_tokens=3,
                                  temperature=0, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    assert "\ufffd" in lp.tokens
    assert lp.text_offset[0] == 0
    assert all(b == a + len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))


def test_logprobs_chat(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token or "\ufffd" in item.token


def rendered_prompt(model, messages, **kw):
    """The prompt our chat template renders (HF equality is tests/python/test_chat_template.py's job)."""
    req = {"messages": messages, "add_generation_prompt": True, **kw}
    p = subprocess.run([str(BIN), "chat-template", "--tokenizer", str(model)], input=json.dumps(req).encode(),
                       capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    return p.stdout.decode()


def test_chat_equals_generate_on_rendered_prompt(client, model):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant"
    prompt = rendered_prompt(model, messages, enable_thinking=False)
    expected = generate_cli(model, prompt, 10)
    got = (getattr(msg, "reasoning_content", None) or "") + (msg.content or "")
    # The parser may move a <think> block to reasoning_content; the raw text is the same tokens.
    assert got.replace("<think>", "").replace("</think>", "").strip() == \
        expected.replace("<think>", "").replace("</think>", "").strip()
    assert r.usage.prompt_tokens == len(__import__("tokenizers").Tokenizer.from_file(
        str(TOKDIR / "tokenizer.json")).encode(prompt, add_special_tokens=False).ids)


def test_think_tag_in_a_message_is_text(client):
    """A literal <think> in a user (or system) message does not put the answer in reasoning: only
    the turn being generated decides (it made every token reasoning_content, and lost tool calls)."""
    kw = dict(model="tiny", max_tokens=8, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for text in ("What does the <think> tag do?", "What does the tag do?"):
        r = client.chat.completions.create(
            messages=[{"role": "system", "content": "Wrap notes in <think> tags."},
                      {"role": "user", "content": text}], **kw)
        msg = r.choices[0].message
        assert (msg.content or "") != "" and not getattr(msg, "reasoning_content", None), (text, msg)
    # No generation prompt at all: nothing of the output's turn is in the prompt.
    r = client.chat.completions.create(
        messages=[{"role": "user", "content": "What does the <think> tag do?"}],
        model="tiny", max_tokens=8, temperature=0, extra_body={"add_generation_prompt": False})
    msg = r.choices[0].message
    assert (msg.content or "") != "" and not getattr(msg, "reasoning_content", None), msg


def test_chat_stream_equals_nonstream(client):
    messages = [{"role": "user", "content": "Count to three."}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices)
    assert content == (full.choices[0].message.content or "")
    assert reasoning == (getattr(full.choices[0].message, "reasoning_content", None) or "")
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]



def test_return_token_ids_chat_and_completions(client):
    """return_token_ids: the streamed ids (one list per chunk) equal the non-streamed ones, decode
    to the same text, and count as usage.completion_tokens; prompt_token_ids are the prompt."""
    from tokenizers import Tokenizer
    tk = Tokenizer.from_file(str(TOKDIR / "tokenizer.json"))
    messages = [{"role": "user", "content": "Count to three."}]
    extra = {"return_token_ids": True, "ignore_eos": True}
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                          extra_body=extra).model_dump()
    ids = full["choices"][0]["token_ids"]
    assert len(ids) == full["usage"]["completion_tokens"] == 10
    assert len(full["prompt_token_ids"]) == full["usage"]["prompt_tokens"]
    chunks = [ch.model_dump() for ch in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True, extra_body=extra)]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert [i for ch in chunks if ch["choices"] for i in ch["choices"][0].get("token_ids") or []] == ids
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=9, temperature=0,
                                  extra_body=extra).model_dump()
    c = r["choices"][0]
    assert tk.decode(c["token_ids"], skip_special_tokens=True) == c["text"]
    assert c["prompt_token_ids"] == tk.encode(PROMPTS[2], add_special_tokens=False).ids
    streamed, text = [], ""
    for ch in client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=9, temperature=0, stream=True,
                                        extra_body=extra):
        if ch.choices:
            d = ch.choices[0].model_dump()
            streamed += d.get("token_ids") or []
            text += d["text"]
    assert streamed == c["token_ids"] and text == c["text"]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def test_chat_with_tools(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="auto",
                                       max_tokens=4, temperature=0)
    # The tools are rendered into the prompt by the template.
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # A multi-turn conversation with a previous tool call and its result renders and runs.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    r2 = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    # tool_choice none: the tools are still rendered (vLLM's default), only calls are not parsed.
    r3 = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                        max_tokens=4, temperature=0)
    assert r3.usage.prompt_tokens == r.usage.prompt_tokens
    assert r3.choices[0].finish_reason in ("stop", "length")


def test_n_and_several_prompts(client):
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in PROMPTS[:2]]
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == alone
    r2 = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=5, n=3)
    assert len(r2.choices) == 3 and r2.usage.completion_tokens <= 24
    assert len({c.text for c in r2.choices}) >= 2  # seeds seed, seed+1, seed+2
    streamed = {}
    for ch in client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=8, temperature=0, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[0], streamed[1]] == alone


def test_echo_and_token_id_prompt(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.choices[0].text == PROMPTS[0] + plain.choices[0].text
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(TOKDIR / "tokenizer.json")).encode(PROMPTS[0], add_special_tokens=False).ids
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert r2.choices[0].text == plain.choices[0].text
    assert r2.usage.prompt_tokens == len(ids)


def test_api_key_required(server):
    status, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"
    status, _ = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1},
                               headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"})
    assert status == 401
    status, _ = server.request("GET", "/v1/models")
    assert status == 401
    assert server.healthy()  # /health and /metrics need no key
    assert "deltaserve_num_requests_running" in server.metrics()


def test_usage_and_finish_reason_length(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_stream_is_incremental(client):
    """Chunks arrive as tokens are generated, not all at the end. The GPU engine makes 200 tokens
    of the tiny model in ~30 ms, too fast to see a spread: there the request asks for 1000 (the
    context is 1024), ~0.15 s."""
    import time
    n = 200 if DEVICE == "cpu" else 1000
    t0 = time.time()
    times = []
    for ch in client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=n, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].text:
            times.append(time.time() - t0)
    assert len(times) >= n // 10  # many chunks (a chunk may hold several tokens)
    if times[-1] < 0.05:
        pytest.skip(f"generation too fast ({times[-1]:.3f} s for {n} tokens) to see the spread")
    assert times[0] < 0.5 * times[-1], times
    assert len({round(t, 3) for t in times}) >= 20  # spread over time, not one burst


def test_tokenize_and_detokenize(server, client):
    """vLLM's /tokenize (a prompt, or chat messages through the model's template) and /detokenize:
    the ids and token strings of HF `tokenizers`, the chat ids those of a chat completion's prompt,
    the API key required, and bad bodies a 400 naming the field."""
    from tokenizers import Tokenizer
    tk = Tokenizer.from_file(str(TOKDIR / "tokenizer.json"))
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def post(path, body, headers=auth):
        status, raw = server.request("POST", path, body, headers=headers)
        return status, json.loads(raw)

    for prompt in PROMPTS + ["<|im_start|>user\nhi<|im_end|>", " \t\n  x"]:
        status, r = post("/tokenize", {"model": "tiny", "prompt": prompt, "return_token_strs": True})
        assert status == 200, r
        ref = tk.encode(prompt, add_special_tokens=False)
        assert r["tokens"] == ref.ids and r["count"] == len(ref.ids)
        assert r["token_strs"] == [tk.id_to_token(i) for i in ref.ids]
        assert r["max_model_len"] == 1024
        status, d = post("/detokenize", {"model": "tiny", "tokens": r["tokens"]})
        assert status == 200 and d["prompt"] == tk.decode(ref.ids, skip_special_tokens=False) == prompt
    status, r = post("/tokenize", {"prompt": "abc"})
    assert status == 200 and r["token_strs"] is None
    # A split UTF-8 character decodes lossily, as HF does.
    ids = tk.encode("𓀀", add_special_tokens=False).ids
    assert len(ids) > 1
    status, d = post("/detokenize", {"tokens": ids[:1]})
    assert status == 200 and d["prompt"] == tk.decode(ids[:1], skip_special_tokens=False)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0,
                                          extra_body={"return_token_ids": True}).model_dump()
    status, r = post("/tokenize", {"messages": messages})
    assert status == 200 and r["tokens"] == chat["prompt_token_ids"]
    status, r2 = post("/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and r2["tokens"] == r["tokens"][:len(r2["tokens"])] and len(r2["tokens"]) < len(r["tokens"])

    assert post("/tokenize", {"prompt": "x"}, headers={})[0] == 401
    assert post("/detokenize", {"tokens": [1]}, headers={})[0] == 401
    for path, body, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ]:
        status, r = post(path, body)
        assert status == 400 and r["error"]["param"] == param, (path, body, r)
    status, r = post("/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404
    status, _ = server.request("GET", "/tokenize", headers=auth)
    assert status == 405
