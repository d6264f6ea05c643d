// Residual add fused with RMSNorm (SPEC.md "RMSNorm"): per row,
//   residual = bf16(residual + delta)   (when delta is given; the residual stream is bf16)
//   out = bf16(residual * rsqrt(mean(residual^2) + eps) * (weight_offset + w))   in fp32.
// weight_offset 1 gives Qwen3.5's zero-centred norms (input/post-attention/final). One block per
// row; the row and the weights are held in registers (d <= 256 threads * 8 * kMaxVec), 16-byte
// loads when d % 8 == 0, all before the reduction. (Not all in one memory round trip: each new
// residual vector is stored before the next is loaded, as delta may alias it; see pdl_enter.)
// Shapes: any d up to 16384 (5120 for 27B). Tested in tests/cuda/cuda_kernels_test.cpp against a
// CPU loop (normalised L2 error < 4e-3; the bf16 residual bit-exact).
// Programmatic dependent launch (see pdl_enter): launched with PDL unless $DS_NORM_PDL=0, and it
// lets its dependent (a PDL-launched decode GEMV) start at once; 27B decode graph, batch 1 at 4K,
// with the bulk GEMVs' PDL: 13.572 vs 13.698 ms per token (docs/perf/decode_gemv.md).
// The decode step mostly runs this norm inside the bulk GEMVs' prologue instead (gemv_bulk.cu
// norm_to_shared, cuda/gemv_bulk_norm.h), which reproduces add_rmsnorm_vec_kernel's sums and
// expressions bit for bit: change the two together (tests/cuda/cuda_gemv_norm_test.cpp).
// Prompt chunks (>= kRmsNormFitMinRows rows) run the same kernel compiled for the vectors per
// thread that d needs (VEC 3 at d 5120 instead of 8): the same bits, far fewer registers
// (issue 7, docs/perf/prefill_gaps.md); $DS_NORM_FIT=0 keeps the 8-vector build everywhere.
// Decode norms (fewer than kRmsNormFitMinRows rows) keep the 8-vector build: other forms of it
// (the dependent triggered after the loads; every load before the first store; the form after the
// cuBLASLt out-projections apart) gave the same bits and no faster step on the H100 or the H200
// (sessions 30-31, docs/perf/decode_gemv.md) and were removed.
#include <cstdlib>
#include <string>

#include "cuda/cuda_common.h"
#include "cuda/kernels.h"

namespace ds::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxVec = 8;  // 16-byte vectors per thread: d <= 256 * 8 * 8 = 16384

// Programmatic dependent launch, both sides, first thing in the kernel:
// - trigger: a dependent launched with programmatic stream serialization (the decode GEMVs) may
//   start now; it reads this kernel's output only after its griddepcontrol.wait, which waits for
//   this whole grid to finish and flush. No effect on a dependent launched without PDL.
// - wait: when this kernel itself was launched with PDL (rmsnorm_pdl_enabled()), nothing before
//   it is guaranteed finished until here, so every load and store comes after. A no-op otherwise.
// Triggering before waiting is safe: the dependent's wait needs this grid complete, which needs
// this grid's wait to have returned, i.e. the kernel before this one complete too.
// What the kernel before writes (delta, residual) is read through plain pointers, never
// `const __restrict__`: those compile to ld.global.nc, which ptxas may schedule above the wait
// (it did so in the GDN decode kernels: stale reads on the H200; docs/perf/decode_kernels.md).
__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// VEC = the 16-byte vectors per thread the kernel holds in registers (d / 8 <= kThreads * VEC).
// The loops run over VEC slots with the same guard, so every VEC >= ceil(d / 8 / kThreads) sums a
// row in the same order and gives the same bits: kMaxVec is the first version (any d, but 125
// registers, 2 blocks per SM), add_rmsnorm_vec_kernel<vec_fit(d)> the prompt-chunk one (issue 7:
// d 5120 -> VEC 3, a fraction of the registers, several blocks per SM, more bytes in flight).
template <int VEC>
__global__ void __launch_bounds__(kThreads)
    add_rmsnorm_vec_kernel(bf16* __restrict__ residual,  // [n_rows, d]
                           const bf16* delta,            // [n_rows, d] or null
                           const bf16* __restrict__ w,   // [d]
                           int d, float eps, float w_off,
                           bf16* __restrict__ out) {  // [n_rows, d]
  pdl_enter();
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int d8 = d / 8;
  uint4* res4 = reinterpret_cast<uint4*>(residual + row * d);
  const uint4* del4 = delta ? reinterpret_cast<const uint4*>(delta + row * d) : nullptr;
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  float x[VEC][8];
  uint4 wv[VEC];  // the weights are loaded with the row: one memory round trip, not two
  float ss = 0.f;
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const int i = threadIdx.x + v * kThreads;
    if (i < d8) {
      wv[v] = w4[i];
      uint4 r = res4[i];
      const bf16* rb = reinterpret_cast<const bf16*>(&r);
      if (del4) {
        uint4 dd = del4[i];
        const bf16* db = reinterpret_cast<const bf16*>(&dd);
        uint4 nr;
        bf16* nb = reinterpret_cast<bf16*>(&nr);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          nb[j] = __float2bfloat16_rn(__bfloat162float(rb[j]) + __bfloat162float(db[j]));
          x[v][j] = __bfloat162float(nb[j]);
        }
        res4[i] = nr;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) x[v][j] = __bfloat162float(rb[j]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += x[v][j] * x[v][j];
    }
  }
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / d + eps);
  uint4* out4 = reinterpret_cast<uint4*>(out + row * d);
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const int i = threadIdx.x + v * kThreads;
    if (i < d8) {
      const bf16* wb = reinterpret_cast<const bf16*>(&wv[v]);
      uint4 o;
      bf16* ob = reinterpret_cast<bf16*>(&o);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        ob[j] = __float2bfloat16_rn(x[v][j] * inv * (w_off + __bfloat162float(wb[j])));
      out4[i] = o;
    }
  }
}

