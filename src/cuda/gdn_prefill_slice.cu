// GDN prompt path, Hopper kernels for d_k = d_v = 128: the kGdnPrefill variants "slice_scan*"
// of dispatch.cpp (gdn_prefill.cu runs them after the conv kernel and the register WY kernel of
// gdn_prefill_sm90.cu). The FLA / FlashInfer split of the chunked delta rule:
//  - gdn_state_slice_kernel: the only sequential stage, the inter-chunk state pass, split over
//    slices of NW * 16 value columns of each head's state (the rows of h^T are independent given
//    W, U and K), so 48 heads x 128 / (16 NW) CTAs share the SMs (NW = 4 is built: 96 CTAs for
//    one 27B sequence; NW = 2, 192 CTAs, was slower and is removed). Warp w keeps 16 rows of h^T
//    [v, k] in registers (fp32 mma.sync accumulator fragments); per chunk of 64 tokens it stores
//    the bf16 snapshot h_c (what the output needs), V_new^T = U^T - h^T W^T, and h^T <-
//    e^(gamma_last) h^T + (V_new^T e^(gamma_last - gamma_t)) K. V_new (bf16) overwrites U in place
//    (each warp its own columns). K, W, this slice's U columns and gamma of the next chunk stream
//    in with cp.async (double buffer). Nothing else is on the sequential path: no P, no output, no
//    norm (the removed gdn_scan_kernel did all of it per warp, ~3300 instructions per chunk with
//    one warp per scheduler; this one does ~700).
//  - gdn_chunk_out_kernel<VS>: the output, fully parallel over chunks x heads, one CTA of 4 VS
//    warps per (chunk, head): warp w = rows [16 (w % 4), + 16) of the chunk and 128 / VS value
//    columns; P = causal(Q K^T) * e^(gamma_i - gamma_j) (formed while h_c, V_new and z are still
//    landing: two cp.async groups), O = e^gamma (Q h_c) + P V_new, then the gated RMSNorm (row sums
//    by quad shuffles, VS = 2: plus the partner warp's through shared memory), y written as bf16.
//  - slice_scan_ov: the state pass in its lean form (kLean below: U / V_new through ldmatrix /
//    stmatrix .trans fragments, the snapshot staged for 16-byte stores after the state update is
//    issued), and the output launched as a programmatic dependent of it
//    (griddepcontrol.launch_dependents once every state CTA is resident) with a head-major grid,
//    so that its CTAs fill the SMs and registers the 96 state CTAs leave idle; each output CTA
//    stages Q, K, z, then waits until ready[chunk][head] counts both slices (red.release.gpu
//    after a block barrier in the state pass / ld.acquire.gpu + block barrier in the output)
//    before it reads h_c and V_new. Bit-identical to slice_scan_cs. H200 (2026-11-29,
//    docs/perf/gdn_prefill.md), 4096 tokens: state pass alone 151.6 us (lean) vs 175.1; state +
//    output 243.5 us overlapped (lean), 293.2 overlapped (not lean), 326.3 one after the other;
//    whole layer 0.440 vs 0.539 ms (bench kernels, same run, carried state), 512 tokens 0.080 vs
//    0.097, 8192 0.837 vs 0.981. The lean state pass under ncu: one warp per scheduler, 0.32
//    issued instructions per cycle, 3.1 cycles per issued instruction (latency-bound).
//  - slice_scan_wg: slice_scan_ov with the state pass on warpgroup MMAs and its tiles moved by TMA
//    (gdn_state_wg_kernel below), and the output on warpgroup MMAs fed by TMA too
//    (gdn_chunk_out_wg_kernel; `$DS_GDN_OUT` = tma / cp: gdn_chunk_out's mma.sync forms);
//    bit-identical to slice_scan_ov on the H200, the pass 115-119 vs 150 us alone, 208 vs 250 us
//    with the output beside it (4096 tokens, sessions 18-19).
// Precision as FLA and the other variants: bf16 operands (h_c, V_new, P, Q, K, W, U), fp32
// accumulators, state and gamma. Workspace: gdn_prefill.cu's h snapshot region ([chunk, head, v,
// k] bf16, the generic layout) and U (V_new after the pass).
// Shared memory: state pass 88.6 KB (lean: 106 KB); output 105 KB (2 CTAs per SM).
//
// Measured on the H200 (2026-11-29, cuda_gdn_test PrefillStageTiming / Timing: CUDA-event
// medians, 27B shapes, one sequence with carried state), per stage at 4096 tokens in us:
//   conv_prep_multi 104 (generic 107, the wide grid 114), wy_mma tf32 path 126 (SIMT 180),
//   state pass 177 (32-column slices 200; a warp pair splitting k, tried: 274; 3 / 4 cp.async
//   stages instead of 2 (STAGES), tried: 177 / 185 vs 174, so it is not waiting on its loads;
//   ncu of the 4-stage build: 6% achieved occupancy, 3.5 cycles per issued instruction, L1
//   63%; docs/perf/2026-11-29-gdnp4-ncu.log), output 156 with
//   8 warps per CTA (180 with 4; ncu: 59% of memory throughput),
// vs the removed wymma_scan_x2's fused scan alone 610. Whole layer (ms): 64 tokens 0.052, 512
// 0.108, 2048 0.314, 4096 0.565, 8192 1.071 (wymma_scan_x2: 0.093, 0.187, 0.491, 0.897, 1.743). The
// state pass is latency-bound (~2.8 us per chunk step, one warp per scheduler); the output moves
// ~300 MB per 4096 tokens, 100 MB of it the bf16 snapshots. Test: tests/cuda/cuda_gdn_test.cpp
// (every prefill case runs each variant, forced for all lengths); bench: `deltaserve bench kernels
// --only gdn_prefill`.
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/cuda_common.h"
#include "cuda/gdn_chunk.cuh"
#include "cuda/gdn_prefill_sm90.h"
#include "cuda/bulk_copy.cuh"
#include "cuda/cluster.cuh"
#include "cuda/mma_util.cuh"
#include "cuda/tma.cuh"
#include "cuda/tma.h"
#include "cuda/wgmma.cuh"

namespace ds::cuda {
namespace {

using gdn_tile::acc_a_times_tile;
using gdn_tile::acc_to_a;
using gdn_tile::ha_times_tile_t;
using gdn_tile::kC;
using gdn_tile::kD;
using gdn_tile::kLd;

constexpr size_t kTileBytes = sizeof(bf16) * kC * kLd;  // one [64][kLd] bf16 tile

// bar.sync on barrier `id` (1..15; 0 is __syncthreads) for `n_threads` threads (whole warps).
__device__ __forceinline__ void named_barrier_sync(int id, int n_threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n_threads) : "memory");
}

// ---- state pass ---------------------------------------------------------------------------------
template <int NW, int STAGES = 2>
struct SliceCfg {
  static constexpr int kThreads = 32 * NW;
  static constexpr int kVs = 16 * NW;   // state rows (value columns) per CTA
  static constexpr int kLdu = kVs + 8;  // U / V_new tile row stride (bf16)
  static constexpr size_t kK = 0, kW = kTileBytes, kU = 2 * kTileBytes;
  static constexpr size_t kGam = kU + sizeof(bf16) * kC * kLdu;
  static constexpr size_t kBuf = (kGam + sizeof(float) * kC + 127) / 128 * 128;  // one stage
  static constexpr size_t kTotal = STAGES * kBuf;
  static_assert(kThreads >= kC && (kLdu * sizeof(bf16)) % 16 == 0 && STAGES >= 2);
};

// stmatrix (sm 90): four 8x8 bf16 matrices from the fragments of mma_util.cuh's layout (row
// addresses from lanes 8m .. 8m + 7 for matrix m), plain and transposed.
__device__ __forceinline__ void stsm_x4(bf16* p, const uint32_t (&r)[4]) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_u32(p)),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
      : "memory");
}
__device__ __forceinline__ void stsm_x4_t(bf16* p, const uint32_t (&r)[4]) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_u32(p)),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
      : "memory");
}

// kSignal (slice_scan_ov): the output kernel runs beside this one (programmatic dependent launch)
// and takes chunk c of head hv once ready[c][hv] counts every slice of the head: each CTA adds 1
// (release, gpu scope) after its snapshot h_c and V_new rows of chunk c are stored; for a
// sequence's last chunk only after the final state is stored too, so that the output kernel
// cannot finish before this one has written everything.
__device__ __forceinline__ void signal_ready(int* flag) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(flag) : "memory");
}

// kLean (GdnSliceState::kV64Lean): the same arithmetic with fewer instructions per chunk step: U
// read and V_new written back as ldmatrix / stmatrix .trans fragments (4 + 4 per warp instead of
// 32 + 32 scalar 2-byte shared accesses), and the snapshot h_c staged by stmatrix in shared memory
// and stored as 16-byte rows after the state update is issued (8 instead of 32 global stores per
// thread, off the V_new -> h dependency chain). Bit-identical states, snapshots and V_new.
template <int NW, int STAGES, bool kSignal, bool kLean>
__global__ void __launch_bounds__(SliceCfg<NW, STAGES>::kThreads)
    gdn_state_slice_kernel(GdnShape s, GdnStatePool pool,
                           const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                           const int32_t* __restrict__ seq_pos,     // [n_seqs]
                           const int32_t* __restrict__ slot_ids,    // [n_seqs]
                           const int* __restrict__ seq_chunk0,      // [n_seqs + 1] first chunk
                           const bf16* __restrict__ qkv,            // [n_tokens, qkv_dim]
                           const float* __restrict__ gamma,         // [n_tokens, n_v]
                           const bf16* __restrict__ w_mat,          // [n_tokens, n_v, 128]
                           bf16* __restrict__ u_mat,   // [n_tokens, n_v, 128] in U, out V_new
                           bf16* __restrict__ h_snap,  // [max_chunks, n_v, 128 v, 128 k]
                           int* __restrict__ ready)    // [max_chunks, n_v] (kSignal only)
{
  if constexpr (kSignal) {
    // Every CTA of this grid is resident once all have passed here: only then may the output
    // grid start (its CTAs wait on `ready`, so it must never hold SMs that a state CTA needs).
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  using L = SliceCfg<NW, STAGES>;
  constexpr int kVs = L::kVs, kLdu = L::kLdu, kThreads = L::kThreads;
  const int seq = blockIdx.x, hv = blockIdx.y;
  const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
  if (len <= 0) return;  // the slot is left untouched
  const int v_cta = blockIdx.z * kVs;
  const int n_v = s.n_v_heads, hk = hv / (n_v / s.n_k_heads), qkv_dim = s.qkv_dim();
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int v_loc = 16 * warp;       // this warp's first column in the U tile
  const int v_base = v_cta + v_loc;  // this warp's state rows (head-relative)
  const int n_chunks = (len + kC - 1) / kC;
  const int64_t chunk0 = seq_chunk0[seq];

  auto tile = [&](int b, size_t off) { return reinterpret_cast<bf16*>(smem + b * L::kBuf + off); };
  auto gam_buf = [&](int b) { return reinterpret_cast<float*>(smem + b * L::kBuf + L::kGam); };
  // Chunk ch's K and W rows, this CTA's U columns and gamma into stage b (rows past the end: 0).
  auto fetch = [&](int ch, int b) {
    const int64_t row0 = start + static_cast<int64_t>(ch) * kC;
    const int n = min(kC, len - ch * kC);
    bf16* k_d = tile(b, L::kK);
    bf16* w_d = tile(b, L::kW);
    bf16* u_d = tile(b, L::kU);
    for (int e = tid; e < kC * (kD / 8); e += kThreads) {
      const int r = e / (kD / 8), col = (e % (kD / 8)) * 8;
      const bool ok = r < n;
      const int64_t row = row0 + (ok ? r : 0);
      cp_async16(k_d + r * kLd + col, qkv + row * qkv_dim + (s.n_k_heads + hk) * kD + col, ok);
      cp_async16(w_d + r * kLd + col, w_mat + (row * n_v + hv) * kD + col, ok);
    }
    for (int e = tid; e < kC * (kVs / 8); e += kThreads) {
      const int r = e / (kVs / 8), col = (e % (kVs / 8)) * 8;
      const bool ok = r < n;
      const int64_t row = row0 + (ok ? r : 0);
      cp_async16(u_d + r * kLdu + col, u_mat + (row * n_v + hv) * kD + v_cta + col, ok);
    }
    if (tid < kC) {
      const bool ok = tid < n;
      cp_async4(gam_buf(b) + tid, gamma + (row0 + (ok ? tid : 0)) * n_v + hv, ok);
    }
  };
  // Chunks 0 .. STAGES - 2 in flight before the loop (one commit group per chunk, empty past the
  // end, so cp_async_wait<STAGES - 2> always means "chunk ch landed").
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_chunks) fetch(st, st);
    cp_async_commit();
  }

  // The state: h[j][i] = h^T(v, k), v = v_base + g + 8 (i / 2), k = 8 j + 2 c + (i % 2).
  float* state = pool.rec_state + static_cast<int64_t>(slot_ids[seq]) * pool.rec_slot_stride +
                 static_cast<int64_t>(hv) * kD * kD;
  const bool has_state = seq_pos[seq] > 0;
  float h[16][4];
  gdn_tile::load_state_rows(h, state, has_state, v_base, g, c);

  for (int ch = 0; ch < n_chunks; ++ch) {
    const int b = ch % STAGES;
    const int64_t row0 = start + static_cast<int64_t>(ch) * kC;
    const int n = min(kC, len - ch * kC);
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // chunk ch landed; every warp is done with chunk ch - 1's stage
    // (and has stored chunk ch - 1's snapshot and V_new rows: publish them)
    if (kSignal && ch > 0 && tid == 0) signal_ready(ready + (chunk0 + ch - 1) * n_v + hv);
    if (ch + STAGES - 1 < n_chunks) fetch(ch + STAGES - 1, (ch + STAGES - 1) % STAGES);
    cp_async_commit();
    const bf16* k_s = tile(b, L::kK);
    const bf16* w_s = tile(b, L::kW);
    bf16* u_s = tile(b, L::kU);
    const float* gam = gam_buf(b);
    const float g_last = gam[n - 1];

    // ---- h^T as bf16 A fragments; they are also the snapshot h_c the output kernel reads.
    uint32_t ha[8][4];
    acc_to_a<16>(h, ha);
    if constexpr (!kLean) {
      bf16* hs = h_snap + ((chunk0 + ch) * n_v + hv) * static_cast<int64_t>(kD * kD) +
                 (v_base + g) * kD + 2 * c;
#pragma unroll
      for (int sk = 0; sk < 8; ++sk) {
        *reinterpret_cast<uint32_t*>(hs + 16 * sk) = ha[sk][0];
        *reinterpret_cast<uint32_t*>(hs + 8 * kD + 16 * sk) = ha[sk][1];
        *reinterpret_cast<uint32_t*>(hs + 16 * sk + 8) = ha[sk][2];
        *reinterpret_cast<uint32_t*>(hs + 8 * kD + 16 * sk + 8) = ha[sk][3];
      }
    }

    // ---- V_new^T [16 v, 64 t] = U^T - h^T W^T; B(k, t) = W[t][k].
    float vn[8][4];
    ha_times_tile_t(ha, w_s, lane, vn);
    uint32_t vsa[4][4];  // (V_new^T e^(gamma_last - gamma_t)) as A fragments
    if constexpr (kLean) {
      float vs[8][4], gc[8][2];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) gc[j][e] = __expf(g_last - gam[min(8 * j + 2 * c + e, n - 1)]);
      }
      const int m = lane >> 3, r = lane & 7;
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        // Matrix m: rows t = 16 jp + 8 (m / 2) + r, columns v_loc + 8 (m % 2): thread (g, c) gets
        // U[t = 2c, 2c + 1][v = g] of it, i.e. the pairs i = 0 / 1 (m even) or 2 / 3 (m odd) of
        // accumulator tile j = 2 jp + m / 2.
        bf16* up = u_s + (16 * jp + 8 * (m >> 1) + r) * kLdu + v_loc + 8 * (m & 1);
        uint32_t ur[4];
        ldsm_x4_t(ur, up);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int j = 2 * jp + (q >> 1), i0 = 2 * (q & 1);
          const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(&ur[q]);
          const bf16 x0 = __float2bfloat16(__low2float(u2) - vn[j][i0]);
          const bf16 x1 = __float2bfloat16(__high2float(u2) - vn[j][i0 + 1]);
          vs[j][i0] = __bfloat162float(x0) * gc[j][0];
          vs[j][i0 + 1] = __bfloat162float(x1) * gc[j][1];
          __nv_bfloat162 x2;
          x2.x = x0;
          x2.y = x1;
          ur[q] = *reinterpret_cast<const uint32_t*>(&x2);
        }
        stsm_x4_t(up, ur);  // V_new in place of U (this warp's columns only)
      }
      acc_to_a<8>(vs, vsa);
    } else {
      float vs[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float gc[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) gc[e] = __expf(g_last - gam[min(8 * j + 2 * c + e, n - 1)]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int v = v_loc + g + 8 * (i >> 1), t = 8 * j + 2 * c + (i & 1);
          const bf16 x = __float2bfloat16(__bfloat162float(u_s[t * kLdu + v]) - vn[j][i]);
          u_s[t * kLdu + v] = x;  // V_new in place of U (this warp's columns only)
          vs[j][i] = __bfloat162float(x) * gc[i & 1];
        }
      }
      acc_to_a<8>(vs, vsa);
    }
    __syncwarp();
    // V_new rows of this chunk, this warp's 16 columns (two 16-byte pieces per row), over U.
    for (int e = lane; e < 2 * kC; e += 32) {
      const int t = e >> 1, piece = e & 1;
      if (t < n) {
        *reinterpret_cast<uint4*>(u_mat + ((row0 + t) * n_v + hv) * kD + v_base + 8 * piece) =
            *reinterpret_cast<const uint4*>(u_s + t * kLdu + v_loc + 8 * piece);
      }
    }

    // ---- h^T <- e^(gamma_last) h^T + Vs^T K; B(t, k) = K[t][k] (ldmatrix.trans).
    const float decay = __expf(g_last);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) h[j][i] *= decay;
    }
    acc_a_times_tile(vsa, k_s, lane, kC / 16 - 1, h);

    if constexpr (kLean) {
      // The snapshot h_c (ha): stmatrix into this warp's staging rows, then 16-byte stores of its
      // 16 contiguous [128]-rows of h_snap. (The previous chunk's reads of the staging rows are
      // done: they fed that chunk's stores, before the block barrier.)
      bf16* sw = reinterpret_cast<bf16*>(smem + L::kTotal) + warp * 16 * kLd;
#pragma unroll
      for (int sk = 0; sk < 8; ++sk)
        stsm_x4(sw + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kLd + 16 * sk + 8 * (lane >> 4),
                ha[sk]);
      __syncwarp();
      bf16* hs = h_snap + ((chunk0 + ch) * n_v + hv) * static_cast<int64_t>(kD * kD) + v_base * kD;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int idx = 32 * e + lane, row = idx >> 4, col = 8 * (idx & 15);
        *reinterpret_cast<uint4*>(hs + row * kD + col) =
            *reinterpret_cast<const uint4*>(sw + row * kLd + col);
      }
    }
  }
  cp_async_wait_all();  // nothing in flight at exit (the last commit is empty)

  gdn_tile::store_state_rows(h, state, v_base, g, c);
  if constexpr (kSignal) {
    __syncthreads();  // the last chunk's V_new rows and the final state are stored
    if (tid == 0) signal_ready(ready + (chunk0 + n_chunks - 1) * n_v + hv);
  }
}

