// Decode GEMV, bulk-copy pipeline: y[m, n] = x[m, k] w[n, k]^T (+ y) for m = 1..8 tokens and
// k up to ~12K (see gemv.h for the interface and the guard). Built for the k = 5120 / 6144 decode
// projections of Qwen3.5-27B (gate_up 34816x5120, gdn_in 16480x5120, attn_qkv 14336x5120,
// gdn_out / attn_o 5120x6144), where a GEMV must keep the HBM read pipe full from the first
// microsecond to the last.
//
// Method: one persistent block per SM owns a contiguous range of weight rows (n split evenly over
// the grid: no tail wave), i.e. one contiguous byte range of w. A producer warp streams it into a
// shared-memory ring of `slots` stages of R whole rows each with 1-D bulk copies
// (cp.async.bulk, completing on an mbarrier per slot, L2 evict-first policy), so up to ~160 KB
// per SM are in flight from a single thread; the first `slots` copies are issued before the block
// even waits for the previous kernel (programmatic dependent launch) or loads x. Eight consumer
// warps take the stages round robin (stage s -> warp s % 8; slots is a multiple of 8, so a slot
// is always refilled for the warp that consumed it and its mbarrier phase can never be one fill
// behind), dot each row with x (bf16 in shared memory, fp32 FMAs), release the slot and reduce
// across the warp with shuffles. launch_gemv_bulk_silu fuses the SwiGLU activation: stages of one
// gate row and its up row, output bf16(silu(g) * u) bit-identical to the GEMM then
// launch_silu_mul (activation.cu). Lane l sums k-elements [8v, 8v + 8) for v = l, l + 32, ... in
// that order, then a fixed butterfly: the summation order of an output depends on k only, never
// on m, R or the slot count (bit-identical across batch sizes and configs).
// With a GemvNormIn (gemv_bulk_norm.h) the block computes x = rmsnorm(residual + delta) itself
// after griddepcontrol.wait instead of loading x (norm_to_shared), bit-identical to rmsnorm.cu.
#include <algorithm>
#include <atomic>
#include <iterator>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>

#include "cuda/argmax_key.h"
#include "cuda/bulk_copy.cuh"
#include "cuda/cuda_common.h"
#include "cuda/gemv.h"
#include "cuda/gemv_bulk_norm.h"

namespace ds::cuda {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * 32;  // + one producer warp
constexpr int kMaxSlots = 32;
constexpr int kBarBytes = 2 * kMaxSlots * 8;  // full[] and empty[] mbarriers
constexpr int kRedBytes = kGemvBulkMaxM * kConsumerWarps * 4;  // the fused norm's warp sums
constexpr int kNormThreads = 256;  // threads of the fused norm: rmsnorm.cu's block, same sums
constexpr int kNormVec = kGemvNormMaxK / 8 / kNormThreads;  // 16-byte vectors per thread
constexpr int kMaxSmem = 232448;              // sm 90 opt-in dynamic shared memory per block

// The fused prologue (gemv_bulk_norm.h): x[t] = rmsnorm(residual[t] + delta[t]) into xs, block 0
// also writes residual_out. Bit-identical to rmsnorm.cu's add_rmsnorm_vec_kernel: threads 0..255
// take the 16-byte vectors i = thread + 256 v in the same order, sum the squares of the bf16
// residual in the same order, reduce by warp_sum, then the 8 warp sums by warp_sum again (lanes
// >= 8 add zeros, as block_sum does for a 256-thread block), and evaluate the same fp32
// expressions. The new residual is parked in xs as bf16 (exactly the values rmsnorm.cu keeps as
// floats) and normalised in place after the reduction. The loads of all M rows are issued
// together (G = M rows per group; one L2 round trip instead of one per row: the fused gate_up at
// m 4 advanced the decode step by 100.1 instead of 102.2 us, H200). All threads must call it
// (barrier inside); the caller synchronises before xs is read by other threads.
// The norm weight's vectors of this thread (norm_to_shared's wv). A model weight, not an output
// of the kernel before: loaded before griddepcontrol.wait, so that its round trip (often to DRAM:
// each layer's weight is read once per step) overlaps the previous kernel instead of following it.
__device__ __forceinline__ void norm_weight_regs(const GemvNormIn& p, int k,
                                                 uint4 (&wv)[kNormVec]) {
  const int t = threadIdx.x, k8 = k / 8;
  if (t < kNormThreads) {
    const uint4* w4 = reinterpret_cast<const uint4*>(p.weight);
#pragma unroll
    for (int v = 0; v < kNormVec; ++v) {
      const int i = t + v * kNormThreads;
      if (i < k8) wv[v] = w4[i];
    }
  }
}

// kConsumers: called by the 8 consumer warps alone, mid-kernel (the fused MLP's mixer form): the
// block barrier is the consumers' named barrier 1, and residual / delta (written by other blocks
// of the same grid before a grid barrier) are read through L2.
template <int M, bool kConsumers = false>
__device__ __forceinline__ void norm_to_shared(const GemvNormIn& p, int k, bf16* xs, float* red,
                                               const uint4 (&wv)[kNormVec]) {
  constexpr int G = M;  // M <= kGemvNormMaxM = 4
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int k8 = k / 8;
  if (t < kNormThreads) {
#pragma unroll
    for (int r0 = 0; r0 < M; r0 += G) {
      uint4 ra[G][kNormVec], da[G][kNormVec];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (r0 + g >= M) break;
        const uint4* res4 = reinterpret_cast<const uint4*>(p.residual + size_t(r0 + g) * k);
        const uint4* del4 =
            p.delta ? reinterpret_cast<const uint4*>(p.delta + size_t(r0 + g) * k) : nullptr;
#pragma unroll
        for (int v = 0; v < kNormVec; ++v) {
          const int i = t + v * kNormThreads;
          if (i < k8) {
            if constexpr (kConsumers) {
              ra[g][v] = __ldcg(res4 + i);
              if (del4) da[g][v] = __ldcg(del4 + i);
            } else {
              ra[g][v] = res4[i];
              if (del4) da[g][v] = del4[i];
            }
          }
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int r = r0 + g;
        if (r >= M) break;
        uint4* xs4 = reinterpret_cast<uint4*>(xs + size_t(r) * k);
        float ss = 0.f;
#pragma unroll
        for (int v = 0; v < kNormVec; ++v) {
          const int i = t + v * kNormThreads;
          if (i < k8) {
            uint4 a = ra[g][v];
            if (p.delta) {
              const bf16* rb = reinterpret_cast<const bf16*>(&ra[g][v]);
              const bf16* db = reinterpret_cast<const bf16*>(&da[g][v]);
              bf16* nb = reinterpret_cast<bf16*>(&a);
#pragma unroll
              for (int j = 0; j < 8; ++j)
                nb[j] = __float2bfloat16_rn(__bfloat162float(rb[j]) + __bfloat162float(db[j]));
              if (blockIdx.x == 0) reinterpret_cast<uint4*>(p.residual_out + size_t(r) * k)[i] = a;
            }
            xs4[i] = a;
            const bf16* xb = reinterpret_cast<const bf16*>(&a);
            float x[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) x[j] = __bfloat162float(xb[j]);
#pragma unroll
            for (int j = 0; j < 8; ++j) ss += x[j] * x[j];
          }
        }
        ss = warp_sum(ss);
        if (lane == 0) red[r * kConsumerWarps + warp] = ss;
      }
    }
  }
  if constexpr (kConsumers)
    asm volatile("bar.sync 1, %0;" ::"n"(kNormThreads) : "memory");
  else
    __syncthreads();
  if (t < kNormThreads) {
#pragma unroll
    for (int r = 0; r < M; ++r) {
      float ss = lane < kNormThreads / 32 ? red[r * kConsumerWarps + lane] : 0.f;
      ss = warp_sum(ss);
      const float inv = rsqrtf(ss / k + p.eps);
      uint4* xs4 = reinterpret_cast<uint4*>(xs + size_t(r) * k);
#pragma unroll
      for (int v = 0; v < kNormVec; ++v) {
        const int i = t + v * kNormThreads;
        if (i < k8) {
          const uint4 a = xs4[i];  // this thread's own vector: no barrier needed
          const bf16* xb = reinterpret_cast<const bf16*>(&a);
          const bf16* wb = reinterpret_cast<const bf16*>(&wv[v]);
          uint4 o;
          bf16* ob = reinterpret_cast<bf16*>(&o);
#pragma unroll
          for (int j = 0; j < 8; ++j)
            ob[j] = __float2bfloat16_rn(__bfloat162float(xb[j]) * inv *
                                        (p.weight_offset + __bfloat162float(wb[j])));
          xs4[i] = o;
        }
      }
    }
  }
}

// After griddepcontrol.wait, all threads: the block's x [M, k] into shared memory, either the
// fused norm's output (NORM; the weight's vectors in norm_w unless loaded before the wait) or a
// copy of x (k % 8 == 0: whole 16-byte vectors). The caller synchronises before xs is read.
template <int M, bool NORM>
__device__ __forceinline__ void x_to_shared(const bf16* x, const GemvNormIn& norm, int k, bf16* xs,
                                            float* red, uint4 (&norm_w)[kNormVec]) {
  if constexpr (NORM) {
    if (!norm.weight_early) norm_weight_regs(norm, k, norm_w);
    norm_to_shared<M>(norm, k, xs, red, norm_w);
  } else {
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* xd = reinterpret_cast<uint4*>(xs);
    const int nv = M * k / 8;
    for (int i = threadIdx.x; i < nv; i += kThreads) xd[i] = xv[i];
  }
}

// Shared memory: [full mbarriers | empty mbarriers] (kBarBytes), x [M, k] bf16, ring
// [slots, R, k] bf16, and with the fused norm its warp sums (kRedBytes) after the ring.
// GLU (R == 2): w is the fused [gate | up] matrix [2 n, k]; stage s holds gate row j and up row
// n + j (two bulk copies on one mbarrier) and the output is y[t, j] = bf16(silu(g) * u) with g, u
// the two dot products rounded to bf16 first, exactly as the unfused GEMM + launch_silu_mul.
// NORM: the fused norm prologue computes x from `norm` (x unused); a separate instantiation, so
// the plain kernels keep their registers (the prologue's loads of 4 rows take ~160).
// PF: the producer prefetches `next` into L2 at its end (GemvL2Next), also a separate
// instantiation (m <= 2, not GLU), so the kernels without it compile exactly as before.
// SIG: the early-rows signal (GemvSignal, gemv.h; interleaved only), also its own instantiation
// (m 1, R 1, NORM, not GLU, not PF).
// AH: GemvBulkConfig::l2_ahead (`ahead` stages past the ring queued for L2 by the producer right
// after griddepcontrol.wait), its own instantiation too (m <= kGemvAheadMaxM, bf16 out, not PF),
// so that the kernels without it keep their machine code.
template <int M, int R, bool GLU, typename OutT, bool NORM, bool PF = false, bool SIG = false,
          bool AH = false>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_bulk_kernel(const bf16* x,  // [M, k] (unused with NORM); no __restrict__: see the wait
                     const bf16* __restrict__ w,  // [n, k] ([2 n, k] when GLU)
                     OutT* __restrict__ y,        // [M, n]
                     int n, int k, int slots, bool accumulate, bool interleave,
                     const GemvNormIn norm,    // NORM only
                     const GemvL2Next next,    // rows of a later GEMV into L2 (rows 0: none)
                     const GemvSignal sig,     // SIG only
                     int ahead) {              // AH only
  static_assert(!SIG || (!GLU && !PF && R == 1), "the signal is compiled for plain R 1 stages");
  static_assert(!AH || !PF, "the own-stage prefetch is compiled without a later GEMV's");

  static_assert(!GLU || R == 2, "GLU stages hold one gate row and one up row");
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxSlots;
  bf16* xs = reinterpret_cast<bf16*>(smem + kBarBytes);
  bf16* ring = xs + size_t(M) * k;
  float* red = reinterpret_cast<float*>(ring + size_t(slots) * R * k);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Contiguous: block b owns rows [row_begin, row_end). Interleaved: the grid's stages are numbered
  // in memory order (GLU: one row each, else R rows) and block b owns stages b, b + G, ..., so the
  // whole grid sweeps w front to back; row_end is then n (only the last stage can be short).
  const int G = gridDim.x, b = blockIdx.x;
  const int row_begin = interleave ? 0 : int(int64_t(n) * b / G);
  const int row_end = interleave ? n : int(int64_t(n) * (b + 1) / G);
  const int total_stages = GLU ? n : (n + R - 1) / R;
  const int n_stages = interleave ? max(0, (total_stages - b + G - 1) / G)
                                  : (GLU ? row_end - row_begin : (row_end - row_begin + R - 1) / R);
  // First row of this block's stage s. SIG: the sweep starts at stage sig.first_row (R 1) and
  // wraps.
  auto stage_row = [&](int s) {
    if constexpr (SIG) {
      const int j = b + s * G + sig.first_row;
      return j >= total_stages ? j - total_stages : j;
    }
    return interleave ? (b + s * G) * (GLU ? 1 : R) : row_begin + s * (GLU ? 1 : R);
  };
  const size_t stage_elems = size_t(R) * k;

  if (threadIdx.x == 0) init_ring_barriers(full, empty, slots);
  // SIG: the consumer warps past the early rows, counted in the last full[] word (unused: the
  // launch requires slots < kMaxSlots; no static shared memory, the ring may take the maximum).
  [[maybe_unused]] unsigned* sig_warps = reinterpret_cast<unsigned*>(&full[kMaxSlots - 1]);
  if constexpr (SIG)
    if (threadIdx.x == 0) *sig_warps = 0;
  __syncthreads();

  const bool producer = warp == kConsumerWarps;
  uint64_t policy = 0;
  auto issue = [&](int s) {
    const int slot = s % slots;
    if constexpr (GLU) {
      const int j = stage_row(s);
      const uint32_t bytes = uint32_t(k) * 2u;
      mbar_arrive_expect_tx(&full[slot], 2 * bytes);
      bulk_copy(ring + slot * stage_elems, w + size_t(j) * k, bytes, &full[slot], policy);
      bulk_copy(ring + slot * stage_elems + k, w + size_t(n + j) * k, bytes, &full[slot], policy);
    } else {
      const int r0 = stage_row(s);
      const uint32_t bytes = uint32_t(min(R, row_end - r0)) * uint32_t(k) * 2u;
      mbar_arrive_expect_tx(&full[slot], bytes);
      bulk_copy(ring + slot * stage_elems, w + size_t(r0) * k, bytes, &full[slot], policy);
    }
  };
  // The weights do not depend on the previous kernel: start streaming them before waiting for it.
  if (producer && lane == 0) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int s = 0; s < min(slots, n_stages); ++s) issue(s);
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  uint4 norm_w[kNormVec];  // NORM: the norm weight, a model weight (no wait needed)
  if constexpr (NORM) {
    if (norm.weight_early) norm_weight_regs(norm, k, norm_w);
  }
  // x (and y when accumulating) come from the kernel before: read only after this wait, through
  // plain pointers (a const __restrict__ x compiles to ld.global.nc, which ptxas may schedule above
  // the wait: it did so in the GDN decode kernels, docs/perf/decode_kernels.md).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // AH: the ring is full by now (or filling) and the consumers are about to wait for x (the norm
  // prologue's L2 round trips, or x's copy): queue the next `ahead` stages' rows for L2 so that
  // HBM streams them meanwhile; their copies below then hit L2. The producer warp takes no part in
  // the norm, and x's copy does not wait for this lane.
  if constexpr (AH) {
    if (producer && lane == 0) {
      for (int s = slots; s < min(slots + ahead, n_stages); ++s) {
        if constexpr (GLU) {
          const int j = stage_row(s);
          bulk_prefetch_l2(w + size_t(j) * k, uint32_t(k) * 2u);
          bulk_prefetch_l2(w + size_t(n + j) * k, uint32_t(k) * 2u);
        } else {
          const int r0 = stage_row(s);
          bulk_prefetch_l2(w + size_t(r0) * k, uint32_t(min(R, row_end - r0)) * uint32_t(k) * 2u);
        }
      }
    }
  }

