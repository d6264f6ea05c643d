// Decode attention (one query token per sequence) over the paged KV cache, split-KV
// (flash-decoding): the keys of a sequence are cut into splits; one block per (split, kv head,
// sequence) computes an unnormalised partial softmax for all query heads of the GQA group at once
// (each K/V byte is read once, not once per query head); a second kernel merges the partials by
// log-sum-exp, divides, multiplies by sigmoid(gate) and writes bf16.
// How the splits are cut (attention_decode.h AttnDecodeSplit):
//  - kPlanned: n_splits splits of kv_chunk keys (the host's plan for the batch's context bucket);
//    splits past a sequence's length write an empty partial (m = -inf, l = 0, o = 0) that the
//    merge skips, so the grid may be sized for the longest sequence (or larger: CUDA graphs
//    capture one grid per batch bucket). The merge: one block per (query head, sequence).
//  - kAdaptive (mma kernel): each block derives its sequence's split size from kv_len on the
//    device (adaptive_split: at most n_splits splits of at least kv_chunk keys, a multiple of the
//    8-key tile); unused splits exit without writing and the merge reads only the used ones. Its
//    merge kernel cuts the head_dim columns into slices (one block per (query head, slice,
//    sequence)) at small batch and keeps every load of a thread in flight at once.
//    Optionally launched under PDL (attention_decode.h AttnDecodeLaunch::pdl): the split kernel's
//    blocks fetch the cached K/V of positions < kv_len - 1 before griddepcontrol.wait, i.e. while
//    rope_kv (the kernel before it in the engine) still runs, and read q and the newest K/V row
//    after it; the merge kernel is a programmatic dependent of the split kernel.
// Workspace (attention_decode_workspace_bytes): o partials float [n_seqs, n_heads, n_splits, hd]
// then (m, l) float2 [n_seqs, n_heads, n_splits] for the mma kernel (o first for aligned float4
// reads); the simt kernel stores (m, l) first. m is in the log2 domain of the scaled scores.
//
// Two split kernels (kernels.h AttnDecodeKernel; kAuto takes the first that supports the shape):
//  - mma (head_dim 128 / 256, group <= 8, 16-byte aligned q and caches): tensor cores. 4 warps per
//    block, each warp takes every 4th tile of 8 keys of the split and streams its tiles through
//    its own 3-stage cp.async ring in shared memory (2 tiles of K and V in flight per warp while
//    one is computed; no block barrier in the loop). S = Q K^T with mma m16n8k16 (the GQA group's
//    query heads are the M rows, padded to 16; the 8 keys are N), online softmax in fp32 (exp2),
//    then O^T += V^T P^T with mma m16n8k8 (head_dim is M, the 8 keys are K, the 8 heads N): P goes
//    from the S accumulators straight into the B operand, no shuffle through shared memory. Q,
//    K and V fragments come from 16-byte loads; the order of the head dims inside each mma is
//    permuted consistently (Q with K, V with the output), which a dot product does not see. K and
//    V rows are XOR-swizzled in shared memory so that the fragment loads hit distinct banks. The
//    4 warps' partials are merged in shared memory at the end. P is rounded to bf16 for the PV
//    product (as FlashAttention does); l and m stay fp32.
//  - simt (head_dim 32/64/128/256, group <= 8, kPlanned only): the first version, kept as the
//    fallback: 4 warps take keys round-robin, a lane holds head_dim/32 dims, dot products by warp
//    shuffles; its merge walks the splits serially.
// Other shapes go to the prefill kernel through the dispatch registry (attention_decode_supported).
// Measured on the H200 (27B: 24 q / 4 kv heads, hd 256, page 64; tests/cuda/
// cuda_attention_decode_test.cpp Timing: split + merge per launch in a CUDA graph, KV rotated past
// L2, TB/s of KV read; session 2, kPlanned at most 64 splits), mma vs simt us:
//   batch 1:  4K 14.5 (1.15 TB/s) vs 37.1;  16K 27.7 (2.42) vs 106;   32K 43.4 (3.09) vs 196
//   batch 4:  4K 26.9 (2.50) vs 101;    16K 73.4 (3.66) vs 370;   32K 136 (3.96) vs 727
//   batch 16: 4K 72.8 (3.69) vs 369;    16K 254 (4.23) vs 1439;   32K 490 (4.38) vs 2865
// kAdaptive / PDL vs kPlanned: docs/perf/decode_kernels.md (session 5, attnd7).
// AttnDecodeLaunch::cluster (kAdaptive; session 22, not yet measured): 16 splits per (kv head,
// sequence) launched as one cluster of 16 blocks; after the block merge each block keeps its
// partial in shared memory, and block r merges head-dim slice r of the group from all 16 through
// distributed shared memory (cluster_merge): no merge kernel, no partials in global memory.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include <cooperative_groups.h>

#include "cuda/attention_decode.h"
#include "cuda/cuda_common.h"
#include "cuda/kernels.h"
#include "cuda/rope_kv.cuh"

namespace ds::cuda {
namespace {

constexpr int kMaxGroup = 8;

// ---- simt split kernel (fallback) -------------------------------------------------------------

constexpr int kSimtWarps = 4;

template <int HD>
__global__ void __launch_bounds__(kSimtWarps * 32)
    attention_decode_simt_kernel(AttnShape s, AttnBatch b,
                                 const bf16* __restrict__ q,        // [n_rows, n_heads, HD]
                                 const bf16* __restrict__ k_cache,  // [blocks, n_kv, page, HD]
                                 const bf16* __restrict__ v_cache, int kv_chunk, int n_splits,
                                 float2* __restrict__ part_ml,  // [n_seqs, n_heads, n_splits]
                                 float* __restrict__ part_o) {  // [n_seqs, n_heads, n_splits, HD]
  // dims per lane
  constexpr int kEpl = HD / 32;
  __shared__ float sm_m[kSimtWarps][kMaxGroup], sm_l[kSimtWarps][kMaxGroup];
  __shared__ float sm_o[kSimtWarps][kMaxGroup][HD];
  const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = s.n_heads / s.n_kv_heads;
  const int kv_len = b.kv_len[seq];
  const int k_begin = split * kv_chunk, k_end = min(kv_len, k_begin + kv_chunk);
  const int32_t* btab = b.block_table + (int64_t)seq * b.block_table_stride;
  const int64_t qrow = b.q_start[seq];
  const float scale_log2 = rsqrtf((float)HD) * 1.4426950408889634f;

  float qv[kMaxGroup][kEpl], acc[kMaxGroup][kEpl], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kEpl; ++e) {
      acc[g][e] = 0.f;
      qv[g][e] =
          g < group
              ? __bfloat162float(q[(qrow * s.n_heads + kvh * group + g) * HD + lane * kEpl + e]) *
                    scale_log2
              : 0.f;
    }
  }

