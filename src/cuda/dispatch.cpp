// The dispatch registry (see dispatch.h) and the engine's built-in variants.
#include "cuda/dispatch.h"

#include <cstdlib>
#include <sstream>

#include "core/error.h"
#include "cuda/gemv.h"

namespace ds::cuda {

const char* family_name(KernelFamily f) {
  switch (f) {
    case KernelFamily::kGemm:
      return "gemm";
    case KernelFamily::kAttnPrefill:
      return "attn_prefill";
    case KernelFamily::kAttnDecode:
      return "attn_decode";
    case KernelFamily::kGdnPrefill:
      return "gdn_prefill";
    case KernelFamily::kGdnDecode:
      return "gdn_decode";
    case KernelFamily::kRmsNorm:
      return "rmsnorm";
    case KernelFamily::kRopeKv:
      return "rope_kv";
    case KernelFamily::kSiluMul:
      return "silu_mul";
    case KernelFamily::kSample:
      return "sample";
    case KernelFamily::kCount:
      break;
  }
  return "?";
}

std::string KernelVariant::full_name() const {
  return std::string(family_name(family)) + "." + name;
}

int DispatchRegistry::add(KernelVariant v) {
  for (const auto& o : variants_)
    DS_CHECK(!(o.family == v.family && o.name == v.name), "dispatch: variant ", v.full_name(),
             " registered twice");
  variants_.push_back(std::move(v));
  return static_cast<int>(variants_.size()) - 1;
}

void DispatchRegistry::set_enabled(const std::string& full_name, bool on) {
  for (auto& v : variants_) {
    if (v.full_name() != full_name) continue;
    DS_CHECK(on || v.guard, "dispatch: ", full_name,
             " is a generic fallback and cannot be switched off");
    v.enabled = on;
    return;
  }
  std::string known;
  for (const auto& v : variants_) known += (known.empty() ? "" : ", ") + v.full_name();
  ds::throw_error("dispatch: unknown kernel variant '", full_name, "' (known: ", known, ")");
}

void DispatchRegistry::disable(const std::string& names) {
  std::stringstream ss(names);
  std::string item;
  while (std::getline(ss, item, ',')) {
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (item.empty()) continue;
    if (item == "all") {
      for (auto& v : variants_)
        if (v.guard) v.enabled = false;
      continue;
    }
    set_enabled(item, false);
  }
}

const KernelVariant& DispatchRegistry::select(KernelFamily f, const ShapeKey& key) const {
  for (const auto& v : variants_) {
    if (v.family != f || !v.enabled) continue;
    if (!v.guard || v.guard(key)) return v;
  }
  ds::throw_error("dispatch: no kernel variant of family ", family_name(f), " accepts the shape");
}

std::string DispatchRegistry::list() const {
  std::ostringstream os;
  for (const auto& v : variants_) {
    os << "  " << v.full_name();
    for (size_t i = v.full_name().size(); i < 28; ++i) os << ' ';
    os << (v.enabled ? "on " : "off") << (v.guard ? "  " : "  [fallback] ") << v.description
       << "\n";
  }
  return os.str();
}

DispatchRegistry DispatchRegistry::with_defaults(int sm, const std::string& disabled) {
  DispatchRegistry r;
  r.sm_ = sm;
  using F = KernelFamily;
  // gemv_bulk_silu: only for the key (m, 2 d_ff, k, 1) that GemmEngine::run_gate_up_silu asks.
  r.add({F::kGemm, "gemv_bulk_silu",
         "decode gate_up GEMV with SiLU-and-mul in the epilogue (gemv.h): m 1..4, k 4096..8192, "
         "d_ff >= 8192, bit-identical to gemv_bulk + silu_mul; sm 90, asked by the MLP only "
         "(dims[3] = 1)",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 && k.dims[3] == 1 && k.dims[1] % 2 == 0 &&
                  gemv_bulk_silu_preferred(k.dims[0], k.dims[1] / 2, k.dims[2]);
         }});
  // gemv_tma_silu / gemv_tma: batch 5..16 decode, gate_up with SiLU-and-mul fused, gdn_in and
  // attn_qkv (on by default; $DS_GEMV_TMA=0 off, =silu only the gate_up): measured faster in the
  // step than cuBLASLt tuned + silu_mul at batch 8 and 16 (docs/perf/2026-12-02-session9-AB.md).
  r.add({F::kGemm, "gemv_tma_silu",
         "decode gate_up GEMM on tensor cores with SiLU-and-mul in the epilogue (gemv.h, "
         "gemv_tma.cu): persistent block per SM, 2-D TMA boxes of all its gate and up rows x 64 k, "
         "mma.sync, bit-identical to gemv_tma + silu_mul; sm 90, m 5..16, k 4096..8192, d_ff >= "
         "8192, asked by the MLP only (dims[3] = 1); off with DS_GEMV_TMA=0",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 && k.dims[3] == 1 && k.dims[1] % 2 == 0 &&
                  gemv_tma_preferred(k.dims[0], k.dims[1] / 2, k.dims[2], true);
         }});
  // gemv_tma_narrow: the MLP down projection at batch 3..16 by default, measured in the step
  // against skinny_mma (batch 3-4) and cuBLASLt tuned (session 10: batch 3 / 4 / 8 / 16 -0.20 /
  // -0.15 / -0.29 / -0.35 ms; the out projections and batch 1-2 slower:
  // docs/perf/2026-12-02-session10-AB.md);
  // listed ahead of gemv_bulk_pdl / gemv_narrow so that $DS_GEMV_TMA_NARROW=down|out|1 can put
  // it on the other shapes.
  r.add({F::kGemm, "gemv_tma_narrow",
         "decode GEMM for narrow outputs on tensor cores (gemv.h, gemv_tma.cu): persistent block "
         "per SM owning 4-8 8-row groups, stages of 8 x 64 k as 2-D TMA boxes, the 8 warps split "
         "k and are summed in warp order, batch-invariant; sm 90, m 1..16, n 5120..8192, k "
         "6144..32768; default the down projection (k > 8192) at m 3..16, DS_GEMV_TMA_NARROW=0 "
         "off, =down every m, =out / =1 the out projections too",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 && k.dims[3] == 0 &&
                  gemv_tma_narrow_preferred(k.dims[0], k.dims[1], k.dims[2]);
         }});
  r.add({F::kGemm, "gemv_bulk",
         "decode GEMV (gemv.h): persistent block per SM, bulk-copy ring of weight rows; sm 90, "
         "k % 8 == 0, k 4096..8192, where it beats cuBLASLt: m 1 with n >= 12288, m 2 with "
         "n >= 32768",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 &&
                  gemv_bulk_preferred(k.dims[0], k.dims[1], k.dims[2]);
         }});
  r.add({F::kGemm, "gemv_bulk_pdl",
         "decode GEMV (gemv.h) on the narrow projections (m 1, n 4096..12287, k 4096..8192: "
         "gdn_out / attn_o), launched with PDL after a kernel that triggers early; sm 90, off "
         "with DS_GEMV_PDL=0",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 &&
                  gemv_bulk_pdl_preferred(k.dims[0], k.dims[1], k.dims[2]);
         }});
  r.add({F::kGemm, "gemv_narrow",
         "decode GEMV for narrow outputs / long rows (gemv.h, gemv_narrow.cu): persistent block "
         "per SM, bulk-copy ring of (row, k-slice) stages, split-K over 8 warps in a fixed order; "
         "sm 90, m 1..2, n 1024..8192, k 12288..32768 (the MLP down projection)",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 &&
                  gemv_narrow_preferred(k.dims[0], k.dims[1], k.dims[2]);
         }});
  r.add({F::kGemm, "gemv_tma",
         "decode GEMM on tensor cores (gemv.h, gemv_tma.cu): persistent block per SM, 2-D TMA "
         "boxes of all its rows x 64 k, mma.sync with the accumulators in registers, "
         "batch-invariant; sm 90, m 5..16, k 4096..8192, n >= 8192 (gdn_in, attn_qkv); off with "
         "DS_GEMV_TMA=0 or silu",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 && k.dims[3] == 0 &&
                  gemv_tma_preferred(k.dims[0], k.dims[1], k.dims[2], false);
         }});
  // gemv_bulk_mma: OFF unless $DS_GEMV_MMA=1 (built, not yet measured on a GPU): the batch 3..16
  // decode projections with k 4096..8192 (gdn_in, gdn_out, attn_qkv, attn_o, gate_up at m 5..16;
  // gate_up at m 3..4 stays with gemv_bulk_silu above, which is asked first with dims[3] = 1).
  r.add({F::kGemm, "gemv_bulk_mma",
         "decode GEMV on tensor cores (gemv.h, gemv_bulk_mma.cu): persistent block per SM, "
         "bulk-copy ring of (k-chunk, 16-row) stages, mma.sync with the accumulators in registers "
         "across k, batch-invariant; sm 90, m 3..16, k % 64 == 0, k 4096..8192, n >= 4096; off "
         "unless DS_GEMV_MMA=1",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 &&
                  gemv_bulk_mma_preferred(k.dims[0], k.dims[1], k.dims[2]);
         }});
  // gemv_splitk_mma: OFF unless $DS_GEMV_SPLITK is 1 / down / out: the batch 5..16 MLP down
  // projection (k 17408) and out projections (k 6144), where cuBLASLt tuned runs otherwise
  // (measured slower than cuBLASLt in the step on the H200, session 8).
  r.add({F::kGemm, "gemv_splitk_mma",
         "decode GEMV on tensor cores split over k (gemv.h, gemv_splitk_mma.cu): 4 k-splits x "
         "SMs/4 row groups, bulk-copy ring of 8-row tiles, x fragments in registers, fp32 "
         "partials summed in split order, batch-invariant; sm 90, m 5..16, k 17408 or 6144, "
         "n % 8 == 0; off unless DS_GEMV_SPLITK is 1, down or out",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 &&
                  gemv_splitk_preferred(k.dims[0], k.dims[1], k.dims[2]);
         }});
  r.add({F::kGemm, "skinny_mma",
         "decode skinny GEMM (gemv.h): mma.sync with tokens as M, weight read once, "
         "batch-invariant; sm 90, k % 8 == 0, where it beats cuBLASLt in the step (k >= 12288, "
         "m <= 4: the down projection at batch 3-4)",
         [](const ShapeKey& k) {
           return k.sm == 90 && k.dtype == 0 &&
                  skinny_gemm_preferred(k.dims[0], k.dims[1], k.dims[2]);
         }});
  r.add({F::kGemm,
         "cublaslt",
         "cuBLASLt bf16 GEMM, fp32 accumulate, algorithm per shape at plan time",
         {}});
  // attn_prefill dims: {head_dim, group, max_q_len, max_kv_len}; the hd-256 kernels also need
  // page_size % 64 == 0, checked in launch_attention_prefill (else the generic kernel runs), and
  // the TMA kernels a cache their tensor map can describe (else wgmma_m128 runs).
  // Order measured on the H200 (issue 7, two runs of bench kernels, every variant timed on the
  // same inputs): the warp-specialised TMA kernels win on every shape measured, against
  // wgmma_m128 by 1.2x (512 / 3072 tokens, nothing cached) to 1.7x (512-4096-token chunks against
  // 8K-32K cached tokens) and against the mma.sync kernel by 1.3-1.5x on 4-21-token chunks;
  // wgmma_ws3 (3 K stages) is -3% to +13% against wgmma_ws from 512-token chunks against >= 8K
  // keys (16K causal: 558-631 vs 535-603 TFLOP/s), 1-7% slower on chunks without a cache.
  // wgmma_m128 runs when the TMA kernels are switched off (DS_DISABLE_KERNELS=attn_prefill.
  // wgmma_ws3,attn_prefill.wgmma_ws,attn_prefill.wgmma_ws3_lean,attn_prefill.wgmma_ws_lean,
  // attn_prefill.wgmma_ws3_persist,attn_prefill.wgmma_ws3_lean_persist,attn_prefill.wgmma_ws_ulean,
  // attn_prefill.wgmma_ws_lazy).
  const auto hd256 = [](const ShapeKey& k) {
    return k.sm == 90 && k.dims[0] == 256 && k.dims[1] >= 1;
  };
  const auto ws3_shapes = [hd256](const ShapeKey& k) {
    return hd256(k) && k.dims[2] >= 512 && k.dims[3] >= 8192;
  };
  // Session 30 (docs/perf/attn_prefill_ws.md "Session 30"): wgmma_ws_lazy first, on every hd-256
  // shape. bench kernels: on the H200 (three processes) faster than wgmma_ws_lean on 16 of the 18
  // benched shapes, 16K causal 643 vs 570 TFLOP/s; on an H100 (three processes each way,
  // interleaved) faster on 16 of 18, even on 512 after 8K, slower on 4096 after 32K (+6%; -8% on
  // the H200, -12% in session 29's H100 run); faster than wgmma_ws_ulean on every shape of the
  // H200. Whole prompts, 3 rounds, TTFT p50: H200 8K / 16K / 32K -0.5% / -0.6% / -1.0% (every
  // round), H100 4K-32K -1.2% / -0.5% / -0.9% / -0.8%, 2K +0.4% (inside its rounds' spread). Not
  // the same bits as the forms below: its error against the fp32 reference is held to 1.5x
  // wgmma_m128's on every fixture (cuda_attention_test) and the engine's logits to 1e-2 relative
  // L2 of wgmma_ws_lean's (AttnPrefillForms). The A/B reference, the session-25 default:
  // DS_DISABLE_KERNELS=attn_prefill.wgmma_ws_lazy (wgmma_ws_lean then takes every hd-256 shape).
  r.add({F::kAttnPrefill, "wgmma_ws_lazy",
         "hd 256: wgmma_ws_ulean with the scale in the exponent's FFMA and O rescaled only when a "
         "row's max grows by more than 2^8 (not the same bits; within tolerance)",
         hd256});
  // The lean forms next (first in sessions 24-29; session 22's build, measured in session 24,
  // bench kernels on the H200, docs/perf/attn_prefill_ws.md): O rescaled only on tiles where a
  // row of the warp raised its running max, no mask code on the tiles before the first query;
  // bit-identical outputs. Faster than the plain form on 17 of the 18 benched shapes (512 / 3072 /
  // 4096-token chunks against
  // 0-32K cached keys, 16K causal 550 -> 599 TFLOP/s, 4-64-token chunks 194 vs 221 us), 0.6%
  // slower on one (4096 after 8K: 1683 vs 1674 us, within the bench's run-to-run spread); whole
  // prompts 4K 330.6 vs 331.5 ms, 32K 2916 vs 2964 ms. The plain forms stay as their fallbacks
  // (DS_DISABLE_KERNELS=attn_prefill.wgmma_ws3_lean,attn_prefill.wgmma_ws_lean).
  // Session 25 (H200, bench kernels in two calls with the two kernels in opposite places of the
  // bench's order, docs/perf/attn_prefill_ws.md): wgmma_ws_lean (2 K stages) beat
  // wgmma_ws3_lean at 16K causal in both (620-621 vs 600-602 TFLOP/s, 605 vs 595), and at
  // 4096 / 8K, 3072 / 8K and 32K, 512 / 8K and 32K; at the 16K-cached shapes the kernel in the
  // bench's favoured place won each time. Whole prompts of 8K / 16K / 32K (4 rounds): -0.3% /
  // -0.3% / -0.4%. So wgmma_ws_lean came first and took every hd-256 shape (sessions 25-29); it
  // still does with wgmma_ws_lazy switched off.
  r.add({F::kAttnPrefill, "wgmma_ws_lean",
         "hd 256: wgmma_ws with O rescaled only when a row of the warp raised its max and no mask "
         "code before the diagonal (same bits)",
         hd256});
  // wgmma_ws3_lean: never picked while wgmma_ws_lean is on (session 25, below); with it off
  // (DS_DISABLE_KERNELS=attn_prefill.wgmma_ws_lean) the session-24 pick on its shapes.
  r.add({F::kAttnPrefill, "wgmma_ws3_lean",
         "hd 256, >= 512-token chunks against >= 8K keys: wgmma_ws3 with O rescaled only when a "
         "row of the warp raised its max and no mask code before the diagonal (same bits)",
         ws3_shapes});
  r.add({F::kAttnPrefill, "wgmma_ws3",
         "hd 256, >= 512-token chunks against >= 8K keys: wgmma_ws with 3 K stages (227 KiB of "
         "shared memory)",
         ws3_shapes});
  r.add({F::kAttnPrefill, "wgmma_ws",
         "hd 256, 128 rows x 64 keys per block, warp-specialised: a TMA producer warp fills "
         "2-stage K and V rings (mbarriers), two wgmma consumer warpgroups (setmaxnreg 240) "
         "overlap S(j) with P(j-1) V(j-1) and the softmax; bit-identical to wgmma_m128",
         hd256});
  // The persistent forms of wgmma_ws3 and of its lean form (session 23; measured in session 24:
  // slower than the one-tile kernels on every benched shape, e.g. 4096 fresh 497 / 484 vs 447 us
  // for wgmma_ws_lean, 16 after 8K 233 vs 194 us; the 32K prompt 2980 vs 2964 ms): one block per
  // SM walks the row tiles in the same order, the next tile's Q, K and V copies under the current
  // one's tail; same bits. Never picked while wgmma_ws_lean or wgmma_ws is on (hd256 guards);
  // with the four above off, wgmma_ws3_persist takes every hd-256 shape.
  r.add({F::kAttnPrefill, "wgmma_ws3_persist",
         "wgmma_ws3 as a persistent grid (one block per SM walking the row tiles; the next tile's "
         "Q / K / V copies under the current one's tail; same bits)",
         hd256});
  r.add({F::kAttnPrefill, "wgmma_ws3_lean_persist",
         "wgmma_ws3_lean as a persistent grid (same bits)", hd256});
  // Session 26 (docs/perf/attn_prefill_ws.md): two leaner forms of wgmma_ws_lean (wgmma_ws_lazy,
  // the default since session 30, is registered first, above). wgmma_ws_ulean builds the 16 Q
  // descriptors of each S in the uniform datapath (one 64-bit add each instead of ~5
  // instructions; same bits). wgmma_ws_lazy adds the score
  // scale folded into the exponent's FFMA and FlashAttention-4's lazy rescale (a row's base raised
  // only when its max grows by more than 2^8, so O is rarely rescaled): ~294 instructions per
  // unmasked tile against ~385, not the same bits (within the fp32 reference's tolerance and no
  // less accurate than wgmma_m128: cuda_attention_test). wgmma_ws_ulean is registered behind the
  // kernels above, so never picked while those are on; bench kernels times it in every note. With
  // wgmma_ws_lazy and the six above off (DS_DISABLE_KERNELS=attn_prefill.wgmma_ws_lazy,
  // attn_prefill.wgmma_ws_lean,attn_prefill.wgmma_ws3_lean,attn_prefill.wgmma_ws3,attn_prefill.
  // wgmma_ws,attn_prefill.wgmma_ws3_persist,attn_prefill.wgmma_ws3_lean_persist) it takes every
  // hd-256 shape.
  r.add({F::kAttnPrefill, "wgmma_ws_ulean",
         "hd 256: wgmma_ws_lean with the Q descriptors in the uniform datapath (same bits)",
         hd256});
  r.add({F::kAttnPrefill, "wgmma_m128",
         "hd 256, 128 rows x 64 keys per block, Hopper wgmma (Q K^T smem x smem, P V regs x smem), "
         "O in registers, 2-stage cp.async K/V",
         hd256});
  r.add({F::kAttnPrefill,
         "wmma_flash",
         "flash-style tiles, GQA group packed into rows, WMMA bf16, online softmax; hd 16..256",
         {}});
  // attn_decode dims: {head_dim, group, n_seqs, kv_bucket}. split_kv_mma needs 16-byte aligned
  // q / caches / workspace and <= 128 splits (checked at launch; else the SIMT kernel runs).
  r.add({F::kAttnDecode, "split_kv_mma",
         "split-KV decode on tensor cores (mma.sync): GQA group per block, 3-stage cp.async K/V per "
         "warp, parallel log-sum-exp merge; hd 128/256, group <= 8",
         [](const ShapeKey& k) {
           const int64_t hd = k.dims[0], g = k.dims[1];
           return k.sm >= 80 && (hd == 128 || hd == 256) && g >= 1 && g <= 8;
         }});
  r.add({F::kAttnDecode, "split_kv",
         "split-KV flash-decoding on CUDA cores, GQA group per block, log-sum-exp merge; hd "
         "32/64/128/256, group <= 8",
         [](const ShapeKey& k) {
           const int64_t hd = k.dims[0], g = k.dims[1];
           return (hd == 32 || hd == 64 || hd == 128 || hd == 256) && g >= 1 && g <= 8;
         }});
  r.add({F::kAttnDecode, "prefill_kernel", "the prefill kernel with one query per sequence", {}});
  // gdn_prefill dims: {d_k, d_v, n_tokens, n_seqs}; pointer alignment is checked in
  // launch_gdn_prefill (else the generic kernels run). Removed in issue 7 round 3, never picked
  // on sm_90 (slice_scan* came first for every shape; numbers in git history / docs/perf): the
  // register-resident fused scans scan_mma, wymma_scan, wymma_scan_x2 (0.97 / ~0.84 / 0.89 ms per
  // 4096-token layer) and slice_scan_o4 / slice_scan_v32 (4-warp output CTAs / 32-column slices).
  // slice_scan (gdn_prefill_slice.cu): the state pass alone on the sequential path, split over
  // 64-column slices of each head's state; the output + gated norm parallel over chunks (8-warp
  // CTAs). H200 (cuda_gdn_test Timing, one sequence, carried state), ms per layer: 64 tokens
  // 0.052 vs generic 0.072, 512 0.108 vs scan_mma 0.151, 2048 0.314 vs wymma_scan_x2 0.491, 4096
  // 0.565 vs 0.897, 8192 1.071 vs 1.743; slice_scan_o4 (4-warp output CTAs: 0.592 at 4096) and
  // slice_scan_v32 (32-column slices: 0.615) were slower at every size. Rejected (slower,
  // removed): the state pass with each warp pair splitting k (274 vs 177 us at 4096 tokens).
  // slice_scan_cs (issue 7 round 2): slice_scan with the streaming conv of gdn_prefill_conv.cu
  // (each input row read once, 16-byte loads). H200, same run (cuda_gdn_test Timing, one
  // sequence, carried state), ms per layer: 512 tokens 0.104 vs slice_scan 0.104, 2048 0.289 vs
  // 0.325, 4096 0.524 vs 0.550, 8192 0.981 vs 1.034; 64 tokens 0.050 vs 0.047 (the conv stages
  // tie there, 11.4 vs 11.3 us: launch noise, but not a win), hence >= 512 tokens. Rejected
  // (removed): the state pass with 3 / 4 cp.async stages (177 / 185 vs 174 us at 4096 tokens).
  // slice_scan_ov (issue 7 round 3): slice_scan_cs with a leaner state pass (ldmatrix /
  // stmatrix fragments, staged snapshot stores) and the output kernel launched as a programmatic
  // dependent of it (it fills the SMs the 96 state CTAs leave idle and takes each chunk once the
  // state pass has stored it: per-chunk ready flags); bit-identical to slice_scan_cs. H200 (bench
  // kernels, same run, carried state), us per layer: 512 tokens 80.4 vs slice_scan_cs 96.9, 4096
  // 439.8 vs 539.1, 8192 837.3 vs 980.8; bench prefill 32K 3010.6 vs 3039.6 ms
  // (docs/perf/gdn_prefill.md). 64 tokens stay on slice_scan (one chunk: nothing to overlap).
  // slice_scan_wg (issue 7, session 18): slice_scan_ov with the state pass's two products on
  // warpgroup MMAs (one warpgroup per 64-column slice, wgmma m64n64k16 / m64n128k16 with the state
  // and V_new as register A operands) and its tiles moved by TMA; bit-identical to slice_scan_ov
  // (H200). H200 (bench kernels, same run), us per layer: 512 tokens 77.1 vs 81.1, 4096 399.4 vs
  // 423.2, 8192 760.2 vs 800.4 (docs/perf/gdn_prefill.md). Where its TMA maps cannot describe the
  // tensors (n_v_heads % 4 != 0, ...) launch_gdn_prefill runs slice_scan_ov's state pass.
  r.add({F::kGdnPrefill, "slice_scan_wg",
         "d_k = d_v = 128, >= 512 tokens: slice_scan_ov with the state pass on warpgroup MMAs "
         "(wgmma m64n64k16 / m64n128k16, state and V_new as register operands) and its tiles "
         "moved by TMA (gdn_prefill_slice.cu)",
         [](const ShapeKey& k) {
           return k.sm >= 90 && k.dims[0] == 128 && k.dims[1] == 128 && k.dims[2] >= 512;
         }});
  r.add({F::kGdnPrefill, "slice_scan_ov",
         "d_k = d_v = 128, >= 512 tokens: slice_scan_cs with a leaner state pass and the output "
         "kernel running beside it (programmatic dependent launch, per-chunk ready flags; "
         "gdn_prefill_slice.cu)",
         [](const ShapeKey& k) {
           return k.sm >= 90 && k.dims[0] == 128 && k.dims[1] == 128 && k.dims[2] >= 512;
         }});
  r.add({F::kGdnPrefill, "slice_scan_cs",
         "d_k = d_v = 128, >= 512 tokens: slice_scan with the streaming conv (one warp per two "
         "heads down a strip of tokens, each input row read once; gdn_prefill_conv.cu)",
         [](const ShapeKey& k) {
           return k.sm >= 90 && k.dims[0] == 128 && k.dims[1] == 128 && k.dims[2] >= 512;
         }});
  r.add({F::kGdnPrefill, "slice_scan",
         "d_k = d_v = 128, >= 64 tokens: WY on register mma.sync (tf32 off-diagonal inverse), state "
         "pass split over 64-column slices (snapshots + V_new), output + gated norm parallel over "
         "chunks in 8-warp CTAs (gdn_prefill_slice.cu)",
         [](const ShapeKey& k) {
           return k.sm >= 90 && k.dims[0] == 128 && k.dims[1] == 128 && k.dims[2] >= 64;
         }});
  r.add({F::kGdnPrefill, "chunked", "GDN chunked WY/UT prefill (gdn.h)", {}});
  // gdn_decode dims: {d_k, d_v, n_seqs}. The engine maps a variant to its kernel with
  // gdn_decode_kernel_for_variant (gdn.h); state alignment (16-byte rows) is checked at launch.
  // Batch ranges from the H200 timings in tests/cuda/cuda_gdn_decode_test.cpp (Timing).
  // The split kernels only at the batch sizes where the whole step was measured faster (H200,
  // bench decode at 4K, same call, docs/perf/decode_kernels.md "session 5"): batch 1 12.822 ->
  // 12.739 ms (split4 over cluster8), batch 16 17.120 -> 16.972 (split2 over fused_stream); at 4
  // and 8 both were slower or equal. Their kernel times jump wherever a grid spills past one
  // wave of 5 blocks per SM, hence no wider ranges (nor other head sizes, which the kernels
  // take: gdn_decode_split_supported) without a measurement.
  // The persistent kernel with the 8-chunk ring (at most one wave walking (sequence, head) units:
  // no partial wave) only at batch 16, the one size where the whole step was measured faster
  // (H200, bench decode at 4K, one call, docs/perf/decode_kernels.md "gdnd8"): 16.556 / 16.599 ms
  // (fused_split2, two rounds) -> 16.465; kernel 33.0 vs split2 35.3 us. At batch 4, 8 and 32
  // it (and the 4-chunk kPersist) was slower or equal in the step and slower in the kernel.
  r.add({F::kGdnDecode, "fused_persist_deep",
         "fused GDN decode step, the streaming kernel in a persistent grid of at most one wave "
         "(3 blocks per SM walking (sequence, head) units, an 8-chunk 64 KiB ring across units); "
         "bit-equal to fused_stream; sm 90, d_k = d_v = 128, batch 16 (H200 step 16.58 -> 16.47 "
         "ms at 4K)",
         [](const ShapeKey& k) {
           return k.sm >= 90 && k.dims[0] == 128 && k.dims[1] == 128 && k.dims[2] == 16;
         }});
  r.add({F::kGdnDecode, "fused_split4",
         "fused GDN decode step, the streaming kernel with each head's rows over a 4-block "
         "cluster (o rows exchanged by st.async); bit-equal to fused_stream; sm 90, "
         "d_k = d_v = 128, batch 1 (H200 step 12.822 -> 12.739 ms at 4K)",
         [](const ShapeKey& k) {
           return k.sm >= 90 && k.dims[0] == 128 && k.dims[1] == 128 && k.dims[2] == 1;
         }});
  r.add({F::kGdnDecode, "fused_split2",
         "fused GDN decode step, as fused_split4 over a 2-block cluster; sm 90, d_k = d_v = 128, "
         "batch 16 (H200 step 17.120 -> 16.972 ms at 4K)",
         [](const ShapeKey& k) {
           return k.sm >= 90 && k.dims[0] == 128 && k.dims[1] == 128 && k.dims[2] == 16;
         }});
  r.add({F::kGdnDecode, "fused_stream",
         "fused GDN decode step, one block per (sequence, value head), state streamed through a "
         "4-chunk shared-memory ring by bulk copies, no cluster barrier; sm 90, batch >= 3 (H200: "
         "11.2 vs 15.5 us at 4, 32.3 vs 45.8 at 16; 9.4 vs 9.1 at 2)",
         [](const ShapeKey& k) { return k.sm >= 90 && k.dims[2] >= 3; }});
  r.add({F::kGdnDecode, "fused_cluster8",
         "fused GDN decode step, each value head split over an 8-block cluster; d_v % 32 == 0, "
         "batch <= 4 (faster there on the H200, slower at 16)",
         [](const ShapeKey& k) { return k.dims[1] % 32 == 0 && k.dims[2] <= 4; }});
  r.add({F::kGdnDecode, "fused", "fused GDN decode step, 4-block cluster per value head (gdn.h)",
         [](const ShapeKey&) { return true; }});
  r.add({F::kGdnDecode, "prefill_path", "GDN prompt path with one token per sequence", {}});
  r.add({F::kRmsNorm, "fused_add", "residual add + zero-centred RMSNorm, one block per row", {}});
  // The head and rotary dims the warp kernel's per-head arithmetic supports (warp_per_head and
  // token_table; kernels.h qk_norm_rope_kv_warp_supported).
  const auto rope_warp_shape = [](const ShapeKey& k) {
    const int64_t hd = k.dims[0];
    return (hd == 64 || hd == 128 || hd == 256) && k.dims[1] % (hd / 16) == 0 && k.dims[1] <= hd;
  };
  // rope_kv dims: {head_dim, rotary_dim, n_tokens}; row alignment is checked at launch. The warp
  // kernel wins at decode sizes (H200: 4.8 vs 12.0 us at 1 token, 4.9 vs 12.2 at 16) and loses on
  // prompt chunks (190 vs 114 us at 4096 tokens; crossover estimated ~340), hence <= 128 tokens.
  r.add({F::kRopeKv, "warp_per_head",
         "q/k norm + partial RoPE + paged KV write, one warp per (token, head), 16-byte loads; hd "
         "64/128/256, rotary_dim a multiple of head_dim / 16, <= 128 tokens",
         [=](const ShapeKey& k) { return rope_warp_shape(k) && k.dims[2] >= 1 && k.dims[2] <= 128; }});
  // token_table: prompt chunks (> 128 tokens) on the warp kernel's shapes; one block per token,
  // the angles computed once per token, the warp kernel's arithmetic (bit-identical to it).
  r.add({F::kRopeKv, "token_table",
         "q/k norm + partial RoPE + paged KV write, one block per token, angles once per token in "
         "shared memory; hd 64/128/256, rotary_dim a multiple of head_dim / 16, > 128 tokens",
         [=](const ShapeKey& k) { return rope_warp_shape(k) && k.dims[2] > 128; }});
  r.add({F::kRopeKv, "fused", "q/k norm + partial RoPE + paged KV write, one block per token", {}});
  r.add({F::kSiluMul, "generic", "SiLU(gate) * up, 16-byte loads", {}});
  r.add({F::kSample,
         "bitsearch",
         "argmax / top-k / top-p by bitwise threshold search, one block per row",
         {}});
  r.disable(disabled);
  if (const char* env = std::getenv("DS_DISABLE_KERNELS")) r.disable(env);
  return r;
}

}  // namespace ds::cuda
