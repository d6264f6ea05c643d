// Decode GEMV on tensor cores fed by 2-D TMA boxes: y[m, n] = x[m, k] w[n, k]^T for m = 1..16
// tokens (bf16 in, fp32 accumulation, bf16 or fp32 out, no accumulate), and the MLP's gate_up
// with SiLU-and-mul in the epilogue (act[m, d_ff] = bf16(silu(g) * u), g and u rounded to bf16
// first, bit for bit what the GEMM + launch_silu_mul give from the same sums). Built for batch
// 5..16 decode on the Qwen3.5-27B k = 5120 in-projections (gate_up 34816 x 5120, gdn_in 16480 x
// 5120, attn_qkv 14336 x 5120), where cuBLASLt tuned runs at 86-91% of the HBM read floor at m 16
// and the gate_up needs a second kernel for the SiLU (issue 6: batch 16 within 1.3x of batch 1).
// Interface, config and guard in gemv.h; on by default ($DS_GEMV_TMA=0 off, =silu gate_up only).
//
// Why a new kernel (gemv_bulk_mma.cu is the same arithmetic): its stages were (k-chunk, 16-row
// group) tiles made of 16 one-row 1-D bulk copies of 1-2 KiB, and the bulk-copy probe (session 8)
// measured such copies at 61-86% of the read ceiling, against 95% for stages of >= 16 KiB in few
// copies. Here a stage is ALL the rows a block owns over 64 k-elements, as two 2-D TMA boxes
// (cp.async.bulk.tensor.2d, 128-byte swizzle) of up to 192 rows x 128 bytes plus a box of x: one
// stage of ~16-36 KiB in 3 copies, and x never has to sit whole in shared memory (160 KiB at m 16).
//
// Method. One persistent block per SM (grid G = min(SMs, rows)) owns the contiguous outputs
// [n b / G, n (b + 1) / G) (GLU: the gate rows j and the up rows d_ff + j of those features).
// Box rows BR = ceil(outputs per block) (GLU) or ceil(rows per block / 2) (plain: box 0 = the
// block's first BR rows, box 1 the next BR; rows past the block's end are read, never stored; past
// the matrix TMA fills zeros). Stage s = k-elements [64 s, 64 s + 64): box 0, box 1 and x's box
// (m rows x 64; rows m..15 of every x slot are zeroed once: the MMA's padding tokens). A producer
// lane issues the weight boxes of the first `slots` stages before griddepcontrol.wait (L2
// evict-first), the x boxes after it; every stage completes on one mbarrier. The 8 consumer warps
// all read every stage: warp w owns the 8-row groups q = w, w + 8, w + 16 of both boxes, so its
// fp32 accumulators (two m16n8 fragments per q) stay in registers across k, and (GLU) the gate
// and up sums of a feature land in the same thread. Per 16-k step: ldmatrix.x4 of x (A: tokens as
// M, padded to 16 with the zero rows) and, per group and box, one ldmatrix.x4 covering two k-steps
// of its 8 rows (the .col B operand), then mma.sync.m16n8k16. A stage's slot is released by one
// arrival per consumer warp. Addresses follow the 128-byte swizzle: the 16-byte chunk c of row r
// of a box lies at r * 128 + ((c ^ (r % 8)) * 16) (boxes 1024-byte aligned).
// Wider stages (GemvTmaConfig::kbox 2 / 4, $DS_GEMV_TMA_KBOX; session 27, built without a
// device): a stage holds kbox such 64-k chunks (2 kbox weight boxes + kbox x boxes), so each row
// contributes 256 / 512 contiguous bytes per stage and a block has a half / a quarter of the
// stages; the consumers take the chunks in order.
// Summation order: every output is the sum over the k-steps 0, 16, 32, ... in order, one MMA
// each; it depends on k only, never on m, the slot count, kbox or the grid (an MMA's output row
// depends only on its own A row; the padding rows are zeros): batch-invariant and bit-identical
// across configs.
#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <type_traits>

#include "cuda/bulk_copy.cuh"
#include "cuda/cuda_common.h"
#include "cuda/gemv.h"
#include "cuda/mma_util.cuh"
#include "cuda/tma.h"

