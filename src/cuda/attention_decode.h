// Decode attention (attention_decode.cu), beyond kernels.h: how the mma split kernel cuts a
// sequence into splits (planned on the host, or adapted to each sequence's length on the device),
// whether it is launched as a programmatic dependent (PDL) of the kernel before it (rope_kv in the
// engine), and the engine's switch between the two ways ($DS_ATTN_DECODE).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/kernels.h"

namespace ds::cuda {

// How the keys of a sequence are cut into splits:
//  kPlanned: n_splits splits of kv_chunk keys for every sequence (the host's plan,
//    attention_decode_kv_chunk; n_splits * kv_chunk >= every kv_len). Splits past a sequence's
//    length write empty partials; the merge kernel reads all n_splits.
//  kAdaptive (mma kernel only): per sequence, on the device, n = min(n_splits,
//    ceil(kv_len / kv_chunk)) splits of ceil(kv_len / n) keys rounded up to the 8-key tile, i.e.
//    kv_chunk is the smallest split and n_splits the most splits per sequence (the grid's; use
//    attention_decode_adaptive_splits for one wave of the split kernel). Unused splits exit at
//    once and write nothing; the merge (one block per (query head, column slice) at small batch)
//    reads only the used ones. Any kv_len works with one grid, so a CUDA graph captured at one
//    context length fills the GPU at every other.
enum class AttnDecodeSplit { kPlanned, kAdaptive };

// rope_kv's work done by the mma split kernel itself (AttnDecodeLaunch::rope, kAdaptive only), so
// the decode step needs no rope_kv launch before the attention: every split block of (sequence,
// kv head) normalises and rotates the GQA group's query heads from the fused projection row
// (q_norm) into shared memory, and the block holding the sequence's newest key (the last used
// split) also writes that row's normalised, rotated key and its value into the paged cache at
// slot_mapping[row] (k_norm) before it reads the row back as part of its last tile. The
// arithmetic is rope_kv's warp-per-head kernel's (rope_kv.cuh norm_rope_lane_x): outputs and cache
// rows bit-identical to rope_kv + the plain path. Needs qk_norm_rope_kv_warp_supported, 16-byte
// aligned projection rows and weights; the positions / slot_mapping of row q_start[seq]; no
// negative slot (a decode row always has one). The `q` argument of launch_attention_decode is
// then unused (may be null).
struct AttnDecodeRope {
  const __nv_bfloat16* qkv = nullptr;  // [rows, qkv_dim]: [q(+gate) | k | v]; null: off
  const __nv_bfloat16* q_norm_w = nullptr;  // [head_dim]
  const __nv_bfloat16* k_norm_w = nullptr;  // [head_dim]
  const int32_t* positions = nullptr;       // [rows]
  const int32_t* slot_mapping = nullptr;    // [rows]
  __nv_bfloat16* k_cache = nullptr;         // the caches the attention reads (written here)
  __nv_bfloat16* v_cache = nullptr;
};

struct AttnDecodeLaunch {
  AttnDecodeKernel which = AttnDecodeKernel::kAuto;
  AttnDecodeSplit split = AttnDecodeSplit::kPlanned;
  // kAdaptive only: the split kernel is launched as a programmatic dependent of the previous
  // kernel of the stream, the merge kernel as one of the split kernel. Before
  // griddepcontrol.wait the split blocks read only the step metadata (kv_len, q_start, block
  // table) and the cached K/V rows of positions < kv_len - 1 (written by earlier forwards); q and
  // the newest row (kv_len - 1: written by the previous kernel, rope_kv) are read after it.
  // The previous kernel may therefore write only q and the newest K/V row of each sequence.
  bool pdl = false;
  // pdl only: the merge kernel lets its own programmatic dependent (the attn_o GEMV) launch as soon
  // as all merge blocks are resident (under PDL: while the split kernel still runs), instead of
  // once they have passed their wait; the dependent's weight prefetch then overlaps the split
  // kernel. Same results.
  bool early_dependents = false;
  // kAdaptive only: the merge loads each phase's inputs after the barrier before it (the form of
  // sessions 4-6) instead of in one round trip (attention_merge_one_trip). Same results, bit for
  // bit; for the tests' comparison.
  bool serial_merge = false;
  // kAdaptive only: the split kernel does rope_kv's work (AttnDecodeRope above) when rope.qkv.
  AttnDecodeRope rope;
  // kAdaptive only: the split kernel runs in clusters of kAttnDecodeClusterSplits blocks (one per
  // (kv head, sequence)) and merges the partials itself through distributed shared memory: no
  // merge kernel, no partials in the workspace. n_splits must be kAttnDecodeClusterSplits. Not
  // bit-identical to the two-kernel path (other splits); session 22, not yet measured.
  bool cluster = false;
};
// The splits (= blocks per cluster) of AttnDecodeLaunch::cluster: a non-portable cluster size
// (Hopper allows 16 with cudaFuncAttributeNonPortableClusterSizeAllowed).
constexpr int kAttnDecodeClusterSplits = 16;

// Splits per sequence for kAdaptive: one wave of the split kernel (2 blocks per SM) over n_seqs x
// n_kv_heads, at most max_splits, at least 1.
int attention_decode_adaptive_splits(int n_seqs, int n_kv_heads, int n_sms, int max_splits);

// Runs the split kernel chosen by `how` and its merge. Throws ds::Error when kAdaptive is asked
// for a shape or alignment the mma kernel cannot run, or pdl without kAdaptive.
void launch_attention_decode(const AttnShape& s, const AttnBatch& b, const __nv_bfloat16* q,
                             const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                             AttnGate gate, int kv_chunk, int n_splits, void* partials,
                             __nv_bfloat16* out, cudaStream_t stream, const AttnDecodeLaunch& how);

// rope_kv (rope_kv.cu, kernels.h) launched as a programmatic dependent of the previous kernel
// when pdl (the engine's decode step: after the attn_qkv GEMV, which triggers early): its blocks
// become resident early and read nothing before griddepcontrol.wait. Same results either way.
void launch_qk_norm_rope_kv(const AttnShape& s, const __nv_bfloat16* qkv,
                            const __nv_bfloat16* q_norm_w, const __nv_bfloat16* k_norm_w,
                            const int32_t* positions, const int32_t* slot_mapping, int n_tokens,
                            __nv_bfloat16* q_out, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
                            cudaStream_t stream, RopeKvKernel which, bool pdl);

// The engine's decode path, from $DS_ATTN_DECODE (read once per process): "pdl" = kAdaptive under
// PDL after rope_kv; "pdl_rope" = the same with rope_kv itself under PDL after the attn_qkv
// projection; "pdl_early" = "pdl" with AttnDecodeLaunch::early_dependents; "adaptive" = kAdaptive
// without PDL; "planned" = the session-4 path (kPlanned, no PDL). Unset: kDefaultAttnDecodeMode.
// Any other value throws ds::Error naming the variable.
enum class AttnDecodeMode { kPdlRope, kPdlEarly, kPdl, kAdaptive, kPlanned, kPdlCluster };
constexpr AttnDecodeMode kDefaultAttnDecodeMode = AttnDecodeMode::kPdl;
AttnDecodeMode attention_decode_mode();

// The adaptive merge's loads, from $DS_ATTN_MERGE (read once per process): "one_trip" (default)
// issues its (m, l), its first partial columns and the gate together right after the wait; "serial"
// loads each phase after the barrier before it (sessions 4-6). Bit-identical outputs (same sums in
// the same order). Any other value throws ds::Error naming the variable.
bool attention_merge_one_trip();

}  // namespace ds::cuda
