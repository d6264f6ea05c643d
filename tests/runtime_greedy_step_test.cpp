// Backend::step_greedy (the interface for device-side greedy sampling) without a GPU:
// greedy_token() semantics (lowest id on ties, -1 for NaN / +inf), the CPU backend's step_greedy
// against step() on a twin backend (greedy items give the argmax of the row step() returns and no
// row, the others the same rows, all_logits items ignore the flag, the same state changes), and
// the engine's use of it: which rows it asks as tokens (greedy without logprobs / penalties, and
// rows it does not sample), the same generated tokens as the host sampler on the tiny model, and
// a NaN row failing only its own request.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <thread>

#include "model/weights.h"
#include "runtime/cpu_backend.h"
#include "runtime/engine.h"

namespace ds {
namespace {

TEST(GreedyToken, LowestIdOnTiesAndRefusesNanAndInf) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(greedy_token(std::vector<float>{1, 3, 2, 3}), 1);
  EXPECT_EQ(greedy_token(std::vector<float>{-5, -1, -1}), 1);
  EXPECT_EQ(greedy_token(std::vector<float>{-inf, -inf, -inf}), 0);
  EXPECT_EQ(greedy_token(std::vector<float>{-inf, -3, -inf}), 1);
  EXPECT_EQ(greedy_token(std::vector<float>{1, nan, 2}), -1);
  EXPECT_EQ(greedy_token(std::vector<float>{1, inf, 2}), -1);
  EXPECT_EQ(greedy_token(std::vector<float>{7}), 0);
}

std::vector<int32_t> seq(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + salt * 11) % 256);
  return t;
}

TEST(CpuBackendGreedy, StepGreedyMatchesStepPlusArgmax) {
  const HostWeights w = make_synthetic_weights(tiny_model_config(256), 7);
  BackendOptions o;
  o.n_slots = 4;
  o.chunk_size = 16;
  CpuBackend a(w, o), b(w, o);
  const int V = a.config().vocab_size;
  const auto p0 = seq(20, 1), p1 = seq(9, 2), p2 = seq(5, 3), p3 = seq(12, 4);
  // Items: greedy prompt, plain prompt, greedy + all_logits (flag ignored), greedy prompt.
  std::vector<SeqWork> work = {
      {0, p0, false, true}, {1, p1, false, false}, {2, p2, true, true}, {3, p3, false, true}};
  std::vector<float> ref;
  a.step(work, ref);
  StepOutput out;
  b.step_greedy(work, out);
  ASSERT_EQ(ref.size(), size_t(V) * (1 + 1 + p2.size() + 1));
  // The reference rows: item 0 -> row 0, item 1 -> row 1, item 2 -> rows 2..6, item 3 -> row 7.
  ASSERT_EQ(out.tokens.size(), work.size());
  EXPECT_EQ(out.tokens[0], greedy_token(std::span<const float>(ref.data(), V)));
  EXPECT_EQ(out.tokens[1], -1);
  EXPECT_EQ(out.tokens[2], -1);
  EXPECT_EQ(out.tokens[3], greedy_token(std::span<const float>(ref.data() + 7 * V, V)));
  ASSERT_EQ(out.logits.size(), size_t(V) * (1 + p2.size()));
  for (int i = 0; i < V; ++i) ASSERT_EQ(out.logits[i], ref[V + i]) << i;  // item 1's row
  for (size_t i = 0; i < p2.size() * V; ++i) ASSERT_EQ(out.logits[V + i], ref[2 * V + i]) << i;
  for (int s = 0; s < 4; ++s) EXPECT_EQ(a.slot_len(s), b.slot_len(s));

  // Decode steps: all greedy, then no greedy item at all (step()'s layout).
  std::vector<int32_t> t0{5}, t1{6};
  std::vector<SeqWork> dec = {{0, t0, false, true}, {1, t1, false, true}};
  a.step(dec, ref);
  b.step_greedy(dec, out);
  EXPECT_TRUE(out.logits.empty());
  EXPECT_EQ(out.tokens[0], greedy_token(std::span<const float>(ref.data(), V)));
  EXPECT_EQ(out.tokens[1], greedy_token(std::span<const float>(ref.data() + V, V)));
  dec[0].greedy = dec[1].greedy = false;
  a.step(dec, ref);
  b.step_greedy(dec, out);
  EXPECT_EQ(out.logits, ref);
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{-1, -1}));
  EXPECT_EQ(a.slot_len(0), 22);
  EXPECT_EQ(b.slot_len(0), 22);

  // A bad step changes nothing and throws, as step() does.
  std::vector<int32_t> bad{V};
  std::vector<SeqWork> bw = {{0, bad, false, true}};
  EXPECT_THROW(b.step_greedy(bw, out), Error);
  EXPECT_EQ(b.slot_len(0), 22);
}