namespace ds::cuda {
namespace {

constexpr int kW = 8;                    // consumer warps
constexpr int kThreads = (kW + 1) * 32;  // + the producer warp
constexpr int kJ = 3;                    // 8-row groups per consumer warp per box
constexpr int kMaxBoxRows = kW * kJ * 8;  // 192
constexpr int kKc = 64;                  // k-elements per stage (one 128-byte swizzled row)
constexpr int kMaxSlots = 16;
constexpr int kHdrBytes = 1024;  // mbarriers; keeps the ring 1024-byte aligned
constexpr int kAlignSlack = 1024;  // the dynamic shared memory base is aligned up to 1024 bytes
constexpr int kMaxSmem = 232448;   // sm 90 opt-in dynamic shared memory per block
constexpr int kXBoxBytes = 16 * 128;  // x slot: 16 token rows x 64 k (rows >= m zero)
// The registry guard's assumed grid floor (it cannot see the device): H100 PCIe has 114 SMs, the
// H100 SXM / H200 132; the 27B gate_up needs ceil(17408 / grid) <= 192 features per block.
constexpr int kGuardMinSms = 100;

__host__ __device__ constexpr int pad8(int r) { return (r + 7) / 8 * 8; }
__host__ __device__ constexpr int box_bytes(int br) { return pad8(br) * 128; }
// A stage of kb 64-k chunks: [box 0 | box 1] per chunk, then the kb x slabs (GemvTmaConfig::kbox;
// 1 is the shipped layout).
__host__ __device__ constexpr int stage_bytes(int br, int kb = 1) {
  return kb * (2 * box_bytes(br) + kXBoxBytes);
}

size_t smem_bytes(int br, int slots, int kb = 1) {
  return size_t(kAlignSlack) + kHdrBytes + size_t(slots) * stage_bytes(br, kb);
}

// Box rows for n outputs (GLU: features) over a grid of g blocks.
int box_rows(int64_t n, bool glu, int g) {
  const int64_t per = (n + g - 1) / g;  // the most outputs any block owns
  return int(glu ? per : (per + 1) / 2);
}

int grid_for(int64_t n, int n_sms) { return int(std::max<int64_t>(1, std::min<int64_t>(n_sms, n))); }

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}

// The box at (c0, c1) of map into L2 (no shared memory, nothing to wait for).
__device__ __forceinline__ void tma_prefetch_2d(const CUtensorMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1)
               : "memory");
}

// Block prologue of both kernels (all threads call it): the slots' mbarriers (full: the
// producer's arrival + the bytes; empty: one arrival per consumer warp), and rows m..15 of each
// slot's nx x slabs (16 rows x 128 bytes each, from byte x_off of the slot): zeros the x boxes (m
// rows each) never write, the MMA's padding tokens. The zeros (generic proxy) are read by
// ldmatrix only while the boxes (async proxy) write other bytes of the slots: the proxy fence and
// the barrier order both before any copy and any read.
__device__ __forceinline__ void ring_prologue(uint64_t* full, uint64_t* empty, int slots,
                                              unsigned char* ring, int sbytes, int x_off, int nx,
                                              int m) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < slots; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], kW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  const int per_slab = (16 - m) * 128 / 16;
  for (int i = threadIdx.x; i < slots * nx * per_slab; i += kThreads) {
    const int sb = i / per_slab, v = i - sb * per_slab;  // sb = slot * nx + slab
    const int slot = sb / nx, b = sb - slot * nx;
    reinterpret_cast<uint4*>(ring + size_t(slot) * sbytes + size_t(x_off) +
                             size_t(b) * kXBoxBytes + size_t(m) * 128)[v] = make_uint4(0, 0, 0, 0);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
}

template <typename OutT>
__device__ __forceinline__ void put(OutT* y, size_t i, float v) {
  if constexpr (sizeof(OutT) == 4)
    y[i] = v;
  else
    y[i] = __float2bfloat16_rn(v);
}

