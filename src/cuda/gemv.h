// Decode GEMV and skinny GEMM (gemv.cu): y[m, n] = x[m, k] * w[n, k]^T (+ y when accumulate) for
// m = 1..16 tokens, bf16 inputs, fp32 accumulation, bf16 or fp32 output. The weight is the
// row-major [out, in] checkpoint matrix and is read exactly once per call for all m tokens, so a
// batch of 16 costs little more than one token. Picked by GemmEngine::run through the dispatch
// registry (variant "gemm.skinny_mma") for the decode shapes; cuBLASLt stays the fallback.
//
// Method: tensor cores (mma.sync m16n8k16, bf16 -> fp32) with the tokens as the MMA's M side
// (padded to 16) and 8 weight rows as its N side. Each lane loads 16 contiguous bytes of a weight
// row per k-step of 32 (four lanes cover 64 contiguous bytes of the row) with
// ld.global.nc.L1::no_allocate; the MMA's k order is permuted identically for x and w, so no
// shuffles are needed. A block owns 8 * n_tile weight rows and its warps split k between them
// (reduced through shared memory at the end), so narrow outputs (n = 5120) still fill the chip
// with small blocks. Programmatic dependent launch is optional (SkinnyConfig::pdl). The
// summation order of an output depends only on (k, warps, unroll), never on m or on the other
// tokens: results are batch-invariant for a fixed config, and the config's warps / unroll are
// chosen from (n, k) only.
//
// The bulk-copy GEMV below (gemv_bulk.cu, "gemm.gemv_bulk", and the SwiGLU-fused
// "gemm.gemv_bulk_silu") takes the k = 4096..8192 decode shapes where it measured faster than
// cuBLASLt (m 1 with n >= 12288, m 2 with n >= 32768; the MLP's gate_up at m 1..4).
//
// Tests: tests/cuda/cuda_gemv_test.cpp (vs cuBLASLt and an fp64 CPU loop; DS_GEMV_SWEEP=1 also
// times every config). Bench: `deltaserve bench kernels --only gemm` (rows gemm.skinny_mma with
// cuBLASLt as the fallback column).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/gemm.h"