  for (int key = k_begin + warp; key < k_end; key += kSimtWarps) {
    const int64_t blk = btab[key / s.page_size];
    const int64_t off =
        ((blk * s.n_kv_heads + kvh) * s.page_size + key % s.page_size) * HD + lane * kEpl;
    float kf[kEpl], vf[kEpl];
    if constexpr (kEpl == 1) {
      kf[0] = __bfloat162float(k_cache[off]);
      vf[0] = __bfloat162float(v_cache[off]);
    } else {
#pragma unroll
      for (int e = 0; e < kEpl; e += 2) {
        const __nv_bfloat162 k2 = *reinterpret_cast<const __nv_bfloat162*>(k_cache + off + e);
        const __nv_bfloat162 v2 = *reinterpret_cast<const __nv_bfloat162*>(v_cache + off + e);
        kf[e] = __low2float(k2);
        kf[e + 1] = __high2float(k2);
        vf[e] = __low2float(v2);
        vf[e + 1] = __high2float(v2);
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      float d = 0.f;
#pragma unroll
      for (int e = 0; e < kEpl; ++e) d += qv[g][e] * kf[e];
      d = warp_sum(d);
      const float m_new = fmaxf(m[g], d);
      const float corr = exp2f(m[g] - m_new);  // m[g] = -inf -> 0
      const float p = exp2f(d - m_new);
      l[g] = l[g] * corr + p;
#pragma unroll
      for (int e = 0; e < kEpl; ++e) acc[g][e] = acc[g][e] * corr + p * vf[e];
      m[g] = m_new;
    }
  }

  // Merge the warps of the block.
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) break;
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < kEpl; ++e) sm_o[warp][g][lane * kEpl + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * HD; i += kSimtWarps * 32) {
    const int g = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kSimtWarps; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float lsum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kSimtWarps; ++w) {
        const float f = exp2f(sm_m[w][g] - mx);
        lsum += sm_l[w][g] * f;
        o += sm_o[w][g][d] * f;
      }
    }
    const int64_t idx = ((int64_t)seq * s.n_heads + kvh * group + g) * n_splits + split;
    part_o[idx * HD + d] = o;
    if (d == 0) part_ml[idx] = make_float2(mx, lsum);
  }
}

// The simt variant's merge: one block per (query head, sequence), one thread per dim, the splits
// walked one after another.
template <int HD>
__global__ void __launch_bounds__(HD)
    attention_decode_merge_serial_kernel(AttnShape s, AttnBatch b, int n_splits,
                                         const float2* __restrict__ part_ml,
                                         const float* __restrict__ part_o, AttnGate gate,
                                         bf16* __restrict__ out) {  // [n_rows, n_heads, HD]
  // PDL: a dependent launched with programmatic stream serialization (the attn_o GEMV) may
  // start now; it reads this kernel's output only after griddepcontrol.wait, which waits for
  // this whole grid to finish and flush. No effect on a dependent launched without PDL.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int h = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int64_t base = ((int64_t)seq * s.n_heads + h) * n_splits;
  float mx = -INFINITY;
  for (int i = 0; i < n_splits; ++i) mx = fmaxf(mx, part_ml[base + i].x);
  float lsum = 0.f, o = 0.f;
  if (mx != -INFINITY) {
    for (int i = 0; i < n_splits; ++i) {
      const float2 ml = part_ml[base + i];
      if (ml.x == -INFINITY) continue;
      const float f = exp2f(ml.x - mx);
      lsum += ml.y * f;
      o += part_o[(base + i) * HD + d] * f;
    }
  }
  const int64_t row = b.q_start[seq];
  float y = lsum > 0.f ? o / lsum : 0.f;
  if (gate.ptr)
    y *= sigmoid(
        __bfloat162float(gate.ptr[row * gate.token_stride + (int64_t)h * gate.head_stride + d]));
  out[(row * s.n_heads + h) * HD + d] = __float2bfloat16_rn(y);
}

// ---- mma split kernel --------------------------------------------------------------------------

constexpr int kMmaWarps = 4;
constexpr int kTile = 8;    // keys per tile (the N of QK^T, the K of PV)
constexpr int kStages = 3;  // cp.async ring depth per warp

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_1688(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// 16 bytes global -> shared; src_bytes 0 writes zeros without reading.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half)
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <int HD>
constexpr int mma_smem_bytes() {
  return kMmaWarps * kStages * 2 * kTile * HD * 2;  // ring: [warp][stage][K|V][key][HD] bf16
}

// Lane (g = lane / 4, t = lane % 4) roles, per tile of 8 keys:
//  QK (m16n8k16, k-steps of 16 dims taken in pairs u): A = Q rows (head g; rows 8..15 zero),
//    B = K^T (key g). One 16-byte chunk, dims [32u + 8t, +8), gives the lane's A regs of two
//    k-steps (Q) and its B regs of two k-steps (K): logical k 2t, 2t+1 -> dims +0, +1 (step 2u)
//    and +4, +5 (step 2u+1); k 2t+8, 2t+9 -> +2, +3 and +6, +7. C: S[head g][keys 2t, 2t+1].
//  PV (m16n8k8): A = V^T (rows = dims, cols = keys 2t, 2t+1), B = P^T (keys 2t, 2t+1 of head g:
//    exactly the S accumulators), C = O^T[dims][heads 2t, 2t+1]. m-tile 8I + j, row r: dim
//    128I + 8r + j (r < 8) or 128I + 64 + 8(r-8) + j, so a lane's A pairs come from 16-byte
//    chunks 16I + g and 16I + 8 + g of keys 2t and 2t+1 (two bf16 of one dim packed by prmt).
// Shared memory swizzle (16-byte chunk c of key row r): K at c ^ ((r & 1) << 2), V at

// The block merge's floats at the start of the shared memory: m, l [warps][8], o [warps][8][HD].
template <int HD>
constexpr int block_merge_floats() {
  return 2 * kMmaWarps * kMaxGroup + kMmaWarps * kMaxGroup * HD;
}

// kAdaptive's split of one sequence: n_used splits of `chunk` keys (a multiple of the tile).
struct SplitPlan {
  int chunk, n_used;
};
__device__ __forceinline__ SplitPlan adaptive_split(int kv_len, int min_chunk, int max_splits) {
  if (kv_len <= 0) return {kTile, 0};
  const int n = min(max_splits, (kv_len + min_chunk - 1) / min_chunk);  // >= 1
  const int chunk = ((kv_len + n - 1) / n + kTile - 1) / kTile * kTile;
  return {chunk, (kv_len + chunk - 1) / chunk};
}

__device__ __forceinline__ void pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Waits until the previous kernel of the stream has completed and its writes are visible (a
// no-op when the kernel was not launched as a programmatic dependent).
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// The weight of a split's partial: 2^(m_i - max), 0 for an empty split (or when all are empty).
__device__ __forceinline__ float merge_weight(float m_i, float mx) {
  return (mx == -INFINITY || m_i == -INFINITY) ? 0.f : exp2f(m_i - mx);
}

// kCluster: the kAttnDecodeClusterSplits split blocks of one (kv head, sequence) form a cluster;
// each leaves its partial (o [group][HD] fp32, then (m, l) per head) in its own shared memory at
// `cl` and block `rank` merges head-dim slice `rank` of every query head of the group from all the
// cluster's partials (distributed shared memory), with the merge kernel's formula per element
// (weights 2^(m_i - max), o / lsum, times sigmoid(gate)) but its own summation order (one fma
// chain in split order; the merge kernel sums in a tree), and writes the bf16 output. Two cluster barriers: the partials are complete before any is read, and no
// block leaves (its shared memory with it) while another still reads.
template <int HD>
__device__ __forceinline__ void cluster_merge(const AttnShape& s, const AttnBatch& b,
                                              const AttnGate& gate, bf16* out, float* cl,
                                              int group, int kvh, int seq, int rank) {
  namespace cg = cooperative_groups;
  constexpr int kSplits = kAttnDecodeClusterSplits;
  constexpr int kDims = HD / kSplits;
  cg::cluster_group cluster = cg::this_cluster();
  // The partials written (release) before any block reads another's (acquire). (.aligned: every
  // warp arrives converged.)
  __syncwarp();
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  const int64_t row = b.q_start[seq];
  for (int i = threadIdx.x; i < group * kDims; i += blockDim.x) {
    const int hh = i / kDims, d = rank * kDims + i % kDims;
    float m[kSplits], l[kSplits], o_i[kSplits];
#pragma unroll
    for (int r = 0; r < kSplits; ++r) {
      const float* rc = cluster.map_shared_rank(cl, r);
      m[r] = rc[kMaxGroup * HD + 2 * hh];
      l[r] = rc[kMaxGroup * HD + 2 * hh + 1];
      o_i[r] = rc[hh * HD + d];
    }
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < kSplits; ++r) mx = fmaxf(mx, m[r]);
    float lsum = 0.f, o = 0.f;
#pragma unroll
    for (int r = 0; r < kSplits; ++r) {
      const float w = merge_weight(m[r], mx);
      lsum = __fmaf_rn(l[r], w, lsum);
      o = __fmaf_rn(w, o_i[r], o);
    }
    const int h = kvh * group + hh;
    float y = lsum > 0.f ? o / lsum : 0.f;
    if (gate.ptr)
      y *= sigmoid(__bfloat162float(
          gate.ptr[row * gate.token_stride + (int64_t)h * gate.head_stride + d]));
    out[(row * s.n_heads + h) * HD + d] = __float2bfloat16_rn(y);
  }
  // No block leaves (its shared memory with it) before every block has read what it needs: the
  // reads above are complete (their values are stored), so the arrival needs no memory order.
  __syncwarp();
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
               "barrier.cluster.wait.aligned;\n" ::: "memory");
}

