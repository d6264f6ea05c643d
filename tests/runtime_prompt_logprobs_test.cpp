// Prompt logprobs through the engine (GenerationRequest::prompt_logprobs, vLLM's prompt_logprobs,
// OpenAI's echo with logprobs): every prompt token after the first gets the logprob, rank and top
// ids of the row before it, computed from exactly the rows the CPU reference forward gives for the
// same chunk boundaries; the rows per step are capped (SchedulerOptions::max_logit_rows); with
// preemptions every position is reported once and in order; requests without them are untouched.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cmath>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "model/weights.h"
#include "runtime/cpu_backend.h"
#include "runtime/engine.h"
#include "runtime_test_backend.h"

namespace ds {
namespace {

struct Collected {
  std::vector<GeneratedToken> tokens, prompt;
  StreamOutput last;
  int outputs_before_prompt = 0;  // outputs taken before the one with the prompt's logprobs
};

Collected collect(RequestStream& s) {
  Collected c;
  StreamOutput out;
  for (int i = 0; i < 100000; ++i) {
    if (!s.next(out, std::chrono::milliseconds(20000))) break;
    if (!out.prompt_logprobs.empty()) {
      EXPECT_TRUE(c.prompt.empty()) << "prompt logprobs in two outputs";
      EXPECT_FALSE(out.tokens.empty()) << "prompt logprobs before the first token";
      c.prompt = out.prompt_logprobs;
    } else if (c.prompt.empty()) {
      ++c.outputs_before_prompt;
    }
    for (auto& g : out.tokens) c.tokens.push_back(g);
    c.last = out;
    if (out.finish != FinishReason::kNone) break;
  }
  return c;
}

std::vector<int32_t> prompt_of(int n, int salt, int vocab) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + salt * 11 + i * i) % vocab);
  return t;
}

TEST(PromptLogprobs, EqualTheCpuForwardRowsAtTheSameChunks) {
  const HostWeights w = make_synthetic_weights(tiny_model_config(256), 7);
  BackendOptions bo;
  bo.n_slots = 2;
  bo.chunk_size = 64;
  EngineOptions eo;
  eo.scheduler.max_batch = 2;
  eo.scheduler.chunk_size = 512;
  eo.scheduler.max_num_batched_tokens = 512;
  eo.scheduler.max_logit_rows = 7;
  auto backend = std::make_unique<CpuBackend>(w, bo);
  const CpuModel& model = backend->model();
  Engine eng(std::move(backend), nullptr, eo);

  const std::vector<int32_t> prompt = prompt_of(40, 1, 256);
  GenerationRequest r;
  r.prompt = prompt;
  r.sampling.temperature = 0;
  r.max_tokens = 3;
  r.prompt_logprobs = 3;
  // A request beside it without prompt logprobs: one chunk, no rows kept, nothing reported.
  GenerationRequest plain = r;
  plain.prompt = prompt_of(30, 2, 256);
  plain.prompt_logprobs = -1;
  auto s1 = eng.submit(r);
  auto s2 = eng.submit(plain);
  const Collected c = collect(*s1), cp = collect(*s2);
  EXPECT_EQ(c.last.finish, FinishReason::kLength);
  EXPECT_EQ(cp.last.finish, FinishReason::kLength);
  EXPECT_TRUE(cp.prompt.empty());
  EXPECT_EQ(cp.tokens.size(), 3u);
  EXPECT_EQ(c.outputs_before_prompt, 0);
  ASSERT_EQ(c.prompt.size(), prompt.size() - 1);

  // The reference: the CPU forward over the same pieces (7 rows per step: [0, 7), [7, 14), ...,
  // [35, 40)), every row kept.
  CpuSeqState st = model.new_state();
  std::vector<float> rows, piece;
  for (size_t b = 0; b < prompt.size(); b += 7) {
    const size_t n = std::min<size_t>(7, prompt.size() - b);
    piece.clear();
    model.forward(st, std::span<const int32_t>(prompt).subspan(b, n), 64, true, piece);
    rows.insert(rows.end(), piece.begin(), piece.end());
  }
  const size_t V = 256;
  ASSERT_EQ(rows.size(), prompt.size() * V);
  for (size_t j = 1; j < prompt.size(); ++j) {
    const std::span<const float> row(rows.data() + (j - 1) * V, V);
    const GeneratedToken& g = c.prompt[j - 1];
    EXPECT_EQ(g.id, prompt[j]) << j;
    EXPECT_FLOAT_EQ(g.logprob, token_logprob(row, prompt[j])) << j;
    int rank = 0;
    for (float x : row) rank += x >= row[prompt[j]];
    EXPECT_EQ(g.rank, rank) << j;
    const std::vector<TokenLogprob> top = top_logprobs(row, 3);
    ASSERT_EQ(g.top.size(), 3u);
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(g.top[k].token, top[k].token) << j << " " << k;
      EXPECT_FLOAT_EQ(g.top[k].logprob, top[k].logprob) << j << " " << k;
    }
  }
  // The first generated token: the argmax of the last prompt row.
  EXPECT_EQ(c.tokens.at(0).id,
            argmax(std::span<const float>(rows.data() + (prompt.size() - 1) * V, V)));
}