  x_to_shared<M, NORM>(x, norm, k, xs, red, norm_w);
  __syncthreads();

  if (producer) {
    if (lane == 0) {
      for (int s = slots; s < n_stages; ++s) {
        const int slot = s % slots;
        mbar_wait(&empty[slot], uint32_t((s / slots) - 1) & 1u);
        issue(s);
      }
      // Every own copy is in flight: queue the later GEMV's leading rows behind them.
      if constexpr (PF)
        for (int j = blockIdx.x; j < next.grid; j += gridDim.x) {
          const int rb = int(int64_t(next.n) * j / next.grid);
          const int re = min(int(int64_t(next.n) * (j + 1) / next.grid), rb + next.rows);
          const char* p = static_cast<const char*>(next.w) + size_t(rb) * next.k * 2;
          const size_t bytes = size_t(max(re - rb, 0)) * next.k * 2;
          for (size_t off = 0; off < bytes; off += 32768)
            bulk_prefetch_l2(p + off, uint32_t(min(size_t(32768), bytes - off)));
        }
    }
    return;
  }

  const int nv = k / 8;
  // SIG: every row this warp owns among the sweep's first sig.rows is stored once its next stage
  // lies past them (the sweep positions b + s G grow with s). The warp counts itself in shared
  // memory (warp barrier, then lane 0's CTA fence and a shared atomic: a release at CTA scope);
  // the block's last warp to do so (its shared atomic an acquire with the fence after it) raises
  // the global counter after a GPU-scope fence, cumulative over every warp's stores. One GPU
  // fence per block: each stalls its warp (and so the ring behind it) for a store round trip.
  [[maybe_unused]] bool raised = false;
  [[maybe_unused]] auto raise = [&] {
    __syncwarp();
    if (lane == 0) {
      __threadfence_block();
      if (atomicAdd(sig_warps, 1u) == kConsumerWarps - 1) {
        __threadfence();
        atomicAdd(sig.counter, 1u);
      }
    }
    raised = true;
  };
  for (int s = warp; s < n_stages; s += kConsumerWarps) {
    if constexpr (SIG)
      if (!raised && b + s * G >= sig.rows) raise();
    const int slot = s % slots;
    const int r0 = stage_row(s);
    const int rows = GLU ? R : min(R, row_end - r0);
    mbar_wait(&full[slot], uint32_t(s / slots) & 1u);
    const bf16* ws = ring + slot * stage_elems;
    float acc[M][R];
#pragma unroll
    for (int t = 0; t < M; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
#pragma unroll 2
    for (int v = lane; v < nv; v += 32) {
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r)  // rows past `rows` read stale shared memory, never written out
        unpack8(*reinterpret_cast<const uint4*>(ws + size_t(r) * k + size_t(v) * 8), wf[r]);
#pragma unroll
      for (int t = 0; t < M; ++t) {
        float xf[8];
        unpack8(*reinterpret_cast<const uint4*>(xs + size_t(t) * k + size_t(v) * 8), xf);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[t][r] = fmaf(wf[r][e], xf[e], acc[t][r]);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);  // every lane's reads of the slot are done
#pragma unroll
    for (int t = 0; t < M; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[t][r] += __shfl_xor_sync(0xffffffffu, acc[t][r], o);
        if (!GLU && lane == t * R + r && r < rows)
          store_out(y, size_t(t) * n + r0 + r, acc[t][r], accumulate);
      }
    if constexpr (GLU) {
#pragma unroll
      for (int t = 0; t < M; ++t)
        if (lane == t) {
          const float g = __bfloat162float(__float2bfloat16(acc[t][0]));
          const float u = __bfloat162float(__float2bfloat16(acc[t][R - 1]));
          y[size_t(t) * n + r0] = OutT(__float2bfloat16_rn(silu(g) * u));
        }
    }
  }
  if constexpr (SIG)
    if (!raised) raise();
}

size_t smem_bytes(int m, int k, int rows, int slots) {
  return size_t(kBarBytes) + size_t(m) * k * 2 + size_t(slots) * rows * k * 2;
}

template <int M, int R, typename OutT, bool GLU = false>
void launch_t(const bf16* x, const bf16* w, void* y, int n, int k, bool accumulate,
              const GemvBulkConfig& c, int n_sms, cudaStream_t stream, const GemvNormIn& norm,
              const GemvL2Next& next = {}, const GemvSignal& sig = {}) {
  auto* kern = gemv_bulk_kernel<M, R, GLU, OutT, false>;
  if constexpr (M <= kGemvNormMaxM) {
    if (norm.weight) kern = gemv_bulk_kernel<M, R, GLU, OutT, true>;
  }
  if constexpr (M <= kGemvL2NextMaxM && !GLU) {
    if (next.rows > 0)
      kern = norm.weight ? gemv_bulk_kernel<M, R, GLU, OutT, true, true>
                         : gemv_bulk_kernel<M, R, GLU, OutT, false, true>;
  }
  if constexpr (M == 1 && R == 1 && !GLU && std::is_same_v<OutT, bf16>) {
    if (sig.counter != nullptr) kern = gemv_bulk_kernel<M, R, GLU, OutT, true, false, true>;
  }
  if constexpr (M <= kGemvAheadMaxM && std::is_same_v<OutT, bf16>) {
    if (c.l2_ahead > 0) {  // bulk_impl / silu_impl refused it with a GemvL2Next
      kern = norm.weight ? gemv_bulk_kernel<M, R, GLU, OutT, true, false, false, true>
                         : gemv_bulk_kernel<M, R, GLU, OutT, false, false, false, true>;
      if constexpr (M == 1 && R == 1 && !GLU) {
        if (sig.counter != nullptr) kern = gemv_bulk_kernel<M, R, GLU, OutT, true, false, true, true>;
      }
    }
  }
  // The opt-in shared memory size belongs to the device's context: once per (kernel, device), not
  // per process (a std::call_once left the first launch on a second device failing).
  ensure_smem_optin(reinterpret_cast<const void*>(kern), kMaxSmem);
  const int blocks = gemv_bulk_grid(n, c, n_sms);
  const size_t smem = smem_bytes(M, k, R, c.slots) + (norm.weight ? kRedBytes : 0);
  launch_maybe_pdl(kern, dim3(blocks), dim3(kThreads), smem, stream, c.pdl, x, w,
                   static_cast<OutT*>(y), n, k, c.slots, accumulate, c.interleave, norm, next,
                   sig, c.l2_ahead);
}

template <int M, int R>
void launch_mr(const bf16* x, const bf16* w, void* y, int n, int k, GemmOut out, bool acc,
               const GemvBulkConfig& c, int n_sms, cudaStream_t s, const GemvNormIn& nin,
               const GemvL2Next& next, const GemvSignal& sig) {
  if (out == GemmOut::kBF16)
    launch_t<M, R, bf16>(x, w, y, n, k, acc, c, n_sms, s, nin, next, sig);
  else
    launch_t<M, R, float>(x, w, y, n, k, acc, c, n_sms, s, nin, next);
}

template <int M>
void launch_m(const bf16* x, const bf16* w, void* y, int n, int k, GemmOut out, bool acc,
              const GemvBulkConfig& c, int n_sms, cudaStream_t s, const GemvNormIn& nin,
              const GemvL2Next& next, const GemvSignal& sig) {
  if (c.rows_per_stage == 1)
    launch_mr<M, 1>(x, w, y, n, k, out, acc, c, n_sms, s, nin, next, sig);
  else
    launch_mr<M, 2>(x, w, y, n, k, out, acc, c, n_sms, s, nin, next, sig);
}

// The later GEMV's rows must lie inside its weight, 16-byte aligned rows; no weight or no rows:
// off (rows 0 in what the kernel gets).
GemvL2Next checked_next(GemvL2Next p) {
  if (p.rows <= 0 || p.w == nullptr) {
    p.rows = 0;
    return p;
  }
  DS_CHECK(p.n >= 1 && p.k >= 8 && p.k % 8 == 0 && p.grid >= 1 && p.grid <= p.n &&
               (reinterpret_cast<uintptr_t>(p.w) & 15) == 0,
           "bulk gemv: L2 prefetch of a later GEMV needs n >= grid >= 1, k % 8 == 0 and a "
           "16-byte aligned weight (n=", p.n, " k=", p.k, " grid=", p.grid, ")");
  return p;
}

// The fused norm's inputs: present, aligned, k in range, residual_out distinct from its inputs;
// the config's shared memory plus the norm's warp sums within the limit.
bool norm_smem_fits(int m, int k, const GemvBulkConfig& c) {
  const size_t limit = c.blocks_per_sm == 1 ? size_t(kMaxSmem) : size_t(233472 / 2 - 1024);
  return smem_bytes(m, k, c.rows_per_stage, c.slots) + kRedBytes <= limit;
}

void check_norm(const GemvNormIn& p, int m, int k, const GemvBulkConfig& c, const char* what) {
  DS_CHECK(norm_smem_fits(m, k, c), what,
           ": fused norm: config ", c.name(), " leaves no room for the norm's ", kRedBytes,
           " bytes of warp sums at m=", m, " k=", k);
  auto misaligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) != 0; };
  DS_CHECK(p.residual != nullptr && p.weight != nullptr, what,
           ": fused norm needs the residual and the norm weight");
  DS_CHECK(k <= kGemvNormMaxK, what, ": fused norm supports k <= ", kGemvNormMaxK, ", got ", k);
  DS_CHECK(m >= 1 && m <= kGemvNormMaxM, what, ": fused norm supports m 1..", kGemvNormMaxM,
           ", got ", m);
  DS_CHECK(
      !p.delta || (p.residual_out && p.residual_out != p.residual && p.residual_out != p.delta),
      what, ": fused norm with a delta needs a residual_out distinct from residual and delta");
  DS_CHECK(!misaligned(p.residual) && !misaligned(p.delta) && !misaligned(p.weight) &&
               !misaligned(p.residual_out),
           what, ": fused norm pointers must be 16-byte aligned");
}

