// The CPU reference forward: fp32 arithmetic on weights widened from the checkpoint, exactly the
// maths of ../shared/SPEC.md, one readable forward that branches per layer type. It is the spec
// the CUDA engine is tested against and the engine CI runs.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/weights.h"

namespace ds {

// Per-sequence state: KV cache of the full-attention layers, conv + recurrent state of the GDN
// layers, and the number of tokens seen.
struct CpuSeqState {
  int n_past = 0;
  std::vector<std::vector<float>> k_cache, v_cache;  // per full layer: [n_past, n_kv_heads, head_dim]
  std::vector<std::vector<float>> conv_state;        // per linear layer: [conv_kernel-1, gdn_qkv_dim]
  std::vector<std::vector<float>> rec_state;         // per linear layer: [n_v_heads, d_k, d_v]
};

class CpuModel {
 public:
  explicit CpuModel(const HostWeights& weights);
  const ModelConfig& config() const { return cfg_; }
  CpuSeqState new_state() const;

  // Runs `tokens` after what `state` has seen, in chunks of at most `chunk_size` tokens (GDN uses
  // the chunked WY form inside a chunk, the state is carried across), and appends logits:
  // every token's row when `all_logits`, else only the last token's. logits: [rows, vocab].
  void forward(CpuSeqState& state, std::span<const int32_t> tokens, int chunk_size,
               bool all_logits, std::vector<float>& logits) const;

 private:
  struct Layer;
  ModelConfig cfg_;
  std::vector<float> embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace ds
