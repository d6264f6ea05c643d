// Gated DeltaNet prompt path (see gdn.h for layouts): conv + SiLU + l2norm + gates, then the
// chunked gated delta rule (chunk C = 64) in the WY / UT form of flash-linear-attention, then the
// gated RMSNorm, for several sequences of different lengths in one set of launches.
//
// Stages (one kernel each, all on the caller's stream):
//  0. chunk map: global chunk index -> (sequence, first token, valid rows); per-sequence base.
//  1. conv_prep (one block per token): causal depthwise conv (kernel 4, taps before the chunk from
//     the slot's ring) + SiLU, q/k l2norm (q * d_k^-0.5), beta = sigmoid(b),
//     g = -exp(A_log) softplus(a + dt_bias).
//  2. wy (one block per chunk x value head): gamma = cumsum(g) in the chunk;
//     A = strictly-lower(beta_i k_i.k_j e^(gamma_i - gamma_j)); T = (I + A)^-1 (16x16 diagonal
//     blocks by forward substitution, then the off-diagonal blocks); W = T (beta e^gamma K),
//     U = T (beta V), stored bf16.
//  3. state pass (one block per sequence x value head x 32 state columns; sequential over the
//     sequence's chunks): snapshot h_c (bf16); V_new = U - W h_c;
//     h_{c+1} = e^(gamma_last) h_c + K^T (e^(gamma_last - gamma_r) V_new). Initial state from the
//     slot (zero when seq_pos == 0), final state written back (fp32).
//  4. output (one block per chunk x value head): O = e^gamma (Q h_c) + (causal(Q K^T) e^(gamma_i -
//     gamma_j)) V_new, then y = norm_w * rmsnorm(O) * silu(z) per row.
// Products use tensor cores through wmma (bf16 operands, fp32 accumulate); gamma, A, the inverse,
// the running state and every accumulator are fp32 (FLA's precision: T, W, U, V_new and the
// snapshots bf16). Tail chunks: rows past the sequence end are zero (k, v, beta) with gamma held
// at the last valid value, and are never written.
// Specialisations: the WY and output kernels are compiled for d_k = d_v = 128 (the shipped
// models) with a run-time-size fallback for the other supported sizes; the state pass is compiled
// per d_k with 32 (or 16) state columns per block.
// Shared memory: WY ~83 KB, state pass ~103 KB, output ~105 KB at d 128 (two blocks per SM).
// Measured on the H200 (tests/cuda/cuda_gdn_test.cpp, Timing / ProfileOnce under ncu), one
// 4096-token sequence with carried state, 48 v heads, 16 k heads, d 128: 1.04 ms/layer in all
// (conv_prep 0.10, wy 0.29, state pass 0.39, output 0.22); 512 tokens 0.17 ms, 8192 tokens
// 1.97 ms. PERF.md: flash-linear-attention 0.405 ms at 4096; target 0.16 ms. Where the time goes
// next: the state pass is latency-bound (192 blocks, 64 sequential chunks, 4 barriers each;
// FlashInfer keeps the state in registers across warpgroups), the WY kernel's inverse is SIMT,
// and W, U, V_new and the snapshots make ~0.6 GB of extra traffic per 4096 tokens that a fused
// kernel would not.
// Specialised variants (dispatch.cpp kGdnPrefill, sm 90, d_k = d_v = 128): the FLA split with the
// state pass alone on the sequential path, sliced over value columns, and the output + gated norm
// parallel over chunks ("slice_scan", "slice_scan_cs", "slice_scan_ov": gdn_prefill_slice.cu, with
// the conv / WY kernels of gdn_prefill_sm90.cu and gdn_prefill_conv.cu; they reuse this file's
// snapshot region h and write V_new over U; slice_scan_ov's ready flags live here too). Stage
// profile of these generic kernels under ncu on the H200 (4096 tokens,
// carried state, 2026-11-29): chunk map 2.8 us, conv_prep 103, conv ring 4.4, wy 294, state pass
// 384, output 223 (1.01 ms in all).
// Test: tests/cuda/cuda_gdn_test.cpp (vs the token-by-token fp32 recurrence; timings printed).
#include <mma.h>

#include <algorithm>
#include <string>

#include "cuda/cuda_common.h"
#include "cuda/dispatch.h"
#include "cuda/gdn.h"
#include "cuda/gdn_chunk.cuh"
#include "cuda/gdn_prefill_sm90.h"
#include "cuda/mma_util.cuh"

