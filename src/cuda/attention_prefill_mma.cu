// Prompt attention for head_dim 256 over the paged KV cache, FlashAttention-2/3 style with every
// running quantity in registers: the specialised attn_prefill variants (dispatch.cpp) behind
// launch_attention_prefill. Same maths and contract as the generic kernel (attention_prefill.cu):
// causal softmax(q k^T / 16) v, bottom-right aligned against the tokens already in the cache
// (query j of a q_len chunk sits at kv_len - q_len + j), GQA, output times sigmoid(gate), several
// sequences of different lengths per launch (AttnBatch).
//
// Work layout (all variants): one block per (row tile of 128 rows, kv head, sequence); the rows of
// a tile are (query token, query head of the GQA group) pairs, row = token * group + head, so one
// K/V tile in shared memory serves every query head that reads it (6 for Qwen3.5-27B). 64 keys
// per step = exactly one page run of one kv head when page_size % 64 == 0 (a contiguous [64, 256]
// bf16 block, the only paging requirement). 2 consumer warpgroups x 64 rows; S = Q K^T by wgmma
// m64n64k16 (Q and K in shared memory), O += P V by wgmma m64n256k16 (P in registers, V MN-major in
// shared memory); tiles in the 128-byte-swizzled wgmma layout. Online softmax in fp32 (exp2
// domain): each thread owns 2 rows x 16 keys, row max / sum over the 4 lanes of a quad; the causal
// mask is applied only on tiles that reach past the tile's first query. P (bf16) is the S
// accumulators re-packed as the A operand of P V (no shared-memory round trip); O [rows, 256]
// stays in fp32 registers (128 per thread). The heaviest (last) tiles of the causal triangle start
// first.
//
// Variants (H200, bench kernels, 27B shapes; generic kernel 21-34 TFLOP/s):
//   wgmma_ws / wgmma_ws3  (the lean forms' fallbacks; wgmma_ws3 from 512-token chunks against
//               >= 8K keys)
//               warp-specialised: 3 warpgroups; a producer thread copies whole K / V tiles with
//               TMA (cp.async.bulk.tensor, 128-byte swizzle = the wgmma layout) into 2 (ws) or 3
//               (ws3) K stages and 2 V stages guarded by full / empty mbarriers and gives its
//               registers away (setmaxnreg 24 / 240); two consumer warpgroups of 64 rows never
//               meet at a block barrier, and each issues S(j) = Q K(j)^T before P(j-1) V(j-1) and
//               runs the softmax of tile j while P V is on the tensor cores. Whole tiles are
//               copied: K rows past the last needed key are masked, V rows there are zeroed in
//               shared memory before the last P V. The epilogue writes bf16 pairs straight from the
//               accumulators. Bit-identical to wgmma_m128 (same instructions in the same order).
//               Grid (n_kv, tiles, seqs): the heaviest row tiles of every kv head start first.
//               Two runs: 4096-token chunks 451 TFLOP/s with nothing cached, 600-672 against
//               8K-32K cached; 3072: 376-383 / 578-610; 512: 91 / 460-542; 16K causal 558-631;
//               4-21-token chunks against 2K-32K cached 1.3-1.5x faster than the mma.sync kernel
//               that used to run them (e.g. 16 after 8192: 209 vs 310 us). 1.2-1.7x wgmma_m128.
//   wgmma_ws_lean / wgmma_ws3_lean  (session 22; the default picks since session 24's
//               measurement: faster on 17 of 18 benched shapes, 16K causal 550 -> 599 TFLOP/s,
//               the 32K prompt -1.6%; the plain forms above are their fallbacks; since session 25
//               wgmma_ws_lean takes every hd-256 shape: 16K causal 605-621 vs 595-602
//               TFLOP/s for wgmma_ws3_lean, whole prompts 0.3-0.4% faster) the same kernels
//               with ~30% fewer
//               instructions per 64-key tile and the same bits: a warp skips O's rescale (128
//               FMULs per thread) when none of its rows raised its running max (alpha exactly 1),
//               and the tiles wholly before the row tile's first query run in a loop compiled
//               without the causal mask (the compiler otherwise if-converts the mask into 32
//               compares + 32 selects executed on every tile). SASS per unmasked tile (cuobjdump):
//               ~433 instructions per thread when the rescale is skipped, against ~630.
//   wgmma_ws_ulean / wgmma_ws_lazy  (session 26; lazy the default on every hd-256 shape since
//               session 30: 16K causal 643 vs 570 TFLOP/s on the H200) wgmma_ws_lean with the 16 Q
//               descriptors of each S built in the uniform datapath (ulean: same bits, ~320
//               instead of ~385 instructions per unmasked tile), and also the score scale folded
//               into the exponent's FFMA and a row's softmax base raised only when its max grows
//               by more than 2^8 (lazy: FlashAttention-4's lazy rescale, ~294 per tile, O almost
//               never rescaled; not the same bits: within 1.5x wgmma_m128's error vs fp32).
//   wgmma_ws3_persist / wgmma_ws3_lean_persist  (session 23; measured in session 24: slower than
//               the one-tile kernels on every shape; never picked while those are on)
//               wgmma_ws3 / wgmma_ws3_lean as a persistent grid: one block per SM walks the row
//               tiles in the one-tile grid's order, dealt round by round in alternating
//               direction; the producer streams each next tile's K / V through the same rings and
//               each consumer warpgroup copies its next Q rows once its last S is done, so a
//               tile's start (Q, first K, first S) runs under the previous tile's last P V and
//               epilogue. The consumers zero a partial last V tile themselves. Same bits.
//   wgmma_m128  the same tiles with every thread loading K/V through a 2-stage cp.async pipeline
//               (rows past the last needed key zero-filled, never read), block barriers per
//               tile, an epilogue staged in fp32 through shared memory (16-byte rows). 310-443
//               TFLOP/s for 3072/4096-token chunks (425-435 at 16K causal), 300-326 for
//               512-token chunks against 8K-32K cached tokens: 8.5-15x the generic kernel. Runs
//               where the TMA kernels cannot, or are switched off; the reference of their
//               bit-exact test.
// Removed in session 5 (never picked on sm_90; docs/perf/attn_prefill_ws.md): wgmma_pipe,
// wgmma_ws_tilemajor, mma_m128 and mma_m64.
// Tests: tests/cuda/cuda_attention_test.cpp (vs the fp32 CPU reference and the generic kernel);
// bench: `deltaserve bench kernels --only attn_prefill` (every variant's time, fallback, match).
#include "cuda/attention_prefill_mma.h"

#include <cuda.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda/cuda_common.h"
#include "cuda/mma_util.cuh"
#include "cuda/tma.h"
#include "cuda/wgmma.cuh"

