// Gated DeltaNet decode: one fused kernel per layer for one new token in each of n_seqs sequences
// (layouts in gdn.h). One cluster of 4 blocks (128 threads each) per (sequence, value head); block
// z owns state rows [z*d_v/4, (z+1)*d_v/4):
//  0. every global load is issued first: the block's state rows (fp32, d_k contiguous, 16-byte
//     loads, DK/4 lanes per row, all rows in flight at once), then the conv inputs, weights and
//     gate inputs, so the kernel pays about one memory latency before it computes;
//  1. conv: 4 channels per thread, the 4 taps of each (3 from the slot's ring, rows
//     (p-3..p-1) % 4, zero before position 0, plus the new input), SiLU;
//  2. q/k l2norm (q * d_k^-0.5) as shuffle reductions (q lives on threads [0, DK/4), k on
//     [DK/4, DK/2)), beta = sigmoid(b), e^g = exp(-exp(A_log) softplus(a + dt_bias));
//  3. per row, in registers: decay by e^g, u = S k, S += k beta (v - u), o = S q;
//  4. gated RMSNorm: the head's sum of o^2 is reduced across the cluster through distributed
//     shared memory (no global store is outstanding at that barrier, so it does not wait on
//     memory);
//  5. stores: the state rows (read and written once), the new input into ring row p % 4 (v
//     channels by the block that owns them, q/k channels by block 0 of the first value head of
//     the key group; no block reads row p % 4, so the in-place update has no race), and
//     y = w * o * rsqrt(mean(o^2) + eps) * silu(z) as bf16 (the out_proj input).
// Specialised on d_k (16/32/64/128, template) and on 8-byte aligned rows (VEC; scalar loads
// otherwise); d_v is any of 16..128 at run time.
// Block split: 4-block clusters (above) or 8-block clusters (d_v / 8 rows per block).
// The streaming kernel (kStream, gdn_decode_stream_kernel) does the same steps with one 256-thread
// block per (sequence, value head): thread 0 starts the head's state (d_v rows, 64 KiB at 27B) as
// bulk copies (cp.async.bulk, 8 KiB chunks, one mbarrier each) into a ring of 4 shared-memory
// chunk buffers before anything else; the warps update each chunk's rows as soon as it lands and
// store them straight from registers, so a head's reads and writes overlap; the block holds the
// whole head, so the gated norm needs no cluster barrier. 5 blocks per SM (48 registers; a cap at
// 40 for 6 per SM measured 4-5% slower at batch 4, 8, 32). kStreamWhole keeps the whole head in
// flight (64 KiB, 3 blocks per SM; slower) for A/B runs.
// The split streaming kernels (kSplit2 / kSplit4, gdn_decode_split_kernel) run the streaming
// kernel's code with each head's rows split over a cluster of 2 / 4 blocks (d_v / 2 or d_v / 4
// contiguous rows, 32 / 16 KiB at 27B, all in flight at once: no ring refill); every block sends
// its rows' o to its peers' shared memory by st.async (completing on the peer's mbarrier, so no
// cluster barrier waits behind the state stores) and reduces the whole head's o^2 in kStream's
// order: states AND outputs bit-equal to kStream's. More, shorter blocks: they win where the grid
// still fits one wave (batch 1) or where kStream's spills just past one (batch 16: 768 heads on
// 660 slots).
// The persistent streaming kernels (kPersist / kPersistDeep, gdn_decode_persist_kernel) run the
// streaming kernel's per-head code in a grid of at most one wave (occupancy x SMs blocks: 4 / 3
// per SM, a 4- / 8-chunk ring of 32 / 64 KiB), each block walking the same number of (sequence,
// value head) units with a static stride, its chunks one bulk-copy stream across its units (the
// next unit's copies in flight while the current one finishes): no partial wave at any batch.
// States AND outputs bit-equal to kStream's. H200: kPersistDeep at batch 16 33.0 us vs kSplit2
// 35.3, kStream 37.2 (the one-wave grid: 384 blocks x 2 heads); at batch <= 12 and 32 slower
// than kStream (the unit loop's fixed costs with one or three heads per block).
// PDL (launch_gdn_decode's pdl, the engine's $DS_GDN_DECODE_PDL): every kernel can be launched as
// a programmatic dependent of the in-projection GEMV; the state loads (or bulk copies), the conv
// taps and the weights are issued before griddepcontrol.wait, proj is read after it (pdl_wait
// below says why that is safe). The kernels are the same with or without: only the launch differs.
// Every kernel runs the same per-row code (update_row) and conv / gates code, so all give bit-equal
// states; outputs differ only in the order of the norm's sum of squares.
// kAuto (and the dispatch registry, dispatch.cpp) picks by batch size: kCluster8MaxSeqs,
// kStreamMinSeqs, kSplit4Seqs, kPersistDeepSeqs below.
// Bytes per layer: 2 * n_seqs * n_v_heads * d_v * d_k * 4 (state) + small; 27B batch 1: 6.3 MB.
// Measured on the H200 (tests/cuda/cuda_gdn_decode_test.cpp Timing: 64 launches in a CUDA graph,
// states rotated past L2), session 2, cluster8 / cluster4 us per layer: batch 1 6.27 / 7.25 (1.00 /
// 0.87 TB/s), batch 2 8.82 / 9.88, batch 4 14.9 / 16.4, batch 16 47.6 / 45.7 (2.1 / 2.2 TB/s).
// Streaming kernel: see docs/perf/decode_kernels.md.
// PERF.md: flash-linear-attention 5.9 us at batch 1; target 2 us (not reached: the kernel is
// latency-bound at small batch, one load round trip + the row updates + a cluster barrier).
// Tests: tests/cuda/cuda_gdn_test.cpp (Decode* vs the fp32 CPU recurrence, kAuto) and
// tests/cuda/cuda_gdn_decode_test.cpp (every kernel vs an fp64 CPU step and vs cluster4 over
// carried steps: states bit-equal, outputs within 1e-3; the split and persistent kernels
// bit-equal to kStream in both, the persistent ones also with their grid capped to 1-7 blocks;
// timing of every kernel at batch 1-32 next to a copy of the same bytes).
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "cuda/cluster.cuh"
#include "cuda/cuda_common.h"
#include "cuda/gdn.h"
#include "cuda/mma_util.cuh"

namespace ds::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kDecodeThreads = 128;
// Blocks (one cluster) per (sequence, value head), each d_v / SPLIT rows: 4 when d_v % 16 == 0
// (the shipped shapes), else 1 (the generic fallback, e.g. d_v 24: correct, not fast).
constexpr int kSplitFast = 4;
// The 8-block cluster (d_v / 8 rows per block, 4 per thread at d_v 128) for small batches, where
// 4 blocks per head leave most SMs idle (48 heads x 4 = 192 blocks at batch 1); needs d_v % 32 ==
// 0 (each block's v channels are whole 4-channel conv groups).
constexpr int kMaxD = 128;
// kAuto's choice by batch size: cluster8 up to kCluster8MaxSeqs sequences, the streaming kernel
// from kStreamMinSeqs (when its alignment holds), else cluster4.
// H200 (cuda_gdn_decode_test Timing, us per layer, cluster8 / cluster4 / stream): batch 1 6.5 /
// 7.2 / 8.4, batch 2 9.1 / 9.4 / 9.4, batch 3 13.3 / 11.2 / ~11.0, batch 4 15.5 / 16.4 / 11.2,
// batch 16 50.4 / 45.8 / 32.3 (docs/perf/decode_kernels.md).
constexpr int kCluster8MaxSeqs = 2;
constexpr int kStreamMinSeqs = 3;
// kAuto (as the registry) takes the split streaming kernels only where the whole decode step was
// measured faster on the H200 (bench decode at 4K, one call): the 4-block split at batch 1
// (12.822 -> 12.739 ms per step; kernel 6.84 vs cluster8 6.81-7.15 us, the gain is under PDL),
// the 2-block split at batch 16 (17.120 -> 16.972 ms; kernel 35.2 vs stream 37.0 us). Kernel
// times per batch 1 / 2 / 3 / 4 / 8 / 16 / 32, us (cuda_gdn_decode_test Timing): split4 6.84 /
// 8.37 / 9.72 / 14.4 / 22.9 / 39.5 / 74.0, split2 7.31 / 8.95 / 10.3 / 11.3 / 21.3 / 35.2 / 61.3,
// stream 9.02 / 10.0 / 11.1 / 11.8 / 17.3 / 37.0 / 60.2: each jumps where its grid spills past
// one wave of 5 blocks per SM (660 on 132 SMs), so ranges are not extrapolated.
// At batch 16 the persistent 8-chunk kernel replaced the 2-block split (session 5, gdnd8: bench
// decode at 4K 16.556 / 16.599 -> 16.465 ms per step; kernel 35.3 -> 33.0 us); kSplit2 stays
// the registry's fused_split2 behind it.
constexpr int kSplit4Seqs = 1;
constexpr int kPersistDeepSeqs = 16;
// gdn_decode_pdl_for's default: PDL up to this batch size. H200, bench decode with
// DS_GDN_DECODE_PDL=0 vs 1 in one call (docs/perf/decode_kernels.md), ms per step: batch 1 4K
// 13.486 -> 13.366, 1 32K 13.983 -> 13.884; batch 2 13.838 -> 13.847 and 4 14.962 -> 14.961 (the
// engine's gdn_in there is cuBLASLt, which does not trigger its dependents early: nothing to
// overlap), 16 17.853 -> 17.945 (slower). So batch 1 only.
constexpr int kPdlDefaultMaxSeqs = 1;

