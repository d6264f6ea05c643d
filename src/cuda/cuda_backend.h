// The CUDA engine as a Backend (runtime/backend.h): bf16 weights and activations, fp32
// accumulation, one GPU. Holds the weights (uploaded from HostWeights through pinned staging, or
// generated on the device for synthetic runs), a paged KV pool for the attention layers, one GDN
// state slot per sequence slot, and activation buffers sized for the largest step; all of it is
// planned and allocated at construction (printed), so a request that does not fit is a ds::Error
// at step() time, never an out-of-memory crash.
//
// step(): prompt work is split into chunks of at most chunk_size tokens per forward (several
// sequences share one forward, packed back to back). Inside a forward the single tokens of running
// sequences come first and take the decode kernels (split-KV attention, fused GDN decode), the
// prompt chunks after them the prompt kernels; GEMMs and the rest run once over all rows. Every
// kernel choice goes through the DispatchRegistry. Layouts and measured numbers: docs/GPU.md.
//
// Decode steps (every piece one token of a running sequence) replay a captured CUDA graph per
// (batch size, KV bucket, greedy) key: the split-KV attention grid is planned for the bucket (the
// next power of two of the longest sequence), eager steps use the same plan, so graph and eager
// logits are bit-identical. A key is captured on its second use (the first runs eagerly and warms
// every kernel and GEMM plan); at most max_cuda_graphs are kept (least recently used evicted).
// A capture or launch failure prints a warning and turns graphs off (eager from then on).
// step_greedy(): greedy rows get their argmax on the device; 4 bytes per row are copied back.
// launch_greedy_decode() / collect_greedy_decode() (Backend's pipelined decode): the same decode
// step and graph enqueued without waiting, through a second pair of pinned buffers; fed rows take
// the previous step's argmax on the device (a 1-block kernel before the graph), so the tokens are
// bit-identical to step_greedy's (cuda_decode_pipeline_test).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"
#include "runtime/backend.h"

