// Residual add + RMSNorm fused into the prologue of the bulk-copy decode GEMVs (gemv_bulk.cu):
//   residual_out = bf16(residual + delta)                       (when delta is given)
//   x = bf16(r * rsqrt(mean(r^2) + eps) * (weight_offset + w))  r = that residual, fp32 math
//   y = x W^T  (launch_gemv_bulk_norm)  or  act = bf16(silu(bf16(x G^T)) * bf16(x U^T))
//   (launch_gemv_bulk_silu_norm, the fused [gate | up] weight)
// in ONE launch instead of launch_add_rmsnorm (rmsnorm.cu) followed by the GEMV: every block
// computes the normalised rows itself after griddepcontrol.wait, straight into the shared-memory
// copy of x the GEMV reads (its weight stream starts before, as in the plain kernel), and block 0
// writes the updated residual. The normalised x is bit-identical to launch_add_rmsnorm's (the same
// per-thread partial sums over 256 threads, the same warp / block reduction order, the same fp32
// expressions), so the output is bit-identical to the two launches
// (tests/cuda/cuda_gemv_norm_test.cpp). The decode step (cuda_backend.cu) uses it for the input
// norm before gdn_in / attn_qkv and the post-attention norm before gate_up(+SiLU) where the
// dispatch registry picks the bulk GEMV, in forwards of at most CudaEngineOptions::fused_norm_rows
// tokens ($DS_FUSED_NORM=N; default 2: H200 numbers in docs/perf/decode_kernels.md).
// residual_out must not alias residual or delta: other blocks may still read the residual while
// block 0 writes (the engine ping-pongs two residual buffers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/gemv.h"

