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
// Test: tests/cuda/cuda_gdn_test.cpp (vs the token-by-token fp32 recurrence; timings printed).
#include <mma.h>

#include <algorithm>

#include "cuda/cuda_common.h"
#include "cuda/gdn.h"

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

// Copies rows [0, n) of a [rows, width] bf16 matrix (global row stride `stride` elements, width a
// multiple of 8) into smem (row stride ld), zero-filling rows [n, 64). 16-byte accesses.
__device__ void load_rows_bf16(bf16* dst, int ld, const bf16* src, int64_t stride, int width,
                               int n) {
  const int vec_per_row = width / 8;
  for (int e = threadIdx.x; e < kChunk * vec_per_row; e += blockDim.x) {
    const int r = e / vec_per_row, c = (e % vec_per_row) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < n) v = *reinterpret_cast<const uint4*>(src + r * stride + c);
    *reinterpret_cast<uint4*>(dst + r * ld + c) = v;
  }
}

__device__ __forceinline__ float softplus_thresh(float x) {
  return x > 20.f ? x : log1pf(expf(x));
}

// ---- 0. chunk map -------------------------------------------------------------------------------
__global__ void gdn_chunk_map_kernel(const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                                     int n_seqs, int max_chunks,
                                     ChunkInfo* __restrict__ chunks,  // [max_chunks]
                                     int* __restrict__ seq_chunk0) {  // [n_seqs + 1]
  __shared__ int total;
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
// One block per token; one warp per head of conv channels (q heads, k heads, v heads).
__global__ void gdn_conv_prep_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                                     const bf16* __restrict__ proj,  // [n_tokens, in_dim]
                                     const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                                     const int32_t* __restrict__ seq_pos,     // [n_seqs]
                                     const int32_t* __restrict__ slot_ids,    // [n_seqs]
                                     int n_seqs,
                                     bf16* __restrict__ qkv,    // [n_tokens, qkv_dim]
                                     float* __restrict__ g,     // [n_tokens, n_v_heads]
                                     float* __restrict__ beta)  // [n_tokens, n_v_heads]
{
  const int t = blockIdx.x;
  // Sequence of this token: the last s with cu_seqlens[s] <= t (binary search).
  int lo = 0, hi = n_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int seq = lo;
  const int start = cu_seqlens[seq];
  const int pos0 = seq_pos[seq];       // absolute position of the sequence's first token here
  const int p = pos0 + (t - start);    // absolute position of token t
  const int qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  const bf16* ring = pool.conv_state + static_cast<int64_t>(slot_ids[seq]) * pool.conv_slot_stride;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int n_heads = 2 * s.n_k_heads + s.n_v_heads;
  const float q_scale = rsqrtf(static_cast<float>(s.d_k));
  for (int hh = warp; hh < n_heads; hh += n_warps) {
    const bool is_v = hh >= 2 * s.n_k_heads;
    const int d = is_v ? s.d_v : s.d_k;
    const int ch0 = is_v ? 2 * s.n_k_heads * s.d_k + (hh - 2 * s.n_k_heads) * s.d_v : hh * s.d_k;
    float vals[4];  // d <= 128: at most 4 channels per lane
    float ss = 0.f;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int c = lane + 32 * r;
      vals[r] = 0.f;
      if (c < d) {
        const int ch = ch0 + c;
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int pp = p - 3 + j;  // absolute position of this tap
          float x = 0.f;
          if (pp >= pos0) {
            x = __bfloat162float(proj[static_cast<int64_t>(t - 3 + j) * in_dim + ch]);
          } else if (pp >= 0) {
            x = __bfloat162float(ring[(pp & 3) * qkv_dim + ch]);
          }
          acc += __bfloat162float(w.conv_w[ch * 4 + j]) * x;
        }
        const float y = acc / (1.f + __expf(-acc));
        vals[r] = y;
        ss += y * y;
      }
    }
    float scale = 1.f;
    if (!is_v) {
      ss = warp_sum(ss);
      scale = rsqrtf(ss + 1e-6f) * (hh < s.n_k_heads ? q_scale : 1.f);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int c = lane + 32 * r;
      if (c < d) qkv[static_cast<int64_t>(t) * qkv_dim + ch0 + c] = __float2bfloat16(vals[r] * scale);
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
struct WySmem {
  int ldk, ldv, lda, ldt, ldo;
  size_t k_off, v_off, a_off, tf_off, tb_off, o_off, x_off, gam_off, bet_off, total;
};

__host__ __device__ inline WySmem wy_smem(int d_k, int d_v) {
  WySmem m{};
  m.ldk = d_k + 8;
  m.ldv = d_v + 8;
  m.lda = kChunk + 4;
  m.ldt = kChunk + 8;
  m.ldo = (d_k > d_v ? d_k : d_v) + 4;
  size_t off = 0;
  auto take = [&](size_t bytes) { size_t r = off; off += (bytes + 127) & ~size_t(127); return r; };
  m.k_off = take(sizeof(bf16) * kChunk * m.ldk);
  m.v_off = take(sizeof(bf16) * kChunk * m.ldv);
  m.a_off = take(sizeof(float) * kChunk * m.lda);
  m.tf_off = take(sizeof(float) * kChunk * m.lda);
  m.tb_off = take(sizeof(bf16) * kChunk * m.ldt);
  m.o_off = take(sizeof(float) * kChunk * m.ldo);
  m.x_off = take(sizeof(float) * 3 * 256);
  m.gam_off = take(sizeof(float) * kChunk);
  m.bet_off = take(sizeof(float) * kChunk);
  m.total = off;
  return m;
}

__global__ void gdn_wy_kernel(GdnShape s, const ChunkInfo* __restrict__ chunks,
                              const bf16* __restrict__ qkv,  // [n_tokens, qkv_dim]
                              float* __restrict__ g,          // [n_tokens, n_v] in: g, out: gamma
                              const float* __restrict__ beta,  // [n_tokens, n_v]
                              bf16* __restrict__ w_out,        // [n_tokens, n_v, d_k]
                              bf16* __restrict__ u_out)        // [n_tokens, n_v, d_v]
{
  const ChunkInfo ci = chunks[blockIdx.x];
  if (ci.seq < 0) return;
  const int hv = blockIdx.y, hk = hv / (s.n_v_heads / s.n_k_heads);
  const int d_k = s.d_k, d_v = s.d_v, n_v = s.n_v_heads, qkv_dim = s.qkv_dim();
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

  const int n = ci.n;
  const int64_t row0 = static_cast<int64_t>(ci.t0);
  load_rows_bf16(ks, L.ldk, qkv + row0 * qkv_dim + s.n_k_heads * d_k + hk * d_k, qkv_dim, d_k, n);
  load_rows_bf16(vs, L.ldv, qkv + row0 * qkv_dim + 2 * s.n_k_heads * d_k + hv * d_v, qkv_dim, d_v,
                 n);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) {
    // Inclusive cumsum of g over the 64 rows (2 per lane); rows past n get g = 0, i.e. gamma
    // stays at the last valid value.
    float g0 = lane < n ? g[(row0 + lane) * n_v + hv] : 0.f;
    float g1 = lane + 32 < n ? g[(row0 + lane + 32) * n_v + hv] : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float a0 = __shfl_up_sync(0xffffffffu, g0, o);
      const float a1 = __shfl_up_sync(0xffffffffu, g1, o);
      if (lane >= o) { g0 += a0; g1 += a1; }
    }
    g1 += __shfl_sync(0xffffffffu, g0, 31);
    gam[lane] = g0;
    gam[lane + 32] = g1;
    bet[lane] = lane < n ? beta[(row0 + lane) * n_v + hv] : 0.f;
    bet[lane + 32] = lane + 32 < n ? beta[(row0 + lane + 32) * n_v + hv] : 0.f;
    if (lane < n) g[(row0 + lane) * n_v + hv] = g0;
    if (lane + 32 < n) g[(row0 + lane + 32) * n_v + hv] = g1;
  }
  __syncthreads();
  // K K^T.
  smem_mma<wm::row_major, wm::col_major>(ks, L.ldk, ks, L.ldk, af, L.lda, kChunk, kChunk, d_k,
                                         false);
  __syncthreads();
  // A = strictly lower (beta_i e^(gamma_i - gamma_j) k_i.k_j); gamma_i - gamma_j <= 0 there.
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    af[i * L.lda + j] = i > j ? bet[i] * af[i * L.lda + j] * expf(gam[i] - gam[j]) : 0.f;
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
      for (int k = 0; k < 16; ++k) acc += tf[(ib * 16 + r) * L.lda + ib * 16 + k] * xs[jb * 256 + k * 16 + c];
      tf[(ib * 16 + r) * L.lda + jb * 16 + c] = -acc;
    }
    __syncthreads();
  }
  // T to bf16; K <- beta e^gamma K; V <- beta V.
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    tb[i * L.ldt + j] = __float2bfloat16(tf[i * L.lda + j]);
  }
  for (int e = threadIdx.x; e < kChunk * d_k; e += blockDim.x) {
    const int i = e / d_k, c = e % d_k;
    ks[i * L.ldk + c] = __float2bfloat16(__bfloat162float(ks[i * L.ldk + c]) * bet[i] * expf(gam[i]));
  }
  for (int e = threadIdx.x; e < kChunk * d_v; e += blockDim.x) {
    const int i = e / d_v, c = e % d_v;
    vs[i * L.ldv + c] = __float2bfloat16(__bfloat162float(vs[i * L.ldv + c]) * bet[i]);
  }
  __syncthreads();
  // W = T Kb.
  smem_mma<wm::row_major, wm::row_major>(tb, L.ldt, ks, L.ldk, of, L.ldo, kChunk, d_k, kChunk, false);
  __syncthreads();
  for (int e = threadIdx.x; e < n * d_k; e += blockDim.x) {
    const int i = e / d_k, c = e % d_k;
    w_out[((row0 + i) * n_v + hv) * d_k + c] = __float2bfloat16(of[i * L.ldo + c]);
  }
  __syncthreads();
  // U = T Vb.
  smem_mma<wm::row_major, wm::row_major>(tb, L.ldt, vs, L.ldv, of, L.ldo, kChunk, d_v, kChunk, false);
  __syncthreads();
  for (int e = threadIdx.x; e < n * d_v; e += blockDim.x) {
    const int i = e / d_v, c = e % d_v;
    u_out[((row0 + i) * n_v + hv) * d_v + c] = __float2bfloat16(of[i * L.ldo + c]);
  }
}

