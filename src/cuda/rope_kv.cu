// Attention input preparation: zero-centred RMSNorm of each query and key head (q_norm / k_norm
// over head_dim, fp32, rounded to bf16 as HF does), then RoPE on the first rotary_dim dims
// (rotate-half / NeoX pairs i and i + rotary_dim/2, angle pos * theta^(-2i/rotary_dim) in fp32,
// accurate sincosf), q to q_out [n_tokens, n_heads, head_dim], k and v (v untouched) into the paged
// cache [n_blocks, n_kv_heads, page_size, head_dim] at slot_mapping[t]. Reads the fused projection
// row [q(+gate) | k | v] directly. Two kernels (kernels.h RopeKvKernel):
//  - warp_per_head (head_dim 64 / 128 / 256, rotary_dim / 2 a multiple of head_dim / 32, aligned
//    rows): one warp per (token, head) over the whole grid, a lane holds head_dim / 32 consecutive
//    dims (16-byte loads and stores at 256), the RoPE partner comes from the lane rotary_dim /
//    2 / (head_dim / 32) away by a shuffle: one memory round trip, and 32 warps for one decode
//    token instead of one block (the first version took 12 us for one token on the H200);
//  - token_table (the warp kernel's shapes, prompt chunks): one block of 8 warps per token, the
//    token's RoPE angles computed once into shared memory, then the warp kernel's per-head
//    arithmetic: bit-identical to warp_per_head;
//  - block_per_token (any head_dim <= 256): one block of 8 warps per token, a warp per head in
//    turn, the head staged in shared memory. The fallback.
// Same formulas, so the outputs agree up to the order of the fp32 sum of squares.
// Tested in tests/cuda/cuda_kernels_test.cpp against a CPU loop (normalised L2 < 8e-3, v
// bit-exact), both kernels.
#include "cuda/attention_decode.h"
#include "cuda/cuda_common.h"
#include "cuda/kernels.h"
#include "cuda/rope_kv.cuh"

