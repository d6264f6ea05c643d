// Device helpers shared by the chunked GDN prompt kernels (gdn_prefill.cu's generic WY kernel,
// gdn_prefill_sm90.cu's gdn_wy_mma_kernel, scan and conv kernels, gdn_prefill_slice.cu's state
// pass and output kernels): the per-chunk gate staging, the token -> sequence lookup, and
// (namespace gdn_tile) the register-fragment products over [64][128] bf16 shared-memory tiles of
// the d_k = d_v = 128 mma.sync kernels. Everything is
// __device__ __forceinline__, so each kernel compiles as with its own copy. Include only from .cu
// files (nvcc).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/cuda_common.h"
#include "cuda/mma_util.cuh"

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

// ---- mma.sync products on [64][128] bf16 tiles (d_k = d_v = 128, chunk 64) ---------------------
// Fragment layouts are mma_util.cuh's m16n8k16 ones; tiles live in shared memory with row stride
// kLd (272 B: ldmatrix conflict-free).
namespace gdn_tile {

constexpr int kC = 64;       // chunk length
constexpr int kD = 128;      // d_k = d_v
constexpr int kLd = kD + 8;  // bf16 row stride of the [rows][128] tiles

// The A fragments (k-step s covers accumulator tiles 2s, 2s + 1) of a [16, 8 * N_TILES] fp32
// accumulator, as bf16.
template <int N_TILES>
__device__ __forceinline__ void acc_to_a(const float (&acc)[N_TILES][4],
                                         uint32_t (&a)[N_TILES / 2][4]) {
#pragma unroll
  for (int s = 0; s < N_TILES / 2; ++s) {
    a[s][0] = pack_bf16(acc[2 * s][0], acc[2 * s][1]);
    a[s][1] = pack_bf16(acc[2 * s][2], acc[2 * s][3]);
    a[s][2] = pack_bf16(acc[2 * s + 1][0], acc[2 * s + 1][1]);
    a[s][3] = pack_bf16(acc[2 * s + 1][2], acc[2 * s + 1][3]);
  }
}

// acc [16 v, 64 t] = h^T X^T for this warp's 16 state rows: ha the bf16 A fragments of h^T
// (acc_to_a), B(k, t) = X[t][k] from the [64][kLd] bf16 tile x (W or Q).
__device__ __forceinline__ void ha_times_tile_t(const uint32_t (&ha)[8][4], const bf16* x, int lane,
                                                float (&acc)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kD / 32; ++kk) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t b[4];
      ldsm_x4(b, x + (8 * j + (lane & 7)) * kLd + 32 * kk + (lane >> 3) * 8);
      mma_bf16(acc[j], ha[2 * kk], b[0], b[1]);
      mma_bf16(acc[j], ha[2 * kk + 1], b[2], b[3]);
    }
  }
}

// acc [16 rows, 128] += A X for this warp's 16 rows: a the bf16 A fragments of k-steps 0..3 (16
// columns each), X the [64][kLd] bf16 tile x (ldmatrix.trans); k-steps past last_step skipped.
__device__ __forceinline__ void acc_a_times_tile(const uint32_t (&a)[4][4], const bf16* x, int lane,
                                                 int last_step, float (&acc)[16][4]) {
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks) {
    if (ks <= last_step) {
#pragma unroll
      for (int jp = 0; jp < 8; ++jp) {
        uint32_t bk[4];
        ldsm_x4_t(bk, x + (16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8) * kLd + 16 * jp +
                          (lane >> 4) * 8);
        mma_bf16(acc[2 * jp], a[ks], bk[0], bk[1]);
        mma_bf16(acc[2 * jp + 1], a[ks], bk[2], bk[3]);
      }
    }
  }
}

// A warp's 16 rows of one head's fp32 state [d_v, d_k] (row stride kD) in the register layout
// h[j][i] = state(v, k), v = v_base + g + 8 (i / 2), k = 8 j + 2 c + (i % 2) (g = lane / 4,
// c = lane % 4): loaded (zeros when !has_state: a sequence at position 0) and stored back.
__device__ __forceinline__ void load_state_rows(float (&h)[16][4], const float* state,
                                                bool has_state, int v_base, int g, int c) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float2 x = make_float2(0.f, 0.f);
      if (has_state)
        x = *reinterpret_cast<const float2*>(state + (v_base + g + 8 * half) * kD + 8 * j + 2 * c);
      h[j][2 * half] = x.x;
      h[j][2 * half + 1] = x.y;
    }
  }
}
__device__ __forceinline__ void store_state_rows(const float (&h)[16][4], float* state, int v_base,
                                                 int g, int c) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      *reinterpret_cast<float2*>(state + (v_base + g + 8 * half) * kD + 8 * j + 2 * c) =
          make_float2(h[j][2 * half], h[j][2 * half + 1]);
    }
  }
}

}  // namespace gdn_tile

}  // namespace ds::cuda
