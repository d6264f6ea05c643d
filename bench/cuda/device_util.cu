// Device helpers of the GPU benches (see device_util.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "bench/cuda/device_util.h"
#include "core/error.h"

namespace ds::bench::gpu {
namespace {

constexpr int kReadBlocks = 132 * 8;  // enough blocks in flight on any Hopper part
constexpr int kThreads = 256;

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// A standard normal from (seed, i) by Box-Muller on two hashed uniforms.
__device__ __forceinline__ float normal_at(uint64_t seed, uint64_t i) {
  const uint64_t a = mix64(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1);
  const uint64_t b = mix64(a ^ (2 * i + 2));
  const float u1 = (static_cast<float>(a >> 40) + 1.f) * (1.f / 16777217.f);
  const float u2 = static_cast<float>(b >> 40) * (1.f / 16777216.f);
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

__global__ void fill_normal_bf16_kernel(__nv_bfloat16* __restrict__ p, int64_t n, uint64_t seed,
                                        float mean, float std) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(mean + std * normal_at(seed, uint64_t(i)));
}

__global__ void fill_normal_f32_kernel(float* __restrict__ p, int64_t n, uint64_t seed, float mean,
                                       float std) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = mean + std * normal_at(seed, uint64_t(i));
}

__global__ void fill_uniform_f32_kernel(float* __restrict__ p, int64_t n, uint64_t seed, float lo,
                                        float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t a = mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    p[i] = lo + (hi - lo) * (static_cast<float>(a >> 40) * (1.f / 16777216.f));
  }
}

// Streaming read: 16-byte loads, grid-stride, four loads in flight per thread per iteration.
__global__ void stream_read_kernel(const uint4* __restrict__ p, int64_t n_vec,
                                   float* __restrict__ partial) {
  float acc = 0.f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  auto add = [&](const uint4& v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k)
      acc += __uint_as_float(w[k] << 16) + __uint_as_float(w[k] & 0xffff0000u);
  };
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride),
                d = __ldcs(p + i + 3 * stride);
    add(a), add(b), add(c), add(d);
  }
  for (; i < n_vec; i += stride) add(__ldcs(p + i));
  __shared__ float red[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int k = 0; k < kThreads / 32; ++k) s += red[k];
    partial[blockIdx.x] = s;
  }
}

__device__ __forceinline__ void atomic_max_pos(float* addr, float v) {
  // v >= 0 (or NaN, mapped to +inf by the caller): the int order of non-negative floats is theirs.
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

template <typename T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_f(float x) {
  return x;
}

__device__ __forceinline__ int bits_differ(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __bfloat16_as_ushort(a) != __bfloat16_as_ushort(b);
}
__device__ __forceinline__ int bits_differ(float a, float b) {
  return __float_as_uint(a) != __float_as_uint(b);
}

// out[0] = max |a-b|, out[1] = max |b|, out[2] = count of differing bit patterns, out[3] = count
// of non-finite values in a or b.
template <typename T>
__global__ void diff_kernel(const T* __restrict__ a, const T* __restrict__ b, int64_t n,
                            float* out) {
  float md = 0.f, mr = 0.f;
  int ndiff = 0, nbad = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = to_f(a[i]), y = to_f(b[i]);
    if (!isfinite(x) || !isfinite(y)) {
      ++nbad;
      continue;
    }
    md = fmaxf(md, fabsf(x - y));
    mr = fmaxf(mr, fabsf(y));
    ndiff += bits_differ(a[i], b[i]);
  }
  atomic_max_pos(out, md);
  atomic_max_pos(out + 1, mr);
  if (ndiff) atomicAdd(reinterpret_cast<int*>(out + 2), ndiff);
  if (nbad) atomicAdd(reinterpret_cast<int*>(out + 3), nbad);
}

}  // namespace

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) ds::throw_error("bench: ", what, " failed: ", cudaGetErrorString(e));
}

DevBuf::DevBuf(size_t bytes, const char* what) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaMalloc(&p_, bytes);
  if (e != cudaSuccess) {
    p_ = nullptr;
    ds::throw_error("bench: cudaMalloc of ", bytes, " bytes for ", what,
                    " failed: ", cudaGetErrorString(e));
  }
}

DevBuf::~DevBuf() {
  if (p_) cudaFree(p_);
}

DevBuf& DevBuf::operator=(DevBuf&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFree(p_);
    p_ = o.p_, bytes_ = o.bytes_;
    o.p_ = nullptr, o.bytes_ = 0;
  }
  return *this;
}

namespace {
int grid_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 132 * 16));
}
}  // namespace

