// GDN prompt path, Hopper kernels for d_k = d_v = 128 used by the slice_scan variants of
// dispatch.cpp (gdn_prefill.cu runs them; the generic kernels stay the fallback):
//  - gdn_wy_mma_kernel: the WY stage (A, T = (I + A)^-1, W, U) with register-resident mma.sync
//    products instead of the generic kernel's shared-memory WMMA round trips; <true> (the
//    slice_scan variants, gdn_prefill_slice.cu) forms T's off-diagonal blocks on tf32 mma.sync and
//    scales T's columns instead of K's and V's rows (H200, 4096 tokens: 124 vs 178 us).
//  - gdn_conv_prep_multi_kernel: conv + SiLU + l2norm + gates, 8 tokens per block;
//    gdn_conv_prep_wide_kernel: the same with one warp per (head, 8 tokens) (slice_scan below 2048
//    tokens; 114 vs 104 us at 4096).
// Removed in issue 7 round 3 (never picked on sm_90 once the slice_scan variants existed; their
// numbers stay in git history and docs/perf): gdn_scan_kernel, the register-resident state pass +
// output + gated norm in one kernel per (sequence, head) or 2-CTA cluster (variants scan_mma,
// wymma_scan, wymma_scan_x2: 0.97 / ~0.84 / 0.89 ms per 4096-token layer vs 0.44 for
// slice_scan_ov): latency-bound at ~3300 instructions per warp per chunk.
// Shared memory: WY 72.8 KB, 3 per SM; with the late V load (the default) 55.8 KB, 4 per SM.
// Test: tests/cuda/cuda_gdn_test.cpp (every prefill case runs the generic path and each variant,
// forced for all lengths); bench: `deltaserve bench kernels --only gdn_prefill`.
#include "cuda/cuda_common.h"
#include "cuda/gdn_chunk.cuh"
#include "cuda/gdn_prefill_sm90.h"
#include "cuda/mma_util.cuh"

namespace ds::cuda {
namespace {

constexpr int kC = 64;   // chunk length
constexpr int kD = 128;  // d_k = d_v
constexpr int kLd =
    kD + 8;  // bf16 row stride of the [64][128] tiles: 272 B, ldmatrix conflict-free
static_assert(kC == gdn_tile::kC && kD == gdn_tile::kD && kLd == gdn_tile::kLd);

using gdn_tile::acc_a_times_tile;

// ---- conv + SiLU + l2norm + gates, several tokens per block
// -------------------------------------- The generic gdn_conv_prep_kernel (gdn_prefill.cu) runs one
// block per token and so re-reads the whole conv weight (80 KB at 27B shapes) from L2 for every
// token (~330 MB per 4096 tokens). Here a block takes kConvTokens consecutive tokens (any mix of
// sequences) and each warp keeps one head's conv weights in registers across them; same arithmetic
// as the generic kernel (fp32 conv, SiLU, rsqrt(sum x^2 + 1e-6) for q / k, q also times d_k^-0.5).
// d_k = d_v = 128 (lane = 4 channels), 8-byte aligned proj / ring rows, 16-byte aligned conv_w.
constexpr int kConvTokens = 8;

// Threads [0, n_here) of the block: token t_first + thread's 4 conv taps (positions p - 3 .. p of
// its sequence) as row pointers: this chunk's proj rows, the slot's conv ring rows (p % 4) for
// positions before the chunk, null (zero) before position 0.
__device__ __forceinline__ void fill_conv_taps(const bf16* (&taps)[kConvTokens][4],
                                               const GdnStatePool& pool, const bf16* proj,
                                               const int32_t* cu_seqlens, const int32_t* seq_pos,
                                               const int32_t* slot_ids, int n_seqs, int t_first,
                                               int n_here, int qkv_dim, int in_dim) {
  if (threadIdx.x >= n_here) return;
  const int t = t_first + threadIdx.x;
  const int seq = seq_of_token(cu_seqlens, n_seqs, t);
  const int start = cu_seqlens[seq], pos0 = seq_pos[seq], p = pos0 + (t - start);
  const bf16* ring = pool.conv_state + static_cast<int64_t>(slot_ids[seq]) * pool.conv_slot_stride;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int pp = p - 3 + j;
    taps[threadIdx.x][j] = pp >= pos0 ? proj + static_cast<int64_t>(t - 3 + j) * in_dim
                                      : (pp >= 0 ? ring + (pp & 3) * qkv_dim : nullptr);
  }
}

__global__ void __launch_bounds__(256)
    gdn_conv_prep_multi_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                               const bf16* __restrict__ proj,           // [n_tokens, in_dim]
                               const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                               const int32_t* __restrict__ seq_pos,     // [n_seqs]
                               const int32_t* __restrict__ slot_ids,    // [n_seqs]
                               int n_seqs, int n_tokens,
                               bf16* __restrict__ qkv,    // [n_tokens, qkv_dim]
                               float* __restrict__ g,     // [n_tokens, n_v_heads]
                               float* __restrict__ beta)  // [n_tokens, n_v_heads]
{
  __shared__ const bf16* taps[kConvTokens][4];  // per token: the rows of its 4 taps (null: zero)
  const int t_first = blockIdx.x * kConvTokens;
  const int n_here = min(kConvTokens, n_tokens - t_first);
  const int qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  fill_conv_taps(taps, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, t_first, n_here, qkv_dim,
                 in_dim);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int n_heads = 2 * s.n_k_heads + s.n_v_heads;
  const float q_scale = rsqrtf(static_cast<float>(kD));
  for (int hh = warp; hh < n_heads; hh += n_warps) {
    const bool is_v = hh >= 2 * s.n_k_heads;
    const int ch = hh * kD + 4 * lane;  // q, k and v heads are all 128 channels wide here
    float wt[16];                       // [4 channels][4 taps]
    load16_bf16(w.conv_w + ch * 4, wt);
    const float head_scale = hh < s.n_k_heads ? q_scale : 1.f;
#pragma unroll 2
    for (int tt = 0; tt < n_here; ++tt) {
      float vals[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bf16* row = taps[tt][j];
        float xv[4] = {0.f, 0.f, 0.f, 0.f};
        if (row != nullptr) load4_bf16(row + ch, xv);
#pragma unroll
        for (int i = 0; i < 4; ++i) vals[i] += wt[i * 4 + j] * xv[i];
      }
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        vals[i] = vals[i] / (1.f + __expf(-vals[i]));
        ss += vals[i] * vals[i];
      }
      float scale = 1.f;
      if (!is_v) scale = rsqrtf(warp_sum(ss) + 1e-6f) * head_scale;
      uint2 u;
      u.x = pack_bf16(vals[0] * scale, vals[1] * scale);
      u.y = pack_bf16(vals[2] * scale, vals[3] * scale);
      *reinterpret_cast<uint2*>(qkv + static_cast<int64_t>(t_first + tt) * qkv_dim + ch) = u;
    }
  }
  // Gates: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (threshold 20).
  for (int e = threadIdx.x; e < n_here * s.n_v_heads; e += blockDim.x) {
    const int tt = e / s.n_v_heads, h = e % s.n_v_heads;
    const int64_t t = t_first + tt;
    const bf16* b_in = proj + t * in_dim + qkv_dim + s.z_dim();
    const float b = __bfloat162float(b_in[h]);
    const float a = __bfloat162float(b_in[s.n_v_heads + h]) + w.dt_bias[h];
    beta[t * s.n_v_heads + h] = 1.f / (1.f + expf(-b));
    g[t * s.n_v_heads + h] = -expf(w.A_log[h]) * (a > 20.f ? a : log1pf(expf(a)));
  }
}

