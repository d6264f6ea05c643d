// Decode GEMV / skinny GEMM on tensor cores: y[m, n] = x[m, k] w[n, k]^T (+ y), m <= 16 (see
// gemv.h for the method and the guard). Shapes it is tuned for (Qwen3.5-27B decode): gdn_in
// 16480x5120, gate_up 34816x5120, down 5120x17408, gdn_out / attn_o 5120x6144, attn_qkv
// 14336x5120, lm_head 248320x5120 (fp32 out). Test: tests/cuda/cuda_gemv_test.cpp; bench:
// `deltaserve bench kernels --only gemm`.
//
// Fragment layout of mma.sync.m16n8k16.row.col (g = lane / 4, t = lane % 4):
//   A (16 x 16, tokens x k): reg0 = (tok g, k 2t..2t+1),   reg1 = (tok g+8, k 2t..2t+1),
//                            reg2 = (tok g, k 2t+8..2t+9), reg3 = (tok g+8, k 2t+8..2t+9)
//   B (16 x 8, k x rows):    reg0 = (k 2t..2t+1, row g),   reg1 = (k 2t+8..2t+9, row g)
//   C (16 x 8, fp32):        c0, c1 = (tok g, rows 2t, 2t+1), c2, c3 = (tok g+8, rows 2t, 2t+1)
// Lane (g, t) loads 8 contiguous k (16 bytes) at k0 + 8t of token g (x) and of row g (w). Logical
// k {2t, 2t+1, 2t+8, 2t+9} of the first MMA are its elements {0, 1, 2, 3}, of the second MMA
// {4, 5, 6, 7}: the same permutation on both operands, so the two MMAs sum exactly the 32 k of
// the step [k0, k0 + 32).
#include <cstdint>
#include <sstream>

#include "cuda/cuda_common.h"
#include "cuda/gemv.h"

namespace ds::cuda {
namespace {

// 16-byte load through the read-only path, predicated in PTX (zero when !pred) so that no
// branch splits the load batch; CACHE_OP is the PTX cache qualifier.
#define DS_GEMV_LD16(CACHE_OP)                                               \
  asm volatile(                                                              \
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"                          \
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n" \
      " @p ld.global.nc" CACHE_OP ".v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"     \
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)                           \
      : "l"(p), "r"(int(pred)))

// Streaming weight load (no L1 allocation: each byte is used once).
__device__ __forceinline__ uint4 ld_stream16(const bf16* p, bool pred) {
  uint4 r;
  DS_GEMV_LD16(".L1::no_allocate");
  return r;
}

// Activation load, cached (every block of the grid reads the same x).
__device__ __forceinline__ uint4 ld_cached16(const bf16* p, bool pred) {
  uint4 r;
  DS_GEMV_LD16("");
  return r;
}
#undef DS_GEMV_LD16

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, "
      "%2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One block: weight rows [blockIdx.x * 8 * NT, + 8 * NT), all m tokens. Warp
// `warp` takes the k-steps (32 wide) s = warp * U + i * WARPS * U + u, u < U: U
// consecutive steps, so each warp iteration reads U * 64 contiguous bytes of
// every row it owns, all loads issued before the MMAs. HI: m > 8 (tokens 8..15
// in the MMA's upper half; otherwise those registers are zero). The min-blocks
// bound (512 threads per SM, so up to 128 registers) matters: without it ptxas
// aims at full occupancy and sinks each load next to its MMA, leaving one or
// two loads in flight per warp (seen in the SASS); with it, every load of an
// iteration is issued before the MMAs.
template <int NT, int WARPS, int U, bool HI, typename OutT>
__global__ void __launch_bounds__(WARPS * 32, 16 / WARPS)
    skinny_gemm_kernel(const bf16* __restrict__ x,  // [m, k]
                       const bf16* __restrict__ w,  // [n, k]
                       OutT* __restrict__ y,        // [m, n]
                       int m, int n, int k, bool accumulate) {
  __shared__ float red[WARPS][NT][4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * (8 * NT);

  const bf16* wr[NT];
  bool w_ok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int r = row0 + j * 8 + g;
    w_ok[j] = r < n;
    wr[j] = w + size_t(w_ok[j] ? r : 0) * k + t * 8;
  }
  // Programmatic dependent launch: the weights do not depend on the kernel before this one, so
  // this warp's first iteration of them is pulled into L2 while that kernel finishes; x and y are
  // touched only after griddepcontrol.wait (a no-op when launched without the PDL attribute).
  // Dependents may launch once every block got here; they wait for this grid the same way.
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int kk = (warp * U + u) * 32;
#pragma unroll
    for (int j = 0; j < NT; ++j)
      if (kk + t * 8 < k && w_ok[j]) asm volatile("prefetch.global.L2 [%0];" ::"l"(wr[j] + kk));
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");

  const bool x0_ok = g < m, x1_ok = HI && g + 8 < m;
  const bf16* xr0 = x + size_t(x0_ok ? g : 0) * k + t * 8;
  const bf16* xr1 = x + size_t(x1_ok ? g + 8 : 0) * k + t * 8;

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int s0 = warp * U; s0 * 32 < k; s0 += WARPS * U) {
    uint4 wv[U][NT], xv0[U], xv1[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = (s0 + u) * 32;
      const bool ok = kk + t * 8 < k;  // k % 8 == 0: a lane's chunk is all in or all out
#pragma unroll
      for (int j = 0; j < NT; ++j) wv[u][j] = ld_stream16(wr[j] + kk, ok && w_ok[j]);
      xv0[u] = ld_cached16(xr0 + kk, ok && x0_ok);
      xv1[u] = HI ? ld_cached16(xr1 + kk, ok && x1_ok) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        mma_16816(acc[j], xv0[u].x, xv1[u].x, xv0[u].y, xv1[u].y, wv[u][j].x, wv[u][j].y);
        mma_16816(acc[j], xv0[u].z, xv1[u].z, xv0[u].w, xv1[u].w, wv[u][j].z, wv[u][j].w);
      }
  }