namespace ds::cuda {
namespace {

constexpr int kHd = kAttnMmaHeadDim;  // 256
constexpr int kBn = kAttnMmaKeyTile;  // 64 keys per step
constexpr int kRowBytes = kHd * 2;    // one bf16 row of Q / K / V: 512 bytes = 32 chunks of 16
constexpr int kStages = 2;
constexpr int kLdO = kHd + 8;  // fp32 row stride of the epilogue staging buffer

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The softmax's score scale in the exp2 domain: 1/sqrt(256) * log2(e).
constexpr float kScaleLog2 = 0.0625f * 1.4426950408889634f;

// Online softmax of one 64-key tile for this thread's rows a (g) and b (g + 8): scales and masks
// sc (the mma.m16n8 / wgmma accumulator layout of 8 key blocks, sc[4 * n8 + e]), updates the
// running max m and partial sums l, returns the factor alpha by which O must be rescaled, and P in
// bf16 as the A operand of P V (the A fragment of mma.m16n8k16 and of wgmma with A in registers).
struct SoftmaxRows {
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
};
__device__ __forceinline__ void softmax_tile(float (&sc)[kBn / 2], uint32_t (&p)[kBn / 16][4],
                                             int kt, bool need_mask, int pos_a, int pos_b, int t,
                                             SoftmaxRows& st, float& alpha_a, float& alpha_b) {
  float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
  for (int n = 0; n < kBn / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = sc[4 * n + e] * kScaleLog2;
      if (need_mask) {
        const int key = kt + n * 8 + 2 * t + (e & 1);
        if (key > (e < 2 ? pos_a : pos_b)) v = -INFINITY;
      }
      sc[4 * n + e] = v;
    }
    mx_a = fmaxf(mx_a, fmaxf(sc[4 * n], sc[4 * n + 1]));
    mx_b = fmaxf(mx_b, fmaxf(sc[4 * n + 2], sc[4 * n + 3]));
  }
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
  const float mn_a = fmaxf(st.m_a, mx_a), mn_b = fmaxf(st.m_b, mx_b);
  const float base_a = mn_a == -INFINITY ? 0.f : mn_a;  // a row with no key yet stays 0
  const float base_b = mn_b == -INFINITY ? 0.f : mn_b;
  alpha_a = fast_exp2(st.m_a - base_a);
  alpha_b = fast_exp2(st.m_b - base_b);
  st.m_a = mn_a;
  st.m_b = mn_b;
  float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
  for (int n = 0; n < kBn / 8; ++n) {
    const float p0 = fast_exp2(sc[4 * n] - base_a), p1 = fast_exp2(sc[4 * n + 1] - base_a);
    const float p2 = fast_exp2(sc[4 * n + 2] - base_b), p3 = fast_exp2(sc[4 * n + 3] - base_b);
    sum_a += p0 + p1;
    sum_b += p2 + p3;
    p[n >> 1][(n & 1) * 2 + 0] = pack_bf16(p0, p1);
    p[n >> 1][(n & 1) * 2 + 1] = pack_bf16(p2, p3);
  }
  st.l_a = st.l_a * alpha_a + sum_a;
  st.l_b = st.l_b * alpha_b + sum_b;
}

// kTune 2 (wgmma_ws_lazy, session 26): the online softmax of softmax_tile with two changes that
// cost bits, not accuracy (FlashAttention-4's): (1) the row max is taken over the raw scores and
// the scale folded into the exponent's FFMA, exp2(s c - m) with m = max(s) c (the same maximum:
// scaling by c > 0 commutes with max, and rounding is monotonic), instead of a multiply per score
// and then a subtraction (32 instructions per tile and thread fewer); (2) a row's base m is
// raised only when a tile's max exceeds it by more than kLazyTau (log2 domain), so that after
// the first tiles O is almost never rescaled (128 multiplies per thread).
// P may then reach 2^kLazyTau = 256: bf16 keeps its relative precision there, and l (<= 256 per
// key) and O stay far from fp32's range. alpha is exactly 1 for a row that kept its base, so the
// caller's warp vote (alpha != 1 on some row) rescales O as rarely as the rows raise.
constexpr float kLazyTau = 8.f;
__device__ __forceinline__ void softmax_tile_lazy(float (&sc)[kBn / 2], uint32_t (&p)[kBn / 16][4],
                                                  int kt, bool need_mask, int pos_a, int pos_b,
                                                  int t, SoftmaxRows& st, float& alpha_a,
                                                  float& alpha_b) {
  float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
  for (int n = 0; n < kBn / 8; ++n) {
    if (need_mask) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kt + n * 8 + 2 * t + (e & 1);
        if (key > (e < 2 ? pos_a : pos_b)) sc[4 * n + e] = -INFINITY;
      }
    }
    mx_a = fmaxf(mx_a, fmaxf(sc[4 * n], sc[4 * n + 1]));
    mx_b = fmaxf(mx_b, fmaxf(sc[4 * n + 2], sc[4 * n + 3]));
  }
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
  const float ms_a = mx_a * kScaleLog2, ms_b = mx_b * kScaleLog2;  // -inf stays -inf
  // A row raises its base only past the threshold (a row with no key yet has m = -inf, and any
  // finite max raises it: -inf + tau = -inf). Per row and by selects: a vote or a branch here
  // (a warp-wide decision before the exponentials) made the compiler sink the exponentials past
  // the caller's wait for P(j-1) V(j-1). Without a raise mn = m and alpha = exp2(0) = 1 exactly.
  const float mn_a = ms_a > st.m_a + kLazyTau ? ms_a : st.m_a;
  const float mn_b = ms_b > st.m_b + kLazyTau ? ms_b : st.m_b;
  alpha_a = fast_exp2(st.m_a - (mn_a == -INFINITY ? 0.f : mn_a));
  alpha_b = fast_exp2(st.m_b - (mn_b == -INFINITY ? 0.f : mn_b));
  st.m_a = mn_a;
  st.m_b = mn_b;
  const float nb_a = st.m_a == -INFINITY ? 0.f : -st.m_a;  // a row with no key yet stays 0
  const float nb_b = st.m_b == -INFINITY ? 0.f : -st.m_b;
  float sum_a, sum_b;
#pragma unroll
  for (int n = 0; n < kBn / 8; ++n) {
    const float p0 = fast_exp2(fmaf(sc[4 * n], kScaleLog2, nb_a));
    const float p1 = fast_exp2(fmaf(sc[4 * n + 1], kScaleLog2, nb_a));
    const float p2 = fast_exp2(fmaf(sc[4 * n + 2], kScaleLog2, nb_b));
    const float p3 = fast_exp2(fmaf(sc[4 * n + 3], kScaleLog2, nb_b));
    sum_a = n == 0 ? p0 + p1 : sum_a + (p0 + p1);
    sum_b = n == 0 ? p2 + p3 : sum_b + (p2 + p3);
    p[n >> 1][(n & 1) * 2 + 0] = pack_bf16(p0, p1);
    p[n >> 1][(n & 1) * 2 + 1] = pack_bf16(p2, p3);
  }
  st.l_a = st.l_a * alpha_a + sum_a;
  st.l_b = st.l_b * alpha_b + sum_b;
}

// A block's place in the work layout (one block per row tile, kv head, sequence; the heaviest
// tiles of the causal triangle first) and the keys its rows need.
struct RowTile {
  int kvh, group, q_len, row0;  // rows row0 .. row0 + kBm - 1, row = token * group + head
  int q0, past;                 // first token of the chunk in q / out; tokens cached before it
  int first_pos;                // position of the tile's first query
  int n_keys, n_tiles;          // keys 0 .. position of the tile's last query; 64-key tiles
  int ps, n_kv;
  const int32_t* btab;  // this sequence's block table
};

// Fills rt for row tile `tile` of kv head `kvh` of sequence `seq`; false when the tile lies past
// the sequence's rows (the block has nothing to do).
template <int kBm>
__device__ __forceinline__ bool row_tile_of(const AttnShape& s, const AttnBatch& b, int seq,
                                            int tile, int kvh, RowTile& rt) {
  rt.kvh = kvh;
  rt.group = s.n_heads / s.n_kv_heads;
  rt.q_len = b.q_len[seq];
  rt.row0 = tile * kBm;
  if (rt.row0 >= rt.q_len * rt.group) return false;
  const int kv_len = b.kv_len[seq];
  rt.q0 = b.q_start[seq];
  rt.past = kv_len - rt.q_len;  // tokens cached before this chunk
  const int first_tok = rt.row0 / rt.group;
  const int last_tok = min(rt.q_len - 1, (rt.row0 + kBm - 1) / rt.group);
  rt.first_pos = rt.past + first_tok;
  rt.n_keys = rt.past + last_tok + 1;
  rt.n_tiles = (rt.n_keys + kBn - 1) / kBn;
  rt.ps = s.page_size;
  rt.n_kv = s.n_kv_heads;
  rt.btab = b.block_table + int64_t(seq) * b.block_table_stride;
  return true;
}

// The same for sequence blockIdx.z.
template <int kBm>
__device__ __forceinline__ bool row_tile_at(const AttnShape& s, const AttnBatch& b, int tile,
                                            int kvh, RowTile& rt) {
  return row_tile_of<kBm>(s, b, int(blockIdx.z), tile, kvh, rt);
}

// The same for the block's place in the grid (tiles, n_kv, seqs): the longest rows of the
// triangle start first within each kv head.
template <int kBm>
__device__ __forceinline__ bool row_tile(const AttnShape& s, const AttnBatch& b, RowTile& rt) {
  return row_tile_at<kBm>(s, b, gridDim.x - 1 - blockIdx.x, blockIdx.y, rt);
}