// launch_gemv_bulk_silu / launch_gemv_bulk_silu_norm (norm.weight null: x is the input).
void silu_impl(const bf16* x, const bf16* w, bf16* act, int m, int d_ff, int k,
               const GemvBulkConfig& cfg, int n_sms, cudaStream_t stream, const GemvNormIn& nin) {
  DS_CHECK(gemv_bulk_silu_supports(m, d_ff, k), "bulk gemv + silu: unsupported shape m=", m,
           " d_ff=", d_ff, " k=", k, " (needs m 1..", kGemvBulkSiluMaxM,
           ", k % 8 == 0, x and 8 two-row stages in shared memory)");
  DS_CHECK(cfg.rows_per_stage == 2 && gemv_bulk_fits(m, k, cfg), "bulk gemv + silu: config ",
           cfg.name(), " does not fit m=", m, " k=", k, " (needs 2 rows per stage)");
  DS_CHECK(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0,
           "bulk gemv + silu: x and w must be 16-byte aligned");
  DS_CHECK(act != nullptr, "bulk gemv + silu: null output");
  DS_CHECK(n_sms >= 1, "bulk gemv + silu: n_sms must be positive");
  DS_CHECK(cfg.l2_ahead >= 0 && (cfg.l2_ahead == 0 || m <= kGemvAheadMaxM),
           "bulk gemv + silu: l2_ahead is compiled for m 1..", kGemvAheadMaxM, " (got m=", m,
           ", l2_ahead ", cfg.l2_ahead, ")");
  switch (m) {
    case 1:
      launch_t<1, 2, bf16, true>(x, w, act, d_ff, k, false, cfg, n_sms, stream, nin);
      break;
    case 2:
      launch_t<2, 2, bf16, true>(x, w, act, d_ff, k, false, cfg, n_sms, stream, nin);
      break;
    case 3:
      launch_t<3, 2, bf16, true>(x, w, act, d_ff, k, false, cfg, n_sms, stream, nin);
      break;
    default:
      launch_t<4, 2, bf16, true>(x, w, act, d_ff, k, false, cfg, n_sms, stream, nin);
  }
  DS_CUDA_LAUNCH_CHECK();
}

// launch_gemv_bulk / launch_gemv_bulk_norm.
void bulk_impl(const bf16* x, const bf16* w, void* y, int m, int n, int k, GemmOut out,
               bool accumulate, const GemvBulkConfig& cfg, int n_sms, cudaStream_t stream,
               const GemvNormIn& nin, const GemvL2Next& next, const GemvSignal& sig = {}) {
  DS_CHECK(gemv_bulk_supports(m, n, k), "bulk gemv: unsupported shape m=", m, " n=", n, " k=", k,
           " (needs m 1..", kGemvBulkMaxM,
           ", k % 8 == 0, x and 8 one-row stages in shared memory)");
  DS_CHECK(gemv_bulk_fits(m, k, cfg), "bulk gemv: config ", cfg.name(), " does not fit m=", m,
           " k=", k, " (rows 1 or 2, partial sums 1, or 4 at m 1, slots a multiple of 8 up to ",
           kMaxSlots,
           ", shared memory <= ", kMaxSmem, " bytes)");
  DS_CHECK(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0,
           "bulk gemv: x and w must be 16-byte aligned");
  DS_CHECK(y != nullptr, "bulk gemv: null output");
  DS_CHECK(n_sms >= 1, "bulk gemv: n_sms must be positive");
  const GemvL2Next nx = checked_next(next);
  DS_CHECK(nx.rows == 0 || m <= kGemvL2NextMaxM, "bulk gemv: the L2 prefetch of a later GEMV is "
           "compiled for m <= ", kGemvL2NextMaxM, ", got m=", m);
  DS_CHECK(cfg.l2_ahead >= 0 && (cfg.l2_ahead == 0 || (m <= kGemvAheadMaxM &&
                                                        out == GemmOut::kBF16 && nx.rows == 0)),
           "bulk gemv: l2_ahead is compiled for m 1..", kGemvAheadMaxM,
           ", bf16 out and no L2 prefetch of a later GEMV (got m=", m, ", l2_ahead ",
           cfg.l2_ahead, ")");
  if (sig.counter != nullptr) {
    DS_CHECK(gemv_bulk_signal_supported(m, cfg) && nin.weight != nullptr &&
                 out == GemmOut::kBF16 && !accumulate && nx.rows == 0,
             "bulk gemv: the early-rows signal is compiled for m 1, one-row stages, fewer than ",
             kMaxSlots, " slots, the interleaved sweep, the fused norm, bf16 out, no accumulate "
             "and no L2 prefetch (got m=", m, ", config ", cfg.name(),
             nin.weight ? "" : ", no norm", ")");
    DS_CHECK(sig.first_row >= 0 && sig.first_row < n && sig.rows >= 1 && sig.rows <= n,
             "bulk gemv: the early-rows signal needs 0 <= first_row < n and 1 <= rows <= n (n=", n,
             " first_row=", sig.first_row, " rows=", sig.rows, ")");
    DS_CHECK((reinterpret_cast<uintptr_t>(sig.counter) & 3) == 0,
             "bulk gemv: the early-rows counter must be 4-byte aligned");
  }
  const bool a = accumulate;
  switch (m) {
    case 1: launch_m<1>(x, w, y, n, k, out, a, cfg, n_sms, stream, nin, nx, sig); break;
    case 2: launch_m<2>(x, w, y, n, k, out, a, cfg, n_sms, stream, nin, nx, {}); break;
    case 3: launch_m<3>(x, w, y, n, k, out, a, cfg, n_sms, stream, nin, nx, {}); break;
    case 4: launch_m<4>(x, w, y, n, k, out, a, cfg, n_sms, stream, nin, nx, {}); break;
    case 5: launch_m<5>(x, w, y, n, k, out, a, cfg, n_sms, stream, nin, nx, {}); break;
    case 6: launch_m<6>(x, w, y, n, k, out, a, cfg, n_sms, stream, nin, nx, {}); break;
    case 7: launch_m<7>(x, w, y, n, k, out, a, cfg, n_sms, stream, nin, nx, {}); break;
    default: launch_m<8>(x, w, y, n, k, out, a, cfg, n_sms, stream, nin, nx, {}); break;
  }
  DS_CUDA_LAUNCH_CHECK();
}