// ---- Per-element steps shared by every kernel (same code, so the same rounding) ---------------

// Conv + SiLU of the 4 consecutive channels [ch, ch + 4), in two halves so the PDL kernels can
// issue the first before griddepcontrol.wait: conv4_load_taps reads what an earlier forward wrote
// (the ring rows of positions p-3..p-1, zero before position 0) and the conv weights;
// conv4_silu_x reads the new input (the in-projection's output, returned in xin: the caller writes
// it to ring row p % 4 at the end) and applies the taps.
struct ConvTaps {
  float tap[3][4];  // [tap j][channel i]: ring row of position p - 3 + j
  float wt[16];     // [channel i][tap], conv_w rows ch .. ch + 3
};

template <bool VEC>
__device__ __forceinline__ void conv4_load_taps(const bf16* ring,                 // [4, qkv_dim]
                                                const bf16* __restrict__ conv_w,  // [qkv_dim, 4]
                                                int qkv_dim, int ch, int p, ConvTaps& c) {
  if (VEC) {
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const int pp = p - 3 + j;
      if (pp >= 0)
        load4_bf16(ring + (pp & 3) * qkv_dim + ch, c.tap[j]);
      else
        c.tap[j][0] = c.tap[j][1] = c.tap[j][2] = c.tap[j][3] = 0.f;
    }
    load16_bf16(conv_w + ch * 4, c.wt);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const int pp = p - 3 + j;
        c.tap[j][i] = pp >= 0 ? __bfloat162float(ring[(pp & 3) * qkv_dim + ch + i]) : 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) c.wt[i] = __bfloat162float(conv_w[ch * 4 + i]);
  }
}

template <bool VEC>
__device__ __forceinline__ void conv4_silu_x(const bf16* x,  // [in_dim] this token (not restrict)
                                             int ch, const ConvTaps& c, float (&xin)[4],
                                             float (&y)[4]) {
  if (VEC) {
    load4_bf16(x + ch, xin);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) xin[i] = __bfloat162float(x[ch + i]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float acc = c.wt[4 * i] * c.tap[0][i] + c.wt[4 * i + 1] * c.tap[1][i] +
                      c.wt[4 * i + 2] * c.tap[2][i] + c.wt[4 * i + 3] * xin[i];
    y[i] = acc / (1.f + __expf(-acc));
  }
}

// The l2norm factor of a q or k channel group (thread element e = 4 * tid; q on e < DK, k on
// DK <= e < 2 * DK; q also times d_k^-0.5), 1 for v channels. Shuffles within DK / 4 lanes: every
// lane of the warp must call it.
template <int DK>
__device__ __forceinline__ float qk_norm_scale(const float (&y)[4], int e) {
  float ss = y[0] * y[0] + y[1] * y[1] + y[2] * y[2] + y[3] * y[3];
#pragma unroll
  for (int o = DK / 8; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  float scale = 1.f;
  if (e < 2 * DK) scale = rsqrtf(ss + 1e-6f) * (e < DK ? rsqrtf(static_cast<float>(DK)) : 1.f);
  return scale;
}

// The conv channel of the thread's channel group e = 4 * tid: q on e < DK, k on e < 2 DK, else
// the head's v channels from v0 (meaningful only where the caller's `active` holds).
template <int DK>
__device__ __forceinline__ int conv_channel(const GdnShape& s, int hk, int hv, int d_v, int v0,
                                            int e) {
  if (e < DK) return hk * DK + e;
  if (e < 2 * DK) return s.n_k_heads * DK + hk * DK + (e - DK);
  return 2 * s.n_k_heads * DK + hv * d_v + v0 + (e - 2 * DK);
}

// Steps 1-2 of both fused kernels for the thread's channel group e = 4 * tid (active: e < 2 DK +
// the block's v channels), once its taps are loaded: conv + SiLU of 4 channels into y, the new
// input in xin (both zeros from the caller where inactive), then the l2norm of q / k (every lane
// takes part in the shuffles) and the results in qs / ks / vs.
template <int DK, bool VEC>
__device__ __forceinline__ void conv_norm_to_shared(const bf16* x, const ConvTaps& c,
                                                    bool active, int e, int ch, float (&xin)[4],
                                                    float (&y)[4], float* qs, float* ks,
                                                    float* vs) {
  if (active) conv4_silu_x<VEC>(x, ch, c, xin, y);
  const float scale = qk_norm_scale<DK>(y, e);
  if (active) {
    float* dst = e < DK ? qs + e : (e < 2 * DK ? ks + (e - DK) : vs + (e - 2 * DK));
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = y[i] * scale;
  }
}

// Programmatic dependent launch (launch_gdn_decode with pdl): every kernel below may start while
// the in-projection GEMV that writes `proj` still runs (the bulk GEMVs trigger their dependents
// early). Before this wait a kernel reads only bytes that are final when the forward starts:
//  - seq_pos / slot_ids: the step's metadata, copied host -> device by a cudaMemcpyAsync that is
//    ordered before the forward's first kernel (a copy is never a programmatic dependency, so it
//    has completed before any kernel of the forward, or of its CUDA graph, begins);
//  - the slot's recurrent state and the conv ring rows of positions p-3..p-1 of this layer: only
//    this layer's GDN kernels write them (decode or prefill), each in an EARLIER forward, and an
//    earlier forward's kernels all precede that metadata copy in the stream, so they have
//    completed (and the engine synchronises its stream at the end of every forward); in this
//    forward a slot is in one piece only (run_step rejects a slot twice), and this layer's other
//    GDN kernel (the prefill of the prompt rows, launched after this one) touches other slots;
//  - the layer weights (conv_w, A_log, dt_bias, norm_w): constant while a forward runs.
// After the wait: proj (the GEMV's output) and every global write (the state, the ring row p % 4,
// out): the wait returns once the previous kernel has completed and flushed, and that kernel
// completes only after its own wait, so every earlier kernel of the stream (which may still read
// `out`, e.g. the previous layer's out-projection) has completed too. Without the PDL attribute
// the wait is a no-op.
// proj is NOT declared __restrict__: through a const __restrict__ pointer nvcc reads it on the
// non-coherent path (ld.global.nc: data assumed read-only for the kernel's whole life), which
// griddepcontrol.wait need not order. The first H200 run of PdlAfterGemv27B
// (tests/cuda/cuda_gdn_decode_test.cpp: proj poisoned with NaN before the GEMV) read NaN with
// cluster4 at batch 1 while proj was __restrict__: the PTX issued those .nc loads after the wait,
// but ptxas moved three of them (b, a, z) above it in the SASS (LDG.E.U16.CONSTANT before ACQBULK,
// in 9 of the 38 instantiations; the session-4 PDL audit, cuobjdump of the pre-fix source). Plain
// ld.global loads are never moved across it.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// beta = sigmoid(b), decay = e^g with g = -exp(A_log) * softplus(a + dt_bias) (threshold 20).
__device__ __forceinline__ void gdn_gates(float b_raw, float a_raw, float A_log, float dt_bias,
                                          float& beta, float& decay) {
  beta = 1.f / (1.f + expf(-b_raw));
  const float a_dt = a_raw + dt_bias;
  decay = expf(-expf(A_log) * (a_dt > 20.f ? a_dt : log1pf(expf(a_dt))));
}

// One state row (4 of its d_k values per lane, DK / 4 lanes per row): decay, u = S k,
// S += k beta (v - u), o = S q. Returns the new values; o_v is the row's output on every lane.
template <int DK>
__device__ __forceinline__ float4 update_row(float4 t, const float4& kk, const float4& qq,
                                             float decay, float beta, float v_in, float& o_v) {
  constexpr int kLanesPerRow = DK / 4;
  t.x *= decay;
  t.y *= decay;
  t.z *= decay;
  t.w *= decay;
  float u = t.x * kk.x + t.y * kk.y + t.z * kk.z + t.w * kk.w;
#pragma unroll
  for (int o = kLanesPerRow / 2; o > 0; o >>= 1) u += __shfl_xor_sync(0xffffffffu, u, o);
  const float delta = beta * (v_in - u);
  t.x += kk.x * delta;
  t.y += kk.y * delta;
  t.z += kk.z * delta;
  t.w += kk.w * delta;
  o_v = t.x * qq.x + t.y * qq.y + t.z * qq.z + t.w * qq.w;
#pragma unroll
  for (int o = kLanesPerRow / 2; o > 0; o >>= 1) o_v += __shfl_xor_sync(0xffffffffu, o_v, o);
  return t;
}

// y = w * o * rinv * silu(z) (gated RMSNorm with the head's 1 / rms), or o without a norm.
__device__ __forceinline__ float gated_output(float o, float rinv, float z, float w, bool norm) {
  return norm ? w * o * rinv * (z / (1.f + __expf(-z))) : o;
}

// Ring row p % 4 of a slot's conv ring (which no block reads in this step) gets the new input's 4
// channels [ch, ch + 4) (exact: xin came from bf16).
__device__ __forceinline__ void write_ring_row(bf16* ring, int p, int qkv_dim, int ch,
                                               const float (&xin)[4]) {
  bf16* rw = ring + (p & 3) * qkv_dim + ch;
#pragma unroll
  for (int i = 0; i < 4; ++i) rw[i] = __float2bfloat16(xin[i]);
}

// The 1 / rms of a head whose d_v outputs o sit in shared memory os[], reduced by one 256-thread
// block in a fixed order (warp sums, then the warps' partials in order): the streaming, split and
// persistent kernels all reduce this way, so their outputs are bit-equal. warp_sq: [kMaxD / 32]
// shared floats; every thread of the block must call it (one __syncthreads inside).
__device__ __forceinline__ float block_head_rinv(const float* os, float* warp_sq, int d_v,
                                                 float eps, int tid, int lane, int warp) {
  float sq = tid < d_v ? os[tid] * os[tid] : 0.f;
  sq = warp_sum(sq);
  if (lane == 0) warp_sq[warp] = sq;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxD / 32; ++i) total += warp_sq[i];  // warps past d_v hold 0
  return rsqrtf(total / d_v + eps);
}