namespace ds::cuda {
namespace {

namespace wm = nvcuda::wmma;

constexpr int kChunk = 64;

struct ChunkInfo {
  int seq;    // -1: no chunk (past the end of the map)
  int t0;     // first token (global index)
  int n;      // valid rows (1..64)
  int index;  // chunk index within its sequence
};

// Workspace regions, each 256-byte aligned.
struct PrefillWorkspace {
  bf16* qkv;          // [n_tokens, qkv_dim]
  float* g;           // [n_tokens, n_v_heads] log decay, overwritten by the in-chunk cumsum gamma
  float* beta;        // [n_tokens, n_v_heads]
  bf16* w;            // [n_tokens, n_v_heads, d_k]
  bf16* u;            // [n_tokens, n_v_heads, d_v], overwritten by V_new in the state pass
  bf16* h;            // [max_chunks, n_v_heads, d_v, d_k] state snapshot before each chunk
  ChunkInfo* chunks;  // [max_chunks]
  int* seq_chunk0;    // [n_seqs + 1] first global chunk of each sequence
  int* ready;  // [max_chunks, n_v_heads] slice_scan_ov's chunk-ready flags (zeroed by stage 0)
  size_t bytes;
};

size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

int max_chunks_for(int n_tokens, int n_seqs) { return n_tokens / kChunk + n_seqs; }

PrefillWorkspace carve_workspace(const GdnShape& s, int n_tokens, int n_seqs, void* base) {
  PrefillWorkspace ws{};
  const size_t T = static_cast<size_t>(n_tokens);
  const size_t mc = static_cast<size_t>(max_chunks_for(n_tokens, n_seqs));
  char* p = static_cast<char*>(base);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* r = p ? p + off : nullptr;
    off += align_up(bytes);
    return r;
  };
  ws.qkv = reinterpret_cast<bf16*>(take(T * s.qkv_dim() * sizeof(bf16)));
  ws.g = reinterpret_cast<float*>(take(T * s.n_v_heads * sizeof(float)));
  ws.beta = reinterpret_cast<float*>(take(T * s.n_v_heads * sizeof(float)));
  ws.w = reinterpret_cast<bf16*>(take(T * s.n_v_heads * s.d_k * sizeof(bf16)));
  ws.u = reinterpret_cast<bf16*>(take(T * s.n_v_heads * s.d_v * sizeof(bf16)));
  ws.h = reinterpret_cast<bf16*>(take(mc * s.n_v_heads * s.d_v * s.d_k * sizeof(bf16)));
  ws.chunks = reinterpret_cast<ChunkInfo*>(take(mc * sizeof(ChunkInfo)));
  ws.seq_chunk0 = reinterpret_cast<int*>(take((static_cast<size_t>(n_seqs) + 1) * sizeof(int)));
  ws.ready = reinterpret_cast<int*>(take(mc * s.n_v_heads * sizeof(int)));
  ws.bytes = off;
  return ws;
}

// ---- small device helpers -----------------------------------------------------------------------

// C (fp32, smem) [M, N] = (accumulate ? C : 0) + A [M, K] * B [K, N] on tensor cores (16x16x16
// bf16 tiles; M, N, K multiples of 16). A is row-major (a(m,k) = A[m*lda + k]) or, with
// ALayout = col_major, a(m,k) = A[k*lda + m]; likewise B: b(k,n) = B[k*ldb + n] (row_major) or
// B[n*ldb + k] (col_major); C: c(m,n) = C[m*ldc + n], or C[n*ldc + m] when c_col_major.
// The warps of the block share the output tiles; the caller synchronises around it.
template <typename ALayout, typename BLayout>
__device__ void smem_mma(const bf16* A, int lda, const bf16* B, int ldb, float* C, int ldc, int M,
                         int N, int K, bool accumulate, bool c_col_major = false) {
  constexpr bool a_row = std::is_same_v<ALayout, wm::row_major>;
  constexpr bool b_row = std::is_same_v<BLayout, wm::row_major>;
  const int warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int tiles_n = N / 16, n_tiles = (M / 16) * tiles_n;
  const auto c_layout = c_col_major ? wm::mem_col_major : wm::mem_row_major;
  for (int tile = warp; tile < n_tiles; tile += n_warps) {
    const int i = tile / tiles_n, j = tile % tiles_n;
    float* c_ptr = c_col_major ? C + j * 16 * ldc + i * 16 : C + i * 16 * ldc + j * 16;
    wm::fragment<wm::accumulator, 16, 16, 16, float> acc;
    if (accumulate) {
      wm::load_matrix_sync(acc, c_ptr, ldc, c_layout);
    } else {
      wm::fill_fragment(acc, 0.f);
    }
    for (int kk = 0; kk < K / 16; ++kk) {
      wm::fragment<wm::matrix_a, 16, 16, 16, bf16, ALayout> a;
      wm::fragment<wm::matrix_b, 16, 16, 16, bf16, BLayout> b;
      wm::load_matrix_sync(a, a_row ? A + i * 16 * lda + kk * 16 : A + kk * 16 * lda + i * 16, lda);
      wm::load_matrix_sync(b, b_row ? B + kk * 16 * ldb + j * 16 : B + j * 16 * ldb + kk * 16, ldb);
      wm::mma_sync(acc, a, b, acc);
    }
    wm::store_matrix_sync(c_ptr, acc, ldc, c_layout);
  }
}

// Starts async copies of rows [0, n) of a [rows, width] bf16 matrix (global row stride `stride`
// elements, width a multiple of 8) into smem (row stride ld), zero-filling rows [n, 64). The caller
// commits / waits (cp_async_commit, cp_async_wait_all) before its barrier.
__device__ void load_rows_async(bf16* dst, int ld, const bf16* src, int64_t stride, int width,
                                int n) {
  const int vec_per_row = width / 8;
  for (int e = threadIdx.x; e < kChunk * vec_per_row; e += blockDim.x) {
    const int r = e / vec_per_row, c = (e % vec_per_row) * 8;
    cp_async16(dst + r * ld + c, src + (r < n ? r : 0) * stride + c, r < n);
  }
}

__device__ __forceinline__ float softplus_thresh(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// ---- 0. chunk map -------------------------------------------------------------------------------
__global__ void gdn_chunk_map_kernel(const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                                     int n_seqs, int max_chunks,
                                     ChunkInfo* __restrict__ chunks,  // [max_chunks]
                                     int* __restrict__ seq_chunk0,    // [n_seqs + 1]
                                     int* __restrict__ ready,  // [n_ready] flags, cleared here
                                     int n_ready) {
  __shared__ int total;
  for (int i = threadIdx.x; i < n_ready; i += blockDim.x) ready[i] = 0;
  if (threadIdx.x == 0) {
    int c = 0;
    for (int s = 0; s < n_seqs; ++s) {
      seq_chunk0[s] = c;
      c += (cu_seqlens[s + 1] - cu_seqlens[s] + kChunk - 1) / kChunk;
    }
    seq_chunk0[n_seqs] = c;
    total = c;
  }
  __syncthreads();
  for (int s = 0; s < n_seqs; ++s) {
    const int c0 = seq_chunk0[s], t0 = cu_seqlens[s], len = cu_seqlens[s + 1] - t0;
    const int nc = seq_chunk0[s + 1] - c0;
    for (int c = threadIdx.x; c < nc; c += blockDim.x) {
      chunks[c0 + c] = ChunkInfo{s, t0 + c * kChunk, min(kChunk, len - c * kChunk), c};
    }
  }
  for (int c = total + threadIdx.x; c < max_chunks; c += blockDim.x) {
    chunks[c] = ChunkInfo{-1, 0, 0, 0};
  }
}

// ---- 1. conv + SiLU + l2norm + gates ------------------------------------------------------------
// One block per token; one warp per head of conv channels (q heads, k heads, v heads), each lane
// 4 consecutive channels (8-byte loads; VEC = false: the same with scalar loads, for rows that
// are not 8-byte aligned).
template <bool VEC>
__global__ void gdn_conv_prep_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                                     const bf16* __restrict__ proj,           // [n_tokens, in_dim]
                                     const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                                     const int32_t* __restrict__ seq_pos,     // [n_seqs]
                                     const int32_t* __restrict__ slot_ids,    // [n_seqs]
                                     int n_seqs,
                                     bf16* __restrict__ qkv,    // [n_tokens, qkv_dim]
                                     float* __restrict__ g,     // [n_tokens, n_v_heads]
                                     float* __restrict__ beta)  // [n_tokens, n_v_heads]
{
  const int t = blockIdx.x;
  const int seq = seq_of_token(cu_seqlens, n_seqs, t);
  const int start = cu_seqlens[seq];
  const int pos0 = seq_pos[seq];     // absolute position of the sequence's first token here
  const int p = pos0 + (t - start);  // absolute position of token t
  const int qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  const bf16* ring = pool.conv_state + static_cast<int64_t>(slot_ids[seq]) * pool.conv_slot_stride;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int n_heads = 2 * s.n_k_heads + s.n_v_heads;
  const float q_scale = rsqrtf(static_cast<float>(s.d_k));
  // Tap j reads token t - 3 + j, or the ring for positions before this chunk, or zero.
  const bf16* tap[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int pp = p - 3 + j;
    tap[j] = pp >= pos0 ? proj + static_cast<int64_t>(t - 3 + j) * in_dim
                        : (pp >= 0 ? ring + (pp & 3) * qkv_dim : nullptr);
  }
#pragma unroll 2
  for (int hh = warp; hh < n_heads; hh += n_warps) {
    const bool is_v = hh >= 2 * s.n_k_heads;
    const int d = is_v ? s.d_v : s.d_k;
    const int ch0 = is_v ? 2 * s.n_k_heads * s.d_k + (hh - 2 * s.n_k_heads) * s.d_v : hh * s.d_k;
    const int c = 4 * lane;
    float vals[4] = {0.f, 0.f, 0.f, 0.f};
    float ss = 0.f;
    if (c < d) {
      const int ch = ch0 + c;
      float wt[16];  // [4 channels][4 taps]
      if (VEC) {
        load16_bf16(w.conv_w + ch * 4, wt);
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) wt[i] = __bfloat162float(w.conv_w[ch * 4 + i]);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float xv[4] = {0.f, 0.f, 0.f, 0.f};
        if (tap[j] != nullptr) {
          if (VEC) {
            load4_bf16(tap[j] + ch, xv);
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) xv[i] = __bfloat162float(tap[j][ch + i]);
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) vals[i] += wt[i * 4 + j] * xv[i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        vals[i] = vals[i] / (1.f + __expf(-vals[i]));
        ss += vals[i] * vals[i];
      }
    }
    float scale = 1.f;
    if (!is_v) {
      ss = warp_sum(ss);
      scale = rsqrtf(ss + 1e-6f) * (hh < s.n_k_heads ? q_scale : 1.f);
    }
    if (c < d) {
      __nv_bfloat162 lo2 = __floats2bfloat162_rn(vals[0] * scale, vals[1] * scale);
      __nv_bfloat162 hi2 = __floats2bfloat162_rn(vals[2] * scale, vals[3] * scale);
      uint2 u;
      u.x = *reinterpret_cast<uint32_t*>(&lo2);
      u.y = *reinterpret_cast<uint32_t*>(&hi2);
      *reinterpret_cast<uint2*>(qkv + static_cast<int64_t>(t) * qkv_dim + ch0 + c) = u;
    }
  }
  // Gates.
  const bf16* b_in = proj + static_cast<int64_t>(t) * in_dim + qkv_dim + s.z_dim();
  for (int h = threadIdx.x; h < s.n_v_heads; h += blockDim.x) {
    const float b = __bfloat162float(b_in[h]);
    const float a = __bfloat162float(b_in[s.n_v_heads + h]);
    beta[static_cast<int64_t>(t) * s.n_v_heads + h] = 1.f / (1.f + expf(-b));
    g[static_cast<int64_t>(t) * s.n_v_heads + h] =
        -expf(w.A_log[h]) * softplus_thresh(a + w.dt_bias[h]);
  }
}

// Writes the pre-conv inputs of each sequence's last (up to) 4 tokens into its ring.
__global__ void gdn_conv_state_kernel(GdnShape s, GdnStatePool pool,
                                      const bf16* __restrict__ proj,  // [n_tokens, in_dim]
                                      const int32_t* __restrict__ cu_seqlens,
                                      const int32_t* __restrict__ seq_pos,
                                      const int32_t* __restrict__ slot_ids) {
  const int seq = blockIdx.y;
  const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start, pos0 = seq_pos[seq];
  const int qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= qkv_dim) return;
  bf16* ring = pool.conv_state + static_cast<int64_t>(slot_ids[seq]) * pool.conv_slot_stride;
  for (int r = 0; r < 4 && r < len; ++r) {
    const int i = len - 1 - r;  // token index within this chunk of the sequence
    ring[((pos0 + i) & 3) * qkv_dim + ch] = proj[static_cast<int64_t>(start + i) * in_dim + ch];
  }
}

