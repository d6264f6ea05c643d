// Greedy sampling on the device for the engine's step_greedy(): the argmax of each fp32 logits
// row, lowest index on ties, exactly what the host's greedy_token() returns (runtime/backend.h),
// including -1 for a row that holds NaN or +inf (the host sampler refuses such rows). 4 bytes per
// row go back to the host instead of the vocab-sized row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ds::cuda {

enum class ArgmaxKernel {
  kAuto,   // the cluster kernel where it applies (argmax_cluster_applies), else kBlock
  kBlock,  // one block of 1024 threads per row
};
// The engine's choice: kBlock, or kAuto with $DS_ARGMAX_CLUSTER=1 (read once per process; an
// experiment switch until the cluster kernel is measured on the device).
ArgmaxKernel argmax_kernel_default();
// The cluster kernel's guard: 8 blocks of 1024 threads per row, each scanning one contiguous
// eighth; vocab % 4 == 0, vocab >= 32768, 16-byte aligned logits, n_rows <= 65535.
bool argmax_cluster_applies(const float* logits, int n_rows, int vocab);

// out[r] = argmax_i logits[r, i] (lowest i on ties; 0 for a row of -inf), or -1 when the row
// holds a NaN or +inf; the same answer from either kernel. 16-byte loads when vocab % 4 == 0.
// Asynchronous, no allocation, CUDA-graph safe. pdl: the cluster kernel is launched as a
// programmatic dependent of the kernel before it (it reads the logits after griddepcontrol.wait);
// the block kernel never is.
void launch_argmax_rows(const float* logits,  // [n_rows, vocab]
                        int n_rows, int vocab,
                        int32_t* out,  // [n_rows]
                        cudaStream_t stream, ArgmaxKernel which, bool pdl);
// The same with argmax_kernel_default() and no PDL.
void launch_argmax_rows(const float* logits, int n_rows, int vocab, int32_t* out,
                        cudaStream_t stream);

}  // namespace ds::cuda