// ---- 3. state pass ------------------------------------------------------------------------------
struct StateSmem {
  int bv, ldk, ldh, ldf;
  size_t hf_off, hb_off, w_off, k_off, uf_off, wh_off, vb_off, gam_off, total;
};

__host__ __device__ inline StateSmem state_smem(int d_k, int bv) {
  StateSmem m{};
  m.bv = bv;
  m.ldk = d_k + 8;  // bf16 rows of length d_k
  m.ldh = d_k + 4;  // fp32 state rows (state stored [bv][d_k], k contiguous)
  m.ldf = bv + 4;   // fp32 [64][bv]
  size_t off = 0;
  auto take = [&](size_t bytes) { size_t r = off; off += (bytes + 127) & ~size_t(127); return r; };
  m.hf_off = take(sizeof(float) * bv * m.ldh);
  m.hb_off = take(sizeof(bf16) * bv * m.ldk);
  m.w_off = take(sizeof(bf16) * kChunk * m.ldk);
  m.k_off = take(sizeof(bf16) * kChunk * m.ldk);
  m.uf_off = take(sizeof(float) * kChunk * m.ldf);
  m.wh_off = take(sizeof(float) * kChunk * m.ldf);
  m.vb_off = take(sizeof(bf16) * kChunk * (bv + 8));
  m.gam_off = take(sizeof(float) * kChunk);
  m.total = off;
  return m;
}