// ---- 2. WY representation per chunk -------------------------------------------------------------
// DK_/DV_ > 0: compile-time head sizes (the shipped shapes); 0: run-time (the generic fallback).
struct WySmem {
  int ldk, ldv, lda, ldt, ldo;
  size_t k_off, v_off, a_off, tf_off, tb_off, o_off, x_off, gam_off, bet_off, eg_off, total;
};

__host__ __device__ inline WySmem wy_smem(int d_k, int d_v) {
  WySmem m{};
  m.ldk = d_k + 8;
  m.ldv = d_v + 8;
  m.lda = kChunk + 4;
  m.ldt = kChunk + 8;
  m.ldo = (d_k > d_v ? d_k : d_v) + 4;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t r = off;
    off += (bytes + 127) & ~size_t(127);
    return r;
  };
  m.k_off = take(sizeof(bf16) * kChunk * m.ldk);
  m.v_off = take(sizeof(bf16) * kChunk * m.ldv);
  m.a_off = take(sizeof(float) * kChunk * m.lda);
  m.tf_off = take(sizeof(float) * kChunk * m.lda);
  // The W / U staging (fp32 [64][ldo], at most 33.8 KB) reuses A and T (fp32, dead by then).
  m.o_off = m.a_off;
  m.tb_off = take(sizeof(bf16) * kChunk * m.ldt);
  m.x_off = take(sizeof(float) * 3 * 256);
  m.gam_off = take(sizeof(float) * kChunk);
  m.bet_off = take(sizeof(float) * kChunk);
  m.eg_off = take(sizeof(float) * kChunk);
  m.total = off;
  return m;
}

template <int DK_, int DV_>
__global__ void __launch_bounds__(256)
    gdn_wy_kernel(GdnShape s, const ChunkInfo* __restrict__ chunks,
                  const bf16* __restrict__ qkv,    // [n_tokens, qkv_dim]
                  float* __restrict__ g,           // [n_tokens, n_v] in: g, out: gamma
                  const float* __restrict__ beta,  // [n_tokens, n_v]
                  bf16* __restrict__ w_out,        // [n_tokens, n_v, d_k]
                  bf16* __restrict__ u_out)        // [n_tokens, n_v, d_v]
{
  const ChunkInfo ci = chunks[blockIdx.x];
  if (ci.seq < 0) return;
  const int d_k = DK_ ? DK_ : s.d_k, d_v = DV_ ? DV_ : s.d_v;
  const int hv = blockIdx.y, hk = hv / (s.n_v_heads / s.n_k_heads);
  const int n_v = s.n_v_heads, qkv_dim = s.qkv_dim();
  const WySmem L = wy_smem(d_k, d_v);
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* ks = reinterpret_cast<bf16*>(smem + L.k_off);
  bf16* vs = reinterpret_cast<bf16*>(smem + L.v_off);
  float* af = reinterpret_cast<float*>(smem + L.a_off);
  float* tf = reinterpret_cast<float*>(smem + L.tf_off);
  bf16* tb = reinterpret_cast<bf16*>(smem + L.tb_off);
  float* of = reinterpret_cast<float*>(smem + L.o_off);
  float* xs = reinterpret_cast<float*>(smem + L.x_off);
  float* gam = reinterpret_cast<float*>(smem + L.gam_off);
  float* bet = reinterpret_cast<float*>(smem + L.bet_off);
  float* eg = reinterpret_cast<float*>(smem + L.eg_off);

  const int n = ci.n;
  const int64_t row0 = static_cast<int64_t>(ci.t0);
  load_rows_async(ks, L.ldk, qkv + row0 * qkv_dim + s.n_k_heads * d_k + hk * d_k, qkv_dim, d_k, n);
  load_rows_async(vs, L.ldv, qkv + row0 * qkv_dim + 2 * s.n_k_heads * d_k + hv * d_v, qkv_dim, d_v,
                  n);
  cp_async_commit();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    stage_chunk_gates(g, beta, row0, n, n_v, hv, lane, gam, bet, eg);  // gamma, beta, beta e^gamma
  }
  cp_async_wait_all();
  __syncthreads();
  // K K^T.
  smem_mma<wm::row_major, wm::col_major>(ks, L.ldk, ks, L.ldk, af, L.lda, kChunk, kChunk, d_k,
                                         false);
  __syncthreads();
  // A = strictly lower (beta_i e^(gamma_i - gamma_j) k_i.k_j); gamma_i - gamma_j <= 0 there.
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    af[i * L.lda + j] = i > j ? bet[i] * af[i * L.lda + j] * __expf(gam[i] - gam[j]) : 0.f;
    tf[i * L.lda + j] = 0.f;
  }
  __syncthreads();
  // T = (I + A)^-1. Diagonal 16x16 blocks: warp b, lane j < 16 owns column j of block b.
  if (warp < 4 && lane < 16) {
    const int b0 = warp * 16, j = lane;
    float col[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < i; ++k) acc += af[(b0 + i) * L.lda + b0 + k] * col[k];
      col[i] = i == j ? 1.f : (i < j ? 0.f : -acc);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) tf[(b0 + i) * L.lda + b0 + j] = col[i];
  } else if (warp >= 4) {
    // Meanwhile: V <- beta V (bf16), by the other 4 warps.
    for (int e = threadIdx.x - 128; e < kChunk * d_v; e += blockDim.x - 128) {
      const int i = e / d_v, c = e % d_v;
      vs[i * L.ldv + c] = __float2bfloat16(__bfloat162float(vs[i * L.ldv + c]) * bet[i]);
    }
  }
  __syncthreads();
  // Off-diagonal blocks by distance d = 1..3: T_ij = -T_ii * sum_{k=j}^{i-1} A_ik T_kj (i = j + d).
  for (int dist = 1; dist < 4; ++dist) {
    const int nb = 4 - dist;
    for (int e = threadIdx.x; e < nb * 256; e += blockDim.x) {
      const int jb = e / 256, r = (e % 256) / 16, c = e % 16, ib = jb + dist;
      float acc = 0.f;
      for (int k = jb * 16; k < ib * 16; ++k) {
        acc += af[(ib * 16 + r) * L.lda + k] * tf[k * L.lda + jb * 16 + c];
      }
      xs[e] = acc;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nb * 256; e += blockDim.x) {
      const int jb = e / 256, r = (e % 256) / 16, c = e % 16, ib = jb + dist;
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < 16; ++k)
        acc += tf[(ib * 16 + r) * L.lda + ib * 16 + k] * xs[jb * 256 + k * 16 + c];
      tf[(ib * 16 + r) * L.lda + jb * 16 + c] = -acc;
    }
    __syncthreads();
  }
  // T to bf16; K <- beta e^gamma K.
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    tb[i * L.ldt + j] = __float2bfloat16(tf[i * L.lda + j]);
  }
  for (int e = threadIdx.x; e < kChunk * d_k; e += blockDim.x) {
    const int i = e / d_k, c = e % d_k;
    ks[i * L.ldk + c] = __float2bfloat16(__bfloat162float(ks[i * L.ldk + c]) * eg[i]);
  }
  __syncthreads();
  // W = T Kb (staged in the dead A/T space), then U = T Vb.
  smem_mma<wm::row_major, wm::row_major>(tb, L.ldt, ks, L.ldk, of, L.ldo, kChunk, d_k, kChunk,
                                         false);
  __syncthreads();
  for (int e = threadIdx.x; e < n * d_k / 2; e += blockDim.x) {
    const int i = e / (d_k / 2), c = (e % (d_k / 2)) * 2;
    *reinterpret_cast<__nv_bfloat162*>(w_out + ((row0 + i) * n_v + hv) * d_k + c) =
        __floats2bfloat162_rn(of[i * L.ldo + c], of[i * L.ldo + c + 1]);
  }
  __syncthreads();
  smem_mma<wm::row_major, wm::row_major>(tb, L.ldt, vs, L.ldv, of, L.ldo, kChunk, d_v, kChunk,
                                         false);
  __syncthreads();
  for (int e = threadIdx.x; e < n * d_v / 2; e += blockDim.x) {
    const int i = e / (d_v / 2), c = (e % (d_v / 2)) * 2;
    *reinterpret_cast<__nv_bfloat162*>(u_out + ((row0 + i) * n_v + hv) * d_v + c) =
        __floats2bfloat162_rn(of[i * L.ldo + c], of[i * L.ldo + c + 1]);
  }
}

