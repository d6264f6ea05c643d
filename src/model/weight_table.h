// The one table mapping checkpoint tensor names to HostWeights / LayerWeights fields, fusion
// groups, expected shapes, parameter kinds and synthetic-initialisation rules. The loader, the
// synthetic generator, the checkpoint writer and `inspect` all read it, so they cannot disagree.
// Also: the counter-based random generator behind make_synthetic_weights, exposed so that a GPU
// engine can produce bit-identical synthetic weights on the device.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace ds {

enum class ParamKind : uint8_t { kEmbedding, kLmHead, kAttention, kGdn, kMlp, kNorm };
const char* param_kind_name(ParamKind k);
constexpr int kNumParamKinds = 6;

enum class LayerScope : uint8_t { kGlobal, kAnyLayer, kFullLayer, kLinearLayer };

enum class SyntheticKind : uint8_t {
  kNormal,      // mean + std * N(0, 1)
  kLogUniform,  // log(uniform(lo, hi))  (A_log)
};

struct WeightSpec {
  const char*
      name;  // checkpoint name without the model prefix; after "layers.N." for layer tensors
  LayerScope scope;
  ParamKind kind;
  TensorView HostWeights::*global_field;  // kGlobal tensors
  TensorView LayerWeights::*layer_field;  // layer tensors
  int part;     // position inside a fused field (rows concatenated in part order); 0 if not fused
  int n_parts;  // parts of that field (1 when not fused)
  std::vector<int64_t> (*shape)(const ModelConfig&);
  // Synthetic init: kNormal with std == 0 means std = 1/sqrt(fan_in) (fan_in = last dimension).
  SyntheticKind init_kind;
  float init_mean, init_std;
  float init_lo, init_hi;  // kLogUniform range
};

const std::vector<WeightSpec>& weight_table();

// One text tensor of a checkpoint for a given config, in canonical order.
struct CheckpointTensor {
  std::string name;  // without prefix: "embed_tokens.weight", "layers.3.mlp.up_proj.weight"
  const WeightSpec* spec;
  int layer;  // -1 for global tensors
  std::vector<int64_t> shape;
  int64_t row_offset;  // first row of this part inside the fused field
  int64_t numel() const;
};
// Every text tensor the config needs (lm_head omitted when tie_word_embeddings).
std::vector<CheckpointTensor> checkpoint_tensors(const ModelConfig& c);

// Synthetic values: element i of a tensor is a pure function of (spec, i), so any thread count
// (or a GPU) produces the same bytes.
struct SyntheticSpec {
  uint64_t seed = 0;  // per-tensor seed, derived from the model seed and the tensor name
  SyntheticKind kind = SyntheticKind::kNormal;
  float mean = 0, std = 0;  // kNormal
  float lo = 0, hi = 0;     // kLogUniform
};
// `name` is a checkpoint name without prefix (as in CheckpointTensor::name).
SyntheticSpec synthetic_tensor_spec(const ModelConfig& c, const std::string& name,
                                    uint64_t model_seed);

// splitmix64's output function.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element i of the splitmix64 stream seeded with `seed`.
inline uint64_t synthetic_bits(uint64_t seed, uint64_t i) {
  return mix64(seed + (i + 1) * 0x9E3779B97F4A7C15ull);
}

// Approximately N(0,1): sum of the four 16-bit lanes of one 64-bit draw (Irwin-Hall, bounded to
// +-3.46), cheap enough for 27e9 values. On a GPU use __int2float_rn and __fmul_rn/__fadd_rn
// (no FMA contraction) to reproduce these exact floats.
inline float synthetic_normal(uint64_t seed, uint64_t i) {
  uint64_t r = synthetic_bits(seed, i);
  int32_t s =
      static_cast<int32_t>((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48));
  constexpr float kInvStd = 1.0f / 37837.2266f;  // 1 / (65536 * sqrt(1/3))
  return static_cast<float>(s - 131070) * kInvStd;
}

// The float value of element i (before rounding to the storage dtype). Callers compile with
// -ffp-contract=off (src/model/CMakeLists.txt) so that mean + std * z is never fused into an FMA.
inline float synthetic_value(const SyntheticSpec& s, uint64_t i) {
  if (s.kind == SyntheticKind::kNormal) return s.mean + s.std * synthetic_normal(s.seed, i);
  float u = static_cast<float>(synthetic_bits(s.seed, i) >> 40) * (1.0f / 16777216.0f);  // [0, 1)
  return logf(s.lo + (s.hi - s.lo) * u);
}

// Elements [i0, i0 + n) of a tensor into out[n].
inline void synthetic_fill(const SyntheticSpec& s, uint64_t i0, int64_t n, float* out) {
  if (s.kind == SyntheticKind::kNormal) {
    for (int64_t k = 0; k < n; ++k) out[k] = s.mean + s.std * synthetic_normal(s.seed, i0 + k);
  } else {
    for (int64_t k = 0; k < n; ++k) out[k] = synthetic_value(s, i0 + k);
  }
}

}  // namespace ds
