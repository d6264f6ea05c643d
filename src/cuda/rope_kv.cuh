// Device code shared by rope_kv's warp-per-head kernel (rope_kv.cu) and the decode attention's
// split kernel when it does rope_kv's work itself (attention_decode.cu, AttnDecodeLaunch::rope):
// one warp normalises and rotates one (token, head) of the fused projection, a lane holding
// HD / 32 consecutive dims. Both kernels call norm_rope_lane_x, so a head comes out bit for bit the
// same from either (tested: CudaAttentionDecode.FusedRope27b).
#pragma once

#include <cuda_bf16.h>

#include "cuda/cuda_common.h"
#include "cuda/kernels.h"

namespace ds::cuda {

// E consecutive bf16 <-> floats (E = 2, 4 or 8: 4-, 8- or 16-byte accesses).
template <int E>
struct BfVec;
template <>
struct BfVec<8> {
  using T = uint4;
};
template <>
struct BfVec<4> {
  using T = uint2;
};
template <>
struct BfVec<2> {
  using T = uint32_t;
};
template <int E>
__device__ __forceinline__ void load_bf(const bf16* p, float (&f)[E]) {
  const typename BfVec<E>::T u = *reinterpret_cast<const typename BfVec<E>::T*>(p);
  const bf16* b = reinterpret_cast<const bf16*>(&u);
#pragma unroll
  for (int e = 0; e < E; ++e) f[e] = __bfloat162float(b[e]);
}
template <int E>
__device__ __forceinline__ void store_bf(bf16* p, const float (&f)[E]) {
  typename BfVec<E>::T u;
  bf16* b = reinterpret_cast<bf16*>(&u);
#pragma unroll
  for (int e = 0; e < E; ++e) b[e] = __float2bfloat16_rn(f[e]);
  *reinterpret_cast<typename BfVec<E>::T*>(p) = u;
}
// E consecutive bf16 copied as one access.
template <int E>
__device__ __forceinline__ void copy_bf(bf16* dst, const bf16* src) {
  *reinterpret_cast<typename BfVec<E>::T*>(dst) =
      *reinterpret_cast<const typename BfVec<E>::T*>(src);
}

// Row of cache slot `slot` (block slot / page_size, row slot % page_size) of kv head kh in a
// [blocks, n_kv, page, hd] cache.
__device__ __forceinline__ bf16* cache_row(const AttnShape& s, bf16* cache, int slot, int kh,
                                           int hd) {
  const int64_t blk = slot / s.page_size, r = slot % s.page_size;
  return cache + ((blk * s.n_kv_heads + kh) * s.page_size + r) * hd;
}

// The RoPE angle of rotary pair j (dims j and j + rotary_dim / 2): pos * theta^(-2j / rotary_dim),
// its sine and cosine (accurate sincosf). The same for every head of a token.
__device__ __forceinline__ void rope_angle(const AttnShape& s, float pos, int j, float* sn,
                                           float* cs) {
  const float inv_freq = 1.f / powf(s.rope_theta, (2.f * j) / s.rotary_dim);
  sincosf(pos * inv_freq, sn, cs);
}

// One warp, one head of HD dims (a q or k slice of a projection row), the lane's HD / 32 dims
// [lane * HD / 32, +HD / 32) already loaded into x (overwritten): the zero-centred RMSNorm with
// weight w_norm (fp32, rounded to bf16 as HF's q_norm / k_norm output), then RoPE on the first
// rotary_dim dims (rotate-half pairs i and i + rotary_dim / 2, the partner from another lane by a
// shuffle). y: the lane's dims in fp32 (the caller rounds them when storing). Needs
// qk_norm_rope_kv_warp_supported(s).
// kTable: the angles come from `table` (sin, cos of pair j at table[j]), computed once for the
// token by the caller; else rope_angle computes them here from pos. A compile-time choice: with
// a run-time one, every inlined copy carried powf + sincosf (and their slow paths) for each dim,
// and the fused decode attention kernel grew from 2.7K to 13.4K SASS instructions, most of them
// never executed: ncu counted instruction-fetch stalls (no_inst) 13x the plain kernel's and the
// kernel ran 25.9 vs 15.1 us (H200, session 16).
template <int HD, bool kTable>
__device__ __forceinline__ void norm_rope_lane_x(const AttnShape& s, float (&x)[HD / 32],
                                                 const bf16* w_norm, float pos, int lane,
                                                 float (&y)[HD / 32],
                                                 [[maybe_unused]] const float2* table) {
  constexpr int E = HD / 32;
  float w[E];
  load_bf<E>(w_norm + lane * E, w);
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) ss += x[e] * x[e];
  ss = warp_sum(ss);
  const float inv = rsqrtf(ss / HD + s.eps);
#pragma unroll
  for (int e = 0; e < E; ++e)  // normalised value rounded to bf16 (HF's q_norm output)
    x[e] = __bfloat162float(__float2bfloat16_rn(x[e] * inv * (1.f + w[e])));
  const int half = s.rotary_dim / 2;
  const int i0 = lane * E;
  const int partner = i0 < half ? lane + half / E : lane - half / E;
  const int src_lane = partner < 0 ? 0 : (partner > 31 ? 31 : partner);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const float other = __shfl_sync(0xffffffffu, x[e], src_lane);
    const int i = i0 + e;
    if (i < s.rotary_dim) {
      const int j = i < half ? i : i - half;
      float sn, cs;
      if constexpr (kTable) {
        sn = table[j].x;
        cs = table[j].y;
      } else {
        rope_angle(s, pos, j, &sn, &cs);
      }
      y[e] = i < half ? x[e] * cs - other * sn : x[e] * cs + other * sn;
    } else {
      y[e] = x[e];
    }
  }
}

}  // namespace ds::cuda