// ---- 3. state pass ------------------------------------------------------------------------------
template <int DK, int BV>
struct StateSmem {
  static constexpr int kLdk = DK + 8;  // bf16 rows of length DK
  static constexpr int kLdh = DK + 4;  // fp32 state rows ([BV][DK], k contiguous)
  static constexpr int kLdf = BV + 4;  // fp32 [64][BV]
  static constexpr int kLdb = BV + 8;  // bf16 [64][BV]
  static constexpr size_t a(size_t x) { return (x + 127) & ~size_t(127); }
  static constexpr size_t kHf = 0;
  static constexpr size_t kHb = kHf + a(sizeof(float) * BV * kLdh);
  static constexpr size_t kW = kHb + a(sizeof(bf16) * BV * kLdk);
  static constexpr size_t kK = kW + a(sizeof(bf16) * kChunk * kLdk);      // 2 buffers
  static constexpr size_t kU = kK + 2 * a(sizeof(bf16) * kChunk * kLdk);  // 2 buffers
  static constexpr size_t kG = kU + 2 * a(sizeof(bf16) * kChunk * kLdb);  // 2 buffers
  static constexpr size_t kWh = kG + 2 * a(sizeof(float) * kChunk);
  static constexpr size_t kVb = kWh + a(sizeof(float) * kChunk * kLdf);
  static constexpr size_t kTotal = kVb + a(sizeof(bf16) * kChunk * kLdb);
};

// Sequential over the chunks of one sequence; block = (sequence, value head, BV state columns).
// The next chunk's W, K, U and gamma are fetched with cp.async while this chunk computes.
template <int DK, int BV>
__global__ void __launch_bounds__(128)
    gdn_state_kernel(GdnShape s, GdnStatePool pool, const int32_t* __restrict__ cu_seqlens,
                     const int32_t* __restrict__ seq_pos, const int32_t* __restrict__ slot_ids,
                     const int* __restrict__ seq_chunk0,
                     const bf16* __restrict__ qkv,     // [n_tokens, qkv_dim]
                     const float* __restrict__ gamma,  // [n_tokens, n_v]
                     const bf16* __restrict__ w,       // [n_tokens, n_v, DK]
                     bf16* __restrict__ u,             // [n_tokens, n_v, d_v] -> V_new
                     bf16* __restrict__ h_snap)        // [chunks, n_v, d_v, DK]
{
  using L = StateSmem<DK, BV>;
  const int seq = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * BV;
  const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
  if (len <= 0) return;
  const int hk = hv / (s.n_v_heads / s.n_k_heads);
  const int d_v = s.d_v, n_v = s.n_v_heads, qkv_dim = s.qkv_dim();
  extern __shared__ __align__(128) unsigned char smem[];
  float* hf = reinterpret_cast<float*>(smem + L::kHf);
  bf16* hb = reinterpret_cast<bf16*>(smem + L::kHb);
  bf16* ws = reinterpret_cast<bf16*>(smem + L::kW);
  float* wh = reinterpret_cast<float*>(smem + L::kWh);
  bf16* vb = reinterpret_cast<bf16*>(smem + L::kVb);
  auto ks = [&](int b) {
    return reinterpret_cast<bf16*>(smem + L::kK + b * L::a(sizeof(bf16) * kChunk * L::kLdk));
  };
  auto ub = [&](int b) {
    return reinterpret_cast<bf16*>(smem + L::kU + b * L::a(sizeof(bf16) * kChunk * L::kLdb));
  };
  auto gm = [&](int b) {
    return reinterpret_cast<float*>(smem + L::kG + b * L::a(sizeof(float) * kChunk));
  };
  const int tid = threadIdx.x;

  const int n_chunks = (len + kChunk - 1) / kChunk;
  auto fetch_w = [&](int c) {
    const int64_t row0 = start + c * kChunk;
    const int n = min(kChunk, len - c * kChunk);
    for (int e = tid; e < kChunk * DK / 8; e += blockDim.x) {
      const int r = e / (DK / 8), k = (e % (DK / 8)) * 8;
      const int rr = r < n ? r : 0;
      cp_async16(ws + r * L::kLdk + k, w + ((row0 + rr) * n_v + hv) * DK + k, r < n);
    }
  };
  auto fetch_rest = [&](int c, int b) {
    const int64_t row0 = start + c * kChunk;
    const int n = min(kChunk, len - c * kChunk);
    bf16* kd = ks(b);
    for (int e = tid; e < kChunk * DK / 8; e += blockDim.x) {
      const int r = e / (DK / 8), k = (e % (DK / 8)) * 8;
      const int rr = r < n ? r : 0;
      cp_async16(kd + r * L::kLdk + k, qkv + (row0 + rr) * qkv_dim + s.n_k_heads * DK + hk * DK + k,
                 r < n);
    }
    bf16* ud = ub(b);
    for (int e = tid; e < kChunk * BV / 8; e += blockDim.x) {
      const int r = e / (BV / 8), v = (e % (BV / 8)) * 8;
      const int rr = r < n ? r : 0;
      cp_async16(ud + r * L::kLdb + v, u + ((row0 + rr) * n_v + hv) * d_v + v0 + v, r < n);
    }
    float* gd = gm(b);
    for (int r = tid; r < kChunk; r += blockDim.x) {
      const int rr = r < n ? r : 0;
      cp_async4(gd + r, gamma + (row0 + rr) * n_v + hv, r < n);
    }
  };
  fetch_w(0);
  fetch_rest(0, 0);
  cp_async_commit();

  float* state = pool.rec_state + static_cast<int64_t>(slot_ids[seq]) * pool.rec_slot_stride +
                 (static_cast<int64_t>(hv) * d_v + v0) * DK;
  const bool has_state = seq_pos[seq] > 0;
  for (int e = tid; e < BV * DK / 4; e += blockDim.x) {
    const int v = e / (DK / 4), k = (e % (DK / 4)) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (has_state) x = *reinterpret_cast<const float4*>(state + v * DK + k);
    *reinterpret_cast<float4*>(hf + v * L::kLdh + k) = x;
  }
  const int chunk0 = seq_chunk0[seq];
  for (int c = 0; c < n_chunks; ++c) {
    const int b = c & 1;
    const int64_t row0 = start + c * kChunk;
    const int n = min(kChunk, len - c * kChunk);
    cp_async_wait_all();
    __syncthreads();  // chunk c's data landed; the previous chunk is finished
    // Snapshot h_c (bf16): the operand of W h here and of Q h in the output kernel.
    bf16* snap = h_snap + ((static_cast<int64_t>(chunk0 + c) * n_v + hv) * d_v + v0) * DK;
    for (int e = tid; e < BV * DK / 8; e += blockDim.x) {
      const int v = e / (DK / 8), k = (e % (DK / 8)) * 8;
      const float4 x0 = *reinterpret_cast<const float4*>(hf + v * L::kLdh + k);
      const float4 x1 = *reinterpret_cast<const float4*>(hf + v * L::kLdh + k + 4);
      __nv_bfloat162 p[4] = {__floats2bfloat162_rn(x0.x, x0.y), __floats2bfloat162_rn(x0.z, x0.w),
                             __floats2bfloat162_rn(x1.x, x1.y), __floats2bfloat162_rn(x1.z, x1.w)};
      const uint4 pk = *reinterpret_cast<const uint4*>(p);
      *reinterpret_cast<uint4*>(hb + v * L::kLdk + k) = pk;
      *reinterpret_cast<uint4*>(snap + v * DK + k) = pk;
    }
    __syncthreads();
    // W h_c: [64, DK] x [DK, BV]; h element (k, v) at hb[v * ldk + k] (col-major).
    smem_mma<wm::row_major, wm::col_major>(ws, L::kLdk, hb, L::kLdk, wh, L::kLdf, kChunk, BV, DK,
                                           false);
    __syncthreads();
    if (c + 1 < n_chunks) {  // ws and the other K/U/gamma buffers are free now
      fetch_w(c + 1);
      fetch_rest(c + 1, b ^ 1);
    }
    cp_async_commit();
    const float* g_c = gm(b);
    const float g_last = g_c[n - 1];
    const bf16* u_c = ub(b);
    for (int e = tid; e < kChunk * BV / 2; e += blockDim.x) {
      const int i = e / (BV / 2), v = (e % (BV / 2)) * 2;
      __nv_bfloat162 out2 = __floats2bfloat162_rn(0.f, 0.f);
      if (i < n) {
        const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(u_c + i * L::kLdb + v);
        const __nv_bfloat162 vn = __floats2bfloat162_rn(__low2float(u2) - wh[i * L::kLdf + v],
                                                        __high2float(u2) - wh[i * L::kLdf + v + 1]);
        *reinterpret_cast<__nv_bfloat162*>(u + ((row0 + i) * n_v + hv) * d_v + v0 + v) = vn;
        const float sc = expf(g_last - g_c[i]);
        out2 = __floats2bfloat162_rn(__low2float(vn) * sc, __high2float(vn) * sc);
      }
      *reinterpret_cast<__nv_bfloat162*>(vb + i * L::kLdb + v) = out2;
    }
    const float decay = expf(g_last);
    for (int e = tid; e < BV * DK / 4; e += blockDim.x) {
      const int v = e / (DK / 4), k = (e % (DK / 4)) * 4;
      float4* x = reinterpret_cast<float4*>(hf + v * L::kLdh + k);
      float4 t = *x;
      t.x *= decay;
      t.y *= decay;
      t.z *= decay;
      t.w *= decay;
      *x = t;
    }
    __syncthreads();
    // h += K^T Vb: [DK, 64] x [64, BV], accumulated in hf (col-major: (k, v) at hf[v*ldh + k]).
    smem_mma<wm::col_major, wm::row_major>(ks(b), L::kLdk, vb, L::kLdb, hf, L::kLdh, DK, BV, kChunk,
                                           true, true);
  }
  __syncthreads();
  for (int e = tid; e < BV * DK / 4; e += blockDim.x) {
    const int v = e / (DK / 4), k = (e % (DK / 4)) * 4;
    *reinterpret_cast<float4*>(state + v * DK + k) =
        *reinterpret_cast<const float4*>(hf + v * L::kLdh + k);
  }
}

