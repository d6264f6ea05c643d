// Token sampling (see sampling.h).
#include "runtime/sampling.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace ds {

void SamplingParams::validate() const {
  DS_CHECK(std::isfinite(temperature) && temperature >= 0.0f, "temperature must be >= 0, got ",
           temperature);
  DS_CHECK(std::isfinite(top_p) && top_p > 0.0f && top_p <= 1.0f, "top_p must be in (0, 1], got ",
           top_p);
  DS_CHECK(std::isfinite(min_p) && min_p >= 0.0f && min_p <= 1.0f, "min_p must be in [0, 1], got ",
           min_p);
  DS_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f,
           "repetition_penalty must be > 0, got ", repetition_penalty);
  DS_CHECK(std::isfinite(presence_penalty) && std::fabs(presence_penalty) <= 2.0f,
           "presence_penalty must be in [-2, 2], got ", presence_penalty);
  DS_CHECK(std::isfinite(frequency_penalty) && std::fabs(frequency_penalty) <= 2.0f,
           "frequency_penalty must be in [-2, 2], got ", frequency_penalty);
  for (int32_t id : allowed_token_ids)
    DS_CHECK(id >= 0, "allowed_token_ids: token ids must be >= 0, got ", id);
  for (const auto& [id, bias] : logit_bias) {
    DS_CHECK(id >= 0, "logit_bias: token ids must be >= 0, got ", id);
    DS_CHECK(std::isfinite(bias) && std::fabs(bias) <= 100.0f,
             "logit_bias: biases must be in [-100, 100], got ", bias, " for token ", id);
  }
}

int32_t argmax(std::span<const float> logits) {
  DS_CHECK(!logits.empty(), "argmax of an empty logits row");
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

namespace {

// e^x for x <= 0 in float, branch-free so that the loops below vectorize: x = n ln2 + r with
// |r| <= ln2 / 2 (Cody-Waite), e^r by its degree-6 Taylor polynomial (relative error < 2e-7),
// 2^n put into the exponent bits. Below -87 it gives e^-87 (~1.6e-38): nothing next to the
// row's largest term, which is 1.
inline float exp_nonpositive(float x) {
  {  // x = max(x, -87) as a select on the bits (x <= 0: larger bits, more negative), which GCC
     // vectorizes where it does not a float max; -inf clamps too. (A NaN stays NaN: catching it
     // here stops the loop vectorizing, 3x slower, so log_sum_exp redoes such a row.)
    const uint32_t b = std::bit_cast<uint32_t>(x), lim = std::bit_cast<uint32_t>(-87.0f);
    x = std::bit_cast<float>(b > lim ? lim : b);
  }
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return std::bit_cast<float>(std::bit_cast<int32_t>(p) + (static_cast<int32_t>(n) << 23));
}

// A logit with NaN read as -inf: the order every logprob of a row uses (the device's too).
inline float not_nan(float x) { return std::isnan(x) ? -INFINITY : x; }

// sum_i e^(l_i - m): 8 float lanes over blocks of 1024 logits (128 terms each, so float rounding
// stays ~1e-7 relative), blocks summed in double; the lanes make the loop vectorize. kNanAsInf
// reads a NaN as -inf, which stops the loop vectorizing (3x slower).
template <bool kNanAsInf>
double sum_exp(std::span<const float> l, float m) {
  constexpr size_t kL = 8, kBlock = 1024;
  auto at = [&](size_t i) { return kNanAsInf ? not_nan(l[i]) : l[i]; };
  double z = 0.0;
  const size_t n = l.size() / kL * kL;
  for (size_t b = 0; b < n; b += kBlock) {
    float acc[kL] = {};
    const size_t e = std::min(n, b + kBlock);
    for (size_t i = b; i < e; i += kL) {
      for (size_t j = 0; j < kL; ++j) acc[j] += exp_nonpositive(at(i + j) - m);
    }
    for (size_t j = 0; j < kL; ++j) z += acc[j];
  }
  for (size_t i = n; i < l.size(); ++i) z += exp_nonpositive(at(i) - m);
  return z;
}

// log(sum_i e^(l_i - m)) for the row's maximum m, NaN logits read as -inf. A NaN turns the fast
// sum NaN; only such rows pay for the second pass, which sums in the same order (so a NaN gives
// exactly what -inf in its place gives).
double log_sum_exp(std::span<const float> l, float m) {
  double z = sum_exp<false>(l, m);
  if (std::isnan(z)) z = sum_exp<true>(l, m);
  return std::log(z);
}

// The row's largest logit, NaN dropped (an OpenMP max reduction vectorizes; std::max_element's
// loop kept its running maximum in memory, ~0.7 ms for a 248K row).
float row_max(std::span<const float> l) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (size_t i = 0; i < l.size(); ++i) m = l[i] > m ? l[i] : m;
  return m;
}

// How many logits are >= x (vLLM's rank of a token whose logit is x), NaN read as -inf.
int64_t count_at_least(std::span<const float> l, float x) {
  if (x == -INFINITY) return static_cast<int64_t>(l.size());  // every logit, NaN too
  int32_t n = 0;  // (int32 lanes vectorize; rows are far below 2^31; NaN >= x is false)
#pragma omp simd reduction(+ : n)
  for (size_t i = 0; i < l.size(); ++i) n += l[i] >= x ? 1 : 0;
  return n;
}

}  // namespace