// ---- Cluster kernels (cluster4 / cluster8) -----------------------------------------------------
template <int DK, bool VEC, int SPLIT>
__global__ void __cluster_dims__(1, 1, SPLIT) __launch_bounds__(kDecodeThreads)
    gdn_decode_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                      const bf16* proj,  // [n_seqs, in_dim] (no __restrict__: see pdl_wait)
                      const int32_t* __restrict__ seq_pos,   // [n_seqs]
                      const int32_t* __restrict__ slot_ids,  // [n_seqs]
                      bf16* __restrict__ out)                // [n_seqs, n_v_heads * d_v]
{
  constexpr int kLanesPerRow = DK / 4;             // each lane holds 4 consecutive k values
  constexpr int kRowsPerWarp = 32 / kLanesPerRow;  // rows a warp covers per pass
  constexpr int kGroups = (kDecodeThreads / 32) * kRowsPerWarp;  // lane groups in the block
  constexpr int kMaxRows = kMaxD / SPLIT;
  constexpr int kMaxRowsPerGroup = (kMaxRows + kGroups - 1) / kGroups;
  static_assert(2 * DK + kMaxRows <= 4 * kDecodeThreads && kMaxRows <= kDecodeThreads,
                "one pass must cover the conv channels and the outputs");

  __shared__ __align__(16) float qs[DK], ks[DK], vs[kMaxRows], os[kMaxRows];
  __shared__ float part;  // this block's sum of o^2 (read by the whole cluster)
  // PDL: a dependent launched with programmatic stream serialization (the gdn_out GEMV) may
  // start now; it reads this kernel's output only after griddepcontrol.wait, which waits for
  // this whole grid to finish and flush. No effect on a dependent launched without PDL.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  const int seq = blockIdx.x, hv = blockIdx.y, split = blockIdx.z;
  const int ratio = s.n_v_heads / s.n_k_heads, hk = hv / ratio;
  const int d_v = s.d_v, qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  const int rows = d_v / SPLIT, v0 = split * rows;  // this block's state rows [v0, v0 + rows)
  const int p = seq_pos[seq];
  const int64_t slot = slot_ids[seq];
  bf16* ring = pool.conv_state + slot * pool.conv_slot_stride;
  const bf16* x = proj + static_cast<int64_t>(seq) * in_dim;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // 0. Issue every global load first (the state rows are the traffic; the rest is latency).
  // Lane group `grp` owns local rows grp, grp + kGroups, ...; k4 covers k = 4*k4 .. 4*k4+3.
  const int grp = warp * kRowsPerWarp + lane / kLanesPerRow;
  const int k4 = lane % kLanesPerRow;
  float* state =
      pool.rec_state + slot * pool.rec_slot_stride + (static_cast<int64_t>(hv) * d_v + v0) * DK;
  const bool has_state = p > 0;
  float4 st[kMaxRowsPerGroup];
#pragma unroll
  for (int r = 0; r < kMaxRowsPerGroup; ++r) {
    const int v = grp + r * kGroups;
    st[r] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (has_state && v < rows)
      st[r] = __ldcg(reinterpret_cast<const float4*>(state + v * DK + 4 * k4));
  }
  const float A_log = w.A_log[hv], dt_bias = w.dt_bias[hv];
  const bool norm = w.norm_w != nullptr;
  float z_c = 0.f, w_c = 0.f;  // thread c < rows: the gate z and norm weight of its output
  if (tid < rows && norm) w_c = __bfloat162float(w.norm_w[v0 + tid]);
  // 1. conv + SiLU over q (DK), k (DK) and this block's v channels, 4 channels per thread, one
  // pass (2 * 128 + 32 channels = 72 threads at 27B): q on threads [0, DK/4), k on
  // [DK/4, DK/2), so their l2norms are shuffle reductions within aligned lane groups. The taps
  // (earlier tokens) and weights are loaded before the wait, the new input after it.
  const bool write_qk = hv % ratio == 0 && split == 0;
  const int e = 4 * tid;
  const bool active = e < 2 * DK + rows;
  const int ch = conv_channel<DK>(s, hk, hv, d_v, v0, e);
  ConvTaps taps;
  if (active) conv4_load_taps<VEC>(ring, w.conv_w, qkv_dim, ch, p, taps);

  pdl_wait();  // proj is the previous kernel's output (see pdl_wait)
  const float b_raw = __bfloat162float(x[qkv_dim + s.z_dim() + hv]);
  const float a_raw = __bfloat162float(x[qkv_dim + s.z_dim() + s.n_v_heads + hv]);
  if (tid < rows && norm) z_c = __bfloat162float(x[qkv_dim + hv * d_v + v0 + tid]);
  float xin[4] = {0.f, 0.f, 0.f, 0.f}, y[4] = {0.f, 0.f, 0.f, 0.f};
  conv_norm_to_shared<DK, VEC>(x, taps, active, e, ch, xin, y, qs, ks, vs);
  // 2. gates.
  float beta, decay;
  gdn_gates(b_raw, a_raw, A_log, dt_bias, beta, decay);
  __syncthreads();

  // 3. Per row: decay, u = S k, S += k beta (v - u), o = S q (rows stay in registers).
  const float4 kk = *reinterpret_cast<const float4*>(ks + 4 * k4);
  const float4 qq = *reinterpret_cast<const float4*>(qs + 4 * k4);
#pragma unroll
  for (int r = 0; r < kMaxRowsPerGroup; ++r) {
    const int v = grp + r * kGroups;
    float o_v;
    st[r] = update_row<DK>(st[r], kk, qq, decay, beta, v < rows ? vs[v] : 0.f, o_v);
    if (v < rows && k4 == 0) os[v] = o_v;
  }
  __syncthreads();

  // 4. The head's sum of o^2 across the cluster (distributed shared memory). No global store is
  // outstanding at the release barrier, so it does not wait on memory.
  float rinv = 1.f;
  if (norm) {
    if (warp == 0) {
      float sq = 0.f;
      for (int c = lane; c < rows; c += 32) sq += os[c] * os[c];
      sq = warp_sum(sq);
      if (lane == 0) part = sq;
    }
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
            : "memory");
    cg::cluster_group cluster = cg::this_cluster();
    float total = 0.f;
#pragma unroll
    for (int r = 0; r < SPLIT; ++r) total += *cluster.map_shared_rank(&part, r);
    rinv = rsqrtf(total / d_v + s.norm_eps);
    // Peers may exit once everyone has read: arrive now, wait at the very end.
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  }

  // 5. Stores: state rows, the ring, the gated-norm output.
#pragma unroll
  for (int r = 0; r < kMaxRowsPerGroup; ++r) {
    const int v = grp + r * kGroups;
    if (v < rows) __stcg(reinterpret_cast<float4*>(state + v * DK + 4 * k4), st[r]);
  }
  if (active && (e >= 2 * DK || write_qk)) {
    write_ring_row(ring, p, qkv_dim, ch, xin);
  }
  if (tid < rows) {  // rows <= 32 <= threads
    bf16* yo = out + static_cast<int64_t>(seq) * s.out_dim() + hv * d_v + v0;
    yo[tid] = __float2bfloat16(gated_output(os[tid], rinv, z_c, w_c, norm));
  }
  if (norm) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

// ---- Streaming kernel: one block per (sequence, value head) -----------------------------------
// mbarrier + bulk-copy helpers (sm_90). A CTA launched without a cluster is its own cluster of
// one, so its shared::cta addresses are valid shared::cluster destinations.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives once and adds `bytes` to the transaction count the phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@!P1 bra WAIT;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// Bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared,
// completing on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

constexpr int kStreamThreads = 256;
constexpr int kStreamChunkBytes = 8192;  // state rows per bulk copy: 16 rows at d_k 128

template <int DK>
struct StreamCfg {
  static constexpr int kLanesPerRow = DK / 4;
  static constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  static constexpr int kRowsPerPass = (kStreamThreads / 32) * kRowsPerWarp;
  static constexpr int kChunkRows = kStreamChunkBytes / (DK * 4);
  static constexpr int kPasses = kChunkRows / kRowsPerPass;  // rows per lane group per chunk
  static constexpr int kMaxChunks = (kMaxD + kChunkRows - 1) / kChunkRows;
  static_assert(kPasses * kRowsPerPass == kChunkRows, "chunk = whole passes");
  static_assert(2 * DK + kMaxD <= 4 * kStreamThreads && kMaxD <= kStreamThreads,
                "one pass must cover the conv channels and the outputs");
};

