// Our engine against HF transformers at the real Qwen3.5-27B shapes with random weights (issue 4's
// gate). This binary runs OUR half: the deterministic synthetic weights generated on the GPU
// (make_cuda_backend_synthetic, no checkpoint on disk), a 2048-token prompt in one chunk (logits
// of every prompt token), then 64 decode steps teacher-forced with given tokens (the decode
// kernels), for each layer count in $DS_HF_COMPARE_LAYERS (default "4,64": 3 GDN + 1 attention,
// and the full model). tools/hf_compare.py runs the HF half: it rebuilds the same weights on the
// GPU from the same counter-based generator (model/weight_table.h), checks them against the
// fingerprint written here, and compares logits (top-1 agreement, error distribution, KL).
//
// Files written to $DS_HF_COMPARE_DIR (the test skips without it):
//   compare.json  tokens, n_prompt, n_decode, layer counts, model seed, the config (HF layout)
//   weights.json  per checkpoint tensor of the largest model: name, shape, synthetic spec (seed,
//                 kind, mean, std, lo, hi) and bf16 bits at sample indices (every element of
//                 tensors of <= 256 elements), computed on the host by the reference generator
//   ours_L<N>.npy our logits [2048 + 64, vocab] float32 for N layers (2.1 GB each at 27B)
// Why no checkpoint: 64 layers are 51 GB of safetensors; writing and reading them would take
// minutes of device time, the generator takes about a second on either side.
// Run: scripts/gpu_test.sh --hf-compare DIR (both halves).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/bf16.h"
#include "core/npy.h"
#include "cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "model/weight_table.h"
#include "model/weights.h"

namespace ds {
namespace {

constexpr uint64_t kModelSeed = 11;
constexpr int kPrompt = 2048, kDecode = 64;

std::vector<int> layer_counts(int max_layers) {
  const char* env = std::getenv("DS_HF_COMPARE_LAYERS");
  std::string spec = env && *env ? env : "4,64";
  std::vector<int> out;
  std::stringstream ss(spec);
  for (std::string item; std::getline(ss, item, ',');) {
    const int n = std::atoi(item.c_str());
    DS_CHECK(n >= 1 && n <= max_layers, "DS_HF_COMPARE_LAYERS: '", item, "' is not in 1..",
             max_layers);
    out.push_back(n);
  }
  DS_CHECK(!out.empty(), "DS_HF_COMPARE_LAYERS is empty");
  return out;
}

ModelConfig truncated(ModelConfig c, int layers) {
  c.n_layers = layers;
  c.layer_types.resize(layers);
  return c;
}

// The host reference generator's bf16 bits of every tensor at a few indices: HF's rebuilt
// weights must match these exactly (the device generator is checked against the host one by
// cuda_backend_test's DeviceSyntheticEqualsHostSynthetic).
nlohmann::json weight_fingerprint(const ModelConfig& c) {
  nlohmann::json out = nlohmann::json::array();
  for (const CheckpointTensor& t : checkpoint_tensors(c)) {
    const SyntheticSpec s = synthetic_tensor_spec(c, t.name, kModelSeed);
    const int64_t n = t.numel();
    std::vector<int64_t> idx;
    if (n <= 256) {
      for (int64_t i = 0; i < n; ++i) idx.push_back(i);
    } else {
      idx = {0, 1, 2, n / 3, n / 2, n - 2, n - 1};
      for (int k = 1; k <= 9; ++k) idx.push_back(int64_t(mix64(s.seed + k) % uint64_t(n)));
    }
    nlohmann::json samples = nlohmann::json::array();
    for (int64_t i : idx) {
      const float v = synthetic_value(s, uint64_t(i));
      samples.push_back({i, f32_to_bf16(v)});
    }
    out.push_back({{"name", t.name},
                   {"shape", t.shape},
                   {"seed", std::to_string(s.seed)},
                   {"kind", s.kind == SyntheticKind::kNormal ? "normal" : "log_uniform"},
                   {"mean", s.mean},
                   {"std", s.std},
                   {"lo", s.lo},
                   {"hi", s.hi},
                   {"samples", samples}});
  }
  return out;
}

TEST(CudaHfCompare, WriteOurLogitsAndWeightFingerprint) {
  DS_REQUIRE_GPU();
  const char* dir_env = std::getenv("DS_HF_COMPARE_DIR");
  if (!dir_env || !*dir_env)
    GTEST_SKIP() << "set DS_HF_COMPARE_DIR to write the HF comparison files";
  const std::string dir = dir_env;
  const ModelConfig full = synthetic_model_config("27b");
  const std::vector<int> counts = layer_counts(full.n_layers);
  const int max_layers = *std::max_element(counts.begin(), counts.end());
  std::filesystem::create_directories(dir);

  const int V = full.vocab_size;
  std::mt19937 rng(2024);
  std::vector<int32_t> toks(kPrompt + kDecode);
  for (auto& t : toks) t = static_cast<int32_t>(rng() % V);

  for (int layers : counts) {
    const auto t0 = std::chrono::steady_clock::now();
    const ModelConfig c = truncated(full, layers);
    BackendOptions o;
    o.device = "cuda";
    o.n_slots = 1;
    o.chunk_size = 4096;
    CudaEngineOptions e;
    e.max_kv_tokens = 4096;
    e.verbose = false;
    auto b = make_cuda_backend_synthetic(o, c, kModelSeed, e);
    std::vector<float> all;
    test::prefill_then_decode(*b, toks, kPrompt, /*keep_prompt=*/true, all);
    b.reset();
    // Row r is the prediction after token r (rows 0..P-1 from the prompt, P..P+D-1 from decode).
    ASSERT_EQ(all.size(), size_t(kPrompt + kDecode) * V);
    for (float x : all) ASSERT_TRUE(std::isfinite(x)) << layers << " layers: non-finite logit";
    write_npy_f32(dir + "/ours_L" + std::to_string(layers) + ".npy", all.data(),
                  {kPrompt + kDecode, V});
    std::printf("  %d layers: our logits [%d, %d] in %.1f s (engine build, forward, file)\n",
                layers, kPrompt + kDecode, V,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  nlohmann::json j;
  j["tokens"] = toks;
  j["n_prompt"] = kPrompt;
  j["n_decode"] = kDecode;
  j["layers"] = counts;
  j["seed"] = kModelSeed;
  j["config"] = nlohmann::json::parse(model_config_to_json(truncated(full, max_layers), false));
  std::ofstream(dir + "/compare.json") << j.dump();
  std::ofstream(dir + "/weights.json") << weight_fingerprint(truncated(full, max_layers)).dump();
  std::printf("  wrote %s: compare.json, weights.json, ours_L*.npy\n", dir.c_str());
}

}  // namespace
}  // namespace ds
