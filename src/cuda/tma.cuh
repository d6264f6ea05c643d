// Device side of the Hopper tensor memory accelerator (TMA) for the sm_90 kernels
// (gdn_prefill_slice.cu): tensor-map box loads into shared memory that complete on an mbarrier
// (bulk_copy.cuh's mbarriers), box stores from shared memory tracked as bulk groups of the
// issuing thread, and the group waits. Everything is __device__ __forceinline__. Include only from .cu files (nvcc).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/mma_util.cuh"

namespace ds::cuda {

// Box at (c0, c1) / (c0, c1, c2) of `map` into shared memory at dst (1024-byte aligned for the
// 128-byte swizzle), counted as transaction bytes on the mbarrier `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}
// Box stores from shared memory at src (written by this CTA's generic stores: fence_proxy_async
// first) to (c0, c1) / (c0, c1, c2) of `map`; elements outside the tensor are dropped. Part of
// the issuing thread's current bulk group (tma_commit).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int c0, int c1,
                                             const void* src) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(smem_u32(src))
      : "memory");
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, int c0, int c1, int c2,
                                             const void* src) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(src))
      : "memory");
}
__device__ __forceinline__ void tma_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Until all but the newest N bulk groups of this thread are complete (their writes performed and
// visible to this thread) / have finished reading their shared-memory sources.
template <int N>
__device__ __forceinline__ void tma_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void tma_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

}  // namespace ds::cuda