namespace ds::cuda {

struct GemvNormIn {
  const __nv_bfloat16* residual = nullptr;  // [m, k] residual stream before the add
  const __nv_bfloat16* delta = nullptr;     // [m, k] or null (no add, residual_out unused)
  const __nv_bfloat16* weight = nullptr;    // [k] norm weight
  float eps = 1e-6f;
  float weight_offset = 1.f;              // 1: Qwen3.5's zero-centred norms
  __nv_bfloat16* residual_out = nullptr;  // [m, k] residual + delta (out, with delta)
  // The norm weight (a model weight, never written by the kernel before) loaded before
  // griddepcontrol.wait rather than after it with residual and delta; the same values either way.
  // The engine sets it from gemv_norm_weight_early() ($DS_GEMV_NORM_EARLY, default on).
  bool weight_early = true;
};

// $DS_GEMV_NORM_EARLY (read once; 1 or unset: on, 0: off; anything else throws): GemvNormIn's
// weight_early for the engine's decode steps (an A/B switch; session 22, not yet measured).
bool gemv_norm_weight_early();

// The largest k the prologue handles (256 threads x 4 vectors of 8), and m (rows are loaded
// together: registers; the decode step uses m 1 for gdn_in / attn_qkv, m 1..4 for gate_up).
constexpr int kGemvNormMaxK = 8192;
constexpr int kGemvNormMaxM = 4;

// Whether config c leaves room in shared memory for the prologue's warp sums at (m, k), and m, k
// are in range: the engine asks before choosing the fused path (else add_rmsnorm + the GEMV).
bool gemv_bulk_norm_fits(int m, int k, const GemvBulkConfig& c);

// y = rmsnorm(residual + delta) w^T. The same shapes, configs and guarantees as launch_gemv_bulk
// (gemv.h) plus m <= kGemvNormMaxM, k <= kGemvNormMaxK; every pointer of `norm` 16-byte aligned.
// Throws ds::Error otherwise. Asynchronous, graph-safe, never allocates.
void launch_gemv_bulk_norm(const GemvNormIn& norm,
                           const __nv_bfloat16* w,  // [n, k]
                           void* y,                 // [m, n] bf16 or fp32 (out)
                           int m, int n, int k, GemmOut out, const GemvBulkConfig& cfg, int n_sms,
                           cudaStream_t stream, const GemvL2Next& next = {},
                           const GemvSignal& sig = {});  // gemv.h; not with `next`

// launch_gemv_bulk_argmax (gemv.h: the fp32 logits and each row's greedy token, session 27, not
// yet measured) with x = rmsnorm(residual + delta) computed in its prologue: at decode the final
// norm, lm_head and the argmax in one kernel (CudaEngineOptions::head_norm_fused with
// argmax_fused). gemv_bulk_argmax_supports(m, n, k, cfg, true) and the checks above.
void launch_gemv_bulk_argmax_norm(const GemvNormIn& norm,
                                  const __nv_bfloat16* w,  // [n, k]
                                  float* y,                // [m, n] (out: the logits)
                                  int32_t* tokens,         // [m] (out)
                                  void* workspace,         // kGemvBulkArgmaxWorkspaceBytes, zeroed
                                  int m, int n, int k, const GemvBulkConfig& cfg, int n_sms,
                                  cudaStream_t stream);

// act = bf16(silu(g) * u) of x = rmsnorm(residual + delta): launch_gemv_bulk_silu with the norm in
// its prologue.
void launch_gemv_bulk_silu_norm(const GemvNormIn& norm,
                                const __nv_bfloat16* w_gate_up,  // [2 d_ff, k]
                                __nv_bfloat16* act,              // [m, d_ff] (out)
                                int m, int d_ff, int k, const GemvBulkConfig& cfg, int n_sms,
                                cudaStream_t stream);

// ---- The batch-1 decode MLP in one kernel (gemv_bulk.cu; session 23, not yet measured) ----
// act = bf16(silu(g) * u), [g | u] = rmsnorm(residual + delta) w_gate_up^T, then y = act w_down^T:
// launch_gemv_bulk_silu_norm followed by launch_gemv_narrow (bf16 out, no accumulate) as phases
// of one persistent grid of n_sms blocks (one per SM) with a grid barrier between them, so that
// the weight stream does not stop between the projections. With `mixer` (w0 set) the mixer's
// out-projection comes first: delta = x0 w0^T (launch_gemv_bulk's rows, bf16), written to y0,
// which must be norm.delta, then a grid barrier, then the norm. Every output is the separate
// kernels' bits. grid_bar: 2 words of device memory owned by this launch site, zeroed once (the
// barrier leaves them ready for the next launch); launches that share it go on one stream (under
// PDL a launch touches it only after griddepcontrol.wait, when the one before has finished). Needs
// every block resident at once (one per SM; checked with the occupancy API). Throws ds::Error for
// anything unsupported. Asynchronous, graph-safe, never allocates.
struct GemvMlpMixer {
  const __nv_bfloat16* x0 = nullptr;  // [m, k0] the mixer's output
  const __nv_bfloat16* w0 = nullptr;  // [k, k0] gdn_out / attn_o; null: no out-projection
  __nv_bfloat16* y0 = nullptr;        // [m, k] = norm.delta (out)
  int k0 = 0;
};
// With `next` (w set) the next layer's input norm and in-projection come last: after a grid
// barrier, x = rmsnorm(next.norm.residual + y) (next.norm.residual must be norm.residual_out and
// next.norm.delta must be y; next.norm.residual_out gets their sum), next.y = x next.w^T
// (launch_gemv_bulk_norm's rows, bf16). Only with `mixer`. Every buffer written must be disjoint
// from every other buffer the kernel touches, except y, which may be norm.delta, and
// next.norm.residual_out, which may be norm.residual (the engine's buffers).
struct GemvMlpNext {
  GemvNormIn norm;
  const __nv_bfloat16* w = nullptr;  // [n, k] gdn_in / attn_qkv of the next layer; null: none
  __nv_bfloat16* y = nullptr;        // [m, n] (out)
  int n = 0;
};
// k0: the mixer form's W0 row length (0: without it); n_next: the next in-projection's rows (0:
// without it).
bool gemv_mlp_norm_supports(int64_t m, int64_t d_ff, int64_t k, int64_t n, int64_t k0,
                            int n_sms, int64_t n_next = 0);
// The buffer rules above (host only, no device access): throws ds::Error naming the two buffers
// that overlap. launch_gemv_mlp_norm calls it.
void gemv_mlp_norm_check_buffers(const GemvNormIn& norm, const GemvMlpMixer& mixer,
                                 const GemvMlpNext& next, const void* act, const void* y, int m,
                                 int d_ff, int k, int n);
void launch_gemv_mlp_norm(const GemvNormIn& norm, const GemvMlpMixer& mixer,
                          const GemvMlpNext& next,
                          const __nv_bfloat16* w_gate_up,  // [2 d_ff, k]
                          __nv_bfloat16* act,              // [m, d_ff] (out; also the exchange)
                          const __nv_bfloat16* w_down,     // [n, d_ff]
                          __nv_bfloat16* y,                // [m, n] (out)
                          int m, int d_ff, int k, int n, bool pdl, unsigned* grid_bar, int n_sms,
                          cudaStream_t stream);

}  // namespace ds::cuda
