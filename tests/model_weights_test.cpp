// Tests of load_host_weights / make_synthetic_weights / write_checkpoint: round trips in both
// layouts and several shard counts, the fused layouts, dtype handling, and the errors for missing
// tensors, wrong shapes, wrong dtypes and mismatched configs (each naming file and tensor).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "core/bf16.h"
#include "core/error.h"
#include "model/safetensors.h"
#include "model/weight_table.h"
#include "model/weights.h"

namespace ds {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string temp_dir(const std::string& tag) {
  fs::path p =
      fs::temp_directory_path() / ("ds_model_test_" + tag + "_" + std::to_string(::getpid()) + "_" +
                                   std::to_string(std::random_device{}()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

struct TempDir {
  std::string path;
  explicit TempDir(const std::string& tag) : path(temp_dir(tag)) {}
  ~TempDir() { fs::remove_all(path); }
};

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.shape == b.shape && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

void expect_same_weights(const HostWeights& a, const HostWeights& b) {
  ASSERT_EQ(a.layers.size(), b.layers.size());
  EXPECT_TRUE(same_bytes(a.embed, b.embed));
  EXPECT_TRUE(same_bytes(a.final_norm, b.final_norm));
  EXPECT_TRUE(same_bytes(a.lm_head, b.lm_head));
  for (size_t il = 0; il < a.layers.size(); ++il) {
    SCOPED_TRACE("layer " + std::to_string(il));
    const LayerWeights &x = a.layers[il], &y = b.layers[il];
    EXPECT_EQ(x.type, y.type);
    for (auto f : {&LayerWeights::input_norm, &LayerWeights::post_norm, &LayerWeights::mlp_gate_up,
                   &LayerWeights::mlp_down, &LayerWeights::attn_qkv, &LayerWeights::attn_o,
                   &LayerWeights::q_norm, &LayerWeights::k_norm, &LayerWeights::gdn_in,
                   &LayerWeights::gdn_conv, &LayerWeights::gdn_dt_bias, &LayerWeights::gdn_A_log,
                   &LayerWeights::gdn_norm, &LayerWeights::gdn_out}) {
      EXPECT_EQ((x.*f).empty(), (y.*f).empty());
      if (!(x.*f).empty()) {
        EXPECT_TRUE(same_bytes(x.*f, y.*f)) << (x.*f).name;
      }
    }
  }
}

// Expects `fn` to throw ds::Error whose message contains every string of `parts`.
template <typename Fn>
void expect_error(Fn fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected ds::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

TEST(ModelWeights, TinyConfigHasBothLayerKindsAnd27BRatios) {
  ModelConfig c = tiny_model_config();
  EXPECT_EQ(c.n_linear_layers(), 3);
  EXPECT_EQ(c.n_full_layers(), 1);
  EXPECT_EQ(c.n_heads / c.n_kv_heads, 6);
  EXPECT_EQ(c.n_v_heads / c.n_k_heads, 3);
  EXPECT_EQ(c.head_dim, 2 * c.d_k);
  EXPECT_EQ(c.rotary_dim, c.head_dim / 4);
  EXPECT_EQ(c.vocab_size, 1024);
  EXPECT_EQ(tiny_model_config(300).vocab_size, 300);
}

TEST(ModelWeights, SyntheticIsDeterministicAcrossThreadCounts) {
  // Large enough (5M values) that generation really runs on several threads.
  ModelConfig c = tiny_model_config(40000);
  int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  HostWeights a = make_synthetic_weights(c, 7);
  omp_set_num_threads(std::max(3, saved));  // 3: uneven split of the blocks
  HostWeights b = make_synthetic_weights(c, 7);
  omp_set_num_threads(saved);
  expect_same_weights(a, b);
  HostWeights d = make_synthetic_weights(c, 8);
  EXPECT_FALSE(same_bytes(a.embed, d.embed));
  EXPECT_EQ(a.source, "synthetic:7");
}

// Pins the synthetic generator: a GPU engine reproducing it (weight_table.h) and every saved
// comparison depend on these exact bits. The first values were checked against a Python
// splitmix64 implementation.
TEST(ModelWeights, SyntheticValuesArePinned) {
  EXPECT_EQ(synthetic_bits(1, 0), 0x910a2dec89025cc1ull);
  EXPECT_EQ(synthetic_normal(1, 0), -0.617513597f);
  ModelConfig c = tiny_model_config();
  SyntheticSpec s = synthetic_tensor_spec(c, "layers.0.linear_attn.A_log", 1);
  EXPECT_EQ(s.seed, 0xe88a2e077784ad8full);
  EXPECT_FLOAT_EQ(synthetic_value(s, 0), 2.08418345f);
  HostWeights w = make_synthetic_weights(c, 1);
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](const TensorView& t) {
    for (size_t i = 0; i < t.nbytes(); ++i) {
      h ^= static_cast<uint8_t>(t.data[i]);
      h *= 0x100000001b3ull;
    }
  };
  mix(w.embed);
  mix(w.lm_head);
  mix(w.final_norm);
  for (const LayerWeights& l : w.layers) {
    mix(l.input_norm);
    mix(l.mlp_gate_up);
    mix(l.mlp_down);
    if (l.type == LayerType::kFull) {
      for (auto f : {&LayerWeights::attn_qkv, &LayerWeights::attn_o, &LayerWeights::q_norm,
                     &LayerWeights::k_norm})
        mix(l.*f);
    } else {
      for (auto f : {&LayerWeights::gdn_in, &LayerWeights::gdn_conv, &LayerWeights::gdn_A_log,
                     &LayerWeights::gdn_dt_bias, &LayerWeights::gdn_norm, &LayerWeights::gdn_out}) {
        mix(l.*f);
      }
    }
  }
  EXPECT_EQ(h, 0xa6f229f0dc649d41ull)
      << "synthetic weights changed: update every consumer of the generator";
}

TEST(ModelWeights, SyntheticMagnitudes) {
  ModelConfig c = tiny_model_config();
  HostWeights w = make_synthetic_weights(c, 1, DType::kF32);
  auto stats = [](const TensorView& t, double* mean, double* sd) {
    std::vector<float> v(t.numel());
    t.to_f32(v.data());
    double s = 0, s2 = 0;
    for (float x : v) s += x;
    *mean = s / v.size();
    for (float x : v) s2 += (x - *mean) * (x - *mean);
    *sd = std::sqrt(s2 / v.size());
  };
  double m, sd;
  stats(w.layers[0].mlp_gate_up, &m, &sd);  // 1/sqrt(64)
  EXPECT_NEAR(m, 0.0, 0.01);
  EXPECT_NEAR(sd, 0.125, 0.01);
  stats(w.embed, &m, &sd);
  EXPECT_NEAR(sd, 0.02, 0.002);
  stats(w.final_norm, &m, &sd);  // zero-centred norm: small around 0
  EXPECT_LT(std::fabs(m), 0.06);
  EXPECT_LT(sd, 0.2);
  stats(w.layers[0].gdn_norm, &m, &sd);  // plain norm: around 1
  EXPECT_NEAR(m, 1.0, 0.1);
  const TensorView& a_log = w.layers[0].gdn_A_log;
  for (int64_t i = 0; i < a_log.numel(); ++i) {
    EXPECT_GE(a_log.at(i), 0.0f);
    EXPECT_LT(a_log.at(i), std::log(16.0f) + 1e-6f);
  }
  // Same spec the GPU path would use.
  SyntheticSpec s = synthetic_tensor_spec(c, "layers.0.mlp.gate_proj.weight", 1);
  EXPECT_EQ(synthetic_value(s, 5), w.layers[0].mlp_gate_up.at(5));
  SyntheticSpec up = synthetic_tensor_spec(c, "layers.0.mlp.up_proj.weight", 1);
  EXPECT_EQ(synthetic_value(up, 3), w.layers[0].mlp_gate_up.at(int64_t(c.d_ff) * c.d_model + 3));
  EXPECT_NE(s.seed, up.seed);
}

TEST(ModelWeights, SyntheticBf16AndF16AreRoundedF32) {
  ModelConfig c = tiny_model_config();
  HostWeights f = make_synthetic_weights(c, 3, DType::kF32);
  HostWeights b = make_synthetic_weights(c, 3, DType::kBF16);
  HostWeights h = make_synthetic_weights(c, 3, DType::kF16);
  // Every element of a few tensors with different magnitudes (embedding values reach the f16
  // subnormal range; conv weights are large; A_log comes from log-uniform).
  for (auto field : {&LayerWeights::gdn_conv, &LayerWeights::gdn_A_log, &LayerWeights::gdn_in}) {
    const TensorView &tf = f.layers[0].*field, &tb = b.layers[0].*field, &th = h.layers[0].*field;
    for (int64_t i = 0; i < tf.numel(); ++i) {
      ASSERT_EQ(round_bf16(tf.at(i)), tb.at(i)) << tf.name << " " << i;
      ASSERT_NEAR(th.at(i), tf.at(i), std::fabs(tf.at(i)) * (1.0 / 1024) + 1e-7) << tf.name << " " << i;
    }
  }
  int subnormal = 0;
  for (int64_t i = 0; i < f.embed.numel(); ++i) {
    const float x = f.embed.at(i);
    ASSERT_EQ(round_bf16(x), b.embed.at(i)) << i;
#ifdef __FLT16_MAX__
    // The compiler's float -> _Float16 conversion rounds to nearest even: the reference.
    ASSERT_EQ(static_cast<float>(static_cast<_Float16>(x)), h.embed.at(i)) << x;
#endif
    subnormal += x != 0.0f && std::fabs(x) < 6.1e-5f;
  }
  EXPECT_GT(subnormal, 0);  // the subnormal path of the f16 conversion was exercised
}

struct RoundTrip {
  bool wrapper;
  int shards;
};
class ModelWeightsRoundTrip : public ::testing::TestWithParam<RoundTrip> {};

TEST_P(ModelWeightsRoundTrip, WriteThenLoadGivesIdenticalBytes) {
  RoundTrip p = GetParam();
  TempDir dir("rt");
  ModelConfig c = tiny_model_config(512);
  c.eos_token_ids = {3, 4};
  c.bos_token_id = 1;
  HostWeights w = make_synthetic_weights(c, 11);
  write_checkpoint(w, dir.path, p.shards, p.wrapper);
  EXPECT_EQ(fs::exists(fs::path(dir.path) / "model.safetensors.index.json"), p.shards > 1);
  HostWeights r = load_host_weights(dir.path);
  EXPECT_EQ(r.config.is_wrapper, p.wrapper);
  EXPECT_EQ(r.config.eos_token_ids, c.eos_token_ids);
  EXPECT_EQ(r.config.bos_token_id, 1);
  EXPECT_EQ(r.config.layer_types, c.layer_types);
  EXPECT_EQ(r.config.rotary_dim, c.rotary_dim);
  EXPECT_EQ(r.config.rms_norm_eps, c.rms_norm_eps);
  EXPECT_EQ(r.stats.n_files, p.shards);
  EXPECT_EQ(r.stats.n_text_tensors, int64_t(checkpoint_tensors(c).size()));
  EXPECT_EQ(r.stats.n_other_tensors, 0);
  EXPECT_GT(r.stats.load_seconds, 0.0);
  expect_same_weights(w, r);
  // Fused views are owned copies; unfused ones point into the mmap.
  EXPECT_EQ(r.layers[0].gdn_in.name.rfind("fused:", 0), 0u);
  EXPECT_NE(r.layers[0].mlp_down.name.find("mlp.down_proj.weight"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ModelWeightsRoundTrip,
                         ::testing::Values(RoundTrip{false, 1}, RoundTrip{true, 1},
                                           RoundTrip{false, 3}, RoundTrip{true, 5}));

// Writes a checkpoint from explicit tensors (name -> f32 values), for the fusion/error tests.
struct RawTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

std::vector<RawTensor> raw_from_weights(const HostWeights& w, bool wrapper) {
  TempDir dir("raw");
  write_checkpoint(w, dir.path, 1, wrapper);
  SafetensorsFile f(dir.path + "/model.safetensors");
  std::vector<RawTensor> out;
  for (const SafetensorsEntry& e : f.header().tensors) {
    DType dt;
    EXPECT_TRUE(e.engine_dtype(&dt));
    const std::byte* p = f.tensor_data(e);
    out.push_back({e.name, dt, e.shape, std::vector<std::byte>(p, p + (e.end - e.begin))});
  }
  return out;
}

void write_raw(const std::string& dir, const ModelConfig& c, bool wrapper,
               const std::vector<RawTensor>& ts) {
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << model_config_to_json(c, wrapper);
  std::vector<TensorToWrite> tw;
  for (const RawTensor& t : ts) tw.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
  write_safetensors(dir + "/model.safetensors", tw);
}

RawTensor* find_raw(std::vector<RawTensor>& ts, const std::string& name) {
  for (RawTensor& t : ts) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

TEST(ModelWeights, FusedGdnLayoutIsQkvZBA) {
  ModelConfig c = tiny_model_config(256);
  HostWeights w = make_synthetic_weights(c, 5, DType::kF32);
  std::vector<RawTensor> ts = raw_from_weights(w, false);
  // Distinct constant per part so that the fused rows can be told apart.
  const char* parts[] = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"};
  for (int k = 0; k < 4; ++k) {
    RawTensor* t = find_raw(ts, std::string("model.layers.1.linear_attn.") + parts[k] + ".weight");
    ASSERT_NE(t, nullptr);
    float* v = reinterpret_cast<float*>(t->bytes.data());
    for (size_t i = 0; i < t->bytes.size() / 4; ++i)
      v[i] = float(k + 1) + float(i % c.d_model) * 1e-3f;
  }
  TempDir dir("fuse");
  write_raw(dir.path, c, false, ts);
  HostWeights r = load_host_weights(dir.path);
  const TensorView& g = r.layers[1].gdn_in;
  ASSERT_EQ(g.shape, (std::vector<int64_t>{c.gdn_in_dim(), c.d_model}));
  const int64_t rows[] = {c.gdn_qkv_dim(), c.gdn_z_dim(), c.n_v_heads, c.n_v_heads};
  int64_t row = 0;
  for (int k = 0; k < 4; ++k) {
    for (int64_t i = 0; i < rows[k]; ++i, ++row) {
      ASSERT_EQ(g.at(row * c.d_model + 7), float(k + 1) + 7e-3f) << "row " << row;
    }
  }
  EXPECT_EQ(g.name,
            "fused:layers.1.[linear_attn.in_proj_qkv.weight|linear_attn.in_proj_z.weight|"
            "linear_attn.in_proj_b.weight|linear_attn.in_proj_a.weight]");
  // [q|k|v] and [gate|up]
  const TensorView& qkv = r.layers[3].attn_qkv;
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{c.q_proj_dim() + 2 * c.kv_dim(), c.d_model}));
  EXPECT_EQ(r.layers[3].mlp_gate_up.shape, (std::vector<int64_t>{2 * c.d_ff, c.d_model}));
  const TensorView& k_src = w.layers[3].attn_qkv;
  for (int64_t i = 0; i < qkv.numel(); ++i) ASSERT_EQ(qkv.at(i), k_src.at(i));
}

TEST(ModelWeights, MixedDtypesInAFusedGroupWidenToF32) {
  ModelConfig c = tiny_model_config(256);
  HostWeights w = make_synthetic_weights(c, 5, DType::kBF16);
  std::vector<RawTensor> ts = raw_from_weights(w, true);
  RawTensor* z = find_raw(ts, "model.language_model.layers.0.linear_attn.in_proj_z.weight");
  ASSERT_NE(z, nullptr);
  std::vector<std::byte> f32(z->bytes.size() * 2);
  for (size_t i = 0; i < z->bytes.size() / 2; ++i) {
    uint16_t h;
    std::memcpy(&h, z->bytes.data() + 2 * i, 2);
    float v = bf16_to_f32(h);
    std::memcpy(f32.data() + 4 * i, &v, 4);
  }
  z->bytes = f32;
  z->dtype = DType::kF32;
  TempDir dir("mixed");
  write_raw(dir.path, c, true, ts);
  HostWeights r = load_host_weights(dir.path);
  EXPECT_EQ(r.layers[0].gdn_in.dtype, DType::kF32);
  EXPECT_EQ(r.layers[1].gdn_in.dtype, DType::kBF16);
  for (int64_t i = 0; i < r.layers[0].gdn_in.numel(); i += 97) {
    ASSERT_EQ(r.layers[0].gdn_in.at(i), w.layers[0].gdn_in.at(i));
  }
}

class ModelWeightsErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    c = tiny_model_config(256);
    w = make_synthetic_weights(c, 2);
    ts = raw_from_weights(w, true);
  }
  std::string write(const ModelConfig& cfg) {
    dir = std::make_unique<TempDir>("err");
    write_raw(dir->path, cfg, true, ts);
    return dir->path;
  }
  ModelConfig c;
  HostWeights w;
  std::vector<RawTensor> ts;
  std::unique_ptr<TempDir> dir;
};

TEST_F(ModelWeightsErrors, MissingTensorNamesTensorAndFile) {
  ts.erase(ts.begin() + 5);  // some layer tensor
  std::string name;
  {
    std::vector<RawTensor> full = raw_from_weights(w, true);
    name = full[5].name;
  }
  std::string d = write(c);
  expect_error([&] { load_host_weights(d); },
               {"missing tensor '" + name + "'", d + "/model.safetensors"});
}

TEST_F(ModelWeightsErrors, MissingTensorInShardedCheckpointNamesTheShard) {
  TempDir sd("shard");
  write_checkpoint(w, sd.path, 3, false);
  // Drop one tensor from the index: it then is missing.
  std::string ip = sd.path + "/model.safetensors.index.json";
  json idx = json::parse(std::ifstream(ip));
  const std::string gone = "model.layers.2.mlp.down_proj.weight";
  std::string shard = idx["weight_map"][gone];
  idx["weight_map"].erase(gone);
  std::ofstream(ip) << idx.dump();
  expect_error([&] { load_host_weights(sd.path); },
               {"missing tensor '" + gone + "'", ip, "layer 2"});
}

TEST_F(ModelWeightsErrors, MissingLmHeadWhenUntied) {
  ts.erase(std::remove_if(ts.begin(), ts.end(),
                          [](const RawTensor& t) { return t.name == "lm_head.weight"; }),
           ts.end());
  std::string d = write(c);
  expect_error([&] { load_host_weights(d); },
               {"missing tensor 'lm_head.weight'", "tie_word_embeddings"});
  // Tied: fine, lm_head is the embedding.
  ModelConfig tied = c;
  tied.tie_word_embeddings = true;
  d = write(tied);
  HostWeights r = load_host_weights(d);
  EXPECT_EQ(r.lm_head.data, r.embed.data);
}

TEST_F(ModelWeightsErrors, WrongShapeNamesTensorFileAndShapes) {
  RawTensor* t = find_raw(ts, "model.language_model.layers.3.self_attn.o_proj.weight");
  ASSERT_NE(t, nullptr);
  std::swap(t->shape[0], t->shape[1]);
  std::string d = write(c);
  expect_error([&] { load_host_weights(d); },
               {"model.language_model.layers.3.self_attn.o_proj.weight", d + "/model.safetensors",
                "[192, 64]", "expected [64, 192]"});
}

TEST_F(ModelWeightsErrors, Fp8AndIntegerDtypesRejected) {
  RawTensor* t = find_raw(ts, "model.language_model.layers.0.mlp.down_proj.weight");
  ASSERT_NE(t, nullptr);
  t->bytes.resize(t->bytes.size() / 2);
  t->dtype = DType::kF8E4M3;
  std::string d = write(c);
  expect_error([&] { load_host_weights(d); },
               {"model.language_model.layers.0.mlp.down_proj.weight", "F8_E4M3", "not supported",
                d + "/model.safetensors"});
}

TEST_F(ModelWeightsErrors, ConfigCheckpointMismatches) {
  // Config says layer 3 is linear: the attention tensors of layer 3 are then unexpected.
  ModelConfig lin = c;
  lin.layer_types[3] = LayerType::kLinear;
  lin.layer_types[2] = LayerType::kFull;
  std::string d = write(lin);
  expect_error([&] { load_host_weights(d); }, {"model.language_model.layers.", "layer_types"});
  // Fewer layers in the config than in the checkpoint.
  ModelConfig fewer = c;
  fewer.n_layers = 3;
  fewer.layer_types.resize(3);
  d = write(fewer);
  expect_error([&] { load_host_weights(d); }, {"layers.3.", "num_hidden_layers"});
  // Different hidden size: shape errors.
  ModelConfig wide = c;
  wide.d_ff = 256;
  d = write(wide);
  expect_error([&] { load_host_weights(d); }, {"mlp.", "expected ["});
}

TEST_F(ModelWeightsErrors, QwenNextPackedNamesAreRecognised) {
  RawTensor* t = find_raw(ts, "model.language_model.layers.0.linear_attn.in_proj_qkv.weight");
  t->name = "model.language_model.layers.0.linear_attn.in_proj_qkvz.weight";
  std::string d = write(c);
  expect_error([&] { load_host_weights(d); }, {"in_proj_qkvz", "Qwen3-Next", "not supported yet"});
}

TEST_F(ModelWeightsErrors, VisualMtpAndOtherTensorsAreCountedAndSkipped) {
  std::vector<std::byte> four(4 * 6);
  ts.push_back({"model.visual.blocks.0.attn.qkv.weight", DType::kF32, {2, 3}, four});
  ts.push_back({"model.visual.merger.weight", DType::kF32, {6}, four});
  ts.push_back({"mtp.fc.weight", DType::kF32, {3, 2}, four});
  ts.push_back({"something.else", DType::kF32, {6}, four});
  ts.push_back({"model.language_model.layers.0.mlp.extra_scale", DType::kF32, {6}, four});
  std::string d = write(c);
  HostWeights r = load_host_weights(d);
  EXPECT_EQ(r.stats.n_visual_tensors, 2);
  EXPECT_EQ(r.stats.visual_params, 12);
  EXPECT_EQ(r.stats.n_mtp_tensors, 1);
  EXPECT_EQ(r.stats.mtp_params, 6);
  EXPECT_EQ(r.stats.n_other_tensors, 2);
  ASSERT_EQ(r.stats.other_tensor_names.size(), 2u);
  expect_same_weights(w, r);
}

TEST_F(ModelWeightsErrors, DuplicateUnderBothPrefixes) {
  RawTensor copy = *find_raw(ts, "model.language_model.norm.weight");
  copy.name = "model.norm.weight";
  ts.push_back(copy);
  std::string d = write(c);
  expect_error([&] { load_host_weights(d); }, {"norm.weight", "appears twice"});
}

// A layer index written "03" (or too long to be a number) once reached the layer-type message,
// which then contradicted itself ("belongs to a full-attention layer, but ... makes layer 3 a
// full_attention layer"; found by fuzzing).
TEST_F(ModelWeightsErrors, NonCanonicalLayerIndexIsNamed) {
  for (const std::string idx : {"03", "+3", "99999999999999999999"}) {
    SetUp();
    RawTensor copy = *find_raw(ts, "model.language_model.layers.3.mlp.up_proj.weight");
    copy.name = "model.language_model.layers." + idx + ".mlp.up_proj.weight";
    ts.push_back(copy);
    std::string d = write(c);
    expect_error([&] { load_host_weights(d); },
                 {"layers." + idx + ".mlp.up_proj.weight", "'" + idx + "'", "not written as a layer number"});
  }
}

TEST_F(ModelWeightsErrors, NoCheckpointFiles) {
  TempDir d("empty");
  expect_error([&] { load_host_weights(d.path); }, {d.path, "config.json"});
  std::ofstream(d.path + "/config.json") << model_config_to_json(c, false);
  expect_error([&] { load_host_weights(d.path); }, {d.path, "model.safetensors"});
  expect_error([&] { load_host_weights(d.path + "/nope"); }, {"nope", "not a directory"});
}

}  // namespace
}  // namespace ds

namespace ds {
namespace {

// Checkpoints written by HF transformers' save_pretrained (tools/, tests/data/golden): both
// layouts load to the same bytes, and each fused field is exactly its parts stacked in order.
TEST(ModelWeightsGolden, HfSavedCheckpointsLoadAndFuseExactly) {
  const std::string root = std::string(DS_TEST_DATA) + "/golden";
  if (!fs::exists(root)) GTEST_SKIP() << root << " absent";
  for (const char* name : {"qwen35_27b_ratios", "qwen35_other_ratios"}) {
    SCOPED_TRACE(name);
    const std::string text_dir = root + "/" + name + "/text",
                      wrap_dir = root + "/" + name + "/wrapper";
    if (!fs::exists(text_dir) || !fs::exists(wrap_dir)) GTEST_SKIP() << "golden layouts absent";
    HostWeights t = load_host_weights(text_dir);
    HostWeights w = load_host_weights(wrap_dir);
    EXPECT_FALSE(t.config.is_wrapper);
    EXPECT_TRUE(w.config.is_wrapper);
    EXPECT_GT(t.stats.n_files, 1);
    EXPECT_GT(w.stats.n_visual_tensors + w.stats.n_mtp_tensors, 0);
    EXPECT_EQ(t.stats.n_other_tensors, 0);
    EXPECT_EQ(w.stats.n_other_tensors, 0);
    expect_same_weights(t, w);
    // Each fused field equals its parts read straight from the safetensors files.
    SafetensorsCheckpoint ck(text_dir);
    for (const CheckpointTensor& ct : checkpoint_tensors(t.config)) {
      const TensorLocation* loc =
          ck.find(ct.name == "lm_head.weight" ? ct.name : "model." + ct.name);
      ASSERT_NE(loc, nullptr) << ct.name;
      const TensorView& f =
          ct.layer < 0 ? t.*(ct.spec->global_field) : t.layers[ct.layer].*(ct.spec->layer_field);
      const int64_t row = f.numel() / f.shape[0];
      const size_t es = dtype_size(f.dtype);
      ASSERT_EQ(std::memcmp(f.data + ct.row_offset * row * es, loc->file->tensor_data(*loc->entry),
                            loc->entry->end - loc->entry->begin),
                0)
          << ct.name;
    }
  }
}

}  // namespace
}  // namespace ds