// ---- state pass on warpgroup MMAs, tiles moved by TMA (GdnSliceState::kWgmma) -------------------
// kLean's chunk step with its two products on wgmma and every tile moved by the TMA unit, so that
// the four warps (one per scheduler: the chain is issue-bound) spend their instructions on the
// chain. One warpgroup owns a 64-column slice (4 warps x 16 state rows; 96 CTAs for one 27B
// sequence):
//   S [64 v, 64 t] = h^T W^T: 8 x wgmma m64n64k16, A = h^T as bf16 register fragments (the
//     snapshot's bits), B = W [64 t, 128 k] K-major from shared memory;
//   h^T [64 v, 128 k] = e^(gamma_last) h^T + Vs^T K: 4 x wgmma m64n128k16, A = Vs^T from
//     registers, B = K [64 t, 128 k] MN-major.
// h^T (64 fp32 per thread) is the m64n128 accumulator, whose per-warp layout is kLean's mma.sync
// one (h[4 j + i] = h[j][i] there). Loads: while S of chunk ch runs, thread 0 loads chunk ch + 1
// into the other of two stages (once every warp has released it on its `empty` mbarrier): K and
// W as two [64 t, 64 k] boxes each (128-byte swizzle = the wgmma layout), this slice's U columns
// (one swizzled [64 t, 64 v] box), gamma (a [64 t, 4 heads] fp32 box), all on the stage's `full`
// mbarrier. Stores, per warp by its lane 0, two bulk groups per chunk: the warp's snapshot rows
// (two swizzled [16 v, 64 k] boxes, staged by stmatrix while S runs) and its V_new columns (a
// [64 t, 16 v] box staged by stmatrix.trans; a partial chunk stores its rows one by one, since
// the box would write past the sequence into the next one's U). Rows past the sequence's end in a
// partial chunk (another sequence's rows, or zeros past the tensor) are neutralised: K's rows are
// zeroed in shared memory and Vs is zero there, so nothing of them reaches h. No block barrier
// per chunk: with kSignal each warp publishes chunk c (ready += 1, so a head's chunk is ready at 4
// x n_slices) once its stores of c are complete, at the start of chunk c + 2; the last two after
// its final state rows are stored. Same products on the same operands in the same order as kLean:
// on the H200 y, states, snapshots and V_new come out bit-identical (wgmma sums as mma.sync does).
// H200, 4096 tokens (session 18, docs/perf/gdn_prefill.md): the pass alone 121.6 us vs 150.7
// (lean); with the output beside it 232.0 vs 250.1; whole layer 0.399 vs 0.423 ms.
// kTight ($DS_GDN_STATE=tight; session 22, built without a device, not yet measured): the same
// operations on the same values, with fewer instructions on the chain and more of them under the
// two products. The chain is one warp per scheduler and issue-bound. SASS per full chunk
// (tools/sass.py; a warp with lane-0 work), shipped -> tight:
//   top to S's issue 117 -> 62; under S 217 -> 134; S's completion to the update's issue 486 ->
//   333; under the update 24 -> 267. In all, 844 -> 796.
// The changes:
//   (1) The tile pointers keep their shared address space (align_1024_shared), so gamma is read
//       by ld.shared instead of generic loads.
//   (2) The next chunk's full-barrier wait, its decay factors and the publication of chunk ch - 1
//       run while chunk ch's update is on the tensor cores; the shipped form runs them at the top
//       of the chunk and right after S's wait.
//   (3) U - S is rounded two values at a time: one cvt.rn.bf16x2 gives the two scalar
//       conversions' bits, without their 2 cvt + 2 prmt.
//   (4) A full chunk, the uniform case, skips the per-row test.
// h's decay stays after S: multiplying h while S is in flight makes ptxas inject a wgmma wait
// there (C7517).
struct WgCfg {
  static constexpr int kThreads = 128;
  static constexpr int kStages = 2;  // 3 ran the pass alone no faster (121.6 us) and left no room
                                     // for an output CTA beside it (266 vs 232 us overlapped)
  static constexpr int kVs = 64;                        // state rows (value columns) per CTA
  static constexpr uint32_t kBox = kC * 128;            // one swizzled [64 rows, 64 bf16] box
  static constexpr uint32_t kK = 0, kW = 2 * kBox, kU = 4 * kBox, kGam = 5 * kBox;
  static constexpr uint32_t kBuf = kGam + kC * 4 * 4;   // + gamma [64 t][4 heads] fp32
  static constexpr uint32_t kSnap = kStages * kBuf;      // 4 warps x two [16 v, 64 k] boxes
  static constexpr uint32_t kVout = kSnap + 4 * 4096;   // 4 warps x [64 t, 16 v] bf16
  static constexpr uint32_t kBar = kVout + 4 * 2048;    // full[STAGES], empty[STAGES] mbarriers
  static constexpr size_t kTotal = 1024 + kBar + 2 * kStages * 8;  // + alignment slack
  static constexpr uint32_t kLoadBytes = kBuf;          // transaction bytes of one chunk's loads
  static_assert(kBuf % 1024 == 0 && kSnap % 1024 == 0, "swizzled boxes are 1024-byte aligned");
};

// The TMA maps of the wgmma state pass (make_gdn_wg_maps).
struct GdnWgMaps {
  CUtensorMap k;     // qkv [n_tokens, qkv_dim] bf16, box [64 t, 64], 128-byte swizzle
  CUtensorMap w;     // w_mat [n_tokens, n_v, 128] bf16, box [64 t, 1, 64], swizzled
  CUtensorMap u;     // u_mat, the same box (U in)
  CUtensorMap gam;   // gamma [n_tokens, n_v] fp32, box [64 t, 4]
  CUtensorMap vout;  // u_mat, box [64 t, 1, 16] (V_new out), no swizzle
  CUtensorMap snap;  // h_snap [max_chunks * n_v * 128 rows, 128] bf16, box [16, 64], swizzled
};

