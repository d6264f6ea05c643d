// Decode GEMV for narrow outputs and long rows: y[m, n] = x[m, k] w[n, k]^T (+ y) for m = 1..8
// tokens (as many as x fits in shared memory), bf16 in, fp32 accumulation, bf16 or fp32 out. Built
// for the Qwen3.5-27B MLP down projection (5120 x 17408: a 34.8 KB row, too long for the whole-row
// stages of gemv_bulk.cu) and measured on gdn_out / attn_o (5120 x 6144). Interface and guard in
// gemv.h; test tests/cuda/cuda_gemv_test.cpp (CudaGemvNarrow.*); bench `deltaserve bench kernels
// --only gemm` (rows gemm.gemv_narrow, and the A/B rows of every decode GEMV of the narrow shapes).
//
// Method: one persistent block per SM owns the contiguous rows [n b / G, n (b + 1) / G) (at most
// one row more than any other block: 39 vs 38 rows of 5120 on 132 SMs), i.e. one contiguous byte
// range of w. Each row is cut into C = gemv_narrow_slices(k) slices of L = gemv_narrow_slice_len(k)
// elements (C in {1, 2, 4, 8}, L <= 6144, a multiple of 8; 17408 -> 4 x 4352), and a stage of the
// shared-memory ring is one (row, slice): a producer lane streams the block's stages in memory
// order with 1-D bulk copies (cp.async.bulk, L2 evict-first, one mbarrier per slot; the first
// `slots` stages are issued before griddepcontrol.wait) and x [m, k] arrives with one bulk copy
// after the wait. Eight consumer warps take the stages round robin (stage s -> warp s % 8; slots
// is a multiple of 8, so a slot is always refilled for the warp that drained it), dot the slice
// with x (lane l sums the 16-byte vectors l, l + 32, ... of the slice; fp32 FMAs), release the
// slot, reduce across the warp with a fixed butterfly and park the slice's partial sum in shared
// memory. After the last stage the block sums each row's C partials in slice order and stores.
// The summation order of an output depends on k only (L and C are functions of k), never on m,
// the slot count or the grid: bit-identical across batch sizes and configs.
#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

#include "cuda/bulk_copy.cuh"
#include "cuda/cuda_common.h"
#include "cuda/gemv.h"

