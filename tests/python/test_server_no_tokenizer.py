"""`deltaserve serve` on a model folder without a tokenizer (needs no shared test data, so it runs
in any clean clone): token-id prompts, generated ids read back from logprobs ("token_id:N"),
equal to `deltaserve generate --output ids`; stop_token_ids; text prompts, stop strings and chat
refused with 400; 32 concurrent streams with cancellations give the same ids as alone (exact on
the CPU engine) and leave no slot in use; return_token_ids streams the ids without logprobs."""
import json
import random
import subprocess
import threading
import time

import pytest

from server_util import BIN, DEVICE, ServerProc, run_concurrently, wait_counter_delta

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")

VOCAB = 1024
LONG_TOKENS = 3000  # with --max-model-len 4096: a request that runs for seconds even on the GPU engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "m"
    subprocess.run([str(BIN), "make-tiny", "--out", str(d), "--seed", "3", "--vocab", str(VOCAB)], check=True,
                   capture_output=True, timeout=300)
    return d


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ServerProc(model, "--max-batch", 8, "--max-model-len", 4096, "--chunk-size", 8,
                     log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def ids_of(choice_logprobs):
    return [int(t.split(":")[1]) for t in choice_logprobs["tokens"]]


def complete(server, prompt, max_tokens, **kw):
    status, body = server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                              "temperature": 0, "logprobs": 0,
                                                              "ignore_eos": True, **kw})
    assert status == 200, body
    return json.loads(body)


def test_ids_equal_generate(server, model):
    prompt = [5, 17, 300, 42, 7, 999, 3]
    r = complete(server, prompt, 12)
    c = r["choices"][0]
    assert c["text"] == ""  # no tokenizer, no text
    p = subprocess.run([str(BIN), "generate", "--model", str(model), "--prompt-ids", ",".join(map(str, prompt)),
                        "--max-tokens", "12", "--output", "ids", "--ignore-eos", "-q", "--device", DEVICE],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert ids_of(c["logprobs"]) == json.loads(p.stdout)
    assert r["usage"] == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19}
    assert c["finish_reason"] == "length"


def test_stop_token_ids(server):
    ids = ids_of(complete(server, [1, 2, 3], 10)["choices"][0]["logprobs"])
    stop = ids[3]
    first = ids.index(stop)
    r = complete(server, [1, 2, 3], 10, stop_token_ids=[stop])
    c = r["choices"][0]
    assert c["finish_reason"] == "stop"
    assert ids_of(c["logprobs"]) == ids[:first + 1]  # the stop id is generated (and counted)
    assert r["usage"]["completion_tokens"] == first + 1


def test_text_features_refused_without_tokenizer(server):
    for path, body in [("/v1/completions", {"prompt": "text", "max_tokens": 2}),
                       ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stop": ["x"]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
        status, out = server.request("POST", path, body)
        assert status == 400, out
        assert json.loads(out)["error"]["type"] == "invalid_request_error"
    status, out = server.request("POST", "/v1/completions", {"prompt": [VOCAB + 1], "max_tokens": 2})
    assert status == 400 and b"vocabulary" in out


def test_32_concurrent_streams_with_cancellations(server):
    prompts = [[(i * 37 + k * 11) % VOCAB for k in range(3 + i % 9)] for i in range(32)]
    rng = random.Random(3)
    cancel = set(rng.sample(range(32), 8))
    # A cancelled stream may have read more than 16 ids (a chunk holds all ids since the last write).
    alone = [ids_of(complete(server, p, 64 if i in cancel else 16)["choices"][0]["logprobs"])
             for i, p in enumerate(prompts)]
    before = server.metrics()
    results = [None] * 32
    barrier = threading.Barrier(32)

    def run(i):
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        barrier.wait()
        # The cancelling clients ask for LONG_TOKENS: still generating when they leave, on any engine.
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": prompts[i], "max_tokens": LONG_TOKENS if i in cancel else 16, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        ids, finish, events, left = [], None, 0, False
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            if ch["logprobs"]:
                ids += [int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]]
            finish = ch["finish_reason"] or finish  # as the server reported it
            events += 1
            if i in cancel and events >= 3:
                conn.close()
                left = True
                break
        results[i] = (ids, finish, left)

    errors = run_concurrently(32, run)
    assert not errors, errors
    exact = DEVICE == "cpu"
    for i, (ids, finish, left) in enumerate(results):
        if i in cancel:
            assert left and finish is None, (i, left, finish)  # left before the server ended the stream
            n = min(len(ids), len(alone[i]))
            assert not exact or alone[i][:n] == ids[:n], i
        else:
            assert finish == "length" and len(ids) == 16, (i, finish, ids)
            assert not exact or ids == alone[i], (i, ids, alone[i])
    deadline = time.time() + 20
    while True:
        m = server.metrics()
        if m["deltaserve_num_requests_running"] == 0 and m["deltaserve_state_slots_used"] == 0 and \
                m["deltaserve_num_requests_waiting"] == 0:
            break
        assert time.time() < deadline, m
        time.sleep(0.05)
    cancelled = 'deltaserve_request_finished_total{finish_reason="cancelled"}'
    m = wait_counter_delta(server, cancelled, before, len(cancel))
    # Each was still running when its client left, and the server cancelled it.
    assert m[cancelled] - before[cancelled] == len(cancel), (m[cancelled], before[cancelled])
    assert server.healthy()