// A partial chunk (n < 64) in a chain warpgroup's stage: the rows past the sequence of the two
// swizzled [64 t, 64 k] boxes of K at k_box (another sequence's rows, or TMA's zeros past the
// tensor) to zeros, for the state update's wgmma reads them; then the proxy fence and the four
// chain warps' named barrier 1. All 128 threads of the warpgroup call it (tid: 0..127).
__device__ __forceinline__ void zero_k_tail(unsigned char* k_box, uint32_t box_bytes, int n,
                                            int tid) {
  for (int e = tid; e < (kC - n) * 16; e += 128) {
    const int r = n + (e >> 4), half = (e >> 3) & 1, q = e & 7;
    *reinterpret_cast<uint4*>(k_box + half * box_bytes + r * 128 + q * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  named_barrier_sync(1, 128);
}

// The exchange slots of a cluster pair's gated norm (thread 0, with the other mbarriers): one
// arrival each, armed for 64 row sums of 4 bytes before the cluster barrier that follows, so the
// peer's first stores never find a slot unarmed.
__device__ __forceinline__ void init_xchg_slots(uint64_t* xchg, int slots, bool norm) {
  for (int x = 0; x < slots; ++x) {
    mbar_init(&xchg[x], 1);
    if (norm) mbar_arrive_expect_tx(&xchg[x], kC * 4);
  }
}

template <bool kSignal, bool kTight>
__global__ void __launch_bounds__(WgCfg::kThreads, 1)
    gdn_state_wg_kernel(GdnShape s, GdnStatePool pool,
                        const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                        const int32_t* __restrict__ seq_pos,     // [n_seqs]
                        const int32_t* __restrict__ slot_ids,    // [n_seqs]
                        const int* __restrict__ seq_chunk0,      // [n_seqs + 1] first chunk
                        bf16* __restrict__ u_mat,  // V_new rows of partial chunks (plain stores)
                        int* __restrict__ ready,   // [max_chunks, n_v] (kSignal only)
                        const __grid_constant__ GdnWgMaps maps) {
  if constexpr (kSignal) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  using L = WgCfg;
  constexpr int STAGES = L::kStages;
  const int seq = blockIdx.x, hv = blockIdx.y;
  const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
  if (len <= 0) return;  // the slot is left untouched
  const int v_cta = blockIdx.z * L::kVs;
  const int n_v = s.n_v_heads, hk = hv / (n_v / s.n_k_heads);
  extern __shared__ unsigned char smem_raw[];
  // swizzle atoms; kTight: aligned by pointer arithmetic, so the compiler still sees shared
  // memory behind every tile pointer (ld.shared for gamma instead of generic loads)
  unsigned char* smem = kTight ? align_1024_shared(smem_raw) : align_1024(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int v_loc = 16 * warp;
  const int v_base = v_cta + v_loc;
  const int n_chunks = (len + kC - 1) / kC;
  const int64_t chunk0 = seq_chunk0[seq];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBar);
  uint64_t* empty = full + STAGES;
  auto stage = [&](int b) { return smem + b * L::kBuf; };

  if (tid == 0) {
    for (int b = 0; b < STAGES; ++b) {
      mbar_init(&full[b], 1);
      mbar_init(&empty[b], 4);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // Chunk ch's tiles into stage ch % STAGES once every warp has released it (thread 0).
  auto fetch = [&](int ch) {
    const int b = ch % STAGES, row0 = start + ch * kC;
    if (ch >= STAGES) mbar_wait(&empty[b], uint32_t(ch / STAGES - 1) & 1u);
    unsigned char* st = stage(b);
    mbar_arrive_expect_tx(&full[b], L::kLoadBytes);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      tma_load_2d(st + L::kK + half * L::kBox, &maps.k, (s.n_k_heads + hk) * kD + 64 * half, row0,
                  &full[b]);
      tma_load_3d(st + L::kW + half * L::kBox, &maps.w, 64 * half, hv, row0, &full[b]);
    }
    tma_load_3d(st + L::kU, &maps.u, v_cta, hv, row0, &full[b]);
    tma_load_2d(st + L::kGam, &maps.gam, hv & ~3, row0, &full[b]);
  };
  if (tid == 0)
    for (int ch = 0; ch < min(STAGES - 1, n_chunks); ++ch) fetch(ch);

  float* state = pool.rec_state + static_cast<int64_t>(slot_ids[seq]) * pool.rec_slot_stride +
                 static_cast<int64_t>(hv) * kD * kD;
  const bool has_state = seq_pos[seq] > 0;
  float h[64];  // h[4 j + i] = h^T(v_base + g + 8 (i / 2), 8 j + 2 c + (i % 2))
  gdn_tile::load_state_rows(reinterpret_cast<float(&)[16][4]>(h), state, has_state, v_base, g, c);
  bf16* snap_w = reinterpret_cast<bf16*>(smem + L::kSnap + warp * 4096);  // two [16, 64] boxes
  bf16* vout_w = reinterpret_cast<bf16*>(smem + L::kVout + warp * 2048);  // [64 t][16 v]
  int* ready_h = ready + hv;  // ready[chunk * n_v + hv]: one count per consumer warp and slice
  // kTight: chunk cx's tiles waited for and its decay factors formed one chunk ahead, while the
  // previous chunk's update runs (loop-carried g_last and gc; the shipped form does both at the
  // top of each chunk, on the chain).
  float g_last_t = 0.f, gc_t[8][2];
  auto prologue = [&](int cx) {
    const int nx = min(kC, len - cx * kC), hx = hv & 3;
    mbar_wait(&full[cx % STAGES], uint32_t(cx / STAGES) & 1u);
    const float* gx = reinterpret_cast<const float*>(stage(cx % STAGES) + L::kGam);
    g_last_t = gx[(nx - 1) * 4 + hx];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
        gc_t[j][e] = __expf(g_last_t - gx[min(8 * j + 2 * c + e, nx - 1) * 4 + hx]);
    }
  };
  // (STAGES >= 2: chunk ch + 1's loads are issued during chunk ch, before its prologue waits.)
  static_assert(!kTight || STAGES >= 2, "the tight form waits for the next chunk one chunk ahead");
  if constexpr (kTight) prologue(0);

  for (int ch = 0; ch < n_chunks; ++ch) {
    const int b = ch % STAGES;
    const int row0 = start + ch * kC;
    const int n = min(kC, len - ch * kC);
    unsigned char* st = stage(b);
    if constexpr (!kTight) mbar_wait(&full[b], uint32_t(ch / STAGES) & 1u);
    if (n < kC) zero_k_tail(st + L::kK, L::kBox, n, tid);  // wgmma reads K's rows past n
    if (kSignal && !kTight && ch >= 2 && lane == 0) {  // this warp's stores of chunk ch - 2 are
      tma_wait<2>();                                   // complete: publish them
      asm volatile("fence.proxy.async.global;" ::: "memory");
      signal_ready(ready_h + (chunk0 + ch - 2) * n_v);
    }
    const uint32_t k_s = smem_u32(st + L::kK), w_s = smem_u32(st + L::kW);
    const bf16* u_s = reinterpret_cast<const bf16*>(st + L::kU);
    const float* gam = reinterpret_cast<const float*>(st + L::kGam);
    const int hq = hv & 3;
    const float g_last = kTight ? g_last_t : gam[(n - 1) * 4 + hq];
    float gc[8][2];  // e^(gamma_last - gamma_t) of V_new's rows

    // ---- h^T as bf16 A fragments (also the snapshot h_c); S = h^T W^T.
    uint32_t ha[8][4];
    gdn_tile::acc_to_a<16>(reinterpret_cast<const float(&)[16][4]>(h), ha);
    // The snapshot h_c into this warp's staging boxes (once the previous chunk's snapshot group
    // has read them: bulk groups per chunk [snapshot, V_new]), stored by lane 0 as one group.
    auto snapshot = [&](const uint32_t (&frag)[8][4]) {
      if (lane == 0) tma_wait_read<1>();
      __syncwarp();
#pragma unroll
      for (int sk = 0; sk < 8; ++sk) {
        const int row = (lane & 7) + 8 * ((lane >> 3) & 1), q = 2 * sk + (lane >> 4);
        stsm_x4(reinterpret_cast<bf16*>(reinterpret_cast<unsigned char*>(snap_w) +
                                        (q >> 3) * 2048 + row * 128 +
                                        (((q & 7) ^ (row & 7)) << 4)),
                frag[sk]);
      }
      fence_proxy_async();
      __syncwarp();
      if (lane == 0) {
        const int snap_row = static_cast<int>(((chunk0 + ch) * n_v + hv) * kD + v_base);
        tma_store_2d(&maps.snap, 0, snap_row, snap_w);
        tma_store_2d(&maps.snap, 64, snap_row, reinterpret_cast<unsigned char*>(snap_w) + 2048);
        tma_commit();
      }
    };
    float sacc[32];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      wgmma_m64n64k16_rs(sacc, ha[kk],
                         gmma_desc(w_s + (kk >> 2) * L::kBox + (kk & 3) * 32, 16, 1024),
                         kk == 0 ? 0 : 1);
    wgmma_commit();
    // While S runs: the loads of chunk ch + STAGES - 1 (thread 0; its stage was released at the
    // end of chunk ch - 1), the snapshot into this warp's staging boxes (once the previous chunk's
    // snapshot group has read them: bulk groups per chunk [snapshot, V_new]), stored by lane 0 as
    // one group; and the decay factors.
    if (tid == 0 && ch + STAGES - 1 < n_chunks) fetch(ch + STAGES - 1);
    // The snapshot is packed again from h (bit-identical to ha): ha is S's A operand, and PTX
    // makes any access to it before wgmma.wait_group undefined. fence_regs keeps the compiler
    // from reusing ha's registers for the same values. (Storing ha itself before S is issued
    // leaves S's latency uncovered; ptxas shares the conversions with ha anyway.)
    {
      fence_regs(h);
      uint32_t hs[8][4];
#pragma unroll
      for (int sk = 0; sk < 8; ++sk) {
        hs[sk][0] = pack_bf16(h[8 * sk], h[8 * sk + 1]);
        hs[sk][1] = pack_bf16(h[8 * sk + 2], h[8 * sk + 3]);
        hs[sk][2] = pack_bf16(h[8 * sk + 4], h[8 * sk + 5]);
        hs[sk][3] = pack_bf16(h[8 * sk + 6], h[8 * sk + 7]);
      }
      snapshot(hs);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
        gc[j][e] =
            kTight ? gc_t[j][e] : __expf(g_last - gam[min(8 * j + 2 * c + e, n - 1) * 4 + hq]);
    }
    const float decay = __expf(g_last);
    wgmma_wait<0>();
    fence_regs(sacc);

    // ---- V_new^T = U^T - S (bf16, staged for the store once the previous chunk's V_new group
    // has read the staging rows), Vs = V_new^T e^(gamma_last - gamma_t), zero past the sequence.
    if (lane == 0) tma_wait_read<1>();
    __syncwarp();
    uint32_t vsa[4][4];
    // kTight: U - S packed to bf16 two at a time (one cvt.rn.bf16x2, the same rounding as two
    // scalar conversions), and a full chunk (the uniform case) without the per-element row test.
    auto v_new = [&](auto is_full) {
      float vs[8][4];
      const int m = lane >> 3, r = lane & 7;
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        // Matrix m: rows t = 16 jp + 8 (m / 2) + r, columns v_loc + 8 (m % 2) (chunk q of the
        // swizzled U row).
        const int t = 16 * jp + 8 * (m >> 1) + r, q = 2 * warp + (m & 1);
        uint32_t ur[4];
        ldsm_x4_t(ur, reinterpret_cast<const bf16*>(reinterpret_cast<const unsigned char*>(u_s) +
                                                    t * 128 + ((q ^ (t & 7)) << 4)));
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
          const int j = 2 * jp + (qq >> 1), i0 = 2 * (qq & 1);
          const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(&ur[qq]);
          const int t0 = 8 * j + 2 * c;
          if constexpr (kTight) {
            const uint32_t x2 = pack_bf16(__low2float(u2) - sacc[4 * j + i0],
                                          __high2float(u2) - sacc[4 * j + i0 + 1]);
            const float x0 = __uint_as_float(x2 << 16), x1 = __uint_as_float(x2 & 0xffff0000u);
            vs[j][i0] = decltype(is_full)::value || t0 < n ? x0 * gc[j][0] : 0.f;
            vs[j][i0 + 1] = decltype(is_full)::value || t0 + 1 < n ? x1 * gc[j][1] : 0.f;
            ur[qq] = x2;
          } else {
            const bf16 x0 = __float2bfloat16(__low2float(u2) - sacc[4 * j + i0]);
            const bf16 x1 = __float2bfloat16(__high2float(u2) - sacc[4 * j + i0 + 1]);
            vs[j][i0] = t0 < n ? __bfloat162float(x0) * gc[j][0] : 0.f;
            vs[j][i0 + 1] = t0 + 1 < n ? __bfloat162float(x1) * gc[j][1] : 0.f;
            __nv_bfloat162 x2;
            x2.x = x0;
            x2.y = x1;
            ur[qq] = *reinterpret_cast<const uint32_t*>(&x2);
          }
        }
        stsm_x4_t(vout_w + t * 16 + 8 * (m & 1), ur);
      }
      gdn_tile::acc_to_a<8>(vs, vsa);
    };
    if (kTight && n == kC)
      v_new(std::true_type{});
    else
      v_new(std::false_type{});

    // ---- h^T <- e^(gamma_last) h^T + Vs^T K.
#pragma unroll
    for (int i = 0; i < 64; ++i) h[i] *= decay;
    fence_regs(h);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kC / 16; ++kk)
      wgmma_m64n128k16_rs_t(h, vsa[kk], gmma_desc(k_s + kk * 16 * 128, L::kBox, 1024));
    wgmma_commit();

    // While the update runs: this warp's V_new columns (a box; rows past the sequence must not be
    // written: those belong to the next sequence, so a partial chunk stores its rows one by one).
    fence_proxy_async();
    __syncwarp();
    if (n == kC) {
      if (lane == 0) tma_store_3d(&maps.vout, v_base, hv, row0, vout_w);
    } else {
      for (int e = lane; e < 2 * n; e += 32) {
        const int t = e >> 1, piece = e & 1;
        *reinterpret_cast<uint4*>(u_mat + ((int64_t(row0) + t) * n_v + hv) * kD + v_base +
                                  8 * piece) =
            *reinterpret_cast<const uint4*>(vout_w + t * 16 + 8 * piece);
      }
    }
    if (lane == 0) tma_commit();
    if constexpr (kTight) {
      // While the update runs: the next chunk's tiles and decay factors, and the publication of
      // chunk ch - 1 (its snapshot and V_new groups are complete once at most this chunk's two
      // are pending), which the shipped form does at the top of chunk ch + 1. The last two
      // chunks are published after the final state, as there.
      if (ch + 1 < n_chunks) {
        if (kSignal && ch >= 1 && lane == 0) {  // first: it releases waiting output CTAs
          tma_wait<2>();
          asm volatile("fence.proxy.async.global;" ::: "memory");
          signal_ready(ready_h + (chunk0 + ch - 1) * n_v);
        }
        __syncwarp();
        prologue(ch + 1);
      }
      __syncwarp();
    }
    wgmma_wait<0>();
    fence_regs(h);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[b]);  // this warp is done with stage b
  }
  if (lane == 0) {  // every store of this warp is complete
    tma_wait<0>();
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }

  gdn_tile::store_state_rows(reinterpret_cast<const float(&)[16][4]>(h), state, v_base, g, c);
  if constexpr (kSignal) {
    __syncwarp();  // this warp's last stores and its final state rows are done
    if (lane == 0) {
      if (n_chunks >= 2) signal_ready(ready_h + (chunk0 + n_chunks - 2) * n_v);
      signal_ready(ready_h + (chunk0 + n_chunks - 1) * n_v);
    }
  }
}

// A row-major bf16 matrix [rows, cols] in boxes of [box_rows, box_cols].
CUtensorMap matrix_map(const void* base, uint64_t rows, uint64_t cols, uint32_t box_rows,
                       uint32_t box_cols, CUtensorMapSwizzle swizzle, const char* what) {
  const uint64_t dims[2] = {cols, rows}, strides[1] = {cols * 2};
  const uint32_t box[2] = {box_cols, box_rows};
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, swizzle,
                         what);
}
// A per-head bf16 tensor [n_tokens, n_v, 128] (W, U / V_new) in boxes of [64 tokens, 1 head,
// box_cols].
CUtensorMap head_rows_map(const bf16* base, const GdnShape& s, int n_tokens, uint32_t box_cols,
                          CUtensorMapSwizzle swizzle, const char* what) {
  const uint64_t nv = uint64_t(s.n_v_heads);
  const uint64_t dims[3] = {kD, nv, uint64_t(n_tokens)}, strides[2] = {kD * 2, nv * kD * 2};
  const uint32_t box[3] = {box_cols, 1, kC};
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, dims, strides, box, swizzle,
                         what);
}