// Any d: two passes over the row (re-read from L1/L2).
__global__ void __launch_bounds__(kThreads)
    add_rmsnorm_kernel(bf16* __restrict__ residual, const bf16* delta,
                       const bf16* __restrict__ w, int d, float eps, float w_off,
                       bf16* __restrict__ out) {
  pdl_enter();
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  bf16* r = residual + row * d;
  float ss = 0.f;
  for (int i = threadIdx.x; i < d; i += kThreads) {
    float x = __bfloat162float(r[i]);
    if (delta) {
      bf16 nb = __float2bfloat16_rn(x + __bfloat162float(delta[row * d + i]));
      r[i] = nb;
      x = __bfloat162float(nb);
    }
    ss += x * x;
  }
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / d + eps);
  for (int i = threadIdx.x; i < d; i += kThreads)
    out[row * d + i] =
        __float2bfloat16_rn(__bfloat162float(r[i]) * inv * (w_off + __bfloat162float(w[i])));
}

}  // namespace

void launch_add_rmsnorm(bf16* residual, const bf16* delta, const bf16* w, int n_rows, int d,
                        float eps, float weight_offset, bf16* out, cudaStream_t stream) {
  launch_add_rmsnorm(residual, delta, w, n_rows, d, eps, weight_offset, out, stream,
                     RmsNormKernel::kAuto);
}

void launch_add_rmsnorm(bf16* residual, const bf16* delta, const bf16* w, int n_rows, int d,
                        float eps, float weight_offset, bf16* out, cudaStream_t stream,
                        RmsNormKernel which) {
  if (n_rows <= 0) return;
  DS_CHECK(d > 0, "rmsnorm: width must be positive, got ", d);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = d % 8 == 0 && d / 8 <= kThreads * kMaxVec && aligned(residual) &&
                   (!delta || aligned(delta)) && aligned(w) && aligned(out);
  void (*kernel)(bf16*, const bf16*, const bf16*, int, float, float, bf16*) = add_rmsnorm_kernel;
  if (vec) {
    kernel = add_rmsnorm_vec_kernel<kMaxVec>;
    const bool fit = which == RmsNormKernel::kFit ||
                     (which == RmsNormKernel::kAuto && n_rows >= kRmsNormFitMinRows &&
                      rmsnorm_fit_enabled());
    if (fit) {
      const int need = (d / 8 + kThreads - 1) / kThreads;  // 16-byte vectors per thread
      kernel = need <= 1   ? add_rmsnorm_vec_kernel<1>
               : need <= 2 ? add_rmsnorm_vec_kernel<2>
               : need <= 3 ? add_rmsnorm_vec_kernel<3>
               : need <= 4 ? add_rmsnorm_vec_kernel<4>
                           : add_rmsnorm_vec_kernel<kMaxVec>;
    }
  }
  launch_maybe_pdl(kernel, dim3(n_rows), dim3(kThreads), 0, stream, rmsnorm_pdl_enabled(),
                   residual, delta, w, d, eps, weight_offset, out);
}

bool rmsnorm_fit_enabled() {
  const char* e = std::getenv("DS_NORM_FIT");
  if (!e) return true;
  const std::string v = e;
  DS_CHECK(v == "0" || v == "1", "DS_NORM_FIT must be 0 or 1, got '", v, "'");
  return v == "1";
}

bool rmsnorm_pdl_enabled() {
  static const bool on = env_switch("DS_NORM_PDL", true);
  return on;
}

}  // namespace ds::cuda