// ---- The decode MLP in one persistent kernel (gemv_mlp_norm; session 23, built without a device)
// act = bf16(silu(g) * u) with [g | u] = rmsnorm(residual + delta) [W_gate | W_up]^T, then
// y = act W_down^T: the fused-norm gate_up GEMV (gemv_bulk_kernel<M, 2, GLU, bf16, NORM>) and
// the down projection (gemv_narrow_kernel<M, bf16>) as two phases of one grid of one block per SM.
// kMixer adds the mixer's out-projection before them: delta = x0 W0^T (gdn_out / attn_o, as
// gemv_bulk_kernel<M, 1, false, bf16, false> computes each row), written to norm.delta.
// Why: between two GEMV kernels each SM's weight stream stops (the old block drains its ring and
// exits, the new one launches and issues its first copies): 2-6 us of each decode GEMV's advance
// above its bytes at batch 1 (decode_kernels.md, session 23). Here the producer warp streams every
// phase's stages into one ring, each right behind the one before, so the stream does not stop at
// a phase change; the consumers meet at a grid barrier before they read what the phase before
// wrote (delta, act).
// Each output's arithmetic is its kernel's: the out-projection's rows and the gate / up dot
// products as gemv_bulk_kernel's (lane l sums the 16-byte vectors l, l + 32, ... in order, xor
// butterfly; GLU: bf16 of each, silu), the fused norm prologue (norm_to_shared), and the down
// projection per slice as gemv_narrow_kernel's (the same slices, per-slice sums, butterfly, slices
// summed in order): delta, act, y and residual_out are the kernels' bits. Stage sizes differ (a
// row of W0; a gate row and an up row; kMlpSlicesPerStage slices of a down row); every slot holds
// the largest.
constexpr int kMlpSlicesPerStage = 2;
constexpr int kMlpSlots = 8;  // multiple of the 8 consumer warps: a slot stays with its warp

// Grid barrier of one launch site, thread 0 of each block (the caller syncs its block around it):
// bar[0] counts arrivals, bar[1] is the generation, which the last arriver sets to `target` after
// resetting the count. Each launch reads the generation g0 after its PDL wait, and its u-th
// barrier waits for g0 + u, so consecutive barriers and launches on one stream cannot mix.
// Watchdog (the kernel ran on no GPU when written): after 2^26 polls (~6 s and more: each sleeps
// 64 ns at least) the waiting thread traps, so a miscounted barrier fails the launch with an
// error instead of hanging the decode step's stream.
__device__ __forceinline__ void mlp_grid_barrier(unsigned* bar, unsigned target) {
  __threadfence();  // the block's writes (ordered before by the caller's barrier), then arrive
  if (atomicAdd(bar, 1u) == gridDim.x - 1) {
    atomicExch(bar, 0u);
    __threadfence();
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 1), "r"(target) : "memory");
  } else {
    for (uint32_t polls = 0; load_acquire(bar + 1) != target;) {
      __nanosleep(64);
      if (++polls == (1u << 26)) asm volatile("trap;");
    }
  }
  __threadfence();
}

