// The register-resident flash prefill kernels for head_dim 256 (attention_prefill_mma.cu): the
// specialised variants behind launch_attention_prefill (attention_prefill.cu), which selects
// them through the dispatch registry (family attn_prefill, variants "wgmma_ws" / "wgmma_ws3"
// (TMA producer + warp-specialised wgmma consumers) and "wgmma_m128" (Hopper warpgroup MMA,
// cp.async loads)).
#pragma once

#include "cuda/kernels.h"

namespace ds::cuda {

// Head dim the mma kernel is built for, and the key tile (keys per step) it reads from one page.
constexpr int kAttnMmaHeadDim = 256;
constexpr int kAttnMmaKeyTile = 64;

// Whether the mma kernel can run `s` at all (head_dim 256, page_size a multiple of the key tile);
// the registry guard decides on top of this whether it should.
bool attention_prefill_mma_supported(const AttnShape& s);

// The TMA view of one paged cache [blocks, n_kv, page, 256] (bf16) that wgmma_ws / wgmma_ws3 load
// tiles through: a 3-D tensor {256 columns, n_kv * page rows of one block, blocks} (innermost
// first) with byte strides {512, n_kv * page * 512} for dims 1 and 2, and room for every block id
// of the int32 block table. A tile's coordinates are (column, head * page + slot, block): small
// 32-bit numbers whatever the size of the cache, so nothing can wrap. `ok` is false when the shape
// is not an mma shape or breaks the encoder's limits (dims <= 2^32, strides < 2^40, signed 32-bit
// row coordinates); the TMA variants then run as wgmma_m128 (bit-identical outputs).
struct AttnCacheTmaView {
  uint64_t dims[3] = {0, 0, 0};
  uint64_t strides[2] = {0, 0};
  bool ok = false;
};
AttnCacheTmaView attention_prefill_tma_view(const AttnShape& s);

// The kernels of this file, one per attn_prefill variant of dispatch.cpp: Hopper wgmma (sm_90a, 2
// warpgroups x 64 rows) fed by cp.async (kWgmmaM128), and warp-specialised (a TMA producer warp
// feeding two wgmma consumer warpgroups through 2 K and 2 V stages, kWgmmaWs, or 3 K and 2 V
// stages, kWgmmaWs3; both start the heaviest row tiles of every kv head first). The Lean forms
// are the same kernels with less softmax work per tile and the same bits: O's rescale skipped on
// a tile where no row of a warp raised its max (alpha exactly 1), and the tiles before the first
// query in a loop compiled without the causal mask; registered after wgmma_ws, so not picked by
// default until measured. The Persist forms (of wgmma_ws3 and its lean form) are persistent: one
// block per SM walks the row tiles (the same order, dealt round by round), the producer streams
// the next tile's K / V and the consumers copy its Q while they finish the current one; same
// bits, not picked by default until measured. Session 26 (built, not measured): kWgmmaWsULean is
// wgmma_ws_lean with its Q descriptors built in the uniform datapath (same bits, ~80 fewer
// instructions per tile); kWgmmaWsLazy is that with the score scale folded into the exponent's
// FFMA and a row's softmax base raised only when its max grows by more than 2^8
// (FlashAttention-4's lazy rescale, so O is rarely rescaled): not the same bits, within the fp32
// reference's tolerance (tested against wgmma_m128).
enum class AttnMmaKernel {
  kWgmmaM128,
  kWgmmaWs,
  kWgmmaWs3,
  kWgmmaWsLean,
  kWgmmaWs3Lean,
  kWgmmaWs3Persist,
  kWgmmaWs3LeanPersist,
  kWgmmaWsULean,
  kWgmmaWsLazy
};

// Same contract as launch_attention_prefill, run by `kernel`.
void launch_attention_prefill_mma(AttnMmaKernel kernel, const AttnShape& s, const AttnBatch& b,
                                  const __nv_bfloat16* q,        // [n_rows, n_heads, 256]
                                  const __nv_bfloat16* k_cache,  // [blocks, n_kv, page, 256]
                                  const __nv_bfloat16* v_cache,  // [blocks, n_kv, page, 256]
                                  AttnGate gate,
                                  __nv_bfloat16* out,  // [n_rows, n_heads, 256]
                                  cudaStream_t stream);

}  // namespace ds::cuda
