// Decode GEMV on tensor cores with the k dimension split over blocks, for the batch 5..16
// narrow-output projections: y[m, n] = x[m, k] w[n, k]^T, m = 1..16 tokens, bf16 in, fp32
// accumulation, bf16 or fp32 out, no accumulate. Built for Qwen3.5-27B's MLP down projection (n
// 5120, k 17408) and the mixers' out projections gdn_out / attn_o (n 5120, k 6144) at batch 16,
// where cuBLASLt tuned reaches 70-83% of the read ceiling and x [16, k] fits no block's shared
// memory next to a weight ring. Interface, guard and config in gemv.h; OFF unless
// $DS_GEMV_SPLITK is 1 / down / out: measured on the H200 in session 8, it is correct but slower
// than cuBLASLt alone (70-79% of the read ceiling at m 8..16) and in the decode step (+0.4 to +0.7
// ms at batch 8 / 16; docs/perf/2026-12-02-session8-AB.md). Tests:
// tests/cuda/cuda_gemv_test.cpp (CudaGemvSplitK.*); bench: `deltaserve bench kernels --only gemm`
// (rows gemm.gemv_splitk_mma).
//
// Method. 4 * G blocks = 4 k-splits x G row groups, G = min(SMs / 4, n / 8, 64) (33 on an H200):
// block (split s, group g) owns the 8-row tiles [g T / G, (g + 1) T / G) of the T = n / 8 tiles and
// k [s k / 4, (s + 1) k / 4). A producer warp streams the group's tiles of that k range through a
// ring of `slots` stages (one 1-D bulk copy per row into a padded shared-memory row, L2
// evict-first, an mbarrier per slot); the first `slots` tiles are issued before
// griddepcontrol.wait (the weights do not depend on the kernel before), so under programmatic
// dependent launch the stream starts while that kernel finishes. Sixteen consumer warps each own
// a fixed k range of 16 * STEPS inside the split and hold the MMA's A fragments of x for it (16
// tokens, zero rows past m) in registers for the whole kernel, loaded after the wait: x is read
// from global memory once per block and never staged in shared memory. Per tile each warp does
// STEPS mma.sync m16n8k16 (tokens as M, the tile's 8 rows as N; the k order inside a 16-step is
// permuted identically for x and w so that a lane's operands are 8 contiguous bytes), then the 16
// warps' fp32 tiles are summed in warp order through shared memory and stored as the block's fp32
// partial [split][row][token]. The last of a group's 4 blocks to finish (a per-group counter in
// the engine's workspace, reset by that block) sums the 4 partials in split order (four float4
// loads per 4 tokens, one L2 round trip for the whole group) and writes y.
// Every output is a fixed-order sum that depends on k only: bit-identical for every m (padding
// tokens are zeros and touch no other token), every grid and run to run.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/bulk_copy.cuh"
#include "cuda/cuda_common.h"
#include "cuda/gemv.h"

