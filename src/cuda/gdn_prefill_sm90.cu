// GDN prompt path, Hopper kernels for d_k = d_v = 128 (the kGdnPrefill variants "scan_mma" and
// "wymma_scan_x2" of dispatch.cpp; gdn_prefill.cu runs them, the generic kernels stay the
// fallback):
//  - gdn_scan_kernel: replaces the generic state pass + output kernels (which wrote a bf16 state
//    snapshot per chunk, ~100 MB at 4096 tokens, and V_new, and read them back) by one kernel per
//    (sequence, value head) walking the sequence's chunks of 64 tokens with the state in
//    registers; SPLIT = 2 splits each head's state over a cluster of two CTAs (96 CTAs, not 48,
//    for one 27B sequence), the gated norm's row sums exchanged through distributed shared memory.
//  - gdn_wy_mma_kernel: the WY stage (A, T = (I + A)^-1, W, U) with register-resident mma.sync
//    products instead of the generic kernel's shared-memory WMMA round trips; <true> (the
//    slice_scan variants, gdn_prefill_slice.cu) forms T's off-diagonal blocks on tf32 mma.sync and
//    scales T's columns instead of K's and V's rows (H200, 4096 tokens: 126 vs 180 us).
//  - gdn_conv_prep_multi_kernel: conv + SiLU + l2norm + gates, 8 tokens per block;
//    gdn_conv_prep_wide_kernel: the same with one warp per (head, 8 tokens) (slice_scan below 2048
//    tokens; 114 vs 104 us at 4096).
//
// Scan layout: warp w owns 16 rows v of the head's state, kept as the fp32 accumulator fragments
// of h^T [v, k] (16 mma.sync m16n8 tiles, 64 registers per thread). Working transposed (M = v) lets
// every product chain through registers: the accumulator layout of h^T is the A-operand layout of
// h^T W^T and h^T Q^T, and the accumulator of V_new^T [v, t] is the A operand of V_new^T P^T and
// of the state update V_new^T K. The only cross-warp data are P (once per chunk, 8 KB of shared
// memory) and the output rows for the gated RMSNorm.
// Per chunk (n valid rows, tail rows zero-filled; gamma of rows past n = gamma[n - 1]):
//   P   = causal(Q K^T) * e^(gamma_t - gamma_t')             (bf16, shared; warps split the tiles)
//   Vn^T = U^T - h^T W^T                                      (fp32 accumulate, rounded to bf16)
//   O^T  = (h^T Q^T) * e^(gamma_t) + Vn^T P^T
//   h^T <- e^(gamma_last) h^T + (Vn^T * e^(gamma_last - gamma_t)) K
//   y    = norm_w * rmsnorm(O) * silu(z)                      (rows through shared memory)
// The next chunk's Q, K, W, U and gamma stream in with cp.async (double buffer) while this one
// computes. Precision as FLA and the generic path: bf16 operands (h, Vn, P, Q, K, W, U), fp32
// accumulators, state and gamma.
// Shared memory: scan 179 KB (SPLIT 1) / 150 KB (SPLIT 2), one CTA per SM; WY 72.8 KB, 3 per SM.
//
// Measured on the H200 (2026-11-29, tests/cuda/cuda_gdn_test.cpp Timing = CUDA events, median of
// 20, one sequence with carried state; per-kernel times under ncu at 4096 tokens):
//   tokens            512     4096    8192   ms/layer
//   generic         0.173    1.037   1.977
//   scan_mma        0.153    0.967   1.873   (scan<1> 554 us replaces state 386 + output 226)
//   wymma_scan_x2   0.186    0.893   1.735   (conv_multi 99 us, wy_mma 176 us vs 295, scan<2> 604)
//   wymma_scan      (not run yet: generic conv + wy_mma + scan<1>, est. ~0.84 at 4096)
// `bench kernels` (graph replays, rotated inputs): 4096 tokens 0.891 ms vs the generic 1.034
// (carried), 0.881 vs 1.004 (fresh); 512 tokens 0.178 vs 0.163 and 64 tokens 0.120 vs 0.084:
// hence the token thresholds of the guards. Far from FLA (0.405 ms at 4096): the scan is
// latency-bound, one instruction per ~5 cycles per warp (ncu: 1 warp per scheduler, 80% of
// cycles with no eligible warp), ~3300 instructions per warp per chunk of which only ~250 are
// mma: 64 chunks x ~9 us. What would pay next: fewer non-mma instructions per chunk (the U^T
// scalar loads, the per-chunk cp.async address arithmetic, the P tiles' branches), the WY kernel
// on scan<1> (not measured), and a wgmma state pass with warp specialisation (FlashInfer).
// Test: tests/cuda/cuda_gdn_test.cpp (every prefill case runs the generic path and each variant,
// forced for all lengths); bench: `deltaserve bench kernels --only gdn_prefill`.
#include <cooperative_groups.h>