// The same conv + SiLU + l2norm + gates with one warp per (head, 8 tokens): grid (token groups,
// head groups of 8), so a 4096-token chunk runs 5120 blocks instead of 512, and each warp issues
// all 32 tap loads of its 8 tokens at once (one memory round trip) instead of walking 10 heads x 8
// tokens two at a time (gdn_conv_prep_multi_kernel is latency-bound that way: ~104 us at 4096
// tokens for ~170 MB). Same arithmetic in the same order.
__global__ void __launch_bounds__(256)
    gdn_conv_prep_wide_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                              const bf16* __restrict__ proj,           // [n_tokens, in_dim]
                              const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                              const int32_t* __restrict__ seq_pos,     // [n_seqs]
                              const int32_t* __restrict__ slot_ids,    // [n_seqs]
                              int n_seqs, int n_tokens,
                              bf16* __restrict__ qkv,    // [n_tokens, qkv_dim]
                              float* __restrict__ g,     // [n_tokens, n_v_heads]
                              float* __restrict__ beta)  // [n_tokens, n_v_heads]
{
  __shared__ const bf16* taps[kConvTokens][4];  // per token: the rows of its 4 taps (null: zero)
  const int t_first = blockIdx.x * kConvTokens;
  const int n_here = min(kConvTokens, n_tokens - t_first);
  const int qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  fill_conv_taps(taps, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, t_first, n_here, qkv_dim,
                 in_dim);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_heads = 2 * s.n_k_heads + s.n_v_heads;
  const int hh = blockIdx.y * 8 + warp;
  if (hh < n_heads) {
    const bool is_v = hh >= 2 * s.n_k_heads;
    const int ch = hh * kD + 4 * lane;  // q, k and v heads are all 128 channels wide here
    uint2 raw[kConvTokens][4];          // the 4 taps' inputs of each token (zero: no tap)
#pragma unroll
    for (int tt = 0; tt < kConvTokens; ++tt) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bf16* row = tt < n_here ? taps[tt][j] : nullptr;
        raw[tt][j] = row != nullptr ? *reinterpret_cast<const uint2*>(row + ch) : make_uint2(0, 0);
      }
    }
    float wt[16];  // [4 channels][4 taps]
    load16_bf16(w.conv_w + ch * 4, wt);
    const float head_scale = hh < s.n_k_heads ? rsqrtf(static_cast<float>(kD)) : 1.f;