// gemv_bulk_kernel's consumer arithmetic for one stage of R rows of k elements at ws against the
// M rows of x at xs: lane l sums the 16-byte vectors l, l + 32, ... in order (fp32 FMAs), then
// (mlp_butterfly) the warp's xor butterfly leaves every lane with the full sums. (gemv_bulk_kernel
// keeps its own copy of the loop: calling this there changes 56 of its instantiations' register
// allocation and order, and the shipped kernels stay .text-identical until a device re-measures
// them.)
template <int M, int R>
__device__ __forceinline__ void mlp_dot_rows(const bf16* ws, const bf16* xs, int k, int lane,
                                             float (&acc)[M][R]) {
#pragma unroll
  for (int t = 0; t < M; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] = 0.f;
  const int nv = k / 8;
#pragma unroll 2
  for (int v = lane; v < nv; v += 32) {
    float wf[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r)  // rows past the stage's last read stale memory, never stored
      unpack8(*reinterpret_cast<const uint4*>(ws + size_t(r) * k + size_t(v) * 8), wf[r]);
#pragma unroll
    for (int t = 0; t < M; ++t) {
      float xf[8];
      unpack8(*reinterpret_cast<const uint4*>(xs + size_t(t) * k + size_t(v) * 8), xf);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[t][r] = fmaf(wf[r][e], xf[e], acc[t][r]);
    }
  }
}
template <int M, int R>
__device__ __forceinline__ void mlp_butterfly(float (&acc)[M][R]) {
#pragma unroll
  for (int t = 0; t < M; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[t][r] += __shfl_xor_sync(0xffffffffu, acc[t][r], o);
}

template <int M, bool kMixer, bool kNext>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_mlp_norm_kernel(const GemvNormIn norm, const GemvMlpMixer mix, const GemvMlpNext next,
                         const bf16* __restrict__ w_gu,    // [2 d_ff, k]
                         bf16* act,                        // [M, d_ff]: written, then read back
                         const bf16* __restrict__ w_down,  // [n, d_ff]
                         bf16* y,  // [M, n]; may be norm.delta (written after the barrier)
                         int d_ff, int k, int n, int slice, int n_slices, int slot_elems,
                         bool interleave, unsigned* grid_bar) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMlpSlots;
  bf16* x0s = reinterpret_cast<bf16*>(smem + kBarBytes);  // [M, k0] (kMixer)
  bf16* xs = x0s + (kMixer ? size_t(M) * mix.k0 : 0);     // [M, k]: the normed input
  bf16* as = xs + size_t(M) * k;                          // [M, d_ff]: act, after the barrier
  bf16* ring = as + size_t(M) * d_ff;                     // [slots, slot_elems]
  float* red = reinterpret_cast<float*>(ring + size_t(kMlpSlots) * slot_elems);
  float* part = red + kRedBytes / 4;  // [rows of down, n_slices, M]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int G = gridDim.x, b = blockIdx.x;
  // Phase 0 (kMixer): stage s = row row0(s) of W0 (k rows).
  const int o_begin = interleave ? 0 : int(int64_t(k) * b / G);
  const int n_0 = !kMixer ? 0
                  : interleave ? max(0, (k - b + G - 1) / G)
                               : int(int64_t(k) * (b + 1) / G) - o_begin;
  auto row0 = [&](int s) { return interleave ? b + s * G : o_begin + s; };
  // Phase A (gate_up): stage s = gate row j and up row d_ff + j, j = rowA(s).
  const int a_begin = interleave ? 0 : int(int64_t(d_ff) * b / G);
  const int n_a = interleave ? max(0, (d_ff - b + G - 1) / G)
                             : int(int64_t(d_ff) * (b + 1) / G) - a_begin;
  auto rowA = [&](int s) { return interleave ? b + s * G : a_begin + s; };
  // Phase B (down): local row r = global row rowB(r), kMlpSlicesPerStage slices per stage.
  const int b_begin = int(int64_t(n) * b / G);
  const int n_rows_b = interleave ? max(0, (n - b + G - 1) / G)
                                  : int(int64_t(n) * (b + 1) / G) - b_begin;
  auto rowB = [&](int r) { return interleave ? b + r * G : b_begin + r; };
  const int pairs = (n_slices + kMlpSlicesPerStage - 1) / kMlpSlicesPerStage;
  const int n_b = n_rows_b * pairs;
  // Phase C (kNext): the next layer's in-projection, stages of two consecutive rows of W_in
  // (contiguous per block, or interleaved over the grid; each row's sums do not depend on how
  // many rows a stage holds, so they are the engine's R = 1 gemv_bulk_kernel's).
  const int c_pairs = kNext ? (next.n + 1) / 2 : 0;
  const int c_begin = interleave ? 0 : int(int64_t(c_pairs) * b / G);
  const int n_c = !kNext ? 0
                  : interleave ? max(0, (c_pairs - b + G - 1) / G)
                               : int(int64_t(c_pairs) * (b + 1) / G) - c_begin;
  auto rowC = [&](int s) { return 2 * (interleave ? b + s * G : c_begin + s); };
  // Global stage g: [0, a0) phase 0, [a0, b0) phase A, [b0, c0) phase B, [c0, n_total) phase C.
  const int a0 = n_0, b0 = n_0 + n_a, c0 = b0 + n_b, n_total = c0 + n_c;
  // Warp w takes the stages g = w (mod 8) of each phase: the first one at or after g0.
  auto first_of = [&](int g0) {
    return g0 + ((warp - g0) % kConsumerWarps + kConsumerWarps) % kConsumerWarps;
  };

  if (threadIdx.x == 0) init_ring_barriers(full, empty, kMlpSlots);
  __syncthreads();

  const bool producer = warp == kConsumerWarps;
  uint64_t policy = 0;
  auto issue = [&](int g) {
    const int slot = g % kMlpSlots;
    bf16* dst = ring + size_t(slot) * slot_elems;
    if (g < a0) {
      const uint32_t bytes = uint32_t(mix.k0) * 2u;
      mbar_arrive_expect_tx(&full[slot], bytes);
      bulk_copy(dst, mix.w0 + size_t(row0(g)) * mix.k0, bytes, &full[slot], policy);
    } else if (g < b0) {
      const int j = rowA(g - a0);
      const uint32_t bytes = uint32_t(k) * 2u;
      mbar_arrive_expect_tx(&full[slot], 2 * bytes);
      bulk_copy(dst, w_gu + size_t(j) * k, bytes, &full[slot], policy);
      bulk_copy(dst + k, w_gu + size_t(d_ff + j) * k, bytes, &full[slot], policy);
    } else if (g < c0) {
      const int q = g - b0, row = rowB(q / pairs);
      const int k0 = (q % pairs) * kMlpSlicesPerStage * slice;
      const uint32_t bytes = uint32_t(min(kMlpSlicesPerStage * slice, d_ff - k0)) * 2u;
      mbar_arrive_expect_tx(&full[slot], bytes);
      bulk_copy(dst, w_down + size_t(row) * d_ff + k0, bytes, &full[slot], policy);
    } else {
      const int r0 = rowC(g - c0);
      const uint32_t bytes = uint32_t(min(2, next.n - r0)) * uint32_t(k) * 2u;
      mbar_arrive_expect_tx(&full[slot], bytes);
      bulk_copy(dst, next.w + size_t(r0) * k, bytes, &full[slot], policy);
    }
  };
  // Every weight is a model weight: stream from the start, before the wait.
  if (producer && lane == 0) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int g = 0; g < min(kMlpSlots, n_total); ++g) issue(g);
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  uint4 norm_w[kNormVec], next_w[kNormVec];
  if (norm.weight_early) norm_weight_regs(norm, k, norm_w);
  if constexpr (kNext)
    if (next.norm.weight_early) norm_weight_regs(next.norm, k, next_w);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // The barrier's generation before this launch's first barrier. Read after the wait: a launch
  // before this one on the same barrier (the kernel this one depends on) has then finished.
  const unsigned gen0 = threadIdx.x == 0 ? load_acquire(grid_bar + 1) : 0u;
  if constexpr (kMixer) {  // x0 -> shared memory (gemv_bulk_kernel's copy), after the wait
    const uint4* xv = reinterpret_cast<const uint4*>(mix.x0);
    uint4* xd = reinterpret_cast<uint4*>(x0s);
    const int nv0 = M * mix.k0 / 8;
    for (int i = threadIdx.x; i < nv0; i += kThreads) xd[i] = xv[i];
  } else {
    if (!norm.weight_early) norm_weight_regs(norm, k, norm_w);
    norm_to_shared<M>(norm, k, xs, red, norm_w);
  }
  __syncthreads();

  if (producer) {
    if (lane == 0)
      for (int g = kMlpSlots; g < n_total; ++g) {
        const int slot = g % kMlpSlots;
        mbar_wait(&empty[slot], uint32_t((g / kMlpSlots) - 1) & 1u);
        issue(g);
      }
    return;
  }
  constexpr int kConsumerThreads = kConsumerWarps * 32;
  auto consumers_sync = [] { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory"); };
  auto grid_sync = [&](unsigned u) {
    consumers_sync();
    if (threadIdx.x == 0) mlp_grid_barrier(grid_bar, gen0 + u);
    consumers_sync();
  };

  if constexpr (kMixer) {
    // Phase 0: gemv_bulk_kernel's consumer (R = 1, no GLU), delta rows to global memory.
    for (int g = warp; g < a0; g += kConsumerWarps) {
      const int slot = g % kMlpSlots;
      mbar_wait(&full[slot], uint32_t(g / kMlpSlots) & 1u);
      float acc[M][1];
      mlp_dot_rows<M, 1>(ring + size_t(slot) * slot_elems, x0s, mix.k0, lane, acc);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
      mlp_butterfly(acc);
#pragma unroll
      for (int t = 0; t < M; ++t)
        if (lane == t) mix.y0[size_t(t) * k + row0(g)] = __float2bfloat16(acc[t][0]);
    }
    // Every block's delta rows are written before any block's norm reads them.
    grid_sync(1);
    if (!norm.weight_early) norm_weight_regs(norm, k, norm_w);
    norm_to_shared<M, true>(norm, k, xs, red, norm_w);
    consumers_sync();  // xs complete
  }

  // Phase A: gemv_bulk_kernel's GLU consumer (R = 2), act rows to global memory.
  for (int g = first_of(a0); g < b0; g += kConsumerWarps) {
    const int slot = g % kMlpSlots;
    mbar_wait(&full[slot], uint32_t(g / kMlpSlots) & 1u);
    float acc[M][2];
    mlp_dot_rows<M, 2>(ring + size_t(slot) * slot_elems, xs, k, lane, acc);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
    mlp_butterfly(acc);
#pragma unroll
    for (int t = 0; t < M; ++t)
      if (lane == t) {
        const float gg = __bfloat162float(__float2bfloat16(acc[t][0]));
        const float u = __bfloat162float(__float2bfloat16(acc[t][1]));
        act[size_t(t) * d_ff + rowA(g - a0)] = __float2bfloat16_rn(silu(gg) * u);
      }
  }

  // Every block's act rows are written before any block reads act.
  grid_sync(kMixer ? 2 : 1);
  {  // act -> shared memory, through L2 (other SMs wrote it)
    const uint4* av = reinterpret_cast<const uint4*>(act);
    uint4* ad = reinterpret_cast<uint4*>(as);
    const int n4 = M * d_ff / 8;
    for (int i = threadIdx.x; i < n4; i += kConsumerThreads) ad[i] = __ldcg(av + i);
  }
  consumers_sync();

  // Phase B: gemv_narrow_kernel's consumer, kMlpSlicesPerStage slices per stage.
  for (int g = first_of(b0); g < c0; g += kConsumerWarps) {
    const int slot = g % kMlpSlots;
    const int q = g - b0, lr = q / pairs, cs = (q % pairs) * kMlpSlicesPerStage;
    mbar_wait(&full[slot], uint32_t(g / kMlpSlots) & 1u);
    const bf16* ws0 = ring + size_t(slot) * slot_elems;
    float sums[kMlpSlicesPerStage][M];
#pragma unroll
    for (int cc = 0; cc < kMlpSlicesPerStage; ++cc) {
      const int c = cs + cc;
#pragma unroll
      for (int t = 0; t < M; ++t) sums[cc][t] = 0.f;
      if (c >= n_slices) continue;
      const int k0 = c * slice;
      float acc[M];
      narrow_slice_dot<M>(ws0 + size_t(cc) * slice, as + k0, d_ff, min(slice, d_ff - k0) / 8, lane,
                          acc);
#pragma unroll
      for (int t = 0; t < M; ++t) sums[cc][t] = acc[t];
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);  // every lane's reads of the slot are done
#pragma unroll
    for (int cc = 0; cc < kMlpSlicesPerStage; ++cc) {
      const int c = cs + cc;
      if (c >= n_slices) continue;
#pragma unroll
      for (int t = 0; t < M; ++t) {
        const float v = warp_sum(sums[cc][t]);
        if (lane == t) part[(size_t(lr) * n_slices + c) * M + t] = v;
      }
    }
  }
  consumers_sync();
  const int n_out = n_rows_b * M;
  for (int i = threadIdx.x; i < n_out; i += kConsumerThreads) {
    const int r = i / M, t = i - r * M;
    const float* p = part + size_t(r) * n_slices * M + t;
    float sum = p[0];
    for (int c = 1; c < n_slices; ++c) sum += p[size_t(c) * M];
    y[size_t(t) * n + rowB(r)] = __float2bfloat16(sum);
  }
  if constexpr (!kNext) return;

  // Phase C: the next layer's input norm of (residual_out + y) and its in-projection, as
  // gemv_bulk_kernel<M, R, false, bf16, NORM> computes them (any R: rows are independent).
  // Every block's y rows are written before any block's norm reads them.
  grid_sync(kMixer ? 3 : 2);
  if (!next.norm.weight_early) norm_weight_regs(next.norm, k, next_w);
  norm_to_shared<M, true>(next.norm, k, xs, red, next_w);
  consumers_sync();  // xs complete
  for (int g = first_of(c0); g < n_total; g += kConsumerWarps) {
    const int slot = g % kMlpSlots;
    const int r0 = rowC(g - c0), rows = min(2, next.n - r0);
    mbar_wait(&full[slot], uint32_t(g / kMlpSlots) & 1u);
    float acc[M][2];
    mlp_dot_rows<M, 2>(ring + size_t(slot) * slot_elems, xs, k, lane, acc);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
    mlp_butterfly(acc);
#pragma unroll
    for (int t = 0; t < M; ++t)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (lane == t * 2 + r && r < rows)
          next.y[size_t(t) * next.n + r0 + r] = __float2bfloat16(acc[t][r]);
  }
}

// Shared memory of gemv_mlp_norm_kernel (k0: the mixer form's W0 row length, 0 without).
size_t mlp_smem_bytes(int m, int d_ff, int k, int n, int k0, int G) {
  const int slice = gemv_narrow_slice_len(d_ff), n_slices = gemv_narrow_slices(d_ff);
  const size_t slot_elems =
      std::max<size_t>({size_t(2) * k, size_t(kMlpSlicesPerStage) * slice, size_t(k0)});
  const size_t rows_cap = (size_t(n) + G - 1) / G;
  return size_t(kBarBytes) + size_t(m) * k0 * 2 + size_t(m) * k * 2 + size_t(m) * d_ff * 2 +
         size_t(kMlpSlots) * slot_elems * 2 + kRedBytes + rows_cap * n_slices * m * 4;
}

