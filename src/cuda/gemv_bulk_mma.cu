// Decode GEMV on tensor cores fed by the bulk-copy ring: y[m, n] = x[m, k] w[n, k]^T for m = 1..16
// tokens (the registry guard: 3..16), bf16 in, fp32 accumulation, bf16 or fp32 out, no accumulate.
// Built for batch 3..16 decode on the Qwen3.5-27B k = 5120 / 6144 projections (gdn_in 16480 x
// 5120, gdn_out / attn_o 5120 x 6144, attn_qkv 14336 x 5120, gate_up 34816 x 5120), where
// cuBLASLt tuned reaches 69-90% of the HBM read ceiling at m = 16 and the CUDA-core consumers of
// gemv_bulk.cu cannot keep up (16 tokens x 8 FMAs per 16 weight bytes). Interface, config and
// guard in gemv.h; OFF unless $DS_GEMV_MMA=1 (not yet measured on a GPU: docs/perf/decode_gemv.md,
// last section). Tests: tests/cuda/cuda_gemv_test.cpp (CudaGemvBulkMma.*); bench: `deltaserve
// bench kernels --only gemm` (rows gemm.gemv_bulk_mma_* in the "A/B" shapes).
//
// Method. One persistent block per SM owns the contiguous rows [n b / G, n (b + 1) / G), cut into
// groups of 16 rows (the last one partial). k is cut into chunks of KC elements (512 or 1024; the
// last chunk shorter when KC does not divide k). A stage is (chunk c, group g): the group's 16
// rows x KC elements of w, one 1-D bulk copy per row into a padded row of a ring slot (row stride
// KC + 8 elements: the eight 16-byte rows an ldmatrix phase reads fall in eight different bank
// groups). A producer warp streams the stages in the order s = c * groups + g (L2 evict-first,
// lanes 0..15 issue one row each, an mbarrier per slot); the first `slots` stages are issued
// before griddepcontrol.wait. A second producer warp copies x chunk by chunk (after the wait, one
// row per lane) into two padded [16, KC] buffers whose rows >= m are zero-filled once; each
// buffer has a full and an empty mbarrier (empty: one arrival per consumer warp that owns a group).
// Consumer warp w owns the groups g = w, w + 8, w + 16, ... for the whole kernel, so its fp32
// accumulators (16 tokens x 16 rows = two m16n8 fragments, 8 registers per group) stay in
// registers across all chunks. Per stage and k-step of 16: ldmatrix.x4 of x (the MMA's A: tokens
// as M, padded to 16 with the zero rows) and ldmatrix.x4 of the 16 weight rows (k-contiguous rows
// are exactly the .col B operand of mma.m16n8k16.row.col: two n8 tiles), then two mma.sync.
// Ring slots are not tied to warps (a stage's consumer is g % 8, not s % slots), so a consumer
// could reach a slot before the slot's previous fill has even landed, where a parity wait would
// pass one phase early. The producer therefore writes the stage number into a per-slot tag after
// issuing it; a consumer waits for tag == s first (then the previous fill was consumed, so its
// phase is complete) and only then for the full barrier's parity (s / slots) & 1.
// Every output is the sum over the k-steps 0, 16, 32, ... in that order of one MMA each (the
// chunks are consecutive k ranges): it depends on k only, never on KC, the slot count, the grid or
// m (an MMA's output row depends only on its own A row, and the padding rows are zeros), so
// results are bit-identical across batch sizes and configs.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "cuda/bulk_copy.cuh"
#include "cuda/cuda_common.h"
#include "cuda/gemv.h"