#pragma unroll
    for (int tt = 0; tt < kConvTokens; ++tt) {
      float vals[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float xv[4];
        load4_bf16(reinterpret_cast<const bf16*>(&raw[tt][j]), xv);
#pragma unroll
        for (int i = 0; i < 4; ++i) vals[i] += wt[i * 4 + j] * xv[i];
      }
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        vals[i] = vals[i] / (1.f + __expf(-vals[i]));
        ss += vals[i] * vals[i];
      }
      float scale = 1.f;
      if (!is_v) scale = rsqrtf(warp_sum(ss) + 1e-6f) * head_scale;
      if (tt < n_here) {
        uint2 u;
        u.x = pack_bf16(vals[0] * scale, vals[1] * scale);
        u.y = pack_bf16(vals[2] * scale, vals[3] * scale);
        *reinterpret_cast<uint2*>(qkv + static_cast<int64_t>(t_first + tt) * qkv_dim + ch) = u;
      }
    }
  }
  if (blockIdx.y != 0) return;
  // Gates (the first head group's blocks): beta = sigmoid(b), g = -exp(A_log) softplus(a +
  // dt_bias) (threshold 20).
  for (int e = threadIdx.x; e < n_here * s.n_v_heads; e += blockDim.x) {
    const int tt = e / s.n_v_heads, h = e % s.n_v_heads;
    const int64_t t = t_first + tt;
    const bf16* b_in = proj + t * in_dim + qkv_dim + s.z_dim();
    const float b = __bfloat162float(b_in[h]);
    const float a = __bfloat162float(b_in[s.n_v_heads + h]) + w.dt_bias[h];
    beta[t * s.n_v_heads + h] = 1.f / (1.f + expf(-b));
    g[t * s.n_v_heads + h] = -expf(w.A_log[h]) * (a > 20.f ? a : log1pf(expf(a)));
  }
}

// ---- WY representation per (chunk, value head), register-resident products ----------------------
// Same maths and precision as gdn_prefill.cu's gdn_wy_kernel (FLA's): gamma = cumsum(g);
// A = strictly-lower(beta_i e^(gamma_i - gamma_j) k_i.k_j) (fp32); T = (I + A)^-1 (fp32: 16x16
// diagonal blocks by forward substitution, off-diagonal blocks T_ij = -T_ii sum_k A_ik T_kj);
// W = T (beta e^gamma K), U = T (beta V) with bf16 operands, fp32 accumulate, stored bf16.
// 4 warps, warp w owning rows [16 w, 16 w + 16): K K^T and W / U are mma.sync products kept in
// registers (no shared-memory round trips), T's A fragments are read straight from the fp32 T.
// Shared memory 74.5 KB: three blocks per SM.
struct WyCfg {
  static constexpr int kThreads = 128;
  static constexpr int kLda = kC + 4;  // fp32 A [64][68]
  static constexpr int kLdt = kC + 8;  // fp32 T [64][72]: conflict-free float2 fragment reads
  static constexpr size_t kK = 0;
  static constexpr size_t kV = kK + sizeof(bf16) * kC * kLd;
  static constexpr size_t kA = kV + sizeof(bf16) * kC * kLd;
  static constexpr size_t kT = kA + sizeof(float) * kC * kLda;
  static constexpr size_t kX = kT + sizeof(float) * kC * kLdt;  // [3][256] products in a round
  static constexpr size_t kGam = kX + sizeof(float) * 3 * 256;
  static constexpr size_t kBet = kGam + sizeof(float) * kC;
  static constexpr size_t kEg = kBet + sizeof(float) * kC;
  static constexpr size_t kTotal = kEg + sizeof(float) * kC;
  // LATE_V: V is loaded once T is complete, into A's space (A is dead by then), so V's own
  // space is not allocated and every later offset moves down by it: 55.75 KB, 4 blocks per SM
  // instead of 3 (72.75 KB).
  static constexpr size_t kLateShift = sizeof(bf16) * kC * kLd;
  static constexpr size_t kTotalLate = kTotal - kLateShift;
  static_assert(sizeof(float) * kC * kLda >= sizeof(bf16) * kC * kLd, "V fits in A's space");
};

// tf32 operands (round to nearest) and mma.sync m16n8k8 with fp32 accumulators: a (16x8 row) =
// {(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)}, b (8x8 col) = {(k t, n g), (k t + 4, n g)}, c
// as the bf16 m16n8 layout (lane = 4 g + t).
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The tf32 A fragment of the 16x8 block at p (fp32, row stride ld) for this lane (g, t).
__device__ __forceinline__ void load_a_tf32(uint32_t (&a)[4], const float* p, int ld, int g,
                                            int t) {
  a[0] = to_tf32(p[g * ld + t]);
  a[1] = to_tf32(p[(g + 8) * ld + t]);
  a[2] = to_tf32(p[g * ld + t + 4]);
  a[3] = to_tf32(p[(g + 8) * ld + t + 4]);
}

// The balanced split of a chunk's lower-triangular 8-row tiles (8 x 8 of them, tiles up to the
// diagonal of each 16-row block) over the 4 warps, 5 tiles each: f(row block, first tile, end)
// for this warp's runs (warp 0: block 0 tiles 0-1 and block 3 tiles 0-2; warp 1: block 1 tiles 0-3
// and block 2 tile 0; warp 2: block 2 tiles 1-5; warp 3: block 3 tiles 3-7).
template <typename F>
__device__ __forceinline__ void balanced_tiles(int warp, F&& f) {
  if (warp == 0) {
    f(0, 0, 2);
    f(3, 0, 3);
  } else if (warp == 1) {
    f(1, 0, 4);
    f(2, 0, 1);
  } else if (warp == 2) {
    f(2, 1, 6);
  } else {
    f(3, 3, 8);
  }
}

