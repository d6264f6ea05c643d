// Pipelined greedy decode (Backend::launch_greedy_decode / collect_greedy_decode and the engine
// loop that uses them, issue 6) on the host, without a GPU or a tokenizer:
//  - the Backend default (synchronous: each step runs at launch) gives exactly step_greedy's
//    tokens, feeds rows from the last launch, and refuses misuse (feed without a launch, feed row
//    out of range, a third step in flight, collect with nothing launched);
//  - the Engine with decode_pipeline kOn against kOff (the default) over a backend that claims to
//    pipeline and checks the engine's use of it (no step() while steps are in flight, at most 2
//    in flight): many concurrent greedy requests with different max_tokens, stop ids,
//    cancellations, a sampled and a logprobs request (no pipelining while they run), and a KV
//    pool small enough to preempt: every request's tokens and finish reason are identical,
//    pipelined steps happened, and every KV block and slot comes back; a request stopped by a
//    stop id wastes exactly the one step queued after it, one ended by max_tokens none; kAuto
//    follows Backend::pipelines_decode.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "runtime/engine.h"
#include "runtime_test_backend.h"

namespace ds {
namespace {

// A paged backend whose next token is a fixed function of the slot's history (the last token and
// the length): deterministic and batch-invariant.
class HashBackend : public test::HistoryBackend {
 public:
  HashBackend(int n_slots, int page, int64_t blocks, int vocab, bool pipelines)
      : HistoryBackend("hash", n_slots, page, blocks, vocab), pipelines_(pipelines) {}
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override {
    // The engine must collect every launched step before a plain step (the default launch runs
    // its own step through here: not a misuse).
    if (!in_launch_ && decode_in_flight() != 0) misuse_ = true;
    ++plain_steps_;
    HistoryBackend::step(work, logits);
  }
  bool pipelines_decode() const override { return pipelines_; }
  void launch_greedy_decode(std::span<const DecodeItem> items) override {
    ++launches_;
    if (decode_in_flight() >= 2) misuse_ = true;
    if (launches_ == fail_at_launch_) {
      // A device error after part of the step was enqueued: the slots' state has changed.
      for (const DecodeItem& it : items) history(it.slot).push_back(0);
      throw Error("hash: device error in the middle of a launch");
    }
    in_launch_ = true;
    try {
      Backend::launch_greedy_decode(items);
    } catch (...) {
      in_launch_ = false;
      throw;
    }
    in_launch_ = false;
  }
  bool misuse() const { return misuse_; }
  int64_t launches() const { return launches_; }
  void fail_at_launch(int64_t n) { fail_at_launch_ = n; }

 protected:
  int32_t next_token(const std::vector<int32_t>& h) const override {
    const uint64_t x = uint64_t(h.back()) * 2654435761u + h.size() * 40503u;
    return static_cast<int32_t>((x >> 7) % uint64_t(vocab()));
  }