// GLU: y = act [m, n = d_ff]; wmap rows 0..2 d_ff (gate then up). Plain: y [m, n], wmap rows n.
// KB (GemvTmaConfig::kbox): 64-k chunks per stage. A stage holds, per chunk c < KB, the two
// weight boxes at box strides 2 c and 2 c + 1, then the KB x slabs; chunks past k are not loaded
// (a stage's tx counts the chunks it loads). The consumers take the chunks in order, so every
// output sums the same k-steps in the same order at every KB (bit-identical).
// AH (GemvTmaConfig::l2_ahead, session 34; KB 1 only): after griddepcontrol.wait and the first
// stages' x boxes, the producer queues the weight boxes of the next `ahead` stages for L2
// (cp.async.bulk.prefetch.tensor), so HBM streams while the consumers wait for x; those stages'
// loads then hit L2. No value changes: bit-identical outputs. Its own instantiation, so the kernels
// without it keep their machine code.
template <bool GLU, typename OutT, int KB = 1, bool AH = false>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_tma_kernel(const __grid_constant__ CUtensorMap wmap,  // w [rows, k], box {64, br}
                    const __grid_constant__ CUtensorMap xmap,  // x [m, k], box {64, m}
                    OutT* __restrict__ y, int m, int n, int k, int br, int slots,
                    int ahead) {  // AH only
  static_assert(!AH || KB == 1, "the L2 prefetch ahead is compiled for one 64-k chunk a stage");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + (kAlignSlack - 1)) & ~uintptr_t(kAlignSlack - 1));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxSlots;
  unsigned char* ring = smem + kHdrBytes;
  const int bbytes = box_bytes(br), sbytes = stage_bytes(br, KB);
  const int xbase = 2 * KB * bbytes;  // the x slabs' offset in a stage

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int o_begin = int(int64_t(n) * blockIdx.x / gridDim.x);
  const int o_end = int(int64_t(n) * (blockIdx.x + 1) / gridDim.x);
  const int row0 = o_begin, row1 = GLU ? n + o_begin : o_begin + br;  // the two boxes' first rows
  constexpr int kStageK = KB * kKc;
  const int n_stages = (k + kStageK - 1) / kStageK;
  // 64-k chunks of stage s that start inside k (KB for every stage but maybe the last).
  auto chunks = [&](int s) { return KB == 1 ? 1 : min(KB, (k - s * kStageK + kKc - 1) / kKc); };
  const uint32_t tx_w = 2u * uint32_t(br) * 128u, tx = tx_w + uint32_t(m) * 128u;

  ring_prologue(full, empty, slots, ring, sbytes, xbase, KB, m);

  const bool producer = warp == kW;
  uint64_t policy = 0;
  const int pre = min(slots, n_stages);
  if (producer && lane == 0) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&wmap)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&xmap)) : "memory");
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    // The weights do not depend on the previous kernel: the first stages' boxes go out now.
    for (int s = 0; s < pre; ++s) {
      const uint32_t st = smem_u32(ring + size_t(s) * sbytes);
      const int nc = chunks(s);
      mbar_arrive_expect_tx(&full[s], uint32_t(nc) * tx);
      for (int c = 0; c < nc; ++c) {
        tma_load_2d(st + 2 * c * bbytes, &wmap, s * kStageK + c * kKc, row0, &full[s], policy);
        tma_load_2d(st + (2 * c + 1) * bbytes, &wmap, s * kStageK + c * kKc, row1, &full[s],
                    policy);
      }
    }
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // x comes from the kernel before (and y may still be read by it): only after this wait.
  asm volatile("griddepcontrol.wait;" ::: "memory");

  if (producer) {
    if (lane == 0) {
      for (int s = 0; s < pre; ++s)
        for (int c = 0; c < chunks(s); ++c)
          tma_load_2d(smem_u32(ring + size_t(s) * sbytes + xbase + c * kXBoxBytes), &xmap,
                      s * kStageK + c * kKc, 0, &full[s]);
      if constexpr (AH) {
        for (int s = pre; s < min(pre + ahead, n_stages); ++s) {
          tma_prefetch_2d(&wmap, s * kKc, row0);
          tma_prefetch_2d(&wmap, s * kKc, row1);
        }
      }
      for (int s = pre; s < n_stages; ++s) {
        const int slot = s % slots;
        mbar_wait(&empty[slot], uint32_t((s / slots) - 1) & 1u);
        const uint32_t st = smem_u32(ring + size_t(slot) * sbytes);
        const int nc = chunks(s);
        mbar_arrive_expect_tx(&full[slot], uint32_t(nc) * tx);
        for (int c = 0; c < nc; ++c) {
          tma_load_2d(st + 2 * c * bbytes, &wmap, s * kStageK + c * kKc, row0, &full[slot],
                      policy);
          tma_load_2d(st + (2 * c + 1) * bbytes, &wmap, s * kStageK + c * kKc, row1, &full[slot],
                      policy);
          tma_load_2d(st + xbase + c * kXBoxBytes, &xmap, s * kStageK + c * kKc, 0, &full[slot]);
        }
      }
    }
    return;
  }

  const int groups = pad8(br) / 8;  // 8-row groups per box
  float acc[kJ][2][4];
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][t][e] = 0.f;
  // Swizzled ldmatrix offsets inside a stage. A (x): lanes 0-7 / 8-15 / 16-23 / 24-31 give rows
  // (tokens) lane % 16 at k 0-7 / 0-7 / 8-15 / 8-15 of the k-step: chunk 2 kk + lane / 16.
  // B (a group's 8 rows r = 8 q + lane % 8): chunk 4 kp + lane / 8 = k-steps 2 kp, 2 kp + 1.
  const int xr = lane & 15, br8 = lane & 7;
  for (int s = 0; s < n_stages; ++s) {
    const int slot = s % slots;
    mbar_wait(&full[slot], uint32_t(s / slots) & 1u);
    const int nc = chunks(s);
#pragma unroll 1
    for (int c = 0; c < nc; ++c) {  // the stage's 64-k chunks in order
      const uint32_t st = smem_u32(ring + size_t(slot) * sbytes) + uint32_t(2 * c * bbytes);
      const uint32_t x_row = uint32_t(xbase - 2 * c * bbytes + c * kXBoxBytes + xr * 128);
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) {
        uint32_t a0[4], a1[4];
        const int c0 = 4 * kp + (lane >> 4), c1 = c0 + 2;
        ldmatrix_x4(a0, st + x_row + uint32_t(((c0 ^ (xr & 7)) << 4)));
        ldmatrix_x4(a1, st + x_row + uint32_t(((c1 ^ (xr & 7)) << 4)));
        const int cb = 4 * kp + (lane >> 3);
        const uint32_t b_col = uint32_t((cb ^ br8) << 4);
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          const int q = warp + j * kW;
          if (q < groups) {
#pragma unroll
            for (int t = 0; t < 2; ++t) {
              uint32_t b[4];
              ldmatrix_x4(b, st + uint32_t(t * bbytes + (8 * q + br8) * 128) + b_col);
              mma_bf16(acc[j][t], a0, b[0], b[1]);
              mma_bf16(acc[j][t], a1, b[2], b[3]);
            }
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);  // every lane's reads of the slot are done
  }

  // D fragments: lane 4 g + t4 holds tokens g and g + 8, rows 2 t4 and 2 t4 + 1 of the group.
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const int q = warp + j * kW;
    if (q >= groups) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = g + (e >> 1) * 8, r = 8 * q + 2 * t4 + (e & 1);  // row inside the box
      if (token >= m || r >= br) continue;
      if constexpr (GLU) {
        const int f = o_begin + r;
        if (f < o_end) {
          const float gv = __bfloat162float(__float2bfloat16_rn(acc[j][0][e]));
          const float uv = __bfloat162float(__float2bfloat16_rn(acc[j][1][e]));
          put(y, size_t(token) * n + f, silu(gv) * uv);
        }
      } else {
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int row = o_begin + t * br + r;
          if (row < o_end) put(y, size_t(token) * n + row, acc[j][t][e]);
        }
      }
    }
  }
}