void fill_normal_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed, float mean, float std,
                      cudaStream_t s) {
  if (n <= 0) return;
  fill_normal_bf16_kernel<<<grid_for(n), kThreads, 0, s>>>(p, n, seed, mean, std);
  check(cudaGetLastError(), "fill_normal_bf16 launch");
}
void fill_normal_f32(float* p, int64_t n, uint64_t seed, float mean, float std, cudaStream_t s) {
  if (n <= 0) return;
  fill_normal_f32_kernel<<<grid_for(n), kThreads, 0, s>>>(p, n, seed, mean, std);
  check(cudaGetLastError(), "fill_normal_f32 launch");
}
void fill_uniform_f32(float* p, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t s) {
  if (n <= 0) return;
  fill_uniform_f32_kernel<<<grid_for(n), kThreads, 0, s>>>(p, n, seed, lo, hi);
  check(cudaGetLastError(), "fill_uniform_f32 launch");
}

int read_kernel_blocks() { return kReadBlocks; }

void launch_stream_read(const void* p, size_t n_bytes, float* partial, cudaStream_t s) {
  DS_CHECK(n_bytes % 16 == 0, "stream read: size must be a multiple of 16 bytes");
  stream_read_kernel<<<kReadBlocks, kThreads, 0, s>>>(static_cast<const uint4*>(p),
                                                      static_cast<int64_t>(n_bytes / 16), partial);
  check(cudaGetLastError(), "stream_read launch");
}

std::string Diff::text() const {
  if (!finite) return "NON-FINITE values";
  if (bit_exact) return "bit-exact";
  char buf[96];
  std::snprintf(buf, sizeof buf, "max abs err %.2e (of max %.2g)", max_abs, max_ref);
  return buf;
}

namespace {
template <typename T>
Diff compare_impl(const T* a, const T* b, int64_t n, cudaStream_t s) {
  DevBuf out(4 * sizeof(float), "compare result");
  check(cudaMemsetAsync(out.as<float>(), 0, 4 * sizeof(float), s), "cudaMemsetAsync");
  diff_kernel<T><<<grid_for(n), kThreads, 0, s>>>(a, b, n, out.as<float>());
  check(cudaGetLastError(), "diff launch");
  float h[4];
  check(cudaMemcpyAsync(h, out.as<float>(), sizeof h, cudaMemcpyDeviceToHost, s),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(s), "compare sync");
  int ndiff = 0, nbad = 0;
  std::memcpy(&ndiff, &h[2], 4);
  std::memcpy(&nbad, &h[3], 4);
  Diff d;
  d.max_abs = h[0];
  d.max_ref = h[1];
  d.bit_exact = ndiff == 0 && nbad == 0;
  d.finite = nbad == 0;
  return d;
}
}  // namespace

Diff compare_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, cudaStream_t s) {
  return compare_impl(a, b, n, s);
}
Diff compare_f32(const float* a, const float* b, int64_t n, cudaStream_t s) {
  return compare_impl(a, b, n, s);
}

Summary time_launches(const std::function<void(int)>& launch, cudaStream_t s,
                      const TimerOptions& o) {
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  struct Guard {
    cudaEvent_t a, b;
    ~Guard() {
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
  } guard{e0, e1};
  // Warm-up and a first estimate with plain launches.
  launch(0);
  check(cudaStreamSynchronize(s), "warm-up");
  check(cudaEventRecord(e0, s), "cudaEventRecord");
  for (int i = 0; i < 3; ++i) launch(i);
  check(cudaEventRecord(e1, s), "cudaEventRecord");
  check(cudaEventSynchronize(e1), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
  const double est = std::max(1e-7, ms * 1e-3 / 3);
  const int per = std::max(
      o.min_per_replay, static_cast<int>(std::clamp(std::ceil(o.min_sample_s / est), 1.0, 256.0)));

  // Capture `per` launches into a graph.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool graphed = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
  if (graphed) {
    try {
      for (int i = 0; i < per; ++i) launch(i);
    } catch (...) {
      cudaStreamEndCapture(s, &graph);
      if (graph) cudaGraphDestroy(graph);
      cudaGetLastError();
      graph = nullptr;
      graphed = false;
    }
    if (graphed) {
      graphed = cudaStreamEndCapture(s, &graph) == cudaSuccess && graph &&
                cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
      if (!graphed) cudaGetLastError();
    }
  } else {
    cudaGetLastError();
  }
  auto replay = [&]() {
    if (graphed) {
      check(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
    } else {
      for (int i = 0; i < per; ++i) launch(i);
    }
  };
  replay();
  replay();
  std::vector<double> t;
  for (int r = 0; r < o.samples; ++r) {
    check(cudaEventRecord(e0, s), "cudaEventRecord");
    replay();
    check(cudaEventRecord(e1, s), "cudaEventRecord");
    check(cudaEventSynchronize(e1), "cudaEventSynchronize");
    check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    t.push_back(ms * 1e-3 / per);
  }
  check(cudaStreamSynchronize(s), "timing sync");
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  return summarize(std::move(t));
}

}  // namespace ds::bench::gpu
