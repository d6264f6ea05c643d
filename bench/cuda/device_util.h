// Device helpers of the GPU benches: owned device buffers, random fills (never zeros: METHOD.md),
// the streaming-read kernel of the bandwidth ceiling, output comparison, and the timer that every
// GPU number comes from (a CUDA graph of several launches, replayed between CUDA events, the
// median over replays; plain launches when a call cannot be captured).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "bench/bench_math.h"

namespace ds::bench::gpu {

// Throws ds::Error naming the call and the CUDA error.
void check(cudaError_t e, const char* what);

// One cudaMalloc, freed on destruction. Movable, not copyable.
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes, const char* what = "bench buffer");
  ~DevBuf();
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  DevBuf& operator=(DevBuf&& o) noexcept;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// mean + std * N(0, 1) from a counter-based generator (the value depends on (seed, index) only).
void fill_normal_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed, float mean, float std,
                      cudaStream_t s);
void fill_normal_f32(float* p, int64_t n, uint64_t seed, float mean, float std, cudaStream_t s);
void fill_uniform_f32(float* p, int64_t n, uint64_t seed, float lo, float hi, cudaStream_t s);

// Reads n_bytes (a multiple of 16) with 16-byte loads and sums them as bf16 pairs into
// partial[grid] (so the loads cannot be dropped). partial needs read_kernel_blocks() floats.
int read_kernel_blocks();
void launch_stream_read(const void* p, size_t n_bytes, float* partial, cudaStream_t s);

// max |a - b| and max |b| over n elements, written to out[0], out[1] (device floats); synchronous
// helper returns both on the host.
struct Diff {
  double max_abs = 0, max_ref = 0;
  bool bit_exact = false;
  bool finite = true;
  std::string text() const;  // "bit-exact" / "max abs err 1.2e-03 (of max 3.4)"
};
Diff compare_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, cudaStream_t s);
Diff compare_f32(const float* a, const float* b, int64_t n, cudaStream_t s);

// Times `launch(i)` (i = 0, 1, 2, ... selects the rotated input set): captures a graph of
// `per_replay` launches (chosen so that one replay lasts at least min_sample_s, at most 256
// launches, at least min_per_replay), replays it `samples` times between events after two warm-up
// replays, and returns the per-launch time of each replay. Falls back to plain launches when
// capture fails.
struct TimerOptions {
  int samples = 30;
  double min_sample_s = 2e-4;
  int min_per_replay = 1;  // at least this many launches per replay (= the rotation period)
};
Summary time_launches(const std::function<void(int)>& launch, cudaStream_t s,
                      const TimerOptions& o);

}  // namespace ds::bench::gpu
