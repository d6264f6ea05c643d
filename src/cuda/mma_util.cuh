// Device-side wrappers shared by the tensor-core kernels (attention_prefill_mma.cu,
// gdn_prefill_sm90.cu, gdn_prefill.cu, gdn_decode.cu): cp.async global -> shared copies,
// ldmatrix, mma.sync m16n8k16 (bf16 in, fp32 accumulate), bf16 packing and 4-wide bf16 loads;
// also the GPU-scope acquire load of a flag and %globaltimer (bulk_copy.cuh and gdn_decode.cu).
// Everything is __device__ __forceinline__, so every kernel compiles to the same code as with its
// own copy. Two ldmatrix forms: the shared-address form carries no "memory" clobber (the tiles
// come from cp.async and are ordered by the caller's barriers), the pointer form does (tiles
// written by plain stores of the same kernel stay ordered before the read).
// Include only from .cu files (nvcc).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace ds::cuda {

// A load with acquire semantics at GPU scope (a flag or counter another block releases).
__device__ __forceinline__ int load_acquire(const int* flag) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  return v;
}
__device__ __forceinline__ unsigned load_acquire(const unsigned* flag) {
  return static_cast<unsigned>(load_acquire(reinterpret_cast<const int*>(flag)));
}

// The GPU's nanosecond timer (%globaltimer): time stamps and bounded waits.
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Shared-window address of a pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async ----------------------------------------------------------------------------------
// 16-byte (4-byte) async copy global -> shared; !valid zero-fills the destination without
// reading src (src-size 0).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16(smem_u32(dst), src, valid);
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Waits for every committed group; also a compiler barrier for memory accesses.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// ---- ldmatrix ----------------------------------------------------------------------------------
// Four 8x8 bf16 matrices; lane l supplies the row address of matrix l / 8. Address form, no
// memory clobber.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Pointer form, with a memory clobber: four (two) 8x8 matrices, plain and transposed.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const __nv_bfloat16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const __nv_bfloat16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(p))
               : "memory");
}

// ---- mma.sync ----------------------------------------------------------------------------------
// c[16x8] += a[16x16] b[16x8]: m16n8k16, bf16 operands, fp32 accumulators (PTX fragment layouts:
// lane = 4 g + t; a: {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b: {(k 2t..2t+1,
// n g), (k 2t+8.., n g)}; c: {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- bf16 helpers ------------------------------------------------------------------------------
// Two floats as one bf16x2 register (lo in the low half), round to nearest.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Loads 4 consecutive bf16 (8 bytes, 8-byte aligned) as floats.
__device__ __forceinline__ void load4_bf16(const __nv_bfloat16* p, float* f) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&u.x);
  const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&u.y);
  f[0] = __low2float(a);
  f[1] = __high2float(a);
  f[2] = __low2float(b);
  f[3] = __high2float(b);
}

// Loads 16 consecutive bf16 (two 16-byte loads, 16-byte aligned) as floats.
__device__ __forceinline__ void load16_bf16(const __nv_bfloat16* p, float (&f)[16]) {
  const uint4 w0 = *reinterpret_cast<const uint4*>(p);
  const uint4 w1 = *reinterpret_cast<const uint4*>(p + 8);
  const __nv_bfloat16* wb0 = reinterpret_cast<const __nv_bfloat16*>(&w0);
  const __nv_bfloat16* wb1 = reinterpret_cast<const __nv_bfloat16*>(&w1);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[i] = __bfloat162float(wb0[i]);
    f[8 + i] = __bfloat162float(wb1[i]);
  }
}

}  // namespace ds::cuda