namespace ds::cuda {
namespace {

constexpr int kWarps = 8;      // block_per_token
constexpr int kHeadWarps = 4;  // warp_per_head: warps per block

// Start of kv head kh's slice (k, or v when !is_k) in a token's qkv row.
__device__ __forceinline__ const bf16* kv_head_src(const AttnShape& s, const bf16* row, bool is_k,
                                                   int kh, int hd) {
  return row + s.q_proj_dim() + (is_k ? 0 : s.kv_dim()) + kh * hd;
}

__global__ void __launch_bounds__(kWarps * 32)
    qk_norm_rope_kv_kernel(AttnShape s, const bf16* qkv,  // [n_tokens, qkv_dim]
                           const bf16* __restrict__ q_norm_w,          // [head_dim]
                           const bf16* __restrict__ k_norm_w,          // [head_dim]
                           const int32_t* __restrict__ positions,      // [n_tokens]
                           const int32_t* __restrict__ slot_mapping,   // [n_tokens]
                           bf16* __restrict__ q_out,                   // [n_tokens, n_heads, hd]
                           bf16* __restrict__ k_cache, bf16* __restrict__ v_cache) {
  extern __shared__ float smem[];  // [kWarps, head_dim]
  // PDL: the decode attention (a programmatic dependent) reads q and the rows written here only
  // after its griddepcontrol.wait (this whole grid done); no effect on a plain launch after us.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // Launched as a programmatic dependent itself (attention_decode.h launch_qk_norm_rope_kv with
  // pdl): nothing is read before the previous kernel (the qkv projection) is done; qkv is a
  // plain pointer (no ld.global.nc, which ptxas may hoist above the wait). A no-op otherwise.
  asm volatile("griddepcontrol.wait;" ::: "memory");
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
      src = kv_head_src(s, row, is_k, kh, hd);
      if (slot < 0) continue;
      dst = cache_row(s, is_k ? k_cache : v_cache, slot, kh, hd);
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

// One (token t, head h) item of the warp-arithmetic kernels: h < n_heads a q head (normed and
// rotated into q_out), then the k heads (normed and rotated into the cache) and the v heads
// (copied into the cache); a k / v item of a token with slot_mapping[t] < 0 does nothing. A warp
// per item, a lane holding HD / 32 dims. kTable: the angles from `table` (the token's), else
// computed per element from pos (norm_rope_lane_x).
template <int HD, bool kTable>
__device__ __forceinline__ void rope_kv_item(const AttnShape& s, const bf16* qkv, int t, int h,
                                             const int32_t* slot_mapping, const bf16* q_norm_w,
                                             const bf16* k_norm_w, float pos, int lane,
                                             bf16* q_out, bf16* k_cache, bf16* v_cache,
                                             const float2* table) {
  constexpr int E = HD / 32;
  const bool is_q = h < s.n_heads, is_k = !is_q && h < s.n_heads + s.n_kv_heads;
  const bf16* row = qkv + (int64_t)t * s.qkv_dim();
  const bf16* src;
  bf16* dst;
  if (is_q) {
    src = row + h * HD * (s.gated ? 2 : 1);
    dst = q_out + ((int64_t)t * s.n_heads + h) * HD;
  } else {
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int kh = is_k ? h - s.n_heads : h - s.n_heads - s.n_kv_heads;
    src = kv_head_src(s, row, is_k, kh, HD);
    dst = cache_row(s, is_k ? k_cache : v_cache, slot, kh, HD);
  }
  if (!is_q && !is_k) {  // v: plain copy
    copy_bf<E>(dst + lane * E, src + lane * E);
    return;
  }
  float x[E], y[E];
  load_bf<E>(src + lane * E, x);
  norm_rope_lane_x<HD, kTable>(s, x, is_q ? q_norm_w : k_norm_w, pos, lane, y, table);
  store_bf<E>(dst + lane * E, y);
}

template <int HD>
__global__ void __launch_bounds__(kHeadWarps * 32)
    qk_norm_rope_kv_warp_kernel(AttnShape s, const bf16* qkv,  // [n_tokens, qkv_dim]
                                const bf16* __restrict__ q_norm_w,          // [HD]
                                const bf16* __restrict__ k_norm_w,          // [HD]
                                const int32_t* __restrict__ positions,      // [n_tokens]
                                const int32_t* __restrict__ slot_mapping,   // [n_tokens]
                                int n_tokens,
                                bf16* __restrict__ q_out,  // [n_tokens, n_heads, HD]
                                bf16* __restrict__ k_cache, bf16* __restrict__ v_cache) {
  // PDL: as in qk_norm_rope_kv_kernel (dependents may start; nothing read before the wait).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int lane = threadIdx.x & 31;
  const int n_work = s.n_heads + 2 * s.n_kv_heads;
  const int64_t item = (int64_t)blockIdx.x * kHeadWarps + (threadIdx.x >> 5);
  if (item >= (int64_t)n_tokens * n_work) return;  // whole warps only
  const int t = static_cast<int>(item / n_work), h = static_cast<int>(item % n_work);
  rope_kv_item<HD, false>(s, qkv, t, h, slot_mapping, q_norm_w, k_norm_w,
                          static_cast<float>(positions[t]), lane, q_out, k_cache, v_cache, nullptr);
}

// token_table (prompt chunks): one block of kWarps warps per token. The token's RoPE angles are
// computed once into shared memory (rope_angle, as the warp kernel computes them per element:
// the same values), then each warp normalises and rotates heads h = warp, warp + kWarps, ... with
// the warp kernel's arithmetic (norm_rope_lane_x), so its outputs are the warp kernel's bit for
// bit. The warp kernel spends its time in powf + sincosf on 8 of 32 lanes for every (token, head)
// (190 us for a 4096-token chunk of the 27B, H200); here they run once per token.
template <int HD>
__global__ void __launch_bounds__(kWarps * 32)
    qk_norm_rope_kv_table_kernel(AttnShape s, const bf16* qkv,  // [n_tokens, qkv_dim]
                                 const bf16* __restrict__ q_norm_w,         // [HD]
                                 const bf16* __restrict__ k_norm_w,         // [HD]
                                 const int32_t* __restrict__ positions,     // [n_tokens]
                                 const int32_t* __restrict__ slot_mapping,  // [n_tokens]
                                 bf16* __restrict__ q_out,  // [n_tokens, n_heads, HD]
                                 bf16* __restrict__ k_cache, bf16* __restrict__ v_cache) {
  __shared__ float2 table[HD / 2];  // (sin, cos) of rotary pair j; rotary_dim <= HD
  // PDL: as in qk_norm_rope_kv_kernel (dependents may start; nothing read before the wait).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float pos = static_cast<float>(positions[t]);
  for (int j = threadIdx.x; j < s.rotary_dim / 2; j += kWarps * 32) {
    float sn, cs;
    rope_angle(s, pos, j, &sn, &cs);
    table[j] = make_float2(sn, cs);
  }
  __syncthreads();
  const int n_work = s.n_heads + 2 * s.n_kv_heads;
  for (int h = warp; h < n_work; h += kWarps)
    rope_kv_item<HD, true>(s, qkv, t, h, slot_mapping, q_norm_w, k_norm_w, pos, lane, q_out,
                           k_cache, v_cache, table);
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

bool qk_norm_rope_kv_warp_supported(const AttnShape& s) {
  const int hd = s.head_dim;
  if (hd != 64 && hd != 128 && hd != 256) return false;
  const int e = hd / 32;
  return s.rotary_dim % (2 * e) == 0 && s.rotary_dim <= hd && s.page_size > 0;
}

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
  launch_qk_norm_rope_kv(s, qkv, q_norm_w, k_norm_w, positions, slot_mapping, n_tokens, q_out,
                         k_cache, v_cache, stream, RopeKvKernel::kAuto);
}

void launch_qk_norm_rope_kv(const AttnShape& s, const bf16* qkv, const bf16* q_norm_w,
                            const bf16* k_norm_w, const int32_t* positions,
                            const int32_t* slot_mapping, int n_tokens, bf16* q_out, bf16* k_cache,
                            bf16* v_cache, cudaStream_t stream, RopeKvKernel which) {
  launch_qk_norm_rope_kv(s, qkv, q_norm_w, k_norm_w, positions, slot_mapping, n_tokens, q_out,
                         k_cache, v_cache, stream, which, false);
}

void launch_qk_norm_rope_kv(const AttnShape& s, const bf16* qkv, const bf16* q_norm_w,
                            const bf16* k_norm_w, const int32_t* positions,
                            const int32_t* slot_mapping, int n_tokens, bf16* q_out, bf16* k_cache,
                            bf16* v_cache, cudaStream_t stream, RopeKvKernel which, bool pdl) {
  if (n_tokens <= 0) return;
  check_attn_shape(s);
  const int vb = 2 * s.head_dim / 32;  // bytes per lane access of the warp kernel
  const bool warp_ok = qk_norm_rope_kv_warp_supported(s) && s.qkv_dim() % (vb / 2) == 0 &&
                       aligned(qkv, vb) && aligned(q_out, vb) && aligned(k_cache, vb) &&
                       aligned(v_cache, vb) && aligned(q_norm_w, vb) && aligned(k_norm_w, vb);
  DS_CHECK(which != RopeKvKernel::kWarpPerHead || warp_ok,
           "rope_kv: the warp-per-head kernel needs head_dim 64/128/256 (got ", s.head_dim,
           "), rotary_dim / 2 a multiple of head_dim / 32 (got rotary_dim ", s.rotary_dim,
           ") and aligned rows");
  DS_CHECK(which != RopeKvKernel::kTokenTable || warp_ok,
           "rope_kv: the token-table kernel needs what the warp-per-head kernel needs (head_dim "
           "64/128/256, rotary_dim / 2 a multiple of head_dim / 32, aligned rows)");
  if (which == RopeKvKernel::kTokenTable) {
    DS_CHECK(n_tokens < (1 << 30), "rope_kv: ", n_tokens, " tokens is too many for one launch");
#define DS_ROPE_TABLE(HD)                                                                      \
  launch_maybe_pdl(qk_norm_rope_kv_table_kernel<HD>, dim3(n_tokens), dim3(kWarps * 32), 0,     \
                   stream, pdl, s, qkv, q_norm_w, k_norm_w, positions, slot_mapping, q_out,     \
                   k_cache, v_cache)
    if (s.head_dim == 256)
      DS_ROPE_TABLE(256);
    else if (s.head_dim == 128)
      DS_ROPE_TABLE(128);
    else
      DS_ROPE_TABLE(64);
#undef DS_ROPE_TABLE
    DS_CUDA_LAUNCH_CHECK();
    return;
  }
  if (which != RopeKvKernel::kBlockPerToken && warp_ok) {
    const int64_t items = (int64_t)n_tokens * (s.n_heads + 2 * s.n_kv_heads);
    const int64_t blocks = (items + kHeadWarps - 1) / kHeadWarps;
    DS_CHECK(blocks < (1ll << 31), "rope_kv: ", n_tokens, " tokens is too many for one launch");
#define DS_ROPE_WARP(HD)                                                                      \
  launch_maybe_pdl(qk_norm_rope_kv_warp_kernel<HD>, dim3(static_cast<unsigned>(blocks)),      \
                   dim3(kHeadWarps * 32), 0, stream, pdl, s, qkv, q_norm_w, k_norm_w, positions, \
                   slot_mapping, n_tokens, q_out, k_cache, v_cache)
    if (s.head_dim == 256)
      DS_ROPE_WARP(256);
    else if (s.head_dim == 128)
      DS_ROPE_WARP(128);
    else
      DS_ROPE_WARP(64);
#undef DS_ROPE_WARP
    DS_CUDA_LAUNCH_CHECK();
    return;
  }
  const size_t smem = sizeof(float) * kWarps * s.head_dim;
  launch_maybe_pdl(qk_norm_rope_kv_kernel, dim3(n_tokens), dim3(kWarps * 32), smem, stream, pdl, s,
                   qkv, q_norm_w, k_norm_w, positions, slot_mapping, q_out, k_cache, v_cache);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
