// The engine-level benches (see bench.h): prefill TTFT, decode TPOT and the concurrency-1 serving
// workload, all through the Backend interface (the code path the server uses), timed with the
// host clock around step() (prefill: returns once the last row's logits are on the host) or, for
// decode, step_greedy() (returns once each row's greedy token id is on the host; --decode-logits:
// step() with every row's logits).
// $DS_DECODE_PIPELINE=1: device-greedy decode on a backend that pipelines
// (Backend::pipelines_decode, the CUDA engine) runs as the engine's pipelined loop does: step t+1
// is launched, its tokens fed from step t's argmax on the device, before step t's tokens are
// collected; a step's time is then the interval between two collects (what a client sees between
// two tokens). =ab alternates the synchronous and the pipelined loop within each case (4 runs of
// a quarter of the steps, sync first) and prints both, for a same-process A/B; the case's result
// is the pipelined one. Unset / 0: the synchronous step_greedy loop (the engine's default).
//
// Token ids are random (fixed seed): the engine's speed does not depend on which ids they are.
// Decode fills the KV cache by real prefill of random tokens (the Backend interface has no way to
// pretend a context), growing every slot of a context bucket together in packed steps, and
// reuses those slots for every batch size of the bucket; the context each case actually ran at is
// reported (decode steps of earlier cases add tokens) and its floor uses that context.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>

#include "bench/bench.h"
#include "core/error.h"
#include "runtime/engine.h"

namespace ds::bench {
namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, int64_t n, int vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

int default_repeats(int64_t prompt) { return prompt <= 8192 ? 3 : prompt <= 16384 ? 2 : 1; }

// $DS_DECODE_PIPELINE: "1" (pipelined where the backend pipelines), "0" / unset (sync), "ab".
enum class PipeMode { kOn, kOff, kAb };
PipeMode decode_pipe_mode() {
  const char* e = std::getenv("DS_DECODE_PIPELINE");
  const std::string v = e ? e : "0";
  if (v == "1" || v == "on") return PipeMode::kOn;
  if (v == "0" || v == "off") return PipeMode::kOff;
  DS_CHECK(v == "ab", "DS_DECODE_PIPELINE must be 1, 0 or ab, got '", v, "'");
  return PipeMode::kAb;
}

}  // namespace

std::vector<std::pair<int, int64_t>> cross_cases(const std::vector<int64_t>& batches,
                                                 const std::vector<int64_t>& contexts) {
  std::vector<std::pair<int, int64_t>> out;
  for (int64_t c : contexts)
    for (int64_t b : batches) {
      DS_CHECK(b <= 4096, "--batch ", b, " is larger than any slot count this bench supports");
      out.emplace_back(static_cast<int>(b), c);
    }
  return out;
}

std::vector<std::pair<int, int64_t>> parse_decode_cases(const std::string& cases) {
  std::vector<std::pair<int, int64_t>> out;
  size_t i = 0;
  DS_CHECK(!cases.empty(), "--cases: empty list");
  while (i <= cases.size()) {
    const size_t j = std::min(cases.find(',', i), cases.size());
    const std::string item = cases.substr(i, j - i);
    const size_t at = item.find('@');
    DS_CHECK(at != std::string::npos, "--cases: '", item, "' is not BATCH@CONTEXT (e.g. 4@8192)");
    const auto b = parse_int_list(item.substr(0, at), "--cases batch");
    const auto c = parse_int_list(item.substr(at + 1), "--cases context");
    DS_CHECK(b.size() == 1 && c.size() == 1 && b[0] <= 4096, "--cases: bad item '", item, "'");
    out.emplace_back(static_cast<int>(b[0]), c[0]);
    i = j + 1;
  }
  return out;
}

int decode_slots_needed(const EngineBenchOptions& opt) {
  int n = 1;
  for (const auto& [b, c] : opt.decode_cases) n = std::max(n, b);
  return n;
}