namespace ds::cuda {
namespace {

constexpr int kSplits = 4;          // k splits (blocks per row group)
constexpr int kMaxGroups = 64;      // row groups (the workspace's counters)
constexpr int kCw = 16;             // consumer warps
constexpr int kThreads = (kCw + 1) * 32;
constexpr int kMaxSlots = 8;        // ring stages of one 8-row tile
constexpr int kRowPad = 16;         // elements of padding per shared row (32 bytes: see below)
constexpr int kHdrBytes = 256;      // full[8], empty[8], the counter broadcast
constexpr int kMaxSmem = 232448;    // sm 90 opt-in dynamic shared memory per block
constexpr int kStepsDown = 17;      // k16-steps per warp: k = 4 * 16 * 16 * 17 = 17408
constexpr int kStepsOut = 6;        // k = 4 * 16 * 16 * 6 = 6144

// Shared memory: header | ring [slots][8][L + kRowPad] bf16 | red [2][kCw][kRedWarp] fp32,
// L = k / 4; a warp's 128 partial values are stored with 4 floats of padding after every 32
// (element e at e + 4 (e / 32)), so the summing threads' reads spread over all banks.
// Row stride (L + 16) * 2 bytes = 32 (mod 128) at L = 4352 / 1536 (any L % 64 == 0): the 8-byte
// operand loads of a half-warp (rows g 0..3, lanes t 0..3: 32 contiguous bytes per row) fall in
// four different bank groups.
constexpr size_t slot_bytes(int l) { return size_t(8) * size_t(l + kRowPad) * 2; }
constexpr int kRedWarp = 144;  // 128 values + 16 floats of padding
constexpr size_t red_bytes() { return size_t(2) * kCw * kRedWarp * 4; }
constexpr int slots_for(int l) {
  const size_t room = size_t(kMaxSmem) - kHdrBytes - red_bytes();
  return int(std::min<size_t>(kMaxSlots, room / slot_bytes(l)));
}
constexpr size_t smem_bytes(int l) {
  return kHdrBytes + size_t(slots_for(l)) * slot_bytes(l) + red_bytes();
}
static_assert(slots_for(kCw * 16 * kStepsDown) == 3, "down: 3 slots of 8 x 8.5 KiB rows");
static_assert(slots_for(kCw * 16 * kStepsOut) == 8, "out: 8 slots of 8 x 3 KiB rows");

int steps_for(int64_t k) {
  if (k == int64_t(kSplits) * kCw * 16 * kStepsDown) return kStepsDown;
  if (k == int64_t(kSplits) * kCw * 16 * kStepsOut) return kStepsOut;
  return 0;
}

template <int STEPS, typename OutT>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_splitk_mma_kernel(const bf16* x,  // [m, k]; no __restrict__: read after the wait
                           const bf16* __restrict__ w,  // [n, k]
                           OutT* __restrict__ y,        // [m, n]
                           int m, int n, int k,
                           float* __restrict__ part,  // [kSplits][n][16] fp32
                           int* __restrict__ count) { // [kMaxGroups], zero between launches
  constexpr int L = kCw * 16 * STEPS;  // k elements per split
  constexpr int kStride = L + kRowPad;
  constexpr int kSlots = slots_for(L);
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + kMaxSlots;
  int* last_flag = reinterpret_cast<int*>(empty + kMaxSlots);
  bf16* ring = reinterpret_cast<bf16*>(smem + kHdrBytes);
  float* red = reinterpret_cast<float*>(smem + kHdrBytes + kSlots * slot_bytes(L));

  const int split = blockIdx.x % kSplits, group = blockIdx.x / kSplits;
  const int groups = gridDim.x / kSplits, n_tiles = n / 8;
  const int tile0 = int(int64_t(n_tiles) * group / groups);
  const int tiles = int(int64_t(n_tiles) * (group + 1) / groups) - tile0;
  const int row0 = tile0 * 8, rows = tiles * 8;
  const int k0 = split * L;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kSlots; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], kCw);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  constexpr uint32_t kRowBytes = uint32_t(L) * 2u;
  uint64_t policy = 0;
  auto issue = [&](int t) {  // tile t of the group -> slot t % kSlots, row r by one copy
    const int slot = t % kSlots;
    mbar_arrive_expect_tx(&full[slot], 8u * kRowBytes);
    bf16* dst = ring + size_t(slot) * 8 * kStride;
    const bf16* src = w + size_t(row0 + t * 8) * k + k0;
    for (int r = 0; r < 8; ++r)
      bulk_copy(dst + size_t(r) * kStride, src + size_t(r) * k, kRowBytes, &full[slot], policy);
  };
  const bool producer = warp == kCw;
  // The weights do not depend on the previous kernel: start streaming them before waiting for it.
  if (producer && lane == 0) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int t = 0; t < min(kSlots, tiles); ++t) issue(t);
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // x comes from the kernel before, and the previous launch of this kernel's partials / counters
  // must be complete: everything below reads or writes only after this wait.
  asm volatile("griddepcontrol.wait;" ::: "memory");

  if (producer) {
    if (lane == 0)
      for (int t = kSlots; t < tiles; ++t) {
        mbar_wait(&empty[t % kSlots], uint32_t((t / kSlots) - 1) & 1u);
        issue(t);
      }
    return;
  }

  // A fragments of this warp's k range [kw, kw + 16 STEPS): lane = 4 g + t holds, per step j,
  // x[g][kw + 16 j + 4 t .. + 3] (a0 = the first two, a2 = the next two) and the same of token
  // g + 8 (a1, a3); B: w[row g][the same four k] (b0, b1). The MMA's logical k 2t, 2t + 1,
  // 2t + 8, 2t + 9 are these four physical k for both operands, so the sum is over the same
  // products (in the tensor core's own order within a step).
  const int g = lane >> 2, tq = lane & 3;
  const int kw = k0 + warp * 16 * STEPS;
  uint32_t a[STEPS][4];
  {
    const bool v0 = g < m, v1 = g + 8 < m;
    const bf16* x0 = x + size_t(v0 ? g : 0) * k + kw + 4 * tq;
    const bf16* x1 = x + size_t(v1 ? g + 8 : 0) * k + kw + 4 * tq;
#pragma unroll
    for (int j = 0; j < STEPS; ++j) {
      const uint2 p0 = v0 ? *reinterpret_cast<const uint2*>(x0 + 16 * j) : make_uint2(0, 0);
      const uint2 p1 = v1 ? *reinterpret_cast<const uint2*>(x1 + 16 * j) : make_uint2(0, 0);
      a[j][0] = p0.x, a[j][2] = p0.y, a[j][1] = p1.x, a[j][3] = p1.y;
    }
  }
  const int kl = warp * 16 * STEPS + 4 * tq;  // this lane's k offset inside a shared row
  for (int t = 0; t < tiles; ++t) {
    const int slot = t % kSlots;
    mbar_wait(&full[slot], uint32_t(t / kSlots) & 1u);
    const bf16* srow = ring + size_t(slot) * 8 * kStride + size_t(g) * kStride + kl;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < STEPS; ++j) {
      const uint2 b = *reinterpret_cast<const uint2*>(srow + 16 * j);
      mma_bf16(c, a[j], b.x, b.y);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);  // this warp's reads of the slot are done
    // The 16 warps' tiles, summed in warp order: element e of lane l = (token g + 8 (e / 2), row
    // 2 t + e % 2); thread i < 128 sums element (row i / 16, token i % 16) of the 8 x 16 tile.
    float* rb = red + size_t(t & 1) * kCw * kRedWarp;
    *reinterpret_cast<float4*>(rb + warp * kRedWarp + lane * 4 + 4 * (lane >> 3)) =
        make_float4(c[0], c[1], c[2], c[3]);
    asm volatile("bar.sync 1, %0;" ::"n"(kCw * 32) : "memory");
    if (threadIdx.x < 128) {
      const int row = threadIdx.x >> 4, token = threadIdx.x & 15;
      const int src = (4 * (token & 7) + (row >> 1)) * 4 + (token >> 3) * 2 + (row & 1);
      const int at = src + 4 * (src >> 5);
      float s = 0.f;
#pragma unroll
      for (int wv = 0; wv < kCw; ++wv) s += rb[wv * kRedWarp + at];
      part[(size_t(split) * n + row0 + t * 8 + row) * 16 + token] = s;
    }
    // red[t & 1] is written again at tile t + 2, after every warp has passed the barrier of tile
    // t + 1, which the summing threads reach only after their sums of tile t.
  }

  // The last of the group's kSplits blocks adds the partials in split order. Ordering as a grid
  // barrier orders it: the block's partial stores, then the barrier, then one thread's release
  // fence + atomic; the last block's thread 0 fences again after its atomic, and the barrier
  // after it orders the block's reads of the other blocks' partials (through L2) after that.
  asm volatile("bar.sync 1, %0;" ::"n"(kCw * 32) : "memory");
  if (threadIdx.x == 0) {
    __threadfence();
    *last_flag = atomicAdd(&count[group], 1) == kSplits - 1;
    __threadfence();
  }
  asm volatile("bar.sync 1, %0;" ::"n"(kCw * 32) : "memory");
  if (!*last_flag) return;
  // Item i = (quad q of 4 tokens, row r), rows fastest: a warp's stores of one token are 32
  // consecutive outputs. The four splits' float4 loads of an item are independent.
  const int quads = (m + 3) / 4;
  for (int i = threadIdx.x; i < quads * rows; i += kCw * 32) {
    const int q = i / rows, row = row0 + i % rows;
    float4 p[kSplits];
#pragma unroll
    for (int sp = 0; sp < kSplits; ++sp)
      p[sp] = __ldcg(reinterpret_cast<const float4*>(part + (size_t(sp) * n + row) * 16 + 4 * q));
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
    for (int sp = 0; sp < kSplits; ++sp) s0 += p[sp].x, s1 += p[sp].y, s2 += p[sp].z, s3 += p[sp].w;
    const int t0 = 4 * q;
    store_out(y, size_t(t0) * n + row, s0, false);
    if (t0 + 1 < m) store_out(y, size_t(t0 + 1) * n + row, s1, false);
    if (t0 + 2 < m) store_out(y, size_t(t0 + 2) * n + row, s2, false);
    if (t0 + 3 < m) store_out(y, size_t(t0 + 3) * n + row, s3, false);
  }
  if (threadIdx.x == 0) count[group] = 0;  // ready for the next launch (stream-ordered)
}

