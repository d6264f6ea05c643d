"""Continuous batching through HTTP: 32 concurrent streaming clients (more than the 8 slots, so
requests queue) with random cancellations; every request completes with the same text as when it
ran alone (greedy, batch invariance: exact on the CPU engine) or is cancelled with a prefix of it;
afterwards /metrics shows no running / waiting request and no state slot or KV block in use. Also:
a client that drops a NON-streaming request frees its slot, the waiting-queue bound answers 429
without disturbing running requests, and SIGTERM drains running streams before exiting 0."""
import json
import random
import socket
import threading
import time

import pytest

from server_util import DEVICE, ServerProc, make_tiny_model, requires_server, run_concurrently

pytestmark = requires_server

N_CLIENTS = 32
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = ServerProc(model, "--max-batch", 8, "--max-model-len", 512, "--chunk-size", 8,
                     "--max-num-batched-tokens", 48, "--max-waiting", 64,
                     log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log_text()


def client_for(server):
    from openai import OpenAI
    return OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)


def wait_drained(server, timeout=20.0):
    deadline = time.time() + timeout
    m = {}
    while time.time() < deadline:
        m = server.metrics()
        if (m["deltaserve_num_requests_running"] == 0 and m["deltaserve_num_requests_waiting"] == 0
                and m["deltaserve_state_slots_used"] == 0 and m["deltaserve_kv_blocks_used"] == 0):
            return m
        time.sleep(0.05)
    raise AssertionError(f"engine did not drain: {m}")


def prompt_of(i):
    return f"Request {i}: " + " ".join(["lorem", "ipsum", "dolor", "sit", "amet"][: 1 + i % 5]) * (1 + i % 3)


def test_32_streaming_clients_with_cancellations(server):
    client = client_for(server)
    alone = [client.completions.create(model="m", prompt=prompt_of(i), max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for i in range(N_CLIENTS)]
    rng = random.Random(7)
    cancel_after = {i: rng.randint(1, 6) for i in rng.sample(range(N_CLIENTS), 10)}
    results = [None] * N_CLIENTS
    start = threading.Barrier(N_CLIENTS)

    def run(i):
        c = client_for(server)
        start.wait()
        stream = c.completions.create(model="m", prompt=prompt_of(i), max_tokens=MAX_TOKENS, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        text, finish, n = "", None, 0
        for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            n += 1
            if i in cancel_after and n >= cancel_after[i]:
                stream.close()  # the client goes away mid-stream
                finish = "cancelled"
                break
        results[i] = (text, finish)

    errors = run_concurrently(N_CLIENTS, run)
    assert not errors, errors
    # Batch invariance is exact on the CPU engine (every row computed on its own). The CUDA engine
    # batches rows in bf16 GEMMs, so near-tied logits (random weights!) can flip: there only the
    # shape of the results is checked and the agreement is printed.
    exact = DEVICE == "cpu"
    same = 0
    for i, (text, finish) in enumerate(results):
        if finish == "cancelled":
            assert not exact or alone[i].startswith(text), (i, text, alone[i])
        else:
            assert finish == "length", (i, finish)
            assert not exact or text == alone[i], (i, text, alone[i])
            same += text == alone[i]
    print(f"{same} completed requests identical to their alone run ({DEVICE})")
    m = wait_drained(server)
    assert m['deltaserve_request_finished_total{finish_reason="cancelled"}'] >= 1
    assert m['deltaserve_request_finished_total{finish_reason="error"}'] == 0
    assert m["deltaserve_state_slots_total"] == 8
    assert server.healthy()


def test_dropped_nonstreaming_request_frees_its_slot(server):
    body = json.dumps({"prompt": "a long one", "max_tokens": 400, "temperature": 0, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.time() + 10
    while time.time() < deadline and server.metrics()["deltaserve_num_requests_running"] == 0:
        time.sleep(0.01)
    assert server.metrics()["deltaserve_num_requests_running"] == 1
    s.close()  # gone before the answer
    t0 = time.time()
    wait_drained(server, timeout=5)
    assert time.time() - t0 < 5
    m = server.metrics()
    assert m["deltaserve_generation_tokens_total"] >= 0
    assert server.healthy()


def test_queue_bound_answers_429_and_running_requests_finish(model, tmp_path):
    srv = ServerProc(model, "--max-batch", 1, "--max-waiting", 1, "--max-model-len", 1024,
                     log_path=tmp_path / "server.log")
    try:
        statuses, texts = [], []
        lock = threading.Lock()

        def one():
            status, body = srv.request("POST", "/v1/completions", {"prompt": "queue", "max_tokens": 900,
                                                                   "temperature": 0, "ignore_eos": True})
            with lock:
                statuses.append(status)
                if status == 200:
                    texts.append(json.loads(body)["choices"][0]["text"])
                else:
                    err = json.loads(body)["error"]
                    assert err["type"] == "rate_limit_error" and err["code"] == 429

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.02)
        for t in threads:
            t.join(timeout=120)
        assert statuses.count(429) >= 1, statuses
        assert statuses.count(200) >= 2, statuses
        assert len(set(texts)) == 1  # every admitted request got the full, same answer
        wait_drained(srv)
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_sigterm_drains_running_streams(model, tmp_path):
    srv = ServerProc(model, "--max-batch", 2, "--max-model-len", 1024, log_path=tmp_path / "server.log")
    client = client_for(srv)
    got = {}

    def stream():
        text, finish = "", None
        for ch in client.completions.create(model="m", prompt="drain me", max_tokens=120, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}):
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
        got["text"], got["finish"] = text, finish

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.time() + 10
    while time.time() < deadline and srv.metrics()["deltaserve_num_requests_running"] == 0:
        time.sleep(0.01)
    srv.proc.send_signal(__import__("signal").SIGTERM)
    time.sleep(0.1)
    # New work is refused while draining (or the listener is already gone).
    try:
        status, body = srv.request("POST", "/v1/completions", {"prompt": "late", "max_tokens": 2}, timeout=5)
        assert status == 503, body
    except OSError:
        pass
    t.join(timeout=120)
    assert got.get("finish") == "length"
    assert srv.proc.wait(timeout=60) == 0
    assert "shutting down" in srv.log_text()