namespace ds::cuda {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * 32;  // + one producer warp
constexpr int kMaxSlots = 32;
constexpr int kMaxSliceLen = 6144;  // elements per stage (12 KB)
constexpr int kBarBytes = 128 * 5;  // full[32], empty[32], x barrier (+ padding)
constexpr int kMaxSmem = 232448;    // sm 90 opt-in dynamic shared memory per block
// The registry guards cannot see the device: they test the shared-memory fit for a grid of at
// least this many SMs (the partial sums grow as the grid shrinks); GemmEngine::run re-checks with
// the device's own count and falls back to cuBLASLt when it does not fit.
constexpr int kGuardMinSms = 64;

// Shared memory: [mbarriers (kBarBytes) | x [M, k] bf16 | ring [slots, L] bf16 |
// partial sums [rows_cap, C, M] fp32].
// AH (GemvNarrowConfig::l2_ahead, session 34): after the wait and x's copy, the producer queues
// the slices of its next `ahead` stages for L2 (cp.async.bulk.prefetch.L2), so that HBM streams
// while the consumers wait for x; their copies then hit L2. No value changes. Its own
// instantiation (M <= kGemvAheadMaxM, bf16 out), so the kernels without it keep their machine code.
template <int M, typename OutT, bool AH = false>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_narrow_kernel(const bf16* __restrict__ x,  // [M, k]
                       const bf16* __restrict__ w,  // [n, k]
                       OutT* __restrict__ y,        // [M, n]
                       int n, int k, int slice, int n_slices, int slots, bool accumulate,
                       bool interleave,
                       int ahead) {  // AH only
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxSlots;
  uint64_t* xbar = empty + kMaxSlots;
  bf16* xs = reinterpret_cast<bf16*>(smem + kBarBytes);
  bf16* ring = xs + size_t(M) * k;
  float* part = reinterpret_cast<float*>(ring + size_t(slots) * slice);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Contiguous: block b owns rows [row_begin, row_end); interleaved: rows b, b + G, ... (the grid
  // sweeps w front to back). Local row r of the block is global row row_of(r).
  const int G = gridDim.x, b = blockIdx.x;
  const int row_begin = int(int64_t(n) * b / G);
  const int n_rows = interleave ? max(0, (n - b + G - 1) / G)
                                : int(int64_t(n) * (b + 1) / G) - row_begin;
  auto row_of = [&](int r) { return interleave ? b + r * G : row_begin + r; };
  const int n_stages = n_rows * n_slices;

  if (threadIdx.x == 0) {
    for (int i = 0; i < slots; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 1);
    }
    mbar_init(xbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const bool producer = warp == kConsumerWarps;
  uint64_t policy = 0;
  // Stage s = (row row_begin + s / C, slice s % C): consecutive stages are consecutive bytes of w.
  auto issue = [&](int s) {
    const int slot = s % slots;
    const int row = row_of(s / n_slices), k0 = (s % n_slices) * slice;
    const uint32_t bytes = uint32_t(min(slice, k - k0)) * 2u;
    mbar_arrive_expect_tx(&full[slot], bytes);
    bulk_copy(ring + size_t(slot) * slice, w + size_t(row) * k + k0, bytes, &full[slot], policy);
  };
  // The weights do not depend on the previous kernel: start streaming them before waiting for it.
  if (producer && lane == 0) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int s = 0; s < min(slots, n_stages); ++s) issue(s);
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");

  if (producer) {
    if (lane == 0) {
      // x (written by the previous kernel) only after the wait; one copy, M * k * 2 bytes.
      mbar_arrive_expect_tx(xbar, uint32_t(M) * uint32_t(k) * 2u);
      bulk_copy(xs, x, uint32_t(M) * uint32_t(k) * 2u, xbar);
      if constexpr (AH) {
        for (int s = slots; s < min(slots + ahead, n_stages); ++s) {
          const int row = row_of(s / n_slices), k0 = (s % n_slices) * slice;
          bulk_prefetch_l2(w + size_t(row) * k + k0, uint32_t(min(slice, k - k0)) * 2u);
        }
      }
      for (int s = slots; s < n_stages; ++s) {
        const int slot = s % slots;
        mbar_wait(&empty[slot], uint32_t((s / slots) - 1) & 1u);
        issue(s);
      }
    }
    return;
  }

  mbar_wait(xbar, 0);
  for (int s = warp; s < n_stages; s += kConsumerWarps) {
    const int slot = s % slots;
    const int k0 = (s % n_slices) * slice;
    const int nv = min(slice, k - k0) / 8;
    mbar_wait(&full[slot], uint32_t(s / slots) & 1u);
    const bf16* ws = ring + size_t(slot) * slice;
    const bf16* xk = xs + k0;
    float acc[M];  // (part: the block's shared partial sums)
#pragma unroll
    for (int t = 0; t < M; ++t) acc[t] = 0.f;
#pragma unroll 4
    for (int v = lane; v < nv; v += 32) {
      float wf[8];
      unpack8(*reinterpret_cast<const uint4*>(ws + size_t(v) * 8), wf);
#pragma unroll
      for (int t = 0; t < M; ++t) {
        float xf[8];
        unpack8(*reinterpret_cast<const uint4*>(xk + size_t(t) * k + size_t(v) * 8), xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[t] = fmaf(wf[e], xf[e], acc[t]);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);  // every lane's reads of the slot are done
#pragma unroll
    for (int t = 0; t < M; ++t) {
      const float v = warp_sum(acc[t]);
      if (lane == t) part[size_t(s) * M + t] = v;
    }
  }
  // The consumer warps only (the producer warp has returned): every partial is parked.
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
  const int n_out = n_rows * M;
  for (int i = threadIdx.x; i < n_out; i += kConsumerWarps * 32) {
    const int r = i / M, t = i - r * M;
    const float* p = part + size_t(r) * n_slices * M + t;
    float sum = p[0];
    for (int c = 1; c < n_slices; ++c) sum += p[size_t(c) * M];
    store_out(y, size_t(t) * n + row_of(r), sum, accumulate);
  }
}

int grid_blocks(int n, int n_sms) { return std::max(1, std::min(n_sms, n)); }

size_t smem_bytes(int m, int n, int k, int slots, int n_sms) {
  const int blocks = grid_blocks(n, n_sms);
  const size_t rows_cap = (size_t(n) + blocks - 1) / blocks;
  const int c = gemv_narrow_slices(k);
  return size_t(kBarBytes) + size_t(m) * k * 2 + size_t(slots) * gemv_narrow_slice_len(k) * 2 +
         rows_cap * c * m * 4;
}

template <int M, typename OutT>
void launch_t(const bf16* x, const bf16* w, void* y, int n, int k, bool accumulate,
              const GemvNarrowConfig& c, int n_sms, cudaStream_t stream) {
  auto* kern = gemv_narrow_kernel<M, OutT>;
  if constexpr (M <= kGemvAheadMaxM && std::is_same_v<OutT, bf16>) {
    if (c.l2_ahead > 0) kern = gemv_narrow_kernel<M, OutT, true>;
  }
  // The opt-in shared memory size belongs to the device's context: once per (kernel, device), not
  // per process (a std::call_once left the first launch on a second device failing).
  ensure_smem_optin(reinterpret_cast<const void*>(kern), kMaxSmem);
  launch_maybe_pdl(kern, dim3(grid_blocks(n, n_sms)), dim3(kThreads),
                   smem_bytes(M, n, k, c.slots, n_sms), stream, c.pdl, x, w, static_cast<OutT*>(y),
                   n, k, gemv_narrow_slice_len(k), gemv_narrow_slices(k), c.slots, accumulate,
                   c.interleave, c.l2_ahead);
}

template <int M>
void launch_m(const bf16* x, const bf16* w, void* y, int n, int k, GemmOut out, bool acc,
              const GemvNarrowConfig& c, int n_sms, cudaStream_t s) {
  if (out == GemmOut::kBF16)
    launch_t<M, bf16>(x, w, y, n, k, acc, c, n_sms, s);
  else
    launch_t<M, float>(x, w, y, n, k, acc, c, n_sms, s);
}

}  // namespace

std::string GemvNarrowConfig::name() const {
  std::ostringstream os;
  os << "s" << slots << (pdl ? "-pdl" : "") << (interleave ? "-ilv" : "");
  if (l2_ahead > 0) os << "-a" << l2_ahead;
  return os.str();
}

int gemv_narrow_ahead_stages(int kib, int64_t k) {
  if (kib <= 0 || k < 8) return 0;
  return gemv_ahead_stages_for(kib, int64_t(gemv_narrow_slice_len(k)) * 2);
}

int gemv_narrow_slices(int64_t k) {
  int c = 1;
  while (c < 8 && (k + c - 1) / c > kMaxSliceLen) c *= 2;
  return c;
}

int gemv_narrow_slice_len(int64_t k) {
  const int c = gemv_narrow_slices(k);
  return int(((k + c - 1) / c + 7) / 8 * 8);
}

bool gemv_narrow_fits(int64_t m, int64_t n, int64_t k, const GemvNarrowConfig& c, int n_sms) {
  if (m < 1 || m > kGemvNarrowMaxM || n < 1 || n > kSkinnyMaxN || k < 8 || k % 8 != 0 ||
      k > kSkinnyMaxK || n_sms < 1)
    return false;
  if (c.slots < kConsumerWarps || c.slots > kMaxSlots || c.slots % kConsumerWarps != 0)
    return false;
  // every slice non-empty (the last one may be shorter)
  if (int64_t(gemv_narrow_slices(k) - 1) * gemv_narrow_slice_len(k) >= k) return false;
  return smem_bytes(int(m), int(n), int(k), c.slots, n_sms) <= size_t(kMaxSmem);
}

bool gemv_narrow_supports(int64_t m, int64_t n, int64_t k, int n_sms) {
  return gemv_narrow_fits(m, n, k, {kConsumerWarps, false}, n_sms);
}

std::vector<GemvNarrowConfig> gemv_narrow_configs(int m, int n, int k, int n_sms) {
  std::vector<GemvNarrowConfig> v;
  for (int s : {8, 16, 24, 32})
    if (gemv_narrow_fits(m, n, k, {s, false}, n_sms)) v.push_back({s, false});
  return v;
}

GemvNarrowConfig gemv_narrow_config(int m, int n, int k, int n_sms) {
  // The deepest ring up to ~200 KB of weights in flight per SM that fits next to x: the down
  // projection 16 stages of 8.5 KB at m 1..2, 8 at m 3..4; gdn_out / attn_o 16 stages of 12 KB
  // at m 1..2 (gemv_bulk's choice at m 1), 8 from m 3.
  GemvNarrowConfig c{kConsumerWarps, false};
  for (int s : {16, 24, 32})
    if (size_t(s) * gemv_narrow_slice_len(k) * 2 <= size_t(200) << 10 &&
        gemv_narrow_fits(m, n, k, {s, false}, n_sms))
      c.slots = s;
  c.interleave = gemv_interleave_narrow();
  return c;
}

bool gemv_narrow_preferred(int64_t m, int64_t n, int64_t k) {
  // The MLP down projection of the 27B (5120 x 17408), H200 (cuda_gemv_test CudaGemvNarrow.Sweep,
  // rotating weights, us, narrow / with PDL back to back vs skinny_mma vs cuBLASLt tuned): m 1
  // 44.55 / 41.54 vs 47.87 vs 46.95, m 2 46.25 / 43.10 vs 48.20 vs 47.07; it loses from m 3
  // (51.32 / 48.24 vs 47.94; m 4 57.49 vs 47.73: the SIMT consumers re-read and unpack x per
  // weight vector, and only 8 stages fit next to x). 27B decode step (bench decode @ 4K, same
  // call): b1 13.261 vs 13.678 ms with skinny_mma, b2 13.717 vs 14.037; with m 3..4 too, b4 lost
  // 0.46 ms. n <= 8192 and k 12288..32768 bound it to what was measured.
  return m >= 1 && m <= 2 && n >= 1024 && n <= 8192 && k >= 12288 && k <= kSkinnyMaxK &&
         k % 8 == 0 && gemv_narrow_supports(m, n, k, kGuardMinSms);
}

void launch_gemv_narrow(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n,
                        int k, GemmOut out, bool accumulate, const GemvNarrowConfig& cfg, int n_sms,
                        cudaStream_t stream) {
  DS_CHECK(n_sms >= 1, "narrow gemv: n_sms must be positive, got ", n_sms);
  DS_CHECK(gemv_narrow_supports(m, n, k, n_sms), "narrow gemv: unsupported shape m=", m, " n=", n,
           " k=", k, " (needs m 1..", kGemvNarrowMaxM, ", k % 8 == 0, 8 <= k <= ", kSkinnyMaxK,
           ", x, 8 stages and the partial sums within ", kMaxSmem, " bytes of shared memory)");
  DS_CHECK(gemv_narrow_fits(m, n, k, cfg, n_sms), "narrow gemv: config ", cfg.name(),
           " does not fit m=", m, " n=", n, " k=", k,
           " (partial sums 1, or 4 at m 1; slots a multiple of 8 up to ", kMaxSlots,
           ", shared memory <= ", kMaxSmem, " bytes)");
  DS_CHECK(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0,
           "narrow gemv: x and w must be 16-byte aligned");
  DS_CHECK(y != nullptr, "narrow gemv: null output");
  DS_CHECK(cfg.l2_ahead >= 0 && (cfg.l2_ahead == 0 || (m <= kGemvAheadMaxM && out == GemmOut::kBF16)),
           "narrow gemv: l2_ahead is compiled for m 1..", kGemvAheadMaxM, " and bf16 out (got m=",
           m, ", config ", cfg.name(), ")");
  switch (m) {
    case 1:
      launch_m<1>(x, w, y, n, k, out, accumulate, cfg, n_sms, stream);
      break;
    case 2:
      launch_m<2>(x, w, y, n, k, out, accumulate, cfg, n_sms, stream);
      break;
    case 3:
      launch_m<3>(x, w, y, n, k, out, accumulate, cfg, n_sms, stream);
      break;
    case 4:
      launch_m<4>(x, w, y, n, k, out, accumulate, cfg, n_sms, stream);
      break;
    case 5:
      launch_m<5>(x, w, y, n, k, out, accumulate, cfg, n_sms, stream);
      break;
    case 6:
      launch_m<6>(x, w, y, n, k, out, accumulate, cfg, n_sms, stream);
      break;
    case 7:
      launch_m<7>(x, w, y, n, k, out, accumulate, cfg, n_sms, stream);
      break;
    default:
      launch_m<8>(x, w, y, n, k, out, accumulate, cfg, n_sms, stream);
      break;
  }
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
