// bf16 GEMMs of the engine through cuBLASLt: y[m, n] = x[m, k] * w[n, k]^T (+ y when accumulate),
// bf16 inputs, fp32 accumulation, bf16 or fp32 output. x and y are row-major activations (m =
// tokens), w is a row-major [out, in] weight, the layout of every checkpoint matrix.
// Each distinct shape (m, n, k, output type, accumulate) gets its descriptors, layouts and
// algorithm once (prepare(), at start-up or at plan time) and reuses them on every call; the
// workspace is allocated once. run() on a shape never prepared prepares it on the spot and
// counts it in late_plans() (host work only, no device synchronisation, so still graph-safe).
// With a dispatch registry set, run() sends the shapes that the registry's "gemm.gemv_bulk" guard
// accepts (decode m <= 4, k <= 8192) to the bulk-copy GEMV and those its "gemm.skinny_mma" guard
// accepts (decode: m <= 16, k >= 12288, see gemv.h) to the skinny tensor-core kernel, and those
// its "gemm.gemv_narrow" guard accepts (the MLP down projection at m 1..2) to the narrow-output
// bulk-copy GEMV, when x and w are 16-byte aligned; everything else goes to cuBLASLt.
// tune() replaces a plan's heuristic algorithm by the fastest of cuBLASLt's top candidates, timed
// on the caller's real buffers (CUDA events, median per call over batches that rotate over several
// distinct weight matrices, so L2 does not flatter small matrices). $DS_GEMM_TUNE=0, a failure or
// a stream under capture keep the heuristic's first choice. Tune before any graph is captured: a
// graph keeps the algorithm it captured. Choices are cached per process (device, shape) so that
// every engine of a process runs the same algorithm on a shape.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace ds::cuda {

class DispatchRegistry;  // dispatch.h

enum class GemmOut : uint8_t { kBF16, kF32 };

struct GemmTuneOptions {
  int max_candidates = 12;  // heuristic candidates asked for (1: only the heuristic's first)
  int max_weights = 4;      // distinct weight matrices rotated per timed batch (<= weights given)
  int batches = 5;          // timed batches; the median time per call is kept
  double min_gain = 0.01;   // another algorithm replaces the heuristic's only if this much faster
  // Also try the algorithms these m's (same n, k, out, accumulate) were tuned to, when
  // cublasLtMatmulAlgoCheck accepts them for this m.
  std::vector<int> borrow_m;
  // Reuse the choice an earlier tune() in this process made for the same device and shape (any
  // engine): engines of one process then run the same algorithms, so their results stay
  // bit-identical to each other (tests compare two engines bit for bit), and start-up is cheaper.
  bool use_process_cache = true;
  // Sustained timing (window_ms > 0): the card is first kept busy with the heuristic's algorithm
  // for window_ms; then, for `rounds` rounds (candidate order rotated each round), every candidate
  // runs back to back for about window_ms and is timed over the second half of its window. Under
  // the card's power cap the clock settles to each algorithm's own power draw within a window, so
  // this ranks algorithms by their speed in a long prompt, where every GEMM runs at the cap (a
  // short burst on a cool card ranks them at the unthrottled clock). Per call: the median over
  // rounds. batches is unused then.
  double window_ms = 0;
  int rounds = 2;
};

struct GemmTuneResult {
  int m = 0, n = 0, k = 0;
  GemmOut out = GemmOut::kBF16;
  bool accumulate = false;
  bool timed = false;             // candidates were timed (false: heuristic kept, see note)
  int candidates = 0;             // algorithms offered (the heuristic's first included)
  int ran = 0;                    // of which ran and were timed
  int chosen = 0;                 // index of the kept algorithm; 0 = the heuristic's first
  bool borrowed = false;          // the kept algorithm came from borrow_m
  double heuristic_us = 0;        // median per call of the heuristic's first (0 when not timed)
  double chosen_us = 0;           // of the kept one
  bool cached = false;            // taken from the process cache (the times are that tune's)
  double tune_ms = 0;             // host wall time of this tune() call
  bool sustained = false;         // timed in windows (GemmTuneOptions::window_ms)
  std::vector<double> cand_us;    // per candidate (index as chosen), -1 when it did not run;
                                  // filled only when timed
  std::vector<std::string> cand_desc;  // each candidate's cuBLASLt configuration (algo_desc)
  std::string note;               // why nothing was timed, or a failure message
  std::string to_string() const;  // one line
};

class GemmEngine {
 public:
  // Creates the cuBLASLt handle and a workspace of `workspace_bytes` on the current device.
  explicit GemmEngine(size_t workspace_bytes = size_t(64) << 20);
  ~GemmEngine();
  GemmEngine(const GemmEngine&) = delete;
  GemmEngine& operator=(const GemmEngine&) = delete;

  // Picks the algorithm for this shape (cuBLASLt heuristic) and keeps it. Throws ds::Error when
  // cuBLASLt has no algorithm for it.
  void prepare(int m, int n, int k, GemmOut out, bool accumulate = false);

  // Times the heuristic's top candidates for this shape (preparing it first) and keeps the fastest
  // in the plan. x [m, k] and y [m, n] are the caller's buffers: x is overwritten with
  // pseudo-random bf16 values (timing on zeros flatters), y with results. weights: one or more
  // distinct [n, k] matrices of this shape (e.g. the same projection of different layers). Blocks
  // until the timing is done. Never throws for timing trouble (keeps the heuristic, says why in
  // note); throws ds::Error for a bad shape or arguments, like prepare().
  GemmTuneResult tune(int m, int n, int k, GemmOut out,
                      const std::vector<const __nv_bfloat16*>& weights,  // each [n, k]
                      __nv_bfloat16* x,                                  // [m, k] (overwritten)
                      void* y,                                           // [m, n] (overwritten)
                      cudaStream_t stream, bool accumulate = false,
                      const GemmTuneOptions& opt = {});
  // False when $DS_GEMM_TUNE is "0" (tune() then keeps the heuristic's first choice).
  static bool tuning_enabled();
  // Whether the planned shape runs the heuristic's first algorithm (false: tuned to another).
  // Throws ds::Error when the shape has no plan.
  bool uses_heuristic_algo(int m, int n, int k, GemmOut out, bool accumulate = false) const;