__global__ void gdn_state_kernel(GdnShape s, GdnStatePool pool, int bv,
                                 const int32_t* __restrict__ cu_seqlens,
                                 const int32_t* __restrict__ seq_pos,
                                 const int32_t* __restrict__ slot_ids,
                                 const int* __restrict__ seq_chunk0,
                                 const bf16* __restrict__ qkv,   // [n_tokens, qkv_dim]
                                 const float* __restrict__ gamma,  // [n_tokens, n_v]
                                 const bf16* __restrict__ w,     // [n_tokens, n_v, d_k]
                                 bf16* __restrict__ u,           // [n_tokens, n_v, d_v] -> V_new
                                 bf16* __restrict__ h_snap)      // [chunks, n_v, d_v, d_k]
{
  const int seq = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * bv;
  const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
  if (len <= 0) return;
  const int hk = hv / (s.n_v_heads / s.n_k_heads);
  const int d_k = s.d_k, d_v = s.d_v, n_v = s.n_v_heads, qkv_dim = s.qkv_dim();
  const StateSmem L = state_smem(d_k, bv);
  extern __shared__ __align__(128) unsigned char smem[];
  float* hf = reinterpret_cast<float*>(smem + L.hf_off);
  bf16* hb = reinterpret_cast<bf16*>(smem + L.hb_off);
  bf16* ws = reinterpret_cast<bf16*>(smem + L.w_off);
  bf16* ks = reinterpret_cast<bf16*>(smem + L.k_off);
  float* uf = reinterpret_cast<float*>(smem + L.uf_off);
  float* wh = reinterpret_cast<float*>(smem + L.wh_off);
  bf16* vb = reinterpret_cast<bf16*>(smem + L.vb_off);
  float* gam = reinterpret_cast<float*>(smem + L.gam_off);
  const int ldvb = bv + 8;

  float* state = pool.rec_state + static_cast<int64_t>(slot_ids[seq]) * pool.rec_slot_stride +
                 (static_cast<int64_t>(hv) * d_v + v0) * d_k;
  const bool has_state = seq_pos[seq] > 0;
  for (int e = threadIdx.x; e < bv * d_k; e += blockDim.x) {
    const int v = e / d_k, k = e % d_k;
    hf[v * L.ldh + k] = has_state ? state[v * d_k + k] : 0.f;
  }
  const int n_chunks = (len + kChunk - 1) / kChunk;
  const int chunk0 = seq_chunk0[seq];
  for (int c = 0; c < n_chunks; ++c) {
    const int64_t row0 = start + c * kChunk;
    const int n = min(kChunk, len - c * kChunk);
    __syncthreads();  // previous chunk's readers of ws/ks/vb/hf are done
    load_rows_bf16(ws, L.ldk, w + (row0 * n_v + hv) * d_k, static_cast<int64_t>(n_v) * d_k, d_k, n);
    load_rows_bf16(ks, L.ldk, qkv + row0 * qkv_dim + s.n_k_heads * d_k + hk * d_k, qkv_dim, d_k, n);
    for (int e = threadIdx.x; e < kChunk * bv; e += blockDim.x) {
      const int i = e / bv, v = e % bv;
      uf[i * L.ldf + v] = i < n ? __bfloat162float(u[((row0 + i) * n_v + hv) * d_v + v0 + v]) : 0.f;
    }
    for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
      gam[i] = i < n ? gamma[(row0 + i) * n_v + hv] : 0.f;
    }
    // Snapshot h_c (bf16): the operand of W h here and of Q h in the output kernel.
    bf16* snap = h_snap + ((static_cast<int64_t>(chunk0 + c) * n_v + hv) * d_v + v0) * d_k;
    for (int e = threadIdx.x; e < bv * d_k; e += blockDim.x) {
      const int v = e / d_k, k = e % d_k;
      const bf16 x = __float2bfloat16(hf[v * L.ldh + k]);
      hb[v * L.ldk + k] = x;
      snap[v * d_k + k] = x;
    }
    __syncthreads();
    // W h_c: [64, d_k] x [d_k, bv]; h element (k, v) at hb[v * ldk + k] (col-major).
    smem_mma<wm::row_major, wm::col_major>(ws, L.ldk, hb, L.ldk, wh, L.ldf, kChunk, bv, d_k, false);
    __syncthreads();
    const float g_last = gam[n - 1];
    for (int e = threadIdx.x; e < kChunk * bv; e += blockDim.x) {
      const int i = e / bv, v = e % bv;
      float vn = 0.f;
      if (i < n) {
        vn = uf[i * L.ldf + v] - wh[i * L.ldf + v];
        const bf16 vn_b = __float2bfloat16(vn);
        u[((row0 + i) * n_v + hv) * d_v + v0 + v] = vn_b;
        vn = __bfloat162float(vn_b) * expf(g_last - gam[i]);
      }
      vb[i * ldvb + v] = __float2bfloat16(vn);
    }
    const float decay = expf(g_last);
    for (int e = threadIdx.x; e < bv * d_k; e += blockDim.x) {
      const int v = e / d_k, k = e % d_k;
      hf[v * L.ldh + k] *= decay;
    }
    __syncthreads();
    // h += K^T Vb: [d_k, 64] x [64, bv], accumulated in hf (col-major: (k, v) at hf[v*ldh + k]).
    smem_mma<wm::col_major, wm::row_major>(ks, L.ldk, vb, ldvb, hf, L.ldh, d_k, bv, kChunk, true,
                                           true);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < bv * d_k; e += blockDim.x) {
    const int v = e / d_k, k = e % d_k;
    state[v * d_k + k] = hf[v * L.ldh + k];
  }
}