// The streaming kernels' per-chunk row code (stream, split, persistent: the same expressions, so
// their states are bit-equal): lane group grp owns the chunk's local rows grp + j * kRowsPerPass;
// row v = c * kChunkRows + j * kRowsPerPass + grp of the block's n_rows. chunk_rows_load takes them
// from the chunk buffer (zero where the sequence starts fresh, or past n_rows); chunk_rows_update
// decays / updates them (update_row), stores them to the state and each row's o to os[v].
template <int DK>
__device__ __forceinline__ void chunk_rows_load(float4 (&t)[StreamCfg<DK>::kPasses],
                                                const float* buf, int c, int grp, int k4,
                                                int n_rows, bool has_state) {
  using C = StreamCfg<DK>;
#pragma unroll
  for (int j = 0; j < C::kPasses; ++j) {
    const int v = c * C::kChunkRows + j * C::kRowsPerPass + grp;
    t[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (has_state && v < n_rows)
      t[j] = *reinterpret_cast<const float4*>(buf + (j * C::kRowsPerPass + grp) * DK + 4 * k4);
  }
}

template <int DK>
__device__ __forceinline__ void chunk_rows_update(float4 (&t)[StreamCfg<DK>::kPasses], int c,
                                                  int grp, int k4, int n_rows, float4 kk,
                                                  float4 qq, float decay, float beta,
                                                  const float* vs, float* state, float* os) {
  using C = StreamCfg<DK>;
#pragma unroll
  for (int j = 0; j < C::kPasses; ++j) {
    const int v = c * C::kChunkRows + j * C::kRowsPerPass + grp;
    float o_v;
    t[j] = update_row<DK>(t[j], kk, qq, decay, beta, v < n_rows ? vs[v] : 0.f, o_v);
    if (v < n_rows) {
      __stcg(reinterpret_cast<float4*>(state + v * DK + 4 * k4), t[j]);
      if (k4 == 0) os[v] = o_v;
    }
  }
}

// Dynamic shared memory of the streaming kernel: STAGES chunk buffers (or fewer chunks, if the
// head has fewer).
template <int DK, int STAGES>
constexpr int stream_smem_bytes() {
  return (STAGES < StreamCfg<DK>::kMaxChunks ? STAGES : StreamCfg<DK>::kMaxChunks) *
         kStreamChunkBytes;
}

// The whole head's d_v state rows pass through a ring of STAGES shared-memory chunk buffers, each
// filled by one bulk copy (issued by thread 0 at the start, all at once when the head fits); the
// warps update a chunk's rows as soon as it lands and store them straight from registers, so the
// head's reads and writes overlap and no block ever waits on another: the gated norm's sum of
// o^2 is the block's own. With STAGES < chunks the buffer of chunk c is refilled with chunk
// c + STAGES once every warp holds chunk c in registers (one block barrier per refill).
template <int DK, bool VEC, int STAGES>
__global__ void __launch_bounds__(kStreamThreads)
    gdn_decode_stream_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                             const bf16* proj,  // [n_seqs, in_dim] (no __restrict__: pdl_wait)
                             const int32_t* __restrict__ seq_pos,   // [n_seqs]
                             const int32_t* __restrict__ slot_ids,  // [n_seqs]
                             bf16* __restrict__ out)                // [n_seqs, n_v_heads * d_v]
{
  using C = StreamCfg<DK>;
  extern __shared__ __align__(128) float chunk_buf[];  // [STAGES][kChunkRows][DK] state rows
  __shared__ __align__(16) float qs[DK], ks[DK], vs[kMaxD], os[kMaxD];
  __shared__ __align__(8) uint64_t full[STAGES];
  __shared__ float warp_sq[kStreamThreads / 32];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // PDL: as in gdn_decode_kernel

  const int seq = blockIdx.x, hv = blockIdx.y;
  const int ratio = s.n_v_heads / s.n_k_heads, hk = hv / ratio;
  const int d_v = s.d_v, qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  const int p = seq_pos[seq];
  const int64_t slot = slot_ids[seq];
  bf16* ring = pool.conv_state + slot * pool.conv_slot_stride;
  const bf16* x = proj + static_cast<int64_t>(seq) * in_dim;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* state = pool.rec_state + slot * pool.rec_slot_stride + static_cast<int64_t>(hv) * d_v * DK;
  const bool has_state = p > 0;  // uniform over the block
  const int n_chunks = (d_v + C::kChunkRows - 1) / C::kChunkRows;

  // Thread 0: chunk c -> buffer c % STAGES, completing on full[c % STAGES].
  const auto issue_chunk = [&](int c) {
    const int rows_c = min(C::kChunkRows, d_v - c * C::kChunkRows);
    const uint32_t bytes = static_cast<uint32_t>(rows_c) * DK * 4;
    uint64_t* bar = &full[c % STAGES];
    mbar_arrive_expect_tx(bar, bytes);
    bulk_copy_g2s(chunk_buf + (c % STAGES) * C::kChunkRows * DK,
                  state + static_cast<int64_t>(c) * C::kChunkRows * DK, bytes, bar);
  };
  // 0. The state stream starts first; the small loads below overlap it.
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) mbar_init(&full[i], 1);
    mbar_init_fence();
    if (has_state)
      for (int c = 0; c < n_chunks && c < STAGES; ++c) issue_chunk(c);
  }
  const float A_log = w.A_log[hv], dt_bias = w.dt_bias[hv];
  const bool norm = w.norm_w != nullptr;
  float z_c = 0.f, w_c = 0.f;  // thread c < d_v: the gate z and norm weight of its output
  if (tid < d_v && norm) w_c = __bfloat162float(w.norm_w[tid]);
  // 1. conv + SiLU over q, k and the head's v channels, 4 per thread (2 * 128 + 128 channels =
  // 96 threads at 27B: q on warp 0, k on warp 1, v on warp 2); taps before the wait.
  const bool write_qk = hv % ratio == 0;
  const int e = 4 * tid;
  const bool active = e < 2 * DK + d_v;
  const int ch = conv_channel<DK>(s, hk, hv, d_v, 0, e);
  ConvTaps taps;
  if (active) conv4_load_taps<VEC>(ring, w.conv_w, qkv_dim, ch, p, taps);

  pdl_wait();  // proj is the previous kernel's output (see pdl_wait)
  const float b_raw = __bfloat162float(x[qkv_dim + s.z_dim() + hv]);
  const float a_raw = __bfloat162float(x[qkv_dim + s.z_dim() + s.n_v_heads + hv]);
  if (tid < d_v && norm) z_c = __bfloat162float(x[qkv_dim + hv * d_v + tid]);
  float xin[4] = {0.f, 0.f, 0.f, 0.f}, y[4] = {0.f, 0.f, 0.f, 0.f};
  conv_norm_to_shared<DK, VEC>(x, taps, active, e, ch, xin, y, qs, ks, vs);
  // 2. gates.
  float beta, decay;
  gdn_gates(b_raw, a_raw, A_log, dt_bias, beta, decay);
  __syncthreads();  // q, k, v in shared memory; the barriers' init visible to every thread

  // 3. Rows, chunk by chunk as they land: lane group grp owns local rows grp + j * kRowsPerPass.
  const int grp = warp * C::kRowsPerWarp + lane / C::kLanesPerRow;
  const int k4 = lane % C::kLanesPerRow;
  const float4 kk = *reinterpret_cast<const float4*>(ks + 4 * k4);
  const float4 qq = *reinterpret_cast<const float4*>(qs + 4 * k4);
  for (int c = 0; c < n_chunks; ++c) {
    const float* buf = chunk_buf + (c % STAGES) * C::kChunkRows * DK;
    if (has_state) mbar_wait(&full[c % STAGES], (c / STAGES) & 1);
    float4 t[C::kPasses];
    chunk_rows_load<DK>(t, buf, c, grp, k4, d_v, has_state);
    if (STAGES < C::kMaxChunks && has_state && c + STAGES < n_chunks) {
      __syncthreads();  // every warp holds chunk c: its buffer may be refilled
      if (tid == 0) issue_chunk(c + STAGES);
    }
    chunk_rows_update<DK>(t, c, grp, k4, d_v, kk, qq, decay, beta, vs, state, os);
  }
  __syncthreads();

  // 4. The head's 1 / rms (the block holds the whole head).
  float rinv = 1.f;
  if (norm) {
    rinv = block_head_rinv(os, warp_sq, d_v, s.norm_eps, tid, lane, warp);
  }

  // 5. The ring (row p % 4, which no block reads in this step) and the gated-norm output.
  if (active && (e >= 2 * DK || write_qk)) {
    write_ring_row(ring, p, qkv_dim, ch, xin);
  }
  if (tid < d_v) {
    bf16* yo = out + static_cast<int64_t>(seq) * s.out_dim() + hv * d_v;
    yo[tid] = __float2bfloat16(gated_output(os[tid], rinv, z_c, w_c, norm));
  }
}

template <int DK, bool VEC, int STAGES>
void launch_stream(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                   const bf16* proj, const int32_t* seq_pos, const int32_t* slot_ids, int n_seqs,
                   bf16* out, cudaStream_t stream, bool pdl) {
  constexpr int kSmem = stream_smem_bytes<DK, STAGES>();
  ensure_smem_optin(reinterpret_cast<const void*>(gdn_decode_stream_kernel<DK, VEC, STAGES>),
                    kSmem);
  launch_maybe_pdl(gdn_decode_stream_kernel<DK, VEC, STAGES>, dim3(n_seqs, s.n_v_heads),
                   dim3(kStreamThreads), kSmem, stream, pdl, s, w, pool, proj, seq_pos, slot_ids,
                   out);
}

template <int DK, bool VEC>
void launch_stream_stages(GdnDecodeKernel which, const GdnShape& s, const GdnLayerWeights& w,
                          const GdnStatePool& pool, const bf16* proj, const int32_t* seq_pos,
                          const int32_t* slot_ids, int n_seqs, bf16* out, cudaStream_t stream,
                          bool pdl) {
  if (which == GdnDecodeKernel::kStreamWhole)
    launch_stream<DK, VEC, StreamCfg<DK>::kMaxChunks>(s, w, pool, proj, seq_pos, slot_ids, n_seqs,
                                                      out, stream, pdl);
  else
    launch_stream<DK, VEC, 4>(s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, pdl);
}

