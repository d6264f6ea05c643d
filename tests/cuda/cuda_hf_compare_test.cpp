// Our engine against HF transformers at the real Qwen3.5-27B shapes, with random weights (the
// deterministic synthetic generator): this binary writes the checkpoint and our logits, and
// tools/hf_compare.py runs HF on the same checkpoint and compares (top-1 agreement, the logit
// error distribution). Only runs when $DS_HF_COMPARE_DIR names an (empty) folder with room for
// the checkpoint (4 layers: 6.7 GB; 64 layers: 51 GB) and the logits (2.1 GB);
// $DS_HF_COMPARE_LAYERS picks the layer count (default 4: 3 GDN + 1 attention).
// Protocol (issue 4): a 2048-token prompt in one chunk (all logits), then 64 decode steps
// teacher-forced with given tokens (decode kernels), logits of every step.
// Run: scripts/gpu_test.sh --hf-compare DIR (does both halves).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/npy.h"
#include "cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "model/weights.h"

namespace ds {
namespace {

TEST(CudaHfCompare, WriteCheckpointAndOurLogits) {
  DS_REQUIRE_GPU();
  const char* dir_env = std::getenv("DS_HF_COMPARE_DIR");
  if (!dir_env || !*dir_env)
    GTEST_SKIP() << "set DS_HF_COMPARE_DIR to write the HF comparison files";
  const std::string dir = dir_env;
  const int layers =
      std::getenv("DS_HF_COMPARE_LAYERS") ? std::atoi(std::getenv("DS_HF_COMPARE_LAYERS")) : 4;
  ModelConfig c = synthetic_model_config("27b");
  ASSERT_GE(layers, 1);
  ASSERT_LE(layers, c.n_layers);
  c.n_layers = layers;
  c.layer_types.resize(layers);
  const uint64_t seed = 11;
  HostWeights w = make_synthetic_weights(c, seed);
  std::filesystem::create_directories(dir);
  const int64_t bytes = w.stats.text_bytes;
  write_checkpoint(w, dir, static_cast<int>(std::max<int64_t>(1, bytes / (int64_t(4) << 30) + 1)),
                   false);

  const int P = 2048, D = 64, V = c.vocab_size;
  std::mt19937 rng(2024);
  std::vector<int32_t> toks(P + D);
  for (auto& t : toks) t = static_cast<int32_t>(rng() % V);
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = 1;
  o.chunk_size = 4096;
  CudaEngineOptions e;
  e.max_kv_tokens = 8192;
  auto b = make_cuda_backend(o, w, e);
  std::vector<float> all, l;
  SeqWork pw{0, std::span<const int32_t>(toks.data(), P), true};
  b->step(std::span<const SeqWork>(&pw, 1), all);
  for (int i = 0; i < D; ++i) {
    SeqWork dw{0, std::span<const int32_t>(toks.data() + P + i, 1), false};
    b->step(std::span<const SeqWork>(&dw, 1), l);
    all.insert(all.end(), l.begin(), l.end());
  }
  // Row r is the prediction after token r (rows 0..P-1 from the prompt, P..P+D-1 from decode).
  ASSERT_EQ(all.size(), size_t(P + D) * V);
  for (float x : all) ASSERT_TRUE(std::isfinite(x));
  write_npy_f32(dir + "/ours_logits.npy", all.data(), {P + D, V});
  nlohmann::json j;
  j["tokens"] = toks;
  j["n_prompt"] = P;
  j["n_decode"] = D;
  j["layers"] = layers;
  j["seed"] = seed;
  std::ofstream(dir + "/compare.json") << j.dump();
  std::printf("  wrote %s: %d-layer 27B-shape checkpoint, our logits [%d, %d]\n", dir.c_str(),
              layers, P + D, V);
}

}  // namespace
}  // namespace ds
