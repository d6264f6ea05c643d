// Hopper warpgroup MMA (wgmma) helpers shared by the sm_90 tensor-core kernels
// (attention_prefill_mma.cu, gdn_prefill_slice.cu): shared-memory matrix descriptors for the
// 128-byte swizzle, the 16-byte-chunk offsets of that layout, fences / commit / wait, and the
// wgmma.mma_async forms the kernels use (bf16 in, fp32 accumulate). Everything is
// __device__ __forceinline__, so each kernel compiles as with its own copy.
// Include only from .cu files (nvcc, sm_90a).
#pragma once

#include <cstdint>

namespace ds::cuda {

// p rounded up to 1024 bytes (the alignment of the 128-byte swizzle atoms); callers reserve the
// 1024 bytes of slack.
__device__ __forceinline__ unsigned char* align_1024(unsigned char* p) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(p) + 1023) &
                                          ~uintptr_t(1023));
}
// The same for a pointer into dynamic shared memory, by pointer arithmetic: the compiler keeps
// knowing the result points to shared memory (align_1024's integer round trip loses that, so every
// access through it is a generic load / store). The shared window is aligned far beyond 1 KiB, so
// both give the same byte.
__device__ __forceinline__ unsigned char* align_1024_shared(unsigned char* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return p + ((1024u - (a & 1023u)) & 1023u);
}

// Shared-memory matrix descriptor, 128-byte swizzle (PTX ISA "Matrix Descriptor Format").
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t(1) << 62);
}

// Byte offset of 16-byte chunk `c` of row `r` in a [rows, 8 * chunks] bf16 tile stored as column
// blocks of [rows, 64] with the 128-byte swizzle (the layout the descriptors above name).
__device__ __forceinline__ uint32_t gswz(int rows, int r, int c) {
  return uint32_t(c >> 3) * uint32_t(rows) * 128u + uint32_t(r) * 128u +
         (uint32_t((c & 7) ^ (r & 7)) << 4);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async / st.shared writes (generic proxy) become visible to wgmma reads (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across wgmma issue / wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The accumulator operands of the forms below: the register list of the PTX instruction
// ("{%0, ..., %N-1}") and the matching "+f" constraints on d[0 .. N-1].
#define DS_WGMMA_REGS32 \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18," \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define DS_WGMMA_REGS64 \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18," \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35," \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52," \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DS_WGMMA_REGS128 \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18," \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35," \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52," \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69," \
      "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86," \
      "%87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103," \
      "%104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117," \
      "%118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define DS_WGMMA_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define DS_WGMMA_D16(i) DS_WGMMA_D4(i), DS_WGMMA_D4(i + 4), DS_WGMMA_D4(i + 8), DS_WGMMA_D4(i + 12)
#define DS_WGMMA_D32(i) DS_WGMMA_D16(i), DS_WGMMA_D16(i + 16)
#define DS_WGMMA_D64(i) DS_WGMMA_D32(i), DS_WGMMA_D32(i + 32)
#define DS_WGMMA_D128 DS_WGMMA_D64(0), DS_WGMMA_D64(64)

// d[64 x 64] += A[64 x 16] B[16 x 64] (scale_d 0: d = A B, d is not read); A and B from shared
// memory, both K-major.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a,
                                                   uint64_t desc_b, int scale_d = 1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DS_WGMMA_REGS32 "}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : DS_WGMMA_D32(0)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// d[64 x 128] += A[64 x 16] B[16 x 128]; A and B from shared memory, both K-major.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a,
                                                    uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DS_WGMMA_REGS64 "}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : DS_WGMMA_D64(0)
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

// d[64 x 64] += A[64 x 16] B[16 x 64] (scale_d 0: d = A B); A from registers (the mma.m16n8k16 A
// fragment of each warp's 16 rows), B from shared memory, K-major.
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t desc_b, int scale_d = 1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DS_WGMMA_REGS32 "}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : DS_WGMMA_D32(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// d[64 x 128] += A[64 x 16] B[16 x 128]; A from registers, B from shared memory, MN-major
// (transposed).
__device__ __forceinline__ void wgmma_m64n128k16_rs_t(float (&d)[64], const uint32_t (&a)[4],
                                                      uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DS_WGMMA_REGS64 "}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : DS_WGMMA_D64(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// d[64 x 64] += A[64 x 16] B[16 x 64]; A from registers, B from shared memory, MN-major
// (transposed).
__device__ __forceinline__ void wgmma_m64n64k16_rs_t(float (&d)[32], const uint32_t (&a)[4],
                                                     uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DS_WGMMA_REGS32 "}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : DS_WGMMA_D32(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// d[64 x 256] += A[64 x 16] B[16 x 256]; A from registers, B from shared memory, MN-major
// (transposed).
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4],
                                                    uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" DS_WGMMA_REGS128 "}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : DS_WGMMA_D128
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

#undef DS_WGMMA_REGS32
#undef DS_WGMMA_REGS64
#undef DS_WGMMA_REGS128
#undef DS_WGMMA_D4
#undef DS_WGMMA_D16
#undef DS_WGMMA_D32
#undef DS_WGMMA_D64
#undef DS_WGMMA_D128

}  // namespace ds::cuda