// ---- Split streaming kernel: a cluster of NSPLIT blocks per (sequence, value head) -----------
// Each block streams d_v / NSPLIT contiguous state rows (16 KiB or 32 KiB at 27B), all of them in
// flight at once (no ring refill, no block barrier per chunk), with the streaming kernel's
// per-chunk code; the gated norm needs the whole head's o, so every block sends its rows' o to
// its peers' os[] by st.async (remote shared-memory stores that complete on the receiver's
// mbarrier: no cluster barrier after the state stores, which a release barrier would make wait
// for them), then each block reduces the whole head's o^2 exactly as the streaming kernel does
// (same warps, same order), so outputs AND states are bit-equal to kStream's.
// Why: at batch 16 the streaming kernel's 768 blocks are 1.16 waves of 660 slots (the last 108
// heads run on an idle GPU) and each block walks 16 rows per warp in sequence; at batch 4 its
// 192 blocks leave most warps idle. Twice / four times the blocks, each with half / a quarter of
// the rows, shorten every block's chain and the tail.
// (cluster_map, st_async_f32, cluster_rank: cluster.cuh)

// 5 blocks per SM, as the streaming kernel (48 registers; 54 uncapped, i.e. 4 per SM).
constexpr int kSplitMinBlocks = 5;

template <int DK, int NSPLIT>
struct SplitCfg {
  using C = StreamCfg<DK>;
  static constexpr int kMaxRows = kMaxD / NSPLIT;  // state rows per block at most
  static constexpr int kMaxChunks = (kMaxRows + C::kChunkRows - 1) / C::kChunkRows;
  static constexpr int kSmemBytes = kMaxRows * DK * 4;  // the block's rows, all in flight
  static_assert(kMaxChunks <= 4, "at most 4 chunk barriers");
};

// EARLY (GdnDecodeEarly, gdn.h; its own instantiation): thread 0 waits (acquire) for the
// in-projection GEMV's early-rows counter to reach its target, i.e. for proj's qkv, b and a
// columns, and everything up to the gated norm's scale runs before griddepcontrol.wait; only z
// (and the ring row and outputs, written after it as before) wait for the GEMV's end. A wait past
// kEarlySpinNs (a producer that never raises: misuse) falls back to the plain order. After the
// wait each block adds one to the counter; the block that brings it to target + blocks resets it
// to zero for the next launch (every block has passed its spin by then, and the GEMV is done).
// The same arithmetic on the same values as without: bit-identical states and outputs.
constexpr unsigned long long kEarlySpinNs = 2000000ull;  // 2 ms

template <int DK, bool VEC, int NSPLIT, bool EARLY = false>
__global__ void __cluster_dims__(NSPLIT, 1, 1) __launch_bounds__(kStreamThreads, kSplitMinBlocks)
    gdn_decode_split_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                            const bf16* proj,  // [n_seqs, in_dim] (no __restrict__: pdl_wait)
                            const int32_t* __restrict__ seq_pos,   // [n_seqs]
                            const int32_t* __restrict__ slot_ids,  // [n_seqs]
                            bf16* __restrict__ out,                // [n_seqs, n_v_heads * d_v]
                            GdnDecodeEarly early)                  // EARLY only
{
  using C = StreamCfg<DK>;
  using SC = SplitCfg<DK, NSPLIT>;
  extern __shared__ __align__(128) float chunk_buf[];  // [rows][DK]: the block's state rows
  __shared__ __align__(16) float qs[DK], ks[DK], vs[SC::kMaxRows], os[kMaxD];
  __shared__ __align__(8) uint64_t full[SC::kMaxChunks];
  __shared__ __align__(8) uint64_t peers_done;  // the peers' o rows have landed in os[]
  __shared__ float warp_sq[kStreamThreads / 32];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // PDL: as in gdn_decode_kernel

  const uint32_t rank = cluster_rank();  // == blockIdx.x (grid.x == NSPLIT)
  const int hv = blockIdx.y, seq = blockIdx.z;
  const int ratio = s.n_v_heads / s.n_k_heads, hk = hv / ratio;
  const int d_v = s.d_v, qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  const int rows = d_v / NSPLIT, v0 = static_cast<int>(rank) * rows;  // rows [v0, v0 + rows)
  const int p = seq_pos[seq];
  const int64_t slot = slot_ids[seq];
  bf16* ring = pool.conv_state + slot * pool.conv_slot_stride;
  const bf16* x = proj + static_cast<int64_t>(seq) * in_dim;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* state =
      pool.rec_state + slot * pool.rec_slot_stride + (static_cast<int64_t>(hv) * d_v + v0) * DK;
  const bool has_state = p > 0;  // uniform over the block
  const int n_chunks = (rows + C::kChunkRows - 1) / C::kChunkRows;

  // 0. Thread 0 starts every chunk of the block's rows (chunk c -> rows [c * kChunkRows, ...),
  // completing on full[c]) before anything else; peers_done completes once the peers' o rows
  // (st.async, step 4) have landed.
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < SC::kMaxChunks; ++i) mbar_init(&full[i], 1);
    mbar_init(&peers_done, 1);
    // Armed now, so its transaction count never goes below zero: the peers' o rows.
    if (w.norm_w != nullptr)
      mbar_arrive_expect_tx(&peers_done, static_cast<uint32_t>(d_v - rows) * 4);
    mbar_init_fence();
    if (has_state)
      for (int c = 0; c < n_chunks; ++c) {
        const int rows_c = min(C::kChunkRows, rows - c * C::kChunkRows);
        const uint32_t bytes = static_cast<uint32_t>(rows_c) * DK * 4;
        mbar_arrive_expect_tx(&full[c], bytes);
        bulk_copy_g2s(chunk_buf + c * C::kChunkRows * DK,
                      state + static_cast<int64_t>(c) * C::kChunkRows * DK, bytes, &full[c]);
      }
  }
  // The peers may store into this block's os[] once they have passed the matching wait (after
  // their rows): peers_done's init is ordered before it by the fence above.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  const float A_log = w.A_log[hv], dt_bias = w.dt_bias[hv];
  const bool norm = w.norm_w != nullptr;  // uniform over the cluster
  // 1. conv + SiLU over q, k and the block's v channels, 4 per thread; taps before the wait.
  // The q / k ring rows are written by rank 0 of the first value head of the key group.
  const bool write_qk = hv % ratio == 0 && rank == 0;
  const int e = 4 * tid;
  const bool active = e < 2 * DK + rows;
  const int ch = conv_channel<DK>(s, hk, hv, d_v, v0, e);
  ConvTaps taps;
  if (active) conv4_load_taps<VEC>(ring, w.conv_w, qkv_dim, ch, p, taps);

  [[maybe_unused]] bool pre = false;  // EARLY: qkv, b and a read before the wait
  if constexpr (EARLY) {
    __shared__ int early_ok;
    if (tid == 0) {
      const unsigned long long t0 = globaltimer_ns();
      bool ok = true;
      while (load_acquire(early.ready) < early.target) {
        if (globaltimer_ns() - t0 > kEarlySpinNs) {
          ok = false;
          break;
        }
        __nanosleep(500);  // the signal comes ~15 us before the GEMV's end: no hurry
      }
      early_ok = ok;
      if (!ok && early.late != nullptr) atomicAdd(early.late, 1u);
    }
    __syncthreads();
    pre = early_ok != 0;
  }
  if (!pre) pdl_wait();  // proj is the previous kernel's output (see pdl_wait)
  const float b_raw = __bfloat162float(x[qkv_dim + s.z_dim() + hv]);
  const float a_raw = __bfloat162float(x[qkv_dim + s.z_dim() + s.n_v_heads + hv]);
  float xin[4] = {0.f, 0.f, 0.f, 0.f}, y[4] = {0.f, 0.f, 0.f, 0.f};
  conv_norm_to_shared<DK, VEC>(x, taps, active, e, ch, xin, y, qs, ks, vs);
  // 2. gates.
  float beta, decay;
  gdn_gates(b_raw, a_raw, A_log, dt_bias, beta, decay);
  __syncthreads();  // q, k, v in shared memory; the barriers' init visible to every thread

  // 3. Rows, chunk by chunk as they land (the streaming kernel's loop without refills).
  const int grp = warp * C::kRowsPerWarp + lane / C::kLanesPerRow;
  const int k4 = lane % C::kLanesPerRow;
  const float4 kk = *reinterpret_cast<const float4*>(ks + 4 * k4);
  const float4 qq = *reinterpret_cast<const float4*>(qs + 4 * k4);
  for (int c = 0; c < n_chunks; ++c) {
    const float* buf = chunk_buf + c * C::kChunkRows * DK;
    if (has_state) mbar_wait(&full[c], 0);
    float4 t[C::kPasses];
    chunk_rows_load<DK>(t, buf, c, grp, k4, rows, has_state);  // local rows
    chunk_rows_update<DK>(t, c, grp, k4, rows, kk, qq, decay, beta, vs, state, os + v0);
  }
  __syncthreads();  // the block's o rows are in os[]
  // Thread c < rows: the gate z and norm weight of row v0 + c (loaded only now, so they hold no
  // registers over the rows; the exchange below hides their latency).
  float z_c = 0.f, w_c = 0.f;
  if (tid < rows && norm) {
    w_c = __bfloat162float(w.norm_w[v0 + tid]);
    if (!pre) z_c = __bfloat162float(x[qkv_dim + hv * d_v + v0 + tid]);
  }

  // 4. Every block sends its o rows to its peers, then reduces the whole head as kStream does.
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // peers' peers_done initialised
  float rinv = 1.f;
  if (norm) {
    if (tid < rows) {
      const float o = os[v0 + tid];
      const uint32_t addr = smem_u32(&os[v0 + tid]), bar = smem_u32(&peers_done);
#pragma unroll
      for (int r = 1; r < NSPLIT; ++r) {
        const uint32_t peer = (rank + r) % NSPLIT;
        st_async_f32(cluster_map(addr, peer), o, cluster_map(bar, peer));
      }
    }
    mbar_wait(&peers_done, 0);
    rinv = block_head_rinv(os, warp_sq, d_v, s.norm_eps, tid, lane, warp);
  }
  if constexpr (EARLY) {
    if (pre) {
      pdl_wait();  // z: the GEMV's last rows
      if (tid < rows && norm) z_c = __bfloat162float(x[qkv_dim + hv * d_v + v0 + tid]);
    }
    if (tid == 0) {  // after the wait: the GEMV has raised everything; this block has spun
      const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
      if (atomicAdd(early.ready, 1u) == early.target + blocks - 1u) atomicExch(early.ready, 0u);
    }
  }

  // 5. The ring (row p % 4, which no block reads in this step) and the block's outputs.
  if (active && (e >= 2 * DK || write_qk)) {
    write_ring_row(ring, p, qkv_dim, ch, xin);
  }
  if (tid < rows) {
    bf16* yo = out + static_cast<int64_t>(seq) * s.out_dim() + hv * d_v + v0;
    yo[tid] = __float2bfloat16(gated_output(os[v0 + tid], rinv, z_c, w_c, norm));
  }
}