int64_t decode_kv_tokens_needed(const EngineBenchOptions& opt) {
  // Slot s reaches the largest context of any case that uses it, plus the decode steps of every
  // case that uses it (warm-up and timed), plus one page of slack.
  const int n = decode_slots_needed(opt);
  std::vector<int64_t> need(n, 0), extra(n, 0);
  for (const auto& [b, c] : opt.decode_cases)
    for (int s = 0; s < b; ++s) {
      need[s] = std::max(need[s], c);
      extra[s] += opt.decode_warmup + opt.decode_steps;
    }
  int64_t total = 0;
  for (int s = 0; s < n; ++s) total += need[s] + extra[s] + 64;
  return total;
}

std::vector<PrefillResult> run_prefill_bench(Backend& be, const Ceilings& ceil,
                                             const EngineBenchOptions& opt) {
  const ModelConfig& c = be.config();
  std::mt19937_64 rng(opt.seed + 1);
  std::vector<float> logits;
  const int slot = 0;
  const auto t_start = clock_type::now();
  // Warm-up: module load, GEMM plans of the chunk shapes, first-touch of the buffers.
  {
    be.reset_slot(slot);
    const int64_t n = std::min<int64_t>(opt.prompts.empty() ? 512 : opt.prompts.front(), 4096);
    const auto toks = random_tokens(rng, n, c.vocab_size);
    SeqWork w{slot, toks, false};
    be.step(std::span<const SeqWork>(&w, 1), logits);
    be.reset_slot(slot);
  }
  std::vector<PrefillResult> out;
  for (size_t i = 0; i < opt.prompts.size(); ++i) {
    const int64_t p = opt.prompts[i];
    if (opt.max_seconds > 0 && seconds_since(t_start) > opt.max_seconds) {
      std::printf("prefill: time budget of %.0f s spent, skipping prompt %lld and longer\n",
                  opt.max_seconds, static_cast<long long>(p));
      break;
    }
    DS_CHECK(p <= be.max_seq_len(), "prefill: prompt ", p,
             " is longer than the engine's max_seq_len ", be.max_seq_len());
    const int reps = i < opt.prefill_repeats.size() ? opt.prefill_repeats[i] : default_repeats(p);
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      be.reset_slot(slot);
      const auto toks = random_tokens(rng, p, c.vocab_size);
      SeqWork w{slot, toks, false};
      const auto t0 = clock_type::now();
      be.step(std::span<const SeqWork>(&w, 1), logits);
      t.push_back(seconds_since(t0));
    }
    be.reset_slot(slot);
    PrefillResult res;
    res.prompt = p;
    res.ttft_s = summarize(t);
    res.tok_per_s = double(p) / res.ttft_s.p50;
    res.flops = prefill_flops(c, p, 0, 1);
    res.tflops = res.flops.total() / res.ttft_s.p50 / 1e12;
    if (ceil.valid) res.floor_s = res.flops.total() / ceil.gemm_flops;
    std::printf("prefill %6lld tokens: TTFT p50 %.3f ms over %d runs (%.0f tok/s, %.1f TFLOP/s)\n",
                static_cast<long long>(p), res.ttft_s.p50 * 1e3, reps, res.tok_per_s, res.tflops);
    std::fflush(stdout);
    out.push_back(res);
  }
  return out;
}