template <int STEPS, typename OutT>
void launch_t(const bf16* x, const bf16* w, OutT* y, int m, int n, int k, float* part, int* count,
              int groups, bool pdl, cudaStream_t stream) {
  auto* kern = gemv_splitk_mma_kernel<STEPS, OutT>;
  const size_t smem = smem_bytes(kCw * 16 * STEPS);
  ensure_smem_optin(reinterpret_cast<const void*>(kern), smem);
  launch_maybe_pdl(kern, dim3(kSplits * groups), dim3(kThreads), smem, stream, pdl, x, w, y, m, n,
                   k, part, count);
}

// $DS_GEMV_SPLITK: which shapes the registry may give the kernel.
enum class SplitKMode { kOff, kAll, kDown, kOut };
SplitKMode splitk_mode() {
  static const SplitKMode mode = [] {
    const char* e = std::getenv("DS_GEMV_SPLITK");
    const std::string v = e ? e : "";
    DS_CHECK(v.empty() || v == "0" || v == "1" || v == "down" || v == "out",
             "DS_GEMV_SPLITK must be 0, 1, down or out, got '", v, "'");
    if (v == "1") return SplitKMode::kAll;
    if (v == "down") return SplitKMode::kDown;
    if (v == "out") return SplitKMode::kOut;
    return SplitKMode::kOff;
  }();
  return mode;
}

}  // namespace