template <int DK, bool VEC, int NSPLIT>
void launch_split(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                  const bf16* proj, const int32_t* seq_pos, const int32_t* slot_ids, int n_seqs,
                  bf16* out, cudaStream_t stream, bool pdl, const GdnDecodeEarly& early) {
  constexpr int kSmem = SplitCfg<DK, NSPLIT>::kSmemBytes;
  auto* kern = gdn_decode_split_kernel<DK, VEC, NSPLIT>;
  if constexpr (DK == 128) {
    if (early.ready != nullptr) kern = gdn_decode_split_kernel<DK, VEC, NSPLIT, true>;
  }
  ensure_smem_optin(reinterpret_cast<const void*>(kern), kSmem);
  // The cluster dimension comes from the kernel's __cluster_dims__ (also under cudaLaunchKernelEx).
  launch_maybe_pdl(kern, dim3(NSPLIT, s.n_v_heads, n_seqs), dim3(kStreamThreads), kSmem, stream,
                   pdl, s, w, pool, proj, seq_pos, slot_ids, out, early);
}

template <int DK, bool VEC>
void launch_split_n(GdnDecodeKernel which, const GdnShape& s, const GdnLayerWeights& w,
                    const GdnStatePool& pool, const bf16* proj, const int32_t* seq_pos,
                    const int32_t* slot_ids, int n_seqs, bf16* out, cudaStream_t stream, bool pdl,
                    const GdnDecodeEarly& early) {
  if (which == GdnDecodeKernel::kSplit4)
    launch_split<DK, VEC, 4>(s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, pdl, early);
  else
    launch_split<DK, VEC, 2>(s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, pdl, early);
}

// ---- Persistent streaming kernel: at most one wave of blocks walking (sequence, head) units ----
// The streaming kernel's per-unit code (conv / gates / update_row / the block's own gated norm, so
// states AND outputs are bit-equal to kStream's) in a grid of at most one wave: grid = units /
// ceil(units / resident), where resident = blocks per SM (occupancy) x SMs, so every block walks
// the same number of units (+-1) with a static stride (block b: units b, b + grid, ...; nothing to
// reset between CUDA-graph replays). The block's state chunks form one stream across its units: a
// ring of STAGES 8 KiB chunk buffers, chunk g (unit g / n_chunks, chunk g % n_chunks) in buffer
// g % STAGES, and chunk g + STAGES is issued as soon as every warp holds chunk g, so the NEXT
// unit's first chunks are in flight while the current unit's last rows are updated, its norm
// reduced and its outputs stored. Why (docs/perf/decode_kernels.md, gdnd7): every per-head grid
// jumps where it crosses one wave of 660 blocks (5 per SM x 132): at batch 16 kStream's 768 blocks
// are 1.16 waves and the last 108 heads run on an idle GPU for a whole block lifetime.
// Chunks are copied for every unit, also of a sequence at position 0 (the slot's bytes are valid
// memory; the rows then start from zero as in kStream): every unit has the same chunk count, so
// the ring's phases stay in step.
template <int STAGES>
struct PersistCfg {
  // Blocks per SM the launch bounds ask for: 4 with the 32 KiB ring (64 registers; at 5 per SM,
  // 48 registers, the unit loop spilled 64 bytes, and the grids of batch 16 / 32 (768 / 1536
  // units: 384 / 512 blocks) are the same at 4 or 5 per SM), 3 with the 64 KiB ring (80
  // registers; 3 x 64 KiB of 227).
  static constexpr int kMinBlocks = STAGES <= 4 ? 4 : 3;
  static constexpr int kSmemBytes = STAGES * kStreamChunkBytes;
};

template <int DK, bool VEC, int STAGES>
__global__ void __launch_bounds__(kStreamThreads, PersistCfg<STAGES>::kMinBlocks)
    gdn_decode_persist_kernel(GdnShape s, GdnLayerWeights w, GdnStatePool pool,
                              const bf16* proj,  // [n_seqs, in_dim] (no __restrict__: pdl_wait)
                              const int32_t* __restrict__ seq_pos,   // [n_seqs]
                              const int32_t* __restrict__ slot_ids,  // [n_seqs]
                              int n_units,                           // n_seqs * n_v_heads
                              bf16* __restrict__ out)                // [n_seqs, n_v_heads * d_v]
{
  using C = StreamCfg<DK>;
  extern __shared__ __align__(128) float chunk_buf[];  // [STAGES][kChunkRows][DK] state rows
  __shared__ __align__(16) float qs[DK], ks[DK], vs[kMaxD], os[kMaxD];
  __shared__ __align__(8) uint64_t full[STAGES];
  __shared__ float warp_sq[kStreamThreads / 32];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // PDL: as in gdn_decode_kernel

  const int ratio = s.n_v_heads / s.n_k_heads;
  const int d_v = s.d_v, qkv_dim = s.qkv_dim(), in_dim = s.in_dim();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n_chunks = (d_v + C::kChunkRows - 1) / C::kChunkRows;  // per unit
  const int b = blockIdx.x, grid = gridDim.x;
  const int n_mine = b < n_units ? (n_units - b + grid - 1) / grid : 0;  // units b, b + grid, ...
  const int n_g = n_mine * n_chunks;                                     // the block's chunks

  // Thread 0: chunk g of the block's stream -> buffer g % STAGES, completing on full[g % STAGES].
  // Reads only the step's metadata (slot_ids), final before the wait (pdl_wait).
  const auto issue_chunk = [&](int g) {
    const int unit = b + (g / n_chunks) * grid, c = g % n_chunks;
    const int seq = unit / s.n_v_heads, hv = unit - seq * s.n_v_heads;
    const float* src = pool.rec_state + static_cast<int64_t>(slot_ids[seq]) * pool.rec_slot_stride +
                       (static_cast<int64_t>(hv) * d_v + c * C::kChunkRows) * DK;
    const int rows_c = min(C::kChunkRows, d_v - c * C::kChunkRows);
    const uint32_t bytes = static_cast<uint32_t>(rows_c) * DK * 4;
    uint64_t* bar = &full[g % STAGES];
    mbar_arrive_expect_tx(bar, bytes);
    bulk_copy_g2s(chunk_buf + (g % STAGES) * C::kChunkRows * DK, src, bytes, bar);
  };
  // 0. The state stream starts first.
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) mbar_init(&full[i], 1);
    mbar_init_fence();
    for (int g = 0; g < n_g && g < STAGES; ++g) issue_chunk(g);
  }
  const bool norm = w.norm_w != nullptr;  // uniform over the grid
  const int grp = warp * C::kRowsPerWarp + lane / C::kLanesPerRow;
  const int k4 = lane % C::kLanesPerRow;
  const int e = 4 * tid;
  const bool active = e < 2 * DK + d_v;

  int g = 0;  // the block's next chunk
  for (int j = 0; j < n_mine; ++j) {
    const int unit = b + j * grid;
    const int seq = unit / s.n_v_heads, hv = unit - seq * s.n_v_heads, hk = hv / ratio;
    const int p = seq_pos[seq];
    const int64_t slot = slot_ids[seq];
    bf16* ring = pool.conv_state + slot * pool.conv_slot_stride;
    const bf16* x = proj + static_cast<int64_t>(seq) * in_dim;
    float* state =
        pool.rec_state + slot * pool.rec_slot_stride + static_cast<int64_t>(hv) * d_v * DK;
    const bool has_state = p > 0;  // uniform over the block
    // The previous unit's readers of qs / ks / vs / os / warp_sq are done.
    if (j > 0) __syncthreads();
    const float A_log = w.A_log[hv], dt_bias = w.dt_bias[hv];
    // 1. conv + SiLU over q, k and the head's v channels (kStream's step 1).
    const bool write_qk = hv % ratio == 0;
    const int ch = conv_channel<DK>(s, hk, hv, d_v, 0, e);
    ConvTaps taps;
    if (active) conv4_load_taps<VEC>(ring, w.conv_w, qkv_dim, ch, p, taps);
    if (j == 0) pdl_wait();  // proj is the previous kernel's output (see pdl_wait)
    const float b_raw = __bfloat162float(x[qkv_dim + s.z_dim() + hv]);
    const float a_raw = __bfloat162float(x[qkv_dim + s.z_dim() + s.n_v_heads + hv]);
    float xin[4] = {0.f, 0.f, 0.f, 0.f}, y[4] = {0.f, 0.f, 0.f, 0.f};
    conv_norm_to_shared<DK, VEC>(x, taps, active, e, ch, xin, y, qs, ks, vs);
    // The ring row p % 4 (which no unit reads in this step) now, not after the rows as kStream
    // does: the same bytes, and xin holds no registers over the rows (48 per thread for 5 blocks
    // per SM).
    if (active && (e >= 2 * DK || write_qk)) {
      write_ring_row(ring, p, qkv_dim, ch, xin);
    }
    // 2. gates.
    float beta, decay;
    gdn_gates(b_raw, a_raw, A_log, dt_bias, beta, decay);
    __syncthreads();  // q, k, v in shared memory; the barriers' init visible to every thread

    // 3. The unit's rows, chunk by chunk as they land; each buffer refilled with the chunk
    // STAGES further on in the block's stream (the next unit's, near the end of this one).
    const float4 kk = *reinterpret_cast<const float4*>(ks + 4 * k4);
    const float4 qq = *reinterpret_cast<const float4*>(qs + 4 * k4);
    for (int c = 0; c < n_chunks; ++c, ++g) {
      const float* buf = chunk_buf + (g % STAGES) * C::kChunkRows * DK;
      mbar_wait(&full[g % STAGES], (g / STAGES) & 1);
      float4 t[C::kPasses];
      chunk_rows_load<DK>(t, buf, c, grp, k4, d_v, has_state);
      if (g + STAGES < n_g) {
        __syncthreads();  // every warp holds chunk g: its buffer may be refilled
        if (tid == 0) issue_chunk(g + STAGES);
      }
      chunk_rows_update<DK>(t, c, grp, k4, d_v, kk, qq, decay, beta, vs, state, os);
    }
    __syncthreads();
    // Thread c < d_v: the gate z and norm weight of its output, loaded only now (as the split
    // kernel does) so they hold no registers over the rows.
    float z_c = 0.f, w_c = 0.f;
    if (tid < d_v && norm) {
      w_c = __bfloat162float(w.norm_w[tid]);
      z_c = __bfloat162float(x[qkv_dim + hv * d_v + tid]);
    }

    // 4. The head's 1 / rms, in kStream's order.
    float rinv = 1.f;
    if (norm) {
      rinv = block_head_rinv(os, warp_sq, d_v, s.norm_eps, tid, lane, warp);
    }

    // 5. The gated-norm output.
    if (tid < d_v) {
      bf16* yo = out + static_cast<int64_t>(seq) * s.out_dim() + hv * d_v;
      yo[tid] = __float2bfloat16(gated_output(os[tid], rinv, z_c, w_c, norm));
    }
  }
}

