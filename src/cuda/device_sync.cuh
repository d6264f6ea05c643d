// Device-side synchronisation helpers shared by kernels that wait on another block or kernel
// (bulk_copy.cuh, gdn_decode.cu, attention_decode.cu; mma_util.cuh includes this header): the
// GPU-scope acquire load of a flag or counter, the %globaltimer clock, and the early start on a
// producer's counter (session 32's gdn_decode, session 33's attention split kernel).
// Everything is __device__ __forceinline__. Include only from .cu files (nvcc).
#pragma once

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

// The early start on a producer's counter (gdn_decode.cu EARLY, attention_decode.cu kEarly; the
// bulk GEMV's GemvSignal raises it). One thread per block: early_spin waits (acquire) until
// *ready >= target, giving up after kEarlySpinNs (a producer that never raises: misuse), counted
// in *late when late is not null; false when it gave up (the block then waits for the producer's
// end, griddepcontrol.wait, as without the signal). early_done, once per block after its spin
// (after that wait where it gave up): adds one, and the block that brings the counter to
// target + blocks resets it to zero for the next launch (every block has passed its spin then,
// and the producer has raised everything).
constexpr unsigned long long kEarlySpinNs = 2000000ull;  // 2 ms
__device__ __forceinline__ bool early_spin(const unsigned* ready, unsigned target,
                                           unsigned* late) {
  const unsigned long long t0 = globaltimer_ns();
  bool ok = true;
  while (load_acquire(ready) < target) {
    if (globaltimer_ns() - t0 > kEarlySpinNs) {
      ok = false;
      break;
    }
    __nanosleep(500);  // the signals come ~15 us before the producer's end: no hurry
  }
  if (!ok && late != nullptr) atomicAdd(late, 1u);
  return ok;
}
__device__ __forceinline__ void early_done(unsigned* ready, unsigned target) {
  const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
  if (atomicAdd(ready, 1u) == target + blocks - 1u) atomicExch(ready, 0u);
}

}  // namespace ds::cuda
