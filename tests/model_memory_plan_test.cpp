// Tests of the memory plan (27B numbers from SPEC.md) and of inspect_checkpoint (counts from the
// safetensors headers, ignored visual / mtp tensors, config-only folders).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "model/checkpoint_info.h"
#include "model/memory_plan.h"
#include "model/safetensors.h"

namespace ds {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kGiB = int64_t(1) << 30, kMiB = int64_t(1) << 20;

ModelConfig config_27b() {
  return load_model_config(std::string(DS_TEST_DATA) + "/model/qwen3_5_27b_config.json");
}

TEST(ModelMemoryPlan, Qwen35_27B) {
  ModelConfig c = config_27b();
  MemoryPlanOptions o;
  o.gpu_bytes = 112 * kGiB;
  o.reserve_bytes = 2 * kGiB;
  o.context_tokens = 8192;
  const int64_t weights = c.n_params_text() * 2;
  MemoryPlan p = plan_memory(c, weights, o);
  // 16 attention layers x 2 (K, V) x 4 kv heads x 256 x 2 bytes = 64 KiB per token.
  EXPECT_EQ(p.kv_bytes_per_token, 64 * 1024);
  // Per GDN layer: recurrent 48 x 128 x 128 fp32 = 3 MiB; conv ring 4 x 10240 bf16 = 80 KiB (the
  // CUDA engine's ring of conv_kernel rows).
  EXPECT_EQ(p.recurrent_state_bytes_per_layer, 3 * kMiB);
  EXPECT_EQ(p.conv_state_bytes_per_layer, 4 * 10240 * 2);
  EXPECT_EQ(p.gdn_state_bytes_per_seq, 48 * (3 * kMiB + 81920));
  EXPECT_EQ(p.free_bytes, 110 * kGiB - weights);
  EXPECT_TRUE(p.fits());
  EXPECT_EQ(p.max_tokens_one_seq, (p.free_bytes - p.gdn_state_bytes_per_seq) / (64 * 1024));
  EXPECT_EQ(p.max_seqs_at_context, p.free_bytes / (p.gdn_state_bytes_per_seq + 8192 * 64 * 1024));
  EXPECT_NE(p.to_text().find("64.00 KiB"), std::string::npos);
  // An 80 GB H100 budget fits the weights too; a 40 GiB one does not.
  o.gpu_bytes = 40 * kGiB;
  MemoryPlan small = plan_memory(c, weights, o);
  EXPECT_FALSE(small.fits());
  EXPECT_EQ(small.max_seqs_at_context, 0);
  EXPECT_NE(small.to_text().find("NO"), std::string::npos);
  o.context_tokens = 0;
  EXPECT_THROW(plan_memory(c, weights, o), Error);
}

TEST(ModelMemoryPlan, FormatBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3 * kMiB), "3.00 MiB");
  EXPECT_EQ(format_bytes(50 * kGiB + kGiB / 2), "50.50 GiB");
}

std::string temp_dir() {
  fs::path p = fs::temp_directory_path() / ("ds_inspect_test_" + std::to_string(::getpid()) + "_" +
                                            std::to_string(std::random_device{}()));
  fs::create_directories(p);
  return p.string();
}

TEST(ModelInspect, CountsFromHeadersAndIgnoredTensors) {
  std::string d = temp_dir();
  ModelConfig c = tiny_model_config(256);
  HostWeights w = make_synthetic_weights(c, 4);
  write_checkpoint(w, d, 2, true);
  // Add a third shard with vision and MTP tensors to the index.
  std::vector<float> v(10, 1.f);
  auto p = reinterpret_cast<const std::byte*>(v.data());
  write_safetensors(d + "/extra.safetensors",
                    {{"model.visual.patch_embed.proj.weight", DType::kF32, {2, 3}, p},
                     {"mtp.fc.weight", DType::kF32, {4}, p}});
  std::string ip = d + "/model.safetensors.index.json";
  std::string text;
  {
    std::ifstream f(ip);
    text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  size_t pos = text.find("\"weight_map\": {");
  ASSERT_NE(pos, std::string::npos);
  text.insert(pos + 15,
              "\"model.visual.patch_embed.proj.weight\": \"extra.safetensors\", \"mtp.fc.weight\": "
              "\"extra.safetensors\",");
  std::ofstream(ip) << text;

  CheckpointInfo info = inspect_checkpoint(d);
  EXPECT_TRUE(info.has_weights);
  EXPECT_EQ(info.stats.n_files, 3);
  EXPECT_EQ(info.text_params(), c.n_params_text());
  EXPECT_EQ(info.text_bytes(), c.n_params_text() * 2);
  EXPECT_EQ(info.params_by_kind[int(ParamKind::kEmbedding)], 256 * 64);
  EXPECT_EQ(info.params_by_kind[int(ParamKind::kLmHead)], 256 * 64);
  EXPECT_EQ(info.params_by_kind[int(ParamKind::kMlp)], 4 * 3 * 64 * 128);
  EXPECT_EQ(info.stats.n_visual_tensors, 1);
  EXPECT_EQ(info.stats.visual_params, 6);
  EXPECT_EQ(info.stats.n_mtp_tensors, 1);
  EXPECT_EQ(info.stats.mtp_params, 4);
  EXPECT_EQ(info.text_tensors_by_dtype.at("BF16"),
            static_cast<int64_t>(checkpoint_tensors(c).size()));
  // Loading agrees.
  HostWeights r = load_host_weights(d);
  EXPECT_EQ(r.stats.n_visual_tensors, 1);
  EXPECT_EQ(r.stats.n_text_tensors, info.stats.n_text_tensors);

  // inspect runs the loader's checks: a wrong shape is an error there too.
  fs::remove(d + "/config.json");
  ModelConfig wrong = c;
  wrong.d_ff = 96;
  std::ofstream(d + "/config.json") << model_config_to_json(wrong, true);
  EXPECT_THROW(inspect_checkpoint(d), Error);
  fs::remove_all(d);
}

TEST(ModelInspect, ConfigOnlyFolder) {
  std::string d = temp_dir();
  fs::copy_file(std::string(DS_TEST_DATA) + "/model/qwen3_5_27b_config.json", d + "/config.json");
  CheckpointInfo info = inspect_checkpoint(d);
  EXPECT_FALSE(info.has_weights);
  EXPECT_EQ(info.text_params(), config_27b().n_params_text());
  EXPECT_EQ(info.params_by_kind[int(ParamKind::kEmbedding)], int64_t(248320) * 5120);
  EXPECT_EQ(info.text_bytes(), info.text_params() * 2);
  fs::remove_all(d);
}

}  // namespace
}  // namespace ds
