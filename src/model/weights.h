// Host-side weights of the Qwen3.5 text model, as loaded from a checkpoint (or made up for
// synthetic runs). Tensors are views into the mmapped safetensors files, except the matrices
// fused at load (kept in `owned` storage). Backends convert from here: the CPU reference widens
// to fp32, the CUDA engine uploads bf16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"

namespace ds {

enum class DType : uint8_t { kBF16, kF16, kF32, kF8E4M3 };
const char* dtype_name(DType t);
size_t dtype_size(DType t);

struct TensorView {
  std::string name;  // checkpoint name (or "fused:<parts>") for error messages
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // row-major, contiguous
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool empty() const { return data == nullptr; }
  float at(int64_t i) const;      // element i widened to float (bf16/f16/f32)
  void to_f32(float* out) const;  // all elements widened to float
};

struct LayerWeights {
  LayerType type = LayerType::kLinear;
  TensorView input_norm;   // [d_model] zero-centred RMSNorm weight
  TensorView post_norm;    // [d_model] zero-centred RMSNorm weight
  TensorView mlp_gate_up;  // [2*d_ff, d_model] fused at load: rows [gate | up]
  TensorView mlp_down;     // [d_model, d_ff]

  // Full attention layers.
  TensorView attn_qkv;  // [q_proj_dim + 2*kv_dim, d_model] fused: rows [q(+gate) | k | v]
  TensorView attn_o;    // [d_model, n_heads*head_dim]
  TensorView q_norm;    // [head_dim] zero-centred
  TensorView k_norm;    // [head_dim] zero-centred

  // Gated DeltaNet layers.
  TensorView gdn_in;       // [gdn_in_dim, d_model] fused: rows [qkv | z | b | a]
  TensorView gdn_conv;     // [gdn_qkv_dim, 1, conv_kernel] depthwise conv weight
  TensorView gdn_dt_bias;  // [n_v_heads]
  TensorView gdn_A_log;    // [n_v_heads]
  TensorView gdn_norm;     // [d_v] plain (not zero-centred) RMSNorm weight
  TensorView gdn_out;      // [d_model, n_v_heads*d_v]
};

struct CheckpointStats {
  int n_files = 0;
  int64_t n_text_tensors = 0;
  int64_t n_visual_tensors = 0, visual_params = 0;  // model.visual.* (ignored for now)
  int64_t n_mtp_tensors = 0, mtp_params = 0;        // mtp.* (ignored for now)
  int64_t n_other_tensors = 0;                      // anything else (listed, ignored)
  std::vector<std::string> other_tensor_names;      // their names
  int64_t text_bytes = 0;
  double load_seconds = 0;
};

struct HostWeights {
  ModelConfig config;
  TensorView embed;       // [vocab, d_model]
  TensorView final_norm;  // [d_model] zero-centred
  TensorView lm_head;     // [vocab, d_model] (== embed when tied)
  std::vector<LayerWeights> layers;
  CheckpointStats stats;
  std::string source;  // model dir, or "synthetic:<seed>"

  // Keeps the mmaps and the fused/converted buffers alive.
  std::shared_ptr<void> storage;
};

// Loads config.json + safetensors (single file or sharded with model.safetensors.index.json)
// from `model_dir`. Every failure throws ds::Error naming the file and tensor.
HostWeights load_host_weights(const std::string& model_dir);

// Deterministic random weights for any config (no files): normal(0, std) for matrices, small
// values for norms, A_log / dt_bias in realistic ranges. Same seed, same weights, everywhere.
HostWeights make_synthetic_weights(const ModelConfig& config, uint64_t seed,
                                   DType dtype = DType::kBF16);

// Writes `w` as a checkpoint folder (config.json + safetensors, `n_shards` files with an index
// when > 1) in the HF layout, text-only (`model.`) or wrapper (`model.language_model.`).
void write_checkpoint(const HostWeights& w, const std::string& dir, int n_shards, bool wrapper);

// The tiny config used by the README's run command and the CPU tests.
ModelConfig tiny_model_config(int vocab_size = 1024);

}  // namespace ds