// The fused MLP's launch (m = 1: the batch-1 decode step; the grid is one block per SM, all of
// which must be resident at once for the grid barrier: checked with the occupancy API once per
// device and shared-memory size).
void mlp_impl(const GemvNormIn& norm, const GemvMlpMixer& mix, const GemvMlpNext& next,
              const bf16* w_gu, bf16* act, const bf16* w_down, bf16* y, int m, int d_ff, int k,
              int n, bool pdl, unsigned* grid_bar, int n_sms, cudaStream_t stream) {
  const bool mixer = mix.w0 != nullptr, has_next = next.w != nullptr;
  DS_CHECK(gemv_mlp_norm_supports(m, d_ff, k, n, mixer ? mix.k0 : 0, n_sms,
                                  has_next ? next.n : 0),
           "fused MLP GEMV: unsupported shape m=", m, " d_ff=", d_ff, " k=", k, " n=", n,
           mixer ? " k0=" : "", mixer ? std::to_string(mix.k0) : std::string(), " on ", n_sms,
           " SMs");
  DS_CHECK(grid_bar != nullptr && (reinterpret_cast<uintptr_t>(grid_bar) & 7) == 0,
           "fused MLP GEMV: needs an 8-byte aligned grid barrier (2 zeroed words)");
  DS_CHECK(((reinterpret_cast<uintptr_t>(w_gu) | reinterpret_cast<uintptr_t>(w_down) |
             reinterpret_cast<uintptr_t>(act) | reinterpret_cast<uintptr_t>(y)) &
            15) == 0,
           "fused MLP GEMV: weights, act and y must be 16-byte aligned");
  if (mixer) {
    DS_CHECK(mix.x0 != nullptr && ((reinterpret_cast<uintptr_t>(mix.x0) |
                                    reinterpret_cast<uintptr_t>(mix.w0)) & 15) == 0,
             "fused MLP GEMV: the out-projection's x0 and W0 must be 16-byte aligned");
    DS_CHECK(mix.y0 != nullptr && mix.y0 == norm.delta,
             "fused MLP GEMV: the out-projection's output must be the norm's delta (y0 == delta)");
  }
  gemv_mlp_norm_check_buffers(norm, mix, next, act, y, m, d_ff, k, n);
  GemvBulkConfig cfg{2, kMlpSlots, false};  // for check_norm's shared-memory test only
  check_norm(norm, m, k, cfg, "fused MLP GEMV");
  if (has_next) {
    // Form 3 comes with the out-projection (the engine's only use of it; the kernel is not built
    // for the next in-projection alone).
    DS_CHECK(mixer && next.n >= 1, "fused MLP GEMV: the next in-projection needs the mixer's "
             "out-projection and at least one row");
    check_norm(next.norm, m, k, cfg, "fused MLP GEMV (next in-projection)");
    DS_CHECK(next.norm.residual == norm.residual_out && next.norm.delta == y &&
                 norm.residual_out != nullptr,
             "fused MLP GEMV: the next layer's norm must add y to the MLP norm's residual_out");
    DS_CHECK(next.y != nullptr && ((reinterpret_cast<uintptr_t>(next.w) |
                                    reinterpret_cast<uintptr_t>(next.y)) & 15) == 0,
             "fused MLP GEMV: the next in-projection's weight and output must be 16-byte aligned");
  }
  auto* kern = !mixer   ? gemv_mlp_norm_kernel<1, false, false>
              : has_next ? gemv_mlp_norm_kernel<1, true, true>
                         : gemv_mlp_norm_kernel<1, true, false>;
  ensure_smem_optin(reinterpret_cast<const void*>(kern), kMaxSmem);
  const size_t smem = mlp_smem_bytes(m, d_ff, k, n, mixer ? mix.k0 : 0, n_sms);
  {
    int dev = 0, sms = 0;
    DS_CUDA_CHECK(cudaGetDevice(&dev));
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    static std::mutex mu;
    static std::map<std::tuple<int, size_t, const void*>, int> per_sm;  // -> blocks per SM
    const std::lock_guard<std::mutex> lock(mu);
    const void* kp = reinterpret_cast<const void*>(kern);
    auto it = per_sm.find({dev, smem, kp});
    if (it == per_sm.end()) {
      int bl = 0;
      DS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bl, kern, kThreads, smem));
      it = per_sm.emplace(std::make_tuple(dev, smem, kp), bl).first;
    }
    // The grid barrier needs all n_sms blocks resident at once.
    DS_CHECK(it->second >= 1 && n_sms <= sms * it->second, "fused MLP GEMV: ", n_sms,
             " blocks cannot all be resident (", sms, " SMs, ", it->second, " per SM)");
  }
  const int slice = gemv_narrow_slice_len(d_ff), n_slices = gemv_narrow_slices(d_ff);
  const int slot_elems =
      std::max({2 * k, kMlpSlicesPerStage * slice, mixer ? mix.k0 : 0});
  launch_maybe_pdl(kern, dim3(n_sms), dim3(kThreads), smem, stream, pdl, norm, mix, next, w_gu,
                   act, w_down, y, d_ff, k, n, slice, n_slices, slot_elems,
                   gemv_interleave_bulk(), grid_bar);
  DS_CUDA_LAUNCH_CHECK();
}

// ---- lm_head with the greedy argmax in its epilogue (gemv_bulk_argmax; session 27, built without a
// device). y = x w^T in fp32 exactly as gemv_bulk_kernel<M, R, false, float, false> computes it
// with one partial sum per lane (mlp_dot_rows + mlp_butterfly: the same loop and butterfly), and
// tokens[t] = greedy_token(y[t]) without a second kernel re-reading the logits: every stage's
// outputs go into the warp's running maximum of argmax_key(value, row) (argmax_key.h: larger value,
// then lower row; NaN / +inf the largest key), the 8 consumer warps fold theirs into the block's
// (shared atomicMax), the block's last warp folds the block's into the grid's (global atomicMax on
// ws.keys), and the grid's last block turns each row's key into its token and zeroes the keys and
// the counter for the next launch. The maximum does not depend on the order of any of this, so the
// token is greedy_token's whatever the timing. Every access to the workspace follows
// griddepcontrol.wait: a launch that is a programmatic dependent of the one before (the same
// workspace) starts its atomics only after that one has finished.
// NORM: x = rmsnorm(residual + delta) computed in the prologue (norm_to_shared, the fused norm of
// gemv_bulk_kernel<.., NORM>: the same bits as add_rmsnorm; block 0 writes residual_out), so at
// decode the final norm, the lm-rows gather, lm_head and the argmax are one kernel.
constexpr int kArgmaxSmemBytes = 8 * kGemvBulkArgmaxMaxM + 8;  // the block's keys + its counter
template <int M, int R, bool NORM>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_bulk_argmax_kernel(const bf16* x,  // [M, k] (unused with NORM); read after the wait
                            const bf16* __restrict__ w,  // [n, k]
                            float* __restrict__ y,       // [M, n]
                            int n, int k, int slots, bool interleave, int32_t* tokens,
                            unsigned long long* keys,  // [M] grid's keys, zero between launches
                            unsigned* done,            // blocks finished, zero between launches
                            const GemvNormIn norm) {   // NORM only
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxSlots;
  bf16* xs = reinterpret_cast<bf16*>(smem + kBarBytes);
  bf16* ring = xs + size_t(M) * k;
  // After the ring (16-byte aligned: k % 8 == 0): the norm's warp sums (NORM), then the block's
  // key per row and its warps' count.
  float* red = reinterpret_cast<float*>(ring + size_t(slots) * R * k);
  unsigned long long* bkey =
      reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(red) + (NORM ? kRedBytes : 0));
  unsigned* bdone = reinterpret_cast<unsigned*>(bkey + M);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int G = gridDim.x, b = blockIdx.x;
  const int row_begin = interleave ? 0 : int(int64_t(n) * b / G);
  const int row_end = interleave ? n : int(int64_t(n) * (b + 1) / G);
  const int total_stages = (n + R - 1) / R;
  const int n_stages = interleave ? max(0, (total_stages - b + G - 1) / G)
                                  : (row_end - row_begin + R - 1) / R;
  auto stage_row = [&](int s) { return interleave ? (b + s * G) * R : row_begin + s * R; };
  const size_t stage_elems = size_t(R) * k;

  if (threadIdx.x == 0) {
    init_ring_barriers(full, empty, slots);
#pragma unroll
    for (int t = 0; t < M; ++t) bkey[t] = kArgmaxKeyNone;
    *bdone = 0u;
  }
  __syncthreads();

  const bool producer = warp == kConsumerWarps;
  uint64_t policy = 0;
  auto issue = [&](int s) {
    const int slot = s % slots;
    const int r0 = stage_row(s);
    const uint32_t bytes = uint32_t(min(R, row_end - r0)) * uint32_t(k) * 2u;
    mbar_arrive_expect_tx(&full[slot], bytes);
    bulk_copy(ring + slot * stage_elems, w + size_t(r0) * k, bytes, &full[slot], policy);
  };
  if (producer && lane == 0) {  // the weights first, before the wait (gemv_bulk_kernel's order)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int s = 0; s < min(slots, n_stages); ++s) issue(s);
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  uint4 norm_w[kNormVec];  // NORM: the norm weight, a model weight (no wait needed)
  if constexpr (NORM) {
    if (norm.weight_early) norm_weight_regs(norm, k, norm_w);
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  x_to_shared<M, NORM>(x, norm, k, xs, red, norm_w);
  __syncthreads();

  if (producer) {
    if (lane == 0)
      for (int s = slots; s < n_stages; ++s) {
        const int slot = s % slots;
        mbar_wait(&empty[slot], uint32_t((s / slots) - 1) & 1u);
        issue(s);
      }
    return;
  }

  unsigned long long best[M];
#pragma unroll
  for (int t = 0; t < M; ++t) best[t] = kArgmaxKeyNone;
  for (int s = warp; s < n_stages; s += kConsumerWarps) {
    const int slot = s % slots;
    const int r0 = stage_row(s);
    const int rows = min(R, row_end - r0);
    mbar_wait(&full[slot], uint32_t(s / slots) & 1u);
    float acc[M][R];
    mlp_dot_rows<M, R>(ring + slot * stage_elems, xs, k, lane, acc);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);  // every lane's reads of the slot are done
    mlp_butterfly<M, R>(acc);  // every lane holds every sum (the same bits in each lane)
#pragma unroll
    for (int t = 0; t < M; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r < rows) {
          if (lane == t * R + r) y[size_t(t) * n + r0 + r] = acc[t][r];
          best[t] = argmax_key_max(best[t], argmax_key(acc[t][r], uint32_t(r0 + r)));
        }
  }
  // Lane 0 does every step below (each lane holds the same keys): the warp's keys into the
  // block's, then it counts the warp in; the block's last warp folds the block's keys into the
  // grid's and counts the block in; the grid's last block writes the tokens and zeroes the
  // workspace. Each count follows a fence after the folds it reports, and each reader fences
  // after the count that told it it was last, all in one thread.
  if (lane != 0) return;
#pragma unroll
  for (int t = 0; t < M; ++t) atomicMax(&bkey[t], best[t]);
  __threadfence_block();
  if (atomicAdd(bdone, 1u) != kConsumerWarps - 1) return;
  __threadfence_block();
#pragma unroll
  for (int t = 0; t < M; ++t) atomicMax(&keys[t], atomicAdd(&bkey[t], 0ull));
  __threadfence();
  if (atomicAdd(done, 1u) != unsigned(G) - 1) return;
  __threadfence();
#pragma unroll
  for (int t = 0; t < M; ++t) tokens[t] = argmax_key_token(atomicExch(&keys[t], kArgmaxKeyNone));
  atomicExch(done, 0u);
}

size_t argmax_smem_bytes(int m, int k, const GemvBulkConfig& c, bool norm) {
  return smem_bytes(m, k, c.rows_per_stage, c.slots) + (norm ? kRedBytes : 0) + kArgmaxSmemBytes;
}

bool argmax_fits(int64_t m, int64_t k, const GemvBulkConfig& c, bool norm) {
  return m >= 1 && m <= kGemvBulkArgmaxMaxM && c.blocks_per_sm == 1 &&
         gemv_bulk_fits(m, k, c) && (!norm || k <= kGemvNormMaxK) &&
         argmax_smem_bytes(int(m), int(k), c, norm) <= size_t(kMaxSmem);
}