// ---- gemv_tma_narrow: narrow outputs (n ~ d_model), long rows ------------------------------
// Block b owns the 8-row groups [Q b / G, Q (b + 1) / G) of the Q = ceil(n / 8) groups (4 or 5 of
// them on the 27B's n = 5120 over 132 SMs), i.e. at most kNarrowJ x 8 = 64 rows. A stage is those
// rows over kbox x 64 k-elements: kbox 2-D TMA boxes of the weights (one per 64-k chunk, rows x
// 128 bytes, 128-byte swizzle; blocks with one group fewer use a second tensor map whose box is 8
// rows shorter) and kbox boxes of x (m rows into 16-row slabs whose rows m..15 are zeroed once).
// With the block's rows few, a stage is wide in k instead: 8 x 5 KiB of weights per stage on the
// 27B. A last stage past k issues only the boxes that start inside k. The 8 consumer warps split
// a stage by k: its 2 kbox pairs of 16-k steps (one B ldmatrix.x4 covers a pair for 8 rows) go to
// warps p % 8, so a warp keeps one fp32 m16n8 fragment per row group across all stages; at the
// end the 8 warps' fragments are summed in warp order through shared memory (the ring, reused
// after the last stage). Measured in session 10: the wider the stage the faster (27B down at m 16:
// kbox 2 / 4 / 8 = 78 / 51 / 47 us), for reasons not isolated (bytes and boxes in flight were
// equal across the three).
// Summation order: per warp the k-steps it owns in increasing k, then warps 0..7; it depends on k
// and kbox only (never m, the slot count, the grid or PDL): batch-invariant for a fixed kbox.
constexpr int kNarrowJ = 8;  // the most 8-row groups per block (64 rows)

__host__ __device__ constexpr int narrow_stage_bytes(int gmax, int kbox) {
  return kbox * (gmax * 8 * 128 + kXBoxBytes);
}
size_t narrow_smem_bytes(int gmax, int kbox, int slots) {
  return size_t(kAlignSlack) + kHdrBytes + size_t(slots) * narrow_stage_bytes(gmax, kbox);
}
int narrow_gmax(int64_t n, int g) {
  const int64_t q = (n + 7) / 8;
  return int((q + g - 1) / g);
}
int narrow_grid(int64_t n, int n_sms) {
  return int(std::max<int64_t>(1, std::min<int64_t>(n_sms, (n + 7) / 8)));
}