namespace ds::cuda {

constexpr int kSkinnyMaxM = 16;      // tokens per call
constexpr int kSkinnyMaxK = 32768;   // largest k tested (27B: 17408)
constexpr int kSkinnyMaxN = 262144;  // largest n tested (27B lm_head: 248320)

// One compiled kernel configuration.
struct SkinnyConfig {
  int n_tile = 1;  // 8-row MMA tiles per block: 1, 2 or 4
  int warps = 4;   // warps per block, splitting k: 4 or 8
  int unroll = 4;  // k-steps of 32 per warp iteration (loads in flight per row): 2, 4 or 8
  // Programmatic dependent launch: the kernel prefetches its first weights into L2 and waits for
  // the previous kernel of the stream only before it reads x (griddepcontrol), so its start
  // overlaps the end of that kernel, and a following skinny GEMM overlaps this one's tail.
  // Tested, off by default (mixed timings, see skinny_gemm_config).
  bool pdl = false;
  std::string name() const;  // "nt1w4u4", "nt1w4u4-pdl"
};

// The shape part of the guard: 1 <= m <= 16, k % 8 == 0, 8 <= k <= kSkinnyMaxK,
// 1 <= n <= kSkinnyMaxN. (Device sm 90 and bf16 are checked by the registry
// guard; 16-byte aligned x and w by GemmEngine::run.)
bool skinny_gemm_supports(int64_t m, int64_t n, int64_t k);

// The registry guard's shape test: supported and measured faster than cuBLASLt on the H200
// (today: k >= 12288, the MLP down projection; see gemv.cu).
bool skinny_gemm_preferred(int64_t m, int64_t n, int64_t k);

// The config for a shape on a device with n_sms multiprocessors. warps and
// unroll depend on (n, k) only, so every m of one (n, k) sums in the same
// order.
SkinnyConfig skinny_gemm_config(int m, int n, int k, int n_sms);

// Every compiled config (for sweeps).
std::vector<SkinnyConfig> skinny_gemm_configs();

// y = x w^T (+ y). Throws ds::Error when the shape is unsupported, a pointer is
// not 16-byte aligned (x, w) or the config is not compiled. Asynchronous,
// graph-safe, never allocates.
void launch_skinny_gemm(const __nv_bfloat16* x,  // [m, k]
                        const __nv_bfloat16* w,  // [n, k]
                        void* y,                 // [m, n] bf16 or fp32 (out)
                        int m, int n, int k, GemmOut out, bool accumulate, const SkinnyConfig& cfg,
                        cudaStream_t stream);

// ---- bulk-copy GEMV (gemv_bulk.cu), variant "gemm.gemv_bulk" ---------------------------------
// y = x w^T (+ y) for m = 1..8 tokens, k up to ~12K: one persistent block per SM streams its
// contiguous share of the weight rows through a shared-memory ring with 1-D bulk copies
// (cp.async.bulk + mbarriers, one producer warp, up to ~160 KB in flight per SM) and eight
// consumer warps dot each row with x (bf16 in shared memory, fp32 FMAs, warp-shuffle reduction).
// Summation order depends on k only: results are bit-identical for every m and config.
constexpr int kGemvBulkMaxM = 8;

struct GemvBulkConfig {
  int rows_per_stage = 1;  // weight rows per bulk copy / ring stage: 1 or 2
  int slots = 16;          // ring stages: a multiple of 8 (the consumer warps), at most 32
  // Programmatic dependent launch: the first `slots` weight copies are issued before the kernel
  // waits for the previous one (griddepcontrol.wait), x is read after.
  bool pdl = false;
  int blocks_per_sm = 1;  // 1, or 2 (each then within half of the SM's shared memory)
  // Stage order over the grid: false = block b owns one contiguous range of rows; true = block b
  // owns stages b, b + G, b + 2 G, ... (G blocks), so the whole grid sweeps the weight in memory
  // order. Each output's sums are the same either way (bit-identical; tested).
  bool interleave = false;
  // Stages past the ring whose weight rows the producer queues for L2
  // (cp.async.bulk.prefetch.L2) right after griddepcontrol.wait, i.e. while the consumers wait
  // for x (the fused norm's prologue, or x's copy) with the ring already full (session 34,
  // $DS_GEMV_AHEAD; not yet measured). Those stages' copies then hit L2. A prefetch moves no value:
  // the outputs are bit-identical for every count. 0: none (the kernels without it are separate
  // instantiations, unchanged); compiled for m <= kGemvAheadMaxM, bf16 out, without a GemvL2Next.
  int l2_ahead = 0;
  // Each lane sums its part of an output row in one fp32 FMA chain. (Session 26's 4 partial sums
  // per lane at m = 1, $DS_GEMV_ACC=4, were removed in session 30: within noise of this order on
  // an H100 in session 29, and off by default; docs/perf/decode_gemv.md.)
  std::string name() const;  // "r1s16", "r2s8b2", "r1s16-pdl", "r1s16-ilv", "r1s16-a8"
};
constexpr int kGemvAheadMaxM = 2;    // the m compiled with l2_ahead (the decode step's bulk GEMVs)
constexpr int kGemvAheadMaxKib = 512;  // $DS_GEMV_AHEAD's and $DS_GEMV_TMA_AHEAD's range
// The default for the GEMVs at m <= kGemvAheadMaxM (bulk and narrow): off. Session 36's A/Bs on
// an H100 (docs/perf/decode_gemv.md) had 80 KiB 0.11-0.14 ms a step faster at 1@4096 but
// 0.01-0.05 ms slower at 1@16384 / 1@32768 and 0.14 ms slower at 2@4096.
constexpr int kGemvAheadDefaultKib = 0;
// $DS_GEMV_AHEAD: KiB of each block's next weight stages the decode GEMVs at m <= kGemvAheadMaxM
// queue for L2 after their wait (0..512; unset: kGemvAheadDefaultKib), read by the engine at
// start. gemv_bulk_ahead_stages turns a KiB budget into l2_ahead for a config at row length k
// (GLU: the stage is a gate row and an up row); at least one stage for any budget > 0.
int gemv_ahead_kib_from_env();
// $DS_GEMV_TMA_AHEAD: the same for the TMA GEMVs (batch 5-16; GemvTmaConfig::l2_ahead); unset or
// 0: off (the default).
int gemv_tma_ahead_kib_from_env();
// Stages of stage_bytes each that a budget of kib KiB covers, rounded up: at least one for any
// budget > 0, none for 0 (the rounding every GEMV's *_ahead_stages shares).
inline int gemv_ahead_stages_for(int kib, int64_t stage_bytes) {
  if (kib <= 0 || stage_bytes <= 0) return 0;
  const int64_t st = (int64_t(kib) * 1024 + stage_bytes - 1) / stage_bytes;
  return int(st > 1 ? st : 1);
}
int gemv_bulk_ahead_stages(int kib, int k, const GemvBulkConfig& c, bool glu);

// The leading rows of a LATER GEMV's blocks, prefetched into L2 by this GEMV's blocks as each
// issues its last own copy (cp.async.bulk.prefetch.L2), so that HBM keeps streaming weights while
// the small kernels between the two run (the decode step's gdn_in -> gdn_decode -> gdn_out and
// attn_qkv -> rope_kv + attention -> attn_o), and the later GEMV finds those rows in L2. A
// prefetch changes no value anywhere: the outputs are bit-identical with or without it. rows 0 or
// w null: off.
struct GemvL2Next {
  const void* w = nullptr;  // the later GEMV's bf16 weight [n, k]
  int n = 0, k = 0;
  int grid = 0;  // its blocks: block j reads rows [n j / grid, n (j + 1) / grid), in order
  int rows = 0;  // leading rows of each of those ranges to prefetch
};
// An early-rows signal (session 32, $DS_GDN_EARLY): the interleaved sweep of the bulk GEMV starts
// at row first_row (stage first_row / R, wrapping past the last row to row 0), and each block
// raises *counter by one (a release: the last of its consumer warps to get there fences at GPU
// scope, then adds) once every row it owns among the first `rows` rows of that sweep is stored
// (a warp that owns none past them counts at its end); gemv_bulk_signal_count raises per launch
// in all (one per block). So *counter reaching that count
// means rows [first_row, n) and [0, rows - (n - first_row)) of y are final while the GEMV still
// computes the rest. The decode step points it at gdn_in with first_row = the b / a rows and rows
// covering them and the qkv rows, so gdn_decode can start before the z rows are done. The values
// are those of the plain sweep (each row's sums do not depend on the order): bit-identical y.
// counter null: off. Compiled for m = 1 with the fused norm, rows_per_stage 1, interleaved.
struct GemvSignal {
  unsigned* counter = nullptr;
  int first_row = 0;
  int rows = 0;
};
// The bulk GEMV's grid for n rows with config c on n_sms multiprocessors (one block per SM, or
// two with blocks_per_sm 2; never more blocks than rows).
int gemv_bulk_grid(int n, const GemvBulkConfig& c, int n_sms);
// Whether launch_gemv_bulk_norm takes a GemvSignal with config c at m rows (the rest of its
// checks: first_row and rows inside the weight, no L2 prefetch, bf16 out).
bool gemv_bulk_signal_supported(int m, const GemvBulkConfig& c);
// The raises one signalled launch makes (every block of its grid raises once).
int gemv_bulk_signal_count(int m, int n, int k, const GemvBulkConfig& c, int n_sms);

// $DS_GEMV_L2_NEXT: MiB of a later GEMV's weights to prefetch that way (0..256, read once per
// process; 0 or unset: off). gemv_l2_next_rows turns it into rows per block of that GEMV.
int gemv_l2_next_mib();
constexpr int kGemvL2NextMaxM = 2;  // the m compiled with the prefetch (the engine uses m 1)
int gemv_l2_next_rows(int n, int k, int grid);

// Whether x [m, k] plus `slots` stages of `rows_per_stage` rows fit the shared memory (m <= 8,
// k % 8 == 0, k >= 8, slots a multiple of 8 in 8..32; with 2 blocks per SM, half of it).
bool gemv_bulk_fits(int64_t m, int64_t k, const GemvBulkConfig& c);
// The shape part of the guard: some config fits and 1 <= n <= kSkinnyMaxN.
bool gemv_bulk_supports(int64_t m, int64_t n, int64_t k);
// The registry guard's shape test: supported and measured faster than cuBLASLt (gemv_bulk.cu).
bool gemv_bulk_preferred(int64_t m, int64_t n, int64_t k);
// The config for a shape (fits whenever gemv_bulk_supports).
GemvBulkConfig gemv_bulk_config(int m, int n, int k);
// $DS_GEMV_ILV (read once per process): the engine's default stage order for the bulk and narrow
// GEMVs (unset / `1` / `all`: interleaved in both, the default; `0`: contiguous rows per block;
// `bulk`, `narrow`: one of them).
bool gemv_interleave_bulk();
bool gemv_interleave_narrow();

// Programmatic dependent launch of the decode GEMVs in GemmEngine, from $DS_GEMV_PDL (read once
// per process): "0" off; "1", "bulk" or unset (the default) the bulk GEMVs (gemv_bulk,
// gemv_bulk_pdl, gemv_bulk_silu, gemv_narrow); "all" skinny_mma too, which measured
// much slower in the 27B decode graph (17.65 vs 13.57 ms per token, docs/perf/decode_gemv.md)
// and is an experiment only: skinny_mma reads x through ld.global.nc (gemv.cu, DS_GEMV_LD16),
// which ptxas may schedule above griddepcontrol.wait (the session-4 PDL audit; in nvcc 13.0's
// SASS they come after it); make that load plain before ever making "all" a default.
// The kernels before the GEMVs in the decode step (add_rmsnorm, gdn_decode, the attention decode
// merge, silu_mul) trigger their dependents at their start, so a PDL-launched GEMV streams its
// weights while that kernel runs and reads x after griddepcontrol.wait.
// Invariant this relies on: the weights are constant while GEMVs run. A kernel that writes weights
// (loading, the device synthetic generator, a future LoRA merge or hot swap) must be followed by a
// stream synchronisation or a normal (non-PDL) launch before the next PDL-launched GEMV, which
// would otherwise read the weights before that kernel finished.
enum class GemvPdl { kOff, kBulk, kAll };
GemvPdl gemv_pdl_mode();
// Registry variant "gemm.gemv_bulk_pdl": the narrow decode projections (m 1, n 4096..12287,
// k 4096..8192: gdn_out / attn_o 5120 x 6144) where the bulk GEMV ties cuBLASLt when launched
// alone but gains from PDL; false whenever gemv_pdl_mode() is kOff.
bool gemv_bulk_pdl_preferred(int64_t m, int64_t n, int64_t k);
// Every config that fits (m, k) (for tests and sweeps).
std::vector<GemvBulkConfig> gemv_bulk_configs(int m, int k);

// Launches min(n_sms * blocks_per_sm, n) blocks. Throws ds::Error for an unsupported shape, a
// config that does not fit, unaligned x / w (16 bytes) or a null y. Asynchronous, graph-safe,
// never allocates.
void launch_gemv_bulk(const __nv_bfloat16* x,  // [m, k]
                      const __nv_bfloat16* w,  // [n, k]
                      void* y,                 // [m, n] bf16 or fp32 (out)
                      int m, int n, int k, GemmOut out, bool accumulate, const GemvBulkConfig& cfg,
                      int n_sms, cudaStream_t stream, const GemvL2Next& next = {});

// The greedy argmax fused into the epilogue (lm_head at decode; session 27, built without a
// device, off unless $DS_ARGMAX_FUSED=1 in the engine): y = x w^T in fp32, the bits of
// launch_gemv_bulk, and tokens[t] = greedy_token(y[t])
// (runtime/backend.h: argmax, lowest id on ties, -1 for a row holding NaN or +inf), the answer of
// launch_argmax_rows on y, without that second kernel: the grid reduces argmax_key maxima
// (argmax_key.h) through shared and global atomics, and its last block writes the tokens. The
// workspace (kGemvBulkArgmaxWorkspaceBytes, 8-byte aligned) must be zero before the first launch;
// each launch leaves it zero. Launches sharing a workspace must be ordered (one stream; a
// programmatic dependent launch is fine: the workspace is touched only after the wait).
// m 1..kGemvBulkArgmaxMaxM; the config: gemv_bulk_config's with one block per SM.
// with_norm: launch_gemv_bulk_argmax_norm (gemv_bulk_norm.h) fits too (k <= kGemvNormMaxK and
// the norm's warp sums in shared memory).
constexpr int kGemvBulkArgmaxMaxM = 2;
constexpr size_t kGemvBulkArgmaxWorkspaceBytes = 8 * kGemvBulkArgmaxMaxM + 8;
bool gemv_bulk_argmax_supports(int64_t m, int64_t n, int64_t k, const GemvBulkConfig& c,
                               bool with_norm = false);
void launch_gemv_bulk_argmax(const __nv_bfloat16* x,  // [m, k]
                             const __nv_bfloat16* w,  // [n, k]
                             float* y,                // [m, n] (out: the logits)
                             int32_t* tokens,         // [m] (out)
                             void* workspace,         // kGemvBulkArgmaxWorkspaceBytes, zeroed
                             int m, int n, int k, const GemvBulkConfig& cfg, int n_sms,
                             cudaStream_t stream);

// SwiGLU fused into the epilogue: act[m, d_ff] = bf16(silu(g) * u), g = bf16(x w[j]^T) and
// u = bf16(x w[d_ff + j]^T) from the fused [gate | up] weight [2 d_ff, k]: bit-identical to
// launch_gemv_bulk on [gate | up] followed by launch_silu_mul, without the [m, 2 d_ff]
// intermediate or the second launch. Registry variant "gemm.gemv_bulk_silu", selected with the
// key (m, 2 d_ff, k, 1) (dims[3] = 1 marks a gate_up projection followed by SiLU-and-mul).
constexpr int kGemvBulkSiluMaxM = 4;
bool gemv_bulk_silu_supports(int64_t m, int64_t d_ff, int64_t k);
bool gemv_bulk_silu_preferred(int64_t m, int64_t d_ff, int64_t k);
GemvBulkConfig gemv_bulk_silu_config(int m, int d_ff, int k);  // two rows (gate, up) per stage
void launch_gemv_bulk_silu(const __nv_bfloat16* x,          // [m, k]
                           const __nv_bfloat16* w_gate_up,  // [2 d_ff, k]
                           __nv_bfloat16* act,              // [m, d_ff] (out)
                           int m, int d_ff, int k, const GemvBulkConfig& cfg, int n_sms,
                           cudaStream_t stream);

// ---- narrow-output GEMV (gemv_narrow.cu), variant "gemm.gemv_narrow" --------------------------
// y = x w^T (+ y) for m = 1..8 tokens (as many as x [m, k] fits in shared memory next to the ring)
// and k up to kSkinnyMaxK: one persistent block per SM streams its contiguous rows through a
// shared-memory ring of (row, k-slice) stages with 1-D bulk copies; eight consumer warps each dot
// a slice with x and park the partial sum, the block sums a row's slices in slice order at the
// end. Built for the MLP down projection (5120 x 17408: a row is 34.8 KB, longer than gemv_bulk's
// whole-row stages allow). Slices: C = gemv_narrow_slices(k) of gemv_narrow_slice_len(k) elements
// (functions of k only), so results are bit-identical for every m, slot count and grid size.
constexpr int kGemvNarrowMaxM = 8;

struct GemvNarrowConfig {
  int slots = 16;  // ring stages: a multiple of 8 (the consumer warps), at most 32
  // Programmatic dependent launch: the first `slots` weight copies are issued before
  // griddepcontrol.wait; x is copied after it.
  bool pdl = false;
  // Rows over the grid: false = contiguous per block; true = block b owns rows b, b + G, ... (as
  // GemvBulkConfig::interleave; bit-identical either way).
  bool interleave = false;
  // Stages (row slices) past the ring queued for L2 right after griddepcontrol.wait and x's copy:
  // GemvBulkConfig::l2_ahead's probe for this kernel (session 34, $DS_GEMV_AHEAD; not yet
  // measured). Bit-identical outputs for every count; 0: none. Compiled for m <= kGemvAheadMaxM
  // and bf16 out.
  int l2_ahead = 0;
  std::string name() const;  // "s16", "s8-pdl", "s16-ilv", "s16-ilv-a10"
};
// l2_ahead for a KiB budget per block (a stage: one slice of gemv_narrow_slice_len(k) elements; at
// least one stage for any budget > 0).
int gemv_narrow_ahead_stages(int kib, int64_t k);

int gemv_narrow_slices(int64_t k);     // slices per row: 1, 2, 4 or 8 (17408 -> 4)
int gemv_narrow_slice_len(int64_t k);  // elements per slice, a multiple of 8 (17408 -> 4352)
// Whether the shape and config fit on a device of n_sms SMs (one block each): m <= 8, k % 8 == 0,
// 8 <= k <= kSkinnyMaxK, n <= kSkinnyMaxN, slots a multiple of 8 in 8..32, and x, the ring and
// the partial sums (ceil(n / min(n_sms, n)) rows x slices x m) within the shared memory.
bool gemv_narrow_fits(int64_t m, int64_t n, int64_t k, const GemvNarrowConfig& c, int n_sms);
bool gemv_narrow_supports(int64_t m, int64_t n, int64_t k, int n_sms);  // some config fits
// The registry guard's shape test (sm 90 / bf16 are the registry's), where measured faster: the
// down projection at m 1..2 (n 1024..8192, k 12288..kSkinnyMaxK), in front of skinny_mma. Tests
// the fit for >= 64 SMs; GemmEngine::run re-checks with the device's count (else cuBLASLt).
bool gemv_narrow_preferred(int64_t m, int64_t n, int64_t k);
GemvNarrowConfig gemv_narrow_config(int m, int n, int k, int n_sms);
std::vector<GemvNarrowConfig> gemv_narrow_configs(int m, int n, int k, int n_sms);

// Launches min(n_sms, n) blocks. Throws ds::Error for an unsupported shape, a config that does
// not fit, unaligned x / w (16 bytes) or a null y. Asynchronous, graph-safe, never allocates.
void launch_gemv_narrow(const __nv_bfloat16* x,  // [m, k]
                        const __nv_bfloat16* w,  // [n, k]
                        void* y,                 // [m, n] bf16 or fp32 (out)
                        int m, int n, int k, GemmOut out, bool accumulate,
                        const GemvNarrowConfig& cfg, int n_sms, cudaStream_t stream);


// ---- tensor-core bulk-copy GEMV (gemv_bulk_mma.cu), variant "gemm.gemv_bulk_mma" --------------
// y = x w^T for m = 1..16 tokens (no accumulate), k % 64 == 0: one persistent block per SM streams
// its contiguous rows through a shared-memory ring of (k-chunk, 16-row group) stages with 1-D
// bulk copies (one per row, mbarriers, per-slot tags), x arrives chunk by chunk into two padded
// [16, kc] buffers (rows >= m zero), and eight consumer warps each own a fixed set of 16-row
// groups whose fp32 accumulators stay in registers across the chunks (ldmatrix + mma.sync
// m16n8k16, tokens as M padded to 16). Summation order: the k-steps of 16 in order, one MMA each:
// bit-identical for every m, config and grid. OFF by default: picked only with $DS_GEMV_MMA=1
// (m 3..16, k 4096..8192, n >= 4096); built, not yet measured on a GPU.
constexpr int kGemvBulkMmaMaxM = 16;

struct GemvBulkMmaConfig {
  int kc = 512;     // k elements per chunk (stage = 16 rows x kc): 512 or 1024
  int slots = 11;   // ring stages, 2..16, within the shared memory with the two x buffers
  bool pdl = false; // the first `slots` stages are issued before griddepcontrol.wait
  std::string name() const;  // "k512s11", "k1024s5-pdl"
};

// $DS_GEMV_MMA: "1" on, "0" or unset off; anything else throws ds::Error (read once per process;
// the engine validates it at start-up).
bool gemv_bulk_mma_enabled();
// Whether the shape and config fit on a device of n_sms SMs (one block each, min(n_sms, n)
// blocks): 1 <= m <= 16, k % 64 == 0, 64 <= k <= kSkinnyMaxK, 1 <= n <= kSkinnyMaxN, kc 512 or
// 1024, slots 2..16 within the shared memory, and at most gemv_bulk_mma_max_groups() groups of 16
// rows per block.
bool gemv_bulk_mma_fits(int64_t m, int64_t n, int64_t k, const GemvBulkMmaConfig& c, int n_sms);
bool gemv_bulk_mma_supports(int64_t m, int64_t n, int64_t k, int n_sms);  // the default fits
// The registry guard's shape test (sm 90 / bf16 are the registry's): $DS_GEMV_MMA=1, m 3..16,
// k 4096..8192, n >= 4096, not where gemv_bulk is preferred, and supported on >= 64 SMs
// (GemmEngine::run re-checks with the device's count, and runs cuBLASLt for accumulate).
bool gemv_bulk_mma_preferred(int64_t m, int64_t n, int64_t k);
GemvBulkMmaConfig gemv_bulk_mma_config(int m, int n, int k);
std::vector<GemvBulkMmaConfig> gemv_bulk_mma_configs(int m, int n, int k, int n_sms);
int gemv_bulk_mma_max_groups();                               // 48 (768 rows per block)
size_t gemv_bulk_mma_smem_bytes(const GemvBulkMmaConfig& c);  // dynamic shared memory per block

// Launches min(n_sms, n) blocks of 320 threads. Throws ds::Error for accumulate, an unsupported
// shape or config, unaligned x / w (16 bytes) or a null y. Asynchronous, graph-safe, never
// allocates.
void launch_gemv_bulk_mma(const __nv_bfloat16* x,  // [m, k]
                          const __nv_bfloat16* w,  // [n, k]
                          void* y,                 // [m, n] bf16 or fp32 (out)
                          int m, int n, int k, GemmOut out, bool accumulate,
                          const GemvBulkMmaConfig& cfg, int n_sms, cudaStream_t stream);

// ---- TMA tensor-core GEMV (gemv_tma.cu), variants "gemm.gemv_tma" / "gemm.gemv_tma_silu" -----
// y = x w^T for m = 1..16 tokens (no accumulate), any k % 8 == 0 up to kSkinnyMaxK, and the fused
// gate_up + SiLU-and-mul (act = bf16(silu(bf16(g)) * bf16(u)), bit-identical to the plain kernel
// on [gate | up] followed by launch_silu_mul): one persistent block per SM owns a contiguous
// range of outputs; a stage is all its rows over 64 k-elements as two 2-D TMA boxes (128-byte
// swizzle) plus a box of x; 8 consumer warps keep fp32 accumulators in registers (mma.sync
// m16n8k16, tokens as M padded to 16 with zeros). Summation order: the k-steps of 16 in order, one
// MMA each: bit-identical for every m, config and grid. On by default for gate_up + SiLU, gdn_in
// and attn_qkv at m kGemvTmaMinM..16, k 4096..8192, n (d_ff for the SiLU kernel) >= 8192;
// $DS_GEMV_TMA=0 off (cuBLASLt, and silu_mul after gate_up), =silu gate_up + SiLU only.
constexpr int kGemvTmaMaxM = 16;
constexpr int kGemvTmaMinM = 5;  // m 1..4 stay with gemv_bulk / gemv_bulk_silu / cuBLASLt

enum class GemvTmaMode { kOff, kAll, kSilu };
// $DS_GEMV_TMA: unset / "1" all (the default), "0" off, "silu"; anything else throws ds::Error
// (read once).
GemvTmaMode gemv_tma_mode();

struct GemvTmaConfig {
  int slots = 0;     // ring stages (2..16); 0 = as many as fit in the shared memory
  bool pdl = false;  // the first stages' weight boxes are issued before griddepcontrol.wait
  // 64-k chunks per stage: 1 (the shipped 128 bytes of each weight row per stage), 2 or 4 (256 /
  // 512 contiguous bytes per row, fewer and larger stages; session 27, built without a device: the
  // narrow kernel's kbox measured faster the wider up to 8 chunks, session 10). The same sums in
  // the same order at every kbox (bit-identical by construction).
  int kbox = 1;
  // Stages past the ring whose weight boxes the producer queues for L2 right after
  // griddepcontrol.wait (and the first stages' x boxes): GemvBulkConfig::l2_ahead's probe for this
  // kernel (session 34, $DS_GEMV_AHEAD; not yet measured). Bit-identical outputs for every count;
  // 0: none. Compiled for kbox 1 and bf16 out.
  int l2_ahead = 0;
  std::string name() const;  // "smax", "s4-pdl", "smax-kb2", "smax-a3"
};
// l2_ahead for a KiB budget per block (a stage: the block's two weight boxes of 64 k; at least one
// stage for any budget > 0; 0 with kbox != 1).
int gemv_tma_ahead_stages(int kib, int64_t n, bool glu, const GemvTmaConfig& c, int n_sms);

// Stages that fit for a box of `box_rows` rows and kbox chunks per stage (0 for box_rows < 1 or
// a kbox other than 1, 2, 4).
int gemv_tma_max_slots(int box_rows, int kbox = 1);
// $DS_GEMV_TMA_KBOX (read once per process; the CUDA engine reads it at start): the kbox
// gemv_tma_config asks for, 1 (unset), 2 or 4; other values throw. An A/B switch until measured
// on the device. gemv_tma_config checks the fit on 100 SMs: on a smaller device a caller must
// re-check gemv_tma_fits with its own SM count (GemmEngine halves kbox until it fits).
int gemv_tma_kbox_mode();
// Whether the shape (glu: n = d_ff, the weight has 2 d_ff rows) and config fit on a device of
// n_sms SMs (min(n_sms, n) blocks): 1 <= m <= 16, k % 8 == 0, 8 <= k <= kSkinnyMaxK, at most 192
// box rows (GLU: features per block; plain: half the rows per block), 2+ stages.
bool gemv_tma_fits(int64_t m, int64_t n, int64_t k, bool glu, const GemvTmaConfig& c, int n_sms);
bool gemv_tma_supports(int64_t m, int64_t n, int64_t k, bool glu, int n_sms);
// The registry guard's shape test (sm 90 / bf16 are the registry's): the mode above, m
// kGemvTmaMinM..16, k 4096..8192, n >= 8192, supported on >= 100 SMs (GemmEngine re-checks).
bool gemv_tma_preferred(int64_t m, int64_t n, int64_t k, bool glu);
GemvTmaConfig gemv_tma_config(int m, int n, int k, bool glu);
std::vector<GemvTmaConfig> gemv_tma_configs(int m, int n, int k, bool glu, int n_sms);

// Launch min(n_sms, n) blocks of 288 threads. Throw ds::Error for an unsupported shape or config,
// unaligned x / w (16 bytes) or a null output. Asynchronous, graph-safe, never allocates (the two
// TMA descriptors are kernel parameters, encoded on the host per launch).
void launch_gemv_tma(const __nv_bfloat16* x,  // [m, k]
                     const __nv_bfloat16* w,  // [n, k]
                     void* y,                 // [m, n] bf16 or fp32 (out)
                     int m, int n, int k, GemmOut out, const GemvTmaConfig& cfg, int n_sms,
                     cudaStream_t stream);
void launch_gemv_tma_silu(const __nv_bfloat16* x,          // [m, k]
                          const __nv_bfloat16* w_gate_up,  // [2 d_ff, k]
                          __nv_bfloat16* act,              // [m, d_ff] (out)
                          int m, int d_ff, int k, const GemvTmaConfig& cfg, int n_sms,
                          cudaStream_t stream);

// ---- TMA tensor-core GEMV for narrow outputs (gemv_tma.cu), variant "gemm.gemv_tma_narrow" ----
// y = x w^T for m = 1..16 tokens (no accumulate) where n is small and k long (27B: gdn_out and
// attn_o 5120 x 6144, down 5120 x 17408): one persistent block per SM owns 4-8 8-row groups; a
// stage is those rows over kbox x 64 k-elements (kbox 2-D TMA boxes of the weights and of x,
// 128-byte swizzle); the 8 consumer warps split each stage by k (fp32 m16n8 fragments in
// registers) and are summed in warp order at the end. Summation order depends on k and kbox only:
// bit-identical for every m, slot count, grid and PDL at one kbox. On by default for the MLP
// down projection (k > 8192) at m kGemvTmaNarrowMinM..16 (measured in the step, session 10:
// batch 3 / 4 / 8 / 16 -0.20 / -0.15 / -0.29 / -0.35 ms; batch 1 / 2 +0.16-0.27 / +0.09 ms
// against gemv_narrow, which keeps m 1..2);
// $DS_GEMV_TMA_NARROW=0 off, =down the down projection at every m 1..16, =out the out projections
// (k <= 8192: slower in the step), =1 both at every m (shapes: n 5120..8192, k 6144..32768).
constexpr int kGemvTmaNarrowMaxK = 32768;
constexpr int kGemvTmaNarrowMinM = 3;  // the default's smallest m (the down projection)

enum class GemvTmaNarrowMode { kOff, kDownBatch, kDown, kOut, kAll };
// $DS_GEMV_TMA_NARROW: unset kDownBatch (the default), "0" off, "down", "out", "1"; anything else
// throws ds::Error (read once).
GemvTmaNarrowMode gemv_tma_narrow_mode();

struct GemvTmaNarrowConfig {
  int kbox = 8;      // 64-k boxes per stage: 2, 4, 8 or 16
  int slots = 0;     // ring stages (2..16); 0 = as many as fit in the shared memory
  bool pdl = false;  // the first stages' weight boxes are issued before griddepcontrol.wait
  std::string name() const;  // "kb8-smax", "kb2-s3-pdl"
};

// Stages that fit for blocks of at most `groups` 8-row groups (0 for a bad kbox or groups < 1).
int gemv_tma_narrow_max_slots(int groups, int kbox);
// Whether the shape and config fit on n_sms SMs (min(n_sms, ceil(n / 8)) blocks): 1 <= m <= 16,
// k % 8 == 0, 8 <= k <= 32768, at most 64 rows per block, 2+ stages.
bool gemv_tma_narrow_fits(int64_t m, int64_t n, int64_t k, const GemvTmaNarrowConfig& c,
                          int n_sms);
bool gemv_tma_narrow_supports(int64_t m, int64_t n, int64_t k, int n_sms);
// The registry guard's shape test (sm 90 / bf16 are the registry's): the mode above, m 1..16
// (default: kGemvTmaNarrowMinM..16), n 5120..8192, k 6144..32768, supported on >= 100 SMs (GemmEngine
// re-checks).
bool gemv_tma_narrow_preferred(int64_t m, int64_t n, int64_t k);
GemvTmaNarrowConfig gemv_tma_narrow_config(int m, int n, int k);
std::vector<GemvTmaNarrowConfig> gemv_tma_narrow_configs(int m, int n, int k, int n_sms);
// Launch min(n_sms, ceil(n / 8)) blocks of 288 threads. Throw ds::Error for an unsupported shape
// or config, unaligned x / w (16 bytes) or a null output. Asynchronous, graph-safe, never
// allocates (three TMA descriptors as kernel parameters, encoded on the host per launch).
void launch_gemv_tma_narrow(const __nv_bfloat16* x,  // [m, k]
                            const __nv_bfloat16* w,  // [n, k]
                            void* y,                 // [m, n] bf16 or fp32 (out)
                            int m, int n, int k, GemmOut out, const GemvTmaNarrowConfig& cfg,
                            int n_sms, cudaStream_t stream);

// ---- split-K tensor-core GEMV (gemv_splitk_mma.cu), variant "gemm.gemv_splitk_mma" ------------
// y = x w^T for m = 1..16 tokens (no accumulate) on the narrow-output shapes k = 17408 (the 27B MLP
// down projection) and k = 6144 (the mixers' out projections), n a multiple of 8 up to
// kGemvSplitKMaxN: 4 k-splits x G row groups of 8-row tiles (G = min(SMs / 4, n / 8, 64)), a
// bulk-copy ring per block (its first stages issued before griddepcontrol.wait), 16 consumer warps
// with their x fragments in registers (mma.sync m16n8k16, tokens as M), fp32 partials per split in
// a workspace, summed in split order by the last block of each row group. Bit-identical for every
// m and grid. OFF by default (measured slower than cuBLASLt in the decode step, session 8):
// picked at m 5..16 only with $DS_GEMV_SPLITK = 1 (both shapes), down or out (one of them).
constexpr int kGemvSplitKMaxM = 16;
constexpr int kGemvSplitKMaxN = 8192;

// $DS_GEMV_SPLITK: "1", "down" or "out" on, "0" or unset off; anything else throws (read once).
bool gemv_splitk_enabled();
bool gemv_splitk_supports(int64_t m, int64_t n, int64_t k);
// The registry guard's shape test: $DS_GEMV_SPLITK selects the shape, m 5..16, supported.
bool gemv_splitk_preferred(int64_t m, int64_t n, int64_t k);
// Device workspace the launch needs (fp32 partials, the row groups' counters): zero-filled once
// before the first launch; every launch leaves the counters at zero again. One stream at a time.
size_t gemv_splitk_workspace_bytes();
// The grid of a launch on n_sms SMs (4 x the row groups).
int gemv_splitk_blocks(int64_t n, int n_sms);
// Throws ds::Error for accumulate, an unsupported shape, unaligned x / w / workspace or a null y.
// n_sms <= 0: the current device's. pdl: launched with programmatic dependent launch (x is read
// after griddepcontrol.wait). Asynchronous, graph-safe, never allocates.
void launch_gemv_splitk(const __nv_bfloat16* x,  // [m, k]
                        const __nv_bfloat16* w,  // [n, k]
                        void* y,                 // [m, n] bf16 or fp32 (out)
                        int m, int n, int k, GemmOut out, bool accumulate, void* workspace,
                        cudaStream_t stream, int n_sms = 0, bool pdl = false);

}  // namespace ds::cuda