// kAdaptive = false: split `split` covers keys [split * kv_chunk, +kv_chunk), every split writes a
// partial. kAdaptive = true: the split comes from adaptive_split(kv_len, kv_chunk, n_splits);
// unused splits write nothing (kCluster: an empty partial in shared memory, for the cluster
// merge); the kernel may run as a programmatic dependent (see the PDL
// comment in the body).
// q, part_ml and part_o are plain pointers (no const __restrict__): under PDL q is written by the
// previous kernel, and ptxas may move ld.global.nc loads above griddepcontrol.wait
// (docs/perf/decode_kernels.md, "PDL and const __restrict__").
// kRope (kAdaptive only): rope_kv's work done here (attention_decode.h AttnDecodeRope): q comes
// from rope.qkv through shared memory, and the block holding a sequence's newest key writes that
// K / V row to the cache (through rope.k_cache / v_cache, the same buffers) before reading it back.
// kCluster (kAdaptive only; launched in clusters of kAttnDecodeClusterSplits along the splits):
// no partials in global memory and no merge kernel: cluster_merge above, after the block merge.
template <int HD, bool kAdaptive, bool kRope = false, bool kCluster = false>
__global__ void __launch_bounds__(kMmaWarps * 32, 2)
    attention_decode_mma_kernel(AttnShape s, AttnBatch b,
                                const bf16* q,                     // [n_rows, n_heads, HD]
                                const bf16* __restrict__ k_cache,  // [blocks, n_kv, page, HD]
                                const bf16* __restrict__ v_cache,  // [blocks, n_kv, page, HD]
                                int kv_chunk, int n_splits,
                                float2* part_ml,  // [n_seqs, n_heads, n_splits]
                                float* part_o,    // [n_seqs, n_heads, n_splits, HD]
                                AttnDecodeRope rope, AttnGate gate, bf16* out) {
  static_assert(kAdaptive || !kRope, "the fused rope needs the adaptive split");
  static_assert(kAdaptive || !kCluster, "the cluster merge needs the adaptive split");
  static_assert(HD == 128 || HD == 256, "mma decode: head_dim 128 or 256");
  // PDL: the merge kernel (a programmatic dependent in kAdaptive; kCluster: the next kernel, the
  // attn_o GEMV, reads the output) reads the partials only after
  // its griddepcontrol.wait, which waits for this whole grid; its blocks may become resident now.
  if constexpr (kAdaptive) pdl_trigger();
  constexpr int kRowBytes = HD * 2;
  constexpr int kTileBytes = kTile * kRowBytes;  // K (or V) of one tile
  constexpr int kStageBytes = 2 * kTileBytes;
  constexpr int kChunks = HD / 8;                // 16-byte chunks per row
  constexpr int kCopies = kTile * kChunks / 32;  // cp.async per lane per tile, K and V each
  constexpr int kU = HD / 32;                    // pairs of QK k-steps
  constexpr int kI = HD / 128;                   // groups of 8 PV m-tiles
  constexpr int kMt = HD / 16;                   // PV m-tiles
  extern __shared__ __align__(16) unsigned char smem[];

  const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int group = s.n_heads / s.n_kv_heads;
  // PDL: everything read before pdl_wait() below is final before the previous kernel (rope_kv)
  // started: the step metadata (kv_len, q_start, block table) is copied from the host before the
  // forward's first kernel, and the cached K/V rows of positions < kv_len - 1 were written by
  // earlier forwards (the engine synchronises its stream after each forward; a decode step
  // writes only each sequence's newest row, position kv_len - 1). q and that row are read after
  // the wait.
  const int kv_len = b.kv_len[seq];
  int chunk = kv_chunk;
  if constexpr (kAdaptive) {
    const SplitPlan p = adaptive_split(kv_len, kv_chunk, n_splits);
    if (split >= p.n_used) {
      // Unused split: nothing to write. Wait anyway, so that this grid's completion (which the
      // merge and every later kernel wait for) always implies the previous kernel's.
      pdl_wait();
      if constexpr (kCluster) {  // an empty partial (m = -inf, l = 0, o = 0), then the merge
        float* cl = reinterpret_cast<float*>(smem) + block_merge_floats<HD>();
        for (int i = threadIdx.x; i < kMaxGroup * HD; i += kMmaWarps * 32) cl[i] = 0.f;
        for (int i = threadIdx.x; i < kMaxGroup; i += kMmaWarps * 32) {
          cl[kMaxGroup * HD + 2 * i] = -INFINITY;
          cl[kMaxGroup * HD + 2 * i + 1] = 0.f;
        }
        cluster_merge<HD>(s, b, gate, out, cl, s.n_heads / s.n_kv_heads, blockIdx.y, blockIdx.z,
                          split);
      }
      return;
    }
    chunk = p.chunk;
  }
  const int k_begin = split * chunk;
  const int k_end = min(kv_len, k_begin + chunk);
  const int n_tiles = k_end > k_begin ? (k_end - k_begin + kTile - 1) / kTile : 0;
  const int n_my = n_tiles > warp ? (n_tiles - warp + kMmaWarps - 1) / kMmaWarps : 0;
  const int32_t* btab = b.block_table + (int64_t)seq * b.block_table_stride;
  const int64_t head_elems = (int64_t)s.page_size * HD;
  const int64_t blk_elems = (int64_t)s.n_kv_heads * head_elems;
  const bf16* kbase = k_cache + kvh * head_elems;
  const bf16* vbase = v_cache + kvh * head_elems;
  // One page lookup per tile when no tile crosses a page.
  const bool tile_in_page = s.page_size % kTile == 0 && chunk % kTile == 0;
  unsigned char* ring = smem + warp * kStages * kStageBytes;
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));

  // Tile j of this warp (keys k_begin + (warp + 4j) * 8 ...) into stage j % kStages; always
  // commits a group (empty past the end) so the wait counts stay uniform.
  auto issue = [&](int j) {
    if (j < n_my) {
      const int k0 = k_begin + (warp + j * kMmaWarps) * kTile;
      const uint32_t kst = ring_s + (j % kStages) * kStageBytes, vst = kst + kTileBytes;
      int64_t tile_off = 0;
      if (tile_in_page)
        tile_off = btab[k0 / s.page_size] * blk_elems + (int64_t)(k0 % s.page_size) * HD;
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const int c = lane + 32 * i;
        const int r = c / kChunks, ch = c % kChunks;  // key row in the tile, chunk in the row
        const int key = k0 + r;
        const bool ok = key < k_end;
        int64_t off = 0;
        if (ok)
          off = tile_in_page
                    ? tile_off + (int64_t)r * HD
                    : btab[key / s.page_size] * blk_elems + (int64_t)(key % s.page_size) * HD;
        off += ch * 8;
        cp_async_16(kst + r * kRowBytes + ((ch ^ ((r & 1) << 2)) << 4), kbase + off, ok ? 16 : 0);
        cp_async_16(vst + r * kRowBytes + ((ch ^ (((r >> 1) & 3) << 1)) << 4), vbase + off,
                    ok ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  // The ring's first tiles. kAdaptive: before the wait only the leading tiles whose keys are all
  // < kv_len - 1 (in order, so the commit groups stay in tile order); the rest after it.
  int n_pre = kStages - 1;
  if constexpr (kAdaptive) {
    n_pre = 0;
    while (n_pre < kStages - 1 &&
           (n_pre >= n_my || k_begin + (warp + n_pre * kMmaWarps) * kTile + kTile <= kv_len - 1))
      ++n_pre;
  }
  for (int j = 0; j < n_pre; ++j) issue(j);
  // kRope: the token's RoPE angles (sin, cos per rotary pair) into a shared table before the wait:
  // positions are step metadata, so the transcendental work overlaps the previous kernel and only
  // the norm and the rotation stay after the wait.
  // sq and the angles live in the last warp's last ring stage, which no copy fills before that
  // warp's first main-loop step (tiles 0 and 1 go to stages 0 and 1); the block barrier after
  // the q fragments are read keeps it so (the shared-memory size stays the plain kernel's: 2
  // blocks per SM).
  static_assert(kMaxGroup * HD * 2 + HD / 2 * 8 <= kStageBytes, "sq + angles fit one stage");
  [[maybe_unused]] bf16* sq = reinterpret_cast<bf16*>(
      smem + ((kMmaWarps - 1) * kStages + kStages - 1) * kStageBytes);
  [[maybe_unused]] float2* angles = reinterpret_cast<float2*>(sq + kMaxGroup * HD);
  [[maybe_unused]] int64_t rope_row = 0;
  [[maybe_unused]] int rope_slot = -1;
  if constexpr (kRope) {
    rope_row = b.q_start[seq];
    rope_slot = rope.slot_mapping[rope_row];
    const float pos = static_cast<float>(rope.positions[rope_row]);
    for (int j = threadIdx.x; j < s.rotary_dim / 2; j += kMmaWarps * 32)
      rope_angle(s, pos, j, &angles[j].x, &angles[j].y);
    __syncthreads();
  }
  if constexpr (kAdaptive) pdl_wait();
  // kRope: the group's query heads, normalised and rotated, into sq [group][HD] (after the rings);
  // in the block that holds the newest key (the last used split: k_end == kv_len), also that
  // key row (normalised, rotated) and its value row into the cache. Work items (the group's
  // heads, then K, then V) go round-robin to the warps, one warp per item as in rope_kv.
  if constexpr (kRope) {
    constexpr int E = HD / 32;
    const bf16* prow = rope.qkv + rope_row * s.qkv_dim();
    const float pos = 0.f;  // unused: the angles come from the table
    const int slot = rope_slot;
    const int n_items = group + (k_end == kv_len && slot >= 0 ? 2 : 0);
    // A warp's items (at most 3: group <= 8, plus K and V) are loaded first, all in flight at
    // once, then normalised and rotated one after another.
    constexpr int kMaxItems = (kMaxGroup + 2 + kMmaWarps - 1) / kMmaWarps;
    auto src_of = [&](int it) {
      return it < group ? prow + (int64_t)(kvh * group + it) * HD * (s.gated ? 2 : 1)
                        : prow + s.q_proj_dim() + (it == group ? 0 : s.kv_dim()) + kvh * HD;
    };
    float x[kMaxItems][E];
#pragma unroll
    for (int k = 0; k < kMaxItems; ++k)
      if (warp + k * kMmaWarps < n_items) load_bf<E>(src_of(warp + k * kMmaWarps) + lane * E, x[k]);
#pragma unroll
    for (int k = 0; k < kMaxItems; ++k) {
      const int it = warp + k * kMmaWarps;
      if (it >= n_items) break;
      float y[E];
      if (it <= group) {  // a query head, or the key: one inlined copy of the norm + rotation
        norm_rope_lane_x<HD, true>(s, x[k], it < group ? rope.q_norm_w : rope.k_norm_w, pos,
                                   lane, y, angles);
        store_bf<E>(it < group ? sq + it * HD + lane * E
                               : cache_row(s, rope.k_cache, slot, kvh, HD) + lane * E,
                    y);
      } else {
        copy_bf<E>(cache_row(s, rope.v_cache, slot, kvh, HD) + lane * E,  // v: the bits as is
                   src_of(it) + lane * E);
      }
    }
    // sq is complete, and the newest K / V row is stored before any thread copies its tile
    // (cp.async below, after this barrier: bar.sync orders the block's memory accesses).
    __syncthreads();
  }
  for (int j = n_pre; j < kStages - 1; ++j) issue(j);

  // Q fragments (zeros for the padding heads), scores scaled in fp32 after the product. Read
  // through L2 (ld.global.cg, coherent): under PDL the previous kernel wrote q.
  uint4 qa[kU];
  if constexpr (kRope) {
    const bf16* qh = sq + g * HD + 8 * t;
#pragma unroll
    for (int u = 0; u < kU; ++u)
      qa[u] = g < group ? *reinterpret_cast<const uint4*>(qh + 32 * u) : make_uint4(0, 0, 0, 0);
    __syncthreads();  // every warp holds its q fragments before the last warp's stage 2 refills
  } else {
    const int64_t qrow = b.q_start[seq];
    const bf16* qh = q + (qrow * s.n_heads + kvh * group + g) * HD + 8 * t;
#pragma unroll
    for (int u = 0; u < kU; ++u)
      qa[u] = g < group ? __ldcg(reinterpret_cast<const uint4*>(qh + 32 * u))
                        : make_uint4(0, 0, 0, 0);
  }
  const float scale_log2 = rsqrtf((float)HD) * 1.4426950408889634f;

  float acc[kMt][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;  // of head g (the same in the 4 lanes of a group)

  for (int j = 0; j < n_my; ++j) {
    issue(j + kStages - 1);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    const unsigned char* kst = ring + (j % kStages) * kStageBytes;
    const unsigned char* vst = kst + kTileBytes;
    const int k0 = k_begin + (warp + j * kMmaWarps) * kTile;

    // S = Q K^T: [16 heads (6 used), 8 keys]
    // Two accumulators (even / odd k-steps) halve the dependent mma chain.
    float sc[4] = {0.f, 0.f, 0.f, 0.f}, sc2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint4 kk = *reinterpret_cast<const uint4*>(kst + g * kRowBytes +
                                                       (((4 * u + t) ^ ((g & 1) << 2)) << 4));
      mma_16816(sc, qa[u].x, 0u, qa[u].y, 0u, kk.x, kk.y);
      mma_16816(sc2, qa[u].z, 0u, qa[u].w, 0u, kk.z, kk.w);
    }
    sc[0] += sc2[0];
    sc[1] += sc2[1];
    // Online softmax of head g over keys 2t, 2t+1 (masked past the split / sequence).
    const int kb = k0 + 2 * t;
    const float x0 = kb < k_end ? sc[0] * scale_log2 : -INFINITY;
    const float x1 = kb + 1 < k_end ? sc[1] * scale_log2 : -INFINITY;
    float mx = fmaxf(x0, x1);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    const float corr = exp2f(m_run - m_use);
    const float p0 = exp2f(x0 - m_use), p1 = exp2f(x1 - m_use);
    l_run = l_run * corr + p0 + p1;
    m_run = m_new;
    // The accumulator columns are heads 2t and 2t+1: their factors live in lanes 8t and 8t+4.
    const float c_a = __shfl_sync(0xffffffffu, corr, 8 * t);
    const float c_b = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
    const uint32_t pb = pack_bf16(p0, p1);
    // O^T += V^T P^T
#pragma unroll
    for (int I = 0; I < kI; ++I) {
      const int pos0 = (16 * I + g) ^ (t << 1), pos1 = (16 * I + 8 + g) ^ (t << 1);
      const uint4 va0 = *reinterpret_cast<const uint4*>(vst + (2 * t) * kRowBytes + (pos0 << 4));
      const uint4 vb0 =
          *reinterpret_cast<const uint4*>(vst + (2 * t + 1) * kRowBytes + (pos0 << 4));
      const uint4 va1 = *reinterpret_cast<const uint4*>(vst + (2 * t) * kRowBytes + (pos1 << 4));
      const uint4 vb1 =
          *reinterpret_cast<const uint4*>(vst + (2 * t + 1) * kRowBytes + (pos1 << 4));
      const uint32_t a0w[4] = {va0.x, va0.y, va0.z, va0.w}, b0w[4] = {vb0.x, vb0.y, vb0.z, vb0.w};
      const uint32_t a1w[4] = {va1.x, va1.y, va1.z, va1.w}, b1w[4] = {vb1.x, vb1.y, vb1.z, vb1.w};
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const uint32_t sel = (jj & 1) ? 0x7632u : 0x5410u;
        float(&c)[4] = acc[8 * I + jj];
        c[0] *= c_a;
        c[1] *= c_b;
        c[2] *= c_a;
        c[3] *= c_b;
        mma_1688(c, __byte_perm(a0w[jj >> 1], b0w[jj >> 1], sel),
                 __byte_perm(a1w[jj >> 1], b1w[jj >> 1], sel), pb);
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);

  // Merge the 4 warps in shared memory (the rings are free now).
  __syncthreads();
  float* sm_m = reinterpret_cast<float*>(smem);  // [warps][8]
  float* sm_l = sm_m + kMmaWarps * kMaxGroup;    // [warps][8]
  float* sm_o = sm_l + kMmaWarps * kMaxGroup;    // [warps][8][HD]
  if (t == 0) {
    sm_m[warp * kMaxGroup + g] = m_run;
    sm_l[warp * kMaxGroup + g] = l_run;
  }
#pragma unroll
  for (int I = 0; I < kI; ++I)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int col = 0; col < 2; ++col) {
        float* dst = sm_o + (warp * kMaxGroup + 2 * t + col) * HD + 128 * I + 64 * half + 8 * g;
        const int e = 2 * half + col;
        *reinterpret_cast<float4*>(dst) =
            make_float4(acc[8 * I][e], acc[8 * I + 1][e], acc[8 * I + 2][e], acc[8 * I + 3][e]);
        *reinterpret_cast<float4*>(dst + 4) =
            make_float4(acc[8 * I + 4][e], acc[8 * I + 5][e], acc[8 * I + 6][e], acc[8 * I + 7][e]);
      }
  __syncthreads();
  for (int i = threadIdx.x; i < group * HD; i += kMmaWarps * 32) {
    const int hh = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) mx = fmaxf(mx, sm_m[w * kMaxGroup + hh]);
    float lsum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) {
        const float f = exp2f(sm_m[w * kMaxGroup + hh] - mx);  // empty warp: -inf -> 0
        lsum += sm_l[w * kMaxGroup + hh] * f;
        o += sm_o[(w * kMaxGroup + hh) * HD + d] * f;
      }
    }
    if constexpr (kCluster) {
      float* cl = reinterpret_cast<float*>(smem) + block_merge_floats<HD>();
      cl[hh * HD + d] = o;
      if (d == 0) {
        cl[kMaxGroup * HD + 2 * hh] = mx;
        cl[kMaxGroup * HD + 2 * hh + 1] = lsum;
      }
    } else {
      const int64_t idx = ((int64_t)seq * s.n_heads + kvh * group + hh) * n_splits + split;
      part_o[idx * HD + d] = o;
      if (d == 0) part_ml[idx] = make_float2(mx, lsum);
    }
  }
  if constexpr (kCluster)
    cluster_merge<HD>(s, b, gate, out, reinterpret_cast<float*>(smem) + block_merge_floats<HD>(),
                      group, kvh, seq, split);
}

