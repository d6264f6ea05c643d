#!/usr/bin/env python3
"""`bench serve` over HTTP: PERF.md's concurrency-1 workload against a running `deltaserve serve`
(or any OpenAI-compatible server that takes token-id prompts), measured from the client side.

Buckets 4K-8K, 8K-16K, 16K-32K prompt tokens, N requests each (lengths and token ids from a fixed
seed, as `deltaserve bench serve` draws them), 128 output tokens, EOS ignored, greedy, streamed.
TTFT = time to the first streamed chunk that carries a token; TPOT = (end - first token) /
(completion tokens - 1, from the usage block); throughput = output tokens / end-to-end time;
weighted 20/50/30.
How tokens are seen in the stream (--count, in the JSON as meta.token_counting):
  ids (auto's first choice): the request asks for "return_token_ids" (a vLLM extension that
      deltaserve serves): every chunk carries the ids of its new tokens, so tokens are counted
      exactly, with or without a tokenizer on the server, and the server does no extra work;
  text: one token per chunk with text (as OpenAI benchmark clients do; needs a server tokenizer);
  logprobs: the "token_id:N" entries of logprobs; this makes the server compute a log-softmax over
      the vocabulary per token (about 2 ms per token on the 27B synthetic model in the first H200
      run), so its TPOT is not comparable with the in-process bench.
auto takes ids, else text, else logprobs, whichever the server streams first.
Engine-side timings: when the server has a Prometheus /metrics (deltaserve serve does), the
engine's own TTFT/TPOT of each request (the quantities the in-process bench reports) are read
from its histogram sums before and after the request, so every bucket also shows the per-token
HTTP overhead (client TPOT - engine TPOT) measured on the same requests.
Standard library only. Output: a table and, with --json, the same "serve" layout as deltaserve's
JSON (mode "HTTP ...").

Usage: serve_http.py --url http://127.0.0.1:8000 [--requests 5] [--output-tokens 128]
                     [--vocab 248320] [--scale 1.0] [--json FILE] [--api-key KEY]
                     [--prompts-from BENCH.json] [--count auto|ids|text|logprobs]
--scale multiplies the bucket bounds (e.g. 0.01 for a dry run against a tiny CPU model).
--prompts-from takes the prompt lengths of each bucket from the "serve" part of a `deltaserve
bench serve --json` file, so that both runs serve exactly the same requests (the in-process bench
draws them with its own generator); --requests and --scale are then ignored.
"""
import argparse
import http.client
import json
import random
import sys
import time
import urllib.parse

BUCKETS = [("4K-8K", 4096, 8192, 0.2), ("8K-16K", 8192, 16384, 0.5), ("16K-32K", 16384, 32768, 0.3)]


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    pos = q / 100 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def engine_sums(url, key):
    """(TTFT sum, TPOT sum, TPOT count) of the server's /metrics histograms, or None."""
    u = urllib.parse.urlparse(url)
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
        conn.request("GET", u.path.rstrip("/") + "/metrics",
                     headers={"Authorization": f"Bearer {key}"} if key else {})
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", "replace") if resp.status == 200 else ""
        conn.close()
    except OSError:
        return None
    vals = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("deltaserve_time_to_first_token_seconds_sum",
                                            "deltaserve_time_per_output_token_seconds_sum",
                                            "deltaserve_time_per_output_token_seconds_count"):
            vals[parts[0]] = float(parts[1])
    if len(vals) != 3:
        return None
    return (vals["deltaserve_time_to_first_token_seconds_sum"], vals["deltaserve_time_per_output_token_seconds_sum"],
            vals["deltaserve_time_per_output_token_seconds_count"])


