// Element-wise helpers: bf16 <-> f32 conversion (round to nearest even), and the device-side
// synthetic weight generator: element i of a tensor is a pure function of (tensor seed, i), the
// same function as the host's make_synthetic_weights (model/weight_table.h), so a 51 GB model is
// generated on the GPU in about a second with exactly the host's bytes. Grid-stride loops, any n.
// Tested in tests/cuda/cuda_kernels_test.cpp (exact conversion; bytes equal to the host generator).
#include "cuda/cuda_common.h"
#include "cuda/kernels.h"

namespace ds::cuda {
namespace {

__global__ void bf16_to_f32_kernel(const bf16* __restrict__ in, int64_t n,
                                   float* __restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ in, int64_t n,
                                   bf16* __restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

// Exactly model/weight_table.h's synthetic_value() for SyntheticKind::kNormal, rounded to bf16:
// splitmix64 stream element i, sum of its four 16-bit lanes (Irwin-Hall), mul and add rounded
// separately (no FMA contraction), so the device bytes equal make_synthetic_weights' bytes.
__global__ void fill_synthetic_normal_kernel(bf16* __restrict__ out, int64_t n, uint64_t seed,
                                             float mean, float std) {
  constexpr float kInvStd = 1.0f / 37837.2266f;  // 1 / (65536 * sqrt(1/3)), as on the host
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    uint64_t z = seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    const int32_t s =
        (int32_t)((z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + (z >> 48));
    const float zn = __fmul_rn(__int2float_rn(s - 131070), kInvStd);
    out[i] = __float2bfloat16_rn(__fadd_rn(mean, __fmul_rn(std, zn)));
  }
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<int>(blocks < 132 * 64 ? (blocks > 0 ? blocks : 1) : 132 * 64);
}

}  // namespace

void launch_bf16_to_f32(const bf16* in, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return;
  bf16_to_f32_kernel<<<grid_for(n), 256, 0, stream>>>(in, n, out);
  DS_CUDA_LAUNCH_CHECK();
}

void launch_f32_to_bf16(const float* in, int64_t n, bf16* out, cudaStream_t stream) {
  if (n <= 0) return;
  f32_to_bf16_kernel<<<grid_for(n), 256, 0, stream>>>(in, n, out);
  DS_CUDA_LAUNCH_CHECK();
}

void launch_fill_synthetic_normal_bf16(bf16* out, int64_t n, uint64_t seed, float mean, float std,
                                       cudaStream_t stream) {
  if (n <= 0) return;
  fill_synthetic_normal_kernel<<<grid_for(n), 256, 0, stream>>>(out, n, seed, mean, std);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