 private:
  bool pipelines_;
  bool misuse_ = false, in_launch_ = false;
  int64_t launches_ = 0, plain_steps_ = 0, fail_at_launch_ = -1;
};

TEST(BackendPipelineDefault, MatchesStepGreedyAndRefusesMisuse) {
  HashBackend a(3, 16, 1000, 97, false), b(3, 16, 1000, 97, false);
  std::vector<float> logits;
  for (int s = 0; s < 3; ++s) {
    std::vector<int32_t> p = {s + 1, 2 * s + 5, 7};
    SeqWork w{s, p, false};
    a.step(std::span<const SeqWork>(&w, 1), logits);
    b.step(std::span<const SeqWork>(&w, 1), logits);
  }
  // Reference: the synchronous chain through step_greedy.
  std::vector<int32_t> cur = {1, 2, 3};
  std::vector<std::vector<int32_t>> ref;
  for (int st = 0; st < 20; ++st) {
    std::vector<std::vector<int32_t>> t(3, std::vector<int32_t>(1));
    std::vector<SeqWork> work(3);
    for (int s = 0; s < 3; ++s) {
      t[s][0] = cur[s];
      work[s] = {s, t[s], false, true};
    }
    StepOutput out;
    a.step_greedy(work, out);
    ref.push_back(out.tokens);
    cur = out.tokens;
  }
  std::vector<DecodeItem> fed0 = {{0, 0, 0}};
  EXPECT_THROW(b.launch_greedy_decode(fed0), Error) << "feed_row before any launch";
  std::vector<DecodeItem> items = {{0, 1, -1}, {1, 2, -1}, {2, 3, -1}};
  b.launch_greedy_decode(items);
  for (int s = 0; s < 3; ++s) items[s].feed_row = s;
  std::vector<std::vector<int32_t>> got;
  std::vector<int32_t> toks;
  for (int st = 0; st < 20; ++st) {
    if (st + 1 < 20) b.launch_greedy_decode(items);
    EXPECT_LE(b.decode_in_flight(), 2);
    b.collect_greedy_decode(toks);
    got.push_back(toks);
  }
  EXPECT_EQ(got, ref);
  EXPECT_THROW(b.collect_greedy_decode(toks), Error) << "nothing launched";
  b.launch_greedy_decode(items);
  EXPECT_THROW(b.launch_greedy_decode(std::vector<DecodeItem>{{0, 0, 5}}), Error)
      << "feed row past the last launch's rows";
  b.launch_greedy_decode(items);
  EXPECT_THROW(b.launch_greedy_decode(items), Error) << "a third step in flight";
  b.collect_greedy_decode(toks);
  b.collect_greedy_decode(toks);
  EXPECT_EQ(b.decode_in_flight(), 0);
  EXPECT_EQ(b.slot_len(0), a.slot_len(0) + 2);
}

struct Result {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
};

Result drain(RequestStream& s) {
  Result r;
  StreamOutput out;
  for (int i = 0; i < 100000; ++i) {
    if (!s.next(out, std::chrono::milliseconds(5000))) break;
    for (auto& g : out.tokens) r.tokens.push_back(g.id);
    if (out.finish != FinishReason::kNone) {
      r.finish = out.finish;
      break;
    }
  }
  return r;
}

// Runs the request mix on an engine and returns each request's result, plus the engine stats.
std::vector<Result> run_mix(EngineOptions::Pipeline mode, int64_t blocks, EngineStats* stats,
                            bool* misuse) {
  constexpr int kVocab = 211;
  auto backend = std::make_unique<HashBackend>(6, 16, blocks, kVocab, true);
  HashBackend* hb = backend.get();
  EngineOptions o;
  o.scheduler.max_batch = 6;
  o.scheduler.chunk_size = 16;
  o.scheduler.max_num_batched_tokens = 64;
  o.decode_pipeline = mode;
  Engine eng(std::move(backend), nullptr, o);
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 14; ++i) {
    GenerationRequest r;
    for (int k = 0; k < 9 + 5 * i; ++k) r.prompt.push_back((i * 31 + k * 7) % kVocab);
    r.max_tokens = 10 + (i * 13) % 40;
    r.ignore_eos = true;
    r.sampling.temperature = 0;
    if (i % 4 == 1)  // a tenth of the vocabulary: stops after ~10 tokens
      for (int k = 0; k < 21; ++k) r.stop_token_ids.push_back((i + k * 10) % kVocab);
    if (i == 5) {
      r.sampling.temperature = 0.7f;  // sampled on the host: no pipelining while it runs
      r.sampling.seed = 42;
      r.max_tokens = 6;
    }
    if (i == 9) {
      r.top_logprobs = 2;  // needs logits: the same
      r.max_tokens = 6;
    }
    if (i == 13) {  // stop ids banned for the first 8 tokens (host sampling), then device argmax
      for (int k = 0; k < 21; ++k) r.stop_token_ids.push_back((i + k * 10) % kVocab);
      r.min_tokens = 8;
      r.max_tokens = 40;
    }
    reqs.push_back(r);
  }
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : reqs) streams.push_back(eng.submit(r));
  std::vector<Result> res(reqs.size());
  std::vector<std::thread> th;
  for (size_t i = 0; i < reqs.size(); ++i)
    th.emplace_back([&, i] {
      if (i == 3 || i == 11) {  // cancelled after a few tokens
        StreamOutput out;
        int n = 0;
        FinishReason fin = FinishReason::kNone;
        while (n < 4 && streams[i]->next(out, std::chrono::milliseconds(5000))) {
          n += static_cast<int>(out.tokens.size());
          fin = out.finish;
          if (fin != FinishReason::kNone) break;
        }
        streams[i]->cancel();
        if (fin == FinishReason::kNone) fin = drain(*streams[i]).finish;
        // How many tokens come before the cancel lands (or whether the request ends first)
        // depends on timing: only that it ended is compared.
        res[i].finish = fin == FinishReason::kCancelled || fin == FinishReason::kLength
                            ? FinishReason::kCancelled
                            : fin;
        return;
      }
      res[i] = drain(*streams[i]);
    });
  for (auto& t : th) t.join();
  EXPECT_TRUE(eng.wait_idle(std::chrono::milliseconds(5000)));
  *stats = eng.stats();
  *misuse = hb->misuse();
  return res;
}

