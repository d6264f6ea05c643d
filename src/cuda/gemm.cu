// cuBLASLt GEMM plans (see gemm.h). Row-major y[m, n] = x[m, k] w[n, k]^T is computed as the
// column-major y^T[n, m] = w[n, k] x^T: A = w (stored k x n column-major, op T), B = x (stored
// k x m, op N), D = y^T (n x m, ld n): the "TN" layout cuBLASLt is fastest at.
// tune(): candidates from cublasLtMatmulAlgoGetHeuristic (top N) and borrowed plans, each timed
// with CUDA events behind a short spin kernel (so the host queues ahead of the device).
#include <cublasLt.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

#include "cuda/cuda_common.h"
#include "cuda/dispatch.h"
#include "cuda/gemm.h"
#include "cuda/gemv.h"

namespace ds::cuda {

#define DS_CUBLAS_CHECK(call)                                                                 \
  do {                                                                                        \
    cublasStatus_t st_ = (call);                                                              \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                         \
      ds::throw_error("cuBLASLt error ", cublasLtGetStatusString(st_), " in ", #call, " at ", \
                      __FILE__, ":", __LINE__);                                               \
  } while (0)

struct GemmEngine::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t ws = 0;
  cublasLtMatmulAlgo_t heuristic{};  // the heuristic's first choice (algo unless tuned)
  size_t heuristic_ws = 0;
  std::string tune_note;  // the last tune() result, for describe()
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

GemmEngine::GemmEngine(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  // $DS_GEMV_PDL first: a bad value throws before anything is allocated (no handle to leak).
  const GemvPdl pdl = gemv_pdl_mode();
  const bool splitk = gemv_splitk_enabled();
  (void)gemv_tma_mode();  // $DS_GEMV_TMA: a bad value throws here, not in a step
  (void)gemv_tma_narrow_mode();
  cublasLtHandle_t h = nullptr;
  DS_CUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
  if (workspace_bytes_ > 0) DS_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  int dev = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms_, cudaDevAttrMultiProcessorCount, dev));
  bulk_pdl_ = pdl != GemvPdl::kOff;
  skinny_pdl_ = pdl == GemvPdl::kAll;
  if (splitk) {  // zero-filled once: every launch leaves its counters at zero
    DS_CUDA_CHECK(cudaMalloc(&splitk_ws_, gemv_splitk_workspace_bytes()));
    DS_CUDA_CHECK(cudaMemset(splitk_ws_, 0, gemv_splitk_workspace_bytes()));
    DS_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

GemmEngine::~GemmEngine() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (splitk_ws_) cudaFree(splitk_ws_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

GemmEngine::Plan& GemmEngine::get(int m, int n, int k, GemmOut out, bool accumulate, bool late) {
  const Key key{m, n, k, static_cast<int>(out), accumulate};
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  DS_CHECK(m > 0 && n > 0 && k > 0, "gemm: bad shape m=", m, " n=", n, " k=", k);
  if (late) ++late_plans_;
  auto p = std::make_unique<Plan>();
  const cudaDataType_t out_t = out == GemmOut::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
  DS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  DS_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  DS_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, k, n, k));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, k, m, k));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, out_t, n, m, n));
  cublasLtMatmulPreference_t pref = nullptr;
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t res{};
  int n_res = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), p->desc, p->a, p->b,
                                     p->c, p->c, pref, 1, &res, &n_res);
  cublasLtMatmulPreferenceDestroy(pref);
  DS_CHECK(st == CUBLAS_STATUS_SUCCESS && n_res > 0, "gemm: cuBLASLt has no algorithm for m=", m,
           " n=", n, " k=", k, " (", cublasLtGetStatusString(st), ")");
  p->algo = p->heuristic = res.algo;
  p->ws = p->heuristic_ws = res.workspaceSize;
  auto& ref = *p;
  plans_.emplace(key, std::move(p));
  return ref;
}

void GemmEngine::prepare(int m, int n, int k, GemmOut out, bool accumulate) {
  get(m, n, k, out, accumulate, false);
}