template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_tma_narrow_kernel(const __grid_constant__ CUtensorMap wmap_hi,  // box {64, 8 gmax}
                           const __grid_constant__ CUtensorMap wmap_lo,  // box {64, 8 (gmax - 1)}
                           const __grid_constant__ CUtensorMap xmap,     // x [m, k], box {64, m}
                           OutT* __restrict__ y, int m, int n, int k, int gmax, int kbox,
                           int slots) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + (kAlignSlack - 1)) & ~uintptr_t(kAlignSlack - 1));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxSlots;
  unsigned char* ring = smem + kHdrBytes;
  const int wslab = gmax * 8 * 128;                  // one 64-k box of weights (the largest)
  const int sbytes = narrow_stage_bytes(gmax, kbox);  // kbox weight slabs, then kbox x slabs

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q_total = (n + 7) / 8;
  const int q0 = int(int64_t(q_total) * blockIdx.x / gridDim.x);
  const int q1 = int(int64_t(q_total) * (blockIdx.x + 1) / gridDim.x);
  const int groups = q1 - q0;  // gmax or gmax - 1
  const CUtensorMap* wmap = groups == gmax ? &wmap_hi : &wmap_lo;
  const int kstage = kbox * kKc;
  const int n_stages = (k + kstage - 1) / kstage;
  // boxes of stage s (those that start inside k) and the bytes they bring
  auto boxes = [&](int s) { return min(kbox, (k - s * kstage + kKc - 1) / kKc); };
  const uint32_t tx_box = uint32_t(groups) * 8u * 128u + uint32_t(m) * 128u;

  ring_prologue(full, empty, slots, ring, sbytes, kbox * wslab, kbox, m);

  const bool producer = warp == kW;
  const int pre = min(slots, n_stages);
  if (producer && lane == 0) {
    uint64_t policy;
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(wmap)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&xmap)) : "memory");
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    auto weights = [&](int s, int slot) {
      const uint32_t st = smem_u32(ring + size_t(slot) * sbytes);
      const int nb = boxes(s);
      for (int b = 0; b < nb; ++b)
        tma_load_2d(st + uint32_t(b * wslab), wmap, s * kstage + b * kKc, q0 * 8, &full[slot],
                    policy);
    };
    auto xs = [&](int s, int slot) {
      const uint32_t st = smem_u32(ring + size_t(slot) * sbytes) + uint32_t(kbox * wslab);
      const int nb = boxes(s);
      for (int b = 0; b < nb; ++b)
        tma_load_2d(st + uint32_t(b * kXBoxBytes), &xmap, s * kstage + b * kKc, 0, &full[slot]);
    };
    // The weights do not depend on the previous kernel: the first stages' boxes go out now.
    for (int s = 0; s < pre; ++s) {
      mbar_arrive_expect_tx(&full[s], uint32_t(boxes(s)) * tx_box);
      weights(s, s);
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    // x comes from the kernel before: only after this wait.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int s = 0; s < pre; ++s) xs(s, s);
    for (int s = pre; s < n_stages; ++s) {
      const int slot = s % slots;
      mbar_wait(&empty[slot], uint32_t((s / slots) - 1) & 1u);
      mbar_arrive_expect_tx(&full[slot], uint32_t(boxes(s)) * tx_box);
      weights(s, slot);
      xs(s, slot);
    }
    return;
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // y may still be read by the kernel before (and the x boxes wait for it anyway).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (producer) return;

  float acc[kNarrowJ][4];
#pragma unroll
  for (int j = 0; j < kNarrowJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  const int xr = lane & 15, br8 = lane & 7;
  for (int s = 0; s < n_stages; ++s) {
    const int slot = s % slots;
    mbar_wait(&full[slot], uint32_t(s / slots) & 1u);
    const uint32_t st = smem_u32(ring + size_t(slot) * sbytes);
    const int pairs = 2 * boxes(s);
    for (int p = warp; p < pairs; p += kW) {
      const int bx = p >> 1, kp = p & 1;
      uint32_t a0[4], a1[4];
      const uint32_t xrow = st + uint32_t(kbox * wslab + bx * kXBoxBytes + xr * 128);
      const int c0 = 4 * kp + (lane >> 4), c1 = c0 + 2;
      ldmatrix_x4(a0, xrow + uint32_t((c0 ^ (xr & 7)) << 4));
      ldmatrix_x4(a1, xrow + uint32_t((c1 ^ (xr & 7)) << 4));
      const uint32_t wbase =
          st + uint32_t(bx * wslab + br8 * 128) + uint32_t(((4 * kp + (lane >> 3)) ^ br8) << 4);
#pragma unroll
      for (int j = 0; j < kNarrowJ; ++j) {
        if (j < groups) {
          uint32_t b[4];
          ldmatrix_x4(b, wbase + uint32_t(j * 8 * 128));
          mma_bf16(acc[j], a0, b[0], b[1]);
          mma_bf16(acc[j], a1, b[2], b[3]);
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);  // every lane's reads of the slot are done
  }

  // Every consumer warp has read every stage and no copy is outstanding: the ring is free.
  asm volatile("bar.sync 1, %0;" ::"r"(kW * 32) : "memory");
  float* red = reinterpret_cast<float*>(ring);  // [warp][group < gmax][lane][4]: gmax x 4 KiB
#pragma unroll
  for (int j = 0; j < kNarrowJ; ++j)
    if (j < groups)
      reinterpret_cast<float4*>(red)[(warp * gmax + j) * 32 + lane] =
          make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
  asm volatile("bar.sync 1, %0;" ::"r"(kW * 32) : "memory");
  // D fragment element e of lane l: token (l / 4) + 8 (e / 2), row 2 (l % 4) + e % 2 of the group.
  for (int i = threadIdx.x; i < groups * 128; i += kW * 32) {
    const int j = i >> 7, l = (i >> 2) & 31, e = i & 3;
    const int token = (l >> 2) + (e >> 1) * 8, row = 8 * (q0 + j) + 2 * (l & 3) + (e & 1);
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) v += red[(w * gmax + j) * 128 + (i & 127)];
    if (token < m && row < n) put(y, size_t(token) * n + row, v);
  }
}

// A [rows, k] bf16 row-major matrix as 2-D boxes of {64 k, box_rows} with the 128-byte swizzle.
CUtensorMap matrix_map(const bf16* p, int64_t rows, int64_t k, int box_rows, bool weights) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(k) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kKc), cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(p), dims, strides, box,
      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      weights ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DS_CHECK(r == CUDA_SUCCESS, "tma gemv: cuTensorMapEncodeTiled failed for a ", rows, " x ", k,
           weights ? " weight" : " input", " (box rows ", box_rows, ", CUresult ", int(r), ")");
  return map;
}