void log_softmax(std::span<const float> logits, std::vector<float>& out) {
  DS_CHECK(!logits.empty(), "log_softmax of an empty logits row");
  const float m = row_max(logits);
  const double log_z = log_sum_exp(logits, m);  // max and log z apart: exact for big logits
  out.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i)
    out[i] = static_cast<float>((not_nan(logits[i]) - m) - log_z);
}

float token_logprob(std::span<const float> logits, int32_t token) {
  DS_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size(), "token ", token,
           " outside the logits row of ", logits.size());
  const float m = row_max(logits);
  return static_cast<float>((not_nan(logits[token]) - m) - log_sum_exp(logits, m));
}

namespace {
// The k ids with the largest logits, best first (ties: lower id first): one pass keeping a k-heap.
std::vector<int32_t> top_ids(std::span<const float> logits, int k) {
  k = std::clamp(k, 0, static_cast<int>(logits.size()));
  // The heap's root is the worst id kept; an id replaces it when it ranks before it.
  auto before = [&](int32_t a, int32_t b) {  // (NaN as -inf keeps the order total)
    const float x = not_nan(logits[a]), y = not_nan(logits[b]);
    return x > y || (x == y && a < b);
  };
  std::vector<int32_t> heap;
  if (k == 0) return heap;
  heap.reserve(static_cast<size_t>(k));
  for (int32_t id = 0; id < k; ++id) {
    heap.push_back(id);
    std::push_heap(heap.begin(), heap.end(), before);
  }
  float worst = not_nan(logits[heap.front()]);  // the kept ids' worst logit
  for (size_t i = static_cast<size_t>(k); i < logits.size(); ++i) {
    // Equal: a higher id, after the kept one; NaN compares false and never enters.
    if (logits[i] > worst) {
      std::pop_heap(heap.begin(), heap.end(), before);
      heap.back() = static_cast<int32_t>(i);
      std::push_heap(heap.begin(), heap.end(), before);
      worst = not_nan(logits[heap.front()]);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), before);  // best first
  return heap;
}

// top_ids with their logprobs, for the row's max m and log-sum-exp log_z.
std::vector<TokenLogprob> top_entries(std::span<const float> logits, int k, float m,
                                      double log_z) {
  std::vector<TokenLogprob> out;
  for (int32_t id : top_ids(logits, k))
    out.push_back({id, static_cast<float>((not_nan(logits[id]) - m) - log_z)});
  return out;
}
}  // namespace

std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, int k) {
  DS_CHECK(!logits.empty(), "top_logprobs of an empty logits row");
  const float m = row_max(logits);
  return top_entries(logits, k, m, log_sum_exp(logits, m));
}

PositionLogprobs position_logprobs(std::span<const float> logits, int32_t token, int k) {
  DS_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size(), "token ", token,
           " outside the logits row of ", logits.size());
  const float m = row_max(logits);
  const double log_z = log_sum_exp(logits, m);
  PositionLogprobs out;
  const float x = not_nan(logits[token]);
  out.logprob = static_cast<float>((x - m) - log_z);
  out.rank = static_cast<int32_t>(count_at_least(logits, x));
  out.top = top_entries(logits, k, m, log_z);
  return out;
}

void apply_penalties(std::span<float> logits, std::span<const int32_t> history,
                     const SamplingParams& p) {
  if (history.empty() ||
      (p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f)) {
    return;
  }
  std::unordered_map<int32_t, int> count;
  for (int32_t t : history) {
    if (t >= 0 && static_cast<size_t>(t) < logits.size()) ++count[t];
  }
  for (const auto& [t, c] : count) {
    float& l = logits[t];
    if (p.repetition_penalty != 1.0f)
      l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
    l -= p.presence_penalty + p.frequency_penalty * static_cast<float>(c);
  }
}