void GemmEngine::run(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n, int k,
                     GemmOut out, cudaStream_t stream, bool accumulate, bool pdl) {
  if (m <= 0) return;
  const bool bulk_pdl = bulk_pdl_ && pdl;
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
  const std::string& v = variant(m, n, k);
  if (aligned && !accumulate && v == "gemv_tma_narrow" &&
      gemv_tma_narrow_supports(m, n, k, n_sms_)) {
    GemvTmaNarrowConfig c = gemv_tma_narrow_config(m, n, k);
    c.pdl = bulk_pdl;
    launch_gemv_tma_narrow(x, w, y, m, n, k, out, c, n_sms_, stream);
    return;
  }
  if (aligned && (v == "gemv_bulk" || v == "gemv_bulk_pdl")) {
    GemvBulkConfig c = gemv_bulk_config(m, n, k);
    c.pdl = bulk_pdl;
    if (m <= kGemvAheadMaxM && out == GemmOut::kBF16)
      c.l2_ahead = gemv_bulk_ahead_stages(l2_ahead_kib_, k, c, false);
    launch_gemv_bulk(x, w, y, m, n, k, out, accumulate, c, n_sms_, stream);
    return;
  }
  if (aligned && v == "gemv_narrow" && gemv_narrow_supports(m, n, k, n_sms_)) {
    GemvNarrowConfig c = gemv_narrow_config(m, n, k, n_sms_);
    c.pdl = bulk_pdl;
    if (m <= kGemvAheadMaxM && out == GemmOut::kBF16)
      c.l2_ahead = gemv_narrow_ahead_stages(l2_ahead_kib_, k);
    launch_gemv_narrow(x, w, y, m, n, k, out, accumulate, c, n_sms_, stream);
    return;
  }
  // gemv_tma ($DS_GEMV_TMA=1 only): no accumulate (cuBLASLt takes y +=); the guard's grid is
  // re-checked against this device's.
  if (aligned && !accumulate && v == "gemv_tma" && gemv_tma_supports(m, n, k, false, n_sms_)) {
    GemvTmaConfig c = gemv_tma_config(m, n, k, false);
    while (c.kbox > 1 && !gemv_tma_fits(m, n, k, false, c, n_sms_)) c.kbox /= 2;  // this device
    c.pdl = bulk_pdl;
    if (out == GemmOut::kBF16) c.l2_ahead = gemv_tma_ahead_stages(tma_ahead_kib_, n, false, c, n_sms_);
    launch_gemv_tma(x, w, y, m, n, k, out, c, n_sms_, stream);
    return;
  }
  // gemv_bulk_mma ($DS_GEMV_MMA=1 only): no accumulate (cuBLASLt takes y +=), and the grid the
  // guard assumed may be larger than this device's (re-checked here).
  if (aligned && !accumulate && v == "gemv_bulk_mma" && gemv_bulk_mma_supports(m, n, k, n_sms_)) {
    GemvBulkMmaConfig c = gemv_bulk_mma_config(m, n, k);
    c.pdl = bulk_pdl;
    launch_gemv_bulk_mma(x, w, y, m, n, k, out, false, c, n_sms_, stream);
    return;
  }
  // gemv_splitk_mma ($DS_GEMV_SPLITK=1 only): no accumulate (cuBLASLt takes y +=).
  if (aligned && !accumulate && v == "gemv_splitk_mma" && splitk_ws_ &&
      gemv_splitk_supports(m, n, k)) {
    launch_gemv_splitk(x, w, y, m, n, k, out, false, splitk_ws_, stream, n_sms_, bulk_pdl_);
    return;
  }
  if (aligned && v == "skinny_mma") {
    SkinnyConfig c = skinny_gemm_config(m, n, k, n_sms_);
    c.pdl = skinny_pdl_;
    launch_skinny_gemm(x, w, y, m, n, k, out, accumulate, c, stream);
    return;
  }
  Plan& p = get(m, n, k, out, accumulate, true);
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  DS_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.desc, &alpha, w, p.a, x,
                                 p.b, &beta, y, p.c, y, p.c, &p.algo, workspace_, workspace_bytes_,
                                 stream));
}