template <bool GLU, typename OutT>
void launch_t(const bf16* x, const bf16* w, OutT* y, int m, int n, int k, const GemvTmaConfig& c,
              int n_sms, cudaStream_t stream) {
  const int grid = grid_for(n, n_sms);
  const int br = box_rows(n, GLU, grid);
  const int slots = c.slots > 0 ? c.slots : gemv_tma_max_slots(br, c.kbox);
  const CUtensorMap wmap = matrix_map(w, GLU ? 2 * int64_t(n) : int64_t(n), k, br, true);
  const CUtensorMap xmap = matrix_map(x, m, k, m, false);
  auto* kern = c.kbox == 4   ? gemv_tma_kernel<GLU, OutT, 4>
               : c.kbox == 2 ? gemv_tma_kernel<GLU, OutT, 2>
                             : gemv_tma_kernel<GLU, OutT, 1>;
  if constexpr (std::is_same_v<OutT, bf16>) {
    if (c.l2_ahead > 0) kern = gemv_tma_kernel<GLU, OutT, 1, true>;  // kbox 1 (checked)
  }
  ensure_smem_optin(reinterpret_cast<const void*>(kern), kMaxSmem);
  launch_maybe_pdl(kern, dim3(grid), dim3(kThreads), smem_bytes(br, slots, c.kbox), stream, c.pdl,
                   wmap, xmap, y, m, n, k, br, slots, c.l2_ahead);
}

template <typename OutT>
void launch_narrow_t(const bf16* x, const bf16* w, OutT* y, int m, int n, int k,
                     const GemvTmaNarrowConfig& c, int n_sms, cudaStream_t stream) {
  const int grid = narrow_grid(n, n_sms);
  const int gmax = narrow_gmax(n, grid);
  const int slots = c.slots > 0 ? c.slots : gemv_tma_narrow_max_slots(gmax, c.kbox);
  const CUtensorMap hi = matrix_map(w, n, k, 8 * gmax, true);
  const CUtensorMap lo = gmax > 1 ? matrix_map(w, n, k, 8 * (gmax - 1), true) : hi;
  const CUtensorMap xmap = matrix_map(x, m, k, m, false);
  auto* kern = gemv_tma_narrow_kernel<OutT>;
  ensure_smem_optin(reinterpret_cast<const void*>(kern), kMaxSmem);
  launch_maybe_pdl(kern, dim3(grid), dim3(kThreads), narrow_smem_bytes(gmax, c.kbox, slots),
                   stream, c.pdl, hi, lo, xmap, y, m, n, k, gmax, c.kbox, slots);
}

void check_common(const bf16* x, const bf16* w, const void* y, int n_sms, const char* what) {
  DS_CHECK(n_sms >= 1, what, ": n_sms must be positive");
  DS_CHECK(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0, what,
           ": x and w must be 16-byte aligned");
  DS_CHECK(y != nullptr, what, ": null output");
}

}  // namespace

std::string GemvTmaConfig::name() const {
  std::ostringstream os;
  os << "s" << (slots > 0 ? std::to_string(slots) : std::string("max"))
     << (kbox != 1 ? "-kb" + std::to_string(kbox) : std::string()) << (pdl ? "-pdl" : "");
  if (l2_ahead > 0) os << "-a" << l2_ahead;
  return os.str();
}

int gemv_tma_ahead_stages(int kib, int64_t n, bool glu, const GemvTmaConfig& c, int n_sms) {
  if (kib <= 0 || c.kbox != 1 || n < 1 || n_sms < 1) return 0;
  return gemv_ahead_stages_for(kib, 2 * int64_t(box_bytes(box_rows(n, glu, grid_for(n, n_sms)))));
}

int gemv_tma_max_slots(int box_rows, int kbox) {
  if (box_rows < 1 || (kbox != 1 && kbox != 2 && kbox != 4)) return 0;
  const int64_t room = int64_t(kMaxSmem) - kAlignSlack - kHdrBytes;
  return int(std::min<int64_t>(kMaxSlots, room / stage_bytes(box_rows, kbox)));
}

int gemv_tma_kbox_mode() {
  static const int kbox = [] {
    const char* e = std::getenv("DS_GEMV_TMA_KBOX");
    const std::string v = e ? e : "";
    if (v.empty() || v == "1") return 1;
    DS_CHECK(v == "2" || v == "4", "DS_GEMV_TMA_KBOX must be 1, 2 or 4, got '", v, "'");
    return v == "2" ? 2 : 4;
  }();
  return kbox;
}

GemvTmaMode gemv_tma_mode() {
  static const GemvTmaMode mode = [] {
    const char* e = std::getenv("DS_GEMV_TMA");
    const std::string v = e ? e : "";
    if (v.empty() || v == "1") return GemvTmaMode::kAll;  // the default (session 9 A/B)
    if (v == "0") return GemvTmaMode::kOff;
    if (v == "silu") return GemvTmaMode::kSilu;
    ds::throw_error("DS_GEMV_TMA must be 0, 1 or silu, got '", v, "'");
  }();
  return mode;
}

bool gemv_tma_fits(int64_t m, int64_t n, int64_t k, bool glu, const GemvTmaConfig& c, int n_sms) {
  if (m < 1 || m > kGemvTmaMaxM || n < 1 || k < 8 || k % 8 != 0 || k > kSkinnyMaxK ||
      n_sms < 1 || n > (glu ? kSkinnyMaxN / 2 : kSkinnyMaxN))
    return false;
  const int br = box_rows(n, glu, grid_for(n, n_sms));
  if (br < 1 || br > kMaxBoxRows) return false;
  const int max_slots = gemv_tma_max_slots(br, c.kbox);  // 0 for a kbox other than 1, 2, 4
  const int slots = c.slots > 0 ? c.slots : max_slots;
  return slots >= 2 && slots <= max_slots;
}