// Starts the cp.async copies of the Q tile (rows past the chunk zero-filled: their scores are 0,
// finite, and never stored).
template <int kBm, int kThreads>
__device__ __forceinline__ void load_q_tile(uint32_t q_smem, const bf16* __restrict__ q,
                                            const AttnShape& s, const RowTile& rt) {
  for (int i = threadIdx.x; i < kBm * 32; i += kThreads) {
    const int r = i >> 5, c = i & 31, pr = rt.row0 + r, tok = pr / rt.group;
    const bool ok = tok < rt.q_len;
    const bf16* src =
        ok ? q + (int64_t(rt.q0 + tok) * s.n_heads + rt.kvh * rt.group + pr % rt.group) * kHd +
                 c * 8
           : q;
    cp_async16(q_smem + gswz(kBm, r, c), src, ok);
  }
}

// Element offset of key tile j (64 keys = one page run of this kv head) in the K / V cache.
__device__ __forceinline__ int64_t key_tile_offset(const RowTile& rt, int j) {
  const int kt = j * kBn;
  const int64_t blk = rt.btab[kt / rt.ps];
  return ((blk * rt.n_kv + rt.kvh) * rt.ps + kt % rt.ps) * kHd;
}

// Starts the cp.async copies of key tile j of K into kd and of V into vd; rows past the last
// needed key are zero-filled, not read.
template <int kThreads>
__device__ __forceinline__ void load_kv_tile(const RowTile& rt, const bf16* __restrict__ k_cache,
                                             const bf16* __restrict__ v_cache, int j, uint32_t kd,
                                             uint32_t vd) {
  const int kt = j * kBn;
  const int64_t off = key_tile_offset(rt, j);
  const bf16* kp = k_cache + off;
  const bf16* vp = v_cache + off;
  for (int i = threadIdx.x; i < kBn * 32; i += kThreads) {
    const int r = i >> 5, c = i & 31;
    const bool ok = kt + r < rt.n_keys;
    cp_async16(kd + gswz(kBn, r, c), kp + r * kHd + c * 8, ok);
    cp_async16(vd + gswz(kBn, r, c), vp + r * kHd + c * 8, ok);
  }
}

// This thread's two rows ra (g of its warp's 16) and rb = ra + 8, and their query positions.
// Rows past the chunk get no mask (INT_MAX: their zero Q gives finite scores over zero-filled
// keys).
struct QueryRows {
  int ra, rb, pos_a, pos_b;
};
__device__ __forceinline__ QueryRows query_rows(const RowTile& rt, int ra) {
  QueryRows qr;
  qr.ra = ra;
  qr.rb = ra + 8;
  const int tok_a = (rt.row0 + qr.ra) / rt.group, tok_b = (rt.row0 + qr.rb) / rt.group;
  qr.pos_a = tok_a < rt.q_len ? rt.past + tok_a : INT_MAX;
  qr.pos_b = tok_b < rt.q_len ? rt.past + tok_b : INT_MAX;
  return qr;
}

// O (the accumulator layout o[4 * d8 + e] of 32 8-column blocks) times alpha of its row.
__device__ __forceinline__ void rescale_o(float (&o)[kHd / 2], float alpha_a, float alpha_b) {
#pragma unroll
  for (int d = 0; d < kHd / 8; ++d) {
    o[4 * d] *= alpha_a;
    o[4 * d + 1] *= alpha_a;
    o[4 * d + 2] *= alpha_b;
    o[4 * d + 3] *= alpha_b;
  }
}

// The rows' softmax denominators summed over the quad, inverted (0 for a row with no key).
__device__ __forceinline__ void row_inverses(const SoftmaxRows& st, float& inv_a, float& inv_b) {
  float l_a = st.l_a, l_b = st.l_b;
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  inv_a = l_a > 0.f ? 1.f / l_a : 0.f;
  inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
}

// Epilogue, first half: the rows' sums over the quad, then O / l in fp32 into os ([kBm, kLdO]).
__device__ __forceinline__ void stage_o(const float (&o)[kHd / 2], const SoftmaxRows& st,
                                        const QueryRows& qr, int t, float* os) {
  float inv_a, inv_b;
  row_inverses(st, inv_a, inv_b);
#pragma unroll
  for (int d = 0; d < kHd / 8; ++d) {
    *reinterpret_cast<float2*>(os + qr.ra * kLdO + d * 8 + 2 * t) =
        make_float2(o[4 * d] * inv_a, o[4 * d + 1] * inv_a);
    *reinterpret_cast<float2*>(os + qr.rb * kLdO + d * 8 + 2 * t) =
        make_float2(o[4 * d + 2] * inv_b, o[4 * d + 3] * inv_b);
  }
}

// Epilogue rows: os holds O / l in fp32 ([kBm, kLdO]); writes 16-byte rows of out with the gate.
template <int kBm, int kThreads>
__device__ __forceinline__ void store_rows(const float* os, const AttnShape& s, AttnGate gate,
                                           const RowTile& rt, bf16* __restrict__ out) {
  const int q0 = rt.q0, q_len = rt.q_len, row0 = rt.row0, kvh = rt.kvh, group = rt.group;
  for (int i = threadIdx.x; i < kBm * 32; i += kThreads) {
    const int r = i >> 5, c = i & 31, pr = row0 + r, tok = pr / group;
    if (tok >= q_len) continue;
    const int h = kvh * group + pr % group;
    const float4 lo = *reinterpret_cast<const float4*>(os + r * kLdO + c * 8);
    const float4 hi = *reinterpret_cast<const float4*>(os + r * kLdO + c * 8 + 4);
    float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    if (gate.ptr) {
      const bf16* gp =
          gate.ptr + int64_t(q0 + tok) * gate.token_stride + int64_t(h) * gate.head_stride + c * 8;
      if ((reinterpret_cast<uintptr_t>(gp) & 15) == 0) {
        const uint4 gv = *reinterpret_cast<const uint4*>(gp);
        const bf16* ge = reinterpret_cast<const bf16*>(&gv);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] *= sigmoid(__bfloat162float(ge[e]));
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] *= sigmoid(__bfloat162float(gp[e]));
      }
    }
    uint4 ov;
    ov.x = pack_bf16(v[0], v[1]);
    ov.y = pack_bf16(v[2], v[3]);
    ov.z = pack_bf16(v[4], v[5]);
    ov.w = pack_bf16(v[6], v[7]);
    *reinterpret_cast<uint4*>(out + (int64_t(q0 + tok) * s.n_heads + h) * kHd + c * 8) = ov;
  }
}

// ---- wgmma variant: the same tiles with Hopper warpgroup MMAs ---------------------------------
// 2 warpgroups x 64 rows; S = Q K^T by wgmma m64n64k16 with Q and K from shared memory, O += P V
// by wgmma m64n256k16 with P from registers and V from shared memory (MN-major). Tiles are stored
// as 4 column blocks of [rows, 64] bf16 with the 128-byte swizzle the descriptors name.

constexpr int kWgRows = 128;
constexpr size_t kWgSmemBytes =
    1024 + size_t(kWgRows) * kRowBytes + size_t(kStages) * 2 * kBn * kRowBytes;

// Issues S = Q K^T (64 rows of warpgroup wg x 64 keys) into sc, zeroed first; not committed.
__device__ __forceinline__ void issue_qk(float (&sc)[kBn / 2], uint32_t q_smem, uint32_t ks,
                                         int wg) {
#pragma unroll
  for (int i = 0; i < kBn / 2; ++i) sc[i] = 0.f;
  fence_regs(sc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHd / 16; ++kk) {
    const uint64_t da =
        gmma_desc(q_smem + (kk >> 2) * kWgRows * 128 + wg * 64 * 128 + (kk & 3) * 32, 16, 1024);
    const uint64_t db = gmma_desc(ks + (kk >> 2) * kBn * 128 + (kk & 3) * 32, 16, 1024);
    wgmma_m64n64k16_ss(sc, da, db);
  }
}