bool GemmEngine::run_gate_up_silu(const __nv_bfloat16* x, const __nv_bfloat16* w_gate_up,
                                  __nv_bfloat16* act, int m, int d_ff, int k,
                                  cudaStream_t stream) {
  if (!dispatch_ || m <= 0) return false;
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w_gate_up)) & 15) == 0;
  if (!aligned) return false;
  const std::string& v =
      dispatch_->select(KernelFamily::kGemm, dispatch_->key(m, 2 * int64_t(d_ff), k, 1)).name;
  if (v == "gemv_tma_silu" && gemv_tma_supports(m, d_ff, k, true, n_sms_)) {
    GemvTmaConfig c = gemv_tma_config(m, d_ff, k, true);
    while (c.kbox > 1 && !gemv_tma_fits(m, d_ff, k, true, c, n_sms_)) c.kbox /= 2;
    c.pdl = bulk_pdl_;
    c.l2_ahead = gemv_tma_ahead_stages(tma_ahead_kib_, d_ff, true, c, n_sms_);
    launch_gemv_tma_silu(x, w_gate_up, act, m, d_ff, k, c, n_sms_, stream);
    return true;
  }
  if (v != "gemv_bulk_silu") return false;
  GemvBulkConfig c = gemv_bulk_silu_config(m, d_ff, k);
  c.pdl = bulk_pdl_;
  if (m <= kGemvAheadMaxM) c.l2_ahead = gemv_bulk_ahead_stages(l2_ahead_kib_, k, c, true);
  launch_gemv_bulk_silu(x, w_gate_up, act, m, d_ff, k, c, n_sms_, stream);
  return true;
}

bool GemmEngine::run_head_argmax(const __nv_bfloat16* x, const __nv_bfloat16* w, float* y,
                                 int32_t* tokens, void* workspace, int m, int n, int k,
                                 cudaStream_t stream) {
  if (!dispatch_ || m <= 0) return false;
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
  const std::string& v = variant(m, n, k);
  if (!aligned || (v != "gemv_bulk" && v != "gemv_bulk_pdl")) return false;
  GemvBulkConfig c = gemv_bulk_config(m, n, k);
  c.pdl = bulk_pdl_;
  if (!gemv_bulk_argmax_supports(m, n, k, c)) return false;
  launch_gemv_bulk_argmax(x, w, y, tokens, workspace, m, n, k, c, n_sms_, stream);
  return true;
}

const std::string& GemmEngine::variant(int m, int n, int k) const {
  static const std::string kCublasLt = "cublaslt";
  if (!dispatch_) return kCublasLt;
  return dispatch_->select(KernelFamily::kGemm, dispatch_->key(m, n, k)).name;
}

namespace {

bool same_algo(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
  return std::memcmp(a.data, b.data, sizeof a.data) == 0;
}

// Keeps the device busy for `ns` nanoseconds so that the host queues the timed calls ahead of it
// (the events then measure device time, not launch latency).
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// x[i] = a hash of i mapped to a bf16 in [-1, 1): deterministic, never all zeros.
__global__ void fill_tune_input_kernel(__nv_bfloat16* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2bfloat16(static_cast<float>(h >> 8) * (2.f / 16777216.f) - 1.f);
  }
}

// Events owned for one tune() call.
struct EventSet {
  std::vector<cudaEvent_t> ev;
  explicit EventSet(int n) {
    for (int i = 0; i < n; ++i) {
      cudaEvent_t e = nullptr;
      DS_CUDA_CHECK(cudaEventCreate(&e));
      ev.push_back(e);
    }
  }
  ~EventSet() {
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
  }
};

struct TuneCandidate {
  cublasLtMatmulAlgo_t algo;
  size_t ws;
  bool borrowed;
};