#include "cuda/cuda_common.h"
#include "cuda/gdn_chunk.cuh"
#include "cuda/gdn_prefill_sm90.h"
#include "cuda/mma_util.cuh"

namespace ds::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kC = 64;   // chunk length
constexpr int kD = 128;  // d_k = d_v
constexpr int kLd =
    kD + 8;  // bf16 row stride of the [64][128] tiles: 272 B, ldmatrix conflict-free
constexpr int kLdp = kC + 8;  // P row stride: 144 B
static_assert(kC == gdn_tile::kC && kD == gdn_tile::kD && kLd == gdn_tile::kLd);

// SPLIT CTAs (a cluster) share one (sequence, head): each owns d_v / SPLIT state rows with
// 8 / SPLIT warps; SPLIT = 2 puts 96 CTAs (not 48) on the 132 SMs for one 27B sequence.
template <int SPLIT>
struct ScanCfg {
  static constexpr int kWarps = 8 / SPLIT;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kVc = kD / SPLIT;  // state rows (value columns) per CTA
  static constexpr int kLdu = kVc + 8;    // U tile (this CTA's columns) row stride
  static constexpr int kLdo = kVc + 4;    // fp32 output staging row stride
  static constexpr size_t kTile = sizeof(bf16) * kC * kLd;
  static constexpr size_t kQ = 0, kK = kTile, kW = 2 * kTile, kU = 3 * kTile;
  static constexpr size_t kGam = kU + sizeof(bf16) * kC * kLdu;
  static constexpr size_t kBuf = kGam + sizeof(float) * kC;  // one stage of the pipeline
  static constexpr size_t kP = 2 * kBuf;
  static constexpr size_t kO = kP + sizeof(bf16) * kC * kLdp;
  static constexpr size_t kSs = kO + sizeof(float) * kC * kLdo;  // [3][64]: own, peer x 2
  static constexpr size_t kTotal = kSs + sizeof(float) * 3 * kC;
  static_assert(kBuf % 128 == 0 && kO % 16 == 0 && kSs % 16 == 0);
};

using gdn_tile::acc_a_times_tile;
using gdn_tile::acc_to_a;
using gdn_tile::ha_times_tile_t;