__global__ void __launch_bounds__(256, 1)
    attention_prefill_wgmma_kernel(AttnShape s, AttnBatch b,
                                   const bf16* __restrict__ q,        // [n_rows, n_heads, 256]
                                   const bf16* __restrict__ k_cache,  // [blocks, n_kv, page, 256]
                                   const bf16* __restrict__ v_cache,  // [blocks, n_kv, page, 256]
                                   AttnGate gate,
                                   bf16* __restrict__ out) {  // [n_rows, n_heads, 256]
  constexpr int kBm = kWgRows;
  constexpr int kThreads = 256;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);  // swizzle atoms
  const uint32_t q_smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t kv_smem = q_smem + kBm * kRowBytes;
  auto k_stage = [&](int st) { return kv_smem + uint32_t(st) * 2 * kBn * kRowBytes; };
  auto v_stage = [&](int st) { return k_stage(st) + kBn * kRowBytes; };

  RowTile rt;
  if (!row_tile<kBm>(s, b, rt)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  const int t = lane & 3;

  load_q_tile<kBm, kThreads>(q_smem, q, s, rt);
  auto load_kv = [&](int j, int st) {
    load_kv_tile<kThreads>(rt, k_cache, v_cache, j, k_stage(st), v_stage(st));
  };
  load_kv(0, 0);
  cp_async_commit();

  const QueryRows qr = query_rows(rt, warp * 16 + (lane >> 2));

  float o[kHd / 2];  // o[4 * d8 + e]: the mma accumulator layout of 8-column block d8
#pragma unroll
  for (int i = 0; i < kHd / 2; ++i) o[i] = 0.f;
  SoftmaxRows st;

  for (int j = 0; j < rt.n_tiles; ++j) {
    if (j + 1 < rt.n_tiles) load_kv(j + 1, (j + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    const uint32_t ks = k_stage(j & 1), vs = v_stage(j & 1);
    const int kt = j * kBn;

    float sc[kBn / 2];  // sc[4 * n8 + e]
    issue_qk(sc, q_smem, ks, wg);
    wgmma_commit();
    wgmma_wait_all();
    fence_regs(sc);

    uint32_t p[kBn / 16][4];
    float alpha_a, alpha_b;
    softmax_tile(sc, p, kt, kt + kBn - 1 > rt.first_pos, qr.pos_a, qr.pos_b, t, st, alpha_a,
                 alpha_b);
    rescale_o(o, alpha_a, alpha_b);

    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBn / 16; ++kk)
      wgmma_m64n256k16_rs(o, p[kk], gmma_desc(vs + kk * 16 * 128, kBn * 128, 1024));
    wgmma_commit();
    wgmma_wait_all();
    fence_regs(o);
    __syncthreads();
  }
  cp_async_wait<0>();

  float* os = reinterpret_cast<float*>(smem);
  stage_o(o, st, qr, t, os);
  __syncthreads();
  store_rows<kBm, kThreads>(os, s, gate, rt, out);
}

void launch_wgmma(const AttnShape& s, const AttnBatch& b, const bf16* q, const bf16* k_cache,
                  const bf16* v_cache, AttnGate gate, bf16* out, cudaStream_t stream) {
  static_assert(size_t(kWgRows) * kLdO * 4 + 1024 <= kWgSmemBytes, "epilogue staging must fit");
  ensure_smem_optin(reinterpret_cast<const void*>(attention_prefill_wgmma_kernel), kWgSmemBytes);
  const int group = s.n_heads / s.n_kv_heads;
  const int64_t tiles = (int64_t(b.max_q_len) * group + kWgRows - 1) / kWgRows;
  DS_CHECK(tiles <= 0x7fffffff, "attention prefill: too many row tiles (", tiles, ")");
  dim3 grid(unsigned(tiles), s.n_kv_heads, b.n_seqs);
  attention_prefill_wgmma_kernel<<<grid, 256, kWgSmemBytes, stream>>>(s, b, q, k_cache, v_cache,
                                                                      gate, out);
  DS_CUDA_LAUNCH_CHECK();
}

// ---- wgmma_ws: warp-specialised, TMA-fed form -------------------------------------------------
// 3 warpgroups: warpgroup 0 is the producer (one thread issues the TMA tensor copies of whole K / V
// tiles into a ring of shared-memory stages, each completing on an mbarrier; its registers are
// handed to the consumers with setmaxnreg), warpgroups 1 and 2 are the consumers (64 rows each,
// the same rows and fragments as wgmma_m128). The consumers never meet at a block barrier: each
// waits on the stage's "full" mbarrier and gives the stage back through its "empty" mbarrier, so
// the two drift apart and one's softmax runs while the other's GEMMs use the tensor cores. Inside
// a warpgroup, S(j) = Q K(j)^T is issued before P(j-1) V(j-1) and the softmax of tile j runs while
// P V is on the tensor cores (FlashAttention-3's intra-warpgroup overlap). The arithmetic is the
// same as wgmma_m128 in the same order (same instructions, same softmax, O rescaled before the
// P V that follows), so the outputs are bit-identical to it.
// K / V tile j = 64 keys of one kv head = one contiguous [64, 256] run of a page; the TMA map sees
// the cache as a 3-D tensor {256 columns, n_kv * page rows (row = head * page + slot), blocks}
// (attention_prefill_tma_view: every coordinate stays a small 32-bit number, however large the
// cache) and copies a tile as 4 boxes of [64 rows, 64 columns] with the 128-byte swizzle: exactly
// the wgmma tile layout (gswz). Rows past the last needed key are copied too (the page is
// allocated): K rows there are masked (their scores are replaced by -inf), V rows there are zeroed
// before the last P V (P is 0 there, but 0 * NaN would not be) by a second producer warp alone,
// once the TMA copy has landed; the consumers wait for that on one more mbarrier (a tile with
// every key needed skips both).

constexpr int kWsThreads = 384;
constexpr uint32_t kWsTileBytes = kBn * kRowBytes;  // one K or V tile: 32 KiB
// Shared memory of the kernel with KS K stages and VS V stages (+ 1024 for the alignment).
template <int KS, int VS>
constexpr size_t ws_smem_bytes() {
  return 1024 + size_t(kWgRows) * kRowBytes + size_t(KS + VS) * kWsTileBytes +
         (2 * (KS + VS) + 2) * sizeof(uint64_t);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of `bar` with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// One [64 rows, 64 columns] box of the cache (TMA view {256 columns, n_kv * page rows, blocks})
// at column c0, row r0 of block blk into dst (1024-byte aligned), completing on bar.
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, int c0, int r0,
                                             int blk, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(r0), "r"(blk), "r"(bar)
      : "memory");
}
// Named barrier of the 128 threads of one consumer warpgroup (ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_bar(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}

// Shared-memory map of the warp-specialised kernel: Q [128, 256], the K and V rings, then the
// mbarriers (full / empty of each K stage, then of each V stage, then "every fill is issued" and
// "the last V tile's rows past the last key are zeroed").
template <int KS, int VS>
struct WsSmem {
  uint32_t q, k, v, bars;
  __device__ uint32_t full_k(int st) const { return bars + 8u * st; }
  __device__ uint32_t empty_k(int st) const { return bars + 8u * (KS + st); }
  __device__ uint32_t full_v(int st) const { return bars + 8u * (2 * KS + st); }
  __device__ uint32_t empty_v(int st) const {
    return bars + 8u * (2 * KS + VS + st);
  }
  __device__ uint32_t last_issued() const { return bars + 8u * (2 * KS + 2 * VS); }
  __device__ uint32_t v_zeroed() const { return bars + 8u * (2 * KS + 2 * VS + 1); }
};

// The shared-memory map of the warp-specialised kernels' dynamic shared memory (1024-aligned).
template <int KS, int VS>
__device__ __forceinline__ WsSmem<KS, VS> ws_smem(unsigned char* smem_raw) {
  WsSmem<KS, VS> sm;
  sm.q = smem_u32(align_1024(smem_raw));
  sm.k = sm.q + kWgRows * kRowBytes;
  sm.v = sm.k + KS * kWsTileBytes;
  sm.bars = sm.v + VS * kWsTileBytes;
  return sm;
}

// The K and V rings' mbarriers: a full barrier per stage (the producer's expect_tx arrival) and an
// empty one (lane 0 of each of the 8 consumer warps). Thread 0, before the block barrier.
template <int KS, int VS>
__device__ __forceinline__ void ws_init_rings(const WsSmem<KS, VS>& sm) {
  for (int st = 0; st < KS; ++st) {
    mbar_init(sm.full_k(st), 1);
    mbar_init(sm.empty_k(st), 8);
  }
  for (int st = 0; st < VS; ++st) {
    mbar_init(sm.full_v(st), 1);
    mbar_init(sm.empty_v(st), 8);
  }
}