// ---- 4. output + gated RMSNorm ------------------------------------------------------------------
struct OutSmem {
  int ldk, ldv, lds, ldp, ldo;
  size_t q_off, k_off, v_off, h_off, s_off, p_off, o_off, gam_off, total;
};

__host__ __device__ inline OutSmem out_smem(int d_k, int d_v) {
  OutSmem m{};
  m.ldk = d_k + 8;
  m.ldv = d_v + 8;
  m.lds = kChunk + 4;
  m.ldp = kChunk + 8;
  m.ldo = d_v + 4;
  size_t off = 0;
  auto take = [&](size_t bytes) { size_t r = off; off += (bytes + 127) & ~size_t(127); return r; };
  m.q_off = take(sizeof(bf16) * kChunk * m.ldk);
  m.k_off = take(sizeof(bf16) * kChunk * m.ldk);
  m.v_off = take(sizeof(bf16) * kChunk * m.ldv);
  m.h_off = take(sizeof(bf16) * d_v * m.ldk);
  m.s_off = take(sizeof(float) * kChunk * m.lds);
  m.p_off = take(sizeof(bf16) * kChunk * m.ldp);
  m.o_off = take(sizeof(float) * kChunk * m.ldo);
  m.gam_off = take(sizeof(float) * kChunk);
  m.total = off;
  return m;
}

