// The engine a bench runs against (see bench.h): synthetic weights (on the device for CUDA, so a
// 27B run needs no files and no host memory) or a checkpoint folder, on the CPU reference or the
// CUDA engine.
#include <cstdio>

#include "bench/bench.h"
#include "core/error.h"
#include "model/weights.h"
#include "runtime/backend_factory.h"
#ifdef DS_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace ds::bench {

ModelConfig bench_model_config(const BenchBackendSpec& spec) {
  ModelConfig c;
  if (!spec.model.empty()) {
    c = load_model_config(spec.model + "/config.json");
  } else if (spec.synthetic == "tiny") {
    c = tiny_model_config();
  } else if (spec.synthetic == "27b" || spec.synthetic == "27B") {
#ifdef DS_HAVE_CUDA
    c = synthetic_model_config("27b");
#else
    c = load_model_config(std::string(DS_BENCH_SOURCE_DIR) + "/configs/qwen3.5-27b.json");
#endif
  } else {
    c = load_model_config(spec.synthetic);
  }
  if (spec.layers > 0) {
    DS_CHECK(spec.layers <= c.n_layers, "--layers ", spec.layers, " exceeds the model's ",
             c.n_layers, " layers");
    c.n_layers = spec.layers;
    c.layer_types.resize(spec.layers);
  }
  c.validate();
  return c;
}

std::unique_ptr<Backend> make_bench_backend(const BenchBackendSpec& spec) {
  BackendOptions o;
  o.device = spec.device;
  o.n_slots = spec.n_slots;
  o.max_seq_len = spec.max_seq_len;
  o.chunk_size = spec.chunk_size;
  const bool cuda = spec.device.rfind("cuda", 0) == 0;
  if (!spec.model.empty()) {
    DS_CHECK(spec.layers == 0, "--layers applies to synthetic weights only");
    HostWeights w = load_host_weights(spec.model);
    return make_backend(o, w);
  }
  const ModelConfig c = bench_model_config(spec);
  if (cuda) {
#ifdef DS_HAVE_CUDA
    CudaEngineOptions e;
    e.max_kv_tokens = spec.max_kv_tokens;
    e.verbose = spec.verbose;
    return make_cuda_backend_synthetic(o, c, spec.seed, e);
#else
    ds::throw_error("--device ", spec.device, ": this binary was built without the CUDA backend");
#endif
  }
  HostWeights w = make_synthetic_weights(c, spec.seed);
  return make_backend(o, w);
}

}  // namespace ds::bench
