// First numbers of the CUDA engine on the synthetic Qwen3.5-27B (device-generated weights, no
// files): load (generation) time, prompt tokens/s for a 4096-token prompt (one chunk) and decode
// tokens/s at batch 1 and 8, each after a warm-up, timed on the host around step() (which
// synchronises). Only runs with DS_PERF=1 (scripts/gpu_test.sh --perf); these are the baselines
// the performance issues beat, not correctness checks (the logits must still be finite).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>

#include "cuda/cuda_backend.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

TEST(CudaPerf, Synthetic27b) {
  DS_REQUIRE_GPU();
  const char* env = std::getenv("DS_PERF");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set DS_PERF=1 to run the 27B timing";
  const int layers = std::getenv("DS_PERF_LAYERS") ? std::atoi(std::getenv("DS_PERF_LAYERS")) : 64;
  ModelConfig c = synthetic_model_config("27b");
  if (layers < c.n_layers) {
    c.n_layers = layers;
    c.layer_types.resize(layers);
  }
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = 8;
  o.chunk_size = 4096;
  CudaEngineOptions e;
  e.max_kv_tokens = 8 * 8192;
  const double t0 = now_s();
  auto b = make_cuda_backend_synthetic(o, c, 1, e);
  const double t_load = now_s() - t0;
  std::mt19937 rng(1);
  std::vector<int32_t> prompt(4096);
  for (auto& t : prompt) t = rng() % c.vocab_size;
  std::vector<float> l;
  SeqWork w{0, std::span<const int32_t>(prompt.data(), 512), false};
  b->step(std::span<const SeqWork>(&w, 1), l);  // warm-up (plans, module load)
  b->reset_slot(0);
  double t = now_s();
  w = {0, prompt, false};
  b->step(std::span<const SeqWork>(&w, 1), l);
  const double t_prefill = now_s() - t;
  for (float x : l) ASSERT_TRUE(std::isfinite(x));
  auto decode = [&](int batch, int steps) {
    std::vector<std::vector<int32_t>> toks(batch, std::vector<int32_t>{1});
    std::vector<SeqWork> work;
    for (int i = 0; i < batch; ++i) {
      if (i > 0 && b->slot_len(i) == 0) {
        SeqWork p{i, std::span<const int32_t>(prompt.data(), 4096), false};
        b->step(std::span<const SeqWork>(&p, 1), l);
      }
      work.push_back({i, toks[i], false});
    }
    b->step(work, l);  // warm-up
    const double ts = now_s();
    for (int s = 0; s < steps; ++s) b->step(work, l);
    return (now_s() - ts) / steps;
  };
  const double d1 = decode(1, 32);
  const double d8 = decode(8, 16);
  std::printf(
      "PERF synthetic 27B (%d layers): load %.2f s | prompt 4096 tok %.3f s = %.0f tok/s | "
      "decode b1 %.2f ms/tok = %.1f tok/s | decode b8 %.2f ms/step = %.1f tok/s\n",
      c.n_layers, t_load, t_prefill, 4096 / t_prefill, d1 * 1e3, 1 / d1, d8 * 1e3, 8 / d8);
}

}  // namespace
}  // namespace ds