// The maps of gdn_state_wg_kernel over this launch's tensors (n_tokens rows).
GdnWgMaps make_gdn_wg_maps(const GdnShape& s, int n_tokens, int max_chunks, const bf16* qkv,
                           const float* gamma, const bf16* w_mat, const bf16* u_mat,
                           const bf16* h_snap) {
  constexpr CUtensorMapSwizzle kSw = CU_TENSOR_MAP_SWIZZLE_128B, kNone = CU_TENSOR_MAP_SWIZZLE_NONE;
  GdnWgMaps m;
  m.k = matrix_map(qkv, n_tokens, s.qkv_dim(), kC, 64, kSw, "gdn state pass: K");
  m.w = head_rows_map(w_mat, s, n_tokens, 64, kSw, "gdn state pass: W");
  m.u = head_rows_map(u_mat, s, n_tokens, 64, kSw, "gdn state pass: U");
  m.vout = head_rows_map(u_mat, s, n_tokens, 16, kNone, "gdn state pass: V_new");
  {
    const uint64_t nv = uint64_t(s.n_v_heads);
    const uint64_t dims[2] = {nv, uint64_t(n_tokens)}, strides[1] = {nv * 4};
    const uint32_t box[2] = {4, kC};
    m.gam = make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, gamma, dims, strides, box, kNone,
                            "gdn state pass: gamma");
  }
  m.snap = matrix_map(h_snap, uint64_t(max_chunks) * s.n_v_heads * kD, kD, 16, 64, kSw,
                      "gdn state pass: snapshots");
  return m;
}

// ---- output -------------------------------------------------------------------------------------
template <int VS>
struct OutCfg {
  static constexpr int kThreads = 128 * VS;
  static constexpr size_t kQ = 0, kK = kTileBytes, kV = 2 * kTileBytes, kZ = 3 * kTileBytes;
  static constexpr size_t kH = 4 * kTileBytes;                  // [128 v][kLd] bf16
  static constexpr size_t kGam = kH + sizeof(bf16) * kD * kLd;  // [64] fp32
  static constexpr size_t kSs = kGam + sizeof(float) * kC;  // [8 warps][16 rows] row sums (VS 2)
  static constexpr size_t kTotal = kSs + sizeof(float) * 8 * 16;
};
// kTma (slice_scan_wg): Q, K, z, V_new as two swizzled [64 t, 64] boxes each and h_c as two
// [128 v, 64 k] boxes, moved by TMA (no padding: 98 KB instead of 105), on two mbarriers.
struct OutTmaCfg {
  static constexpr uint32_t kBox = kC * 128;  // one [64 rows, 64 bf16] box
  static constexpr uint32_t kQ = 0, kK = 2 * kBox, kV = 4 * kBox, kZ = 6 * kBox, kH = 8 * kBox;
  static constexpr uint32_t kGam = kH + 2 * kD * 128;         // [64] fp32
  static constexpr uint32_t kSs = kGam + sizeof(float) * kC;  // [8 warps][16 rows] row sums
  static constexpr uint32_t kBar = kSs + sizeof(float) * 8 * 16;
  static constexpr size_t kTotal = 1024 + kBar + 16;  // + alignment slack
};
// The TMA maps of the TMA-fed output kernels (make_gdn_out_maps).
struct GdnOutMaps {
  CUtensorMap qk;  // qkv [n_tokens, qkv_dim] bf16, box [64 t, 64], 128-byte swizzle
  CUtensorMap z;   // proj [n_tokens, in_dim] bf16, the same box
  CUtensorMap v;   // V_new [n_tokens, n_v, 128], box [64 t, 1, 64], swizzled
  CUtensorMap h;   // h_snap [max_chunks * n_v * 128 rows, 128], box [128 v, 64 k], swizzled
};

// P [16 rows of the chunk from r0, 64 t'] = causal(Q K^T) e^(gamma_t - gamma_t') in place on the
// mma.sync / wgmma accumulator layout (p[jt][2 half + e]: row r0 + g + 8 half, column 8 jt + 2 c
// + e); grow receives gamma of the thread's two rows (the output's e^gamma needs them too).
__device__ __forceinline__ void decay_mask_p(float (&p)[8][4], const float* gam, int r0, int g,
                                             int c, float (&grow)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) grow[half] = gam[r0 + g + 8 * half];
#pragma unroll
  for (int jt = 0; jt < 8; ++jt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = r0 + g + 8 * half;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 8 * jt + 2 * c + e;
        float& x = p[jt][2 * half + e];
        x = j <= i ? x * __expf(grow[half] - gam[j]) : 0.f;
      }
    }
  }
}
// In a partial chunk (n < 64), V_new's rows past the sequence (another sequence's, or zeros) in
// its two swizzled [64 t, 64] boxes at smem + v_off to zeros: P is 0 there, but 0 x NaN is not.
template <int kThreads>
__device__ __forceinline__ void zero_v_tail(unsigned char* smem, uint32_t v_off, int n, int tid) {
  for (int e = tid; e < (kC - n) * 16; e += kThreads) {
    const int r = n + (e >> 4), half = (e >> 3) & 1, q = e & 7;
    *reinterpret_cast<uint4*>(smem + v_off + half * OutTmaCfg::kBox + r * 128 + q * 16) =
        make_uint4(0, 0, 0, 0);
  }
}

// The TMA loads of the output kernels, by one thread. Phase 1: the barriers initialised, Q and K
// (and z when `z_off` >= 0) on bar[0]. Phase 2: once ready[chunk][hv] counts n_slices, V_new (at
// `v_off`) and h_c (at `h_off`) on bar[1].
__device__ __forceinline__ void out_tma_fetch_qkz(const GdnShape& s, const GdnOutMaps& om,
                                                  unsigned char* smem, uint64_t* bar, int hv,
                                                  int64_t row0, int z_off) {
  using LT = OutTmaCfg;
  const int hk = hv / (s.n_v_heads / s.n_k_heads), r0 = static_cast<int>(row0);
  mbar_init(&bar[0], 1);
  mbar_init(&bar[1], 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  fence_proxy_async();  // the initialised barriers, visible to this thread's copies
  mbar_arrive_expect_tx(&bar[0], (z_off >= 0 ? 6 : 4) * LT::kBox);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    tma_load_2d(smem + LT::kQ + half * LT::kBox, &om.qk, hk * kD + 64 * half, r0, &bar[0]);
    tma_load_2d(smem + LT::kK + half * LT::kBox, &om.qk, (s.n_k_heads + hk) * kD + 64 * half, r0,
                &bar[0]);
    if (z_off >= 0)
      tma_load_2d(smem + z_off + half * LT::kBox, &om.z, s.qkv_dim() + hv * kD + 64 * half, r0,
                  &bar[0]);
  }
}
__device__ __forceinline__ void out_tma_fetch_vh(const GdnShape& s, const GdnOutMaps& om,
                                                 unsigned char* smem, uint64_t* bar, int chunk,
                                                 int hv, int64_t row0, uint32_t v_off,
                                                 uint32_t h_off, const int* ready, int n_slices) {
  using LT = OutTmaCfg;
  const int n_v = s.n_v_heads;
  const int* flag = ready + static_cast<int64_t>(chunk) * n_v + hv;
  while (load_acquire(flag) < n_slices) __nanosleep(128);
  // h_c and V_new of this chunk are stored (acquired above): read them through the async proxy
  asm volatile("fence.proxy.async.global;" ::: "memory");
  mbar_arrive_expect_tx(&bar[1], 6 * LT::kBox);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    tma_load_3d(smem + v_off + half * LT::kBox, &om.v, 64 * half, hv, static_cast<int>(row0),
                &bar[1]);
    tma_load_2d(smem + h_off + half * 2 * LT::kBox, &om.h, 64 * half,
                static_cast<int>((static_cast<int64_t>(chunk) * n_v + hv) * kD), &bar[1]);
  }
}

// kWait (slice_scan_ov): launched beside the state pass (programmatic dependent launch, grid
// head-major so that CTAs start in the order the state pass finishes chunks); it stages Q, K and z,
// then waits until ready[chunk][head] == n_slices before it reads h_c and V_new. The arithmetic is
// the same as without kWait (bit-identical outputs).
// kTma (slice_scan_wg, gdn_chunk_out_tma_kernel): the same arithmetic with Q, K, z, V_new and h_c
// moved by TMA into swizzled boxes (thread 0: Q, K, z on one mbarrier before the wait, V_new and
// h_c on another after it) instead of 24 cp.async per thread; in a partial chunk V_new's rows past
// the sequence (another sequence's rows, or zeros) are zeroed before P V (P is 0 there, 0 x NaN is
// not). Bit-identical to the cp.async form. H200, 4096 tokens beside the wgmma state pass: 213.5
// vs 231.7 us (session 18; `$DS_GDN_OUT=tma` / `cp` run these forms there since session 19).
template <int VS, bool kWait, bool kTma>
__device__ __forceinline__ void gdn_chunk_out(GdnShape s, GdnLayerWeights wts,
                         const int4* __restrict__ chunks,  // [max_chunks] {seq, t0, n, index}
                         const bf16* __restrict__ proj,    // [n_tokens, in_dim] (z)
                         const bf16* __restrict__ qkv,     // [n_tokens, qkv_dim]
                         const float* __restrict__ gamma,  // [n_tokens, n_v]
                         const bf16* __restrict__ vn_mat,  // [n_tokens, n_v, 128] V_new
                         const bf16* __restrict__ h_snap,  // [max_chunks, n_v, 128 v, 128 k]
                         bf16* __restrict__ out,           // [n_tokens, n_v * 128]
                         const int* __restrict__ ready,    // [max_chunks, n_v] (kWait only)
                         int n_slices,  // ready count of a chunk's head (kWait only)
                         const GdnOutMaps& om)  // kTma only
{
  static_assert(!kTma || (VS == 2 && kWait), "the TMA form is slice_scan_wg's output");
  using L = OutCfg<VS>;
  using LT = OutTmaCfg;
  constexpr int kNj = 16 / VS;  // 8-column tiles of O per warp
  const int chunk = kWait ? blockIdx.y : blockIdx.x;
  const int hv = kWait ? blockIdx.x : blockIdx.y;
  const int4 ci = chunks[chunk];
  if (ci.x < 0) return;
  const int64_t row0 = ci.y;
  const int n = ci.z;
  const int n_v = s.n_v_heads, hk = hv / (n_v / s.n_k_heads);
  const int qkv_dim = s.qkv_dim(), in_dim = s.in_dim(), out_dim = s.out_dim();
  const bool norm = wts.norm_w != nullptr;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = kTma ? align_1024(smem_raw) : smem_raw;
  bf16* q_s = reinterpret_cast<bf16*>(smem + (kTma ? LT::kQ : L::kQ));
  bf16* k_s = reinterpret_cast<bf16*>(smem + (kTma ? LT::kK : L::kK));
  bf16* v_s = reinterpret_cast<bf16*>(smem + (kTma ? LT::kV : L::kV));
  bf16* z_s = reinterpret_cast<bf16*>(smem + (kTma ? LT::kZ : L::kZ));
  bf16* h_s = reinterpret_cast<bf16*>(smem + (kTma ? LT::kH : L::kH));
  float* gam = reinterpret_cast<float*>(smem + (kTma ? LT::kGam : L::kGam));
  // Element (r, col) of a staged tile with `rows` rows: padded rows of kLd, or (kTma) column
  // boxes of [rows, 64] with the 128-byte swizzle (16-byte chunks stay whole).
  auto at = [](const bf16* base, int rows, int r, int col) -> const bf16* {
    if constexpr (kTma)
      return reinterpret_cast<const bf16*>(reinterpret_cast<const unsigned char*>(base) +
                                           (col >> 6) * rows * 128 + r * 128 +
                                           ((((col >> 3) & 7) ^ (r & 7)) << 4) + (col & 7) * 2);
    else
      return base + r * kLd + col;
  };
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int rb = warp & 3;                        // row block: rows [16 rb, 16 rb + 16)
  const int vo = VS == 2 ? 64 * (warp >> 2) : 0;  // first of this warp's 128 / VS columns
  float* ssb = reinterpret_cast<float*>(smem + (kTma ? LT::kSs : L::kSs));

  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + LT::kBar);  // kTma: [Q, K, z], [V_new, h_c]
  if constexpr (kTma) {
    if (tid == 0) {
      out_tma_fetch_qkz(s, om, smem, bar, hv, row0, norm ? static_cast<int>(LT::kZ) : -1);
      out_tma_fetch_vh(s, om, smem, bar, chunk, hv, row0, LT::kV, LT::kH, ready, n_slices);
    }
    if (tid < kC) gam[tid] = gamma[(row0 + min(tid, n - 1)) * n_v + hv];  // held past the end
    __syncthreads();  // the mbarriers are initialised, gamma is in
    mbar_wait(&bar[0], 0);
  } else {
    // Two cp.async groups: Q, K (for P), then V_new, z and the snapshot h_c, which land while the
    // warps form P (kWait: z joins the first group, the second waits for the state pass).
    for (int e = tid; e < kC * (kD / 8); e += L::kThreads) {
      const int r = e / (kD / 8), col = (e % (kD / 8)) * 8;
      const bool ok = r < n;
      const int64_t row = row0 + (ok ? r : 0);
      const bf16* qkv_row = qkv + row * qkv_dim;
      cp_async16(q_s + r * kLd + col, qkv_row + hk * kD + col, ok);
      cp_async16(k_s + r * kLd + col, qkv_row + (s.n_k_heads + hk) * kD + col, ok);
      if (kWait && norm)
        cp_async16(z_s + r * kLd + col, proj + row * in_dim + qkv_dim + hv * kD + col, ok);
    }
    cp_async_commit();
    if constexpr (kWait) {
      if (tid == 0) {
        const int* flag = ready + static_cast<int64_t>(chunk) * n_v + hv;
        while (load_acquire(flag) < n_slices) __nanosleep(128);
      }
      __syncthreads();  // h_c and V_new of this chunk are stored and visible (acquired above)
    }
    for (int e = tid; e < kC * (kD / 8); e += L::kThreads) {
      const int r = e / (kD / 8), col = (e % (kD / 8)) * 8;
      const bool ok = r < n;
      const int64_t row = row0 + (ok ? r : 0);
      cp_async16(v_s + r * kLd + col, vn_mat + (row * n_v + hv) * kD + col, ok);
      if (!kWait && norm)
        cp_async16(z_s + r * kLd + col, proj + row * in_dim + qkv_dim + hv * kD + col, ok);
    }
    const bf16* hsrc = h_snap + (static_cast<int64_t>(chunk) * n_v + hv) * (kD * kD);
    for (int e = tid; e < kD * (kD / 8); e += L::kThreads) {
      const int r = e / (kD / 8), col = (e % (kD / 8)) * 8;
      cp_async16(h_s + r * kLd + col, hsrc + r * kD + col, true);
    }
    cp_async_commit();
    if (tid < kC) gam[tid] = gamma[(row0 + min(tid, n - 1)) * n_v + hv];  // held past the end
    cp_async_wait<1>();
    __syncthreads();                  // Q, K and gamma are in
  }
  const bool active = 16 * rb < n;  // a valid row among this warp's 16

  // Q rows [16 w, 16 w + 16) as A fragments (k-steps of 16).
  uint32_t qa[8][4];
  uint32_t pa[4][4];  // P as A fragments (k-steps of 16 columns t')
  float grow[2];      // gamma of this thread's two rows
  if (active) {
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
      ldsm_x4(qa[ks], at(q_s, kC, 16 * rb + (lane & 15), 16 * ks + (lane >> 4) * 8));

    // ---- P [16 t, 64 t'] = causal(Q K^T) e^(gamma_t - gamma_t'): column tiles jt <= 2 w + 1.
    float pacc[8][4];
#pragma unroll
    for (int jt = 0; jt < 8; ++jt) pacc[jt][0] = pacc[jt][1] = pacc[jt][2] = pacc[jt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
#pragma unroll
      for (int jt = 0; jt < 8; ++jt) {
        if (jt <= 2 * rb + 1) {
          uint32_t bb[2];
          ldsm_x2(bb, at(k_s, kC, 8 * jt + (lane & 7), 16 * ks + ((lane >> 3) & 1) * 8));
          mma_bf16(pacc[jt], qa[ks], bb[0], bb[1]);
        }
      }
    }
    decay_mask_p(pacc, gam, 16 * rb, g, c, grow);
    acc_to_a<8>(pacc, pa);
  }
  if constexpr (kTma) {
    mbar_wait(&bar[1], 0);
    if (n < kC) zero_v_tail<L::kThreads>(smem, LT::kV, n, tid);
  } else {
    cp_async_wait_all();
  }
  __syncthreads();  // V_new, z and h_c are in
  if (!active) return;

  // ---- O [16 t, 128 / VS v] = e^gamma (Q h_c) + P V_new; B(k, v) = h^T[v][k] (h_s rows v).
  float o[kNj][4];
