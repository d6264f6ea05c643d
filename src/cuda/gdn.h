// Gated DeltaNet (GDN) kernels: the linear-attention mixer of the Qwen3.5 layers (SPEC.md "Gated
// DeltaNet"), for prompts (chunked WY/UT form, chunk 64, many sequences of different lengths in
// one launch) and for decode (one fused kernel per layer for a batch of sequences).
//
// Input of both paths: the fused projection output per token (rows of the fused gdn_in matrix,
// weights.h), proj[t] = [qkv (2*n_k_heads*d_k + n_v_heads*d_v) | z (n_v_heads*d_v) | b (n_v_heads)
// | a (n_v_heads)], bf16, contiguous. qkv = [q: n_k_heads x d_k | k: n_k_heads x d_k | v:
// n_v_heads x d_v]; value head h uses key head h / (n_v_heads / n_k_heads).
// Output of both paths: the out_proj input, y[t] = [n_v_heads, d_v] bf16, where per head
// y = norm_w * rmsnorm(o) * silu(z) (plain w, not zero-centred).
//
// Per-sequence state lives in slots (one per running sequence; the engine owns the pools):
//  - conv state: a ring of the last 4 pre-conv qkv inputs, bf16 [4, qkv_dim]; the input of the
//    token at absolute position p (0-based, within its sequence) is row p % 4. A ring (not a
//    shifted window) lets the decode kernel update it in place without a race between the blocks
//    that share a key head. Rows of positions < 0 are never read (zeros are used instead).
//  - recurrent state: fp32 [n_v_heads, d_v, d_k] (k contiguous), i.e. S^T of SPEC.md's S[k, v].
//    Prefill and decode use this one layout.
// A sequence with seq_pos == 0 starts from zero state (the slot's old contents are ignored and
// overwritten), so slots need no clearing between requests.
//
// Sizes are run-time (checked, ds::Error otherwise): d_k one of 16, 32, 64, 128; d_v a multiple
// of 4 up to 128; n_v_heads a multiple of n_k_heads; conv_kernel 4. The fast kernels (tensor-core
// chunked prefill, 4-block-cluster decode) take d_v in {16, 32, 64, 128}; other d_v (e.g. 24 in
// the golden "other ratios" fixture) go to correct but slow generic kernels (token-by-token
// prefill, one block per head in decode).
// Tests and timings: tests/cuda/cuda_gdn_test.cpp (vs a token-by-token fp32 CPU recurrence).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace ds::cuda {

class DispatchRegistry;  // dispatch.h

struct GdnShape {
  int n_k_heads = 0;  // linear_num_key_heads (16 for 27B)
  int n_v_heads = 0;  // linear_num_value_heads (48)
  int d_k = 0;        // linear_key_head_dim (128)
  int d_v = 0;        // linear_value_head_dim (128)
  int conv_kernel = 4;
  float norm_eps = 1e-6f;  // eps of the gated RMSNorm (rms_norm_eps)

  __host__ __device__ int qkv_dim() const {
    return 2 * n_k_heads * d_k + n_v_heads * d_v;
  }  // conv channels
  __host__ __device__ int z_dim() const { return n_v_heads * d_v; }
  __host__ __device__ int in_dim() const {
    return qkv_dim() + z_dim() + 2 * n_v_heads;
  }  // proj row length
  __host__ __device__ int out_dim() const { return n_v_heads * d_v; }
};

// Throws ds::Error when the shape is not supported (names the field).
void check_gdn_shape(const GdnShape& s);

// Device pointers of one GDN layer's small weights.
struct GdnLayerWeights {
  const __nv_bfloat16* conv_w = nullptr;  // [qkv_dim, conv_kernel] (checkpoint [qkv_dim, 1, 4])
  const float* A_log = nullptr;           // [n_v_heads] fp32 (the engine widens at upload)
  const float* dt_bias = nullptr;         // [n_v_heads] fp32
  const __nv_bfloat16* norm_w = nullptr;  // [d_v]; nullptr: no gated norm, y = o (raw output)
};

// Device state pools of one layer. Slot s: conv_state + s * conv_slot_stride and
// rec_state + s * rec_slot_stride (strides in elements; at least 4 * qkv_dim and
// n_v_heads * d_v * d_k), so one pool can interleave the layers as the engine likes.
struct GdnStatePool {
  __nv_bfloat16* conv_state = nullptr;  // per slot [4, qkv_dim] ring, row p % 4
  float* rec_state = nullptr;           // per slot [n_v_heads, d_v, d_k]
  int64_t conv_slot_stride = 0;
  int64_t rec_slot_stride = 0;
};