namespace ds::cuda {
namespace {

constexpr int kW = 8;                      // consumer warps
constexpr int kThreads = (kW + 2) * 32;    // + the weight producer warp + the x producer warp
constexpr int kMaxJ = 6;                   // groups per consumer warp (accumulator sets)
constexpr int kMaxGroups = kW * kMaxJ;     // 48 groups of 16 rows: 768 rows per block
constexpr int kXBufs = 2;                  // x chunk buffers
constexpr int kMaxSlots = 16;              // ring slots (the header's barrier arrays)
constexpr int kHdrBytes = 1024;            // mbarriers and tags
constexpr int kMaxSmem = 232448;           // sm 90 opt-in dynamic shared memory per block
// The registry guard cannot see the device: it tests the groups-per-block limit for a grid of at
// least this many SMs; GemmEngine::run re-checks with the device's count (else cuBLASLt).
constexpr int kGuardMinSms = 64;

constexpr size_t buf_bytes(int kc) { return size_t(16) * (kc + 8) * 2; }
constexpr size_t smem_bytes(int kc, int slots) {
  return kHdrBytes + size_t(kXBufs + slots) * buf_bytes(kc);
}

// acc += x[16, kn] w[16 rows, kn]^T over the k-steps 0, 16, ... of one stage. xa / wb: this
// lane's ldmatrix row addresses at k-step 0 (shared window). kn % 64 == 0.
__device__ __forceinline__ void mma_stage(float (&acc)[2][4], uint32_t xa, uint32_t wb, int kn) {
#pragma unroll 1
  for (int k64 = 0; k64 < kn; k64 += 64) {
#pragma unroll
    for (int kk = k64; kk < k64 + 64; kk += 16) {
      uint32_t a[4], b[4];
      ldmatrix_x4(a, xa + uint32_t(kk) * 2u);
      ldmatrix_x4(b, wb + uint32_t(kk) * 2u);
      mma_bf16(acc[0], a, b[0], b[1]);
      mma_bf16(acc[1], a, b[2], b[3]);
    }
  }
}

// Shared memory: [header: full[kMaxSlots], empty[kMaxSlots], xfull[2], xempty[2] mbarriers,
// tag[kMaxSlots] | x buffers [2][16][KC + 8] bf16 | ring [slots][16][KC + 8] bf16].
template <int KC, typename OutT>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_bulk_mma_kernel(const bf16* x,  // [m, k]; no __restrict__: read after the wait
                         const bf16* __restrict__ w,  // [n, k]
                         OutT* __restrict__ y,        // [m, n]
                         int m, int n, int k, int slots) {
  constexpr int kStride = KC + 8;     // elements per padded row
  constexpr int kBuf = 16 * kStride;  // elements per buffer / slot
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxSlots;
  uint64_t* xfull = empty + kMaxSlots;
  uint64_t* xempty = xfull + kXBufs;
  volatile int* tag = reinterpret_cast<volatile int*>(xempty + kXBufs);
  bf16* xs = reinterpret_cast<bf16*>(smem + kHdrBytes);
  bf16* ring = xs + kXBufs * kBuf;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_begin = int(int64_t(n) * blockIdx.x / gridDim.x);
  const int row_end = int(int64_t(n) * (blockIdx.x + 1) / gridDim.x);
  const int groups = (row_end - row_begin + 15) / 16;
  const int chunks = (k + KC - 1) / KC;
  const int n_stages = chunks * groups;
  const int active = min(groups, kW);  // consumer warps that own at least one group

  if (threadIdx.x == 0) {
    for (int i = 0; i < slots; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 1);
      tag[i] = -1;
    }
    for (int b = 0; b < kXBufs; ++b) {
      mbar_init(&xfull[b], 1);
      mbar_init(&xempty[b], uint32_t(max(active, 1)));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  {  // rows m..15 of both x buffers: zeros (the A rows of the padding tokens), never copied into
    const int per_buf = (16 - m) * kStride / 8;  // 16-byte vectors (kStride * 2 % 16 == 0)
    for (int i = threadIdx.x; i < kXBufs * per_buf; i += kThreads) {
      const int b = i / per_buf, v = i - b * per_buf;
      reinterpret_cast<uint4*>(xs + size_t(b) * kBuf + size_t(m) * kStride)[v] =
          make_uint4(0, 0, 0, 0);
    }
  }
  __syncthreads();

  const bool wproducer = warp == kW, xproducer = warp == kW + 1;
  uint64_t policy = 0;
  // Stage s = (chunk s / groups, group s % groups) into slot s % slots: lane r < rows copies row r.
  auto issue = [&](int s) {
    const int slot = s % slots;
    const int c = s / groups, g = s - c * groups;
    const int r0 = row_begin + g * 16, rows = min(16, row_end - r0);
    const int k0 = c * KC, kn = min(KC, k - k0);
    if (lane == 0) mbar_arrive_expect_tx(&full[slot], uint32_t(rows) * uint32_t(kn) * 2u);
    __syncwarp();
    if (lane < rows)
      bulk_copy(ring + size_t(slot) * kBuf + size_t(lane) * kStride, w + size_t(r0 + lane) * k + k0,
                uint32_t(kn) * 2u, &full[slot], policy);
    __syncwarp();
    if (lane == 0) tag[slot] = s;  // after the copies: a consumer of s may now wait for the fill
  };
  // The weights do not depend on the previous kernel: start streaming them before waiting for it.
  if (wproducer) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int s = 0; s < min(slots, n_stages); ++s) issue(s);
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // x comes from the kernel before (and y may still be read by it): only after this wait, through
  // a plain pointer (see gemv_bulk.cu on ld.global.nc and the wait).
  asm volatile("griddepcontrol.wait;" ::: "memory");

  if (wproducer) {
    for (int s = slots; s < n_stages; ++s) {
      if (lane == 0) mbar_wait(&empty[s % slots], uint32_t((s / slots) - 1) & 1u);
      __syncwarp();
      issue(s);
    }
    return;
  }
  if (xproducer) {
    for (int c = 0; c < chunks; ++c) {
      const int b = c % kXBufs;
      if (c >= kXBufs && lane == 0) mbar_wait(&xempty[b], uint32_t((c / kXBufs) - 1) & 1u);
      const int k0 = c * KC, kn = min(KC, k - k0);
      if (lane == 0) mbar_arrive_expect_tx(&xfull[b], uint32_t(m) * uint32_t(kn) * 2u);
      __syncwarp();
      if (lane < m)
        bulk_copy(xs + size_t(b) * kBuf + size_t(lane) * kStride, x + size_t(lane) * k + k0,
                  uint32_t(kn) * 2u, &xfull[b]);
      __syncwarp();
    }
    return;
  }
  if (warp >= active) return;

  float acc[kMaxJ][2][4];
#pragma unroll
  for (int j = 0; j < kMaxJ; ++j)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][t][e] = 0.f;
  // ldmatrix row addresses at k-step 0. A (x): matrices (tokens 0-7 | 8-15) x (k 0-7 | 8-15) from
  // lanes 0-7 / 8-15 / 16-23 / 24-31: token lane % 16, k (lane / 16) * 8. B (w): matrices
  // (rows 0-7, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 0-7), (rows 8-15, k 8-15): b0 / b1 of the
  // first n8 tile, then of the second.
  const uint32_t a_off = uint32_t(((lane & 15) * kStride + (lane >> 4) * 8) * 2);
  const uint32_t b_off = uint32_t(((((lane >> 4) << 3) + (lane & 7)) * kStride + ((lane >> 3) & 1) * 8) * 2);
  const uint32_t xs_u = smem_u32(xs) + a_off, ring_u = smem_u32(ring) + b_off;