bool gemv_splitk_enabled() { return splitk_mode() != SplitKMode::kOff; }

bool gemv_splitk_supports(int64_t m, int64_t n, int64_t k) {
  return m >= 1 && m <= kGemvSplitKMaxM && steps_for(k) > 0 && n >= 8 && n % 8 == 0 &&
         n <= kGemvSplitKMaxN;
}

bool gemv_splitk_preferred(int64_t m, int64_t n, int64_t k) {
  const SplitKMode mode = splitk_mode();
  const bool shape_on = mode == SplitKMode::kAll ||
                        (mode == SplitKMode::kDown && steps_for(k) == kStepsDown) ||
                        (mode == SplitKMode::kOut && steps_for(k) == kStepsOut);
  return shape_on && m >= 5 && gemv_splitk_supports(m, n, k);
}

size_t gemv_splitk_workspace_bytes() {
  return size_t(kSplits) * kGemvSplitKMaxN * 16 * sizeof(float) + kMaxGroups * sizeof(int);
}

int gemv_splitk_blocks(int64_t n, int n_sms) {
  const int groups = int(std::max<int64_t>(1, std::min<int64_t>({n_sms / kSplits, n / 8,
                                                                 kMaxGroups})));
  return kSplits * groups;
}

void launch_gemv_splitk(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n,
                        int k, GemmOut out, bool accumulate, void* workspace, cudaStream_t stream,
                        int n_sms, bool pdl) {
  DS_CHECK(!accumulate, "split-k mma gemv: accumulate (y +=) is not supported");
  DS_CHECK(gemv_splitk_supports(m, n, k), "split-k mma gemv: unsupported shape m=", m, " n=", n,
           " k=", k, " (needs m 1..", kGemvSplitKMaxM, ", k ", kSplits * kCw * 16 * kStepsDown,
           " or ", kSplits * kCw * 16 * kStepsOut, ", n a multiple of 8 up to ", kGemvSplitKMaxN,
           ")");
  DS_CHECK(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0,
           "split-k mma gemv: x and w must be 16-byte aligned");
  DS_CHECK(y != nullptr && workspace != nullptr, "split-k mma gemv: null output or workspace");
  DS_CHECK((reinterpret_cast<uintptr_t>(workspace) & 15) == 0,
           "split-k mma gemv: the workspace must be 16-byte aligned");
  if (n_sms <= 0) {
    int dev = 0;
    DS_CUDA_CHECK(cudaGetDevice(&dev));
    DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, dev));
  }
  const int groups = gemv_splitk_blocks(n, n_sms) / kSplits;
  float* part = static_cast<float*>(workspace);
  int* count = reinterpret_cast<int*>(part + size_t(kSplits) * kGemvSplitKMaxN * 16);
  auto go = [&](auto* yt) {
    if (steps_for(k) == kStepsDown)
      launch_t<kStepsDown>(x, w, yt, m, n, k, part, count, groups, pdl, stream);
    else
      launch_t<kStepsOut>(x, w, yt, m, n, k, part, count, groups, pdl, stream);
  };
  if (out == GemmOut::kBF16)
    go(static_cast<bf16*>(y));
  else
    go(static_cast<float*>(y));
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
