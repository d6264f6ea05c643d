// SiLU-and-mul of the SwiGLU MLP: out[t, i] = bf16(silu(g) * u) with g = gu[t, i], u =
// gu[t, d_ff + i] (gu is the fused [gate | up] projection), in fp32, rounded once. Any d_ff;
// 16-byte loads when d_ff % 8 == 0 (17408 for 27B). Grid-stride over all n_tokens * d_ff elements.
// Tested in tests/cuda/cuda_kernels_test.cpp (normalised L2 error < 4e-3 vs an fp32 CPU loop).
#include "cuda/cuda_common.h"
#include "cuda/kernels.h"

namespace ds::cuda {
namespace {

__global__ void silu_mul_vec_kernel(const bf16* __restrict__ gu,  // [n_tokens, 2*d_ff]
                                    int64_t n8, int d8,           // n8 = n_tokens * d_ff / 8
                                    bf16* __restrict__ out) {     // [n_tokens, d_ff]
  // PDL: a dependent launched with programmatic stream serialization (the down GEMV) may
  // start now; it reads this kernel's output only after griddepcontrol.wait, which waits for
  // this whole grid to finish and flush. No effect on a dependent launched without PDL.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / d8, c = i % d8;
    const uint4 g = reinterpret_cast<const uint4*>(gu)[t * 2 * d8 + c];
    const uint4 u = reinterpret_cast<const uint4*>(gu)[t * 2 * d8 + d8 + c];
    const bf16* gb = reinterpret_cast<const bf16*>(&g);
    const bf16* ub = reinterpret_cast<const bf16*>(&u);
    uint4 o;
    bf16* ob = reinterpret_cast<bf16*>(&o);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      ob[j] = __float2bfloat16_rn(silu(__bfloat162float(gb[j])) * __bfloat162float(ub[j]));
    reinterpret_cast<uint4*>(out)[i] = o;
  }
}

__global__ void silu_mul_kernel(const bf16* __restrict__ gu, int64_t n, int d_ff,
                                bf16* __restrict__ out) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // PDL: as above
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / d_ff, c = i % d_ff;
    const float g = __bfloat162float(gu[t * 2 * d_ff + c]);
    const float u = __bfloat162float(gu[t * 2 * d_ff + d_ff + c]);
    out[i] = __float2bfloat16_rn(silu(g) * u);
  }
}

int grid_for(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  return static_cast<int>(blocks < 132 * 32 ? blocks : 132 * 32);  // grid-stride beyond this
}

}  // namespace

void launch_silu_mul(const bf16* gu, int n_tokens, int d_ff, bf16* out, cudaStream_t stream) {
  if (n_tokens <= 0) return;
  const bool vec = d_ff % 8 == 0 && reinterpret_cast<uintptr_t>(gu) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (vec) {
    const int64_t n8 = (int64_t)n_tokens * d_ff / 8;
    silu_mul_vec_kernel<<<grid_for(n8, 256), 256, 0, stream>>>(gu, n8, d_ff / 8, out);
  } else {
    const int64_t n = (int64_t)n_tokens * d_ff;
    silu_mul_kernel<<<grid_for(n, 256), 256, 0, stream>>>(gu, n, d_ff, out);
  }
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
