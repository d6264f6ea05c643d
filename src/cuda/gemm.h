// bf16 GEMMs of the engine through cuBLASLt: y[m, n] = x[m, k] * w[n, k]^T (+ y when accumulate),
// bf16 inputs, fp32 accumulation, bf16 or fp32 output. x and y are row-major activations (m =
// tokens), w is a row-major [out, in] weight, the layout of every checkpoint matrix.
// Each distinct shape (m, n, k, output type, accumulate) gets its descriptors, layouts and
// algorithm once (prepare(), at start-up or at plan time) and reuses them on every call; the
// workspace is allocated once. run() on a shape never prepared prepares it on the spot and
// counts it in late_plans() (host work only, no device synchronisation, so still graph-safe).
// With a dispatch registry set, run() sends the shapes that the registry's "gemm.skinny_mma" guard
// accepts (decode: m <= 16, see gemv.h) to the skinny tensor-core kernel when x and w are 16-byte
// aligned; everything else goes to cuBLASLt.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

namespace ds::cuda {

class DispatchRegistry;  // dispatch.h

enum class GemmOut : uint8_t { kBF16, kF32 };

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

  void run(const __nv_bfloat16* x,  // [m, k]
           const __nv_bfloat16* w,  // [n, k]
           void* y,                 // [m, n] bf16 or fp32
           int m, int n, int k, GemmOut out, cudaStream_t stream, bool accumulate = false);

  // Specialised kernels (e.g. decode GEMVs) are picked through this registry when set; null or
  // unset: cuBLASLt for every shape. The registry must outlive the engine.
  void set_dispatch(const DispatchRegistry* dispatch) { dispatch_ = dispatch; }

  // The variant run() takes for this shape with 16-byte aligned x and w: "skinny_mma" or
  // "cublaslt".
  std::string variant(int m, int n, int k) const;

  int n_plans() const { return static_cast<int>(plans_.size()); }
  int late_plans() const { return late_plans_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  std::string describe() const;  // one line per planned shape

 private:
  struct Plan;
  using Key = std::tuple<int, int, int, int, bool>;
  Plan& get(int m, int n, int k, GemmOut out, bool accumulate, bool late);

  void* handle_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  int late_plans_ = 0;
  const DispatchRegistry* dispatch_ = nullptr;
  int n_sms_ = 0;  // of the current device at construction (skinny kernel config)
};

}  // namespace ds::cuda