TEST(EnginePipeline, SameTokensAsSynchronousLoop) {
  for (int64_t blocks : {int64_t(10000), int64_t(14)}) {  // ample, and tight enough to preempt
    EngineStats s_off, s_on;
    bool misuse_off = false, misuse_on = false;
    const auto off = run_mix(EngineOptions::Pipeline::kOff, blocks, &s_off, &misuse_off);
    const auto on = run_mix(EngineOptions::Pipeline::kOn, blocks, &s_on, &misuse_on);
    ASSERT_EQ(on.size(), off.size());
    for (size_t i = 0; i < on.size(); ++i) {
      EXPECT_EQ(on[i].tokens, off[i].tokens) << "request " << i << ", " << blocks << " blocks";
      EXPECT_EQ(on[i].finish, off[i].finish) << "request " << i << ", " << blocks << " blocks";
    }
    EXPECT_FALSE(misuse_on) << "the engine ran step() with pipelined steps in flight";
    EXPECT_EQ(s_off.n_pipelined_steps, 0);
    EXPECT_GT(s_on.n_pipelined_steps, blocks > 1000 ? 5 : 0) << blocks << " blocks";
    EXPECT_EQ(s_on.memory.kv_blocks_used, 0);
    EXPECT_EQ(s_on.memory.state_slots_used, 0);
    EXPECT_EQ(s_on.n_running, 0);
    // Request 13's min_tokens: no stop id among its first 8 tokens, and at least 9 tokens.
    for (const auto* res : {&off, &on}) {
      const std::vector<int32_t>& t13 = (*res)[13].tokens;
      ASSERT_GT(t13.size(), 8u) << blocks << " blocks";
      for (size_t k = 0; k < 8; ++k) {
        for (int j = 0; j < 21; ++j)
          EXPECT_NE(t13[k], (13 + j * 10) % 211) << "token " << k << ", " << blocks << " blocks";
      }
    }
    int stopped = 0;
    for (const auto& r : off) stopped += r.finish == FinishReason::kStop;
    EXPECT_GT(stopped, 0) << "the mix must stop some requests on a stop id";
    std::printf(
        "  %lld blocks: %lld steps (%lld pipelined, %lld wasted rows), %lld preemptions; "
        "sync loop %lld steps\n",
        static_cast<long long>(blocks), static_cast<long long>(s_on.n_steps),
        static_cast<long long>(s_on.n_pipelined_steps), static_cast<long long>(s_on.n_wasted_rows),
        static_cast<long long>(s_on.n_preemptions), static_cast<long long>(s_off.n_steps));
  }
}

// One greedy request that stops on a stop id in the middle: exactly the one step queued after its
// stop is wasted, its tokens equal the synchronous loop's, and its slot and blocks come back.
TEST(EnginePipeline, StopWastesOneQueuedRow) {
  auto run = [](EngineOptions::Pipeline mode, std::vector<int32_t> stop_ids, EngineStats* st) {
    auto backend = std::make_unique<HashBackend>(2, 16, 1000, 257, true);
    EngineOptions o;
    o.decode_pipeline = mode;
    Engine eng(std::move(backend), nullptr, o);
    GenerationRequest r;
    r.prompt = {5, 6, 7, 8};
    r.max_tokens = 40;
    r.sampling.temperature = 0;
    // Pipelined, a stop id wastes the step queued after it; without one nothing is queued past
    // the request's last token.
    const bool wastes = mode == EngineOptions::Pipeline::kOn && !stop_ids.empty();
    r.stop_token_ids = std::move(stop_ids);
    const Result res = drain(*eng.submit(r));
    EXPECT_TRUE(eng.wait_idle(std::chrono::milliseconds(5000)));
    // The wasted step is collected after the request finished (idle already): wait until it is
    // counted, however slow the machine (a fixed 500 ms could pass first on a loaded CI core).
    // Where none is expected, the same short grace as before lets a wrongly queued step show up.
    const auto limit = wastes ? std::chrono::milliseconds(60000) : std::chrono::milliseconds(500);
    const auto t0 = std::chrono::steady_clock::now();
    while (mode == EngineOptions::Pipeline::kOn && eng.stats().n_wasted_rows == 0 &&
           std::chrono::steady_clock::now() - t0 < limit)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    *st = eng.stats();
    return res;
  };
  EngineStats st;
  const Result free_run = run(EngineOptions::Pipeline::kOff, {}, &st);
  ASSERT_EQ(free_run.tokens.size(), 40u);
  // A stop id first generated at position k >= 6 (the first token comes from the prompt step).
  size_t k = 6;
  while (k < free_run.tokens.size() &&
         std::find(free_run.tokens.begin(), free_run.tokens.begin() + k, free_run.tokens[k]) !=
             free_run.tokens.begin() + k)
    ++k;
  ASSERT_LT(k, 39u) << "the hash stream repeats too early for this test";
  const std::vector<int32_t> stop = {free_run.tokens[k]};
  EngineStats s_off, s_on;
  const Result off = run(EngineOptions::Pipeline::kOff, stop, &s_off);
  const Result on = run(EngineOptions::Pipeline::kOn, stop, &s_on);
  EXPECT_EQ(off.finish, FinishReason::kStop);
  EXPECT_EQ(off.tokens.size(), k + 1);
  EXPECT_EQ(on.tokens, off.tokens);
  EXPECT_EQ(on.finish, off.finish);
  EXPECT_EQ(s_on.n_wasted_rows, 1);
  EXPECT_EQ(s_on.n_steps, s_off.n_steps + 1);  // the wasted one
  EXPECT_GE(s_on.n_pipelined_steps, static_cast<int64_t>(k) - 2);
  EXPECT_EQ(s_on.memory.kv_blocks_used, 0);
  // A request that ends on max_tokens wastes nothing (no step is queued past it).
  EngineStats s_len;
  const Result len = run(EngineOptions::Pipeline::kOn, {}, &s_len);
  EXPECT_EQ(len.tokens, free_run.tokens);
  EXPECT_EQ(s_len.n_wasted_rows, 0);
  EXPECT_EQ(s_len.n_steps, st.n_steps);
}