template <int DK, int BV>
void launch_state(const GdnShape& s, const GdnStatePool& pool, const int32_t* cu_seqlens,
                  const int32_t* seq_pos, const int32_t* slot_ids, int n_seqs,
                  const PrefillWorkspace& ws, cudaStream_t stream) {
  constexpr size_t smem_bytes = StateSmem<DK, BV>::kTotal;
  DS_CUDA_CHECK(cudaFuncSetAttribute(gdn_state_kernel<DK, BV>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem_bytes)));
  gdn_state_kernel<DK, BV><<<dim3(n_seqs, s.n_v_heads, s.d_v / BV), 128, smem_bytes, stream>>>(
      s, pool, cu_seqlens, seq_pos, slot_ids, ws.seq_chunk0, ws.qkv, ws.g, ws.w, ws.u, ws.h);
  DS_CUDA_LAUNCH_CHECK();
}

template <int DK>
void launch_state_dk(const GdnShape& s, const GdnStatePool& pool, const int32_t* cu_seqlens,
                     const int32_t* seq_pos, const int32_t* slot_ids, int n_seqs,
                     const PrefillWorkspace& ws, cudaStream_t stream) {
  if (s.d_v >= 32) {
    launch_state<DK, 32>(s, pool, cu_seqlens, seq_pos, slot_ids, n_seqs, ws, stream);
  } else {
    launch_state<DK, 16>(s, pool, cu_seqlens, seq_pos, slot_ids, n_seqs, ws, stream);
  }
}

// ---- 4. output + gated RMSNorm ------------------------------------------------------------------
// smem: Q, K, V_new (bf16 [64][d+8]), the snapshot h (bf16 [d_v][d_k+8]), S (fp32 [64][68]). P
// (bf16) reuses K's space, the fp32 output staging reuses h's: about 104 KB at d 128, so two
// blocks fit on an SM.
struct OutSmem {
  int ldk, ldv, lds, ldp, ldo;
  size_t q_off, k_off, v_off, h_off, s_off, gam_off, eg_off, total;
};

__host__ __device__ inline OutSmem out_smem(int d_k, int d_v) {
  OutSmem m{};
  m.ldk = d_k + 8;
  m.ldv = d_v + 8;
  m.lds = kChunk + 4;
  m.ldp = kChunk + 8;
  m.ldo = d_v + 4;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t r = off;
    off += (bytes + 127) & ~size_t(127);
    return r;
  };
  const size_t k_bytes = sizeof(bf16) * kChunk * m.ldk, p_bytes = sizeof(bf16) * kChunk * m.ldp;
  const size_t h_bytes = sizeof(bf16) * d_v * m.ldk, o_bytes = sizeof(float) * kChunk * m.ldo;
  m.q_off = take(sizeof(bf16) * kChunk * m.ldk);
  m.k_off = take(k_bytes > p_bytes ? k_bytes : p_bytes);
  m.v_off = take(sizeof(bf16) * kChunk * m.ldv);
  m.h_off = take(h_bytes > o_bytes ? h_bytes : o_bytes);
  m.s_off = take(sizeof(float) * kChunk * m.lds);
  m.gam_off = take(sizeof(float) * kChunk);
  m.eg_off = take(sizeof(float) * kChunk);
  m.total = off;
  return m;
}