// Tiles [jlo, jhi) (at most 5) of row block r of X K^T on mma.sync, fp32: the A operand from the
// [64][kLd] bf16 rows of x (K: A's products), B from K's rows; k-steps in order.
__device__ __forceinline__ void row_block_tiles(const bf16* x, const bf16* ks, int r, int jlo,
                                                int jhi, int lane, float (&acc)[5][4]) {
#pragma unroll
  for (int jt = 0; jt < 5; ++jt) acc[jt][0] = acc[jt][1] = acc[jt][2] = acc[jt][3] = 0.f;
#pragma unroll
  for (int kstep = 0; kstep < kD / 16; ++kstep) {
    uint32_t a[4];
    ldsm_x4(a, x + (16 * r + (lane & 15)) * kLd + 16 * kstep + (lane >> 4) * 8);
#pragma unroll
    for (int jt = 0; jt < 5; ++jt) {
      if (jlo + jt < jhi) {
        uint32_t bb[2];
        ldsm_x2(bb, ks + (8 * (jlo + jt) + (lane & 7)) * kLd + 16 * kstep + ((lane >> 3) & 1) * 8);
        mma_bf16(acc[jt], a, bb[0], bb[1]);
      }
    }
  }
}

// TF32_OFFDIAG: the off-diagonal blocks of T per column block on tf32 mma.sync, warp j owning
// column block j (no block barriers between the distances), and the beta e^gamma / beta scales
// applied to T's columns instead of K's and V's rows (used by the slice_scan variants); else the
// three SIMT rounds and the in-place scaling (the shipped wymma variants, unchanged).
//
// BALANCED (with TF32_OFFDIAG): the same products, each computed the same way, spread evenly over
// the 4 warps instead of by row block (warp w: row block w of A, 2w + 2 tiles; column block w of
// T's off-diagonal, 3 - w rounds; row block w of W and U, w + 1 k-steps: 4x, 6x and 4x more work
// on the busiest warp than on the idlest, which ncu saw as 26% of the samples waiting at block
// barriers). A: warp 0 rows 0 tiles 0-1 + rows 3 tiles 0-2, warp 1 rows 1 tiles 0-3 + rows 2
// tile 0, warp 2 rows 2 tiles 1-5, warp 3 rows 3 tiles 3-7 (5 tiles each; every warp still forms
// its own diagonal tiles). T's off-diagonal: the two 8-column halves of a column block are
// independent all the way down (X's columns need only T's same columns, T_ii X's only X's), so
// warps 0 / 3 take the halves of column 0 and warps 1 / 2 those of columns 1 then 2. W / U: warp
// w computes matrix w / 2 (W, U) for row blocks {0, 3} (w even) or {1, 2} (w odd). Every output
// element comes from the same mma instructions on the same operands in the same order:
// bit-identical to the unbalanced kernel (tested: CudaGdn.WyBalancedBitExact).
//
// LATE_V (with BALANCED): the smaller layout of WyCfg (kTotalLate). Warps 2 and 3 load V once T
// is complete, while warps 0 and 1 form W; the same products on the same values: bit-identical.
// The kernel is latency-bound (ncu: 28% issue, waits on shared memory and barriers), so the 4th
// block per SM pays: H200, 4096 tokens, 94.9 vs 105.0 us (docs/perf/gdn_prefill.md, session 20).
//
// TIMED (with LATE_V; launch_gdn_wy_mma_timed, tests only): the same kernel writing
// kGdnWyStamps phase stamps per block to g_wy_stamps (%clock64 of thread 0 at entry, after the
// loads, after A and T's diagonal blocks, after T complete; each warp's lane 0 at its end, i.e.
// once its last W / U store is issued; %globaltimer of thread 0 at entry and end, to convert
// cycles to time). The stamps add no barrier and change no value: bit-identical outputs.
__device__ unsigned long long* g_wy_stamps;

