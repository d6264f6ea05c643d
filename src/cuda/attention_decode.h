// Decode attention (attention_decode.cu), beyond kernels.h: the workspace initialisation that the
// folded merge needs, and the choice of merge for A/B tests and benches.
// The mma split kernel can merge the partials in its last block per (sequence, kv head) (found by
// an atomic counter per (sequence, kv head) at the start of the workspace), bit-identical to its
// separate merge kernel. Off by default (the first version measured slower on the H200, see
// docs/perf/decode_kernels.md); DS_ATTN_FOLD_MERGE=1 in the environment (read once) turns it on
// for kAuto / kMma launches (the engine's).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/kernels.h"

namespace ds::cuda {

// Zeroes the merge counters at the start of a decode workspace (attention_decode_workspace_bytes):
// call it ONCE after allocating the workspace, before its first launch. Every launch leaves the
// counters at 0 again (the last block of each (sequence, kv head) wraps its counter), so CUDA-graph
// replays need nothing. A workspace that was not initialised gives unwritten outputs.
void attention_decode_workspace_init(void* partials, cudaStream_t stream);

// true when the environment has DS_ATTN_FOLD_MERGE=1.
bool attention_decode_fold_enabled();

// How the mma kernel merges: kDefault = folded when DS_ATTN_FOLD_MERGE=1; kFold = folded;
// kSplitMerge = the separate merge kernel. The fold also needs n_seqs * n_kv_heads <= 4096 and
// group * n_splits weights in the kernel's shared memory (else the separate kernel merges). The
// simt kernel always merges in a second kernel.
enum class AttnDecodeMerge { kDefault, kFold, kSplitMerge };

void launch_attention_decode(const AttnShape& s, const AttnBatch& b, const __nv_bfloat16* q,
                             const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                             AttnGate gate, int kv_chunk, int n_splits, void* partials,
                             __nv_bfloat16* out, cudaStream_t stream, AttnDecodeKernel which,
                             AttnDecodeMerge merge);

}  // namespace ds::cuda
