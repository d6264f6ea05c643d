// Device helpers shared by the bulk-copy GEMVs (gemv_bulk.cu, gemv_narrow.cu): mbarriers in shared
// memory (init, arrive, arrive with an expected transaction count, parity wait), the 1-D bulk copy
// global -> shared (cp.async.bulk, sm 90) that completes on one of them, and the unpack of a
// 16-byte vector of 8 bf16 into floats that their consumer warps do. A block launched without a
// cluster is its own cluster of one, so the .shared::cluster forms address the block's own shared
// memory. Everything is __device__ __forceinline__, so each kernel compiles to the same code as
// with its own copy. Include only from .cu files (nvcc).
#pragma once

#include <cstdint>

#include "cuda/mma_util.cuh"

namespace ds::cuda {

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// DS_MBAR_SUSPEND_NS (compile time, default 0 = no hint, the hardware's own time limit): the
// suspend-time hint of each try_wait, in ns, so waiting warps sleep instead of re-polling (an
// energy experiment: the batch-1 decode step runs at the 700 W power cap). Measured in session 19
// with 2 us and 100 us hints in the GEMVs: decode TPOT unchanged within 0.03 ms
// (docs/perf/decode_kernels.md), so off unless a build defines it.
#ifndef DS_MBAR_SUSPEND_NS
#define DS_MBAR_SUSPEND_NS 0
#endif
// One try of mbar_wait (the hardware may suspend the thread a while before it returns false).
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if DS_MBAR_SUSPEND_NS > 0
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity), "n"(DS_MBAR_SUSPEND_NS)
        : "memory");
  } while (!done);
#else
  while (!mbar_try_wait(bar, parity)) {
  }
#endif
}
// 1-D bulk copy global -> shared of `bytes` (a multiple of 16, both ends 16-byte aligned),
// completing as transaction bytes on `bar`; with an L2 cache policy (weights) or without (x).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// Bulk prefetch of `bytes` (a multiple of 16, 16-byte aligned) global -> L2 (cp.async.bulk
// .prefetch.L2, sm 90): no data reaches the issuing block, nothing to wait for.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// A ring's mbarriers, one thread before the block barrier: full[i] completes on the producer's
// expect_tx arrival and its copies, empty[i] on one consumer arrival.
__device__ __forceinline__ void init_ring_barriers(uint64_t* full, uint64_t* empty, int slots) {
  for (int i = 0; i < slots; ++i) {
    mbar_init(&full[i], 1);
    mbar_init(&empty[i], 1);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// 8 bf16 (one 16-byte vector, element 0 in the low half of v.x) -> 8 floats, exactly.
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  f[0] = __uint_as_float(v.x << 16), f[1] = __uint_as_float(v.x & 0xffff0000u);
  f[2] = __uint_as_float(v.y << 16), f[3] = __uint_as_float(v.y & 0xffff0000u);
  f[4] = __uint_as_float(v.z << 16), f[5] = __uint_as_float(v.z & 0xffff0000u);
  f[6] = __uint_as_float(v.w << 16), f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// The narrow GEMV's per-slice arithmetic (gemv_narrow_kernel's consumer loop, which the fused
// MLP's down phase must match bit for bit): lane l's partial dot products of one slice of nvs
// 16-byte vectors of a weight row at ws with the M rows of x at xk (row stride x_stride
// elements), the vectors l, l + 32, ... in order, fp32 FMAs. The caller reduces across the warp.
// (gemv_narrow.cu keeps its own copy of the loop: calling this changes its register allocation and
// instruction order, and the shipped kernel stays .text-identical until a device re-measures it.)
template <int M>
__device__ __forceinline__ void narrow_slice_dot(const __nv_bfloat16* ws, const __nv_bfloat16* xk,
                                                 int x_stride, int nvs, int lane,
                                                 float (&acc)[M]) {
#pragma unroll
  for (int t = 0; t < M; ++t) acc[t] = 0.f;
#pragma unroll 4
  for (int v = lane; v < nvs; v += 32) {
    float wf[8];
    unpack8(*reinterpret_cast<const uint4*>(ws + size_t(v) * 8), wf);
#pragma unroll
    for (int t = 0; t < M; ++t) {
      float xf[8];
      unpack8(*reinterpret_cast<const uint4*>(xk + size_t(t) * x_stride + size_t(v) * 8), xf);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[t] = fmaf(wf[e], xf[e], acc[t]);
    }
  }
}

}  // namespace ds::cuda