// Merge: one block of 256 threads per (query head, sequence). The split weights 2^(m_i - max) are
// computed in parallel into shared memory; then thread (group, c) sums float4 column c of the o
// partials over the splits group, group + G, ... (G = 256 / (HD / 4) split groups) with
// independent 16-byte loads (every partial is written by the split kernel, empty ones as zeros,
// so none is skipped), and the G group sums are added in shared memory.
constexpr int kMergeThreads = 256;

__device__ __forceinline__ void fma4(float4& acc, float w, const float4 v) {
  acc.x = __fmaf_rn(w, v.x, acc.x);
  acc.y = __fmaf_rn(w, v.y, acc.y);
  acc.z = __fmaf_rn(w, v.z, acc.z);
  acc.w = __fmaf_rn(w, v.w, acc.w);
}

// out[row, h, 4c .. 4c+3] = bf16(o / lsum * sigmoid(gate)) (0 where lsum is 0: no keys).
template <int HD>
__device__ __forceinline__ void merge_store(const AttnShape& s, const float4 acc, float lsum,
                                            const AttnGate& gate, int64_t row, int h, int c,
                                            bf16* out) {  // [n_rows, n_heads, HD]
  const float o[4] = {acc.x, acc.y, acc.z, acc.w};
  bf16* dst = out + (row * s.n_heads + h) * HD + 4 * c;
  const bf16* gp = gate.ptr
                       ? gate.ptr + row * gate.token_stride + (int64_t)h * gate.head_stride + 4 * c
                       : nullptr;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float y = lsum > 0.f ? o[e] / lsum : 0.f;
    if (gp) y *= sigmoid(__bfloat162float(gp[e]));
    dst[e] = __float2bfloat16_rn(y);
  }
}