// Wraps a backend and records the `greedy` flags of every step_greedy() call; optionally turns
// into NaN every row of the sequence whose first token is `nan_first_token` (through step(), which
// the default step_greedy() calls).
class RecordingBackend : public Backend {
 public:
  RecordingBackend(std::unique_ptr<Backend> inner, int32_t nan_first_token = -1)
      : inner_(std::move(inner)), nan_first_(nan_first_token), poisoned_(inner_->n_slots(), 0) {}
  const ModelConfig& config() const override { return inner_->config(); }
  std::string name() const override { return "recording"; }
  int n_slots() const override { return inner_->n_slots(); }
  int max_seq_len() const override { return inner_->max_seq_len(); }
  int slot_len(int s) const override { return inner_->slot_len(s); }
  bool can_grow(int s, int n) const override { return inner_->can_grow(s, n); }
  void reset_slot(int s) override {
    inner_->reset_slot(s);
    poisoned_.at(s) = 0;
  }
  MemoryUsage memory() const override { return inner_->memory(); }
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override {
    for (const SeqWork& w : work)
      if (inner_->slot_len(w.slot) == 0) poisoned_.at(w.slot) = w.tokens[0] == nan_first_;
    inner_->step(work, logits);
    const size_t V = config().vocab_size;
    size_t row = 0;
    for (const SeqWork& w : work) {
      const size_t n = w.all_logits ? w.tokens.size() : 1;
      if (poisoned_.at(w.slot))
        for (size_t i = 0; i < n * V; ++i) logits[row * V + i] = std::nanf("");
      row += n;
    }
  }
  void step_greedy(std::span<const SeqWork> work, StepOutput& out) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (const SeqWork& w : work) {
        ++n_items_;
        n_greedy_ += w.greedy;
      }
    }
    Backend::step_greedy(work, out);
  }
  std::pair<int, int> counts() {
    std::lock_guard<std::mutex> lk(mu_);
    return {n_items_, n_greedy_};
  }

 private:
  std::unique_ptr<Backend> inner_;
  int32_t nan_first_;
  std::vector<char> poisoned_;
  std::mutex mu_;
  int n_items_ = 0, n_greedy_ = 0;
};

std::vector<int32_t> run_request(Engine& eng, GenerationRequest req, FinishReason* finish = nullptr,
                                 std::string* error = nullptr,
                                 std::vector<GeneratedToken>* toks = nullptr) {
  auto s = eng.submit(std::move(req));
  std::vector<int32_t> ids;
  StreamOutput o;
  for (int i = 0; i < 10000; ++i) {
    if (!s->next(o, std::chrono::milliseconds(10000))) break;
    for (const GeneratedToken& g : o.tokens) {
      ids.push_back(g.id);
      if (toks) toks->push_back(g);
    }
    if (o.finish != FinishReason::kNone) {
      if (finish) *finish = o.finish;
      if (error) *error = o.error;
      break;
    }
  }
  return ids;
}

GenerationRequest greedy_request(int salt, int max_tokens) {
  GenerationRequest r;
  r.prompt = seq(11 + salt, salt);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.sampling.temperature = 0;
  return r;
}

EngineOptions engine_options(bool device_greedy) {
  EngineOptions o;
  o.scheduler.max_batch = 4;
  o.scheduler.chunk_size = 8;  // prompts in several chunks: rows the engine does not sample
  o.scheduler.max_num_batched_tokens = 32;
  o.device_greedy = device_greedy;
  return o;
}

