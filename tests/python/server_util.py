"""Helpers for the `deltaserve serve` tests: a tiny random checkpoint whose vocabulary covers the
Qwen3 tokenizer (made with `deltaserve make-tiny`, the tokenizer files copied next to it at test
time, never committed), and a server process on a free port (started, health-checked, stopped with
SIGTERM; its log is printed when a test fails)."""
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DS_BUILD_DIR", REPO / "build"))
BIN = BUILD / "bin" / "deltaserve"
TOKDIR = Path(os.environ.get("DS_QWEN3_TOKENIZER_DIR", REPO.parent / "shared" / "data" / "tokenizers" / "qwen3"))
QWEN3_VOCAB = 151669  # highest added-token id + 1
# The backend of every server and `deltaserve generate` these tests start: cpu (default, CI) or cuda
# (scripts/gpu_server_test.sh: the same tests on the GPU engine). DS_TEST_DEVICE wins over the
# older name DS_SERVE_DEVICE.
DEVICE = os.environ.get("DS_TEST_DEVICE") or os.environ.get("DS_SERVE_DEVICE") or "cpu"
if DEVICE != "cpu" and DEVICE != "cuda" and not DEVICE.startswith("cuda:"):
    raise RuntimeError(f"DS_TEST_DEVICE={DEVICE!r}: expected cpu, cuda or cuda:N")

requires_server = pytest.mark.skipif(
    not BIN.exists() or not (TOKDIR / "tokenizer.json").exists(),
    reason=f"needs {BIN} and ../shared/data/tokenizers/qwen3 (shared test data)")


def make_tiny_model(dest: Path, seed: int = 1) -> Path:
    subprocess.run([str(BIN), "make-tiny", "--out", str(dest), "--seed", str(seed), "--vocab", str(QWEN3_VOCAB)],
                   check=True, capture_output=True, timeout=300)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKDIR / name, dest / name)
    return dest


SERVING_RE = re.compile(r"deltaserve: serving '.*' on http://[^:\s]+:(\d+) ")


class ServerProc:
    """`deltaserve serve --port 0`: the server binds a free port itself and names it in its log
    (picking one here and passing it would leave a window for another process to take it)."""

    def __init__(self, model: Path, *extra, log_path: Path):
        self.port = None
        self.base = None
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.args = [str(BIN), "serve", "--model", str(model), "--port", "0", "--device", DEVICE,
                     *map(str, extra)]
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log_text()}")
            if self.port is None:
                m = SERVING_RE.search(self.log_text())
                if not m:
                    time.sleep(0.05)
                    continue
                self.port = int(m.group(1))
                self.base = f"http://127.0.0.1:{self.port}"
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log_text()}")

    def log_text(self) -> str:
        if not self.log.closed:  # stop() closes it; the file stays readable
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    # Plain HTTP without the openai client (for error cases and metrics).
    def request(self, method: str, path: str, body=None, headers=None, timeout: float = 60):
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers or {})
        if data is not None and "Content-Type" not in (headers or {}):
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metrics(self) -> dict:
        status, body = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def healthy(self) -> bool:
        status, _ = self.request("GET", "/health", timeout=10)
        return status == 200


def wait_counter_delta(server: ServerProc, name: str, before: dict, delta: float, timeout: float = 10) -> dict:
    """Polls /metrics until counter `name` rose by at least `delta` since `before` (some counters,
    like the cancelled finish reason, are counted in the HTTP handler's cleanup, after the engine
    already let the request go); returns the last metrics. The caller asserts the exact delta."""
    deadline = time.time() + timeout
    m = server.metrics()
    while m[name] - before[name] < delta and time.time() < deadline:
        time.sleep(0.05)
        m = server.metrics()
    return m


def run_concurrently(n: int, fn, timeout: float = 300) -> list:
    """Runs fn(i) for i in range(n) on n threads (fn may wait on a threading.Barrier(n) to start
    them together); returns [(i, repr(exception)), ...] for the calls that raised."""
    import threading
    errors = []

    def one(i):
        try:
            fn(i)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return errors


def generate_cli(model: Path, prompt: str, max_tokens: int, *extra) -> str:
    """`deltaserve generate` text for the same request (skip special tokens, like the server)."""
    p = subprocess.run([str(BIN), "generate", "--model", str(model), "--prompt", prompt, "--max-tokens",
                        str(max_tokens), "--skip-special", "-q", "--device", DEVICE, *map(str, extra)],
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    out = p.stdout.decode()
    assert out.endswith("\n")
    return out[:-1]
