// Internal to the GDN prompt path (gdn_prefill.cu): the conv and WY kernels of
// gdn_prefill_sm90.cu and the sliced state pass + parallel output of gdn_prefill_slice.cu (the
// kGdnPrefill variants "slice_scan", "slice_scan_cs", "slice_scan_ov"). Not part of the kernels'
// public interface (gdn.h).
#pragma once

#include <cstdint>

#include "cuda/cuda_common.h"
#include "cuda/gdn.h"

namespace ds::cuda {

// Shapes and pointers the specialised prompt kernels take at all: d_k = d_v = 128, 8-byte aligned
// proj rows, state slots and output rows (gdn_slice_supported adds its own). False: the generic
// kernels.
bool gdn_scan_supported(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                        const bf16* proj, const bf16* out);

// conv + SiLU + l2norm + gates (launch_gdn_conv_prep's maths) for d_k = d_v = 128 with
// 8 tokens per block (the conv weights read once per 8 tokens instead of per token).
bool gdn_conv_prep_multi_supported(const GdnShape& s, const GdnLayerWeights& w,
                                   const GdnStatePool& pool, const bf16* proj);
void launch_gdn_conv_prep_multi(const GdnShape& s, const GdnLayerWeights& w,
                                const GdnStatePool& pool,
                                const bf16* proj,  // [n_tokens, in_dim]
                                const int32_t* cu_seqlens, const int32_t* seq_pos,
                                const int32_t* slot_ids, int n_seqs, int n_tokens,
                                bf16* qkv,    // [n_tokens, qkv_dim]
                                float* g,     // [n_tokens, n_v_heads]
                                float* beta,  // [n_tokens, n_v_heads]
                                cudaStream_t stream);

// The same with one warp per (head, 8 tokens) (5120 blocks at 4096 tokens, every tap load of a
// warp in flight at once); launch_gdn_conv_prep_multi's arithmetic and requirements.
void launch_gdn_conv_prep_wide(const GdnShape& s, const GdnLayerWeights& w,
                               const GdnStatePool& pool,
                               const bf16* proj,  // [n_tokens, in_dim]
                               const int32_t* cu_seqlens, const int32_t* seq_pos,
                               const int32_t* slot_ids, int n_seqs, int n_tokens,
                               bf16* qkv,    // [n_tokens, qkv_dim]
                               float* g,     // [n_tokens, n_v_heads]
                               float* beta,  // [n_tokens, n_v_heads]
                               cudaStream_t stream);

// gdn_prefill_conv.cu: the same maths again (up to the last bf16 bit: approximate SiLU divide,
// another l2norm summation order), one warp per two heads sliding the conv window down a strip of
// tokens (16-byte loads, each input row read once). Needs 16-byte aligned proj / ring rows and
// qkv. strip: tokens per warp, a multiple of 8; <= 0: gdn_conv_prep_stream_strip(n_tokens).
// form: kStream (default) as above, a warp per two heads (8 channels per lane, 16-byte loads);
// kHead (session 25) a warp per head (4 channels per lane, 8-byte loads: fewer registers, more
// warps per SM), the same maths but the l2norm's sum of squares over 4 channels per lane, then 32
// lanes, so q / k may differ from kStream's in the last bf16 bit (v, g, beta bit-identical).
// kDefault: $DS_GDN_CONV = stream / head, read at the first call (anything else throws);
// set_gdn_conv_form overrides it (tests).
enum class GdnConvForm { kStream, kHead, kDefault };
GdnConvForm gdn_conv_form();
GdnConvForm parse_gdn_conv_form(const char* value);  // null / "" = kStream; throws on a bad value
void set_gdn_conv_form(GdnConvForm form);
bool gdn_conv_prep_stream_supported(const GdnShape& s, const GdnLayerWeights& w,
                                    const GdnStatePool& pool, const bf16* proj);
int gdn_conv_prep_stream_strip(int n_tokens);
void launch_gdn_conv_prep_stream(const GdnShape& s, const GdnLayerWeights& w,
                                 const GdnStatePool& pool,
                                 const bf16* proj,  // [n_tokens, in_dim]
                                 const int32_t* cu_seqlens, const int32_t* seq_pos,
                                 const int32_t* slot_ids, int n_seqs, int n_tokens,
                                 bf16* qkv,    // [n_tokens, qkv_dim]
                                 float* g,     // [n_tokens, n_v_heads]
                                 float* beta,  // [n_tokens, n_v_heads]
                                 cudaStream_t stream, int strip = 0,
                                 GdnConvForm form = GdnConvForm::kDefault);

// The WY stage (gamma = in-chunk cumsum of g written back into g, W = T (beta e^gamma K),
// U = T (beta V)) for d_k = d_v = 128 with register-resident mma.sync products; the same maths as
// the generic gdn_wy_kernel (tf32_offdiag: T's off-diagonal 16x16 blocks on tf32 mma.sync per
// column block, no block barriers between them, instead of three SIMT rounds). chunks: the chunk
// map of gdn_prefill.cu ({sequence or -1, first token, valid rows, index in the sequence} per
// chunk).
void launch_gdn_wy_mma(const GdnShape& s, const int4* chunks, int max_chunks,
                       const bf16* qkv,    // [n_tokens, qkv_dim]
                       float* g,           // [n_tokens, n_v_heads] in: g, out: gamma
                       const float* beta,  // [n_tokens, n_v_heads]
                       bf16* w_mat,        // [n_tokens, n_v_heads, 128]
                       bf16* u_mat,        // [n_tokens, n_v_heads, 128]
                       cudaStream_t stream,
                       bool tf32_offdiag = false,  // T's off-diagonal blocks on tf32 mma.sync
                       int balanced = -1);  // tf32_offdiag only: 1 = the work spread evenly
                                            // over the warps (bit-identical), 2 = that with V
                                            // loaded late into A's space (56 KB of shared
                                            // memory: 4 blocks per SM instead of 3;
                                            // bit-identical); < 0: gdn_wy_mma_balanced() and
                                            // gdn_wy_mma_late_v()
// The shipped WY build (tf32 off-diagonal, balanced, late V) with phase stamps (tests: where one
// item's latency goes, docs/perf/gdn_prefill.md, session 31): the same outputs bit for bit, and
// per block (blockIdx.y * max_chunks + blockIdx.x) kGdnWyStamps values in `stamps` (zero it
// first: blocks of empty chunk entries write none): [0] %clock64 at entry, [1] after the K /
// gate loads, [2] after A and T's diagonal blocks, [3] after T complete, [4..7] each warp's end
// (its last W / U store issued), [8] / [9] %globaltimer (ns) at thread 0's entry / end.
constexpr int kGdnWyStamps = 10;
void launch_gdn_wy_mma_timed(const GdnShape& s, const int4* chunks, int max_chunks,
                             const bf16* qkv, float* g, const float* beta, bf16* w_mat,
                             bf16* u_mat, unsigned long long* stamps, cudaStream_t stream);
// The WY kernel's balanced warp split (launch_gdn_wy_mma's balanced < 0): on unless
// $DS_GDN_WY_BALANCED is 0 (read once per process).
bool gdn_wy_mma_balanced();
// Its late V load (balanced = 2): on unless $DS_GDN_WY_LATE_V is 0 (read once per process).
bool gdn_wy_mma_late_v();

// gdn_prefill_slice.cu: the state pass split over slices of value columns per CTA (sequential
// over chunks; writes the bf16 snapshot h_c of every chunk into h_snap, V_new over
// U, the final state into the slot, read first when seq_pos > 0), then the output O = e^gamma
// (Q h_c) + causal(Q K^T e^(gamma_i - gamma_j)) V_new and the gated RMSNorm, one CTA per (chunk,
// head). Reads the outputs of conv_prep (qkv) and of the WY kernel (gamma = in-chunk cumsum of g,
// W = T (beta e^gamma K), U = T (beta V)) and the chunk map of gdn_prefill.cu. Needs d_k = d_v =
// 128 and 16-byte aligned proj rows (z is staged with cp.async), qkv, W, U and h_snap.
// The state-pass kernel: 64-column slices (4 warps x 16 rows); kV64Lean: the same with U / V_new
// as ldmatrix / stmatrix .trans fragments and the snapshot staged for 16-byte stores
// (bit-identical results, fewer instructions per chunk step). (32-column slices, slower at every
// size, were removed in issue 7 round 3.) kWgmma: kV64Lean's chunk step with its two products on
// warpgroup MMAs (one warpgroup per 64-column slice; same operand precision, the tensor cores'
// summation order).
enum class GdnSliceState { kV64, kV64Lean, kWgmma };
bool gdn_slice_supported(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                         const bf16* proj, const bf16* out);
void launch_gdn_slice_scan(const GdnShape& s, const GdnLayerWeights& w, const GdnStatePool& pool,
                           const bf16* proj,           // [n_tokens, in_dim] (z)
                           const int32_t* cu_seqlens,  // [n_seqs + 1]
                           const int32_t* seq_pos,     // [n_seqs]
                           const int32_t* slot_ids,    // [n_seqs]
                           int n_seqs,
                           const int4* chunks,     // [max_chunks] {seq or -1, t0, n, index}
                           const int* seq_chunk0,  // [n_seqs + 1] first chunk of each sequence
                           int max_chunks,
                           const bf16* qkv,     // [n_tokens, qkv_dim] conv + SiLU, q/k normed
                           const float* gamma,  // [n_tokens, n_v_heads] in-chunk cumsum of g
                           const bf16* w_mat,   // [n_tokens, n_v_heads, 128]
                           bf16* u_mat,         // [n_tokens, n_v_heads, 128] in U, out V_new
                           bf16* h_snap,        // [max_chunks, n_v_heads, 128 v, 128 k]
                           bf16* out,           // [n_tokens, n_v_heads * 128]
                           GdnSliceState state,
                           int out_warps,  // output CTA: 4 warps (16 rows x 128 columns each) or
                                           // 8 (16 rows x 64 columns, row sums shared per pair)
                           cudaStream_t stream,
                           int stages = 3,  // 1: the state pass only, 2: the output only (timing)
                           // slice_scan_ov: non-null = the output kernel runs beside the state
                           // pass (programmatic dependent launch), each CTA waiting until its
                           // chunk's flag counts every slice; [max_chunks, n_v_heads] ints, zero
                           // on entry (the caller clears them; left at the slice count). Needs
                           // any state kernel, out_warps 8, stages 3 (or 2: the output alone,
                           // after flags completed by an earlier launch; timing). Outputs
                           // bit-identical to null.
                           int* ready = nullptr,
                           // the rows of qkv / gamma / W / U (kWgmma's TMA maps; needs
                           // gdn_slice_wg_supported)
                           int n_tokens = 0);
// The output kernel slice_scan_wg runs beside its wgmma state pass: kWgmma (default) one
// warpgroup per (chunk, head) on warpgroup MMAs in 64 KB of shared memory; kTma the 8-warp
// mma.sync kernel fed by TMA; kCpAsync the same fed by cp.async (slice_scan_ov's). Bit-identical
// outputs. $DS_GDN_OUT = wg / tma / cp, read at the first call (anything else throws);
// set_gdn_out_form overrides it (tests).
enum class GdnOutForm { kWgmma, kTma, kCpAsync };
GdnOutForm gdn_out_form();
GdnOutForm parse_gdn_out_form(const char* value);  // null / "" = kWgmma; throws on a bad value
void set_gdn_out_form(GdnOutForm form);
// The wgmma state pass's chunk step (kWgmma): kWg (default) as measured; kTight the same
// operations with fewer instructions on the chain (gamma by ld.shared, the next chunk's wait and
// decay factors and the previous chunk's publication under the update, U - S packed to bf16 pairs,
// full chunks without the per-row test), bit-identical by construction, not yet measured
// (session 22). kFused (session 24, built without a device, not yet measured): the tight pass
// with slice_scan_wg's output computed in the same kernel (gdn_state_out_fused_kernel: a second
// warpgroup per state CTA, the snapshots and V_new handed over in shared memory instead of
// global memory, the two slices of a head a cluster of 2 for the gated norm's row sums);
// bit-identical by construction; it replaces the overlapped pair (stages 3 with ready flags),
// and a stage launched alone runs the tight pass. kFused2: the same with two output warpgroups
// taking alternate chunks (registers moved to the chain by setmaxnreg), in case one output
// warpgroup cannot keep pace with the chain. $DS_GDN_STATE = wg / tight / fused / fused2, read at
// the first call (anything else throws); set_gdn_state_form overrides it (tests).
// kFused2Wg ($DS_GDN_STATE=fused2w): fused2 with the shipped (kWg) chain step instead of the tight
// one, which session 24 measured slower alone.
enum class GdnStateForm { kWg, kTight, kFused, kFused2, kFused2Wg };
GdnStateForm gdn_state_form();
GdnStateForm parse_gdn_state_form(const char* value);  // null / "" = kWg; throws on a bad value
void set_gdn_state_form(GdnStateForm form);
// Whether kWgmma can run: d_k = d_v = 128, n_v_heads % 4 == 0 (gamma's [64, 4] box), gamma 16-byte
// aligned, n_tokens > 0 and fewer than 2^31 snapshot rows.
bool gdn_slice_wg_supported(const GdnShape& s, int n_tokens, int max_chunks, const float* gamma);

}  // namespace ds::cuda