// Resident blocks of `func` on the current device (occupancy at this block size and dynamic
// shared memory x SMs), computed once per (kernel, device).
int resident_blocks(const void* func, int threads, int smem_bytes) {
  int device = 0;
  DS_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;  // (kernel, device) -> blocks
  const std::lock_guard<std::mutex> lock(mu);
  int& n = cache[{func, device}];
  if (n > 0) return n;
  int per_sm = 0, n_sms = 0;
  DS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, func, threads, smem_bytes));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device));
  DS_CHECK(per_sm > 0, "gdn decode: the persistent kernel does not fit on an SM (", smem_bytes,
           " bytes of shared memory)");
  n = per_sm * n_sms;
  return n;
}

// $DS_GDN_DECODE_PERSIST_BLOCKS (read at each launch, like $DS_GDN_DECODE_PDL): a cap on the
// persistent grid below one wave, for tests (many units per block, rings across units) and grid
// A/B runs; unset or empty: no cap.
int persist_block_cap() {
  const char* v = std::getenv("DS_GDN_DECODE_PERSIST_BLOCKS");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  DS_CHECK(*end == '\0' && n > 0 && n <= (1 << 20),
           "DS_GDN_DECODE_PERSIST_BLOCKS must be a positive block count, got '", v, "'");
  return static_cast<int>(n);
}

// At most one wave, every block the same number of units (+-1).
int persist_grid(int n_units, int resident) {
  const int per_block = (n_units + resident - 1) / resident;
  return (n_units + per_block - 1) / per_block;
}

template <int DK, bool VEC, int STAGES>
void launch_persist(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                    const bf16* proj, const int32_t* seq_pos, const int32_t* slot_ids, int n_seqs,
                    bf16* out, cudaStream_t stream, bool pdl) {
  constexpr int kSmem = PersistCfg<STAGES>::kSmemBytes;
  const void* func = reinterpret_cast<const void*>(gdn_decode_persist_kernel<DK, VEC, STAGES>);
  ensure_smem_optin(func, kSmem);
  const int n_units = n_seqs * s.n_v_heads;
  int resident = resident_blocks(func, kStreamThreads, kSmem);
  if (const int cap = persist_block_cap(); cap > 0) resident = std::min(resident, cap);
  const int grid = persist_grid(n_units, resident);
  launch_maybe_pdl(gdn_decode_persist_kernel<DK, VEC, STAGES>, dim3(grid), dim3(kStreamThreads),
                   kSmem, stream, pdl, s, w, pool, proj, seq_pos, slot_ids, n_units, out);
}

template <int DK, bool VEC>
void launch_persist_n(GdnDecodeKernel which, const GdnShape& s, const GdnLayerWeights& w,
                      const GdnStatePool& pool, const bf16* proj, const int32_t* seq_pos,
                      const int32_t* slot_ids, int n_seqs, bf16* out, cudaStream_t stream,
                      bool pdl) {
  if (which == GdnDecodeKernel::kPersistDeep)
    launch_persist<DK, VEC, 8>(s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, pdl);
  else
    launch_persist<DK, VEC, 4>(s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, pdl);
}

// $DS_GDN_DECODE_PDL, read at each call: the engine asks once per layer while it enqueues a forward
// (for a decode graph only at its capture), so the cost is nil and a test can switch it between
// engines.
GdnDecodePdl read_pdl_mode() {
  const char* v = std::getenv("DS_GDN_DECODE_PDL");
  if (v == nullptr || *v == '\0') return GdnDecodePdl::kDefault;
  const std::string m(v);
  if (m == "0") return GdnDecodePdl::kOff;
  if (m == "1") return GdnDecodePdl::kOn;
  ds::throw_error("DS_GDN_DECODE_PDL must be 0 or 1 (or unset for the default), got '", m, "'");
}

}  // namespace

void launch_gdn_decode(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                       const bf16* proj, const int32_t* seq_pos, const int32_t* slot_ids,
                       int n_seqs, bf16* out, cudaStream_t stream) {
  launch_gdn_decode(s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream,
                    GdnDecodeKernel::kAuto);
}

void launch_gdn_decode(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                       const bf16* proj, const int32_t* seq_pos, const int32_t* slot_ids,
                       int n_seqs, bf16* out, cudaStream_t stream, GdnDecodeKernel which) {
  launch_gdn_decode(s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, which, false);
}

GdnDecodePdl gdn_decode_pdl_mode() { return read_pdl_mode(); }

bool gdn_decode_pdl_for(int n_seqs) {
  switch (gdn_decode_pdl_mode()) {
    case GdnDecodePdl::kOff:
      return false;
    case GdnDecodePdl::kOn:
      return true;
    default:
      return n_seqs <= kPdlDefaultMaxSeqs;
  }
}

