// The one header model code includes for GPU work: every launch_* wrapper of the CUDA engine
// (embedding / row gather, zero-centred RMSNorm fused with the residual add, q/k norm + partial
// RoPE + paged KV-cache write, attention for prompts and for decode over the paged cache,
// SiLU-and-mul, bf16 <-> f32, sampling on the device) plus the GDN kernels (gdn.h).
//
// Conventions: activations are bf16 row-major [n_tokens, width]; accumulation is fp32; every
// launch is asynchronous on the given stream, never allocates and never synchronises (CUDA-graph
// safe); shapes the kernels do not support throw ds::Error at launch. Kernels take raw pointers,
// sizes and a stream, never model or runtime types.
//
// Paged KV cache (attention layers only): per layer a K pool and a V pool, each
// [n_blocks, n_kv_heads, page_size, head_dim] bf16 (one page of one head is contiguous). A
// sequence's block table lists its blocks in order; its token at position p lives in block
// block_table[p / page_size], row p % page_size. K is stored after q/k norm and RoPE.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gdn.h"

namespace ds::cuda {

class DispatchRegistry;  // dispatch.h: picks a specialised variant or the generic kernel

// ---- embedding.cu ----------------------------------------------------------------------------
// out[i, :] = src[idx[i], :]: the embedding lookup (src = table, idx = token ids) and the row
// gather before lm_head. idx must be in [0, n_src) (the engine checks token ids on the host).
void launch_gather_rows(const __nv_bfloat16* src,  // [n_src, d]
                        const int32_t* idx,        // [n_rows]
                        int n_rows, int d,
                        __nv_bfloat16* out,  // [n_rows, d]
                        cudaStream_t stream);

// ---- rmsnorm.cu ------------------------------------------------------------------------------
// Fused residual add + RMSNorm, per row, in fp32:
//   if delta: residual = bf16(residual + delta)        (the residual stream stays bf16, as HF)
//   out = bf16(residual * rsqrt(mean(residual^2) + eps) * (weight_offset + w))
// weight_offset = 1 for Qwen3.5's zero-centred norms, 0 for a plain RMSNorm.
void launch_add_rmsnorm(__nv_bfloat16* residual,     // [n_rows, d] (read; written when delta)
                        const __nv_bfloat16* delta,  // [n_rows, d] or nullptr
                        const __nv_bfloat16* w,      // [d]
                        int n_rows, int d, float eps, float weight_offset,
                        __nv_bfloat16* out,  // [n_rows, d]
                        cudaStream_t stream);
// The same with an explicit kernel build (rmsnorm.cu; every choice gives the same bits): kAuto =
// kFit for n_rows >= kRmsNormFitMinRows unless $DS_NORM_FIT=0 (read at each launch), else kMax8;
// kFit = the kernel compiled for the 16-byte vectors per thread that d needs (fewer registers,
// more blocks per SM: prompt chunks); kMax8 = the build for any d <= 16384 (8 vectors per thread).
enum class RmsNormKernel { kAuto, kFit, kMax8 };
constexpr int kRmsNormFitMinRows = 64;  // decode batches keep their launches unchanged
bool rmsnorm_fit_enabled();             // $DS_NORM_FIT: unset or "1" on, "0" off
void launch_add_rmsnorm(__nv_bfloat16* residual, const __nv_bfloat16* delta,
                        const __nv_bfloat16* w, int n_rows, int d, float eps, float weight_offset,
                        __nv_bfloat16* out, cudaStream_t stream, RmsNormKernel which);
// Whether launch_add_rmsnorm launches with programmatic dependent launch (it then overlaps its
// launch with the kernel before it and waits for it in-kernel): $DS_NORM_PDL, "0" off, "1" or
// unset on; read once per process.
bool rmsnorm_pdl_enabled();

// ---- rope_kv.cu ------------------------------------------------------------------------------
struct AttnShape {
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (n_heads % n_kv_heads == 0)
  int head_dim = 0;    // 16, 32, 64, 128 or 256
  int rotary_dim = 0;  // leading dims that RoPE rotates (even, <= head_dim)
  bool gated = true;   // q_proj rows per head are [query (head_dim) | gate (head_dim)]
  float rope_theta = 1e7f;
  float eps = 1e-6f;  // q_norm / k_norm epsilon
  int page_size = 0;  // tokens per KV block
  __host__ __device__ int q_proj_dim() const { return n_heads * head_dim * (gated ? 2 : 1); }
  __host__ __device__ int kv_dim() const { return n_kv_heads * head_dim; }
  __host__ __device__ int qkv_dim() const {
    return q_proj_dim() + 2 * kv_dim();
  }  // fused projection row length
};

// Throws ds::Error naming the field when the attention kernels do not support `s`.
void check_attn_shape(const AttnShape& s);

// From the fused projection qkv[t] = [q(+gate) | k | v]: zero-centred RMSNorm of each query and
// key head (q_norm / k_norm weights), RoPE (rotate-half, on the first rotary_dim dims, angle
// pos * theta^(-2i/rotary_dim)), q written to q_out, k and v written to the paged cache at
// slot_mapping[t] = block * page_size + row (a negative slot skips the cache write).
void launch_qk_norm_rope_kv(const AttnShape& s,
                            const __nv_bfloat16* qkv,       // [n_tokens, qkv_dim]
                            const __nv_bfloat16* q_norm_w,  // [head_dim]
                            const __nv_bfloat16* k_norm_w,  // [head_dim]
                            const int32_t* positions,       // [n_tokens] absolute positions
                            const int32_t* slot_mapping,    // [n_tokens]
                            int n_tokens,
                            __nv_bfloat16* q_out,    // [n_tokens, n_heads, head_dim]
                            __nv_bfloat16* k_cache,  // [n_blocks, n_kv_heads, page_size, head_dim]
                            __nv_bfloat16* v_cache,  // [n_blocks, n_kv_heads, page_size, head_dim]
                            cudaStream_t stream);
// The same with an explicit kernel (rope_kv.cu): kAuto = one warp per (token, head) when
// qk_norm_rope_kv_warp_supported(s) and the rows are aligned, else one block per token;
// kWarpPerHead throws when it cannot run the shape. Same results.
// kAuto: warp per head where it can run, else block per token; kTokenTable: one block per token
// with the angles computed once (the warp kernel's shapes only; bit-identical to it).
enum class RopeKvKernel { kAuto, kWarpPerHead, kBlockPerToken, kTokenTable };
bool qk_norm_rope_kv_warp_supported(const AttnShape& s);  // head_dim 64/128/256, rotary fits
void launch_qk_norm_rope_kv(const AttnShape& s, const __nv_bfloat16* qkv,
                            const __nv_bfloat16* q_norm_w, const __nv_bfloat16* k_norm_w,
                            const int32_t* positions, const int32_t* slot_mapping, int n_tokens,
                            __nv_bfloat16* q_out, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
                            cudaStream_t stream, RopeKvKernel which);

// ---- attention (attention_prefill.cu / attention_decode.cu) -----------------------------------
// A batch of sequences for attention; all arrays are on the device. Sequence i has q_len[i] query
// rows starting at row q_start[i] of q / gate / out; its cache already holds kv_len[i] tokens
// including these queries, so query j sits at position kv_len - q_len + j and sees keys
// 0..that position (causal, bottom-right aligned).
struct AttnBatch {
  int n_seqs = 0;
  const int32_t* q_start = nullptr;      // [n_seqs]
  const int32_t* q_len = nullptr;        // [n_seqs]
  const int32_t* kv_len = nullptr;       // [n_seqs]
  const int32_t* block_table = nullptr;  // [n_seqs, block_table_stride]
  int block_table_stride = 0;
  int max_q_len = 0;  // host-side bounds used for the grid (>= every q_len / kv_len)
  int max_kv_len = 0;
};

// The gate of the output (Qwen3.5's attn_output_gate): out *= sigmoid(gate), read with strides
// straight from the fused projection (gate of token t, head h at gate + t*token_stride +
// h*head_stride). ptr == nullptr: no gate.
struct AttnGate {
  const __nv_bfloat16* ptr = nullptr;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
};

// Prompt attention (any q_len, including 1): flash-style tiles of (query token, head of the GQA
// group) rows against K/V tiles, tensor cores (WMMA bf16, fp32 accumulate), online softmax in
// fp32, scale 1/sqrt(head_dim), sigmoid gate in the epilogue.
void launch_attention_prefill(const AttnShape& s, const AttnBatch& b,
                              const __nv_bfloat16* q,        // [n_rows, n_heads, head_dim]
                              const __nv_bfloat16* k_cache,  // paged, see above
                              const __nv_bfloat16* v_cache, AttnGate gate,
                              __nv_bfloat16* out,  // [n_rows, n_heads, head_dim]
                              cudaStream_t stream,
                              const DispatchRegistry* dispatch = nullptr);  // null: generic kernel

// Decode attention (q_len 1 for every sequence): split-KV over the paged cache, one block per
// (split, kv head, sequence) that serves all query heads of the GQA group, partial softmaxes
// merged by log-sum-exp in a second kernel. `partials` is workspace of
// attention_decode_workspace_bytes(s, n_seqs, n_splits); n_splits * kv_chunk >= every kv_len.
size_t attention_decode_workspace_bytes(const AttnShape& s, int n_seqs, int n_splits);
// Host planning: tokens per split for this batch (fills the GPU; a multiple of 64).
int attention_decode_kv_chunk(int n_seqs, int n_kv_heads, int max_kv_len, int n_sms,
                              int max_splits);
bool attention_decode_supported(const AttnShape& s);
void launch_attention_decode(const AttnShape& s, const AttnBatch& b,
                             const __nv_bfloat16* q,  // [n_rows, n_heads, head_dim]
                             const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                             AttnGate gate, int kv_chunk, int n_splits, void* partials,
                             __nv_bfloat16* out,  // [n_rows, n_heads, head_dim]
                             cudaStream_t stream);
// Which split kernel (attention_decode.cu): kAuto = the tensor-core kernel when
// attention_decode_mma_supported(s) and q / caches are 16-byte aligned, else the SIMT one; kMma
// throws when it cannot run the shape; kSimt is the first version (kept as the fallback and for
// A/B tests). Both merge into the same output.
enum class AttnDecodeKernel { kAuto, kMma, kSimt };
bool attention_decode_mma_supported(const AttnShape& s);  // head_dim 128 / 256, group <= 8
void launch_attention_decode(const AttnShape& s, const AttnBatch& b, const __nv_bfloat16* q,
                             const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                             AttnGate gate, int kv_chunk, int n_splits, void* partials,
                             __nv_bfloat16* out, cudaStream_t stream, AttnDecodeKernel which);

// ---- activation.cu ---------------------------------------------------------------------------
// out[t, i] = bf16(silu(gu[t, i]) * gu[t, d_ff + i]) (gu = the fused [gate | up] projection).
void launch_silu_mul(const __nv_bfloat16* gu,  // [n_tokens, 2 * d_ff]
                     int n_tokens, int d_ff,
                     __nv_bfloat16* out,  // [n_tokens, d_ff]
                     cudaStream_t stream);

// ---- convert.cu ------------------------------------------------------------------------------
void launch_bf16_to_f32(const __nv_bfloat16* in, int64_t n, float* out, cudaStream_t stream);
void launch_f32_to_bf16(const float* in, int64_t n, __nv_bfloat16* out, cudaStream_t stream);
// mean + std * N(0,1) exactly as make_synthetic_weights draws it (model/weight_table.h
// synthetic_value, SyntheticKind::kNormal, `seed` = the tensor's SyntheticSpec::seed), in bf16.
void launch_fill_synthetic_normal_bf16(__nv_bfloat16* out, int64_t n, uint64_t seed, float mean,
                                       float std, cudaStream_t stream);

// ---- sampling.cu -----------------------------------------------------------------------------
// Per-row sampling parameters. temperature <= 0: greedy (argmax, lowest index on ties). Else
// softmax(logits / temperature) restricted to the top_k most likely tokens (top_k <= 0: all) and
// then to the smallest most-likely set whose mass reaches top_p (of the top-k mass; top_p >= 1:
// all), sampled with a counter-based RNG: the draw depends on (seed, offset) only, so a request
// replays exactly. Ties at the top-k / top-p threshold are all kept.
struct SamplingParams {
  float temperature = 0.f;
  int top_k = 0;
  float top_p = 1.f;
  uint64_t seed = 0;
  uint64_t offset = 0;  // e.g. the index of the generated token
};
void launch_sample(const float* logits,           // [n_rows, vocab]
                   const SamplingParams* params,  // [n_rows], device
                   int n_rows, int vocab,
                   int32_t* out_tokens,  // [n_rows]
                   cudaStream_t stream);

}  // namespace ds::cuda
