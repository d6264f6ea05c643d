// Distributed shared memory helpers of the cluster kernels (sm_90): a peer block's shared::cluster
// address, a remote 4-byte store that completes as transaction bytes on the peer's mbarrier
// (st.async), this block's rank in its cluster, and the full cluster barrier. Used by
// gdn_decode.cu's split kernels and gdn_prefill_slice.cu's fused state + output kernel.
// Everything is __device__ __forceinline__. Include only from .cu files (nvcc).
#pragma once

#include <cstdint>

namespace ds::cuda {

// The shared::cluster address of `smem_addr` (a shared::cta address of this block) in the block
// of cluster rank `rank`.
__device__ __forceinline__ uint32_t cluster_map(uint32_t smem_addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr), "r"(rank));
  return r;
}
// Stores v into the peer's shared memory at `addr` (a shared::cluster address from cluster_map)
// and adds 4 bytes to the transaction count of the peer's mbarrier at `bar`.
__device__ __forceinline__ void st_async_f32(uint32_t addr, float v, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr),
      "r"(__float_as_uint(v)), "r"(bar)
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster: arrive (release) and wait (acquire).
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

}  // namespace ds::cuda
