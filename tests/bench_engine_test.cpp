// The engine benches' bookkeeping against a fake Backend that records every step (no model): the
// decode bench fills each context bucket once for its largest batch, runs every batch on the
// first slots, times exactly `steps` steps after `warmup`, reports the context the steps really
// ran at and the floor from it; the prefill bench runs each prompt on a fresh slot the asked number
// of times; time budgets skip what is left. CPU only (runs in CI).
#include <gtest/gtest.h>

#include <map>

#include "bench/bench.h"
#include "core/error.h"
#include "model/weights.h"

namespace ds::bench {
namespace {

class FakeBackend final : public Backend {
 public:
  explicit FakeBackend(int slots, int max_len)
      : cfg_(tiny_model_config()), len_(slots, 0), max_len_(max_len) {}
  const ModelConfig& config() const override { return cfg_; }
  std::string name() const override { return "fake"; }
  int n_slots() const override { return static_cast<int>(len_.size()); }
  int max_seq_len() const override { return max_len_; }
  int slot_len(int slot) const override { return len_.at(slot); }
  bool can_grow(int slot, int n_new) const override { return len_.at(slot) + n_new <= max_len_; }
  void reset_slot(int slot) override { len_.at(slot) = 0; }
  MemoryUsage memory() const override { return {}; }
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override {
    std::vector<int> shape;
    for (const SeqWork& w : work) {
      DS_CHECK(len_.at(w.slot) + int(w.tokens.size()) <= max_len_, "fake: slot overflow");
      for (int32_t t : w.tokens) DS_CHECK(t >= 0 && t < cfg_.vocab_size, "fake: bad token");
      len_[w.slot] += static_cast<int>(w.tokens.size());
      shape.push_back(static_cast<int>(w.tokens.size()));
    }
    steps.push_back(shape);
    logits.assign(work.size() * size_t(cfg_.vocab_size), 0.f);
  }
  std::vector<std::vector<int>> steps;  // tokens per item of every step

 private:
  ModelConfig cfg_;
  std::vector<int> len_;
  int max_len_;
};

TEST(BenchEngine, DecodeFillsOncePerContextAndRunsEveryBatch) {
  EngineBenchOptions o;
  o.decode_cases = parse_decode_cases("4@256,1@256,1@512");
  o.decode_steps = 10;
  o.decode_warmup = 2;
  FakeBackend be(decode_slots_needed(o), 4096);
  Ceilings c;
  c.valid = true;
  c.read_bps = 1e12;
  c.gemm_flops = 1e15;
  const auto r = run_decode_bench(be, c, o);
  ASSERT_EQ(r.size(), 3u);
  // Ascending context, then ascending batch.
  EXPECT_EQ(r[0].batch, 1);
  EXPECT_EQ(r[0].context, 256);
  EXPECT_EQ(r[1].batch, 4);
  EXPECT_EQ(r[2].context, 512);
  // Context 256: one fill of 4 slots; batch 1 then ran 12 steps on slot 0 only.
  EXPECT_EQ(r[0].fill_tokens, 4 * 256);
  EXPECT_DOUBLE_EQ(r[0].context_mean, 256 + 2 + 4.5);  // after the warm-up, mean over 10 steps
  // Batch 4: slot 0 holds 12 more tokens than slots 1..3.
  EXPECT_DOUBLE_EQ(r[1].context_mean, (4 * 256 + 12) / 4.0 + 2 + 4.5);
  EXPECT_EQ(r[1].fill_tokens, 0);
  // Context 512: only slot 0 grows, from 256 + 24.
  EXPECT_EQ(r[2].fill_tokens, 512 - (256 + 24));
  for (const auto& d : r) {
    EXPECT_EQ(d.tpot_s.n, 10);
    EXPECT_GT(d.floor_s, 0);
    const DecodeBytes b =
        decode_step_bytes(be.config(), static_cast<int64_t>(d.context_mean + 0.5), d.batch);
    EXPECT_DOUBLE_EQ(d.floor_s, b.total() / 1e12);
  }
  // Steps: fill (4 items), 12 steps of batch 1, 12 of batch 4, fill (1 item), 12 of batch 1.
  int one = 0, four = 0;
  for (const auto& s : be.steps) {
    if (s.size() == 1 && s[0] == 1) ++one;
    if (s.size() == 4 && s[0] == 1) ++four;
  }
  EXPECT_EQ(one, 24);
  EXPECT_EQ(four, 12);
  // The slots are released at the end.
  for (int s = 0; s < be.n_slots(); ++s) EXPECT_EQ(be.slot_len(s), 0);
}

TEST(BenchEngine, DecodeRefusesWhatDoesNotFit) {
  EngineBenchOptions o;
  o.decode_cases = parse_decode_cases("2@1000");
  FakeBackend small(1, 4096);
  EXPECT_THROW(run_decode_bench(small, Ceilings{}, o), Error);  // 2 slots needed, 1 there
  FakeBackend short_seq(2, 1000);
  EXPECT_THROW(run_decode_bench(short_seq, Ceilings{}, o), Error);  // no room for the steps
}

TEST(BenchEngine, PrefillRepeatsOnAFreshSlot) {
  EngineBenchOptions o;
  o.prompts = {128, 64};
  o.prefill_repeats = {2, 3};
  FakeBackend be(1, 4096);
  Ceilings c;
  c.valid = true;
  c.read_bps = 1e12;
  c.gemm_flops = 1e14;
  const auto r = run_prefill_bench(be, c, o);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].ttft_s.n, 2);
  EXPECT_EQ(r[1].ttft_s.n, 3);
  EXPECT_DOUBLE_EQ(r[0].floor_s, prefill_flops(be.config(), 128).total() / 1e14);
  // One warm-up, then every run is the whole prompt in one step on an empty slot.
  ASSERT_EQ(be.steps.size(), 1u + 2 + 3);
  EXPECT_EQ(be.steps[1], std::vector<int>{128});
  EXPECT_EQ(be.steps[5], std::vector<int>{64});
  EXPECT_EQ(be.slot_len(0), 0);
  // Without ceilings there is no floor.
  FakeBackend be2(1, 4096);
  EXPECT_LT(run_prefill_bench(be2, Ceilings{}, o)[0].floor_s, 0);
  o.prompts = {8192};
  EXPECT_THROW(run_prefill_bench(be2, Ceilings{}, o), Error);  // longer than max_seq_len
}

TEST(BenchEngine, ServeRunsTheBucketsWithFixedSeed) {
  EngineBenchOptions o;
  o.serve_requests = 2;
  o.serve_output = 3;
  auto run = [&]() { return run_serve_bench(std::make_unique<FakeBackend>(1, 40000), o); };
  const ServeResult a = run();
  ASSERT_EQ(a.buckets.size(), 3u);
  for (const auto& b : a.buckets) {
    ASSERT_EQ(b.prompts.size(), 2u);
    for (int p : b.prompts) {
      EXPECT_GE(p, b.lo);
      EXPECT_LT(p, b.hi);
    }
    EXPECT_EQ(b.ttft_s.n, 2);
    EXPECT_GT(b.throughput, 0);
  }
  EXPECT_NEAR(a.buckets[0].weight + a.buckets[1].weight + a.buckets[2].weight, 1.0, 1e-12);
  // The same requests every run.
  const ServeResult b = run();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a.buckets[i].prompts, b.buckets[i].prompts);
}

}  // namespace
}  // namespace ds::bench
