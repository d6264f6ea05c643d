// Sampling: greedy, seeded reproducibility, top-k / top-p / min-p supports, temperature
// frequencies, penalties, log-softmax helpers, parameter validation.
#include <gtest/gtest.h>

#include <algorithm>

#include <random>

#include <numeric>

#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "core/error.h"
#include "runtime/sampling.h"

namespace ds {
namespace {

std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

std::map<int, int> histogram(Sampler& s, std::span<const float> logits, int n) {
  std::map<int, int> h;
  for (int i = 0; i < n; ++i) ++h[s.sample(logits)];
  return h;
}

TEST(Sampling, GreedyIsArgmaxLowestIdOnTies) {
  std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f, 2.9f};
  SamplingParams p;
  p.temperature = 0.0f;
  Sampler s(p);
  EXPECT_EQ(s.sample(l), 1);
  EXPECT_EQ(argmax(l), 1);
}

TEST(Sampling, SameSeedSameTokensOtherSeedOtherTokens) {
  std::vector<float> l(1000, 0.0f);  // flat: every draw is a fresh 1-in-1000 choice
  SamplingParams p;
  p.seed = 42;
  Sampler a(p), b(p);
  p.seed = 43;
  Sampler c(p);
  std::vector<int> ta, tb, tc;
  for (int i = 0; i < 50; ++i) {
    ta.push_back(a.sample(l));
    tb.push_back(b.sample(l));
    tc.push_back(c.sample(l));
  }
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
  EXPECT_GT(std::set<int>(ta.begin(), ta.end()).size(), 40u);  // not stuck on one token
}

TEST(Sampling, TopK1IsGreedyAtAnyTemperature) {
  std::vector<float> l = {0.5f, 0.4f, 0.6f, 0.59f};
  SamplingParams p;
  p.temperature = 5.0f;
  p.top_k = 1;
  p.seed = 1;
  Sampler s(p);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(s.sample(l), 2);
}

TEST(Sampling, FrequenciesFollowTemperatureAndTopK) {
  const std::vector<double> probs = {0.4, 0.3, 0.2, 0.1};
  const auto l = logits_of(probs);
  const int n = 40000;
  {  // T = 0.5: p ~ probs^2, renormalised
    SamplingParams p;
    p.temperature = 0.5f;
    p.seed = 7;
    Sampler s(p);
    auto h = histogram(s, l, n);
    double z = 0;
    for (double q : probs) z += q * q;
    for (int t = 0; t < 4; ++t) EXPECT_NEAR(h[t] / double(n), probs[t] * probs[t] / z, 0.01) << t;
  }
  {  // top_k 2 at T = 1: {0.4, 0.3} renormalised
    SamplingParams p;
    p.top_k = 2;
    p.seed = 8;
    Sampler s(p);
    auto h = histogram(s, l, n);
    EXPECT_EQ(h.count(2) + h.count(3), 0u);
    EXPECT_NEAR(h[0] / double(n), 0.4 / 0.7, 0.01);
  }
}

TEST(Sampling, TopPKeepsSmallestSetReachingP) {
  const auto l = logits_of({0.15, 0.5, 0.05, 0.3});
  auto support = [&](float top_p) {
    SamplingParams p;
    p.top_p = top_p;
    p.seed = 3;
    Sampler s(p);
    std::set<int> seen;
    for (int i = 0; i < 3000; ++i) seen.insert(s.sample(l));
    return seen;
  };
  EXPECT_EQ(support(0.4f), (std::set<int>{1}));
  EXPECT_EQ(support(0.75f), (std::set<int>{1, 3}));
  EXPECT_EQ(support(0.9f), (std::set<int>{0, 1, 3}));
  EXPECT_EQ(support(1.0f), (std::set<int>{0, 1, 2, 3}));
}

TEST(Sampling, TopPOverMoreThanTheSortedHead) {
  // Flat over 5000 tokens, top_p 0.5: exactly ids 0..2499 survive (ties keep the lower id), which
  // needs the full sort beyond the first 1024 candidates.
  std::vector<float> l(5000, 1.0f);
  SamplingParams p;
  p.top_p = 0.5f;
  p.seed = 11;
  Sampler s(p);
  int max_id = 0;
  for (int i = 0; i < 4000; ++i) max_id = std::max(max_id, s.sample(l));
  EXPECT_LT(max_id, 2500);
  EXPECT_GT(max_id, 2400);
}

TEST(Sampling, MinPDropsUnlikelyTokens) {
  const auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  SamplingParams p;
  p.min_p = 0.2f;  // threshold 0.1
  p.seed = 5;
  Sampler s(p);
  std::set<int> seen;
  for (int i = 0; i < 3000; ++i) seen.insert(s.sample(l));
  EXPECT_EQ(seen, (std::set<int>{0, 1, 2}));
}

TEST(Sampling, Penalties) {
  std::vector<float> l = {2.0f, -2.0f, 1.0f, 0.0f};
  const std::vector<int32_t> hist = {0, 1, 0};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  apply_penalties(l, hist, p);
  EXPECT_FLOAT_EQ(l[0], 1.0f);
  EXPECT_FLOAT_EQ(l[1], -4.0f);
  EXPECT_FLOAT_EQ(l[2], 1.0f);
  SamplingParams q;
  q.presence_penalty = 0.5f;
  q.frequency_penalty = 0.25f;
  std::vector<float> m = {2.0f, -2.0f, 1.0f, 0.0f};
  apply_penalties(m, hist, q);
  EXPECT_FLOAT_EQ(m[0], 2.0f - 0.5f - 0.5f);
  EXPECT_FLOAT_EQ(m[1], -2.0f - 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(m[3], 0.0f);
  // Greedy with a repetition penalty moves off the repeated token.
  SamplingParams g;
  g.temperature = 0.0f;
  g.presence_penalty = 2.0f;
  Sampler s(g);
  std::vector<float> r = {1.0f, 0.5f};
  EXPECT_EQ(s.sample(r), 0);
  EXPECT_EQ(s.sample(r, std::vector<int32_t>{0}), 1);
}

TEST(Sampling, LogSoftmaxAndTopLogprobs) {
  std::vector<float> l = {1.0f, 3.0f, 2.0f, 3.0f};
  std::vector<float> lp;
  log_softmax(l, lp);
  double z = 0;
  for (float v : lp) z += std::exp(v);
  EXPECT_NEAR(z, 1.0, 1e-6);
  const double lse = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(lp[2], 2.0 - lse, 1e-6);
  EXPECT_NEAR(token_logprob(l, 0), 1.0 - lse, 1e-6);
  auto top = top_logprobs(l, 3);
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].token, 1);
  EXPECT_EQ(top[1].token, 3);
  EXPECT_EQ(top[2].token, 2);
  EXPECT_NEAR(top[0].logprob, 3.0 - lse, 1e-6);
  // Large logits stay finite.
  std::vector<float> big = {1000.0f, 999.0f};
  log_softmax(big, lp);
  EXPECT_NEAR(lp[0], -std::log1p(std::exp(-1.0)), 1e-5);
}

