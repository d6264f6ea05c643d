// The kernels' shape structs (AttnShape, GdnShape) filled from a model config: one place for the
// mapping, used by the engine and the benchmarks. Kernels themselves never see ModelConfig.
#pragma once

#include "cuda/kernels.h"
#include "model/config.h"

namespace ds::cuda {

inline AttnShape attn_shape_of(const ModelConfig& c, int page_size) {
  AttnShape s;
  s.n_heads = c.n_heads;
  s.n_kv_heads = c.n_kv_heads;
  s.head_dim = c.head_dim;
  s.rotary_dim = c.rotary_dim;
  s.gated = c.attn_output_gate;
  s.rope_theta = static_cast<float>(c.rope_theta);
  s.eps = c.rms_norm_eps;
  s.page_size = page_size;
  return s;
}

inline GdnShape gdn_shape_of(const ModelConfig& c) {
  GdnShape s;
  s.n_k_heads = c.n_k_heads;
  s.n_v_heads = c.n_v_heads;
  s.d_k = c.d_k;
  s.d_v = c.d_v;
  s.conv_kernel = c.conv_kernel;
  s.norm_eps = c.rms_norm_eps;
  return s;
}

}  // namespace ds::cuda