// merge_store with the gate's 4 values already loaded (gv; used when gated).
template <int HD>
__device__ __forceinline__ void merge_store_gated(const AttnShape& s, const float4 acc, float lsum,
                                                  bool gated, const float (&gv)[4], int64_t row,
                                                  int h, int c, bf16* out) {
  const float o[4] = {acc.x, acc.y, acc.z, acc.w};
  bf16* dst = out + (row * s.n_heads + h) * HD + 4 * c;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float y = lsum > 0.f ? o[e] / lsum : 0.f;
    if (gated) y *= sigmoid(gv[e]);
    dst[e] = __float2bfloat16_rn(y);
  }
}

template <int HD>
__global__ void __launch_bounds__(kMergeThreads) attention_decode_merge_kernel(
    AttnShape s, AttnBatch b, int n_splits,
    const float2* __restrict__ part_ml,  // [n_seqs, n_heads, splits]
    const float* __restrict__ part_o,    // [.., splits, HD], 16B-aligned
    AttnGate gate,
    bf16* __restrict__ out) {  // [n_rows, n_heads, HD]
  constexpr int kCols = HD / 4;
  constexpr int kGroups = kMergeThreads / kCols;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // PDL: as in the serial merge
  extern __shared__ float w_split[];  // [n_splits]
  __shared__ float scratch[32];
  __shared__ float4 red[kGroups][kCols];
  const int h = blockIdx.x, seq = blockIdx.y, tid = threadIdx.x;
  const int c = tid % kCols, grp = tid / kCols;
  const int64_t base = ((int64_t)seq * s.n_heads + h) * n_splits;
  const int64_t row = b.q_start[seq];
  float mx = -INFINITY;
  for (int i = tid; i < n_splits; i += kMergeThreads) mx = fmaxf(mx, part_ml[base + i].x);
  mx = block_max(mx, scratch);
  float lsum = 0.f;
  for (int i = tid; i < n_splits; i += kMergeThreads) {
    const float2 ml = part_ml[base + i];
    const float w = merge_weight(ml.x, mx);
    w_split[i] = w;
    lsum = __fmaf_rn(ml.y, w, lsum);
  }
  lsum = block_sum(lsum, scratch);  // its barriers also publish w_split
  const float4* po = reinterpret_cast<const float4*>(part_o + base * HD) + c;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
  for (int i = grp; i < n_splits; i += kGroups) {
    fma4(acc, w_split[i], po[(int64_t)i * kCols]);
  }
  red[grp][c] = acc;
  __syncthreads();
  if (grp != 0) return;
#pragma unroll
  for (int g = 1; g < kGroups; ++g) {
    const float4 r = red[g][c];
    acc.x += r.x;
    acc.y += r.y;
    acc.z += r.z;
    acc.w += r.w;
  }
  merge_store<HD>(s, acc, lsum, gate, row, h, c, out);
}