  for (int c = 0; c < chunks; ++c) {
    const int b = c % kXBufs;
    const int kn = min(KC, k - c * KC);
    mbar_wait(&xfull[b], uint32_t(c / kXBufs) & 1u);
    const uint32_t xa = xs_u + uint32_t(b * kBuf * 2);
#pragma unroll
    for (int j = 0; j < kMaxJ; ++j) {
      const int g = warp + j * kW;
      if (g < groups) {
        const int s = c * groups + g;
        const int slot = s % slots;
        while (tag[slot] != s) __nanosleep(32);  // the slot's previous fill is consumed
        mbar_wait(&full[slot], uint32_t(s / slots) & 1u);
        mma_stage(acc[j], xa, ring_u + uint32_t(slot * kBuf * 2), kn);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);  // every lane's reads of the slot are done
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&xempty[b]);
  }

  // D fragments: lane 4 q + t holds tokens q and q + 8, rows 2 t and 2 t + 1 of each n8 tile.
  const int q = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < kMaxJ; ++j) {
    const int g = warp + j * kW;
    if (g >= groups) continue;
    const int r0 = row_begin + g * 16;
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token = q + (e >> 1) * 8, row = r0 + t * 8 + 2 * t4 + (e & 1);
        if (token < m && row < row_end) store_out(y, size_t(token) * n + row, acc[j][t][e], false);
      }
  }
}

template <int KC>
void launch_kc(const bf16* x, const bf16* w, void* y, int m, int n, int k, GemmOut out,
               const GemvBulkMmaConfig& c, int blocks, cudaStream_t stream) {
  const size_t smem = smem_bytes(KC, c.slots);
  if (out == GemmOut::kBF16) {
    auto* kern = gemv_bulk_mma_kernel<KC, bf16>;
    ensure_smem_optin(reinterpret_cast<const void*>(kern), kMaxSmem);
    launch_maybe_pdl(kern, dim3(blocks), dim3(kThreads), smem, stream, c.pdl, x, w,
                     static_cast<bf16*>(y), m, n, k, c.slots);
  } else {
    auto* kern = gemv_bulk_mma_kernel<KC, float>;
    ensure_smem_optin(reinterpret_cast<const void*>(kern), kMaxSmem);
    launch_maybe_pdl(kern, dim3(blocks), dim3(kThreads), smem, stream, c.pdl, x, w,
                     static_cast<float*>(y), m, n, k, c.slots);
  }
}

int grid_for(int n, int n_sms) { return std::max(1, std::min(n_sms, n)); }

}  // namespace