std::vector<DecodeResult> run_decode_bench(Backend& be, const Ceilings& ceil,
                                           const EngineBenchOptions& opt) {
  const ModelConfig& c = be.config();
  DS_CHECK(!opt.decode_cases.empty(), "decode: no (batch, context) cases");
  DS_CHECK(opt.decode_steps >= 1 && opt.decode_warmup >= 0, "decode: bad step counts");
  const int n_slots = decode_slots_needed(opt);
  DS_CHECK(n_slots <= be.n_slots(), "decode: batch ", n_slots,
           " needs more slots than the engine has (", be.n_slots(), ")");
  // Contexts ascending; within a context, batches ascending.
  auto cases = opt.decode_cases;
  std::stable_sort(cases.begin(), cases.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second < b.second : a.first < b.first;
  });
  for (int s = 0; s < n_slots; ++s) be.reset_slot(s);
  std::mt19937_64 rng(opt.seed + 2);
  std::vector<float> logits;
  std::vector<DecodeResult> out;
  const auto t_start = clock_type::now();
  size_t i = 0;
  while (i < cases.size()) {
    const int64_t ctx = cases[i].second;
    size_t j = i;
    int max_b = 0;
    while (j < cases.size() && cases[j].second == ctx) max_b = std::max(max_b, cases[j++].first);
    if (opt.max_seconds > 0 && seconds_since(t_start) > opt.max_seconds) {
      std::printf("decode: time budget of %.0f s spent, skipping context %lld and longer\n",
                  opt.max_seconds, static_cast<long long>(ctx));
      break;
    }
    // Fill: grow slots 0..max_b-1 to ctx tokens (those already longer stay as they are).
    const auto t_fill = clock_type::now();
    int64_t fill_tokens = 0;
    {
      std::vector<std::vector<int32_t>> toks;
      std::vector<SeqWork> work;
      for (int s = 0; s < max_b; ++s) {
        const int64_t have = be.slot_len(s);
        if (have >= ctx) continue;
        DS_CHECK(be.can_grow(s, static_cast<int>(ctx - have)), "decode: the KV pool cannot hold ",
                 max_b, " sequences of ", ctx, " tokens (slot ", s, ")");
        toks.push_back(random_tokens(rng, ctx - have, c.vocab_size));
        fill_tokens += ctx - have;
      }
      int k = 0;
      for (int s = 0; s < max_b; ++s)
        if (be.slot_len(s) < ctx) work.push_back({s, toks[k++], false});
      // One step per group of slots whose tokens fit a few chunks, so each step stays bounded.
      for (size_t a = 0; a < work.size();) {
        size_t b = a;
        int64_t n = 0;
        while (b < work.size() &&
               (b == a || n + static_cast<int64_t>(work[b].tokens.size()) <= 65536))
          n += static_cast<int64_t>(work[b++].tokens.size());
        be.step(std::span<const SeqWork>(work.data() + a, b - a), logits);
        a = b;
      }
    }
    const double fill_s = seconds_since(t_fill);
    if (fill_tokens > 0)
      std::printf(
          "decode: filled %d slot(s) to %lld tokens: %lld prompt tokens in %.2f s (%.0f tok/s)\n",
          max_b, static_cast<long long>(ctx), static_cast<long long>(fill_tokens), fill_s,
          fill_tokens / fill_s);
    bool first = true;
    for (; i < j; ++i) {
      const int batch = cases[i].first;
      std::vector<std::vector<int32_t>> tok(batch, std::vector<int32_t>(1));
      std::vector<SeqWork> work(batch);
      StepOutput greedy_out;
      for (int s = 0; s < batch; ++s) {
        // + 9: the most any mode adds (ab: 3 warm-up launches + 2 rounds of q + 1 pipelined
        // steps, 4q <= max(steps, 4); the KV pool keeps 64 tokens of slack per slot).
        DS_CHECK(be.can_grow(s, opt.decode_warmup + opt.decode_steps + 9),
                 "decode: the KV pool cannot hold the decode steps of slot ", s);
        work[s].slot = s;
      }
      auto one_step = [&]() {
        for (int s = 0; s < batch; ++s) {
          tok[s][0] = static_cast<int32_t>(rng() % static_cast<uint64_t>(c.vocab_size));
          work[s].tokens = tok[s];
        }
        if (opt.decode_logits) {
          be.step(work, logits);
        } else {
          for (SeqWork& w : work) w.greedy = true;
          be.step_greedy(work, greedy_out);
          for (int32_t id : greedy_out.tokens)
            DS_CHECK(id >= 0, "decode: the greedy token of a row is invalid (NaN or inf logits)");
        }
      };
      // Pipelined greedy decode: n + 1 steps launched (the first from host tokens, the rest fed
      // on the device), n intervals between consecutive collects timed.
      std::vector<DecodeItem> items(batch);
      std::vector<int32_t> got;
      double ctx_sum = 0;
      auto pipelined = [&](int n, std::vector<double>* t) {
        for (int s = 0; s < batch; ++s)
          items[s] = {s, static_cast<int32_t>(rng() % static_cast<uint64_t>(c.vocab_size)), -1};
        be.launch_greedy_decode(items);
        for (int s = 0; s < batch; ++s) items[s].feed_row = s;
        auto t_prev = clock_type::now();
        for (int st = 0; st <= n; ++st) {
          if (st < n) {
            if (t)
              for (int s = 0; s < batch; ++s) ctx_sum += be.slot_len(s);
            be.launch_greedy_decode(items);
          }
          be.collect_greedy_decode(got);
          for (int32_t id : got)
            DS_CHECK(id >= 0, "decode: the greedy token of a row is invalid (NaN or inf logits)");
          const auto now = clock_type::now();
          if (t && st > 0) t->push_back(std::chrono::duration<double>(now - t_prev).count());
          t_prev = now;
        }
      };
      auto synchronous = [&](int n, std::vector<double>* t) {
        for (int st = 0; st < n; ++st) {
          if (t)
            for (int s = 0; s < batch; ++s) ctx_sum += be.slot_len(s);
          const auto t0 = clock_type::now();
          one_step();
          if (t) t->push_back(seconds_since(t0));
        }
      };
      const PipeMode mode =
          opt.decode_logits || !be.pipelines_decode() ? PipeMode::kOff : decode_pipe_mode();
      if (mode == PipeMode::kOn) {
        pipelined(opt.decode_warmup, nullptr);
      } else {
        synchronous(opt.decode_warmup, nullptr);
      }
      std::vector<double> t, t_sync;
      if (mode == PipeMode::kAb) {
        pipelined(2, nullptr);  // warm: the pipelined path's feed kernel
        const int q = std::max(1, opt.decode_steps / 4);
        for (int round = 0; round < 2; ++round) {
          synchronous(q, &t_sync);
          pipelined(q, &t);
        }
        const Summary a = summarize(t_sync), b = summarize(t);
        std::printf(
            "decode batch %2d context %6lld A/B: sync TPOT p50 %.3f ms p99 %.3f | pipelined p50 "
            "%.3f ms p99 %.3f (%d + %d steps, alternating) -> %.3f ms saved per step (%.2f%%)\n",
            batch, static_cast<long long>(ctx), a.p50 * 1e3, a.p99 * 1e3, b.p50 * 1e3, b.p99 * 1e3,
            a.n, b.n, (a.p50 - b.p50) * 1e3, 100 * (a.p50 - b.p50) / a.p50);
        std::fflush(stdout);
      } else if (mode == PipeMode::kOn) {
        pipelined(opt.decode_steps, &t);
      } else {
        synchronous(opt.decode_steps, &t);
      }
      DecodeResult r;
      r.batch = batch;
      r.context = ctx;
      r.context_mean = ctx_sum / (double(batch) * (t.size() + t_sync.size()));
      r.warmup = opt.decode_warmup;
      r.logits = opt.decode_logits;
      r.tpot_s = summarize(t);
      r.bytes = decode_step_bytes(c, static_cast<int64_t>(r.context_mean + 0.5), batch);
      if (ceil.valid) r.floor_s = r.bytes.total() / ceil.read_bps;
      if (first) {
        r.fill_s = fill_s;
        r.fill_tokens = fill_tokens;
        first = false;
      }
      std::printf("decode batch %2d context %6lld: TPOT p50 %.3f ms p99 %.3f ms (%d steps%s)\n",
                  batch, static_cast<long long>(ctx), r.tpot_s.p50 * 1e3, r.tpot_s.p99 * 1e3,
                  r.tpot_s.n, mode == PipeMode::kOff ? "" : ", pipelined");
      // Long runs: the p50 of each 64-step window in order, so a drift over the run (the card
      // warming up or settling) shows beside the one summary.
      if (t.size() >= 256) {
        std::printf("decode batch %2d context %6lld: p50 of each 64-step window, ms:", batch,
                    static_cast<long long>(ctx));
        for (size_t w0 = 0; w0 + 64 <= t.size(); w0 += 64)
          std::printf(" %.3f",
                      summarize(std::vector<double>(t.begin() + w0, t.begin() + w0 + 64)).p50 * 1e3);
        std::printf("\n");
      }
      std::fflush(stdout);
      out.push_back(r);
    }
  }
  for (int s = 0; s < n_slots; ++s) be.reset_slot(s);
  return out;
}