// kAdaptive's merge: one block of 256 threads per (query head, column slice, sequence): kSlices
// slices of HD / kSlices columns (kSlices > 1 at small batch, so that more SMs share the
// partials' bytes: 96 blocks instead of 24 at batch 1 of the 27B shape). Every block redoes the
// split weights of its head (a few dozen (m, l) pairs), then thread (group, c) sums float4 column
// c over the splits group, group + G, ... (G = 256 / columns) with all its loads in flight, and
// the G group sums are added in shared memory. Reads only the n_used splits of its sequence.
// Under PDL (a programmatic dependent of the split kernel) the partials are read after
// griddepcontrol.wait, through L2 (ld.global.cg), from plain pointers.
template <int HD, int kSlices>
__global__ void __launch_bounds__(kMergeThreads) attention_decode_merge_adaptive_kernel(
    AttnShape s, AttnBatch b, int min_chunk, int n_splits,
    const float2* part_ml,  // [n_seqs, n_heads, n_splits]
    const float* part_o,    // [.., n_splits, HD], 16B-aligned
    AttnGate gate,
    bf16* __restrict__ out,  // [n_rows, n_heads, HD]
    bool early_dependents, bool one_trip) {
  constexpr int kCols = HD / 4 / kSlices;         // float4 columns of this block
  constexpr int kGroups = kMergeThreads / kCols;  // split groups
  constexpr int kPre = 8;                         // partial columns loaded with the (m, l)
  static_assert(kCols * kGroups == kMergeThreads, "merge: columns must divide the block");
  extern __shared__ float w_split[];  // [n_splits]
  __shared__ float scratch[32];
  __shared__ float4 red[kGroups][kCols];
  const int h = blockIdx.x / kSlices, slice = blockIdx.x % kSlices, seq = blockIdx.y;
  const int tid = threadIdx.x, c = tid % kCols, grp = tid / kCols;
  // Step metadata: final before the split kernel started (see its PDL comment).
  const int n_used = adaptive_split(b.kv_len[seq], min_chunk, n_splits).n_used;
  const int64_t row = b.q_start[seq];
  const int64_t base = ((int64_t)seq * s.n_heads + h) * n_splits;
  // PDL: the attn_o GEMV (a programmatic dependent) reads `out` only after its own wait, which
  // waits for this whole grid: it may launch before or after this block's wait.
  if (early_dependents) pdl_trigger();
  pdl_wait();  // the split kernel's partials
  if (!early_dependents) pdl_trigger();
  const float4* po = reinterpret_cast<const float4*>(part_o + base * HD) + slice * kCols + c;
  // Every load that does not need another's result goes out now, in one round trip: this
  // thread's first (m, l), its first kPre partial columns and (group 0) its gate values. The sums
  // below use them in exactly the order of the loops they replace (bit-identical output).
  // $DS_ATTN_MERGE=serial keeps the previous form (each phase's loads after the last barrier).
  float2 ml0 = make_float2(-INFINITY, 0.f);
  float4 pre[kPre];
  float gv[4] = {1.f, 1.f, 1.f, 1.f};
  if (one_trip) {
    if (tid < n_used) ml0 = __ldcg(&part_ml[base + tid]);
#pragma unroll
    for (int j = 0; j < kPre; ++j) {
      const int i = grp + j * kGroups;
      if (i < n_used) pre[j] = __ldcg(po + (int64_t)i * (HD / 4));
    }
    if (grp == 0 && gate.ptr) {
      const bf16* gp = gate.ptr + row * gate.token_stride + (int64_t)h * gate.head_stride +
                       4 * (slice * kCols + c);
#pragma unroll
      for (int e = 0; e < 4; ++e) gv[e] = __bfloat162float(gp[e]);
    }
  }
  auto ml_at = [&](int i) { return one_trip && i == tid ? ml0 : __ldcg(&part_ml[base + i]); };
  float mx = -INFINITY;
  for (int i = tid; i < n_used; i += kMergeThreads) mx = fmaxf(mx, ml_at(i).x);
  mx = block_max(mx, scratch);
  float lsum = 0.f;
  for (int i = tid; i < n_used; i += kMergeThreads) {
    const float2 ml = ml_at(i);
    const float w = merge_weight(ml.x, mx);
    w_split[i] = w;
    lsum = __fmaf_rn(ml.y, w, lsum);
  }
  lsum = block_sum(lsum, scratch);  // its barriers also publish w_split
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  int i = grp;
  if (one_trip) {
#pragma unroll
    for (int j = 0; j < kPre; ++j, i += kGroups)
      if (i < n_used) fma4(acc, w_split[i], pre[j]);
  }
#pragma unroll 8
  for (; i < n_used; i += kGroups) fma4(acc, w_split[i], __ldcg(po + (int64_t)i * (HD / 4)));
  red[grp][c] = acc;
  __syncthreads();
  if (grp != 0) return;
#pragma unroll
  for (int gi = 1; gi < kGroups; ++gi) {
    const float4 r = red[gi][c];
    acc.x += r.x;
    acc.y += r.y;
    acc.z += r.z;
    acc.w += r.w;
  }
  if (one_trip) {
    merge_store_gated<HD>(s, acc, lsum, gate.ptr != nullptr, gv, row, h, slice * kCols + c, out);
    return;
  }
  merge_store<HD>(s, acc, lsum, gate, row, h, slice * kCols + c, out);
}

constexpr int kMaxMergeSplits = 8192;  // the merge's shared weights: 32 KB (+ static scratch)

// A launch of `grid` in clusters of kAttnDecodeClusterSplits blocks along x, the programmatic
// attribute too when `pdl`; `attr` (2 entries) holds the attributes lc points at.
cudaLaunchConfig_t cluster_16_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                     bool pdl, cudaLaunchAttribute (&attr)[2]) {
  cudaLaunchConfig_t lc = {};
  lc.gridDim = grid;
  lc.blockDim = block;
  lc.dynamicSmemBytes = smem;
  lc.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kAttnDecodeClusterSplits;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  lc.attrs = attr;
  lc.numAttrs = pdl ? 2 : 1;
  return lc;
}