// Tuning choices of this process: (device, m, n, k, out, accumulate) -> the kept algorithm and
// the result that chose it.
struct TuneCacheEntry {
  cublasLtMatmulAlgo_t algo;
  size_t ws;
  GemmTuneResult result;
};
using TuneCacheKey = std::tuple<int, int, int, int, int, bool>;
std::mutex g_tune_cache_mutex;
std::map<TuneCacheKey, TuneCacheEntry> g_tune_cache;

const char* out_name(GemmOut out) { return out == GemmOut::kBF16 ? "bf16" : "f32"; }

// cuBLASLt's configuration of an algorithm as its raw enum values (cublasLt.h:
// cublasLtMatmulTile_t, cublasLtMatmulStages_t, cublasLtClusterShape_t), e.g. "id 66 tile 23
// stages 35 cluster 2 splitk 1 swizzle 0 custom 0": enough to tell candidates apart in logs.
std::string algo_desc(const cublasLtMatmulAlgo_t& a) {
  int32_t id = -1, splitk = 0;
  uint32_t tile = 0, stages = 0, swizzle = 0, custom = 0;
  uint16_t cluster = 0;
  size_t got = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages,
                                       &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster,
                                       sizeof cluster, &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk,
                                       &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle,
                                       sizeof swizzle, &got);
  cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom,
                                       sizeof custom, &got);
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "id %d tile %u stages %u cluster %u splitk %d swizzle %u custom %u", id, tile,
                stages, unsigned(cluster), splitk, swizzle, custom);
  return buf;
}

}  // namespace

bool GemmEngine::tuning_enabled() {
  const char* env = std::getenv("DS_GEMM_TUNE");
  return env == nullptr || std::string(env) != "0";
}

bool GemmEngine::uses_heuristic_algo(int m, int n, int k, GemmOut out, bool accumulate) const {
  auto it = plans_.find(Key{m, n, k, static_cast<int>(out), accumulate});
  DS_CHECK(it != plans_.end(), "gemm: no plan for m=", m, " n=", n, " k=", k, " ", out_name(out));
  return same_algo(it->second->algo, it->second->heuristic);
}

std::string GemmTuneResult::to_string() const {
  char buf[320];
  if (!timed) {
    std::snprintf(buf, sizeof buf, "gemm tune m=%d n=%d k=%d %s%s: heuristic kept (%s)", m, n, k,
                  out_name(out), accumulate ? " +=" : "", note.c_str());
  } else {
    const double gain = heuristic_us > 0 ? 100.0 * (heuristic_us - chosen_us) / heuristic_us : 0;
    std::snprintf(buf, sizeof buf,
                  "gemm tune m=%d n=%d k=%d %s%s: heuristic %.2f us -> %s #%d %.2f us (%+.1f%%), "
                  "%d of %d candidates timed%s, %.0f ms%s",
                  m, n, k, out_name(out), accumulate ? " +=" : "", heuristic_us,
                  chosen == 0 ? "kept" : (borrowed ? "borrowed" : "candidate"), chosen, chosen_us,
                  -gain, ran, candidates, sustained ? " sustained" : "", tune_ms,
                  cached ? " (cached: this process tuned it before)" : "");
  }
  return buf;
}