template <int SPLIT>
__global__ void __launch_bounds__(ScanCfg<SPLIT>::kThreads, 1)
    gdn_scan_kernel(GdnShape s, GdnLayerWeights wts, GdnStatePool pool,
                    const int32_t* __restrict__ cu_seqlens,  // [n_seqs + 1]
                    const int32_t* __restrict__ seq_pos,     // [n_seqs]
                    const int32_t* __restrict__ slot_ids,    // [n_seqs]
                    const bf16* __restrict__ proj,           // [n_tokens, in_dim] (z)
                    const bf16* __restrict__ qkv,            // [n_tokens, qkv_dim]
                    const float* __restrict__ gamma,         // [n_tokens, n_v]
                    const bf16* __restrict__ w_mat,          // [n_tokens, n_v, 128]
                    const bf16* __restrict__ u_mat,          // [n_tokens, n_v, 128]
                    bf16* __restrict__ out)                  // [n_tokens, n_v * 128]
{
  using L = ScanCfg<SPLIT>;
  constexpr int kWarps = L::kWarps, kThreads = L::kThreads, kVc = L::kVc;
  constexpr int kLdu = L::kLdu, kLdo = L::kLdo;
  constexpr int kPerLane = kVc / 32;  // output columns per lane in the epilogue (4 or 2)
  const int seq = blockIdx.x, hv = blockIdx.y;
  const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
  if (len <= 0) return;  // the slot is left untouched (both CTAs of a cluster return)
  const int rank = SPLIT == 1 ? 0 : static_cast<int>(blockIdx.z);  // cluster dims (1, 1, SPLIT)
  const int v_cta = rank * kVc;
  const int n_v = s.n_v_heads, hk = hv / (n_v / s.n_k_heads);
  const int qkv_dim = s.qkv_dim(), in_dim = s.in_dim(), out_dim = s.out_dim();
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* p_s = reinterpret_cast<bf16*>(smem + L::kP);        // [64][kLdp]
  float* o_s = reinterpret_cast<float*>(smem + L::kO);      // [64][kLdo]
  float* ss_own = reinterpret_cast<float*>(smem + L::kSs);  // [64] row sums of squares (SPLIT 2)
  float* ss_in = ss_own + kC;                               // [2][64] the peer's, by chunk parity
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int v_base = v_cta + 16 * warp;  // this warp's state rows (head-relative)
  const int n_chunks = (len + kC - 1) / kC;

  auto tile = [&](int b, size_t off) { return reinterpret_cast<bf16*>(smem + b * L::kBuf + off); };
  auto gam_buf = [&](int b) { return reinterpret_cast<float*>(smem + b * L::kBuf + L::kGam); };
  // Chunk ch's Q, K, W rows, this CTA's U columns and gamma into stage b; rows past the sequence
  // end are zero.
  auto fetch = [&](int ch, int b) {
    const int64_t row0 = start + static_cast<int64_t>(ch) * kC;
    const int n = min(kC, len - ch * kC);
    bf16* q_d = tile(b, L::kQ);
    bf16* k_d = tile(b, L::kK);
    bf16* w_d = tile(b, L::kW);
    bf16* u_d = tile(b, L::kU);
    for (int e = tid; e < kC * (kD / 8); e += kThreads) {
      const int r = e / (kD / 8), col = (e % (kD / 8)) * 8;
      const bool ok = r < n;
      const int64_t row = row0 + (ok ? r : 0);
      const bf16* qkv_row = qkv + row * qkv_dim;
      cp_async16(q_d + r * kLd + col, qkv_row + hk * kD + col, ok);
      cp_async16(k_d + r * kLd + col, qkv_row + (s.n_k_heads + hk) * kD + col, ok);
      cp_async16(w_d + r * kLd + col, w_mat + (row * n_v + hv) * kD + col, ok);
    }
    for (int e = tid; e < kC * (kVc / 8); e += kThreads) {
      const int r = e / (kVc / 8), col = (e % (kVc / 8)) * 8;
      const bool ok = r < n;
      const int64_t row = row0 + (ok ? r : 0);
      cp_async16(u_d + r * kLdu + col, u_mat + (row * n_v + hv) * kD + v_cta + col, ok);
    }
    if (tid < kC) {
      const bool ok = tid < n;
      cp_async4(gam_buf(b) + tid, gamma + (row0 + (ok ? tid : 0)) * n_v + hv, ok);
    }
  };
  fetch(0, 0);
  cp_async_commit();

  // The state: h[j][i] = h^T(v, k), v = v_base + g + 8 (i / 2), k = 8 j + 2 c + (i % 2).
  float* state = pool.rec_state + static_cast<int64_t>(slot_ids[seq]) * pool.rec_slot_stride +
                 static_cast<int64_t>(hv) * kD * kD;
  const bool has_state = seq_pos[seq] > 0;
  float h[16][4];
  gdn_tile::load_state_rows(h, state, has_state, v_base, g, c);
  const bool norm = wts.norm_w != nullptr;
  float nw[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    nw[i] = norm ? __bfloat162float(wts.norm_w[v_cta + kPerLane * lane + i]) : 1.f;

  for (int ch = 0; ch < n_chunks; ++ch) {
    const int b = ch & 1;
    const int64_t row0 = start + static_cast<int64_t>(ch) * kC;
    const int n = min(kC, len - ch * kC);
    cp_async_wait_all();
    __syncthreads();  // chunk ch landed; chunk ch - 1 (its epilogue included) is done everywhere
    if (ch + 1 < n_chunks) fetch(ch + 1, b ^ 1);
    cp_async_commit();
    const bf16* q_s = tile(b, L::kQ);
    const bf16* k_s = tile(b, L::kK);
    const bf16* w_s = tile(b, L::kW);
    const bf16* u_s = tile(b, L::kU);
    const float* gam = gam_buf(b);
    const float g_last = gam[n - 1];

    // ---- P = causal(Q K^T) e^(gamma_t - gamma_t') over 16-row blocks rb and 8-column tiles
    // jt <= 2 rb + 1 (the rest of P is never read). SPLIT 1: warp w takes rb = w / 2; SPLIT 2:
    // warps 0, 1 take rb 0 and 3, warps 2, 3 rb 1 and 2 (5 tiles each); jt of parity w % 2.
#pragma unroll
    for (int q = 0; q < SPLIT; ++q) {
      const int r = SPLIT == 1 ? (warp >> 1) : (warp < 2 ? (q ? 3 : 0) : (q ? 2 : 1));
      const int par = warp & 1;
      float pacc[4][4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) pacc[jj][0] = pacc[jj][1] = pacc[jj][2] = pacc[jj][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        uint32_t a[4];
        ldsm_x4(a, q_s + (16 * r + (lane & 15)) * kLd + 16 * ks + (lane >> 4) * 8);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          if (jj <= r) {
            const int jt = 2 * jj + par;
            uint32_t bb[2];
            ldsm_x2(bb, k_s + (8 * jt + (lane & 7)) * kLd + 16 * ks + ((lane >> 3) & 1) * 8);
            mma_bf16(pacc[jj], a, bb[0], bb[1]);
          }
        }
      }
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        if (jj <= r) {
          const int jt = 2 * jj + par;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = 16 * r + g + 8 * half, col = 8 * jt + 2 * c;
            float p0 = 0.f, p1 = 0.f;
            if (row < n) {
              const float gr = gam[row];
              if (col <= row) p0 = pacc[jj][2 * half] * __expf(gr - gam[col]);
              if (col + 1 <= row) p1 = pacc[jj][2 * half + 1] * __expf(gr - gam[col + 1]);
            }
            *reinterpret_cast<uint32_t*>(p_s + row * kLdp + col) = pack_bf16(p0, p1);
          }
        }
      }
    }

    // ---- h^T as bf16 A fragments (k-step s: k in [16 s, 16 s + 16)).
    uint32_t ha[8][4];
    acc_to_a<16>(h, ha);

    // ---- Vn^T [16 v, 64 t] = U^T - h^T W^T; B(k, t) = W[t][k].
    float vn[8][4];
    ha_times_tile_t(ha, w_s, lane, vn);
    // Gamma of this thread's columns t = 8 j + 2 c + e (held at gamma[n - 1] past the end).
    float gcol[8][2];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) gcol[j][e] = gam[min(8 * j + 2 * c + e, n - 1)];
    }
    uint32_t va[4][4], vsa[4][4];  // Vn^T and (Vn^T e^(gamma_last - gamma_t)) as A fragments
    {
      float vs[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int v = v_base - v_cta + g + 8 * (i >> 1), t = 8 * j + 2 * c + (i & 1);
          const float x = __bfloat162float(u_s[t * kLdu + v]) - vn[j][i];
          vn[j][i] = x;
          vs[j][i] = x * __expf(g_last - gcol[j][i & 1]);
        }
      }
      acc_to_a<8>(vn, va);
      acc_to_a<8>(vs, vsa);
    }

    // ---- O^T [16 v, 64 t] = (h^T Q^T) e^(gamma_t); B(k, t) = Q[t][k].
    float o[8][4];
    ha_times_tile_t(ha, q_s, lane, o);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float sc = __expf(gcol[j][e]);
        o[j][e] *= sc;
        o[j][2 + e] *= sc;
      }
    }
    // z of the rows this warp normalises (t = warp + kWarps r), loaded here so that the latency
    // hides behind the P V and state products.
    constexpr int kRows = kC / kWarps;
    uint32_t zr[kRows][kPerLane / 2];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int t = warp + kWarps * r;
      const bf16* zp = proj + (row0 + t) * in_dim + qkv_dim + hv * kD + v_cta + kPerLane * lane;