// Whether `func` can run in clusters of kAttnDecodeClusterSplits blocks of `block` threads and
// `smem` bytes on the current device (non-portable size allowed first); asked once per (kernel,
// device). When it cannot, the caller runs the two-kernel path instead.
bool cluster_16_fits(const void* func, dim3 block, size_t smem) {
  int device = 0;
  DS_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, bool> known;
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find({func, device});
  if (it != known.end()) return it->second;
  cudaError_t e = cudaFuncSetAttribute(func, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  int clusters = 0;
  if (e == cudaSuccess) {
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t lc =
        cluster_16_config(dim3(kAttnDecodeClusterSplits), block, smem, nullptr, false, attr);
    e = cudaOccupancyMaxActiveClusters(&clusters, func, &lc);
  }
  if (e != cudaSuccess) (void)cudaGetLastError();  // this query's own (non-sticky) error
  const bool ok = e == cudaSuccess && clusters >= 1;
  known[{func, device}] = ok;
  return ok;
}

// The mma split kernel + its merge. Workspace: o partials (16-byte aligned for the merge's float4
// loads), then (m, l).
template <int HD>
void launch_mma_hd(const AttnShape& s, const AttnBatch& b, const bf16* q, const bf16* k_cache,
                   const bf16* v_cache, AttnGate gate, int kv_chunk, int n_splits, void* partials,
                   bf16* out, cudaStream_t stream, const AttnDecodeLaunch& how) {
  constexpr int kSmem = mma_smem_bytes<HD>();
  static_assert(kSmem >= block_merge_floats<HD>() * 4, "the block merge reuses the rings");
  static_assert(kSmem >= (block_merge_floats<HD>() + kMaxGroup * (HD + 2)) * 4,
                "the cluster merge's partial follows the block merge's floats in the rings");
  float* o = static_cast<float*>(partials);
  float2* ml = reinterpret_cast<float2*>(o + (size_t)b.n_seqs * s.n_heads * n_splits * HD);
  const dim3 grid(n_splits, s.n_kv_heads, b.n_seqs);
  const size_t merge_smem = n_splits * sizeof(float);
  if (how.split == AttnDecodeSplit::kAdaptive) {
    const bool rope = how.rope.qkv != nullptr;
    auto* cluster_k = rope ? attention_decode_mma_kernel<HD, true, true, true>
                           : attention_decode_mma_kernel<HD, true, false, true>;
    if (how.cluster) {
      DS_CHECK(n_splits == kAttnDecodeClusterSplits, "attention decode: the cluster merge needs ",
               kAttnDecodeClusterSplits, " splits, got ", n_splits);
      ensure_smem_optin(reinterpret_cast<const void*>(cluster_k), kSmem);
    }
    // (A device that cannot hold such a cluster runs the same 16 splits with the merge kernel.)
    if (how.cluster &&
        cluster_16_fits(reinterpret_cast<const void*>(cluster_k), dim3(kMmaWarps * 32), kSmem)) {
      // One cluster of kAttnDecodeClusterSplits split blocks per (kv head, sequence), merging in
      // distributed shared memory: no merge kernel (its programmatic dependent, the attn_o GEMV,
      // depends on this grid directly).
      cudaLaunchAttribute attr[2];
      const cudaLaunchConfig_t lc =
          cluster_16_config(grid, dim3(kMmaWarps * 32), kSmem, stream, how.pdl, attr);
      DS_CUDA_CHECK(cudaLaunchKernelEx(&lc, cluster_k, s, b, q, k_cache, v_cache, kv_chunk,
                                       n_splits, ml, o, how.rope, gate, out));
      return;
    }
    auto* split_k = rope ? attention_decode_mma_kernel<HD, true, true>
                         : attention_decode_mma_kernel<HD, true, false>;
    ensure_smem_optin(reinterpret_cast<const void*>(split_k), kSmem);
    launch_maybe_pdl(split_k, grid, dim3(kMmaWarps * 32), kSmem, stream, how.pdl, s, b, q,
                     k_cache, v_cache, kv_chunk, n_splits, ml, o, how.rope, gate, out);
    DS_CUDA_LAUNCH_CHECK();
    // Column slices while the (query head, sequence) blocks alone would leave most SMs idle.
    int dev = 0, n_sms = 0;
    DS_CUDA_CHECK(cudaGetDevice(&dev));
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, dev));
    constexpr int kSlices = HD / 64;
    if ((int64_t)b.n_seqs * s.n_heads < n_sms)
      launch_maybe_pdl(attention_decode_merge_adaptive_kernel<HD, kSlices>,
                       dim3(s.n_heads * kSlices, b.n_seqs), dim3(kMergeThreads), merge_smem,
                       stream, how.pdl, s, b, kv_chunk, n_splits, ml, o, gate, out,
                       how.pdl && how.early_dependents,
                       !how.serial_merge && attention_merge_one_trip());
    else
      launch_maybe_pdl(attention_decode_merge_adaptive_kernel<HD, 1>,
                       dim3(s.n_heads, b.n_seqs), dim3(kMergeThreads), merge_smem, stream,
                       how.pdl, s, b, kv_chunk, n_splits, ml, o, gate, out,
                       how.pdl && how.early_dependents,
                       !how.serial_merge && attention_merge_one_trip());
    DS_CUDA_LAUNCH_CHECK();
    return;
  }
  ensure_smem_optin(reinterpret_cast<const void*>(attention_decode_mma_kernel<HD, false>), kSmem);
  attention_decode_mma_kernel<HD, false><<<grid, kMmaWarps * 32, kSmem, stream>>>(
      s, b, q, k_cache, v_cache, kv_chunk, n_splits, ml, o, AttnDecodeRope{}, gate, out);
  DS_CUDA_LAUNCH_CHECK();
  attention_decode_merge_kernel<HD>
      <<<dim3(s.n_heads, b.n_seqs), kMergeThreads, merge_smem, stream>>>(s, b, n_splits, ml, o,
                                                                          gate, out);
  DS_CUDA_LAUNCH_CHECK();
}