TEST(EngineGreedy, TokenRowsGiveTheHostSamplersTokens) {
  const HostWeights w = make_synthetic_weights(tiny_model_config(256), 11);
  BackendOptions bo;
  bo.n_slots = 4;
  bo.chunk_size = 64;
  GenerationRequest lp = greedy_request(2, 6);  // logprobs: the row must come to the host
  lp.top_logprobs = 2;
  GenerationRequest pen = greedy_request(3, 8);  // penalties act on the host logits
  pen.sampling.repetition_penalty = 1.3f;
  const std::vector<GenerationRequest> reqs = {greedy_request(1, 12), lp, pen,
                                               greedy_request(4, 9)};
  // One request at a time, or all at once (rows with and without tokens mixed in each step).
  auto run_all = [&](bool device_greedy, bool together, std::pair<int, int>* counts) {
    auto rec = std::make_unique<RecordingBackend>(std::make_unique<CpuBackend>(w, bo));
    RecordingBackend* r = rec.get();
    Engine eng(std::move(rec), nullptr, engine_options(device_greedy));
    std::vector<std::vector<int32_t>> outs(reqs.size());
    std::vector<std::vector<GeneratedToken>> toks(reqs.size());
    if (together) {
      std::vector<std::thread> th;
      for (size_t i = 0; i < reqs.size(); ++i)
        th.emplace_back(
            [&, i] { outs[i] = run_request(eng, reqs[i], nullptr, nullptr, &toks[i]); });
      for (auto& t : th) t.join();
    } else {
      for (size_t i = 0; i < reqs.size(); ++i)
        outs[i] = run_request(eng, reqs[i], nullptr, nullptr, &toks[i]);
    }
    EXPECT_EQ(toks[1].size(), 6u);
    for (const GeneratedToken& g : toks[1]) {
      EXPECT_EQ(g.top.size(), 2u);
      EXPECT_LT(g.logprob, 0.f);
      if (!g.top.empty()) {
        EXPECT_EQ(g.top[0].token, g.id);  // greedy: the most probable
      }
    }
    *counts = r->counts();
    return outs;
  };
  std::pair<int, int> on{}, off{}, both{}, both_off{};
  const auto got = run_all(true, false, &on);
  const auto ref = run_all(false, false, &off);
  EXPECT_EQ(got, ref);
  EXPECT_EQ(run_all(true, true, &both), ref);
  EXPECT_EQ(run_all(false, true, &both_off), ref);
  EXPECT_GT(both.second, 0);
  for (const auto& o : got) EXPECT_FALSE(o.empty());
  EXPECT_EQ(off.second, 0) << "device_greedy off: every row goes to the host";
  EXPECT_GT(on.second, 0);
  EXPECT_LT(on.second, on.first) << "logprobs / penalty requests must get their rows";
}

TEST(EngineGreedy, NanRowFailsOnlyItsRequest) {
  const HostWeights w = make_synthetic_weights(tiny_model_config(256), 11);
  BackendOptions bo;
  bo.n_slots = 2;
  bo.chunk_size = 64;
  // Request 1's prompt starts with token seq(12, 1)[0] = 11: its rows are NaN, request 2's not.
  auto rec = std::make_unique<RecordingBackend>(std::make_unique<CpuBackend>(w, bo), 11);
  EngineOptions o = engine_options(true);
  o.scheduler.max_batch = 2;
  Engine eng(std::move(rec), nullptr, o);
  auto s1 = eng.submit(greedy_request(1, 4));
  auto s2 = eng.submit(greedy_request(2, 4));
  std::vector<FinishReason> fin;
  std::vector<std::string> err;
  for (auto* s : {&s1, &s2}) {
    StreamOutput out;
    fin.push_back(FinishReason::kNone);
    err.emplace_back();
    for (int i = 0; i < 1000 && fin.back() == FinishReason::kNone; ++i) {
      if (!(*s)->next(out, std::chrono::milliseconds(10000))) break;
      fin.back() = out.finish;
      err.back() = out.error;
    }
  }
  EXPECT_EQ(fin[0], FinishReason::kError);
  EXPECT_NE(err[0].find("NaN"), std::string::npos) << err[0];
  EXPECT_EQ(fin[1], FinishReason::kLength) << err[1];
}

}  // namespace
}  // namespace ds
