// The GPU benches in a binary built without the CUDA backend: each says so clearly instead of
// failing at link time (the real ones live in bench/cuda/, built only with CUDA).
#include "bench/bench.h"
#include "core/error.h"

#ifndef DS_HAVE_CUDA
namespace ds::bench {

namespace {
constexpr const char* kNoCuda =
    "no CUDA device: this binary was built without the CUDA backend (configure with -DDS_CUDA=ON "
    "on a machine with nvcc)";
}

std::string cuda_device_status() { return kNoCuda; }

Ceilings measure_ceilings(int, int) { ds::throw_error("bench: ", kNoCuda); }

std::vector<KernelResult> run_kernel_bench(const ModelConfig&, const Ceilings&,
                                           const KernelBenchOptions&) {
  ds::throw_error("bench kernels: ", kNoCuda);
}

std::vector<Profile> run_profile(const ModelConfig&, const Ceilings&, const KernelBenchOptions&,
                                 int, int64_t, int64_t, int64_t, const std::vector<KernelResult>&) {
  ds::throw_error("bench --profile: ", kNoCuda);
}

}  // namespace ds::bench
#endif
