// Helpers shared by the GPU tests: a device buffer that frees itself, bf16 host vectors, random
// inputs, poisoned outputs (0xFFFF bf16 = NaN, so an unwritten element fails every check), and the
// normalised error ||out - ref|| / ||ref|| with NaN always failing, the 27B attention shape.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "cuda/cuda_common.h"
#include "cuda/kernels.h"
#include "runtime/backend.h"

namespace ds::test {

template <typename T>
struct DevBuf {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count) : n(count) {
    DS_CUDA_CHECK(cudaMalloc(&ptr, sizeof(T) * (n ? n : 1)));
  }
  DevBuf(const std::vector<T>& h) : DevBuf(h.size()) { upload(h); }
  ~DevBuf() { cudaFree(ptr); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void upload(const std::vector<T>& h) {
    DS_CUDA_CHECK(cudaMemcpy(ptr, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    DS_CUDA_CHECK(cudaDeviceSynchronize());
    DS_CUDA_CHECK(cudaMemcpy(h.data(), ptr, sizeof(T) * n, cudaMemcpyDeviceToHost));
    return h;
  }
  void poison() { DS_CUDA_CHECK(cudaMemset(ptr, 0xFF, sizeof(T) * (n ? n : 1))); }  // NaN
  template <typename U>
  U* as() const {
    return reinterpret_cast<U*>(ptr);
  }
};

// Approximately normal(0, scale) bf16 values (Irwin-Hall of four 16-bit lanes of a xorshift64*
// draw): fast enough for the 1.3e9-element 27B lm_head in the GEMM test.
inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float scale = 1.f) {
  uint64_t x = (uint64_t(rng()) << 32 | rng()) | 1;
  std::vector<uint16_t> v(n);
  const float k = scale / 37837.2266f;
  for (auto& e : v) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const uint64_t r = x * 0x2545F4914F6CDD1Dull;
    const int32_t s =
        int32_t((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48)) - 131070;
    e = f32_to_bf16(float(s) * k);
  }
  return v;
}

inline std::vector<float> to_f32(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_f32(v[i]);
  return f;
}

// ||a - ref|| / ||ref|| (L2); any NaN / inf in a gives +inf.
inline double norm_err(const std::vector<float>& a, const std::vector<float>& ref) {
  EXPECT_EQ(a.size(), ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), ref.size()); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = double(a[i]) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Test data and source folders: the compiled-in paths, unless $DS_TEST_DATA_DIR /
// $DS_SOURCE_DIR_OVERRIDE say otherwise (scripts/gpu_test.sh sets them: the GPU machine runs the
// binaries built here from another checkout path).
inline std::string test_data_dir() {
  const char* e = std::getenv("DS_TEST_DATA_DIR");
  return e && *e ? e : DS_TEST_DATA;
}
inline std::string source_dir() {
  const char* e = std::getenv("DS_SOURCE_DIR_OVERRIDE");
  return e && *e ? e : DS_SOURCE_DIR;
}

// The full-attention layer shape of Qwen3.5-27B (24 query heads, 4 kv heads, head_dim 256, rotary
// dim 64) over a paged cache of `page_size` tokens per page.
inline cuda::AttnShape attn_shape_27b(int page_size = 64) {
  cuda::AttnShape s;
  s.n_heads = 24;
  s.n_kv_heads = 4;
  s.head_dim = 256;
  s.rotary_dim = 64;
  s.page_size = page_size;
  return s;
}

// Runs slot 0 of `b` over `tokens`: the first n_prompt as one step, then the rest one token per
// step. out = the prompt step's logits of every row (keep_prompt; none otherwise), then one row
// per decode step.
inline void prefill_then_decode(Backend& b, std::span<const int32_t> tokens, int n_prompt,
                                bool keep_prompt, std::vector<float>& out) {
  out.clear();
  std::vector<float> l;
  const SeqWork pw{0, tokens.first(size_t(n_prompt)), keep_prompt};
  b.step(std::span<const SeqWork>(&pw, 1), keep_prompt ? out : l);
  for (size_t i = size_t(n_prompt); i < tokens.size(); ++i) {
    const SeqWork dw{0, tokens.subspan(i, 1), false};
    b.step(std::span<const SeqWork>(&dw, 1), l);
    out.insert(out.end(), l.begin(), l.end());
  }
}

inline bool cuda_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define DS_REQUIRE_GPU() \
  if (!::ds::test::cuda_available()) GTEST_SKIP() << "no CUDA device"

inline int device_count() {
  int n = 0;
  DS_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n;
}

// The multi-device tests: skip unless there are n GPUs, and make device 0 current again when the
// test leaves (RestoreDevice restore;), whichever device it switched to.
#define DS_REQUIRE_GPUS(n)                                                       \
  if (const int ds_n_devices_ = ::ds::test::device_count(); ds_n_devices_ < (n)) \
  GTEST_SKIP() << "needs " << (n) << " GPUs (" << ds_n_devices_ << " here)"

struct RestoreDevice {
  ~RestoreDevice() { cudaSetDevice(0); }
};

}  // namespace ds::test
