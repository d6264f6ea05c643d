// Row argmax over fp32 logits (see argmax.h). Each thread scans its strided share in increasing
// index order keeping the first maximum (strict >), then a warp-shuffle and a shared-memory
// reduction keep the larger value, the lower index on ties. A NaN or +inf anywhere sets the row's
// flag (__syncthreads_or) and the result is -1. Two kernels: one block per row (any vocab), and
// for long aligned rows a cluster of kClusterBlocks blocks per row, each scanning one contiguous
// part, whose block results rank 0 of the cluster reads through distributed shared memory (a row
// of 248320 logits is 1 MB: one SM alone needed 12.5 us for it in the decode graph). The two give
// the same answer by construction (the order of the combine cannot matter: larger value, then
// lower index). Tests: tests/cuda/cuda_kernels_test.cpp (CudaKernels.ArgmaxRows: both kernels vs
// the host greedy_token, ties across the parts, NaN / inf, all -inf), cuda_backend_test.cpp
// (device greedy == host greedy_token).
#include <cooperative_groups.h>

#include <climits>
#include <cstdlib>
#include <string>

#include "cuda/argmax.h"
#include "cuda/cuda_common.h"

namespace ds::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;
constexpr int kClusterBlocks = 8;  // blocks per row in the cluster kernel (portable cluster size)

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

// The best of a warp's 32 candidates (every lane gets it).
__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Best other{__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
    b = better(b, other);
  }
  return b;
}

// Float4 indices i, i + kThreads, ... below hi, in increasing order (four 16-byte loads in flight).
__device__ __forceinline__ void scan4(const float4* x4, int i, int hi, Best& b, bool& bad) {
  for (; i + 3 * kThreads < hi; i += 4 * kThreads) {
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
  for (; i < hi; i += kThreads) {
    const float4 v = x4[i];
    take(b, v.x, 4 * i, bad);
    take(b, v.y, 4 * i + 1, bad);
    take(b, v.z, 4 * i + 2, bad);
    take(b, v.w, 4 * i + 3, bad);
  }
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
    scan4(reinterpret_cast<const float4*>(x), tid, vocab >> 2, b, bad);
  } else {
    for (int i = tid; i < vocab; i += kThreads) take(b, x[i], i, bad);
  }
  b = warp_best(b);
  if (lane == 0) {
    sv[warp] = b.v;
    si[warp] = b.i;
  }
  const bool any_bad = __syncthreads_or(bad);
  if (warp == 0) {
    b = lane < kThreads / 32 ? Best{sv[lane], si[lane]} : Best{-INFINITY, INT_MAX};
    b = warp_best(b);
    if (lane == 0) out[row] = any_bad ? -1 : (b.i == INT_MAX ? 0 : b.i);  // all -inf: token 0
  }
}

// One cluster of kClusterBlocks blocks per row (grid (kClusterBlocks, n_rows)); vocab % 4 == 0 and
// the rows 16-byte aligned. Block `part` scans the float4 range [n4 part / C, n4 (part + 1) / C).
// Launched as a programmatic dependent of the lm_head GEMM: the logits (a plain pointer: a
// const __restrict__ one may be read through the non-coherent path ahead of the wait) are read only
// after griddepcontrol.wait.
__global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kThreads)
    argmax_rows_cluster_kernel(const float* logits,  // [n_rows, vocab]
                               int vocab, int32_t* __restrict__ out) {
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  __shared__ float block_v;
  __shared__ int block_i, block_bad;
  cg::cluster_group cluster = cg::this_cluster();
  const int part = blockIdx.x, row = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const float4* x4 = reinterpret_cast<const float4*>(logits + int64_t(row) * vocab);
  const int n4 = vocab >> 2;
  const int hi = int(int64_t(n4) * (part + 1) / kClusterBlocks);
  Best b{-INFINITY, INT_MAX};
  bool bad = false;
  scan4(x4, int(int64_t(n4) * part / kClusterBlocks) + tid, hi, b, bad);
  b = warp_best(b);
  if (lane == 0) {
    sv[warp] = b.v;
    si[warp] = b.i;
  }
  const bool any_bad = __syncthreads_or(bad);
  if (warp == 0) {
    b = lane < kThreads / 32 ? Best{sv[lane], si[lane]} : Best{-INFINITY, INT_MAX};
    b = warp_best(b);
    if (lane == 0) {
      block_v = b.v;
      block_i = b.i;
      block_bad = any_bad ? 1 : 0;
    }
  }
  cluster.sync();  // every block's result is in its shared memory
  if (part == 0 && warp == 0) {
    Best r{-INFINITY, INT_MAX};
    int rb = 0;
    if (lane < kClusterBlocks) {
      r = Best{*cluster.map_shared_rank(&block_v, lane), *cluster.map_shared_rank(&block_i, lane)};
      rb = *cluster.map_shared_rank(&block_bad, lane);
    }
    r = warp_best(r);
    rb = __any_sync(0xffffffffu, rb != 0);
    if (lane == 0) out[row] = rb ? -1 : (r.i == INT_MAX ? 0 : r.i);  // all -inf: token 0
  }
  cluster.sync();  // the other blocks' shared memory stays alive until rank 0 has read it
}

}  // namespace

ArgmaxKernel argmax_kernel_default() {
  static const ArgmaxKernel k = [] {
    const char* e = std::getenv("DS_ARGMAX_CLUSTER");
    const std::string v = e ? e : "";
    DS_CHECK(v.empty() || v == "0" || v == "1", "DS_ARGMAX_CLUSTER must be 0 or 1, got '", v,
             "'");
    return v == "1" ? ArgmaxKernel::kAuto : ArgmaxKernel::kBlock;  // opt-in until measured
  }();
  return k;
}

bool argmax_cluster_applies(const float* logits, int n_rows, int vocab) {
  return n_rows >= 1 && n_rows <= 65535 && vocab % 4 == 0 &&
         vocab >= kClusterBlocks * kThreads * 4 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
}

void launch_argmax_rows(const float* logits, int n_rows, int vocab, int32_t* out,
                        cudaStream_t stream, ArgmaxKernel which, bool pdl) {
  if (n_rows <= 0) return;
  DS_CHECK(vocab > 0, "argmax: vocab must be positive, got ", vocab);
  if (which == ArgmaxKernel::kAuto && argmax_cluster_applies(logits, n_rows, vocab)) {
    launch_maybe_pdl(argmax_rows_cluster_kernel, dim3(kClusterBlocks, n_rows), dim3(kThreads), 0,
                     stream, pdl, logits, vocab, out);
    DS_CUDA_LAUNCH_CHECK();
    return;
  }
  argmax_rows_kernel<<<n_rows, kThreads, 0, stream>>>(logits, vocab, out);
  DS_CUDA_LAUNCH_CHECK();
}

void launch_argmax_rows(const float* logits, int n_rows, int vocab, int32_t* out,
                        cudaStream_t stream) {
  launch_argmax_rows(logits, n_rows, vocab, out, stream, argmax_kernel_default(), false);
}

}  // namespace ds::cuda