GemmTuneResult GemmEngine::tune(int m, int n, int k, GemmOut out,
                                const std::vector<const __nv_bfloat16*>& weights, __nv_bfloat16* x,
                                void* y, cudaStream_t stream, bool accumulate,
                                const GemmTuneOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  GemmTuneResult r;
  r.m = m, r.n = n, r.k = k, r.out = out, r.accumulate = accumulate;
  Plan& p = get(m, n, k, out, accumulate, false);
  DS_CHECK(!weights.empty(), "gemm tune: no weight matrix given for m=", m, " n=", n, " k=", k);
  for (const __nv_bfloat16* w : weights)
    DS_CHECK(w != nullptr, "gemm tune: null weight matrix for m=", m, " n=", n, " k=", k);
  DS_CHECK(x != nullptr && y != nullptr, "gemm tune: null x or y for m=", m, " n=", n, " k=", k);
  auto finish = [&](const std::string& note) {
    r.note = note;
    r.tune_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    p.tune_note =
        r.timed ? r.to_string().substr(r.to_string().find(": ") + 2) : "heuristic kept: " + note;
    return r;
  };
  // Candidate 0 is always the heuristic's first choice (the plan's fallback).
  std::vector<TuneCandidate> cands{{p.heuristic, p.heuristic_ws, false}};
  auto known = [&](const cublasLtMatmulAlgo_t& a) {
    for (const TuneCandidate& c : cands)
      if (same_algo(c.algo, a)) return true;
    return false;
  };
  auto h = static_cast<cublasLtHandle_t>(handle_);
  if (!tuning_enabled()) {
    p.algo = p.heuristic, p.ws = p.heuristic_ws;
    r.candidates = 1;
    return finish("DS_GEMM_TUNE=0");
  }
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cap) != cudaSuccess || cap != cudaStreamCaptureStatusNone) {
    r.candidates = 1;
    return finish("stream is capturing a graph");
  }
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  const TuneCacheKey cache_key{device, m, n, k, static_cast<int>(out), accumulate};
  if (opt.use_process_cache) {
    std::lock_guard<std::mutex> lock(g_tune_cache_mutex);
    auto it = g_tune_cache.find(cache_key);
    cublasLtMatmulHeuristicResult_t chk{};
    if (it != g_tune_cache.end() && it->second.ws <= workspace_bytes_ &&
        cublasLtMatmulAlgoCheck(h, p.desc, p.a, p.b, p.c, p.c, &it->second.algo, &chk) ==
            CUBLAS_STATUS_SUCCESS &&
        chk.state == CUBLAS_STATUS_SUCCESS && chk.workspaceSize <= workspace_bytes_) {
      p.algo = it->second.algo;
      p.ws = chk.workspaceSize;
      r = it->second.result;
      r.cached = true;
      return finish("reused this process's earlier choice");
    }
  }
  const int n_req = std::clamp(opt.max_candidates, 1, 64);
  if (n_req > 1) {
    cublasLtMatmulPreference_t pref = nullptr;
    if (cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS) {
      // (a fixed array: nvcc 13.0's front end crashes on a std::vector of this type)
      cublasLtMatmulHeuristicResult_t res[64] = {};
      int n_res = 0;
      if (cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &workspace_bytes_,
                                               sizeof(workspace_bytes_)) == CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoGetHeuristic(h, p.desc, p.a, p.b, p.c, p.c, pref, n_req, res, &n_res) ==
              CUBLAS_STATUS_SUCCESS) {
        for (int i = 0; i < n_res; ++i)
          if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= workspace_bytes_ &&
              !known(res[i].algo))
            cands.push_back({res[i].algo, res[i].workspaceSize, false});
      }
      cublasLtMatmulPreferenceDestroy(pref);
    }
  }
  for (int bm : opt.borrow_m) {
    auto it = plans_.find(Key{bm, n, k, static_cast<int>(out), accumulate});
    if (bm == m || it == plans_.end() || known(it->second->algo)) continue;
    cublasLtMatmulHeuristicResult_t chk{};
    if (cublasLtMatmulAlgoCheck(h, p.desc, p.a, p.b, p.c, p.c, &it->second->algo, &chk) ==
            CUBLAS_STATUS_SUCCESS &&
        chk.state == CUBLAS_STATUS_SUCCESS && chk.workspaceSize <= workspace_bytes_)
      cands.push_back({it->second->algo, chk.workspaceSize, true});
  }
  r.candidates = static_cast<int>(cands.size());
  for (const TuneCandidate& c : cands) r.cand_desc.push_back(algo_desc(c.algo));
  if (cands.size() == 1) return finish("single candidate");

  const int n_w = std::clamp(opt.max_weights, 1, static_cast<int>(weights.size()));
  const int n_batches = std::clamp(opt.batches, 1, 50);
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  std::vector<double> per_call(cands.size(), -1.0);
  const bool sustained = opt.window_ms > 0;
  r.sustained = sustained;
  try {
    const int64_t nx = int64_t(m) * k;
    fill_tune_input_kernel<<<static_cast<int>(std::min<int64_t>((nx + 255) / 256, 1024)), 256, 0,
                             stream>>>(x, nx);
    DS_CUDA_LAUNCH_CHECK();
    if (accumulate)
      DS_CUDA_CHECK(cudaMemsetAsync(y, 0, size_t(m) * n * (out == GemmOut::kF32 ? 4 : 2), stream));
    auto call_with = [&](const TuneCandidate& c, int wi) {
      return cublasLtMatmul(h, p.desc, &alpha, weights[wi], p.a, x, p.b, &beta, y, p.c, y, p.c,
                            &c.algo, workspace_, workspace_bytes_, stream);
    };
    if (sustained) {
      // Estimate a call's time with the heuristic's algorithm (one warm call, then 2 timed).
      EventSet est(2);
      bool ok = call_with(cands[0], 0) == CUBLAS_STATUS_SUCCESS;
      DS_CUDA_CHECK(cudaEventRecord(est.ev[0], stream));
      for (int i = 0; i < 2 && ok; ++i)
        ok = call_with(cands[0], (i + 1) % n_w) == CUBLAS_STATUS_SUCCESS;
      DS_CUDA_CHECK(cudaEventRecord(est.ev[1], stream));
      DS_CUDA_CHECK(cudaStreamSynchronize(stream));
      DS_CUDA_CHECK(cudaGetLastError());
      if (!ok) throw Error("the heuristic's algorithm failed to run");
      float est_ms = 0;
      DS_CUDA_CHECK(cudaEventElapsedTime(&est_ms, est.ev[0], est.ev[1]));
      const double call_ms = std::max(1e-3, double(est_ms) / 2);
      // Calls per half window (at least 2), so that each candidate's window lasts ~window_ms.
      const int half = static_cast<int>(
          std::clamp(std::lround(opt.window_ms / 2 / call_ms), long(2), long(5000)));
      const int n_rounds = std::clamp(opt.rounds, 1, 20);
      const int n_c = static_cast<int>(cands.size());
      for (int i = 0; i < 2 * half && ok; ++i)  // bring the card to its sustained state first
        ok = call_with(cands[0], i % n_w) == CUBLAS_STATUS_SUCCESS;
      EventSet ev(2 * n_rounds * n_c);
      std::vector<char> ran_ok(cands.size(), 1);
      for (int rd = 0; rd < n_rounds; ++rd) {
        for (int j = 0; j < n_c; ++j) {
          const int ci = (j + rd) % n_c;
          const TuneCandidate& c = cands[ci];
          bool cok = ran_ok[ci] != 0;
          auto calls = [&](bool ok_in) {  // `half` calls back to back, while they succeed
            for (int i = 0; i < half && ok_in; ++i)
              ok_in = call_with(c, i % n_w) == CUBLAS_STATUS_SUCCESS;
            return ok_in;
          };
          cok = calls(cok);
          DS_CUDA_CHECK(cudaEventRecord(ev.ev[2 * (rd * n_c + ci)], stream));
          cok = calls(cok);
          DS_CUDA_CHECK(cudaEventRecord(ev.ev[2 * (rd * n_c + ci) + 1], stream));
          ran_ok[ci] = cok;
        }
      }
      DS_CUDA_CHECK(cudaStreamSynchronize(stream));
      DS_CUDA_CHECK(cudaGetLastError());
      for (int ci = 0; ci < n_c; ++ci) {
        if (!ran_ok[ci]) continue;
        std::vector<double> t(n_rounds);
        for (int rd = 0; rd < n_rounds; ++rd) {
          float ms = 0;
          DS_CUDA_CHECK(cudaEventElapsedTime(&ms, ev.ev[2 * (rd * n_c + ci)],
                                             ev.ev[2 * (rd * n_c + ci) + 1]));
          t[rd] = 1e3 * ms / half;
        }
        std::sort(t.begin(), t.end());
        per_call[ci] =
            n_rounds % 2 ? t[n_rounds / 2] : 0.5 * (t[n_rounds / 2 - 1] + t[n_rounds / 2]);
        ++r.ran;
      }
    } else {
      EventSet ev(n_batches + 1);
      for (size_t ci = 0; ci < cands.size(); ++ci) {
        const TuneCandidate& c = cands[ci];
        auto call = [&](int wi) { return call_with(c, wi); };
        spin_kernel<<<1, 1, 0, stream>>>(50000);
        DS_CUDA_LAUNCH_CHECK();
        bool ok = true;
        for (int wi = 0; wi < n_w && ok; ++wi) ok = call(wi) == CUBLAS_STATUS_SUCCESS;  // warm-up
        for (int b = 0; b < n_batches && ok; ++b) {
          DS_CUDA_CHECK(cudaEventRecord(ev.ev[b], stream));
          for (int wi = 0; wi < n_w && ok; ++wi) ok = call(wi) == CUBLAS_STATUS_SUCCESS;
        }
        if (ok) DS_CUDA_CHECK(cudaEventRecord(ev.ev[n_batches], stream));
        DS_CUDA_CHECK(cudaStreamSynchronize(stream));
        DS_CUDA_CHECK(cudaGetLastError());
        if (!ok) continue;
        std::vector<double> t(n_batches);
        for (int b = 0; b < n_batches; ++b) {
          float ms = 0;
          DS_CUDA_CHECK(cudaEventElapsedTime(&ms, ev.ev[b], ev.ev[b + 1]));
          t[b] = 1e3 * ms / n_w;
        }
        std::nth_element(t.begin(), t.begin() + n_batches / 2, t.end());
        per_call[ci] = t[n_batches / 2];
        ++r.ran;
      }
    }
  } catch (const std::exception& e) {
    cudaStreamSynchronize(stream);
    p.algo = p.heuristic, p.ws = p.heuristic_ws;
    r.ran = 0;
    return finish(std::string("timing failed: ") + e.what());
  }
  if (per_call[0] <= 0) {  // the fallback itself did not run: do not trust the others
    p.algo = p.heuristic, p.ws = p.heuristic_ws;
    return finish("the heuristic's algorithm failed to run");
  }
  size_t best = 0;
  for (size_t ci = 1; ci < cands.size(); ++ci)
    if (per_call[ci] > 0 && per_call[ci] < per_call[best]) best = ci;
  if (best != 0 && per_call[best] > per_call[0] * (1.0 - opt.min_gain)) best = 0;
  p.algo = cands[best].algo;
  p.ws = cands[best].ws;
  r.timed = true;
  r.cand_us = per_call;
  r.chosen = static_cast<int>(best);
  r.borrowed = cands[best].borrowed;
  r.heuristic_us = per_call[0];
  r.chosen_us = per_call[best];
  finish("");
  {
    std::lock_guard<std::mutex> lock(g_tune_cache_mutex);
    g_tune_cache[cache_key] = TuneCacheEntry{p.algo, p.ws, r};
  }
  return r;
}

std::string GemmEngine::describe() const {
  std::ostringstream os;
  for (const auto& [key, p] : plans_) {
    os << "gemm m=" << std::get<0>(key) << " n=" << std::get<1>(key) << " k=" << std::get<2>(key)
       << (std::get<3>(key) == 0 ? " bf16" : " f32") << (std::get<4>(key) ? " +=" : "")
       << " workspace " << p->ws << " -> "
       << variant(std::get<0>(key), std::get<1>(key), std::get<2>(key));
    if (!p->tune_note.empty()) os << " (" << p->tune_note << ")";
    os << "\n";
  }
  return os.str();
}

}  // namespace ds::cuda