// Producer (one thread): K(0), then K(j), V(j - 1) for j >= 1 (the order the consumers use them),
// then V(last), then (kPersist false) an arrival on last_issued (for ws_zero_v_tail). Each fill
// of a stage first waits until the consumers gave its previous fill back. kf0 / vf0: the K / V
// fills the block issued before this row tile (0 but in the persistent kernel), which set the
// stages and phases of this tile's fills.
template <int KS, int VS, bool kPersist = false>
__device__ __forceinline__ void ws_load_tiles(const RowTile& rt, const CUtensorMap* k_map,
                                              const CUtensorMap* v_map, const WsSmem<KS, VS>& sm,
                                              int kf0 = 0, int vf0 = 0) {
  if constexpr (!kPersist) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(k_map))
                 : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(v_map))
                 : "memory");
  }
  auto load = [&](bool is_v, int j) {
    const int n_stages = is_v ? VS : KS;
    const int f = (is_v ? vf0 : kf0) + j;
    const int st = f % n_stages, fill = f / n_stages;
    const uint32_t full = is_v ? sm.full_v(st) : sm.full_k(st);
    mbar_wait(is_v ? sm.empty_v(st) : sm.empty_k(st), (fill & 1) ^ 1);
    mbar_arrive_expect_tx(full, kWsTileBytes);
    // Block and row inside the block of key tile j: both small 32-bit coordinates (the block is
    // the int32 table entry), whatever the size of the cache.
    const int kt = j * kBn;
    const int blk = rt.btab[kt / rt.ps], row = rt.kvh * rt.ps + kt % rt.ps;
    const uint32_t dst = (is_v ? sm.v : sm.k) + uint32_t(st) * kWsTileBytes;
    const CUtensorMap* map = is_v ? v_map : k_map;
#pragma unroll
    for (int cb = 0; cb < kHd / 64; ++cb)
      tma_load_box(dst + uint32_t(cb) * kBn * 128, map, cb * 64, row, blk, full);
  };
  load(false, 0);
  for (int j = 1; j < rt.n_tiles; ++j) {
    load(false, j);
    load(true, j - 1);
  }
  load(true, rt.n_tiles - 1);
  if constexpr (!kPersist) mbar_arrive(sm.last_issued());
}

// Second producer warp, when the last key tile is partial: zeroes that V tile's rows past the last
// key once its TMA copy has landed (the only writer of those bytes) and arrives on v_zeroed (32
// arrivals), which the consumers wait for before the last P V. It first waits until the loading
// thread has issued every fill (last_issued): the full barrier of that stage is then in the last
// fill's phase or past it, so the parity wait cannot match an older phase. (A warp of its own
// keeps the loading thread's registers free: it runs under setmaxnreg 24.)
template <int KS, int VS>
__device__ __forceinline__ void ws_zero_v_tail(const RowTile& rt, const WsSmem<KS, VS>& sm) {
  const int j = rt.n_tiles - 1, valid = rt.n_keys - j * kBn;  // keys of the last tile (1..64)
  if (valid == kBn) return;
  const int lane = threadIdx.x & 31, sv = j % VS;
  mbar_wait(sm.last_issued(), 0);
  mbar_wait(sm.full_v(sv), (j / VS) & 1);
  const uint32_t vs = sm.v + uint32_t(sv) * kWsTileBytes;
  for (int i = lane; i < (kBn - valid) * 32; i += 32) {
    const int r = valid + (i >> 5), c = i & 31;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(vs + gswz(kBn, r, c)), "r"(0u)
                 : "memory");
  }
  fence_proxy_async();  // the zeros (generic proxy) before the consumers' wgmma reads (async)
  mbar_arrive(sm.v_zeroed());
}

// Keeps the A fragments of an in-flight P V alive (and in place) until its wgmma group is waited.
__device__ __forceinline__ void fence_frags(uint32_t (&p)[kBn / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kBn / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(p[kk][e])::"memory");
}

// S = Q K^T like issue_qk, the first k step with scale_d 0 (no zeroing of the accumulators).
// The Q descriptors are rebuilt from one base per call (a descriptor of address a + off is the
// descriptor of a plus off / 16 while addresses stay below 256 KiB): the base goes through an
// opaque move so that the compiler cannot hoist 16 64-bit descriptors out of the tile loop and
// hold them in registers. kUniform (kTune >= 1: wgmma_ws_ulean, wgmma_ws_lazy): the moved base
// then goes through a shuffle from lane 0, which the compiler knows to be warp-uniform, so each
// descriptor is one 64-bit add in the uniform datapath; without it (an asm output counts as
// divergent) each is built in ordinary registers and moved to uniform ones (IADD3 + IADD3.X + 2
// R2UR + UMOV: ~5 instructions per wgmma, ~80 per tile). The descriptors' values, and so the
// outputs, are the same either way.
template <bool kUniform = false>
__device__ __forceinline__ void issue_qk_ws(float (&sc)[kBn / 2], uint32_t q_smem, uint32_t ks,
                                            int wg) {
  uint32_t qa;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(qa) : "r"(q_smem + uint32_t(wg) * 64 * 128));
  if constexpr (kUniform) qa = __shfl_sync(0xffffffffu, qa, 0);
  const uint64_t qd = gmma_desc(qa, 16, 1024), kd = gmma_desc(ks, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHd / 16; ++kk) {
    const uint64_t da = qd + (((kk >> 2) * kWgRows * 128 + (kk & 3) * 32) >> 4);
    const uint64_t db = kd + (((kk >> 2) * kBn * 128 + (kk & 3) * 32) >> 4);
    wgmma_m64n64k16_ss(sc, da, db, kk == 0 ? 0 : 1);
  }
}

// O += P V(tile in stage vs) on the tensor cores, committed as one group. O and P are not
// touched between the caller's register fences and this (a fence on O while the S group runs
// would serialise the two groups).
__device__ __forceinline__ void issue_pv(float (&o)[kHd / 2], const uint32_t (&p)[kBn / 16][4],
                                         uint32_t vs) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBn / 16; ++kk)
    wgmma_m64n256k16_rs(o, p[kk], gmma_desc(vs + kk * 16 * 128, kBn * 128, 1024));
  wgmma_commit();
}

// Starts the cp.async copies of warpgroup wg's 64 Q rows of row tile rt (pad rows zero-filled);
// the caller commits and waits. ct: the thread's index in the warpgroup.
__device__ __forceinline__ void ws_issue_q_rows(const AttnShape& s, const RowTile& rt,
                                                const bf16* __restrict__ q, int wg, int ct,
                                                uint32_t q_smem) {
  for (int i = ct; i < 64 * 32; i += 128) {
    const int r = wg * 64 + (i >> 5), c = i & 31, pr = rt.row0 + r, tok = pr / rt.group;
    const bool ok = tok < rt.q_len;
    const bf16* src =
        ok ? q + (int64_t(rt.q0 + tok) * s.n_heads + rt.kvh * rt.group + pr % rt.group) * kHd +
                 c * 8
           : q;
    cp_async16(q_smem + gswz(kWgRows, r, c), src, ok);
  }
}
__device__ __forceinline__ void ws_issue_q(const AttnShape& s, const RowTile& rt,
                                           const bf16* __restrict__ q, int wg, uint32_t q_smem) {
  ws_issue_q_rows(s, rt, q, wg, int(threadIdx.x) - 128 * (wg + 1), q_smem);
}