template <bool TF32_OFFDIAG, bool BALANCED = false, bool LATE_V = false, bool TIMED = false>
__global__ void __launch_bounds__(WyCfg::kThreads) gdn_wy_mma_kernel(
    GdnShape s,
    const int4* __restrict__ chunks,  // [max_chunks] {seq (-1: none), t0, n, index}
    const bf16* __restrict__ qkv,     // [n_tokens, qkv_dim]
    float* __restrict__ g,            // [n_tokens, n_v] in: g, out: gamma
    const float* __restrict__ beta,   // [n_tokens, n_v]
    bf16* __restrict__ w_out,         // [n_tokens, n_v, 128]
    bf16* __restrict__ u_out)         // [n_tokens, n_v, 128]
{
  using L = WyCfg;
  const int4 ci = chunks[blockIdx.x];
  if (ci.x < 0) return;
  const int n = ci.z;
  const int64_t row0 = ci.y;
  const int hv = blockIdx.y, n_v = s.n_v_heads, hk = hv / (n_v / s.n_k_heads);
  const int qkv_dim = s.qkv_dim();
  static_assert(!LATE_V || BALANCED, "the late V load needs the balanced split");
  constexpr size_t sh = LATE_V ? L::kLateShift : 0;  // V's own space, absent with LATE_V
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* ks = reinterpret_cast<bf16*>(smem + L::kK);  // [64][kLd] K, then beta e^gamma K
  // [64][kLd] V, then beta V (LATE_V: in A's space, once T is complete)
  bf16* vs = reinterpret_cast<bf16*>(smem + (LATE_V ? L::kA - sh : L::kV));
  float* af = reinterpret_cast<float*>(smem + L::kA - sh);  // [64][kLda]
  float* tf = reinterpret_cast<float*>(smem + L::kT - sh);  // [64][kLdt]
  float* xs = reinterpret_cast<float*>(smem + L::kX - sh);
  float* gam = reinterpret_cast<float*>(smem + L::kGam - sh);
  float* bet = reinterpret_cast<float*>(smem + L::kBet - sh);
  float* eg = reinterpret_cast<float*>(smem + L::kEg - sh);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, c = lane & 3;
  static_assert(!TIMED || LATE_V, "the timed build is the shipped (late V) one");
  [[maybe_unused]] unsigned long long* stamp = nullptr;
  if constexpr (TIMED) {
    stamp = g_wy_stamps + (size_t(blockIdx.y) * gridDim.x + blockIdx.x) * kGdnWyStamps;
    if (tid == 0) {
      stamp[8] = globaltimer_ns();
      stamp[0] = clock64();
    }
  }

  for (int e = tid; e < kC * (kD / 8); e += L::kThreads) {
    const int r = e / (kD / 8), col = (e % (kD / 8)) * 8;
    const bool ok = r < n;
    const bf16* row = qkv + (row0 + (ok ? r : 0)) * qkv_dim;
    cp_async16(ks + r * kLd + col, row + (s.n_k_heads + hk) * kD + col, ok);
    if constexpr (!LATE_V)
      cp_async16(vs + r * kLd + col, row + 2 * s.n_k_heads * kD + hv * kD + col, ok);
  }
  cp_async_commit();
  if (warp == 0) {
    stage_chunk_gates(g, beta, row0, n, n_v, hv, lane, gam, bet, eg);  // gamma, beta, beta e^gamma
  }
  cp_async_wait_all();
  __syncthreads();
  if constexpr (TIMED)
    if (tid == 0) stamp[1] = clock64();

  // ---- A, row block w (columns up to the diagonal block) from K K^T in registers.
  if constexpr (BALANCED) {
    static_assert(TF32_OFFDIAG, "the balanced split needs the tf32 off-diagonal");
    // Tiles [jlo, jhi) of row block r (at most 5).
    auto a_tiles = [&](int r, int jlo, int jhi) {
      float kk[5][4];
      row_block_tiles(ks, ks, r, jlo, jhi, lane, kk);
#pragma unroll
      for (int jt = 0; jt < 5; ++jt) {
        if (jlo + jt < jhi) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int i = 16 * r + gq + 8 * half, j = 8 * (jlo + jt) + 2 * c;
            const float bi = bet[i], gi = gam[i];
            float2 v;
            v.x = i > j ? bi * kk[jt][2 * half] * __expf(gi - gam[j]) : 0.f;
            v.y = i > j + 1 ? bi * kk[jt][2 * half + 1] * __expf(gi - gam[j + 1]) : 0.f;
            *reinterpret_cast<float2*>(af + i * L::kLda + j) = v;
          }
        }
      }
    };
    balanced_tiles(warp, a_tiles);
  } else {
    float kk[8][4];
#pragma unroll
    for (int jt = 0; jt < 8; ++jt) kk[jt][0] = kk[jt][1] = kk[jt][2] = kk[jt][3] = 0.f;
#pragma unroll
    for (int kstep = 0; kstep < kD / 16; ++kstep) {
      uint32_t a[4];
      ldsm_x4(a, ks + (16 * warp + (lane & 15)) * kLd + 16 * kstep + (lane >> 4) * 8);
#pragma unroll
      for (int jt = 0; jt < 8; ++jt) {
        if (jt <= 2 * warp + 1) {
          uint32_t bb[2];
          ldsm_x2(bb, ks + (8 * jt + (lane & 7)) * kLd + 16 * kstep + ((lane >> 3) & 1) * 8);
          mma_bf16(kk[jt], a, bb[0], bb[1]);
        }
      }
    }
#pragma unroll
    for (int jt = 0; jt < 8; ++jt) {
      if (jt <= 2 * warp + 1) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = 16 * warp + gq + 8 * half, j = 8 * jt + 2 * c;
          const float bi = bet[i], gi = gam[i];
          float2 v;
          v.x = i > j ? bi * kk[jt][2 * half] * __expf(gi - gam[j]) : 0.f;
          v.y = i > j + 1 ? bi * kk[jt][2 * half + 1] * __expf(gi - gam[j + 1]) : 0.f;
          *reinterpret_cast<float2*>(af + i * L::kLda + j) = v;
        }
      }
    }
  }
  __syncwarp();
  // ---- Diagonal block w of T = (I + A)^-1 by forward substitution: lane j < 16 owns column j.
  if (lane < 16) {
    const int b0 = 16 * warp, j = lane;
    float col[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < i; ++k) acc += af[(b0 + i) * L::kLda + b0 + k] * col[k];
      col[i] = i == j ? 1.f : (i < j ? 0.f : -acc);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) tf[(b0 + i) * L::kLdt + b0 + j] = col[i];
  }
  __syncthreads();  // A and the diagonal of T complete; nobody reads raw K or V any more
  if constexpr (TIMED)
    if (tid == 0) stamp[2] = clock64();
  // beta e^gamma K and beta V, in place (bf16). TF32_OFFDIAG scales T's columns instead when it
  // forms the A fragments below (W = (T diag(beta e^gamma)) K, U = (T diag(beta)) V): no pass
  // over the 32 KB of K and V.
  if constexpr (!TF32_OFFDIAG) {
    for (int e = tid; e < kC * kD / 2; e += L::kThreads) {
      const int i = e / (kD / 2), col = (e % (kD / 2)) * 2;
      __nv_bfloat162* k2 = reinterpret_cast<__nv_bfloat162*>(ks + i * kLd + col);
      __nv_bfloat162* v2 = reinterpret_cast<__nv_bfloat162*>(vs + i * kLd + col);
      const float ek = eg[i], bv = bet[i];
      *k2 = __floats2bfloat162_rn(__low2float(*k2) * ek, __high2float(*k2) * ek);
      *v2 = __floats2bfloat162_rn(__low2float(*v2) * bv, __high2float(*v2) * bv);
    }
  }
  if constexpr (BALANCED) {
    // ---- Off-diagonal, columns [16 jb + 8 nt, +8) of column block jb per warp (see above):
    // the unbalanced branch below restricted to one n-tile, scratch [16][8] per warp.
    const int nt = warp == 0 || warp == 1 ? 0 : 1;
    float* xw = xs + 128 * warp;  // [16][8]
    for (int jb = warp == 0 || warp == 3 ? 0 : 1; jb < (warp == 0 || warp == 3 ? 1 : 3); ++jb) {
      for (int ib = jb + 1; ib < 4; ++ib) {
        float x[4] = {};
        for (int k0 = 16 * jb; k0 < 16 * ib; k0 += 8) {
          uint32_t a[4];
          load_a_tf32(a, af + 16 * ib * L::kLda + k0, L::kLda, gq, c);
          const float* b = tf + (k0 + c) * L::kLdt + 16 * jb + 8 * nt + gq;
          mma_tf32(x, a, to_tf32(b[0]), to_tf32(b[4 * L::kLdt]));
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float* d = xw + (gq + 8 * half) * 8 + 2 * c;
          d[0] = x[2 * half];
          d[1] = x[2 * half + 1];
        }
        __syncwarp();
        float y[4] = {};
#pragma unroll
        for (int k0 = 0; k0 < 16; k0 += 8) {
          uint32_t a[4];
          load_a_tf32(a, tf + 16 * ib * L::kLdt + 16 * ib + k0, L::kLdt, gq, c);
          const float* b = xw + (k0 + c) * 8 + gq;
          mma_tf32(y, a, to_tf32(b[0]), to_tf32(b[4 * 8]));
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float* d = tf + (16 * ib + gq + 8 * half) * L::kLdt + 16 * jb + 8 * nt + 2 * c;
          d[0] = -y[2 * half];
          d[1] = -y[2 * half + 1];
        }
        __syncwarp();  // T_ib,jb's columns visible to the next row's products; scratch free
      }
    }
    __syncthreads();  // all of T complete
    if constexpr (TIMED)
      if (tid == 0) stamp[3] = clock64();
    if constexpr (LATE_V) {
      // A is dead: warps 2 and 3 (U below) load V into its space while warps 0 and 1 form W.
      if (warp >= 2) {
        for (int e = tid - 64; e < kC * (kD / 8); e += 64) {
          const int r = e / (kD / 8), col = (e % (kD / 8)) * 8;
          const bool ok = r < n;
          const bf16* row = qkv + (row0 + (ok ? r : 0)) * qkv_dim;
          cp_async16(vs + r * kLd + col, row + 2 * s.n_k_heads * kD + hv * kD + col, ok);
        }
        cp_async_commit();
        cp_async_wait_all();
        asm volatile("bar.sync 1, 64;\n" ::: "memory");  // warps 2 and 3
      }
    }
  } else if constexpr (TF32_OFFDIAG) {
    // ---- Column block jb = warp, rows ib = jb + 1 .. 3 in order: X = sum_{k=jb}^{ib-1} A_ik T_kj
    // (tf32 mma, fp32 accumulate), T_ij = -T_ii X (X through this warp's 16x16 scratch). T is
    // stored bf16 for the W / U products afterwards, so tf32 here costs nothing measurable.
    const int jb = warp;
    float* xw = xs + 256 * (warp < 3 ? warp : 0);  // [16][16]; warp 3 has no off-diagonal block
    for (int ib = jb + 1; ib < 4; ++ib) {
      float x[2][4] = {};
      for (int k0 = 16 * jb; k0 < 16 * ib; k0 += 8) {
        uint32_t a[4];
        load_a_tf32(a, af + 16 * ib * L::kLda + k0, L::kLda, gq, c);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* b = tf + (k0 + c) * L::kLdt + 16 * jb + 8 * nt + gq;
          mma_tf32(x[nt], a, to_tf32(b[0]), to_tf32(b[4 * L::kLdt]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float* d = xw + (gq + 8 * half) * 16 + 8 * nt + 2 * c;
          d[0] = x[nt][2 * half];
          d[1] = x[nt][2 * half + 1];
        }
      }
      __syncwarp();
      float y[2][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < 16; k0 += 8) {
        uint32_t a[4];
        load_a_tf32(a, tf + 16 * ib * L::kLdt + 16 * ib + k0, L::kLdt, gq, c);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* b = xw + (k0 + c) * 16 + 8 * nt + gq;
          mma_tf32(y[nt], a, to_tf32(b[0]), to_tf32(b[4 * 16]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float* d = tf + (16 * ib + gq + 8 * half) * L::kLdt + 16 * jb + 8 * nt + 2 * c;
          d[0] = -y[nt][2 * half];
          d[1] = -y[nt][2 * half + 1];
        }
      }
      __syncwarp();  // T_ib,jb visible to the next row's products; the scratch is free again
    }
    __syncthreads();  // all of T complete (and Kb, Vb)
  } else {
    // ---- Off-diagonal blocks by distance: T_ij = -T_ii * sum_{k=j}^{i-1} A_ik T_kj (i = j + d).
    for (int dist = 1; dist < 4; ++dist) {
      const int nb = 4 - dist;
      for (int e = tid; e < nb * 256; e += L::kThreads) {
        const int jb = e / 256, r = (e % 256) / 16, cc = e % 16, ib = jb + dist;
        float acc = 0.f;
        for (int k = jb * 16; k < ib * 16; ++k)
          acc += af[(ib * 16 + r) * L::kLda + k] * tf[k * L::kLdt + jb * 16 + cc];
        xs[e] = acc;
      }
      __syncthreads();
      for (int e = tid; e < nb * 256; e += L::kThreads) {
        const int jb = e / 256, r = (e % 256) / 16, cc = e % 16, ib = jb + dist;
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < 16; ++k)
          acc += tf[(ib * 16 + r) * L::kLdt + ib * 16 + k] * xs[jb * 256 + k * 16 + cc];
        tf[(ib * 16 + r) * L::kLdt + jb * 16 + cc] = -acc;
      }
      __syncthreads();
    }
  }
  // ---- W = T Kb, U = T Vb for rows [16 w, 16 w + 16): k-steps ks <= w (T lower triangular).
  // T's rows as bf16 A fragments, columns j times col_scale[j] (TF32_OFFDIAG) or not.
  auto t_fragments = [&](const float* col_scale, uint32_t(&ta)[4][4], int rb) {
#pragma unroll
    for (int kstep = 0; kstep < 4; ++kstep) {
      const int j0 = 16 * kstep + 2 * c;
      const float* t0 = tf + (16 * rb + gq) * L::kLdt + j0;
      const float2 x0 = *reinterpret_cast<const float2*>(t0);
      const float2 x1 = *reinterpret_cast<const float2*>(t0 + 8 * L::kLdt);
      const float2 x2 = *reinterpret_cast<const float2*>(t0 + 8);
      const float2 x3 = *reinterpret_cast<const float2*>(t0 + 8 * L::kLdt + 8);
      float s0 = 1.f, s1 = 1.f, s8 = 1.f, s9 = 1.f;
      if (col_scale != nullptr) {
        s0 = col_scale[j0], s1 = col_scale[j0 + 1], s8 = col_scale[j0 + 8];
        s9 = col_scale[j0 + 9];
      }
      ta[kstep][0] = pack_bf16(x0.x * s0, x0.y * s1);
      ta[kstep][1] = pack_bf16(x1.x * s0, x1.y * s1);
      ta[kstep][2] = pack_bf16(x2.x * s8, x2.y * s9);
      ta[kstep][3] = pack_bf16(x3.x * s8, x3.y * s9);
    }
  };
  // Unbalanced: W then U for row block `warp`. BALANCED: matrix warp / 2 (W, U) for row blocks
  // {0, 3} (even warps) or {1, 2} (odd warps).
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int which = BALANCED ? warp >> 1 : it;
    const int rb = BALANCED ? ((warp & 1) ? 1 + it : 3 * it) : warp;
    const bf16* src = which == 0 ? ks : vs;
    bf16* dst = which == 0 ? w_out : u_out;
    uint32_t ta[4][4];
    t_fragments(TF32_OFFDIAG ? (which == 0 ? eg : bet) : nullptr, ta, rb);
    float acc[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    acc_a_times_tile(ta, src, lane, rb, acc);  // T is lower triangular: k-steps <= rb
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = 16 * rb + gq + 8 * half;
      if (i < n) {
        bf16* d = dst + ((row0 + i) * n_v + hv) * kD + 2 * c;
#pragma unroll
        for (int j = 0; j < 16; ++j)
          *reinterpret_cast<uint32_t*>(d + 8 * j) =
              pack_bf16(acc[j][2 * half], acc[j][2 * half + 1]);
      }
    }
  }
  if constexpr (TIMED) {
    if (lane == 0) stamp[4 + warp] = clock64();
    if (tid == 0) stamp[9] = globaltimer_ns();
  }
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