namespace ds {

struct CudaEngineOptions {
  int page_size = 64;           // tokens per KV block
  std::string disable_kernels;  // comma-separated "family.variant" names (plus $DS_DISABLE_KERNELS)
  double memory_fraction = 0.92;  // of the device's total memory the engine may use
  int64_t max_kv_tokens = 0;      // > 0: cap the KV pool at this many tokens (tests, sharing a GPU)
  int logits_rows = 256;          // rows of lm_head computed per piece (bounds the logits buffer)
  bool verbose = true;            // print the memory plan, load time and dispatch table to stderr
  bool cuda_graphs = true;        // decode steps as CUDA graphs ($DS_CUDA_GRAPHS=0 turns them off)
  int max_cuda_graphs = 64;       // captured graphs kept at most (each counted in the reserve)
  // Residual add + RMSNorm computed in the prologue of the bulk decode GEMVs (gdn_in / attn_qkv /
  // gate_up where the registry picks them; cuda/gemv_bulk_norm.h) instead of a separate
  // add_rmsnorm launch, for forwards of at most this many tokens (0: never; at most 4):
  // bit-identical outputs. $DS_FUSED_NORM=N overrides. Default 2: measured faster at batch 1 and
  // 2, slower at batch 4 (H200, docs/perf/decode_kernels.md).
  int fused_norm_rows = 2;
  // Prompt forwards (>= 64 tokens with a prompt piece): the residual add folded into the
  // out-projection GEMMs, which write h + x W^T into the residual stream (cuBLASLt beta = 1), so
  // the add_rmsnorm after each reads one tensor instead of two and writes one less. kMixer: the
  // mixer out-projections (gdn_out / attn_o) only; kAll: the MLP down projection too. Decode-only
  // forwards never fold. Measured on the H200 at the 27B shapes (docs/perf/prefill_gaps.md): the
  // logits stayed bit-identical (as if cuBLASLt rounds x W^T to bf16 before adding C, like the
  // separate add; not documented, so not assumed elsewhere).
  // $DS_PREFILL_FOLD = 0 / mixer / all (1 = all) overrides.
  enum class PrefillFold { kOff, kMixer, kAll };
  PrefillFold prefill_residual_fold = PrefillFold::kAll;
  // Decode-only forwards on the adaptive split-KV attention (the default $DS_ATTN_DECODE modes
  // pdl / pdl_early / adaptive): the attention's split kernel does rope_kv's work itself (q_norm /
  // k_norm, RoPE, the newest K/V row into the cache; attention_decode.h AttnDecodeRope), one
  // launch fewer per attention layer. Bit-identical logits (tests: CudaAttentionDecode.FusedRope27b,
  // Specialisations.FusedRopeOnVsOffBitExactAt27bShapes). $DS_DECODE_ROPE_FUSED=0 / 1 overrides.
  bool decode_rope_fused = true;
  // Batch-1 decode steps run the MLP (gate_up + SiLU with the post-attention norm, then down) as
  // one persistent kernel with a grid barrier between the two projections, so the weight stream
  // does not stop between them (cuda/gemv_bulk_norm.h launch_gemv_mlp_norm): 1; 2 also takes the
  // mixer's out-projection (gdn_out / attn_o) into the same kernel, before the MLP; 3 also the
  // next layer's input norm and in-projection (gdn_in / attn_qkv), after it. 0: off.
  // Bit-identical logits (Specialisations.FusedMlpOnVsOffBitExactAt27bShapes). Session 23, not
  // yet measured: off by default. $DS_MLP_FUSED=0..3 overrides.
  int mlp_fused = 0;
  // Greedy steps whose lm_head runs on the bulk GEMV (batch 1 and 2 on the 27B shapes) take the
  // argmax in that GEMV's epilogue (cuda/gemv.h launch_gemv_bulk_argmax) instead of a second
  // kernel re-reading the logits: the same logits and tokens (tests:
  // CudaGemvBulk.ArgmaxFusedMatchesSeparate, Specialisations.FusedHeadOnVsOffBitExactAt27bShapes).
  // Session 27, not yet measured: off by default. $DS_ARGMAX_FUSED=0 / 1 overrides.
  bool argmax_fused = false;
  // Decode-only forwards within the fused norms' rows (fused_norm_rows) whose lm_head runs on the
  // bulk GEMV compute the final norm in lm_head's prologue (cuda/gemv_bulk_norm.h
  // launch_gemv_bulk_norm, or launch_gemv_bulk_argmax_norm with argmax_fused) and read the hidden
  // rows in place: three launches fewer per step (the final add_rmsnorm, the lm-rows gather, and
  // with argmax_fused the argmax). The same logits and tokens (tests:
  // Specialisations.FusedHeadOnVsOffBitExactAt27bShapes). Session 27, not yet measured: off by
  // default. $DS_HEAD_NORM=0 / 1 overrides.
  bool head_norm_fused = false;
  // Batch-1 decode: gdn_decode starts on the gdn_in GEMV's early-rows signal (its qkv, b and a
  // rows; GemvSignal / GdnDecodeEarly) instead of the GEMV's end; only z waits for the end. The
  // same logits and tokens (Specialisations.GdnEarlyOnVsOffBitExactAt27bShapes). Session 32: on
  // (TPOT at batch 1, 4K / 8K / 32K: -0.08 / -0.07 / -0.07 ms on an H200, -0.03 / -0.02 / -0.06 on
  // an H100; docs/perf/decode_gemv.md). $DS_GDN_EARLY=0 / 1 overrides.
  bool gdn_early = true;
};

// Uploads `w` (bf16 / f16 / f32 tensors; f16 / f32 are converted to bf16 on the host).
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& opt, const HostWeights& w);
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& opt, const HostWeights& w,
                                           const CudaEngineOptions& eopt);

// Synthetic weights generated on the device: the same bytes as make_synthetic_weights(config,
// seed) would give (model/weight_table.h's per-tensor spec), without host memory.
std::unique_ptr<Backend> make_cuda_backend_synthetic(const BackendOptions& opt,
                                                     const ModelConfig& config, uint64_t seed,
                                                     const CudaEngineOptions& eopt = {});

// `--synthetic CONFIG`: CONFIG is a config.json path, or "27b" for Qwen3.5-27B (the copy of its
// config in configs/qwen3.5-27b.json is compiled in).
ModelConfig synthetic_model_config(const std::string& spec);

// The engine's memory layout for a config (host arithmetic only; printed at start-up).
struct CudaMemoryLayout {
  int64_t weight_bytes = 0;
  int64_t kv_block_bytes = 0;  // one page of every attention layer, K and V
  int64_t n_kv_blocks = 0;
  int64_t gdn_state_bytes = 0;  // all slots, all GDN layers (conv ring + fp32 recurrent state)
  int64_t activation_bytes = 0;
  int64_t workspace_bytes = 0;  // cuBLASLt + GDN prefill + decode-attention partials
  int64_t reserve_bytes = 0;    // left to the CUDA context, cuBLASLt internals, graphs
  int64_t graph_bytes = 0;      // the part of the reserve kept for captured decode graphs
  int max_seq_len = 0;          // tokens one sequence may hold
  int max_step_tokens = 0;      // tokens per forward
  int max_blocks_per_seq = 0;
  std::string to_text() const;
};