def one_request(url, key, prompt, max_tokens, count):
    """(TTFT or None when no chunk carried a token, end-to-end time, completion tokens, how the
    tokens were seen: "ids", "text", "logprobs" or None)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=3600)
    req = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True}}
    if count in ("ids", "auto"):
        req["return_token_ids"] = True
    if count == "logprobs":
        req["logprobs"] = 0
    body = json.dumps(req)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    conn.request("POST", u.path.rstrip("/") + "/v1/completions", body=body, headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        sys.exit(f"serve_http.py: HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft, n_tokens, usage, seen = None, 0, None, None
    for raw in resp:
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            break
        msg = json.loads(data)
        if msg.get("usage"):
            usage = msg["usage"]
        for ch in msg.get("choices", ()):
            ids = ch.get("token_ids")
            if ids is not None:
                got, how = len(ids), "ids"
            else:
                lp = ch.get("logprobs") or {}
                got = len(lp.get("tokens") or ())
                how = "logprobs"
                if not got and ch.get("text"):
                    got, how = 1, "text"
            if got:
                seen = seen or how
                if ttft is None:
                    ttft = time.perf_counter() - t0
            n_tokens += got
    e2e = time.perf_counter() - t0
    conn.close()
    if usage and usage.get("completion_tokens"):
        n_tokens = usage["completion_tokens"]
    return ttft, e2e, n_tokens, seen


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=248320, help="token ids are drawn below this")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--api-key")
    ap.add_argument("--prompts-from", help="bench JSON whose serve buckets give the prompt lengths")
    ap.add_argument("--count", choices=("auto", "ids", "text", "logprobs"), default="auto",
                    help="how tokens are seen in the stream (see above)")
    ap.add_argument("--logprobs", choices=("auto", "on", "off"), default=None,
                    help="old spelling: on = --count logprobs, off = --count text")
    a = ap.parse_args()
    given = None
    if a.prompts_from:
        try:
            with open(a.prompts_from) as f:
                given = {b["bucket"]: list(b["prompts"]) for b in json.load(f)["serve"]["buckets"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"serve_http.py: --prompts-from {a.prompts_from}: no serve buckets ({type(e).__name__}: {e})")
    if a.requests < 1 or a.output_tokens < 1 or a.scale <= 0:
        sys.exit("serve_http.py: --requests, --output-tokens and --scale must be positive")
    if a.logprobs is not None and a.count == "auto":
        a.count = {"on": "logprobs", "off": "text", "auto": "auto"}[a.logprobs]
    rng = random.Random(a.seed)
    count = a.count  # "auto" until the first request shows what the server streams
    engine = engine_sums(a.url, a.api_key) is not None
    buckets, weighted = [], 0.0
    print(f"{'bucket':<8} {'n':>2} {'TTFT p50 ms':>12} {'p99':>10} {'TPOT p50 ms':>12} {'p99':>8} {'tok/s':>7}"
          + (f" {'engine TTFT':>11} {'engine TPOT':>11} {'HTTP +us/tok':>12}" if engine else ""))
    for name, lo, hi, w in BUCKETS:
        lo, hi = max(1, int(lo * a.scale)), max(2, int(hi * a.scale))
        ttft, tpot, prompts, e2e_sum, out_sum = [], [], [], 0.0, 0
        eng_ttft, eng_tpot, overhead = [], [], []
        lengths = given.get(name, []) if given is not None else [rng.randrange(lo, hi) for _ in range(a.requests)]
        if not lengths:
            continue
        for n in lengths:
            prompts.append(n)
            prompt = [rng.randrange(a.vocab) for _ in range(n)]
            before = engine_sums(a.url, a.api_key) if engine else None
            t, e, k, seen = one_request(a.url, a.api_key, prompt, a.output_tokens, count)
            if count == "auto" and t is None and k > 0:
                print("serve_http.py: the server streams neither token ids nor text: tokens counted through "
                      "logprobs from here on (the server then computes a log-softmax per token)", flush=True)
                count = "logprobs"
                before = engine_sums(a.url, a.api_key) if engine else None
                t, e, k, seen = one_request(a.url, a.api_key, prompt, a.output_tokens, count)
            if t is None:
                sys.exit("serve_http.py: the stream carried no token (no token ids, text or logprobs tokens)")
            if count == "auto":
                count = seen
            after = engine_sums(a.url, a.api_key) if before else None
            if after and after[2] == before[2] + 1:
                eng_ttft.append(after[0] - before[0])
                eng_tpot.append(after[1] - before[1])
                if k > 1:
                    overhead.append((e - t) / (k - 1) - eng_tpot[-1])
            ttft.append(t)
            if k > 1:
                tpot.append((e - t) / (k - 1))
            e2e_sum += e
            out_sum += k
        thr = out_sum / e2e_sum
        weighted += w * thr
        summ = lambda xs: {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "min": min(xs) if xs else None,  # noqa: E731
                           "max": max(xs) if xs else None, "mean": sum(xs) / len(xs) if xs else None}
        b = {"bucket": name, "lo": lo, "hi": hi, "weight": w, "prompts": prompts, "ttft_s": summ(ttft),
             "tpot_s": summ(tpot), "throughput_tok_per_s": thr}
        if eng_tpot:
            b["engine_ttft_s"] = summ(eng_ttft)
            b["engine_tpot_s"] = summ(eng_tpot)
            b["http_overhead_per_token_s"] = summ(overhead)
        buckets.append(b)
        f = lambda s: "-" if s is None else f"{s * 1e3:.3f}"  # noqa: E731
        print(f"{name:<8} {len(prompts):>2} {f(b['ttft_s']['p50']):>12} {f(b['ttft_s']['p99']):>10} "
              f"{f(b['tpot_s']['p50']):>12} {f(b['tpot_s']['p99']):>8} {thr:>7.2f}"
              + (f" {f(b['engine_ttft_s']['p50']):>11} {f(b['engine_tpot_s']['p50']):>11}"
                 f" {b['http_overhead_per_token_s']['mean'] * 1e6:>12.1f}" if eng_tpot and overhead else ""),
              flush=True)
    print(f"weighted throughput {weighted:.2f} tok/s")
    if a.json:
        doc = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "url": a.url,
                        "scale": a.scale, "seed": a.seed, "prompts_from": a.prompts_from,
                        "token_counting": {"ids": "token_ids (return_token_ids)", "text": "text chunks",
                                           "logprobs": "logprobs"}.get(count, count)},
               "serve": {"mode": f"HTTP ({a.url})", "output_tokens": a.output_tokens, "buckets": buckets,
                         "weighted_throughput_tok_per_s": weighted}}
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
