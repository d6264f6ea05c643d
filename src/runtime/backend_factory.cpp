// make_backend (see backend_factory.h).
#include "runtime/backend_factory.h"

#include "core/error.h"
#include "runtime/cpu_backend.h"

#if defined(DS_HAVE_CUDA) && __has_include("cuda/cuda_backend.h")
#include "cuda/cuda_backend.h"
#define DS_CUDA_BACKEND_AVAILABLE 1
#endif

namespace ds {

bool cuda_backend_built() {
#ifdef DS_CUDA_BACKEND_AVAILABLE
  return true;
#else
  return false;
#endif
}

std::unique_ptr<Backend> make_backend(const BackendOptions& opts, const HostWeights& weights) {
  const std::string& dev = opts.device;
  if (dev == "cpu") return std::make_unique<CpuBackend>(weights, opts);
  if (dev == "cuda" || dev.rfind("cuda:", 0) == 0) {
#ifdef DS_CUDA_BACKEND_AVAILABLE
    return make_cuda_backend(opts, weights);
#else
    throw_error("device '", dev,
                "': the CUDA backend is not built into this binary (configure with "
                "-DDS_CUDA=ON on a machine with nvcc); use --device cpu");
#endif
  }
  throw_error("unknown device '", dev, "' (expected cpu, cuda or cuda:N)");
}

}  // namespace ds
