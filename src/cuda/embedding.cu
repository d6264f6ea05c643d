// Row gather: out[i, :] = src[idx[i], :]. Used for the embedding lookup (src = embed_tokens,
// idx = token ids) and to pick the rows that go through lm_head. Layout: bf16 row-major, any d;
// 16-byte copies when d % 8 == 0 (every Qwen3.5 width), else element by element.
// Tested in tests/cuda/cuda_kernels_test.cpp (exact copy).
#include "cuda/cuda_common.h"
#include "cuda/kernels.h"

namespace ds::cuda {
namespace {

__global__ void gather_rows_vec_kernel(const uint4* __restrict__ src,      // [n_src, d/8]
                                       const int32_t* __restrict__ idx,    // [n_rows]
                                       int d8, uint4* __restrict__ out) {  // [n_rows, d/8]
  const int row = blockIdx.x;
  const int64_t s = idx[row];
  for (int i = threadIdx.x; i < d8; i += blockDim.x) out[(int64_t)row * d8 + i] = src[s * d8 + i];
}

__global__ void gather_rows_kernel(const bf16* __restrict__ src, const int32_t* __restrict__ idx,
                                   int d, bf16* __restrict__ out) {
  const int row = blockIdx.x;
  const int64_t s = idx[row];
  for (int i = threadIdx.x; i < d; i += blockDim.x) out[(int64_t)row * d + i] = src[s * d + i];
}

}  // namespace

void launch_gather_rows(const bf16* src, const int32_t* idx, int n_rows, int d, bf16* out,
                        cudaStream_t stream) {
  if (n_rows <= 0) return;
  const bool vec = d % 8 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (vec) {
    const int d8 = d / 8;
    gather_rows_vec_kernel<<<n_rows, d8 >= 256 ? 256 : ((d8 + 31) / 32) * 32, 0, stream>>>(
        reinterpret_cast<const uint4*>(src), idx, d8, reinterpret_cast<uint4*>(out));
  } else {
    gather_rows_kernel<<<n_rows, 256, 0, stream>>>(src, idx, d, out);
  }
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