bool gdn_scan_supported(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                        const bf16* proj, const bf16* out) {
  (void)w;
  return s.d_k == kD && s.d_v == kD && s.in_dim() % 4 == 0 && aligned(proj, 8) && aligned(out, 8) &&
         aligned(pool.rec_state, 8) && pool.rec_slot_stride % 2 == 0;
}

bool gdn_conv_prep_multi_supported(const GdnShape& s, const GdnLayerWeights& w,
                                   const GdnStatePool& pool, const bf16* proj) {
  return s.d_k == kD && s.d_v == kD && s.in_dim() % 4 == 0 && pool.conv_slot_stride % 4 == 0 &&
         aligned(proj, 8) && aligned(pool.conv_state, 8) && aligned(w.conv_w, 16);
}

void launch_gdn_conv_prep_multi(const GdnShape& s, const GdnLayerWeights& w,
                                const GdnStatePool& pool, const bf16* proj,
                                const int32_t* cu_seqlens, const int32_t* seq_pos,
                                const int32_t* slot_ids, int n_seqs, int n_tokens, bf16* qkv,
                                float* g, float* beta, cudaStream_t stream) {
  DS_CHECK(gdn_conv_prep_multi_supported(s, w, pool, proj),
           "gdn conv prep: shape / alignment not supported (d_k = d_v = 128 only)");
  if (n_tokens <= 0 || n_seqs <= 0) return;
  gdn_conv_prep_multi_kernel<<<(n_tokens + kConvTokens - 1) / kConvTokens, 256, 0, stream>>>(
      s, w, pool, proj, cu_seqlens, seq_pos, slot_ids, n_seqs, n_tokens, qkv, g, beta);
  DS_CUDA_LAUNCH_CHECK();
}

