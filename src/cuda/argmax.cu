// Row argmax over fp32 logits (see argmax.h). One block per row: each thread scans its strided
// share in increasing index order keeping the first maximum (strict >), then a warp-shuffle and a
// shared-memory reduction keep the larger value, the lower index on ties. A NaN or +inf anywhere
// sets the row's flag (__syncthreads_or) and the result is -1. Cost: one pass over the row, which
// the lm_head GEMM has just written (L2): a few microseconds at vocab 248320.
// Tests: tests/cuda/cuda_backend_test.cpp (device greedy == host greedy_token, ties, NaN / inf).
#include <climits>

#include "cuda/argmax.h"
#include "cuda/cuda_common.h"

namespace ds::cuda {
namespace {

constexpr int kThreads = 1024;

struct Best {
  float v;
  int i;
};

__device__ __forceinline__ void take(Best& b, float v, int i, bool& bad) {
  bad |= (v != v) || v == INFINITY;
  if (v > b.v) {  // strict: the first maximum of this thread's (increasing) indices stays
    b.v = v;
    b.i = i;
  }
}

__device__ __forceinline__ Best better(Best a, Best o) {
  return (o.v > a.v || (o.v == a.v && o.i < a.i)) ? o : a;
}

__global__ void __launch_bounds__(kThreads)
    argmax_rows_kernel(const float* __restrict__ logits,        // [n_rows, vocab]
                       int vocab, int32_t* __restrict__ out) {  // [n_rows]
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* x = logits + (int64_t)row * vocab;
  Best b{-INFINITY, INT_MAX};
  bool bad = false;
  if ((vocab & 3) == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int n4 = vocab >> 2;
    int i = tid;
    for (; i + 3 * kThreads < n4; i += 4 * kThreads) {  // four 16-byte loads in flight
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = x4[i + u * kThreads];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = 4 * (i + u * kThreads);
        take(b, v[u].x, e, bad);
        take(b, v[u].y, e + 1, bad);
        take(b, v[u].z, e + 2, bad);
        take(b, v[u].w, e + 3, bad);
      }
    }
    for (; i < n4; i += kThreads) {
      const float4 v = x4[i];
      take(b, v.x, 4 * i, bad);
      take(b, v.y, 4 * i + 1, bad);
      take(b, v.z, 4 * i + 2, bad);
      take(b, v.w, 4 * i + 3, bad);
    }
  } else {
    for (int i = tid; i < vocab; i += kThreads) take(b, x[i], i, bad);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Best other{__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
    b = better(b, other);
  }
  if (lane == 0) {
    sv[warp] = b.v;
    si[warp] = b.i;
  }
  const bool any_bad = __syncthreads_or(bad);
  if (warp == 0) {
    b = lane < kThreads / 32 ? Best{sv[lane], si[lane]} : Best{-INFINITY, INT_MAX};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      Best other{__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
      b = better(b, other);
    }
    if (lane == 0) out[row] = any_bad ? -1 : (b.i == INT_MAX ? 0 : b.i);  // all -inf: token 0
  }
}

}  // namespace

void launch_argmax_rows(const float* logits, int n_rows, int vocab, int32_t* out,
                        cudaStream_t stream) {
  if (n_rows <= 0) return;
  DS_CHECK(vocab > 0, "argmax: vocab must be positive, got ", vocab);
  argmax_rows_kernel<<<n_rows, kThreads, 0, stream>>>(logits, vocab, out);
  DS_CUDA_LAUNCH_CHECK();
}

}  // namespace ds::cuda
