// The greedy token of a logits row (runtime/backend.h greedy_token: argmax, lowest id on ties, -1
// when the row holds a NaN or +inf, 0 for a row of -inf) as a maximum of 64-bit keys, one per
// (logit, id). The maximum of unsigned integers is commutative and associative, so any number of
// blocks and warps may reduce their parts in any order (atomicMax included) and get the same
// token; the bulk GEMV's fused argmax (gemv.h, launch_gemv_bulk_argmax) reduces lm_head's outputs
// this way without writing and re-reading the logits first.
//
// key(v, i) = [order(v) : 32 | ~i : 32], where order() maps the floats to unsigned integers in
// the same order (the sign bit set for v >= 0, every bit flipped for v < 0) after -0 is made +0
// (greedy_token's `>` treats them as equal, so the lower id must win between them). A larger
// value gives a larger key; of two equal values the lower id gives the larger key. NaN and +inf
// take the largest key, all ones, which no other value reaches (order(v) == 0xffffffff only for
// the NaN 0x7fffffff); that key becomes token -1. Plain C++ (host and device): the CPU test
// (tests/runtime_argmax_key_test.cpp) holds it to greedy_token on rows of every kind.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DS_ARGMAX_HD __host__ __device__ __forceinline__
#else
#define DS_ARGMAX_HD inline
#endif

namespace ds::cuda {

constexpr uint64_t kArgmaxKeyBad = ~uint64_t(0);  // a NaN or +inf: token -1
constexpr uint64_t kArgmaxKeyNone = 0;             // no candidate yet (below every real key)

DS_ARGMAX_HD uint64_t argmax_key(float v, uint32_t id) {
  if (v != v || v > 3.40282347e+38f) return kArgmaxKeyBad;  // NaN, +inf (> FLT_MAX)
  if (v == 0.f) v = 0.f;  // -0 -> +0
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(v);
#else
  std::memcpy(&u, &v, sizeof u);
#endif
  const uint32_t order = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(order) << 32) | uint64_t(~id);
}

DS_ARGMAX_HD uint64_t argmax_key_max(uint64_t a, uint64_t b) { return a > b ? a : b; }

// The token of a row's largest key: -1 for a NaN / +inf, else the id. kArgmaxKeyNone (an empty
// row, which no caller passes) gives 0.
DS_ARGMAX_HD int32_t argmax_key_token(uint64_t key) {
  if (key == kArgmaxKeyBad) return -1;
  if (key == kArgmaxKeyNone) return 0;
  return int32_t(~uint32_t(key));
}

}  // namespace ds::cuda