// ---- Prompt path ------------------------------------------------------------------------------
// Device workspace the prompt path needs for up to max_tokens tokens in up to max_seqs sequences.
size_t gdn_prefill_workspace_bytes(const GdnShape& s, int max_tokens, int max_seqs);
// The per-chunk ready flags inside such a workspace (tests): [max_chunks, n_v_heads] ints, where
// chunk c counts the state-pass warps that have published it (the chunks numbered across the
// sequences in order; slots past the last chunk stay 0). *count = max_chunks * n_v_heads.
const int* gdn_prefill_ready_flags(const GdnShape& s, int n_tokens, int n_seqs,
                                   const void* workspace, size_t* count);

// The whole GDN mixer for a prompt chunk of n_seqs sequences packed back to back (n_tokens in
// all): conv + SiLU (reading the ring for positions before the chunk), gates, l2norm, the chunked
// recurrence from each slot's state (zero when seq_pos == 0), final state and conv ring written
// back to the slots, gated RMSNorm. Several kernels on `stream`; no host synchronisation, no
// allocation (CUDA-graph safe for fixed n_tokens / n_seqs; the lengths may vary on the device).
// Zero-length sequences are allowed (their state is left untouched).
void launch_gdn_prefill(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                        const __nv_bfloat16* proj,  // [n_tokens, in_dim]
                        const int32_t* cu_seqlens,  // [n_seqs + 1] token offsets, device
                        const int32_t* seq_pos,     // [n_seqs] tokens already in each sequence
                        const int32_t* slot_ids,    // [n_seqs] state slot of each sequence
                        int n_seqs, int n_tokens, void* workspace, size_t workspace_bytes,
                        __nv_bfloat16* out,  // [n_tokens, n_v_heads * d_v]
                        cudaStream_t stream,
                        const DispatchRegistry* dispatch = nullptr);  // null: generic kernels

// ---- Decode path ------------------------------------------------------------------------------
// The early start (session 32, $DS_GDN_EARLY): the in-projection GEMV raises *ready as its qkv,
// b and a rows are stored (GemvSignal, gemv.h; `target` raises in all), and the split decode
// kernels (kSplit2 / kSplit4, d_k 128) wait for that instead of the GEMV's end for everything but
// z. The last block resets *ready to 0, so one zeroed counter per layer serves every step (each
// launch with `ready` must follow exactly one signalled GEMV launch of `target` raises).
// ready null: off. Same states and outputs, bit for bit.
struct GdnDecodeEarly {
  unsigned* ready = nullptr;
  unsigned target = 0;
  unsigned* late = nullptr;  // optional: +1 per block that gave up waiting (2 ms) and ran plainly
};

// One token for each of n_seqs sequences, one fused kernel: conv ring update + conv + SiLU, q/k
// l2norm (q scaled by d_k^-0.5), beta and g, state decay + delta update + readout (state read and
// written once, fp32), gated RMSNorm. seq_pos[i] is the position of the new token (= tokens
// already in sequence i).
void launch_gdn_decode(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                       const __nv_bfloat16* proj,  // [n_seqs, in_dim]
                       const int32_t* seq_pos,     // [n_seqs]
                       const int32_t* slot_ids,    // [n_seqs]
                       int n_seqs,
                       __nv_bfloat16* out,  // [n_seqs, n_v_heads * d_v]
                       cudaStream_t stream);