void launch_gdn_conv_prep_wide(const GdnShape& s, const GdnLayerWeights& w,
                               const GdnStatePool& pool, const bf16* proj,
                               const int32_t* cu_seqlens, const int32_t* seq_pos,
                               const int32_t* slot_ids, int n_seqs, int n_tokens, bf16* qkv,
                               float* g, float* beta, cudaStream_t stream) {
  DS_CHECK(gdn_conv_prep_multi_supported(s, w, pool, proj),
           "gdn conv prep: shape / alignment not supported (d_k = d_v = 128 only)");
  if (n_tokens <= 0 || n_seqs <= 0) return;
  const int n_heads = 2 * s.n_k_heads + s.n_v_heads;
  const dim3 grid((n_tokens + kConvTokens - 1) / kConvTokens, (n_heads + 7) / 8);
  gdn_conv_prep_wide_kernel<<<grid, 256, 0, stream>>>(s, w, pool, proj, cu_seqlens, seq_pos,
                                                      slot_ids, n_seqs, n_tokens, qkv, g, beta);
  DS_CUDA_LAUNCH_CHECK();
}

void launch_gdn_wy_mma_timed(const GdnShape& s, const int4* chunks, int max_chunks,
                             const bf16* qkv, float* g, const float* beta, bf16* w_mat,
                             bf16* u_mat, unsigned long long* stamps, cudaStream_t stream) {
  DS_CHECK(s.d_k == kD && s.d_v == kD, "gdn wy mma: d_k = d_v = 128 only");
  DS_CHECK(aligned(qkv, 16) && aligned(w_mat, 4) && aligned(u_mat, 4) && s.qkv_dim() % 8 == 0,
           "gdn wy mma: qkv rows must be 16-byte aligned");
  DS_CHECK(stamps != nullptr && aligned(stamps, 8), "gdn wy mma timed: stamps buffer needed");
  if (max_chunks <= 0) return;
  auto kernel = gdn_wy_mma_kernel<true, true, true, true>;
  DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(WyCfg::kTotalLate)));
  DS_CUDA_CHECK(cudaMemcpyToSymbolAsync(g_wy_stamps, &stamps, sizeof(stamps), 0,
                                        cudaMemcpyHostToDevice, stream));
  kernel<<<dim3(max_chunks, s.n_v_heads), WyCfg::kThreads, WyCfg::kTotalLate, stream>>>(
      s, chunks, qkv, g, beta, w_mat, u_mat);
  DS_CUDA_LAUNCH_CHECK();
}