// Consumer warpgroup wg (0, 1): rows wg * 64 .. + 63 of row tile rt, whose Q rows are in shared
// memory; warp (0..7 of the consumers) and lane are the thread's. kf0 / vf0: the K / V fills the
// block consumed before this row tile (0 but in the persistent kernel). before_last_pv() runs once
// this thread's last S is done (each warp's own wgmma wait: a caller that rewrites Q must first
// sync the warpgroup); the persistent kernel starts the next row tile's Q copies there. kPersist:
// the last V tile's rows past the last key are zeroed here by the two consumer warpgroups
// (columns split between them, then a 256-thread barrier), not by the second producer warp.
template <int KS, int VS, bool kLean, bool kPersist, int kTune = 0, class BeforeLastPv>
__device__ __forceinline__ void ws_consume_tile(const AttnShape& s, const RowTile& rt,
                                                const AttnGate& gate, bf16* __restrict__ out,
                                                int wg, const WsSmem<KS, VS>& sm, int kf0,
                                                int vf0, BeforeLastPv&& before_last_pv,
                                                int warp, int lane) {
  const int t = lane & 3;

  const QueryRows qr = query_rows(rt, warp * 16 + (lane >> 2));
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  auto need_mask = [&](int j) { return j * kBn + kBn - 1 > rt.first_pos; };

  float o[kHd / 2];
#pragma unroll
  for (int i = 0; i < kHd / 2; ++i) o[i] = 0.f;
  SoftmaxRows st;
  // P of the tile whose P V is next, in two register sets used in turn (the softmax of tile j
  // writes one while P V of tile j - 1 reads the other: no copies, no register moves).
  uint32_t pa[kBn / 16][4], pb[kBn / 16][4];
  {
    float sc[kBn / 2];
    const int sk = kf0 % KS;
    mbar_wait(sm.full_k(sk), (kf0 / KS) & 1);
    issue_qk_ws<(kTune >= 1)>(sc, sm.q, sm.k + uint32_t(sk) * kWsTileBytes, wg);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(sc);
    release(sm.empty_k(sk));
    float alpha_a, alpha_b;  // O is still 0: nothing to rescale
    if constexpr (kTune == 2)
      softmax_tile_lazy(sc, pa, 0, need_mask(0), qr.pos_a, qr.pos_b, t, st, alpha_a, alpha_b);
    else
      softmax_tile(sc, pa, 0, need_mask(0), qr.pos_a, qr.pos_b, t, st, alpha_a, alpha_b);
  }
  // Tile j >= 1: S(j) = Q K(j)^T, then O += P(j-1) V(j-1) from pin, the softmax of S(j) into pout
  // while that runs, then O rescaled. `maskable` false: a tile known to need no mask (compiled
  // without the mask's per-element compares and selects, which the compiler otherwise keeps on
  // every tile as predicated code).
  auto step = [&](auto maskable, int j, uint32_t(&pin)[kBn / 16][4],
                  uint32_t(&pout)[kBn / 16][4]) {
    const int kf = kf0 + j, vf = vf0 + j - 1;
    const int sk = kf % KS, sv = vf % VS;
    float sc[kBn / 2];
    mbar_wait(sm.full_k(sk), (kf / KS) & 1);
    fence_regs(o);
    fence_frags(pin);
    issue_qk_ws<(kTune >= 1)>(sc, sm.q, sm.k + uint32_t(sk) * kWsTileBytes, wg);
    wgmma_commit();
    mbar_wait(sm.full_v(sv), (vf / VS) & 1);
    issue_pv(o, pin, sm.v + uint32_t(sv) * kWsTileBytes);
    wgmma_wait<1>();  // S(j) done; P V may still run
    fence_regs(sc);
    release(sm.empty_k(sk));
    float alpha_a, alpha_b;
    if constexpr (kTune == 2)
      softmax_tile_lazy(sc, pout, j * kBn, decltype(maskable)::value && need_mask(j), qr.pos_a,
                        qr.pos_b, t, st, alpha_a, alpha_b);
    else
      softmax_tile(sc, pout, j * kBn, decltype(maskable)::value && need_mask(j), qr.pos_a,
                   qr.pos_b, t, st, alpha_a, alpha_b);
    wgmma_wait<0>();
    fence_regs(o);
    fence_frags(pin);
    release(sm.empty_v(sv));
    // kLean: once the running maxima settle, most tiles leave every row's max where it was; alpha
    // is then exactly 1 and the 128 multiplies change nothing, so a warp skips them when none of
    // its 16 rows moved (the same bits as always rescaling). kTune 2: a row moves only past the
    // threshold (softmax_tile_lazy), which after the first tiles is rare.
    if (!kLean || __any_sync(0xffffffffu, alpha_a != 1.f || alpha_b != 1.f))
      rescale_o(o, alpha_a, alpha_b);
  };
  // The last tile's P V; when the tile is partial, its V rows past the last key (whatever the
  // page holds there) are zeroed first: by the second producer warp (ws_zero_v_tail) or, in the
  // persistent kernel, by the consumers themselves.
  auto last_pv = [&](uint32_t(&pin)[kBn / 16][4]) {
    before_last_pv();
    const int j = rt.n_tiles - 1, vf = vf0 + j, sv = vf % VS;
    mbar_wait(sm.full_v(sv), (vf / VS) & 1);
    const uint32_t vs = sm.v + uint32_t(sv) * kWsTileBytes;
    if constexpr (kPersist) {
      const int valid = rt.n_keys - j * kBn;  // keys of the last tile (1..64)
      if (valid < kBn) {
        // 16-byte chunks c of rows valid..63: warpgroup wg takes columns 128 wg .. 128 wg + 127.
        const int ct = threadIdx.x - 128 * (wg + 1);
        for (int i = ct; i < (kBn - valid) * 16; i += 128) {
          const int r = valid + (i >> 4), c = 16 * wg + (i & 15);
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(vs + gswz(kBn, r, c)),
                       "r"(0u)
                       : "memory");
        }
        fence_proxy_async();  // the zeros (generic proxy) before either warpgroup's wgmma reads
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
      }
    } else {
      if (rt.n_keys - j * kBn < kBn) mbar_wait(sm.v_zeroed(), 0);
    }
    fence_regs(o);
    fence_frags(pin);
    issue_pv(o, pin, vs);
    wgmma_wait<0>();
    fence_regs(o);
    fence_frags(pin);
    // The persistent kernel's rings go on to the next row tile: give the last V stage back too
    // (the one-tile kernel ends here, and its producer never waits on that stage again).
    if constexpr (kPersist) release(sm.empty_v(sv));
  };
  constexpr std::true_type kMaskable{};
  constexpr std::bool_constant<!kLean> kMaskableUnlessLean{};
  int j = 1;
  // kLean: the tiles wholly before the tile's first query (all but the last one or two of a
  // causal block) in a loop of their own, without the mask (need_mask only turns true with j).
  if constexpr (kLean) {
    for (; j + 1 < rt.n_tiles && !need_mask(j + 1); j += 2) {
      step(kMaskableUnlessLean, j, pa, pb);
      step(kMaskableUnlessLean, j + 1, pb, pa);
    }
  }
  for (; j + 1 < rt.n_tiles; j += 2) {
    step(kMaskable, j, pa, pb);
    step(kMaskable, j + 1, pb, pa);
  }
  if (j < rt.n_tiles) {
    step(kMaskable, j, pa, pb);
    last_pv(pb);
  } else {
    last_pv(pa);
  }

  // Epilogue straight from the accumulators: O / l times sigmoid(gate), bf16 pairs (the same
  // fp32 operations as stage_o + store_rows).
  float inv_a, inv_b;
  row_inverses(st, inv_a, inv_b);
  const bool gate_pairs = (reinterpret_cast<uintptr_t>(gate.ptr) & 3) == 0 &&
                          gate.token_stride % 2 == 0 && gate.head_stride % 2 == 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half ? qr.rb : qr.ra, pr = rt.row0 + r, tok = pr / rt.group;
    if (tok >= rt.q_len) continue;
    const int h = rt.kvh * rt.group + pr % rt.group;
    const float inv = half ? inv_b : inv_a;
    bf16* orow = out + (int64_t(rt.q0 + tok) * s.n_heads + h) * kHd + 2 * t;
    const bf16* grow = gate.ptr ? gate.ptr + int64_t(rt.q0 + tok) * gate.token_stride +
                                      int64_t(h) * gate.head_stride + 2 * t
                                : nullptr;
#pragma unroll
    for (int d = 0; d < kHd / 8; ++d) {
      float v0 = o[4 * d + 2 * half] * inv, v1 = o[4 * d + 2 * half + 1] * inv;
      if (grow) {
        float g0, g1;
        if (gate_pairs) {
          const __nv_bfloat162 g = *reinterpret_cast<const __nv_bfloat162*>(grow + d * 8);
          g0 = __low2float(g);
          g1 = __high2float(g);
        } else {
          g0 = __bfloat162float(grow[d * 8]);
          g1 = __bfloat162float(grow[d * 8 + 1]);
        }
        v0 *= sigmoid(g0);
        v1 *= sigmoid(g1);
      }
      *reinterpret_cast<uint32_t*>(orow + d * 8) = pack_bf16(v0, v1);
    }
  }
}