template <int DK_, int DV_>
__global__ void __launch_bounds__(256)
    gdn_output_kernel(GdnShape s, GdnLayerWeights wts, const ChunkInfo* __restrict__ chunks,
                      const int* __restrict__ seq_chunk0,
                      const bf16* __restrict__ proj,    // [n_tokens, in_dim] (z)
                      const bf16* __restrict__ qkv,     // [n_tokens, qkv_dim]
                      const float* __restrict__ gamma,  // [n_tokens, n_v]
                      const bf16* __restrict__ v_new,   // [n_tokens, n_v, d_v]
                      const bf16* __restrict__ h_snap,  // [chunks, n_v, d_v, d_k]
                      bf16* __restrict__ out)           // [n_tokens, n_v * d_v]
{
  constexpr int kMaxTilesPerWarp = 4;  // 64 x 128 outputs = 32 tiles over 8 warps
  const ChunkInfo ci = chunks[blockIdx.x];
  if (ci.seq < 0) return;
  const int d_k = DK_ ? DK_ : s.d_k, d_v = DV_ ? DV_ : s.d_v;
  const int hv = blockIdx.y, hk = hv / (s.n_v_heads / s.n_k_heads);
  const int n_v = s.n_v_heads, qkv_dim = s.qkv_dim();
  const OutSmem L = out_smem(d_k, d_v);
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem + L.q_off);
  bf16* ks = reinterpret_cast<bf16*>(smem + L.k_off);
  bf16* pb = reinterpret_cast<bf16*>(smem + L.k_off);  // after S = Q K^T
  bf16* vs = reinterpret_cast<bf16*>(smem + L.v_off);
  bf16* hs = reinterpret_cast<bf16*>(smem + L.h_off);
  float* of = reinterpret_cast<float*>(smem + L.h_off);  // after the last product
  float* sf = reinterpret_cast<float*>(smem + L.s_off);
  float* gam = reinterpret_cast<float*>(smem + L.gam_off);
  float* eg = reinterpret_cast<float*>(smem + L.eg_off);

  const int n = ci.n;
  const int64_t row0 = ci.t0;
  load_rows_async(qs, L.ldk, qkv + row0 * qkv_dim + hk * d_k, qkv_dim, d_k, n);
  load_rows_async(ks, L.ldk, qkv + row0 * qkv_dim + s.n_k_heads * d_k + hk * d_k, qkv_dim, d_k, n);
  load_rows_async(vs, L.ldv, v_new + (row0 * n_v + hv) * d_v, static_cast<int64_t>(n_v) * d_v, d_v,
                  n);
  const int chunk = seq_chunk0[ci.seq] + ci.index;
  {
    const bf16* src = h_snap + (static_cast<int64_t>(chunk) * n_v + hv) * d_v * d_k;
    const int vec_per_row = d_k / 8;
    for (int e = threadIdx.x; e < d_v * vec_per_row; e += blockDim.x) {
      const int r = e / vec_per_row, c = (e % vec_per_row) * 8;
      cp_async16(hs + r * L.ldk + c, src + r * d_k + c, true);
    }
  }
  cp_async_commit();
  // Epilogue operands, loaded now so that their latency hides behind the products: warp w owns
  // rows w, w + 8, ... (8 rows), lane l channels 4l .. 4l+3 of the head.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  const int in_dim = s.in_dim(), out_dim = s.out_dim();
  const bool norm = wts.norm_w != nullptr;
  const int c4 = 4 * lane;
  __nv_bfloat162 zr[kChunk / 8][2];
  float nw[4] = {1.f, 1.f, 1.f, 1.f};
  if (norm && c4 < d_v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) nw[i] = __bfloat162float(wts.norm_w[c4 + i]);
  }
#pragma unroll
  for (int r = 0; r < kChunk / 8; ++r) {
    const int i = warp + 8 * r;
    zr[r][0] = zr[r][1] = __floats2bfloat162_rn(0.f, 0.f);
    if (norm && i < n && c4 < d_v) {
      const bf16* z = proj + (row0 + i) * in_dim + qkv_dim + hv * d_v + c4;
      zr[r][0] = __halves2bfloat162(z[0], z[1]);
      zr[r][1] = __halves2bfloat162(z[2], z[3]);
    }
  }
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    const float gi = i < n ? gamma[(row0 + i) * n_v + hv] : 0.f;
    gam[i] = gi;
    eg[i] = i < n ? expf(gi) : 0.f;
  }
  cp_async_wait_all();
  __syncthreads();
  // S = Q K^T.
  smem_mma<wm::row_major, wm::col_major>(qs, L.ldk, ks, L.ldk, sf, L.lds, kChunk, kChunk, d_k,
                                         false);
  __syncthreads();
  // P = causal(S) e^(gamma_i - gamma_j) (bf16, over K's space); Q <- e^gamma Q (bf16, in place).
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    const float p = (j <= i && i < n) ? sf[i * L.lds + j] * __expf(gam[i] - gam[j]) : 0.f;
    pb[i * L.ldp + j] = __float2bfloat16(p);
  }
  for (int e = threadIdx.x; e < kChunk * d_k / 2; e += blockDim.x) {
    const int i = e / (d_k / 2), c = (e % (d_k / 2)) * 2;
    __nv_bfloat162* q2 = reinterpret_cast<__nv_bfloat162*>(qs + i * L.ldk + c);
    const float sc = eg[i];
    *q2 = __floats2bfloat162_rn(__low2float(*q2) * sc, __high2float(*q2) * sc);
  }
  __syncthreads();
  // O = (e^gamma Q) h_c + P V_new, each warp's tiles accumulated in registers.
  const int tiles_n = d_v / 16, n_tiles = (kChunk / 16) * tiles_n;
  wm::fragment<wm::accumulator, 16, 16, 16, float> acc[kMaxTilesPerWarp];
#pragma unroll
  for (int t = 0; t < kMaxTilesPerWarp; ++t) {
    const int tile = warp + t * n_warps;
    if (tile >= n_tiles) break;
    const int i = tile / tiles_n, j = tile % tiles_n;
    wm::fill_fragment(acc[t], 0.f);
    for (int kk = 0; kk < d_k / 16; ++kk) {
      wm::fragment<wm::matrix_a, 16, 16, 16, bf16, wm::row_major> a;
      wm::fragment<wm::matrix_b, 16, 16, 16, bf16, wm::col_major> b;
      wm::load_matrix_sync(a, qs + i * 16 * L.ldk + kk * 16, L.ldk);
      wm::load_matrix_sync(b, hs + j * 16 * L.ldk + kk * 16, L.ldk);  // (k, v) at hs[v*ldk + k]
      wm::mma_sync(acc[t], a, b, acc[t]);
    }
    for (int kk = 0; kk <= i; ++kk) {  // P is lower triangular: blocks kk > i are zero
      wm::fragment<wm::matrix_a, 16, 16, 16, bf16, wm::row_major> a;
      wm::fragment<wm::matrix_b, 16, 16, 16, bf16, wm::row_major> b;
      wm::load_matrix_sync(a, pb + i * 16 * L.ldp + kk * 16, L.ldp);
      wm::load_matrix_sync(b, vs + kk * 16 * L.ldv + j * 16, L.ldv);
      wm::mma_sync(acc[t], a, b, acc[t]);
    }
  }
  __syncthreads();  // every warp is done with h; its space takes the fp32 output
#pragma unroll
  for (int t = 0; t < kMaxTilesPerWarp; ++t) {
    const int tile = warp + t * n_warps;
    if (tile >= n_tiles) break;
    const int i = tile / tiles_n, j = tile % tiles_n;
    wm::store_matrix_sync(of + i * 16 * L.ldo + j * 16, acc[t], L.ldo, wm::mem_row_major);
  }
  __syncthreads();
  // Gated RMSNorm, one warp per row (8 rows per warp, 4 channels per lane).
#pragma unroll
  for (int r = 0; r < kChunk / 8; ++r) {
    const int i = warp + 8 * r;
    if (i >= n) break;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    if (c4 < d_v) {
      const float4 o4 = *reinterpret_cast<const float4*>(of + i * L.ldo + c4);
      o[0] = o4.x;
      o[1] = o4.y;
      o[2] = o4.z;
      o[3] = o4.w;
    }
    float scale = 1.f;
    if (norm) {
      float ss = o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3];
      ss = warp_sum(ss);
      scale = rsqrtf(ss / d_v + s.norm_eps);
    }
    if (c4 < d_v) {
      float yv[4];
      const float zf[4] = {__low2float(zr[r][0]), __high2float(zr[r][0]), __low2float(zr[r][1]),
                           __high2float(zr[r][1])};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        yv[k] = norm ? nw[k] * o[k] * scale * (zf[k] / (1.f + __expf(-zf[k]))) : o[k];
      }
      __nv_bfloat162* y =
          reinterpret_cast<__nv_bfloat162*>(out + (row0 + i) * out_dim + hv * d_v + c4);
      y[0] = __floats2bfloat162_rn(yv[0], yv[1]);
      y[1] = __floats2bfloat162_rn(yv[2], yv[3]);
    }
  }
}

