// cuBLASLt GEMM plans (see gemm.h). Row-major y[m, n] = x[m, k] w[n, k]^T is computed as the
// column-major y^T[n, m] = w[n, k] x^T: A = w (stored k x n column-major, op T), B = x (stored
// k x m, op N), D = y^T (n x m, ld n): the "TN" layout cuBLASLt is fastest at.
#include <cublasLt.h>

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
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

GemmEngine::GemmEngine(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  cublasLtHandle_t h = nullptr;
  DS_CUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
  if (workspace_bytes_ > 0) DS_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  int dev = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms_, cudaDevAttrMultiProcessorCount, dev));
}

GemmEngine::~GemmEngine() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
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
  p->algo = res.algo;
  p->ws = res.workspaceSize;
  auto& ref = *p;
  plans_.emplace(key, std::move(p));
  return ref;
}

void GemmEngine::prepare(int m, int n, int k, GemmOut out, bool accumulate) {
  get(m, n, k, out, accumulate, false);
}

void GemmEngine::run(const __nv_bfloat16* x, const __nv_bfloat16* w, void* y, int m, int n, int k,
                     GemmOut out, cudaStream_t stream, bool accumulate) {
  if (m <= 0) return;
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
  if (aligned && variant(m, n, k) == "skinny_mma") {
    launch_skinny_gemm(x, w, y, m, n, k, out, accumulate, skinny_gemm_config(m, n, k, n_sms_),
                       stream);
    return;
  }
  Plan& p = get(m, n, k, out, accumulate, true);
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  DS_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.desc, &alpha, w, p.a, x,
                                 p.b, &beta, y, p.c, y, p.c, &p.algo, workspace_, workspace_bytes_,
                                 stream));
}

std::string GemmEngine::variant(int m, int n, int k) const {
  if (!dispatch_) return "cublaslt";
  return dispatch_->select(KernelFamily::kGemm, dispatch_->key(m, n, k)).name;
}

std::string GemmEngine::describe() const {
  std::ostringstream os;
  for (const auto& [key, p] : plans_) {
    os << "gemm m=" << std::get<0>(key) << " n=" << std::get<1>(key) << " k=" << std::get<2>(key)
       << (std::get<3>(key) == 0 ? " bf16" : " f32") << (std::get<4>(key) ? " +=" : "")
       << " workspace " << p->ws << " -> "
       << variant(std::get<0>(key), std::get<1>(key), std::get<2>(key)) << "\n";
  }
  return os.str();
}

}  // namespace ds::cuda
