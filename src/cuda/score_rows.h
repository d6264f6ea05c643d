// Prompt logprobs on the device (sampling.cu), for the CUDA engine's scored prompt rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ds::cuda {
// Prompt logprobs on the device: for each of n scored rows (rows[i] of logits [*, vocab], its
// target token targets[i]) the target's logprob = (l_t - max) - log(sum e^(l - max)) (float exps
// summed in float per thread, then across the block), its rank (how many logits are >= l_t,
// vLLM's) and the top_k (<= kMaxScoreTop, <= vocab) largest logits' ids and logprobs, best
// first, ties to the lower id; a NaN logit counts as -inf (as in the host's position_logprobs).
// out: [n, score_stride(top_k)] 32-bit words: logprob (float), rank (int), then top_k x (id
// (int), logprob (float)). One block per row; top_k + 2 passes over the row.
constexpr int kMaxScoreTop = 32;
__host__ __device__ inline int score_stride(int top_k) { return 2 + 2 * top_k; }
void launch_score_rows(const float* logits, int vocab, const int32_t* rows,
                       const int32_t* targets, int n, int top_k, uint32_t* out,
                       cudaStream_t stream);

}  // namespace ds::cuda