// ---- generic fallback: token-by-token recurrence ------------------------------------------------
// For head sizes the chunked kernels do not take (d_v not a multiple of 16, e.g. 24): one block
// per (sequence, value head) walks the sequence's tokens in order, the state [d_v][d_k + 1]
// (padded: conflict-free column access) in shared memory, thread v owning row v. Reads conv_prep's
// output; the gated RMSNorm is fused. Slow (sequential over tokens) but exact in fp32: meant for
// small test models, never for the shipped shapes.
__global__ void __launch_bounds__(128)
    gdn_recurrent_kernel(GdnShape s, GdnLayerWeights wts, GdnStatePool pool,
                         const int32_t* __restrict__ cu_seqlens,
                         const int32_t* __restrict__ seq_pos, const int32_t* __restrict__ slot_ids,
                         const bf16* __restrict__ proj,   // [n_tokens, in_dim] (z)
                         const bf16* __restrict__ qkv,    // [n_tokens, qkv_dim] from conv_prep
                         const float* __restrict__ g,     // [n_tokens, n_v] raw log decay
                         const float* __restrict__ beta,  // [n_tokens, n_v]
                         bf16* __restrict__ out)          // [n_tokens, n_v * d_v]
{
  const int seq = blockIdx.x, hv = blockIdx.y;
  const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
  if (len <= 0) return;
  const int d_k = s.d_k, d_v = s.d_v, n_v = s.n_v_heads, qkv_dim = s.qkv_dim();
  const int hk = hv / (n_v / s.n_k_heads), ld = d_k + 1, tid = threadIdx.x;
  extern __shared__ float rsm[];
  float* S = rsm;             // [d_v][d_k + 1]
  float* qs = S + d_v * ld;   // [d_k]
  float* ks = qs + d_k;       // [d_k]
  float* scratch = ks + d_k;  // [32]
  float* state = pool.rec_state + static_cast<int64_t>(slot_ids[seq]) * pool.rec_slot_stride +
                 static_cast<int64_t>(hv) * d_v * d_k;
  const bool has_state = seq_pos[seq] > 0;
  for (int e = tid; e < d_v * d_k; e += blockDim.x) {
    S[(e / d_k) * ld + e % d_k] = has_state ? state[e] : 0.f;
  }
  const bool norm = wts.norm_w != nullptr;
  const float w_v = norm && tid < d_v ? __bfloat162float(wts.norm_w[tid]) : 0.f;
  for (int t = 0; t < len; ++t) {
    const int64_t row = start + t;
    __syncthreads();  // the previous token's readers of qs / ks are done (and S is loaded)
    for (int c = tid; c < d_k; c += blockDim.x) {
      qs[c] = __bfloat162float(qkv[row * qkv_dim + hk * d_k + c]);
      ks[c] = __bfloat162float(qkv[row * qkv_dim + s.n_k_heads * d_k + hk * d_k + c]);
    }
    __syncthreads();
    const float decay = expf(g[row * n_v + hv]), b = beta[row * n_v + hv];
    float o = 0.f;
    if (tid < d_v) {  // d_v <= 128 = blockDim.x
      const float vv =
          __bfloat162float(qkv[row * qkv_dim + 2 * s.n_k_heads * d_k + hv * d_v + tid]);
      float* Sr = S + tid * ld;
      float u = 0.f;
      for (int k = 0; k < d_k; ++k) {
        Sr[k] *= decay;
        u += Sr[k] * ks[k];
      }
      const float delta = b * (vv - u);
      for (int k = 0; k < d_k; ++k) {
        Sr[k] += ks[k] * delta;
        o += Sr[k] * qs[k];
      }
    }
    float scale = 1.f;
    if (norm) scale = rsqrtf(block_sum(o * o, scratch) / d_v + s.norm_eps);
    if (tid < d_v) {
      float y = o;
      if (norm) {
        const float zf = __bfloat162float(proj[row * s.in_dim() + qkv_dim + hv * d_v + tid]);
        y = w_v * o * scale * (zf / (1.f + __expf(-zf)));
      }
      out[row * s.out_dim() + hv * d_v + tid] = __float2bfloat16(y);
    }
  }
  __syncthreads();
  for (int e = tid; e < d_v * d_k; e += blockDim.x) state[e] = S[(e / d_k) * ld + e % d_k];
}

// Head sizes the chunked (tensor-core) kernels take; others go to gdn_recurrent_kernel.
bool chunked_dims(const GdnShape& s) {
  auto ok = [](int d) { return d == 16 || d == 32 || d == 64 || d == 128; };
  return ok(s.d_k) && ok(s.d_v);
}

void check_common(const GdnShape& s, const GdnStatePool& pool, int n_seqs) {
  check_gdn_shape(s);
  DS_CHECK(n_seqs >= 0, "gdn: n_seqs must be >= 0, got ", n_seqs);
  DS_CHECK(pool.conv_state && pool.rec_state, "gdn: state pool pointers are null");
  DS_CHECK(pool.conv_slot_stride >= 4LL * s.qkv_dim(), "gdn: conv_slot_stride ",
           pool.conv_slot_stride, " < 4 * qkv_dim = ", 4LL * s.qkv_dim());
  DS_CHECK(pool.rec_slot_stride >= static_cast<int64_t>(s.n_v_heads) * s.d_v * s.d_k,
           "gdn: rec_slot_stride ", pool.rec_slot_stride, " < n_v_heads * d_v * d_k");
}

template <typename K>
void set_smem(K kernel, size_t bytes) {
  DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(bytes)));
}

}  // namespace

void check_gdn_shape(const GdnShape& s) {
  auto ok_dim = [](int d) { return d == 16 || d == 32 || d == 64 || d == 128; };
  DS_CHECK(s.n_k_heads > 0 && s.n_v_heads > 0, "gdn: n_k_heads (", s.n_k_heads, ") and n_v_heads (",
           s.n_v_heads, ") must be positive");
  DS_CHECK(s.n_v_heads % s.n_k_heads == 0, "gdn: n_v_heads (", s.n_v_heads,
           ") must be a multiple of n_k_heads (", s.n_k_heads, ")");
  DS_CHECK(ok_dim(s.d_k), "gdn: d_k (linear_key_head_dim) = ", s.d_k,
           " is not supported by the CUDA kernels (16, 32, 64 or 128)");
  DS_CHECK(s.d_v > 0 && s.d_v <= 128 && s.d_v % 4 == 0,
           "gdn: d_v (linear_value_head_dim) = ", s.d_v,
           " is not supported by the CUDA kernels (a multiple of 4 up to 128; 16, 32, 64 and 128 "
           "have the fast kernels)");
  DS_CHECK(s.conv_kernel == 4, "gdn: conv_kernel (linear_conv_kernel_dim) = ", s.conv_kernel,
           " is not supported (4 only)");
}

size_t gdn_prefill_workspace_bytes(const GdnShape& s, int max_tokens, int max_seqs) {
  return carve_workspace(s, max_tokens, max_seqs, nullptr).bytes;
}

const int* gdn_prefill_ready_flags(const GdnShape& s, int n_tokens, int n_seqs,
                                   const void* workspace, size_t* count) {
  *count = size_t(max_chunks_for(n_tokens, n_seqs)) * size_t(s.n_v_heads);
  return carve_workspace(s, n_tokens, n_seqs, const_cast<void*>(workspace)).ready;
}

void launch_gdn_conv_prep(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                          const bf16* proj, const int32_t* cu_seqlens, const int32_t* seq_pos,
                          const int32_t* slot_ids, int n_seqs, int n_tokens, bf16* qkv, float* g,
                          float* beta, cudaStream_t stream) {
  check_common(s, pool, n_seqs);
  if (n_tokens <= 0 || n_seqs <= 0) return;
  // 8-byte loads need 8-byte aligned rows of proj and of the ring.
  const bool vec = s.in_dim() % 4 == 0 && pool.conv_slot_stride % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(proj) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(pool.conv_state) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(w.conv_w) % 16 == 0;
  if (vec) {
    gdn_conv_prep_kernel<true><<<n_tokens, 256, 0, stream>>>(s, w, pool, proj, cu_seqlens, seq_pos,
                                                             slot_ids, n_seqs, qkv, g, beta);
  } else {
    gdn_conv_prep_kernel<false><<<n_tokens, 256, 0, stream>>>(s, w, pool, proj, cu_seqlens, seq_pos,
                                                              slot_ids, n_seqs, qkv, g, beta);
  }
  DS_CUDA_LAUNCH_CHECK();
}

void launch_gdn_conv_state_update(const GdnShape& s, const GdnStatePool& pool, const bf16* proj,
                                  const int32_t* cu_seqlens, const int32_t* seq_pos,
                                  const int32_t* slot_ids, int n_seqs, cudaStream_t stream) {
  check_common(s, pool, n_seqs);
  if (n_seqs <= 0) return;
  dim3 grid((s.qkv_dim() + 255) / 256, n_seqs);
  gdn_conv_state_kernel<<<grid, 256, 0, stream>>>(s, pool, proj, cu_seqlens, seq_pos, slot_ids);
  DS_CUDA_LAUNCH_CHECK();
}