namespace {
std::random_device& entropy() {
  static thread_local std::random_device rd;
  return rd;
}
uint64_t fresh_seed() { return (static_cast<uint64_t>(entropy()()) << 32) ^ entropy()(); }
// Uniform in [0, 1) from the top 53 bits: the same on every standard library.
double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }
}  // namespace

Sampler::Sampler(const SamplingParams& params)
    : params_(params), rng_(params.seed.value_or(fresh_seed())) {
  params_.validate();
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> history,
                        std::span<const int32_t> banned) {
  const int V = static_cast<int>(logits.size());
  DS_CHECK(V > 0, "sampling from an empty logits row");
  if (params_.allowed_token_ids.empty()) {
    work_.assign(logits.begin(), logits.end());
  } else {
    work_.assign(logits.size(), -INFINITY);
    for (int32_t id : params_.allowed_token_ids) {
      if (id < V) work_[id] = logits[id];
    }
  }
  for (const auto& [id, bias] : params_.logit_bias) {
    if (id < V) work_[id] += bias;
  }
  for (float w : work_)
    DS_CHECK(!std::isnan(w) && w != INFINITY, "sampling: the logits contain NaN or +inf");
  for (int32_t id : banned) {
    if (id >= 0 && id < V) work_[id] = -INFINITY;
  }
  apply_penalties(work_, history, params_);
  DS_CHECK(*std::max_element(work_.begin(), work_.end()) > -INFINITY,
           "sampling: every token is excluded");
  if (params_.greedy()) return argmax(work_);

  // Unnormalised probabilities exp((l - max) / T): the best token has weight 1.
  const float m = *std::max_element(work_.begin(), work_.end());
  const float inv_t = 1.0f / params_.temperature;
  for (float& w : work_) w = std::exp((w - m) * inv_t);

  order_.resize(V);
  std::iota(order_.begin(), order_.end(), 0);
  auto more_probable = [&](int32_t a, int32_t b) {
    return work_[a] > work_[b] || (work_[a] == work_[b] && a < b);
  };
  int n = V;
  if (params_.top_k > 0 && params_.top_k < n) {
    std::nth_element(order_.begin(), order_.begin() + params_.top_k, order_.end(), more_probable);
    n = params_.top_k;
  }
  if (params_.min_p > 0.0f) {
    const float thr = params_.min_p;  // p_max has weight 1
    n = static_cast<int>(std::partition(order_.begin(), order_.begin() + n,
                                        [&](int32_t t) { return work_[t] >= thr; }) -
                         order_.begin());
  }
  if (params_.top_p < 1.0f) {
    double z = 0.0;
    for (int i = 0; i < n; ++i) z += work_[order_[i]];
    const double target = params_.top_p * z;
    // Sort only the head when it already reaches top_p (the usual case), else everything.
    int head = std::min(n, 1024);
    std::partial_sort(order_.begin(), order_.begin() + head, order_.begin() + n, more_probable);
    double acc = 0.0;
    int cut = -1;
    for (int i = 0; i < head; ++i) {
      acc += work_[order_[i]];
      if (acc >= target) {
        cut = i + 1;
        break;
      }
    }
    if (cut < 0 && head < n) {
      std::sort(order_.begin() + head, order_.begin() + n, more_probable);
      for (int i = head; i < n; ++i) {
        acc += work_[order_[i]];
        if (acc >= target) {
          cut = i + 1;
          break;
        }
      }
    }
    n = cut < 0 ? n : cut;
  }
  // Walk the survivors in id order (canonical, independent of how they were selected).
  if (n < V) std::sort(order_.begin(), order_.begin() + n);
  double total = 0.0;
  for (int i = 0; i < n; ++i) total += work_[order_[i]];
  const double u = uniform01(rng_) * total;
  double acc = 0.0;
  for (int i = 0; i < n; ++i) {
    acc += work_[order_[i]];
    if (u < acc) return order_[i];
  }
  // u rounding at the very top: the last survivor with any weight (never a banned token).
  for (int i = n - 1; i > 0; --i) {
    if (work_[order_[i]] > 0.0f) return order_[i];
  }
  return order_[0];
}

}  // namespace ds