  // pdl false: the decode GEMV kernels launch without the programmatic attribute even where
  // $DS_GEMV_PDL has it on (the same kernel and bits; cuBLASLt never takes it).
  void run(const __nv_bfloat16* x,  // [m, k]
           const __nv_bfloat16* w,  // [n, k]
           void* y,                 // [m, n] bf16 or fp32
           int m, int n, int k, GemmOut out, cudaStream_t stream, bool accumulate = false,
           bool pdl = true);

  // act[m, d_ff] = bf16(silu(g) * u) for the fused [gate | up] weight [2 d_ff, k] in one launch
  // (gemv.h launch_gemv_bulk_silu) when the registry picks "gemm.gemv_bulk_silu" for the key
  // (m, 2 d_ff, k, 1) and x / w are 16-byte aligned; returns false without launching anything
  // otherwise (the caller then runs run() on [gate | up] and launch_silu_mul: the same bits).
  bool run_gate_up_silu(const __nv_bfloat16* x,          // [m, k]
                        const __nv_bfloat16* w_gate_up,  // [2 d_ff, k]
                        __nv_bfloat16* act,              // [m, d_ff]
                        int m, int d_ff, int k, cudaStream_t stream);

  // y = x w^T in fp32 (the logits) and tokens[t] = the greedy token of row t in one launch
  // (gemv.h launch_gemv_bulk_argmax) when run() would take the bulk GEMV for (m, n, k)
  // ("gemv_bulk" / "gemv_bulk_pdl"), its config has one partial sum per lane and
  // gemv_bulk_argmax_supports it, x / w 16-byte aligned; y then holds run()'s bits. Returns false
  // without launching anything otherwise (the caller then runs run() and launch_argmax_rows: the
  // same logits and tokens). workspace: kGemvBulkArgmaxWorkspaceBytes, zeroed once, one stream.
  bool run_head_argmax(const __nv_bfloat16* x,  // [m, k]
                       const __nv_bfloat16* w,  // [n, k]
                       float* y,                // [m, n]
                       int32_t* tokens,         // [m]
                       void* workspace, int m, int n, int k, cudaStream_t stream);

  // Specialised kernels (e.g. decode GEMVs) are picked through this registry when set; null or
  // unset: cuBLASLt for every shape. The registry must outlive the engine.
  void set_dispatch(const DispatchRegistry* dispatch) { dispatch_ = dispatch; }
  // KiB of each block's next weight stages the decode GEMVs queue for L2 after their wait:
  // `kib` for the bulk ones (gemv_bulk, gemv_bulk_pdl, gemv_bulk_silu at m <= kGemvAheadMaxM, bf16
  // out; GemvBulkConfig::l2_ahead, gemv.h) and the narrow one (gemv_narrow, the same m and out),
  // `tma_kib` for the TMA ones (gemv_tma, gemv_tma_silu at kbox 1, bf16 out;
  // GemvTmaConfig::l2_ahead); 0 (the default here): none. The engine sets them from
  // $DS_GEMV_AHEAD and $DS_GEMV_TMA_AHEAD. The outputs are the same bits either way.
  void set_l2_ahead_kib(int kib, int tma_kib) {
    l2_ahead_kib_ = kib;
    tma_ahead_kib_ = tma_kib;
  }
  int l2_ahead_kib() const { return l2_ahead_kib_; }

  // The variant run() takes for this shape with 16-byte aligned x and w: "gemv_bulk",
  // "gemv_narrow", "skinny_mma" or "cublaslt" (a name owned by the registry: no copy per call on
  // the launch path).
  const std::string& variant(int m, int n, int k) const;

  int n_plans() const { return static_cast<int>(plans_.size()); }
  int late_plans() const { return late_plans_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  std::string describe() const;  // one line per planned shape (with its tuning result)

 private:
  struct Plan;
  using Key = std::tuple<int, int, int, int, bool>;
  Plan& get(int m, int n, int k, GemmOut out, bool accumulate, bool late);

  void* handle_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  void* splitk_ws_ = nullptr;  // gemv_splitk's partials and counters ($DS_GEMV_SPLITK=1 only)
  std::map<Key, std::unique_ptr<Plan>> plans_;
  int late_plans_ = 0;
  const DispatchRegistry* dispatch_ = nullptr;
  int n_sms_ = 0;  // of the current device at construction (skinny kernel config)
  // gemv_pdl_mode() ($DS_GEMV_PDL, gemv.h): kBulk / kAll: the bulk GEMVs (gemv_bulk,
  // gemv_bulk_pdl, gemv_bulk_silu) launch with programmatic dependent launch (weight copies start
  // while the previous kernel runs; x is read after griddepcontrol.wait); kAll: skinny_mma (the
  // MLP down projection) too. Default kBulk: with the early triggers before the GEMVs and the PDL
  // add_rmsnorm, 13.572 vs 13.698 ms per token (27B decode graph, batch 1 at 4K; kAll 17.645).
  bool bulk_pdl_ = false;
  bool skinny_pdl_ = false;
  int l2_ahead_kib_ = 0;
  int tma_ahead_kib_ = 0;
};

}  // namespace ds::cuda