// The vectorized log-sum-exp at a real vocabulary (248320: not a multiple of its 1024 blocks),
// against double-precision sums: logits of a wide spread, ties, values far below the maximum
// and -inf; the rank (vLLM's: ids with a logit >= the token's) and top ids against a full sort.
TEST(Sampling, LogprobsOfAWholeVocabularyRow) {
  const size_t V = 248320;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> l(V);
  for (float& x : l) x = normal(rng);
  l[7] = l[8] = 30.0f;  // the largest, tied
  l[100] = -INFINITY;
  l[101] = -500.0f;
  l[V - 1] = 29.5f;  // in the tail past the last whole block
  double m = 30.0, z = 0.0;
  for (float x : l) z += std::exp(static_cast<double>(x) - m);
  const double lse = m + std::log(z);
  std::vector<float> lp;
  log_softmax(l, lp);
  double worst = 0.0;
  for (size_t i = 0; i < V; ++i) {
    if (i == 100) {
      EXPECT_EQ(lp[i], -INFINITY);
      continue;
    }
    // 4e-6 from the sum, plus the float result's own rounding (-531 for id 101).
    const double ref = l[i] - lse;
    worst = std::max(worst, std::fabs(lp[i] - ref) / (4e-6 + std::fabs(ref) * 0x1p-23));
  }
  EXPECT_LT(worst, 1.0);
  for (int32_t t : {7, 8, 101, 5000, static_cast<int32_t>(V - 1)}) {
    const double ref = l[t] - lse;
    EXPECT_NEAR(token_logprob(l, t), ref, 4e-6 + std::fabs(ref) * 0x1p-23) << t;
    const PositionLogprobs p = position_logprobs(l, t, 4);
    EXPECT_EQ(p.logprob, token_logprob(l, t)) << t;
    EXPECT_EQ(p.rank, std::count_if(l.begin(), l.end(), [&](float x) { return x >= l[t]; })) << t;
    std::vector<int32_t> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
    ASSERT_EQ(p.top.size(), 4u);
    const auto top = top_logprobs(l, 4);
    for (int k = 0; k < 4; ++k) {
      EXPECT_EQ(p.top[k].token, order[k]) << k;
      EXPECT_EQ(top[k].token, order[k]) << k;
      EXPECT_EQ(p.top[k].logprob, lp[order[k]]) << k;
    }
  }
  EXPECT_EQ(position_logprobs(l, 7, 0).rank, 2);  // tied with 8
  EXPECT_EQ(position_logprobs(l, 100, 0).rank, static_cast<int32_t>(V));
  EXPECT_THROW(position_logprobs(l, static_cast<int32_t>(V), 1), Error);
}

