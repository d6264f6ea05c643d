// Greedy sampling on the device for the engine's step_greedy(): the argmax of each fp32 logits
// row, lowest index on ties, exactly what the host's greedy_token() returns (runtime/backend.h),
// including -1 for a row that holds NaN or +inf (the host sampler refuses such rows). 4 bytes per
// row go back to the host instead of the vocab-sized row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ds::cuda {

// out[r] = argmax_i logits[r, i] (lowest i on ties; 0 for a row of -inf), or -1 when the row
// holds a NaN or +inf. One block of 1024 threads per row, 16-byte loads when vocab % 4 == 0.
// Asynchronous, no allocation, CUDA-graph safe.
void launch_argmax_rows(const float* logits,  // [n_rows, vocab]
                        int n_rows, int vocab,
                        int32_t* out,  // [n_rows]
                        cudaStream_t stream);

}  // namespace ds::cuda