ServeResult run_serve_bench(std::unique_ptr<Backend> be, const EngineBenchOptions& opt) {
  DS_CHECK(opt.serve_requests >= 1 && opt.serve_output >= 1 && opt.serve_chunk >= 1,
           "serve: bad request count / output length / chunk");
  const ModelConfig c = be->config();
  const int max_len = be->max_seq_len();
  struct B {
    const char* name;
    int lo, hi;
    double weight;
  };
  // PERF.md: buckets 4K-8K, 8K-16K, 16K-32K, weighted 20/50/30.
  const B spec[3] = {
      {"4K-8K", 4096, 8192, 0.2}, {"8K-16K", 8192, 16384, 0.5}, {"16K-32K", 16384, 32768, 0.3}};
  ServeResult res;
  res.mode = "in-process (Engine + " + be->name() + ")";
  res.output_tokens = opt.serve_output;
  EngineOptions eo;
  eo.scheduler.max_batch = 1;
  eo.scheduler.chunk_size = opt.serve_chunk;
  eo.scheduler.max_num_batched_tokens = opt.serve_chunk;
  Engine engine(std::move(be), nullptr, eo);
  std::mt19937_64 rng(opt.seed);  // fixed seed: the same requests every run
  const auto t_start = clock_type::now();
  for (const B& b : spec) {
    ServeBucket sb;
    sb.name = b.name;
    sb.lo = b.lo;
    sb.hi = b.hi;
    sb.weight = b.weight;
    std::vector<double> ttft, tpot;
    double e2e_sum = 0;
    int out_sum = 0;
    for (int r = 0; r < opt.serve_requests; ++r) {
      if (r > 0 && opt.max_seconds > 0 && seconds_since(t_start) > opt.max_seconds) {
        std::printf("serve: time budget of %.0f s spent, bucket %s stops at %d request(s)\n",
                    opt.max_seconds, b.name, r);
        break;
      }
      int len = b.lo + static_cast<int>(rng() % static_cast<uint64_t>(b.hi - b.lo));
      len = std::min(len, max_len - opt.serve_output);
      DS_CHECK(len >= 1, "serve: the engine's max_seq_len ", max_len, " is too short for bucket ",
               b.name);
      sb.prompts.push_back(len);
      GenerationRequest req;
      req.prompt = random_tokens(rng, len, c.vocab_size);
      req.max_tokens = opt.serve_output;
      req.ignore_eos = true;
      req.sampling.temperature = 0;
      auto stream = engine.submit(std::move(req));
      StreamOutput o, last;
      const auto t_sub = clock_type::now();
      for (;;) {
        if (stream->next(o, std::chrono::milliseconds(100))) {
          last = o;
          if (o.finish != FinishReason::kNone) break;
        }
        if (seconds_since(t_sub) > 1800) {
          stream->cancel();
          ds::throw_error("serve: request ", r, " of bucket ", b.name,
                          " did not finish in 30 minutes");
        }
      }
      DS_CHECK(last.finish == FinishReason::kLength, "serve: request ended with '",
               finish_reason_name(last.finish), "' ", last.error);
      DS_CHECK(last.ttft_s > 0 && last.e2e_s > 0, "serve: the engine reported no timings");
      ttft.push_back(last.ttft_s);
      if (last.n_generated > 1) tpot.push_back((last.e2e_s - last.ttft_s) / (last.n_generated - 1));
      e2e_sum += last.e2e_s;
      out_sum += last.n_generated;
      std::printf("serve %s request %d: prompt %d, TTFT %.3f s, %d tokens in %.3f s\n", b.name, r,
                  len, last.ttft_s, last.n_generated, last.e2e_s);
      std::fflush(stdout);
    }
    sb.ttft_s = summarize(ttft);
    sb.tpot_s = tpot.empty() ? Summary{} : summarize(tpot);
    sb.throughput = e2e_sum > 0 ? out_sum / e2e_sum : 0;
    res.weighted_throughput += b.weight * sb.throughput;
    res.buckets.push_back(sb);
  }
  return res;
}

}  // namespace ds::bench