  // Sum the warps' partial tiles (fixed order: deterministic) and write the
  // outputs.
  auto emit = [&](int j, int q, int l, float v) {
    const int tok = (l >> 2) + (q >= 2 ? 8 : 0);
    const int row = row0 + j * 8 + 2 * (l & 3) + (q & 1);
    if (tok < m && row < n) store_out(y, size_t(tok) * n + row, v, accumulate);
  };
  if constexpr (WARPS == 1) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < (HI ? 4 : 2); ++q) emit(j, q, lane, acc[j][q]);
  } else {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < (HI ? 4 : 2); ++q) red[warp][j][q][lane] = acc[j][q];
    __syncthreads();
    for (int i = threadIdx.x; i < NT * 128; i += WARPS * 32) {
      const int l = i & 31, q = (i >> 5) & 3, j = i >> 7;
      if (!HI && q >= 2) continue;
      float v = 0.f;
#pragma unroll
      for (int ww = 0; ww < WARPS; ++ww) v += red[ww][j][q][l];
      emit(j, q, l, v);
    }
  }
}

template <int NT, int WARPS, int U, bool HI, typename OutT>
void launch_cfg(const bf16* x, const bf16* w, void* y, int m, int n, int k, bool accumulate,
                bool pdl, cudaStream_t stream) {
  const int blocks = (n + 8 * NT - 1) / (8 * NT);
  launch_maybe_pdl(skinny_gemm_kernel<NT, WARPS, U, HI, OutT>, dim3(blocks), dim3(WARPS * 32), 0,
                   stream, pdl, x, w, static_cast<OutT*>(y), m, n, k, accumulate);
}

template <int NT, int WARPS, int U>
bool launch_nwu(const SkinnyConfig& c, const bf16* x, const bf16* w, void* y, int m, int n, int k,
                GemmOut out, bool accumulate, cudaStream_t stream) {
  if (c.n_tile != NT || c.warps != WARPS || c.unroll != U) return false;
  const bool hi = m > 8;
  if (out == GemmOut::kBF16) {
    if (hi)
      launch_cfg<NT, WARPS, U, true, bf16>(x, w, y, m, n, k, accumulate, c.pdl, stream);
    else
      launch_cfg<NT, WARPS, U, false, bf16>(x, w, y, m, n, k, accumulate, c.pdl, stream);
  } else {
    if (hi)
      launch_cfg<NT, WARPS, U, true, float>(x, w, y, m, n, k, accumulate, c.pdl, stream);
    else
      launch_cfg<NT, WARPS, U, false, float>(x, w, y, m, n, k, accumulate, c.pdl, stream);
  }
  return true;
}

// The compiled configs: n_tile x warps x unroll.
// (unroll 8 only with n_tile <= 2: 4 x 8 weight loads in flight would not fit
// the registers)
template <int NT, int WARPS>
bool launch_nw(const SkinnyConfig& c, const bf16* x, const bf16* w, void* y, int m, int n, int k,
               GemmOut out, bool accumulate, cudaStream_t stream) {
  if (launch_nwu<NT, WARPS, 2>(c, x, w, y, m, n, k, out, accumulate, stream) ||
      launch_nwu<NT, WARPS, 4>(c, x, w, y, m, n, k, out, accumulate, stream))
    return true;
  if constexpr (NT <= 2)
    return launch_nwu<NT, WARPS, 8>(c, x, w, y, m, n, k, out, accumulate, stream);
  return false;
}