// CUDA-graph counters of a CUDA backend (tests, benchmarks). Throws ds::Error when `b` is not one.
struct CudaGraphStats {
  bool enabled = false;      // graphs on now (off by option, env, set_cuda_graphs or a failure)
  int cached = 0;            // executable graphs held now
  int64_t captures = 0;      // graphs captured and instantiated
  int64_t replays = 0;       // steps run by cudaGraphLaunch
  int64_t eager_decode = 0;  // decode-only steps run eagerly (graphs off, first use of a key)
  int64_t evictions = 0;     // graphs destroyed to stay within max_cuda_graphs / the budget
  int64_t failures = 0;      // failed captures / launches (each turned graphs off)
  int64_t graph_bytes = 0;   // device memory the cached graphs took (cudaMemGetInfo deltas)
};
CudaGraphStats cuda_graph_stats(const Backend& b);
// Turns decode graphs on or off at run time (off destroys the cached ones). Throws ds::Error when
// `b` is not a CUDA backend.
void set_cuda_graphs(Backend& b, bool on);
// The host clock split of the last step() / step_greedy() / launch_greedy_decode() of a CUDA
// backend (microseconds; issue 6's time outside the graph): validation, the step metadata on the
// host, the metadata copy + kernel plan, the graph launch (or eager enqueue), the wait in the
// stream sync (sync steps), what came after; collect_wait_us: the last collect_greedy_decode()'s
// wait for its step. Throws ds::Error when `b` is not a CUDA backend.
struct CudaStepTiming {
  double validate_us = 0, meta_us = 0, copy_plan_us = 0, launch_us = 0, sync_us = 0, tail_us = 0;
  double collect_wait_us = 0;
  bool graphed = false;  // the step replayed a CUDA graph
};
CudaStepTiming cuda_last_step_timing(const Backend& b);
// Replays the graph of the last decode step `n` times back to back (events around, no host work
// in between) and returns the mean milliseconds per replay: the step's pure device time. It
// re-runs the step on the slots' state (measuring only: the GDN state advances n more times).
double cuda_replay_last_graph(Backend& b, int n);
// Sets the fused decode norms' row limit (CudaEngineOptions::fused_norm_rows, 0 = off) at run
// time (the cached graphs are dropped when it changes), and reads it. Throw ds::Error when `b` is
// not a CUDA backend or rows is outside 0..4.
void set_cuda_fused_norm(Backend& b, int rows);
int cuda_fused_norm(const Backend& b);
// Sets CudaEngineOptions::decode_rope_fused at run time (the cached graphs are dropped when it
// changes), and reads it. Throw ds::Error when `b` is not a CUDA backend.
void set_cuda_decode_rope_fused(Backend& b, bool on);
bool cuda_decode_rope_fused(const Backend& b);
// Sets CudaEngineOptions::mlp_fused (0..3) at run time (the cached graphs are dropped when it
// changes), and reads it. Throw ds::Error when `b` is not a CUDA backend or the mode is not 0..3.
void set_cuda_mlp_fused(Backend& b, int mode);
int cuda_mlp_fused(const Backend& b);
// How many MLPs were enqueued as fused kernel form 1 (the MLP), 2 (with the mixer's
// out-projection) or 3 (and the next layer's in-projection) so far (eager forwards and graph
// captures).
int64_t cuda_mlp_fused_enqueued(const Backend& b, int form);
// Sets CudaEngineOptions::argmax_fused at run time (the cached graphs are dropped when it
// changes), and reads it; how many lm_head launches took the argmax in their epilogue so far
// (eager forwards and graph captures). Throw ds::Error when `b` is not a CUDA backend.
void set_cuda_argmax_fused(Backend& b, bool on);
bool cuda_argmax_fused(const Backend& b);
int64_t cuda_argmax_fused_enqueued(const Backend& b);
// The same for CudaEngineOptions::head_norm_fused, and the count of lm_head launches that took the
// final norm in their prologue.
void set_cuda_head_norm_fused(Backend& b, bool on);
bool cuda_head_norm_fused(const Backend& b);
int64_t cuda_head_norm_enqueued(const Backend& b);
// The same for CudaEngineOptions::gdn_early, and the count of GDN layers enqueued that way.
void set_cuda_gdn_early(Backend& b, bool on);
bool cuda_gdn_early(const Backend& b);
int64_t cuda_gdn_early_enqueued(const Backend& b);
// After the stream drains: the early-rows counter of every layer (0 between forwards) and, last,
// how many gdn_decode blocks gave up waiting for one (0 unless a signal went missing).
std::vector<unsigned> cuda_gdn_early_words(Backend& b);
// Sets the prompt forwards' residual fold (CudaEngineOptions::prefill_residual_fold) at run
// time, and reads it. Throw ds::Error when `b` is not a CUDA backend.
void set_cuda_prefill_fold(Backend& b, CudaEngineOptions::PrefillFold mode);
CudaEngineOptions::PrefillFold cuda_prefill_fold(const Backend& b);

}  // namespace ds