#pragma unroll
  for (int j = 0; j < kNj; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kD / 32; ++kk) {
#pragma unroll
    for (int j = 0; j < kNj; ++j) {
      uint32_t bh[4];
      ldsm_x4(bh, at(h_s, kD, vo + 8 * j + (lane & 7), 32 * kk + (lane >> 3) * 8));
      mma_bf16(o[j], qa[2 * kk], bh[0], bh[1]);
      mma_bf16(o[j], qa[2 * kk + 1], bh[2], bh[3]);
    }
  }
  const float eg0 = __expf(grow[0]), eg1 = __expf(grow[1]);
#pragma unroll
  for (int j = 0; j < kNj; ++j) {
    o[j][0] *= eg0;
    o[j][1] *= eg0;
    o[j][2] *= eg1;
    o[j][3] *= eg1;
  }
  // P V_new; B(t', v) = V_new[t'][v] (ldmatrix.trans); P is lower triangular: k-steps <= rb.
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks) {
    if (ks <= rb) {
#pragma unroll
      for (int jp = 0; jp < kNj / 2; ++jp) {
        uint32_t bv[4];
        ldsm_x4_t(bv, at(v_s, kC, 16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8,
                         vo + 16 * jp + (lane >> 4) * 8));
        mma_bf16(o[2 * jp], pa[ks], bv[0], bv[1]);
        mma_bf16(o[2 * jp + 1], pa[ks], bv[2], bv[3]);
      }
    }
  }

  // ---- Gated RMSNorm per row (the 4 lanes of a quad hold one row's 128 / VS columns; VS 2: the
  // two warps of a row block add their sums through shared memory), bf16 out.
  float ss[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float x = 0.f;
#pragma unroll
    for (int j = 0; j < kNj; ++j)
      x += o[j][2 * half] * o[j][2 * half] + o[j][2 * half + 1] * o[j][2 * half + 1];
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    ss[half] = x + __shfl_xor_sync(0xffffffffu, x, 2);
  }
  if constexpr (VS == 2) {
    if (c == 0) {
      ssb[warp * 16 + g] = ss[0];
      ssb[warp * 16 + g + 8] = ss[1];
    }
    named_barrier_sync(1 + rb, 64);
    ss[0] += ssb[(warp ^ 4) * 16 + g];
    ss[1] += ssb[(warp ^ 4) * 16 + g + 8];
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = 16 * rb + g + 8 * half;
    const float scale = norm ? rsqrtf(ss[half] / kD + s.norm_eps) : 1.f;
    if (i < n) {
      bf16* y = out + (row0 + i) * out_dim + hv * kD + vo + 2 * c;
#pragma unroll
      for (int j = 0; j < kNj; ++j) {
        float y0 = o[j][2 * half], y1 = o[j][2 * half + 1];
        if (norm) {
          const int v = vo + 8 * j + 2 * c;
          const __nv_bfloat162 z2 = *reinterpret_cast<const __nv_bfloat162*>(at(z_s, kC, i, v));
          const __nv_bfloat162 w2 = *reinterpret_cast<const __nv_bfloat162*>(wts.norm_w + v);
          y0 = __low2float(w2) * y0 * scale * silu(__low2float(z2));
          y1 = __high2float(w2) * y1 * scale * silu(__high2float(z2));
        }
        *reinterpret_cast<uint32_t*>(y + 8 * j) = pack_bf16(y0, y1);
      }
    }
  }
}

#define DS_GDN_OUT_PARAMS                                                                         \
  GdnShape s, GdnLayerWeights wts, const int4* __restrict__ chunks,                              \
      const bf16* __restrict__ proj, const bf16* __restrict__ qkv, const float* __restrict__ gamma, \
      const bf16* __restrict__ vn_mat, const bf16* __restrict__ h_snap, bf16* __restrict__ out,   \
      const int* __restrict__ ready, int n_slices, const __grid_constant__ GdnOutMaps om
#define DS_GDN_OUT_ARGS s, wts, chunks, proj, qkv, gamma, vn_mat, h_snap, out, ready, n_slices, om
template <int VS, bool kWait>
__global__ void __launch_bounds__(OutCfg<VS>::kThreads) gdn_chunk_out_kernel(DS_GDN_OUT_PARAMS) {
  gdn_chunk_out<VS, kWait, false>(DS_GDN_OUT_ARGS);
}
// The TMA form with at most 128 registers, so that two CTAs fit on an SM without a state CTA.
__global__ void __launch_bounds__(OutCfg<2>::kThreads, 2)
    gdn_chunk_out_tma_kernel(DS_GDN_OUT_PARAMS) {
  gdn_chunk_out<2, true, true>(DS_GDN_OUT_ARGS);
}

// slice_scan_wg's output on warpgroup MMAs (the default beside the wgmma state pass; `$DS_GDN_OUT`
// = tma / cp runs gdn_chunk_out's mma.sync forms). One warpgroup per (chunk, head); warp w owns
// rows [16 w, 16 w + 16) of every accumulator (the wgmma D layout is mma.sync's per warp), so each
// step below is gdn_chunk_out's on the same operands, and the outputs are bit-identical to it:
//   S [64 t, 64 t'] = Q K^T: 8 x m64n64k16, A = Q, B = K from shared memory (K-major); P =
//     causal(S) e^(gamma_t - gamma_t') as bf16 register A fragments (no warp pair recomputes it);
//   O [64 t, 128 v] = Q h_c^T: 8 x m64n128k16, B = h_c [128 v, 128 k] K-major; O *= e^gamma_t;
//   O += P V_new: 4 x m64n128k16, A = P from registers, B = V_new [64 t', 128 v] MN-major (the
//     extra k-steps of the triangle add P = 0 products: exact zeros);
//   gated RMSNorm of each row: a quad holds a row's 128 columns; the two 64-column halves are
//     summed apart and added, as the 8-warp form adds its warp pair's sums.
// 64 KB of tiles (OutWgCfg), so that 3 CTAs fit on an SM without a state CTA (the TMA form's 96 KB
// fit 2): z is read from global memory into registers while V_new and h_c land, and h_c lands
// over K and the 16 KB after it, loaded once S is done (the ready wait comes after S and P
// anyway). H200, 4096 tokens (session 19, docs/perf/gdn_prefill.md): beside the state pass 207.9 /
// 208.1 us against 211.3 / 212.2 for the TMA form (two calls); alone 134.8 vs 137.1. Tried and
// not kept: the TMA form's 96 KB layout (z staged, h_c apart: 219 / 149 us), and y of whole
// chunks staged in Q's boxes and stored as TMA boxes (220.4 vs 215.7 us beside the state pass,
// the prompt a tie).
struct OutWgCfg {
  static constexpr uint32_t kBox = OutTmaCfg::kBox;
  static constexpr uint32_t kQ = 0, kK = 2 * kBox, kH = kK, kV = 6 * kBox, kGam = 8 * kBox;
  static constexpr uint32_t kBar = kGam + sizeof(float) * kC;
  static constexpr size_t kTotal = 1024 + kBar + 16;  // + alignment slack
  static_assert(kQ == OutTmaCfg::kQ && kK == OutTmaCfg::kK, "out_tma_fetch_qkz's offsets");
};
// (3 CTAs per SM: more than 170 registers would silently cost the third.)
__global__ void __launch_bounds__(128, 3) gdn_chunk_out_wg_kernel(DS_GDN_OUT_PARAMS) {
  using L = OutWgCfg;
  (void)qkv;
  (void)vn_mat;
  (void)h_snap;
  const int chunk = blockIdx.y, hv = blockIdx.x;  // head-major, as the overlapped forms
  const int4 ci = chunks[chunk];
  if (ci.x < 0) return;
  const int64_t row0 = ci.y;
  const int n = ci.z;
  const int n_v = s.n_v_heads, out_dim = s.out_dim();
  const bool norm = wts.norm_w != nullptr;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = align_1024(smem_raw);
  float* gam = reinterpret_cast<float*>(smem + L::kGam);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + L::kBar);  // [Q, K], [V_new, h_c]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  if (tid == 0) out_tma_fetch_qkz(s, om, smem, bar, hv, row0, /*z_off=*/-1);
  if (tid < kC) gam[tid] = gamma[(row0 + min(tid, n - 1)) * n_v + hv];  // held past the end
  __syncthreads();  // the mbarriers are initialised, gamma is in
  const uint32_t q_s = smem_u32(smem + L::kQ), k_s = smem_u32(smem + L::kK);
  const uint32_t h_s = smem_u32(smem + L::kH), v_s = smem_u32(smem + L::kV);
  mbar_wait(&bar[0], 0);

  // ---- S = Q K^T, then P in place (zero-initialised accumulators: the mma.sync chain's sums).
  float p[32];  // p[4 jt + 2 half + e]: row 16 warp + g + 8 half, column 8 jt + 2 c + e