bool gdn_wy_mma_balanced() {
  static const bool on = env_switch("DS_GDN_WY_BALANCED", true);
  return on;
}

bool gdn_wy_mma_late_v() {
  static const bool on = env_switch("DS_GDN_WY_LATE_V", true);
  return on;
}

void launch_gdn_wy_mma(const GdnShape& s, const int4* chunks, int max_chunks, const bf16* qkv,
                       float* g, const float* beta, bf16* w_mat, bf16* u_mat, cudaStream_t stream,
                       bool tf32_offdiag, int balanced) {
  DS_CHECK(s.d_k == kD && s.d_v == kD, "gdn wy mma: d_k = d_v = 128 only");
  DS_CHECK(aligned(qkv, 16) && aligned(w_mat, 4) && aligned(u_mat, 4) && s.qkv_dim() % 8 == 0,
           "gdn wy mma: qkv rows must be 16-byte aligned");
  if (max_chunks <= 0) return;
  auto run = [&](auto kernel, size_t smem = WyCfg::kTotal) {
    DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    kernel<<<dim3(max_chunks, s.n_v_heads), WyCfg::kThreads, smem, stream>>>(
        s, chunks, qkv, g, beta, w_mat, u_mat);
    DS_CUDA_LAUNCH_CHECK();
  };
  DS_CHECK(balanced <= 2, "gdn wy mma: balanced must be -1, 0, 1 or 2 (got ", balanced, ")");
  if (balanced < 0) balanced = gdn_wy_mma_balanced() ? (gdn_wy_mma_late_v() ? 2 : 1) : 0;
  if (tf32_offdiag && balanced == 2)
    run(gdn_wy_mma_kernel<true, true, true>, WyCfg::kTotalLate);
  else if (tf32_offdiag && balanced)
    run(gdn_wy_mma_kernel<true, true>);
  else if (tf32_offdiag)
    run(gdn_wy_mma_kernel<true>);
  else
    run(gdn_wy_mma_kernel<false>);
}

}  // namespace ds::cuda
