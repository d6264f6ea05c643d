// Shared CUDA helpers for every kernel file and the engine: the bf16 type, error checks that throw
// ds::Error (naming the call and the place), launch checks, the per-device shared-memory opt-in
// (ensure_smem_optin), and small device math helpers.
// Host code (g++) may include this header: the device-only parts are guarded by __CUDACC__.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/error.h"

namespace ds::cuda {

using bf16 = __nv_bfloat16;

// Throws ds::Error with the CUDA error string and where it happened.
[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  ds::throw_error("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") in ",
                  what, " at ", file, ":", line);
}

}  // namespace ds::cuda

#define DS_CUDA_CHECK(call)                                                                       \
  do {                                                                                            \
    cudaError_t ds_err_ = (call);                                                                 \
    if (ds_err_ != cudaSuccess) ::ds::cuda::throw_cuda_error(ds_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: catches bad launch configurations at once (no synchronisation).
#define DS_CUDA_LAUNCH_CHECK() DS_CUDA_CHECK(cudaGetLastError())

namespace ds::cuda {

// Lets kernel `func` use `bytes` of dynamic shared memory (the > 48 KiB opt-in,
// cudaFuncAttributeMaxDynamicSharedMemorySize) on the current device, set once per (kernel,
// device): the attribute belongs to the device's context, so a process-wide std::call_once would
// leave the launch on a second device failing. Thread-safe; keeps the largest size asked for. Call
// it before every launch of such a kernel (after the first call: a map lookup under a mutex).
inline void ensure_smem_optin(const void* func, size_t bytes) {
  int device = 0;
  DS_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> set_bytes;  // (kernel, device) -> bytes
  const std::lock_guard<std::mutex> lock(mu);
  size_t& done = set_bytes[{func, device}];
  if (done >= bytes) return;
  DS_CHECK(bytes <= size_t(INT32_MAX), "ensure_smem_optin: ", bytes, " bytes of shared memory");
  DS_CUDA_CHECK(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(bytes)));
  done = bytes;
}

// A 0/1 switch from the environment: unset or empty -> `dflt`, "0" / "1" -> false / true, anything
// else throws ds::Error naming the variable. Callers cache it (read once per process).
inline bool env_switch(const char* name, bool dflt) {
  const char* e = std::getenv(name);
  const std::string v = e ? e : "";
  DS_CHECK(v.empty() || v == "0" || v == "1", name, " must be 0 or 1, got '", v, "'");
  return v.empty() ? dflt : v == "1";
}

// A form switch (an enum) read from the environment variable `env` by `parse` on first use, unless
// set before: `slot` holds the form as an int, -1 while not read yet. Thread-safe; the first value
// stored wins.
template <class Form>
Form cached_form(std::atomic<int>& slot, const char* env, Form (*parse)(const char*)) {
  int f = slot.load(std::memory_order_relaxed);
  if (f < 0) {
    f = static_cast<int>(parse(std::getenv(env)));
    int expected = -1;
    if (!slot.compare_exchange_strong(expected, f)) f = expected;
  }
  return static_cast<Form>(f);
}

}  // namespace ds::cuda

#ifdef __CUDACC__
namespace ds::cuda {

// y[i] = v (+ y[i] when accumulate), rounded to y's type: the GEMV / GEMM epilogue store.
__device__ __forceinline__ void store_out(bf16* y, size_t i, float v, bool accumulate) {
  if (accumulate) v += __bfloat162float(y[i]);
  y[i] = __float2bfloat16(v);
}
__device__ __forceinline__ void store_out(float* y, size_t i, float v, bool accumulate) {
  if (accumulate) v += y[i];
  y[i] = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory; safe to call repeatedly with the same scratch.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

// Launches `kernel` on `stream`, with programmatic dependent launch when `pdl` (the kernel may
// then start while the previous kernel of the stream still runs: it must read that kernel's
// outputs and write anything only after `griddepcontrol.wait`).
template <typename... KArgs, typename... Args>
void launch_maybe_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                      cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t lc = {};
  lc.gridDim = grid;
  lc.blockDim = block;
  lc.dynamicSmemBytes = smem_bytes;
  lc.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  lc.attrs = attr;
  lc.numAttrs = pdl ? 1 : 0;
  DS_CUDA_CHECK(cudaLaunchKernelEx(&lc, kernel, std::forward<Args>(args)...));
}

}  // namespace ds::cuda
#endif