#pragma unroll
  for (int i = 0; i < 32; ++i) p[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t off = (kk >> 2) * L::kBox + (kk & 3) * 32;
    wgmma_m64n64k16_ss(p, gmma_desc(q_s + off, 16, 1024), gmma_desc(k_s + off, 16, 1024));
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(p);
  __syncthreads();  // every warp's S has read K: h_c may land over it
  if (tid == 0) out_tma_fetch_vh(s, om, smem, bar, chunk, hv, row0, L::kV, L::kH, ready, n_slices);
  float grow[2];
  decay_mask_p(reinterpret_cast<float(&)[8][4]>(p), gam, 16 * warp, g, c, grow);
  uint32_t pa[4][4];
  gdn_tile::acc_to_a<8>(reinterpret_cast<const float(&)[8][4]>(p), pa);
  // This thread's z (columns 8 j + 2 c of its two rows) from global memory.
  uint32_t zr[2][16];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = 16 * warp + g + 8 * half;
    const bf16* zrow = proj + (row0 + min(i, n - 1)) * s.in_dim() + s.qkv_dim() + hv * kD + 2 * c;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      zr[half][j] = norm ? __ldg(reinterpret_cast<const unsigned int*>(zrow + 8 * j)) : 0u;
  }

  mbar_wait(&bar[1], 0);
  if (n < kC) {
    zero_v_tail<128>(smem, L::kV, n, tid);
    fence_proxy_async();
    __syncthreads();
  }

  // ---- O = e^gamma (Q h_c^T) + P V_new.
  __syncwarp();  // warp 0 reconverged (lane 0 issued the loads) before the aligned wgmma
  float o[64];  // o[4 j + 2 half + e]: row 16 warp + g + 8 half, column 8 j + 2 c + e
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)
    wgmma_m64n128k16_ss(o, gmma_desc(q_s + (kk >> 2) * L::kBox + (kk & 3) * 32, 16, 1024),
                        gmma_desc(h_s + (kk >> 2) * 2 * L::kBox + (kk & 3) * 32, 16, 1024));
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
  const float eg[2] = {__expf(grow[0]), __expf(grow[1])};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    o[4 * j] *= eg[0];
    o[4 * j + 1] *= eg[0];
    o[4 * j + 2] *= eg[1];
    o[4 * j + 3] *= eg[1];
  }
  fence_regs(o);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kC / 16; ++ks)
    wgmma_m64n128k16_rs_t(o, pa[ks], gmma_desc(v_s + ks * 16 * 128, L::kBox, 1024));
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);

  // ---- Gated RMSNorm per row, bf16 out.
  float ss[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float x[2];
#pragma unroll
    for (int vh = 0; vh < 2; ++vh) {
      float a = 0.f;
#pragma unroll
      for (int j = 8 * vh; j < 8 * vh + 8; ++j)
        a += o[4 * j + 2 * half] * o[4 * j + 2 * half] +
             o[4 * j + 2 * half + 1] * o[4 * j + 2 * half + 1];
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      x[vh] = a + __shfl_xor_sync(0xffffffffu, a, 2);
    }
    ss[half] = x[0] + x[1];
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = 16 * warp + g + 8 * half;
    const float scale = norm ? rsqrtf(ss[half] / kD + s.norm_eps) : 1.f;
    if (i < n) {
      bf16* y = out + (row0 + i) * out_dim + hv * kD + 2 * c;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        float y0 = o[4 * j + 2 * half], y1 = o[4 * j + 2 * half + 1];
        if (norm) {
          const int v = 8 * j + 2 * c;
          const __nv_bfloat162 z2 = *reinterpret_cast<const __nv_bfloat162*>(&zr[half][j]);
          const __nv_bfloat162 w2 = *reinterpret_cast<const __nv_bfloat162*>(wts.norm_w + v);
          y0 = __low2float(w2) * y0 * scale * silu(__low2float(z2));
          y1 = __high2float(w2) * y1 * scale * silu(__high2float(z2));
        }
        *reinterpret_cast<uint32_t*>(y + 8 * j) = pack_bf16(y0, y1);
      }
    }
  }
}
// ---- state pass with the output fused in (GdnStateForm::kFused; session 24, built without a
// device, not yet measured) ------------------------------------------------------------------
// slice_scan_wg runs the state pass (96 CTAs of one warpgroup) and, beside it, the output kernel,
// which reads back what the pass wrote for it: the bf16 snapshots h_c (100 MB per 4096 tokens)
// and V_new (50 MB), with Q, K, z and gamma again. Here each state CTA also computes its slice's
// output, so h_c and V_new never leave the SM:
//   warpgroup 0, the chain: gdn_state_wg_kernel's tight chunk step (thread 0 also issues the
//     loads), but instead of storing the snapshot and V_new to global memory it stages them in
//     shared memory for warpgroup 1: h_c^T [64 v, 128 k] as two swizzled [64 v, 64 k] boxes by
//     stmatrix (the snapshot's bits), V_new [64 t, 64 v] as one swizzled box by stmatrix.trans
//     (rows past a partial chunk's end as zeros, as the output kernel zeroes them), two buffers
//     guarded by mbarriers (hc_full / vn_full: the chain's 4 warps; stg_empty: the output's 4);
//   warpgroup 1, the output of this slice's 64 value columns, gdn_chunk_out_wg_kernel's
//     arithmetic with N = 64: P = causal(Q K^T) e^(gamma_t - gamma_t') (Q and K from the stage the
//     chain uses; Q is one more pair of boxes per stage), O = e^gamma (Q h_c^T) + P V_new (both
//     B operands from the staging buffers), then the gated RMSNorm. A row's sum of o^2 over its
//     128 values needs the other slice's 64: the two slice CTAs of a head form a cluster of 2 and
//     each sends its 64 per-row sums to the other by st.async, completing on the receiver's
//     mbarrier (two buffers, re-armed by the receiver after each use; no cluster barrier per
//     chunk). y is stored straight from the accumulators. Software-pipelined: the next chunk's
//     S and P (they need only the stage) are formed while this chunk's sums travel.
//   kOutWgs 2 ($DS_GDN_STATE=fused2): two output warpgroups, warpgroup 1 + k taking the chunks
//     ch % 2 == k (and staging buffer k), registers moved to the chain by setmaxnreg, 4 exchange
//     slots; for when one output warpgroup cannot keep pace with the chain.
// The stage ring (3 stages: K, W, Q, U, gamma) is released by both warpgroups (8 warp arrivals),
// so the output warpgroup may trail the chain by up to one chunk plus the staging buffers. No
// ready flags, no snapshot or V_new in global memory (the workspace regions stay unused).
// Bit-identity with slice_scan_wg: the state pass is the tight step's arithmetic (states bit-equal);
// y's products are the output kernel's with the value columns split 64 / 64 (wgmma m64n64 instead
// of m64n128: every output element is the same k16 steps in the same order), its P, its e^gamma
// scale, and per row the same two 64-column sums of o^2 added (x[0] + x[1] == x[1] + x[0]). Not
// yet run on a GPU: CudaGdn.PrefillFusedBitExact compares it bit for bit with slice_scan_cs.
// The mbarrier protocol (barrier counts, parities, the exchange slots' re-arming, the order of
// each role's waits and arrivals) is modelled in tools/gdn_fused_protocol.py and checked under
// random schedules by tests/python/test_gdn_fused_protocol.py: change both together.
// Shared memory 221 KB (1 CTA per SM, 96 CTAs for one 27B sequence); 197 registers (kOutWgs 1,
// 183 without the wait watchdog below), no spills.
template <int kOutWgs>
struct FusedCfg {
  static_assert(kOutWgs == 1 || kOutWgs == 2, "one or two output warpgroups");
  // warpgroup 0: the chain (+ loads); 1 .. kOutWgs: the output, warpgroup 1 + k taking the chunks
  // ch with ch % kOutWgs == k
  static constexpr int kThreads = 128 * (1 + kOutWgs);
  static constexpr int kStages = 3;
  static constexpr int kNb = 2;  // staging buffers (h_c, V_new)
  static constexpr int kVs = 64;
  static constexpr uint32_t kBox = kC * 128;  // one swizzled [64 rows, 64 bf16] box
  // One stage: K, W and Q as two boxes each, this slice's U columns, gamma [64 t][4 heads] fp32.
  static constexpr uint32_t kK = 0, kW = 2 * kBox, kQ = 4 * kBox, kU = 6 * kBox, kGam = 7 * kBox;
  static constexpr uint32_t kBuf = kGam + kC * 4 * 4;
  static constexpr uint32_t kLoadBytes = kBuf;  // transaction bytes of one chunk's loads
  static constexpr uint32_t kStg = kStages * kBuf;
  // One staging buffer: h_c^T as two [64 v, 64 k] boxes, then V_new [64 t, 64 v].
  static constexpr uint32_t kHc = 0, kVn = 2 * kBox, kStgBuf = 3 * kBox;
  // The peer's per-row sums: 2 slots per output warpgroup (chunk ch uses slot ch % kXSlots).
  static constexpr int kXSlots = 2 * kOutWgs;
  static constexpr uint32_t kX = kStg + kNb * kStgBuf;  // [kXSlots][64] fp32
  static constexpr uint32_t kBar = kX + kXSlots * kC * 4;
  // full[kStages], empty[kStages], hc_full[kNb], vn_full[kNb], stg_empty[kNb], xchg[kXSlots]
  static constexpr int kBars = 2 * kStages + 3 * kNb + kXSlots;
  // kOutWgs 2: registers moved from the output warpgroups to the chain (setmaxnreg; the block
  // starts with 65536 / 384 = 168 per thread, rounded down to a multiple of 8)
  static constexpr int kChainRegs = 200, kOutRegs = 152;
  static_assert(kOutWgs == 1 || kChainRegs + 2 * kOutRegs <= 3 * 168, "the block's registers");
  static_assert(kNb % kOutWgs == 0, "each output warpgroup keeps to its own staging buffers");
  static constexpr size_t kTotal = 1024 + kBar + kBars * 8;  // + alignment slack
  static_assert(kBuf % 1024 == 0 && kStg % 1024 == 0 && kStgBuf % 1024 == 0,
                "swizzled boxes are 1024-byte aligned");
  static_assert(kTotal <= 227 * 1024, "shared memory of one block");
};

// The fused kernel's mbarrier waits cannot hang silently (it ran on no GPU when written): after
// 2^26 failed tries (each try_wait may suspend the thread a while: seconds to about a minute in
// all, far beyond any legitimate wait, a whole 4096-token layer taking well under a millisecond)
// a wait traps, so the launch fails with an error at the next synchronisation instead of hanging
// the stream. The fast path is one try_wait. (A try counter, not %globaltimer: two 64-bit values
// live across the chain's waits cost 14 registers; no printf of where: a function call in the
// kernel makes ptxas serialise every wgmma, C7510.)
template <bool kWatch = true>
__device__ __forceinline__ void fused_wait(uint64_t* bar, uint32_t parity) {
  if constexpr (!kWatch) {
    mbar_wait(bar, parity);
  } else {
    for (uint32_t tries = 0; !mbar_try_wait(bar, parity);)
      if (++tries == (1u << 26)) asm volatile("trap;");
  }
}

