// Device helpers shared by the chunked GDN prompt kernels (gdn_prefill.cu's generic WY kernel and
// gdn_prefill_sm90.cu's gdn_wy_mma_kernel and conv kernels): the per-chunk gate staging and the
// token -> sequence lookup. Everything is
// __device__ __forceinline__, so each kernel compiles as with its own copy. Include only from .cu
// files (nvcc).
#pragma once

#include <cmath>
#include <cstdint>

namespace ds::cuda {

// Run by one warp (lane = threadIdx.x & 31) for the 64-row chunk starting at token row0 of value
// head hv (n of its rows valid, n_v value heads): the inclusive cumsum gamma of g over the chunk
// (2 rows per lane; rows past n add 0, i.e. gamma stays at the last valid value) into gam[64],
// beta into bet[64] (0 past n), beta e^gamma (the row scale of K in W) into eg[64], and gamma
// written back over g for the valid rows.
__device__ __forceinline__ void stage_chunk_gates(
    float* __restrict__ g,           // [n_tokens, n_v]
    const float* __restrict__ beta,  // [n_tokens, n_v]
    int64_t row0, int n, int n_v, int hv, int lane,
    float* gam,   // [64] shared
    float* bet,   // [64] shared
    float* eg) {  // [64] shared
  float g0 = lane < n ? g[(row0 + lane) * n_v + hv] : 0.f;
  float g1 = lane + 32 < n ? g[(row0 + lane + 32) * n_v + hv] : 0.f;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float a0 = __shfl_up_sync(0xffffffffu, g0, o);
    const float a1 = __shfl_up_sync(0xffffffffu, g1, o);
    if (lane >= o) {
      g0 += a0;
      g1 += a1;
    }
  }
  g1 += __shfl_sync(0xffffffffu, g0, 31);
  gam[lane] = g0;
  gam[lane + 32] = g1;
  const float b0 = lane < n ? beta[(row0 + lane) * n_v + hv] : 0.f;
  const float b1 = lane + 32 < n ? beta[(row0 + lane + 32) * n_v + hv] : 0.f;
  bet[lane] = b0;
  bet[lane + 32] = b1;
  eg[lane] = b0 * expf(g0);
  eg[lane + 32] = b1 * expf(g1);
  if (lane < n) g[(row0 + lane) * n_v + hv] = g0;
  if (lane + 32 < n) g[(row0 + lane + 32) * n_v + hv] = g1;
}

// The sequence of packed token t: the last s in [0, n_seqs) with cu_seqlens[s] <= t (binary
// search).
__device__ __forceinline__ int seq_of_token(const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                                            int n_seqs, int t) {
  int lo = 0, hi = n_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace ds::cuda