// A NaN logit reads as -inf everywhere (as the device scorer reads it): every logprob, rank and
// top id of a row with NaNs equals those of the same row with -inf in their place, and the
// sum does not turn NaN. Each NaN in a different place: a vector block, the tail, the first id.
TEST(Sampling, NanLogitsReadAsMinusInfinity) {
  const size_t V = 5000;  // 4 whole blocks and a tail
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> with_inf(V);
  for (float& x : with_inf) x = normal(rng);
  with_inf[11] = 40.0f;  // the largest
  const size_t nans[] = {0, 17, 2049, V - 2};
  for (size_t i : nans) with_inf[i] = -INFINITY;
  std::vector<float> with_nan = with_inf;
  for (size_t i : nans) with_nan[i] = std::numeric_limits<float>::quiet_NaN();

  std::vector<float> a, b;
  log_softmax(with_inf, a);
  log_softmax(with_nan, b);
  EXPECT_TRUE(std::isfinite(a[11]));
  for (size_t i = 0; i < V; ++i) ASSERT_EQ(a[i], b[i]) << i;
  // Targets: the best id, an ordinary one, and a NaN one (logprob -inf, rank: the whole row).
  for (int32_t t : {11, 300, 17}) {
    EXPECT_EQ(token_logprob(with_nan, t), token_logprob(with_inf, t)) << t;
    const PositionLogprobs p = position_logprobs(with_nan, t, 6);
    const PositionLogprobs q = position_logprobs(with_inf, t, 6);
    EXPECT_EQ(p.logprob, q.logprob) << t;
    EXPECT_EQ(p.rank, q.rank) << t;
    ASSERT_EQ(p.top.size(), q.top.size());
    for (size_t k = 0; k < p.top.size(); ++k) {
      EXPECT_EQ(p.top[k].token, q.top[k].token) << k;
      EXPECT_EQ(p.top[k].logprob, q.top[k].logprob) << k;
    }
  }
  EXPECT_EQ(position_logprobs(with_nan, 17, 0).logprob, -INFINITY);
  EXPECT_EQ(position_logprobs(with_nan, 17, 0).rank, static_cast<int32_t>(V));
  EXPECT_EQ(position_logprobs(with_nan, 11, 0).rank, 1);
  // The top ids of a row that is mostly NaN: the finite ones first, then NaN ids by id (as -inf).
  std::vector<float> mostly(8, std::numeric_limits<float>::quiet_NaN());
  mostly[5] = 1.0f;
  mostly[2] = 2.0f;
  const auto top = top_logprobs(mostly, 4);
  ASSERT_EQ(top.size(), 4u);
  EXPECT_EQ(top[0].token, 2);
  EXPECT_EQ(top[1].token, 5);
  EXPECT_EQ(top[2].token, 0);
  EXPECT_EQ(top[3].token, 1);
  EXPECT_NEAR(top[0].logprob, 2.0 - std::log(std::exp(2.0) + std::exp(1.0)), 1e-6);
  EXPECT_EQ(top[2].logprob, -INFINITY);
}