// kWgChain (fused2w): the chain step of the shipped gdn_state_wg_kernel (kTight false: the
// stage's wait and the decay factors at the top of each chunk, U - S rounded one value at a time,
// the row test on every chunk, the tile pointers generic) instead of the tight step, which
// session 24 measured slower alone (151 vs 118 us at 4096 tokens). The same operations on the
// same values: the same bits.
template <int kOutWgs, bool kWgChain = false>
__global__ void __cluster_dims__(1, 1, 2) __launch_bounds__(FusedCfg<kOutWgs>::kThreads, 1)
    gdn_state_out_fused_kernel(GdnShape s, GdnLayerWeights wts, GdnStatePool pool,
                               const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                               const int32_t* __restrict__ seq_pos,     // [n_seqs]
                               const int32_t* __restrict__ slot_ids,    // [n_seqs]
                               const bf16* __restrict__ proj,  // [n_tokens, in_dim] (z)
                               bf16* __restrict__ out,         // [n_tokens, n_v * 128]
                               const __grid_constant__ GdnWgMaps maps) {
  using L = FusedCfg<kOutWgs>;
  constexpr int STAGES = L::kStages, NB = L::kNb, XS = L::kXSlots;
  // The chain's waits are watched in the one-output-warpgroup form only: in the setmaxnreg form
  // the trap path made ptxas spill (36 bytes).
  constexpr bool kWatchChain = kOutWgs == 1;
  const int seq = blockIdx.x, hv = blockIdx.y;
  const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
  if (len <= 0) return;  // both blocks of the cluster (same sequence); the slot is left untouched
  const uint32_t rank = cluster_rank();  // == blockIdx.z: the 64-column slice
  const int v_cta = static_cast<int>(rank) * L::kVs;
  const int n_v = s.n_v_heads, hk = hv / (n_v / s.n_k_heads), hq = hv & 3;
  const bool norm = wts.norm_w != nullptr;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = kWgChain ? align_1024(smem_raw) : align_1024_shared(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int n_chunks = (len + kC - 1) / kC;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBar);
  uint64_t* empty = full + STAGES;
  uint64_t* hc_full = empty + STAGES;
  uint64_t* vn_full = hc_full + NB;
  uint64_t* stg_empty = vn_full + NB;
  uint64_t* xchg = stg_empty + NB;
  float* xs = reinterpret_cast<float*>(smem + L::kX);  // [XS][64]: the peer's per-row sums
  auto stage = [&](int b) { return smem + b * L::kBuf; };
  auto staging = [&](int nb) { return smem + L::kStg + nb * L::kStgBuf; };

  if (tid == 0) {
    for (int b = 0; b < STAGES; ++b) {
      mbar_init(&full[b], 1);
      mbar_init(&empty[b], 8);  // 4 chain warps + the 4 warps of the chunk's output warpgroup
    }
    for (int nb = 0; nb < NB; ++nb) {
      mbar_init(&hc_full[nb], 4);
      mbar_init(&vn_full[nb], 4);
      mbar_init(&stg_empty[nb], 4);
    }
    init_xchg_slots(xchg, XS, norm);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // Both blocks' barriers are initialised (and xchg armed) before either sends a row sum.
  cluster_sync_all();

  if (warp < 4) {
    // ================= warpgroup 0: the state chain (gdn_state_wg_kernel's tight step) ==========
    if constexpr (kOutWgs == 2)
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(L::kChainRegs) : "memory");
    const int v_loc = 16 * warp, v_base = v_cta + v_loc;
    // Chunk ch's tiles into stage ch % STAGES once all 8 warps have released it (thread 0).
    auto fetch = [&](int ch) {
      const int b = ch % STAGES, row0 = start + ch * kC;
      if (ch >= STAGES) fused_wait<kWatchChain>(&empty[b], uint32_t(ch / STAGES - 1) & 1u);
      unsigned char* st = stage(b);
      mbar_arrive_expect_tx(&full[b], L::kLoadBytes);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        tma_load_2d(st + L::kK + half * L::kBox, &maps.k, (s.n_k_heads + hk) * kD + 64 * half,
                    row0, &full[b]);
        tma_load_2d(st + L::kQ + half * L::kBox, &maps.k, hk * kD + 64 * half, row0, &full[b]);
        tma_load_3d(st + L::kW + half * L::kBox, &maps.w, 64 * half, hv, row0, &full[b]);
      }
      tma_load_3d(st + L::kU, &maps.u, v_cta, hv, row0, &full[b]);
      tma_load_2d(st + L::kGam, &maps.gam, hv & ~3, row0, &full[b]);
    };
    if (tid == 0)
      for (int ch = 0; ch < min(STAGES - 1, n_chunks); ++ch) fetch(ch);

    float* state = pool.rec_state + static_cast<int64_t>(slot_ids[seq]) * pool.rec_slot_stride +
                   static_cast<int64_t>(hv) * kD * kD;
    const bool has_state = seq_pos[seq] > 0;
    float h[64];  // h[4 j + i] = h^T(v_base + g + 8 (i / 2), 8 j + 2 c + (i % 2))
    gdn_tile::load_state_rows(reinterpret_cast<float(&)[16][4]>(h), state, has_state, v_base, g,
                              c);
    float g_last_t = 0.f, gc_t[8][2];  // chunk cx's decay factors, formed one chunk ahead
    auto prologue = [&](int cx) {
      const int nx = min(kC, len - cx * kC);
      fused_wait<kWatchChain>(&full[cx % STAGES], uint32_t(cx / STAGES) & 1u);
      const float* gx = reinterpret_cast<const float*>(stage(cx % STAGES) + L::kGam);
      g_last_t = gx[(nx - 1) * 4 + hq];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e)
          gc_t[j][e] = __expf(g_last_t - gx[min(8 * j + 2 * c + e, nx - 1) * 4 + hq]);
      }
    };
    if constexpr (!kWgChain) prologue(0);
    __syncwarp();  // thread 0 back from its loads, every lane from the wait

    for (int ch = 0; ch < n_chunks; ++ch) {
      const int b = ch % STAGES, nb = ch % NB;
      const int n = min(kC, len - ch * kC);
      unsigned char* st = stage(b);
      unsigned char* sg = staging(nb);
      if constexpr (kWgChain) {
        fused_wait<kWatchChain>(&full[b], uint32_t(ch / STAGES) & 1u);
        __syncwarp();
      }
      if (n < kC) zero_k_tail(st + L::kK, L::kBox, n, tid);  // the update reads K past n
      const uint32_t k_s = smem_u32(st + L::kK), w_s = smem_u32(st + L::kW);
      const bf16* u_s = reinterpret_cast<const bf16*>(st + L::kU);
      const float g_last =
          kWgChain ? reinterpret_cast<const float*>(st + L::kGam)[(n - 1) * 4 + hq] : g_last_t;

      // ---- h^T as bf16 A fragments (also h_c); S = h^T W^T.
      uint32_t ha[8][4];
      gdn_tile::acc_to_a<16>(reinterpret_cast<const float(&)[16][4]>(h), ha);
      float sacc[32];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk)
        wgmma_m64n64k16_rs(sacc, ha[kk],
                           gmma_desc(w_s + (kk >> 2) * L::kBox + (kk & 3) * 32, 16, 1024),
                           kk == 0 ? 0 : 1);
      wgmma_commit();
      if (tid == 0 && ch + STAGES - 1 < n_chunks) fetch(ch + STAGES - 1);
      // While S runs: h_c into staging buffer nb once the output has released it (chunk ch - NB),
      // packed again from h (ha is S's A operand: no access before wgmma.wait_group).
      if (ch >= NB) fused_wait<kWatchChain>(&stg_empty[nb], uint32_t(ch / NB - 1) & 1u);
      __syncwarp();  // lane 0 back from the loads: stmatrix is warp-aligned
      {
        fence_regs(h);
        uint32_t hs[8][4];
#pragma unroll
        for (int sk = 0; sk < 8; ++sk) {
          hs[sk][0] = pack_bf16(h[8 * sk], h[8 * sk + 1]);
          hs[sk][1] = pack_bf16(h[8 * sk + 2], h[8 * sk + 3]);
          hs[sk][2] = pack_bf16(h[8 * sk + 4], h[8 * sk + 5]);
          hs[sk][3] = pack_bf16(h[8 * sk + 6], h[8 * sk + 7]);
        }
#pragma unroll
        for (int sk = 0; sk < 8; ++sk) {
          const int row = (lane & 7) + 8 * ((lane >> 3) & 1), q = 2 * sk + (lane >> 4);
          stsm_x4(reinterpret_cast<bf16*>(sg + L::kHc + (q >> 3) * L::kBox + (v_loc + row) * 128 +
                                          (((q & 7) ^ (row & 7)) << 4)),
                  hs[sk]);
        }
        fence_proxy_async();  // generic stores, read by the output's wgmma (async proxy)
        __syncwarp();
        if (lane == 0) mbar_arrive(&hc_full[nb]);
      }
      float gc[8][2];
      if constexpr (kWgChain) {
        const float* gam = reinterpret_cast<const float*>(st + L::kGam);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e)
            gc[j][e] = __expf(g_last - gam[min(8 * j + 2 * c + e, n - 1) * 4 + hq]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          gc[j][0] = gc_t[j][0];
          gc[j][1] = gc_t[j][1];
        }
      }
      const float decay = __expf(g_last);
      __syncwarp();
      wgmma_wait<0>();
      fence_regs(sacc);

      // ---- V_new^T = U^T - S (bf16) into the staging box, Vs = V_new^T e^(gamma_last - gamma_t),
      // rows past the sequence zero in both.
      uint32_t vsa[4][4];
      unsigned char* vn = sg + L::kVn;
      auto v_new = [&](auto is_full) {
        constexpr bool kFull = decltype(is_full)::value;
        float vs[8][4];
        const int m = lane >> 3, r = lane & 7;
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
          // Matrix m: rows t = 16 jp + 8 (m / 2) + r, columns v_loc + 8 (m % 2) (chunk q of the
          // swizzled row, in U's box and in the staging box alike).
          const int t = 16 * jp + 8 * (m >> 1) + r, q = 2 * warp + (m & 1);
          const uint32_t off = t * 128 + ((q ^ (t & 7)) << 4);
          uint32_t ur[4];
          ldsm_x4_t(ur, reinterpret_cast<const bf16*>(reinterpret_cast<const unsigned char*>(u_s) +
                                                      off));
#pragma unroll
          for (int qq = 0; qq < 4; ++qq) {
            const int j = 2 * jp + (qq >> 1), i0 = 2 * (qq & 1);
            const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(&ur[qq]);
            const int t0 = 8 * j + 2 * c;
            if constexpr (kWgChain) {  // the shipped step's scalar rounding
              const bf16 y0 = __float2bfloat16(__low2float(u2) - sacc[4 * j + i0]);
              const bf16 y1 = __float2bfloat16(__high2float(u2) - sacc[4 * j + i0 + 1]);
              vs[j][i0] = t0 < n ? __bfloat162float(y0) * gc[j][0] : 0.f;
              vs[j][i0 + 1] = t0 + 1 < n ? __bfloat162float(y1) * gc[j][1] : 0.f;
              __nv_bfloat162 y2;
              y2.x = t0 < n ? y0 : __float2bfloat16(0.f);
              y2.y = t0 + 1 < n ? y1 : __float2bfloat16(0.f);
              ur[qq] = *reinterpret_cast<const uint32_t*>(&y2);
            } else {
              const uint32_t x2 = pack_bf16(__low2float(u2) - sacc[4 * j + i0],
                                            __high2float(u2) - sacc[4 * j + i0 + 1]);
              const float x0 = __uint_as_float(x2 << 16), x1 = __uint_as_float(x2 & 0xffff0000u);
              vs[j][i0] = kFull || t0 < n ? x0 * gc[j][0] : 0.f;
              vs[j][i0 + 1] = kFull || t0 + 1 < n ? x1 * gc[j][1] : 0.f;
              ur[qq] = kFull ? x2
                             : (t0 < n ? x2 & 0xffffu : 0u) | (t0 + 1 < n ? x2 & 0xffff0000u : 0u);
            }
          }
          stsm_x4_t(reinterpret_cast<bf16*>(vn + off), ur);
        }
        gdn_tile::acc_to_a<8>(vs, vsa);
      };
      if (!kWgChain && n == kC)
        v_new(std::true_type{});
      else
        v_new(std::false_type{});
      fence_proxy_async();
      __syncwarp();
      if (lane == 0) mbar_arrive(&vn_full[nb]);
      __syncwarp();

      // ---- h^T <- e^(gamma_last) h^T + Vs^T K.
#pragma unroll
      for (int i = 0; i < 64; ++i) h[i] *= decay;
      fence_regs(h);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kC / 16; ++kk)
        wgmma_m64n128k16_rs_t(h, vsa[kk], gmma_desc(k_s + kk * 16 * 128, L::kBox, 1024));
      wgmma_commit();
      // While the update runs: the next chunk's wait and decay factors (the tight step).
      if (!kWgChain && ch + 1 < n_chunks) prologue(ch + 1);
      __syncwarp();
      wgmma_wait<0>();
      fence_regs(h);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[b]);  // this warp is done with stage b
      __syncwarp();
    }
    gdn_tile::store_state_rows(reinterpret_cast<const float(&)[16][4]>(h), state, v_base, g, c);
  } else {
    // ================= warpgroup 1: the output of this slice's 64 value columns ===============
    // gdn_chunk_out_wg_kernel's arithmetic; this thread's rows i = 16 w + g + 8 half, columns
    // v_cta + 8 j + 2 c + e.
    if constexpr (kOutWgs == 2)
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(L::kOutRegs) : "memory");
    const int wg = (warp >> 2) - 1;  // this output warpgroup: chunks ch % kOutWgs == wg
    const int w = warp & 3;
    const int qkv_dim = s.qkv_dim(), in_dim = s.in_dim(), out_dim = s.out_dim();
    const uint32_t peer = rank ^ 1u;
    // S = Q K^T of chunk cx, then P in place, as bf16 A fragments pa (K rows past a partial
    // chunk's end may be zeroed by the chain meanwhile: P is 0 there for every row this block
    // stores); grow: gamma of this thread's two rows.
    auto qk_p = [&](int cx, uint32_t (&pa)[4][4], float (&grow)[2]) {
      const int nx = min(kC, len - cx * kC);
      unsigned char* sx = stage(cx % STAGES);
      fused_wait(&full[cx % STAGES], uint32_t(cx / STAGES) & 1u);
      __syncwarp();  // converged before the warp-aligned wgmma
      const uint32_t q_s = smem_u32(sx + L::kQ), k_s = smem_u32(sx + L::kK);
      const float* gx = reinterpret_cast<const float*>(sx + L::kGam);  // [64 t][4 heads]
      float p[32];  // p[4 jt + 2 half + e]: row 16 w + g + 8 half, column 8 jt + 2 c + e
#pragma unroll
      for (int i = 0; i < 32; ++i) p[i] = 0.f;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const uint32_t off = (kk >> 2) * L::kBox + (kk & 3) * 32;
        wgmma_m64n64k16_ss(p, gmma_desc(q_s + off, 16, 1024), gmma_desc(k_s + off, 16, 1024));
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(p);
      // decay_mask_p on gamma's tile, rows held at the sequence's last (as the output kernel's
      // gam[] is): the same values, so the same bits.
#pragma unroll
      for (int half = 0; half < 2; ++half)
        grow[half] = gx[min(16 * w + g + 8 * half, nx - 1) * 4 + hq];
#pragma unroll
      for (int jt = 0; jt < 8; ++jt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = 16 * w + g + 8 * half;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = 8 * jt + 2 * c + e;
            float& x = p[4 * jt + 2 * half + e];
            x = j <= i ? x * __expf(grow[half] - gx[min(j, nx - 1) * 4 + hq]) : 0.f;
          }
        }
      }
      gdn_tile::acc_to_a<8>(reinterpret_cast<const float(&)[8][4]>(p), pa);
    };
    // Software-pipelined: the next chunk's S and P are formed while this chunk's row sums travel
    // to the peer (they need only the stage, which the chain's loads filled long before).
    uint32_t pa[4][4];
    float grow[2];
    if (wg < n_chunks) qk_p(wg, pa, grow);
    for (int ch = wg; ch < n_chunks; ch += kOutWgs) {
      const int b = ch % STAGES, nb = ch % NB, xb = ch % XS;
      const int64_t row0 = start + int64_t(ch) * kC;
      const int n = min(kC, len - ch * kC);
      unsigned char* st = stage(b);
      unsigned char* sg = staging(nb);
      // This thread's z (columns 8 j + 2 c of its two rows of this slice) from global memory.
      uint32_t zr[2][8];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = 16 * w + g + 8 * half;
        const bf16* zrow =
            proj + (row0 + min(i, n - 1)) * in_dim + qkv_dim + hv * kD + v_cta + 2 * c;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          zr[half][j] = norm ? __ldg(reinterpret_cast<const unsigned int*>(zrow + 8 * j)) : 0u;
      }
      const uint32_t q_s = smem_u32(st + L::kQ);

      // ---- O = e^gamma (Q h_c^T) + P V_new, this slice's 64 columns.
      fused_wait(&hc_full[nb], uint32_t(ch / NB) & 1u);
      __syncwarp();
      const uint32_t hc_s = smem_u32(sg + L::kHc), vn_s = smem_u32(sg + L::kVn);
      float o[32];  // o[4 j + 2 half + e]: row 16 w + g + 8 half, column 8 j + 2 c + e
#pragma unroll
      for (int i = 0; i < 32; ++i) o[i] = 0.f;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const uint32_t off = (kk >> 2) * L::kBox + (kk & 3) * 32;
        wgmma_m64n64k16_ss(o, gmma_desc(q_s + off, 16, 1024), gmma_desc(hc_s + off, 16, 1024));
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[b]);  // Q, K and gamma of this stage are read
      __syncwarp();
      const float eg[2] = {__expf(grow[0]), __expf(grow[1])};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        o[4 * j] *= eg[0];
        o[4 * j + 1] *= eg[0];
        o[4 * j + 2] *= eg[1];
        o[4 * j + 3] *= eg[1];
      }
      fence_regs(o);
      fused_wait(&vn_full[nb], uint32_t(ch / NB) & 1u);
      __syncwarp();
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks)
        wgmma_m64n64k16_rs_t(o, pa[ks], gmma_desc(vn_s + ks * 16 * 128, L::kBox, 1024));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      __syncwarp();
      if (lane == 0) mbar_arrive(&stg_empty[nb]);  // h_c and V_new of buffer nb are read
      __syncwarp();  // converged for the shuffles

      // ---- Gated RMSNorm per row: this slice's sum of o^2 as the output kernel forms its half
      // (vh = rank), the peer's from its st.async, x[0] + x[1].
      float ss[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          a += o[4 * j + 2 * half] * o[4 * j + 2 * half] +
               o[4 * j + 2 * half + 1] * o[4 * j + 2 * half + 1];
        a += __shfl_xor_sync(0xffffffffu, a, 1);
        ss[half] = a + __shfl_xor_sync(0xffffffffu, a, 2);
      }
      if (norm) {
        // One lane per quad sends its rows' sums (equal in the quad's four lanes).
        if (c == 0) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int i = 16 * w + g + 8 * half;
            st_async_f32(cluster_map(smem_u32(xs + xb * kC + i), peer), ss[half],
                         cluster_map(smem_u32(&xchg[xb]), peer));
          }
        }
      }
      uint32_t pa_next[4][4];
      float grow_next[2];
      if (ch + kOutWgs < n_chunks) qk_p(ch + kOutWgs, pa_next, grow_next);
      if (norm) {
        fused_wait(&xchg[xb], uint32_t(ch / XS) & 1u);
        // Re-armed for chunk ch + XS (this slot's next use) by one thread of this warpgroup once
        // its own wait is over: the peer's sums for ch + XS follow the peer's wait for its
        // chunk ch + kOutWgs (the same warpgroup's next chunk), which needs every sum this
        // warpgroup sends for ch + kOutWgs, after this point.
        if ((tid & 127) == 0) mbar_arrive_expect_tx(&xchg[xb], kC * 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) ss[half] += xs[xb * kC + 16 * w + g + 8 * half];
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = 16 * w + g + 8 * half;
        const float scale = norm ? rsqrtf(ss[half] / kD + s.norm_eps) : 1.f;
        if (i < n) {
          bf16* y = out + (row0 + i) * out_dim + hv * kD + v_cta + 2 * c;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float y0 = o[4 * j + 2 * half], y1 = o[4 * j + 2 * half + 1];
            if (norm) {
              const int v = v_cta + 8 * j + 2 * c;
              const __nv_bfloat162 z2 = *reinterpret_cast<const __nv_bfloat162*>(&zr[half][j]);
              const __nv_bfloat162 w2 = *reinterpret_cast<const __nv_bfloat162*>(wts.norm_w + v);
              y0 = __low2float(w2) * y0 * scale * silu(__low2float(z2));
              y1 = __high2float(w2) * y1 * scale * silu(__high2float(z2));
            }
            *reinterpret_cast<uint32_t*>(y + 8 * j) = pack_bf16(y0, y1);
          }
        }
      }
      if (ch + kOutWgs < n_chunks) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