// Each slot continues with token (last * 7 + 3) % vocab; rows are one-hot-ish (5 for that token,
// 1 for the one after, -10 elsewhere), so every prompt logprob and rank is known exactly.
class NextBackend : public test::HistoryBackend {
 public:
  NextBackend(int n_slots, int page, int64_t blocks, int vocab, bool score_rows = false)
      : HistoryBackend("next", n_slots, page, blocks, vocab, score_rows) {}
  // Steps wait until open() (the requests a test submits then all meet in the pool, however the
  // threads happen to run), unless gated is false.
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override {
    if (gated) opened_.wait();
    HistoryBackend::step(work, logits);
  }
  void open() { open_.set_value(); }
  bool gated = false;

 private:
  std::promise<void> open_;
  std::shared_future<void> opened_ = open_.get_future().share();

 protected:
  int32_t next_token(const std::vector<int32_t>& h) const override {
    return (h.back() * 7 + 3) % vocab();
  }
};

// Both ways a backend can serve prompt rows: as logits rows scored on the host (all_logits), or
// scored by the backend itself (Backend::max_score_top: score_top / score_next, the CUDA
// engine's way), through the same preemptions.
class PromptLogprobsBothWays : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(, PromptLogprobsBothWays, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Scored" : "HostRows"; });

TEST_P(PromptLogprobsBothWays, OncePerPositionThroughPreemptions) {
  const bool scored = GetParam();
  const int V = 101;
  // 12 sequences of 60 prompt + 40 output tokens in 4-token pages: 25 blocks each, 50 in the
  // pool, prompts at 6 rows a step: decodes preempt the latest arrivals, some within their
  // prompt's rows.
  auto backend = std::make_unique<NextBackend>(12, 4, 50, V, scored);
  NextBackend* be = backend.get();
  be->gated = true;
  EngineOptions eo;
  eo.scheduler.max_batch = 12;
  eo.scheduler.chunk_size = 8;
  eo.scheduler.max_num_batched_tokens = 48;
  eo.scheduler.max_logit_rows = 6;
  Engine eng(std::move(backend), nullptr, eo);
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 12; ++i) {
    GenerationRequest r;
    r.prompt = prompt_of(60, 3 + i, V);
    r.sampling.temperature = 0;
    r.max_tokens = 40;
    r.prompt_logprobs = i % 3;  // 0, 1 and 2 top entries
    prompts.push_back(r.prompt);
    streams.push_back(eng.submit(r));
  }
  be->open();
  std::vector<Collected> got(12);
  std::vector<std::thread> threads;
  for (int i = 0; i < 12; ++i) threads.emplace_back([&, i] { got[i] = collect(*streams[i]); });
  for (auto& t : threads) t.join();
  EXPECT_GT(eng.stats().n_preemptions, 0);
  // Sequences were preempted within their prompt rows and resumed them; each position is
  // reported once. The recompute runs the positions whose rows were taken without rows: with
  // host rows no row runs twice (a chunk of the backend's own scoring may straddle the point it
  // resumes from). A backend that scores rows itself gets whole chunks (8 tokens), not 6 rows a
  // step.
  std::printf("all-logits rows: %lld for 12 x 60 prompt tokens, %lld resumptions\n",
              static_cast<long long>(be->n_all_logits_rows_),
              static_cast<long long>(be->n_rows_resumed_));
  EXPECT_GT(be->n_rows_resumed_, 0);
  EXPECT_GE(be->n_all_logits_rows_, 12 * 59);
  // (Scored: each resumption may repeat at most the rest of one 8-token chunk.)
  EXPECT_LE(be->n_all_logits_rows_, 12 * 60 + (scored ? 8 * be->n_rows_resumed_ : 0));
  EXPECT_EQ(be->max_item_rows_, scored ? 8 : 6);
  const double lse = std::log(std::exp(5.0) + std::exp(1.0) + (V - 2) * std::exp(-10.0));
  for (int i = 0; i < 12; ++i) {
    const auto& p = prompts[i];
    ASSERT_EQ(got[i].last.finish, FinishReason::kLength) << i;
    ASSERT_EQ(got[i].tokens.size(), 40u) << i;
    ASSERT_EQ(got[i].prompt.size(), p.size() - 1) << i;
    for (size_t j = 1; j < p.size(); ++j) {
      const GeneratedToken& g = got[i].prompt[j - 1];
      const int32_t pred = (p[j - 1] * 7 + 3) % V;
      const float logit = p[j] == pred ? 5.0f : p[j] == (pred + 1) % V ? 1.0f : -10.0f;
      EXPECT_EQ(g.id, p[j]) << i << " " << j;
      EXPECT_NEAR(g.logprob, logit - lse, 1e-5) << i << " " << j;
      EXPECT_EQ(g.rank, logit == 5.0f ? 1 : logit == 1.0f ? 2 : V) << i << " " << j;
      ASSERT_EQ(g.top.size(), static_cast<size_t>(i % 3)) << i;
      if (i % 3 >= 1) {
        EXPECT_EQ(g.top[0].token, pred);
      }
      if (i % 3 >= 2) {
        EXPECT_EQ(g.top[1].token, (pred + 1) % V);
      }
    }
  }
  EXPECT_TRUE(eng.wait_idle(std::chrono::milliseconds(2000)));
  EXPECT_EQ(eng.stats().memory.kv_blocks_used, 0);
}

TEST(PromptLogprobs, RefusedOutOfRangeAndNoneForOneToken) {
  auto backend = std::make_unique<NextBackend>(2, 16, 100, 50);
  Engine eng(std::move(backend), nullptr, EngineOptions{});
  GenerationRequest r;
  r.prompt = {1, 2, 3};
  r.max_tokens = 2;
  r.sampling.temperature = 0;
  r.prompt_logprobs = 51;
  try {
    eng.submit(r);
    FAIL() << "prompt_logprobs past the vocabulary accepted";
  } catch (const RejectedError& e) {
    EXPECT_EQ(e.param, "prompt_logprobs");
  }
  r.prompt_logprobs = -2;
  EXPECT_THROW(eng.submit(r), RejectedError);
  // A one-token prompt has no position to score: no prompt logprobs, and the token comes.
  r.prompt = {7};
  r.prompt_logprobs = 2;
  const Collected c = collect(*eng.submit(r));
  EXPECT_TRUE(c.prompt.empty());
  ASSERT_EQ(c.tokens.size(), 2u);
  EXPECT_EQ(c.tokens[0].id, (7 * 7 + 3) % 50);
}

}  // namespace
}  // namespace ds
