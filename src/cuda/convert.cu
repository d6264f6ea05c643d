// Element-wise helpers: bf16 <-> f32 conversion (round to nearest even), and deterministic random
// fills for the device-side synthetic weights: element i of a tensor is a pure function of
// (seed, i) (SplitMix64 hashing, Box-Muller for normals), so a 51 GB model is generated on the GPU
// in about a second and regenerated identically anywhere. Grid-stride loops, any n.
// Tested in tests/cuda/cuda_kernels_test.cpp (exact conversion; fill statistics and determinism).
#include "cuda/cuda_common.h"
#include "cuda/kernels.h"

namespace ds::cuda {
namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1]: 24 random bits, never 0 (log() below).
__device__ __forceinline__ float unit_float(uint64_t bits) {
  return ((bits >> 40) + 1) * (1.0f / 16777216.0f);
}

__global__ void bf16_to_f32_kernel(const bf16* __restrict__ in, int64_t n, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ in, int64_t n, bf16* __restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

// Pairs (2j, 2j+1) come from one Box-Muller draw.
__global__ void fill_normal_kernel(bf16* __restrict__ out, int64_t n, uint64_t seed, float mean,
                                   float std) {
  const uint64_t key = splitmix64(seed);
  for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; 2 * j < n;
       j += (int64_t)gridDim.x * blockDim.x) {
    const uint64_t h = splitmix64(key ^ (uint64_t)j);
    const float u1 = unit_float(h), u2 = unit_float(splitmix64(h));
    const float r = sqrtf(-2.f * logf(u1));
    float s, c;
    sincospif(2.f * u2, &s, &c);
    out[2 * j] = __float2bfloat16_rn(mean + std * r * c);
    if (2 * j + 1 < n) out[2 * j + 1] = __float2bfloat16_rn(mean + std * r * s);
  }
}

__global__ void fill_uniform_kernel(float* __restrict__ out, int64_t n, uint64_t seed, float lo,
                                    float hi) {
  const uint64_t key = splitmix64(seed);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = lo + (hi - lo) * (unit_float(splitmix64(key ^ (uint64_t)i)) - 1.0f / 16777216.0f);
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

void launch_fill_normal_bf16(bf16* out, int64_t n, uint64_t seed, float mean, float std,
                             cudaStream_t stream) {
  if (n <= 0) return;
  fill_normal_kernel<<<grid_for((n + 1) / 2), 256, 0, stream>>>(out, n, seed, mean, std);
  DS_CUDA_LAUNCH_CHECK();
}

void launch_fill_uniform_f32(float* out, int64_t n, uint64_t seed, float lo, float hi,
                             cudaStream_t stream) {
  if (n <= 0) return;
  fill_uniform_kernel<<<grid_for(n), 256, 0, stream>>>(out, n, seed, lo, hi);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
