// Token sampling (see sampling.h).
#include "runtime/sampling.h"

#include <algorithm>
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

void log_softmax(std::span<const float> logits, std::vector<float>& out) {
  DS_CHECK(!logits.empty(), "log_softmax of an empty logits row");
  const float m = *std::max_element(logits.begin(), logits.end());
  double z = 0.0;
  for (float l : logits) z += std::exp(static_cast<double>(l - m));
  const double log_z = std::log(z);  // subtract max and log z separately: exact for big logits
  out.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<float>((logits[i] - m) - log_z);
}

float token_logprob(std::span<const float> logits, int32_t token) {
  DS_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size(), "token ", token,
           " outside the logits row of ", logits.size());
  const float m = *std::max_element(logits.begin(), logits.end());
  double z = 0.0;
  for (float l : logits) z += std::exp(static_cast<double>(l - m));
  return static_cast<float>((logits[token] - m) - std::log(z));
}

std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, int k) {
  std::vector<float> lp;
  log_softmax(logits, lp);
  k = std::clamp(k, 0, static_cast<int>(logits.size()));
  std::vector<int32_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    return lp[a] > lp[b] || (lp[a] == lp[b] && a < b);
  });
  std::vector<TokenLogprob> out(k);
  for (int i = 0; i < k; ++i) out[i] = {idx[i], lp[idx[i]]};
  return out;
}

PositionLogprobs position_logprobs(std::span<const float> logits, int32_t token, int k) {
  DS_CHECK(token >= 0 && static_cast<size_t>(token) < logits.size(), "token ", token,
           " outside the logits row of ", logits.size());
  const float m = *std::max_element(logits.begin(), logits.end());
  k = std::clamp(k, 0, static_cast<int>(logits.size()));
  // Min-heap of the k best (logit, id) so far: the root is the worst kept one, replaced when an
  // id ranks before it (higher logit, or the same logit and a lower id).
  auto before = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::vector<int32_t> heap;
  heap.reserve(static_cast<size_t>(k));
  const float mine = logits[token];
  double z = 0.0;
  int64_t at_least = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    z += std::exp(static_cast<double>(l - m));
    at_least += l >= mine;
    if (k == 0) continue;
    const int32_t id = static_cast<int32_t>(i);
    if (static_cast<int>(heap.size()) < k) {
      heap.push_back(id);
      std::push_heap(heap.begin(), heap.end(), before);
    } else if (before(id, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), before);
      heap.back() = id;
      std::push_heap(heap.begin(), heap.end(), before);
    }
  }
  const double log_z = std::log(z);
  PositionLogprobs out;
  out.logprob = static_cast<float>((mine - m) - log_z);
  out.rank = static_cast<int32_t>(at_least);
  std::sort_heap(heap.begin(), heap.end(), before);  // best first
  out.top.reserve(heap.size());
  for (int32_t id : heap) out.top.push_back({id, static_cast<float>((logits[id] - m) - log_z)});
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