void launch_gdn_prefill(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                        const bf16* proj, const int32_t* cu_seqlens, const int32_t* seq_pos,
                        const int32_t* slot_ids, int n_seqs, int n_tokens, void* workspace,
                        size_t workspace_bytes, bf16* out, cudaStream_t stream,
                        const DispatchRegistry* dispatch) {
  check_common(s, pool, n_seqs);
  DS_CHECK(w.conv_w && w.A_log && w.dt_bias, "gdn prefill: layer weight pointers are null");
  DS_CHECK(n_tokens >= 0, "gdn prefill: n_tokens must be >= 0, got ", n_tokens);
  if (n_tokens == 0 || n_seqs == 0) return;
  const PrefillWorkspace ws = carve_workspace(s, n_tokens, n_seqs, workspace);
  DS_CHECK(workspace != nullptr && workspace_bytes >= ws.bytes, "gdn prefill: workspace of ",
           workspace_bytes, " bytes is too small for ", n_tokens, " tokens in ", n_seqs,
           " sequences (", ws.bytes, " needed; see gdn_prefill_workspace_bytes)");
  const int max_chunks = max_chunks_for(n_tokens, n_seqs);

  gdn_chunk_map_kernel<<<1, 256, 0, stream>>>(cu_seqlens, n_seqs, max_chunks, ws.chunks,
                                              ws.seq_chunk0, ws.ready, max_chunks * s.n_v_heads);
  DS_CUDA_LAUNCH_CHECK();
  // Compile-time head sizes for d_k == d_v == 128 (the shipped models); run-time otherwise.
  const bool d128 = s.d_k == 128 && s.d_v == 128;
  // The specialised variants (dispatch.cpp kGdnPrefill), "slice_scan*" (gdn_prefill_slice.cu):
  // the register WY stage of gdn_prefill_sm90.cu (tf32 off-diagonal inverse), then the state pass
  // split over 64-column slices of each head's state and the output + gated norm parallel over
  // chunks (8-warp CTAs); slice_scan_cs: slice_scan with the streaming conv of
  // gdn_prefill_conv.cu; slice_scan_ov: slice_scan_cs with the lean state pass and the output
  // kernel running beside it (ready flags per chunk); slice_scan_wg: slice_scan_ov with the state
  // pass on warpgroup MMAs.
  bool slice = false;  // gdn_prefill_slice.cu's state pass and output
  bool slice_overlap = false;
  GdnSliceState slice_state = GdnSliceState::kV64;
  bool wy_mma = false, conv_multi = false, conv_wide = false, conv_stream = false;
  if (d128 && dispatch != nullptr && gdn_scan_supported(s, w, pool, proj, out)) {
    const std::string& v =
        dispatch->select(KernelFamily::kGdnPrefill, dispatch->key(s.d_k, s.d_v, n_tokens, n_seqs))
            .name;
    if (v.rfind("slice_scan", 0) == 0 && gdn_slice_supported(s, w, pool, proj, out)) {
      slice = true;
      // Conv: slice_scan_cs*: the streaming kernel (gdn_prefill_conv.cu) where its 16-byte
      // alignment holds; else 8-token blocks from 2048 tokens on (H200, 4096 tokens: 104 us vs
      // 114 for the wide grid), the wide grid below (the 8-token blocks under-fill the GPU on
      // short chunks).
      const bool ov = v == "slice_scan_ov" || v == "slice_scan_wg";
      slice_overlap = ov && max_chunks <= 65535;
      const bool cs = v == "slice_scan_cs" || ov;
      conv_stream = cs && gdn_conv_prep_stream_supported(s, w, pool, proj);
      conv_multi =
          !conv_stream && n_tokens >= 2048 && gdn_conv_prep_multi_supported(s, w, pool, proj);
      conv_wide = !conv_stream && !conv_multi && gdn_conv_prep_multi_supported(s, w, pool, proj);
      // slice_scan_wg where its TMA maps can describe the tensors, else slice_scan_ov's kernel.
      slice_state = !ov ? GdnSliceState::kV64
                    : v == "slice_scan_wg" && gdn_slice_wg_supported(s, n_tokens, max_chunks, ws.g)
                        ? GdnSliceState::kWgmma
                        : GdnSliceState::kV64Lean;
      wy_mma = true;
    }
  }
  if (conv_stream) {
    launch_gdn_conv_prep_stream(s, w, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, n_tokens,
                                ws.qkv, ws.g, ws.beta, stream);
  } else if (conv_wide) {
    launch_gdn_conv_prep_wide(s, w, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, n_tokens,
                              ws.qkv, ws.g, ws.beta, stream);
  } else if (conv_multi) {
    launch_gdn_conv_prep_multi(s, w, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, n_tokens,
                               ws.qkv, ws.g, ws.beta, stream);
  } else {
    launch_gdn_conv_prep(s, w, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, n_tokens, ws.qkv,
                         ws.g, ws.beta, stream);
  }
  launch_gdn_conv_state_update(s, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, stream);
  if (!chunked_dims(s)) {
    const size_t smem_bytes =
        sizeof(float) * (static_cast<size_t>(s.d_v) * (s.d_k + 1) + 2 * s.d_k + 32);
    set_smem(gdn_recurrent_kernel, smem_bytes);
    gdn_recurrent_kernel<<<dim3(n_seqs, s.n_v_heads), 128, smem_bytes, stream>>>(
        s, w, pool, cu_seqlens, seq_pos, slot_ids, proj, ws.qkv, ws.g, ws.beta, out);
    DS_CUDA_LAUNCH_CHECK();
    return;
  }

  static_assert(sizeof(ChunkInfo) == 16);
  const WySmem wl = wy_smem(s.d_k, s.d_v);
  DS_ASSERT(sizeof(float) * kChunk * wl.ldo <= wl.tb_off - wl.a_off);  // W/U staging fits in A+T
  const OutSmem ol = out_smem(s.d_k, s.d_v);
  const dim3 grid(max_chunks, s.n_v_heads);
  auto run_wy = [&](auto wy_kernel) {
    set_smem(wy_kernel, wl.total);
    wy_kernel<<<grid, 256, wl.total, stream>>>(s, ws.chunks, ws.qkv, ws.g, ws.beta, ws.w, ws.u);
    DS_CUDA_LAUNCH_CHECK();
  };
  auto output = [&](auto out_kernel) {
    set_smem(out_kernel, ol.total);
    out_kernel<<<grid, 256, ol.total, stream>>>(s, w, ws.chunks, ws.seq_chunk0, proj, ws.qkv, ws.g,
                                                ws.u, ws.h, out);
    DS_CUDA_LAUNCH_CHECK();
  };
  if (wy_mma)
    launch_gdn_wy_mma(s, reinterpret_cast<const int4*>(ws.chunks), max_chunks, ws.qkv, ws.g,
                      ws.beta, ws.w, ws.u, stream, /*tf32_offdiag=*/slice);
  else if (d128)
    run_wy(gdn_wy_kernel<128, 128>);
  else
    run_wy(gdn_wy_kernel<0, 0>);
  if (slice) {
    launch_gdn_slice_scan(s, w, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs,
                          reinterpret_cast<const int4*>(ws.chunks), ws.seq_chunk0, max_chunks,
                          ws.qkv, ws.g, ws.w, ws.u, ws.h, out, slice_state, /*out_warps=*/8, stream,
                          /*stages=*/3, slice_overlap ? ws.ready : nullptr, n_tokens);
    return;
  }

  switch (s.d_k) {
    case 16:
      launch_state_dk<16>(s, pool, cu_seqlens, seq_pos, slot_ids, n_seqs, ws, stream);
      break;
    case 32:
      launch_state_dk<32>(s, pool, cu_seqlens, seq_pos, slot_ids, n_seqs, ws, stream);
      break;
    case 64:
      launch_state_dk<64>(s, pool, cu_seqlens, seq_pos, slot_ids, n_seqs, ws, stream);
      break;
    case 128:
      launch_state_dk<128>(s, pool, cu_seqlens, seq_pos, slot_ids, n_seqs, ws, stream);
      break;
    default:
      DS_ASSERT(false);
  }

  if (d128)
    output(gdn_output_kernel<128, 128>);
  else
    output(gdn_output_kernel<0, 0>);
}

}  // namespace ds::cuda