#pragma unroll
      for (int i = 0; i < kPerLane / 2; ++i)
        zr[r][i] = (norm && t < n) ? reinterpret_cast<const uint32_t*>(zp)[i] : 0u;
    }
    __syncthreads();  // P is complete
    // O^T += Vn^T P^T; B(t', t) = P[t][t'], zero for t' > t: k-steps s <= j / 2 only.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        if (ks <= j / 2) {
          uint32_t bp[2];
          ldsm_x2(bp, p_s + (8 * j + (lane & 7)) * kLdp + 16 * ks + ((lane >> 3) & 1) * 8);
          mma_bf16(o[j], va[ks], bp[0], bp[1]);
        }
      }
    }

    // ---- h^T <- e^(gamma_last) h^T + Vs^T K; B(t, k) = K[t][k] (ldmatrix.trans, two k tiles).
    {
      const float decay = __expf(g_last);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) h[j][i] *= decay;
      }
      acc_a_times_tile(vsa, k_s, lane, kC / 16 - 1, h);
    }

    // ---- Output rows through shared memory, then the gated RMSNorm (warp w: rows w + kWarps r).
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int v = v_base - v_cta + g + 8 * (i >> 1), t = 8 * j + 2 * c + (i & 1);
        o_s[t * kLdo + v] = o[j][i];
      }
    }
    __syncthreads();
    if constexpr (SPLIT == 2) {
      // Row sums of squares over this CTA's half of the head: kept here and sent to the peer's
      // shared memory (buffer of this chunk's parity); the cluster barrier publishes both.
      if (norm) {
        cg::cluster_group cluster = cg::this_cluster();
        float* peer_in = cluster.map_shared_rank(ss_in + b * kC, rank ^ 1);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int t = warp + kWarps * r;
          const float2 o2 = *reinterpret_cast<const float2*>(o_s + t * kLdo + 2 * lane);
          const float ss = warp_sum(o2.x * o2.x + o2.y * o2.y);
          if (lane == 0) {
            ss_own[t] = ss;
            peer_in[t] = ss;
          }
        }
        cluster.sync();
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int t = warp + kWarps * r;
      if (t >= n) break;
      float ov[kPerLane];
      if constexpr (kPerLane == 4) {
        const float4 o4 = *reinterpret_cast<const float4*>(o_s + t * kLdo + 4 * lane);
        ov[0] = o4.x, ov[1] = o4.y, ov[2] = o4.z, ov[3] = o4.w;
      } else {
        const float2 o2 = *reinterpret_cast<const float2*>(o_s + t * kLdo + 2 * lane);
        ov[0] = o2.x, ov[1] = o2.y;
      }
      float y[kPerLane];
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) y[i] = ov[i];
      if (norm) {
        float ss;
        if constexpr (SPLIT == 1) {
          float part = 0.f;
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) part += ov[i] * ov[i];
          ss = warp_sum(part);
        } else {
          ss = ss_own[t] + ss_in[b * kC + t];
        }
        const float scale = rsqrtf(ss / kD + s.norm_eps);