def stream_events(server, body):
    """The parsed `data:` events of a streamed completion (without [DONE]) and whether [DONE] came."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events, done = [], False
    for line in resp:
        line = line.strip()
        if line == b"data: [DONE]":
            done = True
            break
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
    conn.close()
    return events, done


def test_return_token_ids_without_tokenizer(server):
    """return_token_ids (vLLM's extension): without a tokenizer there is no text, yet every token
    is streamed as an id (no logprobs needed to count or read them); the ids equal the logprobs
    ids, the non-streamed token_ids and the usage count; prompt_token_ids once per choice."""
    prompt = [9, 100, 31, 7, 512]
    # 200 tokens: enough engine steps that the stream writer wakes before the last one even on a
    # loaded 2-core CI machine (with 10, all tokens were sometimes ready before the first write).
    n = 200
    want = ids_of(complete(server, prompt, n)["choices"][0]["logprobs"])
    base = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    status, body = server.request("POST", "/v1/completions", base)
    assert status == 200, body
    c = json.loads(body)["choices"][0]
    assert c["token_ids"] == want and c["prompt_token_ids"] == prompt and c["logprobs"] is None

    events, done = stream_events(server, {**base, "stream_options": {"include_usage": True}})
    assert done
    ids, prompt_ids, token_chunks = [], [], 0
    for ev in events:
        for ch in ev["choices"]:
            assert ch["logprobs"] is None
            if "token_ids" in ch:
                token_chunks += 1
                ids += ch["token_ids"]
            prompt_ids += ch.get("prompt_token_ids", [])
    assert ids == want and prompt_ids == prompt
    assert token_chunks >= 2  # streamed as they come, not in one piece at the end
    assert events[-1]["usage"]["completion_tokens"] == len(want)
    # Without the flag: no ids in the chunks (and no text without a tokenizer).
    events, done = stream_events(server, {k: v for k, v in base.items() if k != "return_token_ids"})
    assert done and all("token_ids" not in ch for ev in events for ch in ev["choices"])
    status, body = server.request("POST", "/v1/completions", {**base, "return_token_ids": "yes"})
    assert status == 400 and "return_token_ids" in json.loads(body)["error"]["message"]


def test_return_token_ids_several_choices_stream(server):
    """Two prompts x n=2 in one streamed request: the writer wakes on any choice's output (one
    notifier per request, no polling); each choice's ids equal the request alone."""
    prompts = [[4, 5, 6], [700, 1, 2, 3]]
    alone = [ids_of(complete(server, p, 8)["choices"][0]["logprobs"]) for p in prompts]
    events, done = stream_events(server, {"prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 0,
                                          "ignore_eos": True, "return_token_ids": True})
    assert done
    got, finish = {}, {}
    for ev in events:
        for ch in ev["choices"]:
            got.setdefault(ch["index"], []).extend(ch.get("token_ids", []))
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert [got[i] for i in range(4)] == [alone[0], alone[0], alone[1], alone[1]]
    assert finish == {i: "length" for i in range(4)}