template <int M, int R>
void launch_argmax_t(const bf16* x, const bf16* w, float* y, int n, int k,
                     const GemvBulkConfig& c, int n_sms, int32_t* tokens, void* ws,
                     cudaStream_t stream, const GemvNormIn& norm) {
  const bool with_norm = norm.weight != nullptr;
  auto* kern =
      with_norm ? gemv_bulk_argmax_kernel<M, R, true> : gemv_bulk_argmax_kernel<M, R, false>;
  ensure_smem_optin(reinterpret_cast<const void*>(kern), kMaxSmem);
  const int blocks = std::max(1, std::min(n_sms, n));
  auto* keys = static_cast<unsigned long long*>(ws);
  auto* done = reinterpret_cast<unsigned*>(keys + kGemvBulkArgmaxMaxM);
  launch_maybe_pdl(kern, dim3(blocks), dim3(kThreads), argmax_smem_bytes(M, k, c, with_norm),
                   stream, c.pdl, x, w, y, n, k, c.slots, c.interleave, tokens, keys, done, norm);
}

}  // namespace

std::string GemvBulkConfig::name() const {
  std::ostringstream os;
  os << "r" << rows_per_stage << "s" << slots << (blocks_per_sm == 2 ? "b2" : "")
     << (pdl ? "-pdl" : "") << (interleave ? "-ilv" : "");
  if (l2_ahead > 0) os << "-a" << l2_ahead;
  return os.str();
}

