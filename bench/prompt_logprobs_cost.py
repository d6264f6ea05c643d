"""What prompt logprobs cost a served request: against a running `deltaserve serve` (BASE, default
http://127.0.0.1:8000), the same token-id prompt of each length with max_tokens 1, plain, with
OpenAI's echo + logprobs 1 (lm-eval's loglikelihood request) and with vLLM's prompt_logprobs 5;
prints the median wall time of REPEATS requests each and the extra per prompt token. The ids are
fixed (i * 7919 mod 200000) so runs compare."""
import json
import os
import statistics
import sys
import time
import urllib.request

BASE = os.environ.get("BASE", "http://127.0.0.1:8000")
LENGTHS = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "512,2048,4096").split(",")]
REPEATS = int(os.environ.get("REPEATS", "3"))


def post(body):
    req = urllib.request.Request(BASE + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t, out


for n in LENGTHS:
    ids = [(i * 7919) % 200000 for i in range(n)]
    base = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    arms = {"plain": {}, "echo+logprobs 1": {"echo": True, "logprobs": 1},
            "prompt_logprobs 5": {"prompt_logprobs": 5}}
    times = {}
    for name, extra in arms.items():
        post(dict(base, **extra))  # warm-up
        ts = []
        for _ in range(REPEATS):
            dt, out = post(dict(base, **extra))
            ts.append(dt)
        ch = out["choices"][0]
        got = len((ch.get("logprobs") or {}).get("tokens", [])) or len(ch.get("prompt_logprobs") or [])
        times[name] = statistics.median(ts)
        print(f"prompt {n}: {name:18s} {times[name] * 1e3:9.1f} ms (median of {REPEATS}), "
              f"{got} entries; +{(times[name] - times['plain']) / n * 1e6:.0f} us per prompt token",
              flush=True)