bool gemv_tma_supports(int64_t m, int64_t n, int64_t k, bool glu, int n_sms) {
  return gemv_tma_fits(m, n, k, glu, GemvTmaConfig{}, n_sms);
}

bool gemv_tma_preferred(int64_t m, int64_t n, int64_t k, bool glu) {
  const GemvTmaMode mode = gemv_tma_mode();
  if (mode == GemvTmaMode::kOff || (mode == GemvTmaMode::kSilu && !glu)) return false;
  if (m < kGemvTmaMinM || m > kGemvTmaMaxM || k < 4096 || k > 8192 || n < 8192) return false;
  // The guard cannot see the device: the shape must fit a grid of kGuardMinSms blocks (the box
  // rows grow as the grid shrinks); GemmEngine re-checks with the device's SM count.
  return gemv_tma_supports(m, n, k, glu, kGuardMinSms);
}

GemvTmaConfig gemv_tma_config(int m, int n, int k, bool glu) {
  // As many stages as fit (kbox 1: gate_up 6 x 36 KiB, gdn_in 12 x 18 KiB, attn_qkv 14 x 16), of
  // $DS_GEMV_TMA_KBOX 64-k chunks, halved until two stages fit on kGuardMinSms SMs (the box rows
  // grow as the grid shrinks, so what fits there fits on more).
  GemvTmaConfig c;
  c.kbox = gemv_tma_kbox_mode();
  while (c.kbox > 1 && !gemv_tma_fits(m, n, k, glu, c, kGuardMinSms)) c.kbox /= 2;
  return c;
}

std::vector<GemvTmaConfig> gemv_tma_configs(int m, int n, int k, bool glu, int n_sms) {
  std::vector<GemvTmaConfig> v;
  if (!gemv_tma_supports(m, n, k, glu, n_sms)) return v;
  const int br = box_rows(n, glu, grid_for(n, n_sms));
  for (int kb : {1, 2, 4}) {
    const int max_slots = gemv_tma_max_slots(br, kb);
    for (int s : {0, 4, 2})
      if (max_slots >= 2 && (s == 0 || s < max_slots)) v.push_back({s, false, kb});
  }
  return v;
}

void launch_gemv_tma(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n, int k,
                     GemmOut out, const GemvTmaConfig& cfg, int n_sms, cudaStream_t stream) {
  check_common(x, w, y, n_sms, "tma gemv");
  DS_CHECK(gemv_tma_fits(m, n, k, false, cfg, n_sms), "tma gemv: unsupported shape or config m=",
           m, " n=", n, " k=", k, " config ", cfg.name(), " on ", n_sms, " SMs (needs m 1..",
           kGemvTmaMaxM, ", k % 8 == 0, 8 <= k <= ", kSkinnyMaxK, ", at most ", kMaxBoxRows,
           " x 2 rows per block and 2+ stages in shared memory)");
  DS_CHECK(cfg.l2_ahead >= 0 && (cfg.l2_ahead == 0 || (cfg.kbox == 1 && out == GemmOut::kBF16)),
           "tma gemv: l2_ahead is compiled for kbox 1 and bf16 out (config ", cfg.name(), ")");
  if (out == GemmOut::kBF16)
    launch_t<false>(x, w, static_cast<bf16*>(y), m, n, k, cfg, n_sms, stream);
  else
    launch_t<false>(x, w, static_cast<float*>(y), m, n, k, cfg, n_sms, stream);
  DS_CUDA_LAUNCH_CHECK();
}

void launch_gemv_tma_silu(const __nv_bfloat16* x, const __nv_bfloat16* w_gate_up,
                          __nv_bfloat16* act, int m, int d_ff, int k, const GemvTmaConfig& cfg,
                          int n_sms, cudaStream_t stream) {
  check_common(x, w_gate_up, act, n_sms, "tma gemv + silu");
  DS_CHECK(gemv_tma_fits(m, d_ff, k, true, cfg, n_sms),
           "tma gemv + silu: unsupported shape or config m=", m, " d_ff=", d_ff, " k=", k,
           " config ", cfg.name(), " on ", n_sms, " SMs (needs m 1..", kGemvTmaMaxM,
           ", k % 8 == 0, 8 <= k <= ", kSkinnyMaxK, ", at most ", kMaxBoxRows,
           " features per block and 2+ stages in shared memory)");
  DS_CHECK(cfg.l2_ahead >= 0 && (cfg.l2_ahead == 0 || cfg.kbox == 1),
           "tma gemv + silu: l2_ahead is compiled for kbox 1 (config ", cfg.name(), ")");
  launch_t<true>(x, w_gate_up, act, m, d_ff, k, cfg, n_sms, stream);
  DS_CUDA_LAUNCH_CHECK();
}