namespace {
// A KiB budget from $var: digits only (no sign, no blanks), 0..kGemvAheadMaxKib; unset or empty:
// dflt.
int ahead_kib_from_env(const char* var, int dflt) {
  const char* e = std::getenv(var);
  const std::string v = e ? e : "";
  if (v.empty()) return dflt;
  size_t used = 0;
  int x = -1;
  try {
    if (v[0] >= '0' && v[0] <= '9') x = std::stoi(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DS_CHECK(used == v.size() && x >= 0 && x <= kGemvAheadMaxKib, var, " must be KiB in 0..",
           kGemvAheadMaxKib, ", got '", v, "'");
  return x;
}
}  // namespace

int gemv_ahead_kib_from_env() { return ahead_kib_from_env("DS_GEMV_AHEAD", kGemvAheadDefaultKib); }
int gemv_tma_ahead_kib_from_env() { return ahead_kib_from_env("DS_GEMV_TMA_AHEAD", 0); }

int gemv_bulk_ahead_stages(int kib, int k, const GemvBulkConfig& c, bool glu) {
  if (kib <= 0 || k <= 0) return 0;
  return gemv_ahead_stages_for(kib, int64_t(glu ? 2 : c.rows_per_stage) * k * 2);
}

namespace {
// $DS_GEMV_ILV, read once per process: bit 0 bulk, bit 1 narrow.
int interleave_mode() {
  static const int mode = [] {
    const char* e = std::getenv("DS_GEMV_ILV");
    const std::string v = e ? e : "";
    // Default on (both): session 12, same-call A/B, 3 measurements each, TPOT p50 at 1@4096 /
    // 2@4096 / 1@32768 -0.10 / -0.05 / -0.11 ms (docs/perf/decode_gemv.md).
    if (v == "0") return 0;
    if (v.empty() || v == "1" || v == "all") return 3;
    if (v == "bulk") return 1;
    DS_CHECK(v == "narrow", "DS_GEMV_ILV must be 0, 1 (= all), bulk or narrow, got '", v, "'");
    return 2;
  }();
  return mode;
}
}  // namespace

bool gemv_interleave_bulk() { return (interleave_mode() & 1) != 0; }
bool gemv_interleave_narrow() { return (interleave_mode() & 2) != 0; }

bool gemv_bulk_fits(int64_t m, int64_t k, const GemvBulkConfig& c) {
  return m >= 1 && m <= kGemvBulkMaxM && k >= 8 && k % 8 == 0 &&
         (c.rows_per_stage == 1 || c.rows_per_stage == 2) && c.slots >= kConsumerWarps &&
         c.slots <= kMaxSlots && c.slots % kConsumerWarps == 0 &&
         (c.blocks_per_sm == 1 || c.blocks_per_sm == 2) &&
         // 228 KB per SM, 1 KB of it reserved per block
         smem_bytes(int(m), int(k), c.rows_per_stage, c.slots) <=
             (c.blocks_per_sm == 1 ? size_t(kMaxSmem) : size_t(233472 / 2 - 1024));
}

bool gemv_bulk_norm_fits(int m, int k, const GemvBulkConfig& c) {
  return m >= 1 && m <= kGemvNormMaxM && k <= kGemvNormMaxK && gemv_bulk_fits(m, k, c) &&
         norm_smem_fits(m, k, c);
}

bool gemv_bulk_supports(int64_t m, int64_t n, int64_t k) {
  return n >= 1 && n <= kSkinnyMaxN && gemv_bulk_fits(m, k, {1, kConsumerWarps, false});
}

std::vector<GemvBulkConfig> gemv_bulk_configs(int m, int k) {
  std::vector<GemvBulkConfig> v;
  for (int r : {1, 2})
    for (int s : {8, 16, 24})
      if (gemv_bulk_fits(m, k, {r, s, false, 1})) v.push_back({r, s, false, 1});
  for (int r : {1, 2})
    if (gemv_bulk_fits(m, k, {r, 8, false, 2})) v.push_back({r, 8, false, 2});
  return v;
}

// $DS_GEMV_BULK_SLOTS (an experiment switch, read once per process): 8, 16 or 24 one-row stages
// for the m = 1 shapes instead of the tuned 16; 8 takes ~90 KB of shared memory at k 5120 (~110 KB
// at 6144), so two consecutive GEMVs' blocks can share an SM. 0 or unset: the tuned default.
// Slots are a multiple of the 8 consumer warps (gemv_bulk_fits); 24 fits no 27B shape at m = 1
// (245 KB at k 5120), so only 8 changes anything there.
static int bulk_slots_override() {
  static const int slots = [] {
    const char* e = std::getenv("DS_GEMV_BULK_SLOTS");
    const std::string v = e ? e : "";
    DS_CHECK(v.empty() || v == "0" || v == "8" || v == "16" || v == "24",
             "DS_GEMV_BULK_SLOTS must be 0, 8, 16 or 24, got '", v, "'");
    return v.empty() ? 0 : std::stoi(v);
  }();
  return slots;
}

GemvBulkConfig gemv_bulk_config(int m, int n, int k) {
  (void)n;
  // ~160 KB of weights in flight per SM. From the H200 sweep (cuda_gemv_test DS_GEMV_SWEEP=1,
  // 2026-11-29, us): m = 1: 16 one-row stages (gdn_in 43.22 vs 43.43 with 8, attn_qkv 38.51 vs
  // 38.98, gate_up 85.73 vs 84.97, lm_head 566.7 vs 568.0); m >= 2: 8 two-row stages where they
  // fit, x read once per two rows (gate_up m 2 87.04 vs 87.61, lm_head m 2 572.1 vs 575.9, m 4
  // 596.7 vs 731.5); else 16 or 8 one-row stages. Two blocks per SM never won (+0.2-1.5%).
  GemvBulkConfig c{1, 16, false};
  if (m >= 2 && gemv_bulk_fits(m, k, {2, 8, false})) c = {2, 8, false};
  if (m == 1 && bulk_slots_override() > 0 &&
      gemv_bulk_fits(m, k, {1, bulk_slots_override(), false}))
    c = {1, bulk_slots_override(), false};
  if (!gemv_bulk_fits(m, k, c)) c = {1, 8, false};
  c.interleave = gemv_interleave_bulk();
  return c;
}

bool gemv_bulk_preferred(int64_t m, int64_t n, int64_t k) {
  // Where it beat cuBLASLt tuned (top-12 algorithms timed, rotating weights) in the H200 sweep,
  // back-to-back launches without PDL, us (bulk vs cuBLASLt): m = 1: gate_up 85.7 vs 90.2,
  // gdn_in 43.2 vs 44.8, attn_qkv 38.5 vs 39.2, lm_head 566.7 vs 578.6; m = 2: gate_up 87.0 vs
  // 90.3, lm_head 572.1 vs 575.0. It lost on the narrow gdn_out / attn_o (5120 x 6144: 19.9 vs
  // 19.4 at m = 1), on gdn_in / attn_qkv from m = 2 (44.7 vs 43.7) and on every shape from m = 4.
  // k 4096..8192: the measured k (5120, 6144) and around; smaller models keep cuBLASLt.
  if (!gemv_bulk_supports(m, n, k) || k < 4096 || k > 8192) return false;
  return (m == 1 && n >= 12288) || (m == 2 && n >= 32768);
}

GemvPdl gemv_pdl_mode() {
  static const GemvPdl mode = [] {
    const char* e = std::getenv("DS_GEMV_PDL");
    const std::string v = e ? e : "";
    if (v == "0") return GemvPdl::kOff;
    if (v == "all") return GemvPdl::kAll;
    DS_CHECK(v.empty() || v == "1" || v == "bulk",
             "DS_GEMV_PDL must be 0, 1 (= bulk) or all, got '", v, "'");
    return GemvPdl::kBulk;
  }();
  return mode;
}

bool gemv_bulk_pdl_preferred(int64_t m, int64_t n, int64_t k) {
  // Launched alone the bulk kernel ties cuBLASLt on gdn_out / attn_o (5120 x 6144: 20.2 vs 20.2
  // us); back to back with PDL it took 17.7 us (gemv2 sweep, docs/perf/decode_gemv.md). Here the
  // kernel before it (gdn_decode, the attention decode merge) triggers its dependents early.
  if (gemv_pdl_mode() == GemvPdl::kOff) return false;
  if (!gemv_bulk_supports(m, n, k) || k < 4096 || k > 8192) return false;
  return m == 1 && n >= 4096 && n < 12288;
}

bool gemv_bulk_silu_supports(int64_t m, int64_t d_ff, int64_t k) {
  return m >= 1 && m <= kGemvBulkSiluMaxM && d_ff >= 1 && 2 * d_ff <= kSkinnyMaxN &&
         gemv_bulk_fits(m, k, {2, kConsumerWarps, false});
}

bool gemv_bulk_silu_preferred(int64_t m, int64_t d_ff, int64_t k) {
  // H200 sweep, 27B MLP (d_ff 17408, k 5120), us, fused vs cuBLASLt tuned + silu_mul: m 1 85.2 vs
  // 94.2, m 2 87.6 vs 94.2, m 3 91.1 vs 96.5, m 4 92.2 vs 94.4.
  return gemv_bulk_silu_supports(m, d_ff, k) && k >= 4096 && k <= 8192 && d_ff >= 8192;
}

GemvBulkConfig gemv_bulk_silu_config(int m, int d_ff, int k) {
  (void)d_ff, (void)k;
  GemvBulkConfig c{2, 8, false};
  c.interleave = gemv_interleave_bulk();
  return c;
}

void launch_gemv_bulk_silu(const __nv_bfloat16* x, const __nv_bfloat16* w_gate_up,
                           __nv_bfloat16* act, int m, int d_ff, int k, const GemvBulkConfig& cfg,
                           int n_sms, cudaStream_t stream) {
  silu_impl(x, w_gate_up, act, m, d_ff, k, cfg, n_sms, stream, GemvNormIn{});
}

void launch_gemv_bulk_silu_norm(const GemvNormIn& norm, const __nv_bfloat16* w_gate_up,
                                __nv_bfloat16* act, int m, int d_ff, int k,
                                const GemvBulkConfig& cfg, int n_sms, cudaStream_t stream) {
  check_norm(norm, m, k, cfg, "bulk gemv + silu");
  silu_impl(nullptr, w_gate_up, act, m, d_ff, k, cfg, n_sms, stream, norm);
}

void gemv_mlp_norm_check_buffers(const GemvNormIn& norm, const GemvMlpMixer& mix,
                                 const GemvMlpNext& next, const void* act, const void* y, int m,
                                 int d_ff, int k, int n) {
  // The blocks run the phases at their own pace between the grid barriers, so every buffer one
  // block writes must not overlap one another block may still read or write: all of them pairwise
  // disjoint, but y (the MLP output, written last) may be the norm's delta (the engine's one delta
  // buffer), which every block has read before any writes y, and the next norm's residual_out
  // (written in the last phase) may be the first norm's residual (the engine's residual pair),
  // which every block has read by then.
  struct Buf {
    const char* name;
    const void* p;
    size_t bytes;
  };
  const size_t mk = size_t(m) * k * 2;
  const Buf bufs[] = {
      {"residual", norm.residual,
       next.w && next.norm.residual_out == norm.residual ? 0 : mk},
      {"delta", norm.delta, norm.delta == y ? 0 : mk},  // y's range covers it when the same
      {"residual_out", norm.residual_out, mk},
      {"act", act, size_t(m) * d_ff * 2},
      {"y", y, size_t(m) * n * 2},
      {"x0", mix.w0 ? mix.x0 : nullptr, size_t(m) * mix.k0 * 2},
      {"next residual_out", next.w ? next.norm.residual_out : nullptr, mk},
      {"next y", next.w ? next.y : nullptr, size_t(m) * next.n * 2},
  };
  for (size_t i = 0; i < std::size(bufs); ++i)
    for (size_t j = i + 1; j < std::size(bufs); ++j) {
      const auto a = reinterpret_cast<uintptr_t>(bufs[i].p);
      const auto b = reinterpret_cast<uintptr_t>(bufs[j].p);
      DS_CHECK(!bufs[i].p || !bufs[j].p || bufs[i].bytes == 0 || bufs[j].bytes == 0 ||
                   a + bufs[i].bytes <= b || b + bufs[j].bytes <= a,
               "fused MLP GEMV: ", bufs[i].name, " and ", bufs[j].name, " overlap");
    }
}

bool gemv_mlp_norm_supports(int64_t m, int64_t d_ff, int64_t k, int64_t n, int64_t k0,
                            int n_sms, int64_t n_next) {
  if (n_next < 0 || n_next > kSkinnyMaxN) return false;
  if (m != 1 || n_sms < 1 || k < 8 || k % 8 != 0 || k > kGemvNormMaxK || d_ff < 8 ||
      d_ff % 8 != 0 || d_ff > kSkinnyMaxK || n < 1 || n > kSkinnyMaxN || d_ff < n_sms ||
      n < n_sms)
    return false;
  // the mixer form: W0 [k, k0] rows of whole 16-byte vectors, k rows over the grid
  if (k0 != 0 && (k0 < 8 || k0 % 8 != 0 || k0 > kSkinnyMaxK || k < n_sms)) return false;
  // every slice of a down row non-empty, as gemv_narrow_fits asks
  if (int64_t(gemv_narrow_slices(d_ff) - 1) * gemv_narrow_slice_len(d_ff) >= d_ff) return false;
  return mlp_smem_bytes(int(m), int(d_ff), int(k), int(n), int(k0), n_sms) <= size_t(kMaxSmem);
}

void launch_gemv_mlp_norm(const GemvNormIn& norm, const GemvMlpMixer& mixer,
                          const GemvMlpNext& next, const __nv_bfloat16* w_gate_up,
                          __nv_bfloat16* act, const __nv_bfloat16* w_down, __nv_bfloat16* y, int m,
                          int d_ff, int k, int n, bool pdl, unsigned* grid_bar, int n_sms,
                          cudaStream_t stream) {
  mlp_impl(norm, mixer, next, w_gate_up, act, w_down, y, m, d_ff, k, n, pdl, grid_bar, n_sms,
           stream);
}

void launch_gemv_bulk(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n, int k,
                      GemmOut out, bool accumulate, const GemvBulkConfig& cfg, int n_sms,
                      cudaStream_t stream, const GemvL2Next& next) {
  bulk_impl(x, w, y, m, n, k, out, accumulate, cfg, n_sms, stream, GemvNormIn{}, next);
}

void launch_gemv_bulk_norm(const GemvNormIn& norm, const __nv_bfloat16* w, void* y, int m, int n,
                           int k, GemmOut out, const GemvBulkConfig& cfg, int n_sms,
                           cudaStream_t stream, const GemvL2Next& next, const GemvSignal& sig) {
  check_norm(norm, m, k, cfg, "bulk gemv");
  bulk_impl(nullptr, w, y, m, n, k, out, false, cfg, n_sms, stream, norm, next, sig);
}

bool gemv_bulk_signal_supported(int m, const GemvBulkConfig& c) {
  return m == 1 && c.rows_per_stage == 1 && c.slots < kMaxSlots && c.interleave;
}

int gemv_bulk_grid(int n, const GemvBulkConfig& c, int n_sms) {
  return std::max(1, std::min(n_sms * c.blocks_per_sm, n));
}

int gemv_bulk_signal_count(int m, int n, int k, const GemvBulkConfig& c, int n_sms) {
  (void)m;
  (void)k;
  return gemv_bulk_grid(n, c, n_sms);  // one raise per block
}

bool gemv_bulk_argmax_supports(int64_t m, int64_t n, int64_t k, const GemvBulkConfig& c,
                               bool with_norm) {
  return n >= 1 && n <= kSkinnyMaxN && argmax_fits(m, k, c, with_norm);
}

namespace {
// launch_gemv_bulk_argmax / launch_gemv_bulk_argmax_norm (norm.weight null: x is the input).
void argmax_impl(const bf16* x, const bf16* w, float* y, int32_t* tokens, void* workspace, int m,
                 int n, int k, const GemvBulkConfig& cfg, int n_sms, cudaStream_t stream,
                 const GemvNormIn& norm) {
  const bool with_norm = norm.weight != nullptr;
  DS_CHECK(gemv_bulk_argmax_supports(m, n, k, cfg, with_norm), "bulk gemv + argmax: unsupported m=",
           m, " n=", n, " k=", k, " config ", cfg.name(), with_norm ? " with the norm" : "",
           " (needs m 1..", kGemvBulkArgmaxMaxM,
           ", one partial sum, one block per SM, k % 8 == 0, x, the ring",
           with_norm ? ", the norm's sums" : "", " and ", kArgmaxSmemBytes,
           " bytes of keys in shared memory)");
  DS_CHECK(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0,
           "bulk gemv + argmax: x and w must be 16-byte aligned");
  DS_CHECK(y != nullptr && tokens != nullptr, "bulk gemv + argmax: null logits or tokens");
  DS_CHECK(workspace != nullptr && (reinterpret_cast<uintptr_t>(workspace) & 7) == 0,
           "bulk gemv + argmax: needs an 8-byte aligned workspace of ",
           kGemvBulkArgmaxWorkspaceBytes, " zeroed bytes");
  DS_CHECK(n_sms >= 1, "bulk gemv + argmax: n_sms must be positive");
  DS_CHECK(cfg.l2_ahead == 0, "bulk gemv + argmax: l2_ahead is not compiled here");
  const bool r2 = cfg.rows_per_stage == 2;
  if (m == 1) {
    if (r2) launch_argmax_t<1, 2>(x, w, y, n, k, cfg, n_sms, tokens, workspace, stream, norm);
    else launch_argmax_t<1, 1>(x, w, y, n, k, cfg, n_sms, tokens, workspace, stream, norm);
  } else {
    if (r2) launch_argmax_t<2, 2>(x, w, y, n, k, cfg, n_sms, tokens, workspace, stream, norm);
    else launch_argmax_t<2, 1>(x, w, y, n, k, cfg, n_sms, tokens, workspace, stream, norm);
  }
  DS_CUDA_LAUNCH_CHECK();
}
}  // namespace

void launch_gemv_bulk_argmax(const __nv_bfloat16* x, const __nv_bfloat16* w, float* y,
                             int32_t* tokens, void* workspace, int m, int n, int k,
                             const GemvBulkConfig& cfg, int n_sms, cudaStream_t stream) {
  argmax_impl(x, w, y, tokens, workspace, m, n, k, cfg, n_sms, stream, GemvNormIn{});
}

void launch_gemv_bulk_argmax_norm(const GemvNormIn& norm, const __nv_bfloat16* w, float* y,
                                  int32_t* tokens, void* workspace, int m, int n, int k,
                                  const GemvBulkConfig& cfg, int n_sms, cudaStream_t stream) {
  check_norm(norm, m, k, cfg, "bulk gemv + argmax");
  argmax_impl(nullptr, w, y, tokens, workspace, m, n, k, cfg, n_sms, stream, norm);
}

bool gemv_norm_weight_early() {
  static const bool on = env_switch("DS_GEMV_NORM_EARLY", true);
  return on;
}

int gemv_l2_next_mib() {
  static const int mib = [] {
    const char* e = std::getenv("DS_GEMV_L2_NEXT");
    const std::string v = e ? e : "";
    if (v.empty()) return 0;
    size_t used = 0;
    int x = -1;
    try {
      x = std::stoi(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DS_CHECK(used == v.size() && x >= 0 && x <= 256,
             "DS_GEMV_L2_NEXT must be MiB in 0..256, got '", v, "'");
    return x;
  }();
  return mib;
}

int gemv_l2_next_rows(int n, int k, int grid) {
  const int64_t mib = gemv_l2_next_mib();
  if (mib == 0 || n < 1 || k < 1 || grid < 1) return 0;
  const int64_t per_block = (mib << 20) / (int64_t(grid) * k * 2);
  return int(std::min<int64_t>(per_block, (int64_t(n) + grid - 1) / grid));
}

}  // namespace ds::cuda