std::string GemvBulkMmaConfig::name() const {
  std::ostringstream os;
  os << "k" << kc << "s" << slots << (pdl ? "-pdl" : "");
  return os.str();
}

int gemv_bulk_mma_max_groups() { return kMaxGroups; }

size_t gemv_bulk_mma_smem_bytes(const GemvBulkMmaConfig& c) { return smem_bytes(c.kc, c.slots); }

bool gemv_bulk_mma_enabled() {
  static const bool on = env_switch("DS_GEMV_MMA", false);
  return on;
}

bool gemv_bulk_mma_fits(int64_t m, int64_t n, int64_t k, const GemvBulkMmaConfig& c, int n_sms) {
  if (m < 1 || m > kGemvBulkMmaMaxM || n < 1 || n > kSkinnyMaxN || k < 64 || k % 64 != 0 ||
      k > kSkinnyMaxK || n_sms < 1)
    return false;
  if ((c.kc != 512 && c.kc != 1024) || c.slots < 2 || c.slots > kMaxSlots) return false;
  if (smem_bytes(c.kc, c.slots) > size_t(kMaxSmem)) return false;
  const int64_t grid = grid_for(int(n), n_sms);
  const int64_t rows_cap = (n + grid - 1) / grid;  // the most rows any block gets
  return (rows_cap + 15) / 16 <= kMaxGroups;
}

std::vector<GemvBulkMmaConfig> gemv_bulk_mma_configs(int m, int n, int k, int n_sms) {
  std::vector<GemvBulkMmaConfig> v;
  for (auto [kc, s] : {std::pair{512, 11}, std::pair{512, 8}, std::pair{1024, 5},
                       std::pair{1024, 4}})
    if (gemv_bulk_mma_fits(m, n, k, {kc, s, false}, n_sms)) v.push_back({kc, s, false});
  return v;
}

bool gemv_bulk_mma_supports(int64_t m, int64_t n, int64_t k, int n_sms) {
  return gemv_bulk_mma_fits(m, n, k, GemvBulkMmaConfig{}, n_sms);
}

bool gemv_bulk_mma_preferred(int64_t m, int64_t n, int64_t k) {
  // Predicted (not measured) 90-93% of the read ceiling on the five 27B k 5120 / 6144 decode
  // shapes at m 3..16 vs cuBLASLt tuned 69-90% at m 16 (docs/perf/decode_gemv.md, last section).
  // Off unless $DS_GEMV_MMA=1; never where gemv_bulk is picked (m 1..2).
  if (!gemv_bulk_mma_enabled()) return false;
  if (m < 3 || m > kGemvBulkMmaMaxM || k < 4096 || k > 8192 || n < 4096) return false;
  if (gemv_bulk_preferred(m, n, k)) return false;
  return gemv_bulk_mma_supports(m, n, k, kGuardMinSms);
}

GemvBulkMmaConfig gemv_bulk_mma_config(int m, int n, int k) {
  (void)m, (void)n, (void)k;
  // Not tuned yet: 11 stages of 16 rows x 512 (176 KB of weights in flight per SM, 1 KB copies).
  // The bench rows also time k1024s5 (160 KB in flight, 2 KB copies); same bits.
  return {512, 11, false};
}

void launch_gemv_bulk_mma(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n,
                          int k, GemmOut out, bool accumulate, const GemvBulkMmaConfig& cfg,
                          int n_sms, cudaStream_t stream) {
  DS_CHECK(!accumulate, "bulk mma gemv: accumulate (y +=) is not supported");
  DS_CHECK(n_sms >= 1, "bulk mma gemv: n_sms must be positive");
  DS_CHECK(gemv_bulk_mma_fits(m, n, k, cfg, n_sms), "bulk mma gemv: unsupported shape or config m=",
           m, " n=", n, " k=", k, " config ", cfg.name(), " (needs m 1..", kGemvBulkMmaMaxM,
           ", k % 64 == 0, 64 <= k <= ", kSkinnyMaxK, ", kc 512 or 1024, slots 2..", kMaxSlots,
           " within ", kMaxSmem, " bytes of shared memory, at most ", kMaxGroups,
           " groups of 16 rows per block on ", n_sms, " SMs)");
  DS_CHECK(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0,
           "bulk mma gemv: x and w must be 16-byte aligned");
  DS_CHECK(y != nullptr, "bulk mma gemv: null output");
  const int blocks = grid_for(n, n_sms);
  if (cfg.kc == 512)
    launch_kc<512>(x, w, y, m, n, k, out, cfg, blocks, stream);
  else
    launch_kc<1024>(x, w, y, m, n, k, out, cfg, blocks, stream);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
