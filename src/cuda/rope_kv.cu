// Attention input preparation, one block per token: zero-centred RMSNorm of each query and key
// head (q_norm / k_norm over head_dim, fp32, rounded to bf16 as HF does), then RoPE on the first
// rotary_dim dims (rotate-half / NeoX pairs i and i + rotary_dim/2, angle pos *
// theta^(-2i/rotary_dim) in fp32, accurate sincosf), q to q_out [n_tokens, n_heads, head_dim], k
// and v (v untouched) into the paged cache [n_blocks, n_kv_heads, page_size, head_dim] at
// slot_mapping[t]. Reads the fused projection row [q(+gate) | k | v] directly. One warp per head,
// the head staged in shared memory. Shapes: head_dim <= 256, any head counts. Tested in
// tests/cuda/cuda_kernels_test.cpp against a CPU loop (normalised L2 < 8e-3, v bit-exact).
#include "cuda/cuda_common.h"
#include "cuda/kernels.h"

namespace ds::cuda {
namespace {

constexpr int kWarps = 8;

__global__ void __launch_bounds__(kWarps * 32)
    qk_norm_rope_kv_kernel(AttnShape s, const bf16* __restrict__ qkv,  // [n_tokens, qkv_dim]
                           const bf16* __restrict__ q_norm_w,          // [head_dim]
                           const bf16* __restrict__ k_norm_w,          // [head_dim]
                           const int32_t* __restrict__ positions,      // [n_tokens]
                           const int32_t* __restrict__ slot_mapping,   // [n_tokens]
                           bf16* __restrict__ q_out,                   // [n_tokens, n_heads, hd]
                           bf16* __restrict__ k_cache, bf16* __restrict__ v_cache) {
  extern __shared__ float smem[];  // [kWarps, head_dim]
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hd = s.head_dim, half = s.rotary_dim / 2;
  float* buf = smem + warp * hd;
  const bf16* row = qkv + (int64_t)t * s.qkv_dim();
  const int slot = slot_mapping[t];
  const float pos = static_cast<float>(positions[t]);
  const int n_work = s.n_heads + 2 * s.n_kv_heads;
  for (int h = warp; h < n_work; h += kWarps) {
    const bool is_q = h < s.n_heads, is_k = !is_q && h < s.n_heads + s.n_kv_heads;
    const bf16* src;
    bf16* dst;
    if (is_q) {
      src = row + h * hd * (s.gated ? 2 : 1);
      dst = q_out + ((int64_t)t * s.n_heads + h) * hd;
    } else {
      const int kh = is_k ? h - s.n_heads : h - s.n_heads - s.n_kv_heads;
      src = row + s.q_proj_dim() + (is_k ? 0 : s.kv_dim()) + kh * hd;
      if (slot < 0) continue;
      const int64_t blk = slot / s.page_size, r = slot % s.page_size;
      dst = (is_k ? k_cache : v_cache) + ((blk * s.n_kv_heads + kh) * s.page_size + r) * hd;
    }
    if (!is_q && !is_k) {  // v: plain copy
      for (int i = lane; i < hd; i += 32) dst[i] = src[i];
      continue;
    }
    const bf16* w = is_q ? q_norm_w : k_norm_w;
    float ss = 0.f;
    for (int i = lane; i < hd; i += 32) {
      const float x = __bfloat162float(src[i]);
      buf[i] = x;
      ss += x * x;
    }
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / hd + s.eps);
    for (int i = lane; i < hd; i += 32)  // normalised value rounded to bf16 (HF's q_norm output)
      buf[i] = __bfloat162float(__float2bfloat16_rn(buf[i] * inv * (1.f + __bfloat162float(w[i]))));
    __syncwarp();
    for (int i = lane; i < hd; i += 32) {
      float y = buf[i];
      if (i < s.rotary_dim) {
        const int j = i < half ? i : i - half;
        const float inv_freq = 1.f / powf(s.rope_theta, (2.f * j) / s.rotary_dim);
        float sn, cs;
        sincosf(pos * inv_freq, &sn, &cs);
        y = i < half ? buf[i] * cs - buf[i + half] * sn : buf[i] * cs + buf[i - half] * sn;
      }
      dst[i] = __float2bfloat16_rn(y);
    }
    __syncwarp();  // buf is reused by this warp's next head
  }
}

}  // namespace

void check_attn_shape(const AttnShape& s) {
  DS_CHECK(s.n_heads > 0 && s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0,
           "attention: num_attention_heads (", s.n_heads,
           ") must be a positive multiple of "
           "num_key_value_heads (",
           s.n_kv_heads, ")");
  DS_CHECK(s.head_dim >= 16 && s.head_dim <= 256 && s.head_dim % 16 == 0, "attention: head_dim ",
           s.head_dim, " not supported (multiple of 16, at most 256)");
  DS_CHECK(s.rotary_dim >= 0 && s.rotary_dim <= s.head_dim && s.rotary_dim % 2 == 0,
           "attention: rotary dims ", s.rotary_dim, " must be even and at most head_dim");
  DS_CHECK(s.page_size > 0, "attention: page_size must be positive");
}

void launch_qk_norm_rope_kv(const AttnShape& s, const bf16* qkv, const bf16* q_norm_w,
                            const bf16* k_norm_w, const int32_t* positions,
                            const int32_t* slot_mapping, int n_tokens, bf16* q_out, bf16* k_cache,
                            bf16* v_cache, cudaStream_t stream) {
  if (n_tokens <= 0) return;
  check_attn_shape(s);
  const size_t smem = sizeof(float) * kWarps * s.head_dim;
  qk_norm_rope_kv_kernel<<<n_tokens, kWarps * 32, smem, stream>>>(
      s, qkv, q_norm_w, k_norm_w, positions, slot_mapping, q_out, k_cache, v_cache);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