__global__ void gdn_output_kernel(GdnShape s, GdnLayerWeights wts,
                                  const ChunkInfo* __restrict__ chunks,
                                  const int* __restrict__ seq_chunk0,
                                  const bf16* __restrict__ proj,    // [n_tokens, in_dim] (z)
                                  const bf16* __restrict__ qkv,     // [n_tokens, qkv_dim]
                                  const float* __restrict__ gamma,  // [n_tokens, n_v]
                                  const bf16* __restrict__ v_new,   // [n_tokens, n_v, d_v]
                                  const bf16* __restrict__ h_snap,  // [chunks, n_v, d_v, d_k]
                                  bf16* __restrict__ out)           // [n_tokens, n_v * d_v]
{
  const ChunkInfo ci = chunks[blockIdx.x];
  if (ci.seq < 0) return;
  const int hv = blockIdx.y, hk = hv / (s.n_v_heads / s.n_k_heads);
  const int d_k = s.d_k, d_v = s.d_v, n_v = s.n_v_heads, qkv_dim = s.qkv_dim();
  const OutSmem L = out_smem(d_k, d_v);
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem + L.q_off);
  bf16* ks = reinterpret_cast<bf16*>(smem + L.k_off);
  bf16* vs = reinterpret_cast<bf16*>(smem + L.v_off);
  bf16* hs = reinterpret_cast<bf16*>(smem + L.h_off);
  float* sf = reinterpret_cast<float*>(smem + L.s_off);
  bf16* pb = reinterpret_cast<bf16*>(smem + L.p_off);
  float* of = reinterpret_cast<float*>(smem + L.o_off);
  float* gam = reinterpret_cast<float*>(smem + L.gam_off);

  const int n = ci.n;
  const int64_t row0 = ci.t0;
  load_rows_bf16(qs, L.ldk, qkv + row0 * qkv_dim + hk * d_k, qkv_dim, d_k, n);
  load_rows_bf16(ks, L.ldk, qkv + row0 * qkv_dim + s.n_k_heads * d_k + hk * d_k, qkv_dim, d_k, n);
  load_rows_bf16(vs, L.ldv, v_new + (row0 * n_v + hv) * d_v, static_cast<int64_t>(n_v) * d_v, d_v, n);
  const int chunk = seq_chunk0[ci.seq] + ci.index;
  {
    const bf16* src = h_snap + (static_cast<int64_t>(chunk) * n_v + hv) * d_v * d_k;
    const int vec_per_row = d_k / 8;
    for (int e = threadIdx.x; e < d_v * vec_per_row; e += blockDim.x) {
      const int r = e / vec_per_row, c = (e % vec_per_row) * 8;
      *reinterpret_cast<uint4*>(hs + r * L.ldk + c) =
          *reinterpret_cast<const uint4*>(src + r * d_k + c);
    }
  }
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    gam[i] = i < n ? gamma[(row0 + i) * n_v + hv] : 0.f;
  }
  __syncthreads();
  // S = Q K^T and O = Q h_c.
  smem_mma<wm::row_major, wm::col_major>(qs, L.ldk, ks, L.ldk, sf, L.lds, kChunk, kChunk, d_k, false);
  smem_mma<wm::row_major, wm::col_major>(qs, L.ldk, hs, L.ldk, of, L.ldo, kChunk, d_v, d_k, false);
  __syncthreads();
  for (int e = threadIdx.x; e < kChunk * kChunk; e += blockDim.x) {
    const int i = e / kChunk, j = e % kChunk;
    const float p = (j <= i && i < n) ? sf[i * L.lds + j] * expf(gam[i] - gam[j]) : 0.f;
    pb[i * L.ldp + j] = __float2bfloat16(p);
  }
  for (int e = threadIdx.x; e < kChunk * d_v; e += blockDim.x) {
    const int i = e / d_v, c = e % d_v;
    of[i * L.ldo + c] *= i < n ? expf(gam[i]) : 0.f;
  }
  __syncthreads();
  // O += P V_new.
  smem_mma<wm::row_major, wm::row_major>(pb, L.ldp, vs, L.ldv, of, L.ldo, kChunk, d_v, kChunk, true);
  __syncthreads();
  // Gated RMSNorm, one warp per row.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int in_dim = s.in_dim(), out_dim = s.out_dim();
  for (int i = warp; i < n; i += n_warps) {
    const float* o = of + i * L.ldo;
    bf16* y = out + (row0 + i) * out_dim + hv * d_v;
    if (wts.norm_w == nullptr) {
      for (int c = lane; c < d_v; c += 32) y[c] = __float2bfloat16(o[c]);
      continue;
    }
    float ss = 0.f;
    for (int c = lane; c < d_v; c += 32) ss += o[c] * o[c];
    ss = warp_sum(ss);
    const float r = rsqrtf(ss / d_v + s.norm_eps);
    const bf16* z = proj + (row0 + i) * in_dim + qkv_dim + hv * d_v;
    for (int c = lane; c < d_v; c += 32) {
      const float zf = __bfloat162float(z[c]);
      y[c] = __float2bfloat16(__bfloat162float(wts.norm_w[c]) * o[c] * r * (zf / (1.f + __expf(-zf))));
    }
  }
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
  DS_CHECK(s.n_k_heads > 0 && s.n_v_heads > 0, "gdn: n_k_heads (", s.n_k_heads,
           ") and n_v_heads (", s.n_v_heads, ") must be positive");
  DS_CHECK(s.n_v_heads % s.n_k_heads == 0, "gdn: n_v_heads (", s.n_v_heads,
           ") must be a multiple of n_k_heads (", s.n_k_heads, ")");
  DS_CHECK(ok_dim(s.d_k), "gdn: d_k (linear_key_head_dim) = ", s.d_k,
           " is not supported by the CUDA kernels (16, 32, 64 or 128)");
  DS_CHECK(ok_dim(s.d_v), "gdn: d_v (linear_value_head_dim) = ", s.d_v,
           " is not supported by the CUDA kernels (16, 32, 64 or 128)");
  DS_CHECK(s.conv_kernel == 4, "gdn: conv_kernel (linear_conv_kernel_dim) = ", s.conv_kernel,
           " is not supported (4 only)");
}

