// Token sampling from one logits row: greedy (temperature 0), or temperature + top-k + top-p +
// min-p with a per-request seeded RNG (the same seed and logits give the same tokens on every
// machine: std::mt19937_64 plus our own [0, 1) conversion, no implementation-defined
// distributions). Penalties (repetition / presence / frequency, as vLLM / OpenAI define them) act
// on the logits after the allowed ids, the logit bias and the banned tokens (vLLM's order) and
// before everything else. Also log-softmax helpers for logprobs / top_logprobs.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/backend.h"

namespace ds {

struct SamplingParams {
  float temperature = 1.0f;  // 0: greedy (argmax, lowest id on ties)
  float top_p = 1.0f;        // (0, 1]: smallest set of tokens whose probability reaches top_p
  int top_k = 0;             // 0 or < 0: off
  float min_p = 0.0f;        // [0, 1]: drop tokens with p < min_p * p_max
  float repetition_penalty = 1.0f;  // > 0; 1: off (logit / rp if > 0 else * rp, for seen tokens)
  float presence_penalty = 0.0f;    // [-2, 2]: minus this once for every token already generated
  float frequency_penalty = 0.0f;   // [-2, 2]: minus this times the token's count
  std::optional<uint64_t> seed;     // unset: a fresh random seed per request
  // OpenAI's logit_bias: (token id >= 0, bias in [-100, 100]) added to the logits first; ids
  // past the logits row are ignored here (the engine refuses them at submission).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // vLLM's allowed_token_ids: when not empty, only these ids can be picked (applied first).
  std::vector<int32_t> allowed_token_ids;

  // Throws ds::Error naming the field when a value is out of range.
  void validate() const;
  bool greedy() const { return temperature <= 0.0f; }
};

// One request's sampler: owns its RNG, so concurrent requests never share random state.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  const SamplingParams& params() const { return params_; }

  // Picks the next token from logits [vocab]. `history`: the tokens generated so far (penalties).
  // `banned`: ids that must not be picked (vLLM's min_tokens: the stop ids until that many tokens
  // are out); an error when nothing else is left.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> history = {},
                 std::span<const int32_t> banned = {});

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<float> work_;     // [vocab] scratch
  std::vector<int32_t> order_;  // [vocab] scratch
};

// argmax, lowest index on ties.
int32_t argmax(std::span<const float> logits);

// out[i] = logits[i] - logsumexp(logits). The sum of e^(l - max) takes a float exp (relative
// error < 2e-7) in 8 float lanes over blocks of 1024 logits, blocks summed in double, so that it
// vectorizes (with the row's max: a 248K row in ~0.5 ms on the dev machine, was ~2.3 ms).
void log_softmax(std::span<const float> logits, std::vector<float>& out);
float token_logprob(std::span<const float> logits, int32_t token);

// (TokenLogprob: runtime/backend.h.) The k most probable tokens, most probable first (ties: lower
// id first).
std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, int k);

// One position of a prompt (vLLM's prompt_logprobs, OpenAI's echo with logprobs): the logprob of
// the token that follows, its rank (vLLM's: how many ids have a logit >= its own, so 1 is the
// most probable) and the k most probable ids as top_logprobs gives them, with the same log z:
// passes for the max, the sum, the rank and (k > 0) the top ids (a k-entry heap).
using PositionLogprobs = RowScore;  // runtime/backend.h
PositionLogprobs position_logprobs(std::span<const float> logits, int32_t token, int k);

// Applies repetition / presence / frequency penalties for `history` to logits in place.
void apply_penalties(std::span<float> logits, std::span<const int32_t> history,
                     const SamplingParams& params);

}  // namespace ds