#pragma unroll
        for (int i = 0; i < kPerLane / 2; ++i) {
          const __nv_bfloat162 z2 = *reinterpret_cast<const __nv_bfloat162*>(&zr[r][i]);
          y[2 * i] = nw[2 * i] * ov[2 * i] * scale * silu(__low2float(z2));
          y[2 * i + 1] = nw[2 * i + 1] * ov[2 * i + 1] * scale * silu(__high2float(z2));
        }
      }
      bf16* yp = out + (row0 + t) * out_dim + hv * kD + v_cta + kPerLane * lane;
      if constexpr (kPerLane == 4) {
        *reinterpret_cast<uint2*>(yp) = make_uint2(pack_bf16(y[0], y[1]), pack_bf16(y[2], y[3]));
      } else {
        *reinterpret_cast<uint32_t*>(yp) = pack_bf16(y[0], y[1]);
      }
    }
  }
  cp_async_wait_all();  // nothing in flight at exit (the last commit is empty)

  gdn_tile::store_state_rows(h, state, v_base, g, c);
}

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

// TF32_OFFDIAG: the off-diagonal blocks of T per column block on tf32 mma.sync, warp j owning
// column block j (no block barriers between the distances), and the beta e^gamma / beta scales
// applied to T's columns instead of K's and V's rows (used by the slice_scan variants); else the
// three SIMT rounds and the in-place scaling (the shipped wymma variants, unchanged).
template <bool TF32_OFFDIAG>
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
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* ks = reinterpret_cast<bf16*>(smem + L::kK);    // [64][kLd] K, then beta e^gamma K
  bf16* vs = reinterpret_cast<bf16*>(smem + L::kV);    // [64][kLd] V, then beta V
  float* af = reinterpret_cast<float*>(smem + L::kA);  // [64][kLda]
  float* tf = reinterpret_cast<float*>(smem + L::kT);  // [64][kLdt]
  float* xs = reinterpret_cast<float*>(smem + L::kX);
  float* gam = reinterpret_cast<float*>(smem + L::kGam);
  float* bet = reinterpret_cast<float*>(smem + L::kBet);
  float* eg = reinterpret_cast<float*>(smem + L::kEg);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, c = lane & 3;

  for (int e = tid; e < kC * (kD / 8); e += L::kThreads) {
    const int r = e / (kD / 8), col = (e % (kD / 8)) * 8;
    const bool ok = r < n;
    const bf16* row = qkv + (row0 + (ok ? r : 0)) * qkv_dim;
    cp_async16(ks + r * kLd + col, row + (s.n_k_heads + hk) * kD + col, ok);
    cp_async16(vs + r * kLd + col, row + 2 * s.n_k_heads * kD + hv * kD + col, ok);
  }
  cp_async_commit();
  if (warp == 0) {
    stage_chunk_gates(g, beta, row0, n, n_v, hv, lane, gam, bet, eg);  // gamma, beta, beta e^gamma
  }
  cp_async_wait_all();
  __syncthreads();

  // ---- A, row block w (columns up to the diagonal block) from K K^T in registers.
  {
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
  if constexpr (TF32_OFFDIAG) {
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
  auto t_fragments = [&](const float* col_scale, uint32_t(&ta)[4][4]) {
#pragma unroll
    for (int kstep = 0; kstep < 4; ++kstep) {
      const int j0 = 16 * kstep + 2 * c;
      const float* t0 = tf + (16 * warp + gq) * L::kLdt + j0;
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
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    const bf16* src = which == 0 ? ks : vs;
    bf16* dst = which == 0 ? w_out : u_out;
    uint32_t ta[4][4];
    t_fragments(TF32_OFFDIAG ? (which == 0 ? eg : bet) : nullptr, ta);
    float acc[16][4];
#pragma unroll
    for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    acc_a_times_tile(ta, src, lane, warp, acc);  // T is lower triangular: k-steps <= warp
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = 16 * warp + gq + 8 * half;
      if (i < n) {
        bf16* d = dst + ((row0 + i) * n_v + hv) * kD + 2 * c;
#pragma unroll
        for (int j = 0; j < 16; ++j)
          *reinterpret_cast<uint32_t*>(d + 8 * j) =
              pack_bf16(acc[j][2 * half], acc[j][2 * half + 1]);
      }
    }
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

void launch_gdn_scan(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                     const bf16* proj, const int32_t* cu_seqlens, const int32_t* seq_pos,
                     const int32_t* slot_ids, int n_seqs, const bf16* qkv, const float* gamma,
                     const bf16* w_mat, const bf16* u_mat, bf16* out, int split,
                     cudaStream_t stream) {
  DS_CHECK(split == 1 || split == 2, "gdn scan: split must be 1 or 2, got ", split);
  DS_CHECK(gdn_scan_supported(s, w, pool, proj, out),
           "gdn scan: shape / alignment not supported (d_k = d_v = 128 only)");
  DS_CHECK(aligned(qkv, 16) && aligned(w_mat, 16) && aligned(u_mat, 16),
           "gdn scan: workspace tiles must be 16-byte aligned");
  if (n_seqs <= 0) return;
  if (split == 1) {
    using L = ScanCfg<1>;
    DS_CUDA_CHECK(cudaFuncSetAttribute(gdn_scan_kernel<1>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(L::kTotal)));
    gdn_scan_kernel<1><<<dim3(n_seqs, s.n_v_heads), L::kThreads, L::kTotal, stream>>>(
        s, w, pool, cu_seqlens, seq_pos, slot_ids, proj, qkv, gamma, w_mat, u_mat, out);
    DS_CUDA_LAUNCH_CHECK();
    return;
  }
  // SPLIT 2: the two halves of a head's state in a cluster of two CTAs (the gated norm's row sums
  // go through distributed shared memory).
  using L = ScanCfg<2>;
  DS_CUDA_CHECK(cudaFuncSetAttribute(gdn_scan_kernel<2>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(L::kTotal)));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(n_seqs, s.n_v_heads, 2);
  cfg.blockDim = dim3(L::kThreads);
  cfg.dynamicSmemBytes = L::kTotal;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 2;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  DS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gdn_scan_kernel<2>, s, w, pool, cu_seqlens, seq_pos,
                                   slot_ids, proj, qkv, gamma, w_mat, u_mat, out));
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

void launch_gdn_wy_mma(const GdnShape& s, const int4* chunks, int max_chunks, const bf16* qkv,
                       float* g, const float* beta, bf16* w_mat, bf16* u_mat, cudaStream_t stream,
                       bool tf32_offdiag) {
  DS_CHECK(s.d_k == kD && s.d_v == kD, "gdn wy mma: d_k = d_v = 128 only");
  DS_CHECK(aligned(qkv, 16) && aligned(w_mat, 4) && aligned(u_mat, 4) && s.qkv_dim() % 8 == 0,
           "gdn wy mma: qkv rows must be 16-byte aligned");
  if (max_chunks <= 0) return;
  auto run = [&](auto kernel) {
    DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(WyCfg::kTotal)));
    kernel<<<dim3(max_chunks, s.n_v_heads), WyCfg::kThreads, WyCfg::kTotal, stream>>>(
        s, chunks, qkv, g, beta, w_mat, u_mat);
    DS_CUDA_LAUNCH_CHECK();
  };
  if (tf32_offdiag)
    run(gdn_wy_mma_kernel<true>);
  else
    run(gdn_wy_mma_kernel<false>);
}

}  // namespace ds::cuda
