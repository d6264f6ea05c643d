// A device-to-device copy kernel for `bench ceilings`: 16-byte streaming loads and stores, four
// loads in flight per thread, a grid that fills every SM once (grid-stride). Measured on the H200
// (2026-11-29, in a CUDA graph): 3.81 TB/s, against cudaMemcpyAsync 4.22 TB/s as plain calls and
// 2.76 TB/s as a graph memcpy node (copy engines). The ceiling uses the plain cudaMemcpyAsync;
// this kernel is printed beside it (a graph-capturable copy for whoever needs one).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace ds::bench::gpu {

// dst[0, n_bytes) = src[0, n_bytes); both 16-byte aligned, n_bytes a multiple of 16.
void launch_copy_16b(void* dst, const void* src, size_t n_bytes, cudaStream_t s);

}  // namespace ds::bench::gpu