TEST(Sampling, BadParamsAndLogitsThrow) {
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_THROW(Sampler{p}, Error);
  p = {};
  p.temperature = -1.0f;
  EXPECT_THROW(Sampler{p}, Error);
  p = {};
  p.min_p = 1.5f;
  EXPECT_THROW(p.validate(), Error);
  p = {};
  p.repetition_penalty = 0.0f;
  EXPECT_THROW(p.validate(), Error);
  p = {};
  Sampler s(p);
  std::vector<float> nan = {0.0f, std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> all_nan = {std::numeric_limits<float>::quiet_NaN()};
  EXPECT_THROW(s.sample(all_nan), Error);
  EXPECT_THROW(s.sample(nan), Error);
  EXPECT_THROW(s.sample(std::vector<float>{}), Error);
  EXPECT_THROW(token_logprob(std::vector<float>{1.0f}, 3), Error);
}

// logit_bias is added first, then the banned ids (min_tokens) go to -inf, then the penalties; a
// banned token is never drawn at any temperature, and a row with nothing left is an error.
TEST(Sampling, LogitBiasAndBannedTokens) {
  const std::vector<float> logits = {2.0f, 1.0f, 0.5f, -1.0f};
  SamplingParams p;
  p.temperature = 0.0f;
  p.logit_bias = {{3, 4.0f}};
  EXPECT_EQ(Sampler(p).sample(logits), 3);  // -1 + 4 beats 2
  p.logit_bias = {{0, -100.0f}};
  EXPECT_EQ(Sampler(p).sample(logits), 1);
  // Bias before penalties: with repetition_penalty 2, token 3 (seen) has (-1 + 4) / 2 = 1.5 < 2.
  p.logit_bias = {{3, 4.0f}};
  p.repetition_penalty = 2.0f;
  const std::vector<int32_t> seen = {3};
  EXPECT_EQ(Sampler(p).sample(logits, seen), 0);
  p = {};
  p.temperature = 0.0f;
  const std::vector<int32_t> ban0 = {0, 7, -1};  // ids outside the row are ignored
  EXPECT_EQ(Sampler(p).sample(logits, {}, ban0), 1);
  p.temperature = 5.0f;
  p.seed = 11;
  Sampler hot(p);
  const std::vector<int32_t> ban01 = {0, 1};
  std::set<int32_t> drawn;
  for (int i = 0; i < 2000; ++i) drawn.insert(hot.sample(logits, {}, ban01));
  EXPECT_EQ(drawn, (std::set<int32_t>{2, 3}));
  const std::vector<int32_t> all = {0, 1, 2, 3};
  EXPECT_THROW(hot.sample(logits, {}, all), Error);
  // allowed_token_ids: only those, before the bias (a bias on another id cannot bring it back).
  p = {};
  p.temperature = 0.0f;
  p.allowed_token_ids = {2, 3};
  p.logit_bias = {{0, 100.0f}, {3, 2.0f}};
  EXPECT_EQ(Sampler(p).sample(logits), 3);  // -1 + 2 = 1 beats 0.5
  p.temperature = 3.0f;
  p.seed = 5;
  p.logit_bias.clear();
  Sampler only23(p);
  drawn.clear();
  for (int i = 0; i < 1000; ++i) drawn.insert(only23.sample(logits));
  EXPECT_EQ(drawn, (std::set<int32_t>{2, 3}));
  const std::vector<int32_t> ban23 = {2, 3};
  EXPECT_THROW(only23.sample(logits, {}, ban23), Error);  // allowed minus banned: nothing left
  p = {};
  p.allowed_token_ids = {-2};
  EXPECT_THROW(p.validate(), Error);
  p = {};
  p.logit_bias = {{1, 100.5f}};
  EXPECT_THROW(p.validate(), Error);
  p.logit_bias = {{-1, 1.0f}};
  EXPECT_THROW(p.validate(), Error);
  p.logit_bias = {{1, std::numeric_limits<float>::quiet_NaN()}};
  EXPECT_THROW(p.validate(), Error);
}

}  // namespace
}  // namespace ds
