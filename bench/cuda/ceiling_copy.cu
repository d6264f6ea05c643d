// The copy kernel of the D2D bandwidth ceiling (see ceiling_copy.h).
#include <algorithm>
#include <cstdint>

#include "bench/cuda/ceiling_copy.h"
#include "bench/cuda/device_util.h"
#include "core/error.h"

namespace ds::bench::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread before the first store

__global__ void copy_16b_kernel(uint4* __restrict__ dst,        // [n]
                                const uint4* __restrict__ src,  // [n]
                                size_t n) {
  const size_t stride = size_t(gridDim.x) * kThreads * kUnroll;
  for (size_t base = size_t(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < n;
       base += stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + size_t(u) * kThreads;
      if (i < n) v[u] = __ldcs(src + i);  // streaming: read once, keep L2 for nothing else
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + size_t(u) * kThreads;
      if (i < n) __stcs(dst + i, v[u]);
    }
  }
}

}  // namespace

void launch_copy_16b(void* dst, const void* src, size_t n_bytes, cudaStream_t s) {
  DS_CHECK(n_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(src) % 16 == 0,
           "launch_copy_16b: pointers and size must be 16-byte aligned");
  // One full wave: every SM at its resident-block limit (host queries only: graph-capturable).
  int dev = 0, sms = 0, per_sm = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, copy_16b_kernel, kThreads, 0),
        "occupancy");
  const int blocks = sms * std::max(per_sm, 1);
  const size_t n = n_bytes / 16;
  copy_16b_kernel<<<blocks, kThreads, 0, s>>>(static_cast<uint4*>(dst),
                                              static_cast<const uint4*>(src), n);
  check(cudaGetLastError(), "copy_16b_kernel launch");
}

}  // namespace ds::bench::gpu