// The same step with an explicit kernel (gdn_decode.cu), all with the same results (states
// bit-equal: the same per-row arithmetic; outputs up to the order of the norm's sum of squares):
//  - kCluster4 / kCluster8: each value head split over a cluster of 4 / 8 blocks, the gated norm's
//    sum through distributed shared memory (4: 1 block when d_v % 16 != 0; 8 needs d_v % 32 == 0);
//  - kStream: one 256-thread block per (sequence, value head), the head's state streamed into
//    shared memory by bulk copies in 8 KiB chunks through a ring of 4 chunk buffers and written
//    back from registers as each chunk is updated; no cluster barrier. kStreamWhole: the same
//    with the whole head in flight at once (64 KiB of shared memory; A/B variant, slower on the
//    H200). Both need gdn_decode_stream_supported.
//  - kSplit2 / kSplit4: the streaming kernel's code with each head's rows split over a cluster of
//    2 / 4 blocks (d_v / 2 or d_v / 4 contiguous rows each, all in flight at once); every block
//    sends its rows' o to its peers (st.async into their shared memory) and reduces the whole
//    head as kStream does, so states AND outputs are bit-equal to kStream's. Need
//    gdn_decode_split_supported (d_v % 8 / % 16 == 0 and the streaming kernel's alignment).
//  - kPersist / kPersistDeep: the streaming kernel's code in a persistent grid of at most one
//    wave (occupancy x SMs blocks, each walking the same number of (sequence, value head) units
//    with a static stride), the block's state chunks one stream through a ring of 4 / 8 chunk
//    buffers (32 / 64 KiB), so the next unit's copies are in flight while the current one
//    finishes; no partial wave at any batch size. States AND outputs bit-equal to kStream's.
//    Need gdn_decode_stream_supported. $DS_GDN_DECODE_PERSIST_BLOCKS (a positive count, read at
//    each launch) caps the grid below one wave, for tests and A/B runs.
//  - kAuto: the choice by batch size measured on the H200 (gdn_decode.cu).
// Every kernel needs a 16-byte aligned rec_state and rec_slot_stride % 4 == 0 (ds::Error
// otherwise); forcing an unsupported kernel throws ds::Error.
enum class GdnDecodeKernel {
  kAuto,
  kCluster4,
  kCluster8,
  kStream,
  kStreamWhole,
  kSplit2,
  kSplit4,
  kPersist,
  kPersistDeep
};
bool gdn_decode_cluster8_supported(const GdnShape& s);
// The kernel launch_gdn_decode runs for `which` (kAuto resolved by batch size; kAuto back means
// the cluster kernels), and whether that kernel takes GdnDecodeEarly.
GdnDecodeKernel gdn_decode_resolve(const GdnShape& s, const GdnStatePool& pool, int n_seqs,
                                   GdnDecodeKernel which);
bool gdn_decode_early_supported(const GdnShape& s, GdnDecodeKernel resolved);
bool gdn_decode_stream_supported(const GdnShape& s, const GdnStatePool& pool);
bool gdn_decode_split_supported(const GdnShape& s, const GdnStatePool& pool, int n_split);
// The kernel that runs a gdn_decode dispatch variant (dispatch.cpp: "fused_persist",
// "fused_persist_deep", "fused_split2",
// "fused_split4", "fused_stream", "fused_cluster8", "fused"); false for a variant that is not the
// fused step ("prefill_path").
bool gdn_decode_kernel_for_variant(const std::string& variant, GdnDecodeKernel* which);
void launch_gdn_decode(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                       const __nv_bfloat16* proj, const int32_t* seq_pos, const int32_t* slot_ids,
                       int n_seqs, __nv_bfloat16* out, cudaStream_t stream, GdnDecodeKernel which);
// With pdl, the kernel is a programmatic dependent of the previous kernel of the stream (the
// in-projection GEMV that writes proj): its blocks load the recurrent state, the conv taps and
// the weights while that kernel runs, and read proj / write anything only after
// griddepcontrol.wait (gdn_decode.cu says why the bytes read before it are final). Same results
// as without, bit for bit (the same kernel; only the launch attribute differs).
void launch_gdn_decode(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                       const __nv_bfloat16* proj, const int32_t* seq_pos, const int32_t* slot_ids,
                       int n_seqs, __nv_bfloat16* out, cudaStream_t stream, GdnDecodeKernel which,
                       bool pdl, const GdnDecodeEarly& early = {});
// The engine's PDL choice, from $DS_GDN_DECODE_PDL (read at each call): "0" never, "1" at
// every batch size, unset: by batch size as measured on the H200 (gdn_decode.cu). Any other value
// throws ds::Error.
enum class GdnDecodePdl { kDefault, kOff, kOn };
GdnDecodePdl gdn_decode_pdl_mode();
bool gdn_decode_pdl_for(int n_seqs);

// ---- Prompt-path stages (launch_gdn_prefill runs these; exposed for tests and later fusions) ---
// Conv + SiLU over the qkv channels, l2norm of q and k (q also times d_k^-0.5), and the gates.
void launch_gdn_conv_prep(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                          const __nv_bfloat16* proj,  // [n_tokens, in_dim]
                          const int32_t* cu_seqlens, const int32_t* seq_pos,
                          const int32_t* slot_ids, int n_seqs, int n_tokens,
                          __nv_bfloat16* qkv,  // [n_tokens, qkv_dim] conv+SiLU, q/k normalised
                          float* g,            // [n_tokens, n_v_heads] log decay (<= 0)
                          float* beta,         // [n_tokens, n_v_heads]
                          cudaStream_t stream);

// Writes the last 4 pre-conv inputs of each sequence into its ring (run after conv_prep).
void launch_gdn_conv_state_update(const GdnShape& s, const GdnStatePool& pool,
                                  const __nv_bfloat16* proj,  // [n_tokens, in_dim]
                                  const int32_t* cu_seqlens, const int32_t* seq_pos,
                                  const int32_t* slot_ids, int n_seqs, cudaStream_t stream);

}  // namespace ds::cuda
