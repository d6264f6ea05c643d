"""`deltaserve serve` on a model folder without a tokenizer (needs no shared test data, so it runs
in any clean clone): token-id prompts, generated ids read back from logprobs ("token_id:N"),
equal to `deltaserve generate --output ids`; stop_token_ids; text prompts, stop strings and chat
refused with 400; 32 concurrent streams with cancellations give the same ids as alone (exact on
the CPU engine) and leave no slot in use."""
import json
import random
import subprocess
import threading
import time

import pytest

from server_util import BIN, DEVICE, ServerProc

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")

VOCAB = 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "m"
    subprocess.run([str(BIN), "make-tiny", "--out", str(d), "--seed", "3", "--vocab", str(VOCAB)], check=True,
                   capture_output=True, timeout=300)
    return d


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ServerProc(model, "--max-batch", 8, "--max-model-len", 512, "--chunk-size", 8,
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
    alone = [ids_of(complete(server, p, 16)["choices"][0]["logprobs"]) for p in prompts]
    rng = random.Random(3)
    cancel = set(rng.sample(range(32), 8))
    results, errors = [None] * 32, []
    barrier = threading.Barrier(32)

    def run(i):
        import http.client
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
            barrier.wait()
            conn.request("POST", "/v1/completions", json.dumps({
                "prompt": prompts[i], "max_tokens": 16, "temperature": 0, "logprobs": 0, "ignore_eos": True,
                "stream": True}), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            ids, finish, events = [], None, 0
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ch = json.loads(line[6:])["choices"][0]
                if ch["logprobs"]:
                    ids += [int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]]
                finish = ch["finish_reason"] or finish
                events += 1
                if i in cancel and events >= 3:
                    conn.close()
                    finish = "cancelled"
                    break
            results[i] = (ids, finish)
        except Exception as e:  # noqa: BLE001
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    exact = DEVICE == "cpu"
    for i, (ids, finish) in enumerate(results):
        if finish == "cancelled":
            assert not exact or alone[i][:len(ids)] == ids, i
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
    assert m['deltaserve_request_finished_total{finish_reason="cancelled"}'] >= 1
    assert server.healthy()