// Consumer warpgroup wg (0, 1) of the one-row-tile kernel: its Q rows, then the tile.
template <int KS, int VS, bool kLean, int kTune = 0>
__device__ __forceinline__ void ws_consume(const AttnShape& s, const RowTile& rt,
                                           const bf16* __restrict__ q, const AttnGate& gate,
                                           bf16* __restrict__ out, int wg,
                                           const WsSmem<KS, VS>& sm) {
  const int ct = threadIdx.x - 128 * (wg + 1);  // 0..127 within the warpgroup
  const int warp = (threadIdx.x >> 5) - 4, lane = threadIdx.x & 31;  // warp 0..7 of the rows
  ws_issue_q_rows(s, rt, q, wg, ct, sm.q);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  warpgroup_bar(1 + wg);
  ws_consume_tile<KS, VS, kLean, false, kTune>(s, rt, gate, out, wg, sm, 0, 0, [] {}, warp,
                                               lane);
}

template <int KS, int VS, bool kLean, int kTune = 0>
__global__ void __launch_bounds__(kWsThreads, 1)
    attention_prefill_ws_kernel(AttnShape s, AttnBatch b,
                                const bf16* __restrict__ q,  // [n_rows, n_heads, 256]
                                const __grid_constant__ CUtensorMap k_map,  // K cache, 3-D view
                                const __grid_constant__ CUtensorMap v_map,  // V cache, 3-D view
                                AttnGate gate,
                                bf16* __restrict__ out,  // [n_rows, n_heads, 256]
                                bool heads_fastest) {
  extern __shared__ unsigned char smem_raw[];
  const WsSmem<KS, VS> sm = ws_smem<KS, VS>(smem_raw);

  // Grid (n_kv, tiles, seqs) when heads_fastest: the heaviest row tiles of every kv head first;
  // else (tiles, n_kv, seqs): heaviest first within each kv head, one head after the other.
  RowTile rt;
  const bool has_rows =
      heads_fastest ? row_tile_at<kWgRows>(s, b, gridDim.y - 1 - blockIdx.y, blockIdx.x, rt)
                    : row_tile<kWgRows>(s, b, rt);
  if (!has_rows) return;
  if (threadIdx.x == 0) {
    ws_init_rings(sm);
    mbar_init(sm.last_issued(), 1);  // one phase each
    mbar_init(sm.v_zeroed(), 32);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // One if / else over the warpgroup roles (the form in which setmaxnreg takes effect).
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x == 0) ws_load_tiles(rt, &k_map, &v_map, sm);
    if (threadIdx.x >= 32 && threadIdx.x < 64) ws_zero_v_tail(rt, sm);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    static_assert(kTune == 0 || kLean, "the tuned forms run on the lean form's loops");
    ws_consume<KS, VS, kLean, kTune>(s, rt, q, gate, out, (threadIdx.x >> 7) - 1, sm);
  }
}

// ---- Persistent form of the warp-specialised kernel (session 23, built without a device) ------
// One block per SM walks a list of row tiles: the (sequence, kv head, row tile) items in the
// order of the one-tile grid (heads fastest, the longest rows of the triangle first), dealt to
// the blocks round by round in alternating direction (round r gives item r G + b to block b when
// r is even, r G + G - 1 - b when odd), so the blocks' sums of key tiles stay within about one
// item of each other. The producer thread streams the K / V tiles of its items back to back
// through the same rings (stage and phase from the fills issued so far), so the next item's first
// tiles land while the consumers finish the current one; each consumer warpgroup starts the
// copies of its next item's Q rows once its last S is done, under its last P V and its
// epilogue. The per-tile arithmetic is ws_consume_tile's, so the outputs are the one-tile
// kernel's bits.

// Item o of the list (0 <= o < n_seqs * n_kv * tiles): false if it lies past its sequence's rows.
__device__ __forceinline__ bool wsp_item(const AttnShape& s, const AttnBatch& b, int tiles,
                                         int64_t o, RowTile& rt) {
  const int64_t per_seq = int64_t(s.n_kv_heads) * tiles;
  const int seq = int(o / per_seq), rem = int(o % per_seq);
  return row_tile_of<kWgRows>(s, b, seq, tiles - 1 - rem / s.n_kv_heads, rem % s.n_kv_heads, rt);
}

// The item of round r for this block, or -1 past the list.
__device__ __forceinline__ int64_t wsp_round_item(int64_t r, int64_t n_items) {
  const int64_t g = gridDim.x;
  const int64_t o = r * g + ((r & 1) ? g - 1 - blockIdx.x : blockIdx.x);
  return o < n_items ? o : -1;
}

// The first round >= r whose item has rows (-1: none left). Every thread of the block walks the
// same rounds, so producer and consumers agree on the items and on each one's tile count.
__device__ __forceinline__ int64_t wsp_next_round(const AttnShape& s, const AttnBatch& b,
                                                  int tiles, int64_t n_items, int64_t r) {
  for (; r * gridDim.x < n_items; ++r) {
    const int64_t o = wsp_round_item(r, n_items);
    RowTile rt;
    if (o >= 0 && wsp_item(s, b, tiles, o, rt)) return r;
  }
  return -1;
}

template <int KS, int VS, bool kLean>
__global__ void __launch_bounds__(kWsThreads, 1)
    attention_prefill_wsp_kernel(AttnShape s, AttnBatch b,
                                 const bf16* __restrict__ q,  // [n_rows, n_heads, 256]
                                 const __grid_constant__ CUtensorMap k_map,
                                 const __grid_constant__ CUtensorMap v_map, AttnGate gate,
                                 bf16* __restrict__ out,  // [n_rows, n_heads, 256]
                                 int tiles, int64_t n_items) {
  extern __shared__ unsigned char smem_raw[];
  const WsSmem<KS, VS> sm = ws_smem<KS, VS>(smem_raw);

  int64_t r = wsp_next_round(s, b, tiles, n_items, 0);
  if (r < 0) return;  // the whole block: no item of this block has rows
  if (threadIdx.x == 0) {
    ws_init_rings(sm);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  int kf = 0, vf = 0;  // K / V fills issued (producer) or consumed (consumers) so far
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&k_map))
                   : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&v_map))
                   : "memory");
      for (; r >= 0; r = wsp_next_round(s, b, tiles, n_items, r + 1)) {
        RowTile rt;
        wsp_item(s, b, tiles, wsp_round_item(r, n_items), rt);
        ws_load_tiles<KS, VS, true>(rt, &k_map, &v_map, sm, kf, vf);
        kf += rt.n_tiles;
        vf += rt.n_tiles;
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int wg = (threadIdx.x >> 7) - 1;
    const int warp = (threadIdx.x >> 5) - 4, lane = threadIdx.x & 31;
    {
      RowTile rt;
      wsp_item(s, b, tiles, wsp_round_item(r, n_items), rt);
      ws_issue_q(s, rt, q, wg, sm.q);
      cp_async_commit();
    }
    while (r >= 0) {
      RowTile rt;
      wsp_item(s, b, tiles, wsp_round_item(r, n_items), rt);
      const int64_t rn = wsp_next_round(s, b, tiles, n_items, r + 1);
      cp_async_wait<0>();
      fence_proxy_async();  // the Q rows (generic proxy) before this warpgroup's wgmma reads
      warpgroup_bar(1 + wg);
      ws_consume_tile<KS, VS, kLean, true>(
          s, rt, gate, out, wg, sm, kf, vf,
          [&] {
            if (rn < 0) return;
            // Every warp of this warpgroup past its last S: a warp's wgmma wait covers its own
            // groups only, and the copies below write rows that the other warps' S read.
            warpgroup_bar(1 + wg);
            RowTile next;
            wsp_item(s, b, tiles, wsp_round_item(rn, n_items), next);
            ws_issue_q(s, next, q, wg, sm.q);
            cp_async_commit();
          },
          warp, lane);
      kf += rt.n_tiles;
      vf += rt.n_tiles;
      r = rn;
    }
  }
}