size_t gdn_prefill_workspace_bytes(const GdnShape& s, int max_tokens, int max_seqs) {
  return carve_workspace(s, max_tokens, max_seqs, nullptr).bytes;
}

void launch_gdn_conv_prep(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                          const bf16* proj, const int32_t* cu_seqlens, const int32_t* seq_pos,
                          const int32_t* slot_ids, int n_seqs, int n_tokens, bf16* qkv, float* g,
                          float* beta, cudaStream_t stream) {
  check_common(s, pool, n_seqs);
  if (n_tokens <= 0 || n_seqs <= 0) return;
  gdn_conv_prep_kernel<<<n_tokens, 256, 0, stream>>>(s, w, pool, proj, cu_seqlens, seq_pos,
                                                     slot_ids, n_seqs, qkv, g, beta);
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
                        size_t workspace_bytes, bf16* out, cudaStream_t stream) {
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
                                              ws.seq_chunk0);
  DS_CUDA_LAUNCH_CHECK();
  launch_gdn_conv_prep(s, w, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, n_tokens, ws.qkv,
                       ws.g, ws.beta, stream);
  launch_gdn_conv_state_update(s, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, stream);

  const WySmem wl = wy_smem(s.d_k, s.d_v);
  static_assert(sizeof(ChunkInfo) == 16);
  set_smem(gdn_wy_kernel, wl.total);
  gdn_wy_kernel<<<dim3(max_chunks, s.n_v_heads), 256, wl.total, stream>>>(
      s, ws.chunks, ws.qkv, ws.g, ws.beta, ws.w, ws.u);
  DS_CUDA_LAUNCH_CHECK();

  const int bv = s.d_v >= 32 ? 32 : s.d_v;
  const StateSmem sl = state_smem(s.d_k, bv);
  set_smem(gdn_state_kernel, sl.total);
  gdn_state_kernel<<<dim3(n_seqs, s.n_v_heads, s.d_v / bv), 128, sl.total, stream>>>(
      s, pool, bv, cu_seqlens, seq_pos, slot_ids, ws.seq_chunk0, ws.qkv, ws.g, ws.w, ws.u, ws.h);
  DS_CUDA_LAUNCH_CHECK();

  const OutSmem ol = out_smem(s.d_k, s.d_v);
  set_smem(gdn_output_kernel, ol.total);
  gdn_output_kernel<<<dim3(max_chunks, s.n_v_heads), 256, ol.total, stream>>>(
      s, w, ws.chunks, ws.seq_chunk0, proj, ws.qkv, ws.g, ws.u, ws.h, out);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
