// The CPU reference forward: fp32 arithmetic on weights widened from the checkpoint, exactly the
// maths of ../shared/SPEC.md, one readable forward that branches per layer type. It is the spec
// the CUDA engine is tested against and the engine CI runs.
//
// Unlike HF (and the CUDA engine), the residual stream stays fp32 here: the golden fixtures are
// HF run in fp32, and this path matches them to ~1e-6 relative.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "model/weights.h"

namespace ds {

// Per-sequence state: KV cache of the full-attention layers, conv + recurrent state of the GDN
// layers, and the number of tokens seen.
struct CpuSeqState {
  int n_past = 0;
  std::vector<std::vector<float>> k_cache,
      v_cache;                                 // per full layer: [n_past, n_kv_heads, head_dim]
  std::vector<std::vector<float>> conv_state;  // per linear layer: [conv_kernel-1, gdn_qkv_dim]
  std::vector<std::vector<float>> rec_state;   // per linear layer: [n_v_heads, d_k, d_v]
};

// How the GDN recurrence is evaluated inside a prompt chunk of more than one token.
enum class GdnMode : uint8_t {
  kChunked,    // WY / UT-transform form over sub-chunks of 64 tokens (HF
               // torch_chunk_gated_delta_rule)
  kRecurrent,  // token by token (what decode always uses)
};

// Threads: forward() is const and may run concurrently on distinct states (each call uses
// OpenMP inside; OMP_NUM_THREADS sets the width). The setters below are not synchronised.
// Memory: every weight is held in fp32 (4 bytes per parameter; the constructor refuses with a
// ds::Error when that exceeds 90% of physical memory).
class CpuModel {
 public:
  explicit CpuModel(const HostWeights& weights);
  ~CpuModel();
  CpuModel(CpuModel&&) noexcept;
  CpuModel& operator=(CpuModel&&) noexcept;

  const ModelConfig& config() const { return cfg_; }
  CpuSeqState new_state() const;

  // Runs `tokens` after what `state` has seen, in chunks of at most `chunk_size` tokens (<= 0: one
  // chunk; GDN uses the chunked WY form inside a chunk, the state is carried across), and appends
  // logits: every token's row when `all_logits`, else only the last token's. logits: [rows, vocab].
  // Token ids outside [0, vocab) throw ds::Error (the state is left untouched then).
  void forward(CpuSeqState& state, std::span<const int32_t> tokens, int chunk_size, bool all_logits,
               std::vector<float>& logits) const;

  // For tests: evaluate multi-token GDN chunks token by token instead (same maths, other order).
  void set_gdn_mode(GdnMode mode) { gdn_mode_ = mode; }

  // Debug / test hook (named intermediate dumps): called after decoder layer `il` of every chunk
  // with the residual stream x: [n_tokens, d_model] of the chunk's tokens.
  using LayerProbe = std::function<void(int il, int n_tokens, const float* x)>;
  void set_layer_probe(LayerProbe probe) { probe_ = std::move(probe); }

 private:
  struct Layer;
  // One chunk of n tokens; x: [n, d_model] in/out (the residual stream).
  void forward_chunk(CpuSeqState& state, std::span<const int32_t> tokens,
                     std::vector<float>& x) const;
  void attention_layer(const Layer& L, CpuSeqState& state, int n, const float* xn,
                       float* out) const;
  void gdn_layer(const Layer& L, CpuSeqState& state, int n, const float* xn, float* out) const;

  ModelConfig cfg_;
  GdnMode gdn_mode_ = GdnMode::kChunked;
  LayerProbe probe_;
  std::vector<float> embed_, final_norm_,
      lm_head_;                       // [vocab, d_model], [d_model], [vocab, d_model]
  std::vector<float> rope_inv_freq_;  // [rotary_dim / 2]
  std::vector<Layer> layers_;
};

}  // namespace ds