#pragma unroll
          for (int r = 0; r < 4; ++r) pa[ks][r] = pa_next[ks][r];
        grow[0] = grow_next[0];
        grow[1] = grow_next[1];
      }
    }
  }
}

#undef DS_GDN_OUT_PARAMS
#undef DS_GDN_OUT_ARGS


// The maps of the TMA-fed output kernels over this launch's tensors (n_tokens rows). Q / K and
// V_new are the state pass's K and U maps (the same tensors and boxes); z (with_z: the mma.sync
// TMA form stages it, the wgmma form reads it directly) and h_c are their own.
GdnOutMaps make_gdn_out_maps(const GdnShape& s, int n_tokens, int max_chunks, const bf16* proj,
                             const bf16* h_snap, const GdnWgMaps& wg, bool with_z) {
  constexpr CUtensorMapSwizzle kSw = CU_TENSOR_MAP_SWIZZLE_128B;
  GdnOutMaps m;
  m.qk = wg.k;
  if (with_z) m.z = matrix_map(proj, n_tokens, s.in_dim(), kC, 64, kSw, "gdn output: z");
  m.v = wg.u;
  m.h = matrix_map(h_snap, uint64_t(max_chunks) * s.n_v_heads * kD, kD, kD, 64, kSw,
                   "gdn output: snapshots");
  return m;
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

template <typename K>
void launch_state(K kernel, size_t smem, int threads, int n_slices, const GdnShape& s,
                  const GdnStatePool& pool, const int32_t* cu_seqlens, const int32_t* seq_pos,
                  const int32_t* slot_ids, const int* seq_chunk0, int n_seqs, const bf16* qkv,
                  const float* gamma, const bf16* w_mat, bf16* u_mat, bf16* h_snap, int* ready,
                  cudaStream_t stream) {
  DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
  kernel<<<dim3(n_seqs, s.n_v_heads, n_slices), threads, smem, stream>>>(
      s, pool, cu_seqlens, seq_pos, slot_ids, seq_chunk0, qkv, gamma, w_mat, u_mat, h_snap, ready);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace

namespace {
std::atomic<int> g_out_form{-1};    // -1: not read yet
std::atomic<int> g_state_form{-1};  // -1: not read yet
}  // namespace

GdnStateForm parse_gdn_state_form(const char* value) {
  const std::string v = value ? value : "";
  DS_CHECK(v.empty() || v == "wg" || v == "tight" || v == "fused" || v == "fused2" ||
               v == "fused2w",
           "$DS_GDN_STATE must be wg, tight, fused, fused2 or fused2w (got '", v, "')");
  return v == "tight"     ? GdnStateForm::kTight
         : v == "fused"   ? GdnStateForm::kFused
         : v == "fused2"  ? GdnStateForm::kFused2
         : v == "fused2w" ? GdnStateForm::kFused2Wg
                          : GdnStateForm::kWg;
}

GdnStateForm gdn_state_form() {
  return cached_form(g_state_form, "DS_GDN_STATE", parse_gdn_state_form);
}

void set_gdn_state_form(GdnStateForm form) { g_state_form.store(static_cast<int>(form)); }

GdnOutForm parse_gdn_out_form(const char* value) {
  const std::string v = value ? value : "";
  DS_CHECK(v.empty() || v == "wg" || v == "tma" || v == "cp",
           "$DS_GDN_OUT must be wg, tma or cp (got '", v, "')");
  return v == "tma" ? GdnOutForm::kTma : v == "cp" ? GdnOutForm::kCpAsync : GdnOutForm::kWgmma;
}

GdnOutForm gdn_out_form() { return cached_form(g_out_form, "DS_GDN_OUT", parse_gdn_out_form); }

void set_gdn_out_form(GdnOutForm form) { g_out_form.store(static_cast<int>(form)); }

bool gdn_slice_supported(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                         const bf16* proj, const bf16* out) {
  return s.d_k == kD && s.d_v == kD && s.in_dim() % 8 == 0 && s.qkv_dim() % 8 == 0 &&
         aligned(proj, 16) && aligned(out, 4) && (w.norm_w == nullptr || aligned(w.norm_w, 4)) &&
         aligned(pool.rec_state, 8) && pool.rec_slot_stride % 2 == 0;
}

bool gdn_slice_wg_supported(const GdnShape& s, int n_tokens, int max_chunks, const float* gamma) {
  return s.d_k == kD && s.d_v == kD && s.n_v_heads % 4 == 0 && n_tokens > 0 && aligned(gamma, 16) &&
         int64_t(max_chunks) * s.n_v_heads * kD < (int64_t(1) << 31);
}

void launch_gdn_slice_scan(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                           const bf16* proj, const int32_t* cu_seqlens, const int32_t* seq_pos,
                           const int32_t* slot_ids, int n_seqs, const int4* chunks,
                           const int* seq_chunk0, int max_chunks, const bf16* qkv,
                           const float* gamma, const bf16* w_mat, bf16* u_mat, bf16* h_snap,
                           bf16* out, GdnSliceState state, int out_warps, cudaStream_t stream,
                           int stages, int* ready, int n_tokens) {
  DS_CHECK(out_warps == 4 || out_warps == 8, "gdn slice scan: out_warps must be 4 or 8, got ",
           out_warps);
  DS_CHECK(ready == nullptr || (stages >= 2 && max_chunks <= 65535 && out_warps == 8),
           "gdn slice scan: the overlapped launch (ready flags) runs both stages (or the output "
           "alone, after flags completed by an earlier launch) with 8-warp output CTAs, at most "
           "65535 chunks (got stages ",
           stages, ", out_warps ", out_warps, ", ", max_chunks, " chunks)");
  DS_CHECK(gdn_slice_supported(s, w, pool, proj, out),
           "gdn slice scan: shape / alignment not supported (d_k = d_v = 128 only)");
  DS_CHECK(aligned(qkv, 16) && aligned(w_mat, 16) && aligned(u_mat, 16) && aligned(h_snap, 16),
           "gdn slice scan: workspace tiles must be 16-byte aligned");
  if (n_seqs <= 0 || max_chunks <= 0) return;
  const bool overlap = ready != nullptr;
  const int n_slices = kD / 64;
  GdnWgMaps wg_maps{};  // kWgmma: the state pass's maps (the TMA output reuses two of them)
  if (state == GdnSliceState::kWgmma && ((stages & 1) || overlap)) {  // its maps are used
    DS_CHECK(gdn_slice_wg_supported(s, n_tokens, max_chunks, gamma),
             "gdn slice scan: the wgmma state pass needs n_v_heads % 4 == 0, a 16-byte "
             "aligned gamma and fewer than 2^31 snapshot rows (got n_v ", s.n_v_heads,
             ", n_tokens ", n_tokens, ", ", max_chunks, " chunks)");
    wg_maps = make_gdn_wg_maps(s, n_tokens, max_chunks, qkv, gamma, w_mat, u_mat, h_snap);
  }
  // kFused: the state pass and the output as one kernel (both stages of an overlapped launch;
  // the ready flags, snapshots and V_new are not written). A stage alone runs the tight pass.
  const GdnStateForm state_form = gdn_state_form();
  const bool fused = state_form == GdnStateForm::kFused || state_form == GdnStateForm::kFused2 ||
                     state_form == GdnStateForm::kFused2Wg;
  if (state == GdnSliceState::kWgmma && overlap && stages == 3 && fused) {
    auto go = [&](auto kernel, auto cfg) {
      using L = decltype(cfg);
      ensure_smem_optin(reinterpret_cast<const void*>(kernel), L::kTotal);
      kernel<<<dim3(n_seqs, s.n_v_heads, n_slices), L::kThreads, L::kTotal, stream>>>(
          s, w, pool, cu_seqlens, seq_pos, slot_ids, proj, out, wg_maps);
      DS_CUDA_LAUNCH_CHECK();
    };
    if (state_form == GdnStateForm::kFused2 || state_form == GdnStateForm::kFused2Wg) {
      // setmaxnreg moves registers within the block's allocation: the chain's increase must be
      // covered by what the output warpgroups give back, or it waits forever.
      using L2 = FusedCfg<2>;
      static const int regs = [] {
        cudaFuncAttributes a{};
        DS_CUDA_CHECK(cudaFuncGetAttributes(&a, gdn_state_out_fused_kernel<2>));
        return a.numRegs;
      }();
      DS_CHECK((L2::kChainRegs - regs) * 128 <= (regs - L2::kOutRegs) * 256,
               "gdn fused state + output (fused2): the kernel was built with ", regs,
               " registers per thread, too few to move ", L2::kChainRegs, " to the chain");
      if (state_form == GdnStateForm::kFused2Wg)
        go(gdn_state_out_fused_kernel<2, true>, L2{});
      else
        go(gdn_state_out_fused_kernel<2>, L2{});
    } else {
      go(gdn_state_out_fused_kernel<1>, FusedCfg<1>{});
    }
    return;
  }
  if (stages & 1) {
    auto run = [&](auto kernel, size_t smem, int threads) {
      launch_state(kernel, smem, threads, n_slices, s, pool, cu_seqlens, seq_pos, slot_ids,
                   seq_chunk0, n_seqs, qkv, gamma, w_mat, u_mat, h_snap, ready, stream);
    };
    using L64 = SliceCfg<4, 2>;
    // kLean: after the stages, each warp's bf16 snapshot rows [16][kLd], staged for 16-byte stores.
    const size_t lean_smem = L64::kTotal + sizeof(bf16) * 4 * 16 * kLd;
    switch (state) {
      case GdnSliceState::kV64:
        if (overlap)
          run(gdn_state_slice_kernel<4, 2, true, false>, L64::kTotal, L64::kThreads);
        else
          run(gdn_state_slice_kernel<4, 2, false, false>, L64::kTotal, L64::kThreads);
        break;
      case GdnSliceState::kV64Lean:
        if (overlap)
          run(gdn_state_slice_kernel<4, 2, true, true>, lean_smem, L64::kThreads);
        else
          run(gdn_state_slice_kernel<4, 2, false, true>, lean_smem, L64::kThreads);
        break;
      case GdnSliceState::kWgmma: {
        auto go = [&](auto kernel) {
          ensure_smem_optin(reinterpret_cast<const void*>(kernel), WgCfg::kTotal);
          kernel<<<dim3(n_seqs, s.n_v_heads, n_slices), WgCfg::kThreads, WgCfg::kTotal, stream>>>(
              s, pool, cu_seqlens, seq_pos, slot_ids, seq_chunk0, u_mat, ready, wg_maps);
          DS_CUDA_LAUNCH_CHECK();
        };
        if (state_form != GdnStateForm::kWg) {  // kTight, or the fused forms' pass alone
          if (overlap)
            go(gdn_state_wg_kernel<true, true>);
          else
            go(gdn_state_wg_kernel<false, true>);
        } else if (overlap) {
          go(gdn_state_wg_kernel<true, false>);
        } else {
          go(gdn_state_wg_kernel<false, false>);
        }
        break;
      }
    }
  }
  if ((stages & 2) == 0) return;
  GdnOutMaps out_maps{};  // kTma only
  auto out_kernel = [&](auto kernel, size_t smem, int threads) {
    DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    // Overlapped: head-major grid (CTAs start in the order the state pass finishes chunks),
    // launched as a programmatic dependent of the state pass, so that it may start as soon as
    // every state CTA is resident; the ready flags order each CTA after its chunk.
    const dim3 grid = overlap ? dim3(s.n_v_heads, max_chunks) : dim3(max_chunks, s.n_v_heads);
    // The output alone (stages 2, timing) is no programmatic dependent: these kernels never run
    // griddepcontrol.wait, so only the state pass may be their primary.
    launch_maybe_pdl(kernel, grid, dim3(threads), smem, stream, overlap && (stages & 1), s, w,
                     chunks, proj, qkv, gamma, static_cast<const bf16*>(u_mat),
                     static_cast<const bf16*>(h_snap), out, static_cast<const int*>(ready),
                     // ready counts: one per state CTA, or per consumer warp of the wgmma pass
                     state == GdnSliceState::kWgmma ? 4 * n_slices : n_slices, out_maps);
    DS_CUDA_LAUNCH_CHECK();
  };
  const GdnOutForm form = gdn_out_form();
  if (out_warps == 8) {
    if (overlap && state == GdnSliceState::kWgmma && form != GdnOutForm::kCpAsync) {
      out_maps = make_gdn_out_maps(s, n_tokens, max_chunks, proj, h_snap, wg_maps,
                                   /*with_z=*/form == GdnOutForm::kTma);
      if (form == GdnOutForm::kWgmma)
        out_kernel(gdn_chunk_out_wg_kernel, OutWgCfg::kTotal, 128);
      else
        out_kernel(gdn_chunk_out_tma_kernel, OutTmaCfg::kTotal, OutCfg<2>::kThreads);
    } else if (overlap)
      out_kernel(gdn_chunk_out_kernel<2, true>, OutCfg<2>::kTotal, OutCfg<2>::kThreads);
    else
      out_kernel(gdn_chunk_out_kernel<2, false>, OutCfg<2>::kTotal, OutCfg<2>::kThreads);
  } else {
    out_kernel(gdn_chunk_out_kernel<1, false>, OutCfg<1>::kTotal, OutCfg<1>::kThreads);
  }
}

}  // namespace ds::cuda