// A launch that throws after changing state (a device error part-way) ends its requests with the
// error; the step is never run again (which would apply it twice), and the engine goes on serving.
// Launch 1 is the loop's first launch of a plan, launch 3 a launch ahead inside pipeline_round.
TEST(EnginePipeline, FailedLaunchEndsItsRequestsAndIsNotRetried) {
  for (int64_t fail_at : {int64_t(1), int64_t(3)}) {
    auto backend = std::make_unique<HashBackend>(2, 16, 1000, 257, true);
    HashBackend* hb = backend.get();
    hb->fail_at_launch(fail_at);
    EngineOptions o;
    o.decode_pipeline = EngineOptions::Pipeline::kOn;
    Engine eng(std::move(backend), nullptr, o);
    GenerationRequest r;
    r.prompt = {5, 6, 7, 8};
    r.max_tokens = 20;
    r.sampling.temperature = 0;
    const Result failed = drain(*eng.submit(r));
    EXPECT_EQ(failed.finish, FinishReason::kError) << "fail at launch " << fail_at;
    EXPECT_LE(failed.tokens.size(), static_cast<size_t>(fail_at) + 1) << "fail at launch " << fail_at;
    EXPECT_EQ(hb->launches(), fail_at) << "the failed launch was retried (fail at " << fail_at << ")";
    // The same engine serves the next request in full, equal to a fresh engine's tokens.
    const Result next = drain(*eng.submit(r));
    EXPECT_EQ(next.finish, FinishReason::kLength);
    auto fresh_backend = std::make_unique<HashBackend>(2, 16, 1000, 257, true);
    Engine fresh(std::move(fresh_backend), nullptr, o);
    const Result ref = drain(*fresh.submit(r));
    EXPECT_EQ(next.tokens, ref.tokens) << "fail at launch " << fail_at;
    EXPECT_FALSE(hb->misuse());
    EXPECT_TRUE(eng.wait_idle(std::chrono::milliseconds(5000)));
  }
}

TEST(EnginePipeline, AutoFollowsTheBackendAndDefaultIsOff) {
  // kAuto pipelines only where the backend does; the default (kOff) never does.
  auto run = [](bool backend_pipelines, EngineOptions::Pipeline mode) {
    auto backend = std::make_unique<HashBackend>(2, 16, 1000, 101, backend_pipelines);
    EngineOptions o;
    o.scheduler.max_batch = 2;
    o.decode_pipeline = mode;
    Engine eng(std::move(backend), nullptr, o);
    GenerationRequest r;
    r.prompt = {1, 2, 3};
    r.max_tokens = 12;
    r.sampling.temperature = 0;
    const Result res = drain(*eng.submit(r));
    EXPECT_EQ(res.tokens.size(), 12u);
    return eng.stats().n_pipelined_steps;
  };
  EXPECT_EQ(EngineOptions{}.decode_pipeline, EngineOptions::Pipeline::kOff);
  EXPECT_EQ(run(false, EngineOptions::Pipeline::kAuto), 0);
  EXPECT_GT(run(true, EngineOptions::Pipeline::kAuto), 5);
  EXPECT_EQ(run(true, EngineOptions::Pipeline::kOff), 0);
}

}  // namespace
}  // namespace ds