template <int HD>
void launch_simt_hd(const AttnShape& s, const AttnBatch& b, const bf16* q, const bf16* k_cache,
                    const bf16* v_cache, AttnGate gate, int kv_chunk, int n_splits, void* partials,
                    bf16* out, cudaStream_t stream) {
  float2* ml = static_cast<float2*>(partials);
  float* o = reinterpret_cast<float*>(ml + (size_t)b.n_seqs * s.n_heads * n_splits);
  dim3 grid(n_splits, s.n_kv_heads, b.n_seqs);
  attention_decode_simt_kernel<HD>
      <<<grid, kSimtWarps * 32, 0, stream>>>(s, b, q, k_cache, v_cache, kv_chunk, n_splits, ml, o);
  DS_CUDA_LAUNCH_CHECK();
  attention_decode_merge_serial_kernel<HD>
      <<<dim3(s.n_heads, b.n_seqs), HD, 0, stream>>>(s, b, n_splits, ml, o, gate, out);
  DS_CUDA_LAUNCH_CHECK();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

size_t attention_decode_workspace_bytes(const AttnShape& s, int n_seqs, int n_splits) {
  return (size_t)n_seqs * s.n_heads * n_splits * (sizeof(float2) + sizeof(float) * s.head_dim);
}

int attention_decode_kv_chunk(int n_seqs, int n_kv_heads, int max_kv_len, int n_sms,
                              int max_splits) {
  const int per_split_blocks = n_seqs * n_kv_heads > 0 ? n_seqs * n_kv_heads : 1;
  // At most one wave of the split kernel at 2 blocks per SM (the mma kernel's occupancy): a second,
  // mostly empty wave cost 12% at batch 4 x 32K (17 splits, 272 blocks) on the H200.
  int splits = 2 * n_sms / per_split_blocks;
  const int by_len = (max_kv_len + 63) / 64;
  if (splits > by_len) splits = by_len;
  if (splits > max_splits) splits = max_splits;
  if (splits < 1) splits = 1;
  int chunk = (max_kv_len + splits - 1) / splits;
  chunk = ((chunk + 63) / 64) * 64;
  if (chunk < 64) chunk = 64;
  // The chunk must keep n_splits <= max_splits.
  while ((max_kv_len + chunk - 1) / chunk > max_splits) chunk += 64;
  return chunk;
}

int attention_decode_adaptive_splits(int n_seqs, int n_kv_heads, int n_sms, int max_splits) {
  const int64_t per_split_blocks = std::max<int64_t>(1, (int64_t)n_seqs * n_kv_heads);
  const int64_t splits = std::min<int64_t>(2 * (int64_t)n_sms / per_split_blocks, max_splits);
  return static_cast<int>(std::max<int64_t>(1, splits));
}

bool attention_decode_supported(const AttnShape& s) {
  const int hd = s.head_dim;
  return (hd == 32 || hd == 64 || hd == 128 || hd == 256) && s.n_kv_heads > 0 &&
         s.n_heads % s.n_kv_heads == 0 && s.n_heads / s.n_kv_heads <= kMaxGroup;
}

bool attention_decode_mma_supported(const AttnShape& s) {
  return attention_decode_supported(s) && (s.head_dim == 128 || s.head_dim == 256);
}

AttnDecodeMode attention_decode_mode() {
  static const AttnDecodeMode mode = [] {
    const char* env = std::getenv("DS_ATTN_DECODE");
    const std::string v = env ? env : "";
    if (v.empty()) return kDefaultAttnDecodeMode;
    if (v == "pdl_rope") return AttnDecodeMode::kPdlRope;
    if (v == "pdl") return AttnDecodeMode::kPdl;
    if (v == "pdl_early") return AttnDecodeMode::kPdlEarly;
    if (v == "adaptive") return AttnDecodeMode::kAdaptive;
    if (v == "planned") return AttnDecodeMode::kPlanned;
    if (v == "pdl_cluster") return AttnDecodeMode::kPdlCluster;
    ds::throw_error(
        "DS_ATTN_DECODE must be pdl, pdl_early, pdl_rope, pdl_cluster, adaptive or planned, got '",
        v, "'");
  }();
  return mode;
}

bool attention_merge_one_trip() {
  static const bool one = [] {
    const char* env = std::getenv("DS_ATTN_MERGE");
    const std::string v = env ? env : "";
    if (v.empty() || v == "one_trip") return true;
    if (v == "serial") return false;
    ds::throw_error("DS_ATTN_MERGE must be one_trip or serial, got '", v, "'");
  }();
  return one;
}

void launch_attention_decode(const AttnShape& s, const AttnBatch& b, const bf16* q,
                             const bf16* k_cache, const bf16* v_cache, AttnGate gate, int kv_chunk,
                             int n_splits, void* partials, bf16* out, cudaStream_t stream) {
  launch_attention_decode(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials, out,
                          stream, AttnDecodeLaunch{});
}

void launch_attention_decode(const AttnShape& s, const AttnBatch& b, const bf16* q,
                             const bf16* k_cache, const bf16* v_cache, AttnGate gate, int kv_chunk,
                             int n_splits, void* partials, bf16* out, cudaStream_t stream,
                             AttnDecodeKernel which) {
  AttnDecodeLaunch how;
  how.which = which;
  launch_attention_decode(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials, out,
                          stream, how);
}

void launch_attention_decode(const AttnShape& s, const AttnBatch& b, const bf16* q,
                             const bf16* k_cache, const bf16* v_cache, AttnGate gate, int kv_chunk,
                             int n_splits, void* partials, bf16* out, cudaStream_t stream,
                             const AttnDecodeLaunch& how) {
  if (b.n_seqs <= 0) return;
  check_attn_shape(s);
  DS_CHECK(attention_decode_supported(s), "attention decode: head_dim ", s.head_dim, " / group ",
           s.n_heads / s.n_kv_heads, " not supported by the split-KV kernel");
  const bool adaptive = how.split == AttnDecodeSplit::kAdaptive;
  DS_CHECK(n_splits >= 1 && kv_chunk >= 1, "attention decode: ", n_splits, " splits of ",
           kv_chunk, " tokens");
  DS_CHECK(adaptive || (int64_t)n_splits * kv_chunk >= b.max_kv_len, "attention decode: ",
           n_splits, " splits of ", kv_chunk, " tokens cannot cover ", b.max_kv_len, " tokens");
  DS_CHECK(adaptive || !how.pdl,
           "attention decode: PDL needs the adaptive split (AttnDecodeSplit::kAdaptive)");
  DS_CHECK(adaptive || !how.cluster,
           "attention decode: the cluster merge needs the adaptive split (AttnDecodeSplit::kAdaptive)");
  const AttnDecodeRope& rope = how.rope;
  if (rope.qkv) {
    DS_CHECK(adaptive, "attention decode: the fused rope needs the adaptive split");
    DS_CHECK(qk_norm_rope_kv_warp_supported(s) && s.qkv_dim() % 8 == 0 && aligned16(rope.qkv) &&
                 aligned16(rope.q_norm_w) && aligned16(rope.k_norm_w),
             "attention decode: the fused rope needs head_dim 128 / 256 with rotary_dim / 2 a "
             "multiple of head_dim / 32 (got rotary_dim ",
             s.rotary_dim, "), 16-byte aligned projection rows and norm weights");
    DS_CHECK(rope.positions && rope.slot_mapping && rope.k_cache == k_cache &&
                 rope.v_cache == v_cache,
             "attention decode: the fused rope needs positions, slot_mapping and the caches the "
             "attention reads");
  }
  const bool mma_ok = attention_decode_mma_supported(s) && n_splits <= kMaxMergeSplits &&
                      (rope.qkv || aligned16(q)) && aligned16(k_cache) && aligned16(v_cache) &&
                      aligned16(partials);
  DS_CHECK((how.which != AttnDecodeKernel::kMma && !adaptive) || mma_ok,
           "attention decode: the mma kernel", adaptive ? " (needed by the adaptive split)" : "",
           " needs head_dim 128 or 256 (got ", s.head_dim,
           "), group <= 8, 16-byte aligned q / caches / workspace and at most ", kMaxMergeSplits,
           " splits");
  DS_CHECK(!adaptive || how.which != AttnDecodeKernel::kSimt,
           "attention decode: the simt kernel has no adaptive split");
  if (how.which != AttnDecodeKernel::kSimt && mma_ok) {
    if (s.head_dim == 256)
      return launch_mma_hd<256>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials, out,
                                stream, how);
    return launch_mma_hd<128>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials, out,
                              stream, how);
  }
  switch (s.head_dim) {
    case 32:
      return launch_simt_hd<32>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials, out,
                                stream);
    case 64:
      return launch_simt_hd<64>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials, out,
                                stream);
    case 128:
      return launch_simt_hd<128>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials, out,
                                 stream);
    case 256:
      return launch_simt_hd<256>(s, b, q, k_cache, v_cache, gate, kv_chunk, n_splits, partials, out,
                                 stream);
  }
}

}  // namespace ds::cuda