void launch_gdn_decode(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                       const bf16* proj, const int32_t* seq_pos, const int32_t* slot_ids,
                       int n_seqs, bf16* out, cudaStream_t stream, GdnDecodeKernel which,
                       bool pdl, const GdnDecodeEarly& early) {
  check_gdn_shape(s);
  DS_CHECK(w.conv_w && w.A_log && w.dt_bias, "gdn decode: layer weight pointers are null");
  DS_CHECK(pool.conv_state && pool.rec_state, "gdn decode: state pool pointers are null");
  DS_CHECK(pool.conv_slot_stride >= 4LL * s.qkv_dim(), "gdn decode: conv_slot_stride too small");
  DS_CHECK(pool.rec_slot_stride >= static_cast<int64_t>(s.n_v_heads) * s.d_v * s.d_k,
           "gdn decode: rec_slot_stride too small");
  DS_CHECK(n_seqs >= 0, "gdn decode: n_seqs must be >= 0, got ", n_seqs);
  const bool can8 = gdn_decode_cluster8_supported(s);
  DS_CHECK(which != GdnDecodeKernel::kCluster8 || can8,
           "gdn decode: the 8-block cluster kernel needs d_v % 32 == 0, got d_v ", s.d_v);
  // Every kernel moves state rows as 16-byte vectors (the streaming one by bulk copies).
  DS_CHECK(reinterpret_cast<uintptr_t>(pool.rec_state) % 16 == 0 && pool.rec_slot_stride % 4 == 0,
           "gdn decode: rec_state must be 16-byte aligned and rec_slot_stride a multiple of 4, got "
           "rec_state ",
           static_cast<const void*>(pool.rec_state), ", rec_slot_stride ", pool.rec_slot_stride);
  const bool can_stream = gdn_decode_stream_supported(s, pool);
  const bool persist_asked =
      which == GdnDecodeKernel::kPersist || which == GdnDecodeKernel::kPersistDeep;
  const bool stream_asked =
      which == GdnDecodeKernel::kStream || which == GdnDecodeKernel::kStreamWhole || persist_asked;
  DS_CHECK(!stream_asked || can_stream, "gdn decode: the ",
           persist_asked ? "persistent streaming" : "streaming", " kernel does not take d_v ",
           s.d_v);
  const bool split_asked = which == GdnDecodeKernel::kSplit2 || which == GdnDecodeKernel::kSplit4;
  DS_CHECK(!split_asked ||
               gdn_decode_split_supported(s, pool, which == GdnDecodeKernel::kSplit4 ? 4 : 2),
           "gdn decode: the split streaming kernel over ",
           which == GdnDecodeKernel::kSplit4 ? 4 : 2, " blocks needs d_v % ",
           which == GdnDecodeKernel::kSplit4 ? 16 : 8, " == 0, got d_v ", s.d_v);
  which = gdn_decode_resolve(s, pool, n_seqs, which);
  if (early.ready != nullptr) {
    DS_CHECK(gdn_decode_early_supported(s, which) && n_seqs >= 1,
             "gdn decode: the early start after the in-projection's signal needs the split "
             "kernels at d_k = 128 and at least one sequence (n_seqs ", n_seqs, ", d_k ", s.d_k, ")");
    DS_CHECK(early.target >= 1 && (reinterpret_cast<uintptr_t>(early.ready) & 3) == 0,
             "gdn decode: the early start needs a positive target and a 4-byte aligned counter");
  }
  if (n_seqs == 0) return;
  // 8-byte loads need 8-byte aligned rows of proj and of the ring.
  const bool vec = s.in_dim() % 4 == 0 && pool.conv_slot_stride % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(proj) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(pool.conv_state) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(w.conv_w) % 16 == 0;
  if (which == GdnDecodeKernel::kPersist || which == GdnDecodeKernel::kPersistDeep) {
#define DS_GDN_PERSIST(DK)                                                                      \
  if (vec)                                                                                      \
    launch_persist_n<DK, true>(which, s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, \
                               pdl);                                                            \
  else                                                                                          \
    launch_persist_n<DK, false>(which, s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, \
                                pdl);
    switch (s.d_k) {
      case 16:
        DS_GDN_PERSIST(16);
        break;
      case 32:
        DS_GDN_PERSIST(32);
        break;
      case 64:
        DS_GDN_PERSIST(64);
        break;
      case 128:
        DS_GDN_PERSIST(128);
        break;
      default:
        DS_ASSERT(false);
    }
#undef DS_GDN_PERSIST
    DS_CUDA_LAUNCH_CHECK();
    return;
  }
  if (which == GdnDecodeKernel::kSplit2 || which == GdnDecodeKernel::kSplit4) {
#define DS_GDN_SPLIT(DK)                                                                      \
  if (vec)                                                                                    \
    launch_split_n<DK, true>(which, s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, \
                             pdl, early);                                                     \
  else                                                                                        \
    launch_split_n<DK, false>(which, s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, stream, \
                              pdl, early);
    switch (s.d_k) {
      case 16:
        DS_GDN_SPLIT(16);
        break;
      case 32:
        DS_GDN_SPLIT(32);
        break;
      case 64:
        DS_GDN_SPLIT(64);
        break;
      case 128:
        DS_GDN_SPLIT(128);
        break;
      default:
        DS_ASSERT(false);
    }
#undef DS_GDN_SPLIT
    DS_CUDA_LAUNCH_CHECK();
    return;
  }
  if (which == GdnDecodeKernel::kStream || which == GdnDecodeKernel::kStreamWhole) {
#define DS_GDN_STREAM(DK)                                                                    \
  if (vec)                                                                                   \
    launch_stream_stages<DK, true>(which, s, w, pool, proj, seq_pos, slot_ids, n_seqs, out,  \
                                   stream, pdl);                                             \
  else                                                                                       \
    launch_stream_stages<DK, false>(which, s, w, pool, proj, seq_pos, slot_ids, n_seqs, out, \
                                    stream, pdl);
    switch (s.d_k) {
      case 16:
        DS_GDN_STREAM(16);
        break;
      case 32:
        DS_GDN_STREAM(32);
        break;
      case 64:
        DS_GDN_STREAM(64);
        break;
      case 128:
        DS_GDN_STREAM(128);
        break;
      default:
        DS_ASSERT(false);
    }
#undef DS_GDN_STREAM
    DS_CUDA_LAUNCH_CHECK();
    return;
  }
  int split = s.d_v % 16 == 0 ? kSplitFast : 1;
  if (can8 && (which == GdnDecodeKernel::kCluster8 ||
               (which == GdnDecodeKernel::kAuto && n_seqs <= kCluster8MaxSeqs)))
    split = 8;
  const dim3 grid(n_seqs, s.n_v_heads, split);
// The cluster dimension comes from the kernel's __cluster_dims__ (also under cudaLaunchKernelEx).
#define DS_GDN_DECODE_1(DK, VEC, SPLIT)                                                      \
  launch_maybe_pdl(gdn_decode_kernel<DK, VEC, SPLIT>, grid, dim3(kDecodeThreads), 0, stream, \
                   pdl, s, w, pool, proj, seq_pos, slot_ids, out)
#define DS_GDN_DECODE_S(DK, SPLIT)    \
  if (vec)                            \
    DS_GDN_DECODE_1(DK, true, SPLIT); \
  else                                \
    DS_GDN_DECODE_1(DK, false, SPLIT);
#define DS_GDN_DECODE(DK)           \
  if (split == 8) {                 \
    DS_GDN_DECODE_S(DK, 8)          \
  } else if (split == kSplitFast) { \
    DS_GDN_DECODE_S(DK, kSplitFast) \
  } else {                          \
    DS_GDN_DECODE_S(DK, 1)          \
  }
  switch (s.d_k) {
    case 16:
      DS_GDN_DECODE(16);
      break;
    case 32:
      DS_GDN_DECODE(32);
      break;
    case 64:
      DS_GDN_DECODE(64);
      break;
    case 128:
      DS_GDN_DECODE(128);
      break;
    default:
      DS_ASSERT(false);
  }
#undef DS_GDN_DECODE_1
#undef DS_GDN_DECODE_S
#undef DS_GDN_DECODE
  DS_CUDA_LAUNCH_CHECK();
}

bool gdn_decode_cluster8_supported(const GdnShape& s) { return s.d_v % 32 == 0; }

GdnDecodeKernel gdn_decode_resolve(const GdnShape& s, const GdnStatePool& pool, int n_seqs,
                                   GdnDecodeKernel which) {
  if (which != GdnDecodeKernel::kAuto) return which;
  const bool can_stream = gdn_decode_stream_supported(s, pool);
  const bool measured = s.d_k == 128 && s.d_v == 128;  // the split kernels' timed shape
  if (measured && n_seqs == kSplit4Seqs && gdn_decode_split_supported(s, pool, 4))
    return GdnDecodeKernel::kSplit4;
  if (measured && n_seqs == kPersistDeepSeqs && can_stream) return GdnDecodeKernel::kPersistDeep;
  if (n_seqs >= kStreamMinSeqs && can_stream) return GdnDecodeKernel::kStream;
  return GdnDecodeKernel::kAuto;  // the cluster kernels, by n_seqs
}

bool gdn_decode_early_supported(const GdnShape& s, GdnDecodeKernel resolved) {
  return s.d_k == 128 &&
         (resolved == GdnDecodeKernel::kSplit4 || resolved == GdnDecodeKernel::kSplit2);
}

bool gdn_decode_stream_supported(const GdnShape& s, const GdnStatePool& pool) {
  // Bulk copies need 16-byte aligned sources: the pool base and every slot / head / chunk offset
  // (head and chunk offsets are multiples of d_k floats, d_k >= 16).
  return s.d_v <= kMaxD && reinterpret_cast<uintptr_t>(pool.rec_state) % 16 == 0 &&
         pool.rec_slot_stride % 4 == 0;
}

bool gdn_decode_split_supported(const GdnShape& s, const GdnStatePool& pool, int n_split) {
  // Each block's rows are whole 4-channel conv groups; bulk copies as for the streaming kernel.
  return (n_split == 2 || n_split == 4) && s.d_v % (4 * n_split) == 0 &&
         gdn_decode_stream_supported(s, pool);
}

bool gdn_decode_kernel_for_variant(const std::string& variant, GdnDecodeKernel* which) {
  if (variant == "fused_persist")
    *which = GdnDecodeKernel::kPersist;
  else if (variant == "fused_persist_deep")
    *which = GdnDecodeKernel::kPersistDeep;
  else if (variant == "fused_split2")
    *which = GdnDecodeKernel::kSplit2;
  else if (variant == "fused_split4")
    *which = GdnDecodeKernel::kSplit4;
  else if (variant == "fused_stream")
    *which = GdnDecodeKernel::kStream;
  else if (variant == "fused_cluster8")
    *which = GdnDecodeKernel::kCluster8;
  else if (variant == "fused")
    *which = GdnDecodeKernel::kCluster4;
  else
    return false;
  return true;
}

}  // namespace ds::cuda