// ---- gemv_tma_narrow -------------------------------------------------------------------------

std::string GemvTmaNarrowConfig::name() const {
  std::ostringstream os;
  os << "kb" << kbox << "-s" << (slots > 0 ? std::to_string(slots) : std::string("max"))
     << (pdl ? "-pdl" : "");
  return os.str();
}

int gemv_tma_narrow_max_slots(int groups, int kbox) {
  if (groups < 1 || (kbox != 2 && kbox != 4 && kbox != 8 && kbox != 16)) return 0;
  const int64_t room = int64_t(kMaxSmem) - kAlignSlack - kHdrBytes;
  return int(std::min<int64_t>(kMaxSlots, room / narrow_stage_bytes(groups, kbox)));
}

GemvTmaNarrowMode gemv_tma_narrow_mode() {
  static const GemvTmaNarrowMode mode = [] {
    const char* e = std::getenv("DS_GEMV_TMA_NARROW");
    const std::string v = e ? e : "";
    if (v.empty()) return GemvTmaNarrowMode::kDownBatch;  // the default (session 10 A/B)
    if (v == "0") return GemvTmaNarrowMode::kOff;
    if (v == "1") return GemvTmaNarrowMode::kAll;
    if (v == "out") return GemvTmaNarrowMode::kOut;
    if (v == "down") return GemvTmaNarrowMode::kDown;
    ds::throw_error("DS_GEMV_TMA_NARROW must be 0, 1, out or down, got '", v, "'");
  }();
  return mode;
}

bool gemv_tma_narrow_fits(int64_t m, int64_t n, int64_t k, const GemvTmaNarrowConfig& c,
                          int n_sms) {
  if (m < 1 || m > kGemvTmaMaxM || n < 1 || k < 8 || k % 8 != 0 || k > kGemvTmaNarrowMaxK ||
      n_sms < 1 || n > kSkinnyMaxN)
    return false;
  const int gmax = narrow_gmax(n, narrow_grid(n, n_sms));
  if (gmax < 1 || gmax > kNarrowJ) return false;
  const int max_slots = gemv_tma_narrow_max_slots(gmax, c.kbox);
  const int slots = c.slots > 0 ? c.slots : max_slots;
  return max_slots >= 2 && slots >= 2 && slots <= max_slots;
}

bool gemv_tma_narrow_supports(int64_t m, int64_t n, int64_t k, int n_sms) {
  return gemv_tma_narrow_fits(m, n, k, GemvTmaNarrowConfig{}, n_sms);
}

bool gemv_tma_narrow_preferred(int64_t m, int64_t n, int64_t k) {
  const GemvTmaNarrowMode mode = gemv_tma_narrow_mode();
  if (mode == GemvTmaNarrowMode::kOff) return false;
  if (mode == GemvTmaNarrowMode::kOut && k > 8192) return false;
  if ((mode == GemvTmaNarrowMode::kDown || mode == GemvTmaNarrowMode::kDownBatch) && k <= 8192)
    return false;
  if (mode == GemvTmaNarrowMode::kDownBatch && m < kGemvTmaNarrowMinM) return false;
  // the 27B's out / down projections (n 5120, k 6144 / 17408) and their neighbourhood only; m and
  // the largest k are supports()' limits
  if (n < 5120 || n > 8192 || k < 6144) return false;
  return gemv_tma_narrow_supports(m, n, k, kGuardMinSms);
}

GemvTmaNarrowConfig gemv_tma_narrow_config(int m, int n, int k) {
  (void)m, (void)n, (void)k;
  return {};  // 8 boxes of 64 k per stage, as many stages as fit (27B: 4 x 56 KiB)
}

std::vector<GemvTmaNarrowConfig> gemv_tma_narrow_configs(int m, int n, int k, int n_sms) {
  std::vector<GemvTmaNarrowConfig> v;
  for (int kb : {8, 4, 16, 2})
    for (int s : {0, 2, 3}) {
      const GemvTmaNarrowConfig c{kb, s, false};
      if (gemv_tma_narrow_fits(m, n, k, c, n_sms)) v.push_back(c);
    }
  return v;
}

void launch_gemv_tma_narrow(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n,
                            int k, GemmOut out, const GemvTmaNarrowConfig& cfg, int n_sms,
                            cudaStream_t stream) {
  check_common(x, w, y, n_sms, "tma narrow gemv");
  DS_CHECK(gemv_tma_narrow_fits(m, n, k, cfg, n_sms),
           "tma narrow gemv: unsupported shape or config m=", m, " n=", n, " k=", k, " config ",
           cfg.name(), " on ", n_sms, " SMs (needs m 1..", kGemvTmaMaxM, ", k % 8 == 0, 8 <= k <= ",
           kGemvTmaNarrowMaxK, ", at most ", kNarrowJ * 8,
           " rows per block, kbox 2 / 4 / 8 / 16 and 2+ stages in shared memory)");
  if (out == GemmOut::kBF16)
    launch_narrow_t(x, w, static_cast<bf16*>(y), m, n, k, cfg, n_sms, stream);
  else
    launch_narrow_t(x, w, static_cast<float*>(y), m, n, k, cfg, n_sms, stream);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
