#!/usr/bin/env python3
"""`bench serve` over HTTP: PERF.md's concurrency-1 workload against a running `deltaserve serve`
(or any OpenAI-compatible server that takes token-id prompts), measured from the client side.

Buckets 4K-8K, 8K-16K, 16K-32K prompt tokens, N requests each (lengths and token ids from a fixed
seed, as `deltaserve bench serve` draws them), 128 output tokens, EOS ignored, greedy, streamed.
TTFT = time to the first streamed chunk that carries a token; TPOT = (end - first token) /
(completion tokens - 1, from the usage block); throughput = output tokens / end-to-end time;
weighted 20/50/30. Tokens are seen in the stream's text chunks, as OpenAI benchmark clients do;
a server without a tokenizer streams no text, so then (--logprobs auto, the default) each request
asks for logprobs, whose "token_id:N" entries carry the tokens; that makes the server compute a
log-softmax over the vocabulary per token (about 2 ms per token on the 27B synthetic model in the
first H200 run), so serve a tokenizer (`deltaserve serve --tokenizer DIR`) for a fair comparison
with the in-process bench. The mode used is in the JSON (meta.token_counting).
Standard library only. Output: a table and, with --json, the same "serve" layout as deltaserve's
JSON (mode "HTTP ...").

Usage: serve_http.py --url http://127.0.0.1:8000 [--requests 5] [--output-tokens 128]
                     [--vocab 248320] [--scale 1.0] [--json FILE] [--api-key KEY]
                     [--prompts-from BENCH.json] [--logprobs auto|on|off]
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


def one_request(url, key, prompt, max_tokens, logprobs):
    """(TTFT or None when no chunk carried a token, end-to-end time, completion tokens)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=3600)
    req = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True}}
    if logprobs:
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
    ttft, n_tokens, usage = None, 0, None
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        msg = json.loads(data)
        if msg.get("usage"):
            usage = msg["usage"]
        for ch in msg.get("choices", []):
            lp = ch.get("logprobs") or {}
            got = len(lp.get("tokens") or []) or (1 if ch.get("text") else 0)
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            n_tokens += got
    e2e = time.perf_counter() - t0
    conn.close()
    if usage and usage.get("completion_tokens"):
        n_tokens = usage["completion_tokens"]
    return ttft, e2e, n_tokens


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
    ap.add_argument("--logprobs", choices=("auto", "on", "off"), default="auto",
                    help="see tokens through logprobs (on), text chunks (off), or text unless the server streams none")
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
    rng = random.Random(a.seed)
    use_lp = a.logprobs == "on"
    buckets, weighted = [], 0.0
    print(f"{'bucket':<8} {'n':>2} {'TTFT p50 ms':>12} {'p99':>10} {'TPOT p50 ms':>12} {'p99':>8} {'tok/s':>7}")
    for name, lo, hi, w in BUCKETS:
        lo, hi = max(1, int(lo * a.scale)), max(2, int(hi * a.scale))
        ttft, tpot, prompts, e2e_sum, out_sum = [], [], [], 0.0, 0
        lengths = given.get(name, []) if given is not None else [rng.randrange(lo, hi) for _ in range(a.requests)]
        if not lengths:
            continue
        for n in lengths:
            prompts.append(n)
            prompt = [rng.randrange(a.vocab) for _ in range(n)]
            t, e, k = one_request(a.url, a.api_key, prompt, a.output_tokens, use_lp)
            if t is None and not use_lp and a.logprobs == "auto" and k > 0:
                print("serve_http.py: the server streams no text (no tokenizer?): tokens counted through logprobs "
                      "from here on (the server then computes a log-softmax per token)", flush=True)
                use_lp = True
                t, e, k = one_request(a.url, a.api_key, prompt, a.output_tokens, use_lp)
            if t is None:
                sys.exit("serve_http.py: the stream carried no token (no text, no logprobs tokens)")
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
        buckets.append(b)
        f = lambda s: "-" if s is None else f"{s * 1e3:.3f}"  # noqa: E731
        print(f"{name:<8} {len(prompts):>2} {f(b['ttft_s']['p50']):>12} {f(b['ttft_s']['p99']):>10} "
              f"{f(b['tpot_s']['p50']):>12} {f(b['tpot_s']['p99']):>8} {thr:>7.2f}", flush=True)
    print(f"weighted throughput {weighted:.2f} tok/s")
    if a.json:
        doc = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "url": a.url,
                        "scale": a.scale, "seed": a.seed, "prompts_from": a.prompts_from,
                        "token_counting": "logprobs" if use_lp else "text chunks"},
               "serve": {"mode": f"HTTP ({a.url})", "output_tokens": a.output_tokens, "buckets": buckets,
                         "weighted_throughput_tok_per_s": weighted}}
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