// The TMA map of one paged cache (attention_prefill_tma_view, which the caller has checked), 64 x
// 64 x 1 boxes, 128-byte swizzle.
CUtensorMap cache_tensor_map(const AttnCacheTmaView& view, const bf16* cache, const char* what) {
  DS_CHECK((reinterpret_cast<uintptr_t>(cache) & 15) == 0, "attention prefill (wgmma_ws): the ",
           what, " cache must be 16-byte aligned");
  const uint64_t dims[3] = {view.dims[0], view.dims[1], view.dims[2]};
  const uint32_t box[3] = {64, uint32_t(kBn), 1};
  const std::string name = std::string("attention prefill (wgmma_ws): the ") + what + " cache";
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, cache, dims, view.strides, box,
                         CU_TENSOR_MAP_SWIZZLE_128B, name.c_str());
}

// What both warp-specialised launches set up: the kernel's shared-memory opt-in, the caches' TMA
// maps and the row tiles per (sequence, kv head).
struct WsLaunch {
  CUtensorMap k_map, v_map;
  int64_t tiles;
};
WsLaunch ws_launch_setup(const void* kernel, size_t smem, const AttnShape& s, const AttnBatch& b,
                         const bf16* k_cache, const bf16* v_cache) {
  ensure_smem_optin(kernel, smem);
  const AttnCacheTmaView view = attention_prefill_tma_view(s);
  DS_CHECK(view.ok, "attention prefill (wgmma_ws): no TMA view of a cache with ", s.n_kv_heads,
           " kv heads x ", s.page_size, "-token pages");
  WsLaunch l;
  l.k_map = cache_tensor_map(view, k_cache, "K");
  l.v_map = cache_tensor_map(view, v_cache, "V");
  const int group = s.n_heads / s.n_kv_heads;
  l.tiles = (int64_t(b.max_q_len) * group + kWgRows - 1) / kWgRows;
  DS_CHECK(l.tiles <= 0x7fffffff, "attention prefill: too many row tiles (", l.tiles, ")");
  return l;
}

template <int KS, int VS, bool kLean, int kTune = 0>
void launch_ws(const AttnShape& s, const AttnBatch& b, const bf16* q, const bf16* k_cache,
               const bf16* v_cache, AttnGate gate, bf16* out, cudaStream_t stream) {
  constexpr size_t smem = ws_smem_bytes<KS, VS>();
  static_assert(smem <= 227 * 1024, "shared memory of one block");
  auto* kernel = attention_prefill_ws_kernel<KS, VS, kLean, kTune>;
  const WsLaunch l =
      ws_launch_setup(reinterpret_cast<const void*>(kernel), smem, s, b, k_cache, v_cache);
  // Heads first (the heaviest row tiles of every kv head start first) while the tiles fit grid y
  // (up to 1.4M tokens at group 6), else one kv head after the other.
  const bool heads_fastest = l.tiles <= 65535;
  const dim3 grid = heads_fastest ? dim3(s.n_kv_heads, unsigned(l.tiles), b.n_seqs)
                                  : dim3(unsigned(l.tiles), s.n_kv_heads, b.n_seqs);
  kernel<<<grid, kWsThreads, smem, stream>>>(s, b, q, l.k_map, l.v_map, gate, out, heads_fastest);
  DS_CUDA_LAUNCH_CHECK();
}

template <int KS, int VS, bool kLean>
void launch_wsp(const AttnShape& s, const AttnBatch& b, const bf16* q, const bf16* k_cache,
                const bf16* v_cache, AttnGate gate, bf16* out, cudaStream_t stream) {
  constexpr size_t smem = ws_smem_bytes<KS, VS>();
  static_assert(smem <= 227 * 1024, "shared memory of one block");
  auto* kernel = attention_prefill_wsp_kernel<KS, VS, kLean>;
  const WsLaunch l =
      ws_launch_setup(reinterpret_cast<const void*>(kernel), smem, s, b, k_cache, v_cache);
  DS_CHECK(l.tiles * s.n_kv_heads <= 0x7fffffff, "attention prefill: too many row tiles (",
           l.tiles, " x ", s.n_kv_heads, " kv heads)");
  const int64_t n_items = l.tiles * s.n_kv_heads * b.n_seqs;
  int dev = 0, n_sms = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, dev));
  const unsigned grid = unsigned(std::min<int64_t>(n_items, std::max(n_sms, 1)));
  kernel<<<grid, kWsThreads, smem, stream>>>(s, b, q, l.k_map, l.v_map, gate, out, int(l.tiles),
                                             n_items);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool attention_prefill_mma_supported(const AttnShape& s) {
  return s.head_dim == kHd && s.page_size > 0 && s.page_size % kBn == 0 && s.n_kv_heads > 0 &&
         s.n_heads % s.n_kv_heads == 0;
}

AttnCacheTmaView attention_prefill_tma_view(const AttnShape& s) {
  AttnCacheTmaView v;
  if (!attention_prefill_mma_supported(s)) return v;
  const uint64_t block_rows = uint64_t(s.n_kv_heads) * uint64_t(s.page_size);
  v.dims[0] = kHd;
  v.dims[1] = block_rows;
  v.dims[2] = uint64_t(INT32_MAX) + 1;  // every block id an int32 table entry can hold
  v.strides[0] = kRowBytes;
  v.strides[1] = block_rows * kRowBytes;
  // Encoder limits: dims <= 2^32, strides < 2^40 and multiples of 16; a tile's row coordinate
  // (head * page + slot, up to block_rows - 64) is a signed 32-bit number.
  v.ok = block_rows <= uint64_t(INT32_MAX) && v.strides[1] < (uint64_t(1) << 40);
  return v;
}

void launch_attention_prefill_mma(AttnMmaKernel kernel, const AttnShape& s, const AttnBatch& b,
                                  const bf16* q, const bf16* k_cache, const bf16* v_cache,
                                  AttnGate gate, bf16* out, cudaStream_t stream) {
  DS_CHECK(attention_prefill_mma_supported(s), "attention prefill (mma/wgmma): needs head_dim 256 ",
           "and page_size % ", kBn, " == 0 (got head_dim ", s.head_dim, ", page_size ", s.page_size,
           ")");
  if (b.n_seqs <= 0 || b.max_q_len <= 0) return;
  switch (kernel) {
    case AttnMmaKernel::kWgmmaM128:
      return launch_wgmma(s, b, q, k_cache, v_cache, gate, out, stream);
    case AttnMmaKernel::kWgmmaWs:
    case AttnMmaKernel::kWgmmaWs3:
    case AttnMmaKernel::kWgmmaWsLean:
    case AttnMmaKernel::kWgmmaWs3Lean:
    case AttnMmaKernel::kWgmmaWs3Persist:
    case AttnMmaKernel::kWgmmaWs3LeanPersist:
    case AttnMmaKernel::kWgmmaWsULean:
    case AttnMmaKernel::kWgmmaWsLazy:
      // A cache the TMA map cannot describe (attention_prefill_tma_view) runs wgmma_m128: the
      // same outputs bit for bit.
      if (!attention_prefill_tma_view(s).ok)
        return launch_wgmma(s, b, q, k_cache, v_cache, gate, out, stream);
      switch (kernel) {
        case AttnMmaKernel::kWgmmaWs:
          return launch_ws<2, 2, false>(s, b, q, k_cache, v_cache, gate, out, stream);
        case AttnMmaKernel::kWgmmaWs3:
          return launch_ws<3, 2, false>(s, b, q, k_cache, v_cache, gate, out, stream);
        case AttnMmaKernel::kWgmmaWsLean:
          return launch_ws<2, 2, true>(s, b, q, k_cache, v_cache, gate, out, stream);
        case AttnMmaKernel::kWgmmaWs3Lean:
          return launch_ws<3, 2, true>(s, b, q, k_cache, v_cache, gate, out, stream);
        case AttnMmaKernel::kWgmmaWs3Persist:
          return launch_wsp<3, 2, false>(s, b, q, k_cache, v_cache, gate, out, stream);
        case AttnMmaKernel::kWgmmaWs3LeanPersist:
          return launch_wsp<3, 2, true>(s, b, q, k_cache, v_cache, gate, out, stream);
        case AttnMmaKernel::kWgmmaWsULean:
          return launch_ws<2, 2, true, 1>(s, b, q, k_cache, v_cache, gate, out, stream);
        case AttnMmaKernel::kWgmmaWsLazy:
          return launch_ws<2, 2, true, 2>(s, b, q, k_cache, v_cache, gate, out, stream);
        default:
          break;
      }
      break;
  }
  ds::throw_error("attention prefill (mma): unknown kernel ", static_cast<int>(kernel));
}

}  // namespace ds::cuda