bool launch_any(const SkinnyConfig& c, const bf16* x, const bf16* w, void* y, int m, int n, int k,
                GemmOut out, bool accumulate, cudaStream_t stream) {
  return launch_nw<1, 4>(c, x, w, y, m, n, k, out, accumulate, stream) ||
         launch_nw<1, 8>(c, x, w, y, m, n, k, out, accumulate, stream) ||
         launch_nw<2, 4>(c, x, w, y, m, n, k, out, accumulate, stream) ||
         launch_nw<2, 8>(c, x, w, y, m, n, k, out, accumulate, stream) ||
         launch_nw<4, 4>(c, x, w, y, m, n, k, out, accumulate, stream) ||
         launch_nw<4, 8>(c, x, w, y, m, n, k, out, accumulate, stream);
}

}  // namespace

std::string SkinnyConfig::name() const {
  std::ostringstream os;
  os << "nt" << n_tile << "w" << warps << "u" << unroll << (pdl ? "-pdl" : "");
  return os.str();
}

std::vector<SkinnyConfig> skinny_gemm_configs() {
  std::vector<SkinnyConfig> v;
  for (int nt : {1, 2, 4})
    for (int wp : {4, 8})
      for (int u : {2, 4, 8})
        if (nt * u <= 16) v.push_back({nt, wp, u, false});
  return v;
}

bool skinny_gemm_supports(int64_t m, int64_t n, int64_t k) {
  return m >= 1 && m <= kSkinnyMaxM && n >= 1 && n <= kSkinnyMaxN && k >= 8 && k <= kSkinnyMaxK &&
         k % 8 == 0;
}

SkinnyConfig skinny_gemm_config(int m, int n, int k, int n_sms) {
  (void)n_sms;
  // From two config sweeps on the H200 (cuda_gemv_test DS_GEMV_SWEEP=1, 2026-11-29): narrow
  // outputs (5120 rows) and long rows (down, k 17408) do best with 16-row blocks of 8 warps and 2
  // k-steps per iteration; the wider ones with 8 k-steps per iteration and 4 warps, 8-row blocks
  // up to 8 tokens, 16-row blocks above (half the x re-reads). warps and unroll depend on (n, k)
  // only: every m of a shape sums in the same order (batch-invariant). PDL off: it helped the
  // 4-warp configs by 1-2 us but cost the 8-warp ones up to 11 us (the next kernel's waiting blocks
  // hold one of only two block slots per SM while this one drains).
  SkinnyConfig c;
  if (n <= 8192 || k >= 12288) {
    c.n_tile = 2, c.warps = 8, c.unroll = 2;
  } else {
    c.n_tile = m > 8 ? 2 : 1, c.warps = 4, c.unroll = 8;
  }
  c.pdl = false;
  return c;
}

bool skinny_gemm_preferred(int64_t m, int64_t n, int64_t k) {
  // Measured faster than cuBLASLt only on the long-row shapes: down 5120 x 17408 at 47.0-47.9 us
  // vs 50.5-51.7 us (m 1 and 4), 51.1-51.5 vs 52.8 (m 16), in both sweeps. On the 5120-k shapes
  // it ties or loses by 1-10% (cuBLASLt 3.7-4.1 TB/s there), so those stay with cuBLASLt.
  // m <= 4: the whole decode step decides (H200, b3a8664, same call, bench decode with and without
  // gemm.skinny_mma, i.e. cuBLASLt tuned for the down projection): batch 16 at 4K 17.145 vs
  // 17.520 ms with skinny_mma, batch 4 14.724 vs 14.736 (a tie); bench kernels down m 16: cuBLASLt
  // tuned 47.4 vs 49.9 us. m 5..15 follow m 16 (not measured one by one); m 1..2 run gemv_narrow.
  return skinny_gemm_supports(m, n, k) && k >= 12288 && m <= 4;
}

void launch_skinny_gemm(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n,
                        int k, GemmOut out, bool accumulate, const SkinnyConfig& cfg,
                        cudaStream_t stream) {
  DS_CHECK(skinny_gemm_supports(m, n, k), "skinny gemm: unsupported shape m=", m, " n=", n,
           " k=", k, " (needs m 1..", kSkinnyMaxM, ", k % 8 == 0, k <= ", kSkinnyMaxK,
           ", n <= ", kSkinnyMaxN, ")");
  DS_CHECK(((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0,
           "skinny gemm: x and w must be 16-byte aligned");
  DS_CHECK(y != nullptr, "skinny gemm: null output");
  DS_CHECK(launch_any(cfg, x, w, y, m, n, k, out, accumulate, stream), "skinny gemm: config ",
           cfg.name(), " is not compiled");
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
