// Tests of config.json parsing: the qwen3_5 wrapper and qwen3_5_text layouts, layer_types vs
// full_attention_interval, rope parameter locations and defaults (checked against transformers
// 5.x Qwen3_5TextConfig), eos as int or list, and the errors (each naming the file and field).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "model/config.h"
#include "model/weights.h"

namespace ds {
namespace {

using nlohmann::json;

const std::string k27BConfig = std::string(DS_TEST_DATA) + "/model/qwen3_5_27b_config.json";

json small_text() {
  return json{{"model_type", "qwen3_5_text"},
              {"vocab_size", 1000},
              {"hidden_size", 64},
              {"intermediate_size", 128},
              {"num_hidden_layers", 8},
              {"num_attention_heads", 8},
              {"num_key_value_heads", 2},
              {"head_dim", 32},
              {"linear_num_key_heads", 2},
              {"linear_num_value_heads", 4},
              {"linear_key_head_dim", 16},
              {"linear_value_head_dim", 24},
              {"max_position_embeddings", 4096}};
}

ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "test/config.json"); }

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

void expect_bad(const json& j, std::initializer_list<std::string> parts) {
  std::vector<std::string> all(parts);
  all.push_back("test/config.json");
  try {
    parse(j);
    ADD_FAILURE() << "expected ds::Error for " << j.dump();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const std::string& p : all)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

TEST(ModelConfig, Real27BWrapperConfig) {
  ModelConfig c = load_model_config(k27BConfig);
  EXPECT_TRUE(c.is_wrapper);
  EXPECT_EQ(c.model_type, "qwen3_5_text");
  EXPECT_EQ(c.source, k27BConfig);
  EXPECT_EQ(c.d_model, 5120);
  EXPECT_EQ(c.n_layers, 64);
  EXPECT_EQ(c.d_ff, 17408);
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.n_heads, 24);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.n_k_heads, 16);
  EXPECT_EQ(c.n_v_heads, 48);
  EXPECT_EQ(c.d_k, 128);
  EXPECT_EQ(c.d_v, 128);
  EXPECT_EQ(c.conv_kernel, 4);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.mrope_section, (std::vector<int>{11, 11, 10}));
  EXPECT_TRUE(c.mrope_interleaved);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{248044}));
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.n_full_layers(), 16);
  EXPECT_EQ(c.n_linear_layers(), 48);
  for (int i = 0; i < 64; ++i)
    EXPECT_EQ(c.layer_types[i], (i + 1) % 4 == 0 ? LayerType::kFull : LayerType::kLinear);
  EXPECT_EQ(c.q_proj_dim(), 12288);
  EXPECT_EQ(c.kv_dim(), 1024);
  EXPECT_EQ(c.gdn_qkv_dim(), 10240);
  EXPECT_EQ(c.gdn_in_dim(), 10240 + 6144 + 96);
  // SPEC.md: about 26.9B text parameters.
  EXPECT_GT(c.n_params_text(), 26.8e9);
  EXPECT_LT(c.n_params_text(), 27.0e9);
  EXPECT_NE(c.summary().find("48 Gated DeltaNet + 16 gated attention"), std::string::npos);
}

TEST(ModelConfig, HfDefaultsWhenFieldsAreAbsent) {
  // transformers' Qwen3_5TextConfig() defaults (the 9B-like shape).
  ModelConfig c = parse(json{{"model_type", "qwen3_5_text"}});
  EXPECT_EQ(c.d_model, 4096);
  EXPECT_EQ(c.n_layers, 32);
  EXPECT_EQ(c.d_ff, 12288);
  EXPECT_EQ(c.n_heads, 16);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.n_v_heads, 32);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);  // default_theta
  EXPECT_FLOAT_EQ(c.partial_rotary_factor, 0.25f);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(c.n_full_layers(), 8);  // full_attention_interval 4
  EXPECT_TRUE(c.eos_token_ids.empty());
}

TEST(ModelConfig, TextOnlyWithLayerTypesList) {
  json j = small_text();
  j["layer_types"] = {"linear_attention", "full_attention", "linear_attention", "linear_attention",
                      "full_attention",   "full_attention", "linear_attention", "full_attention"};
  ModelConfig c = parse(j);
  EXPECT_FALSE(c.is_wrapper);
  EXPECT_EQ(c.layer_types,
            (std::vector<LayerType>{LayerType::kLinear, LayerType::kFull, LayerType::kLinear,
                                    LayerType::kLinear, LayerType::kFull, LayerType::kFull,
                                    LayerType::kLinear, LayerType::kFull}));
  EXPECT_EQ(c.d_v, 24);
}

TEST(ModelConfig, FullAttentionInterval) {
  json j = small_text();
  j["full_attention_interval"] = 3;
  ModelConfig c = parse(j);
  std::vector<LayerType> want;
  for (int i = 0; i < 8; ++i)
    want.push_back((i + 1) % 3 == 0 ? LayerType::kFull : LayerType::kLinear);
  EXPECT_EQ(c.layer_types, want);
  // layer_types wins over the interval.
  j["layer_types"] = std::vector<std::string>(8, "linear_attention");
  EXPECT_EQ(parse(j).n_full_layers(), 0);
}

TEST(ModelConfig, RopeLocationsAndPrecedence) {
  json j = small_text();
  j["rope_theta"] = 5e6;  // top level (older layout)
  ModelConfig c = parse(j);
  EXPECT_DOUBLE_EQ(c.rope_theta, 5e6);
  EXPECT_EQ(c.rotary_dim, 8);
  j["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(parse(j).rotary_dim, 16);
  // rope_parameters values win over top-level ones.
  j["rope_parameters"] = {
      {"rope_type", "default"}, {"rope_theta", 77.0}, {"partial_rotary_factor", 0.125}};
  c = parse(j);
  EXPECT_DOUBLE_EQ(c.rope_theta, 77.0);
  EXPECT_EQ(c.rotary_dim, 4);
  // ... top-level fills what rope_parameters lacks.
  j["rope_parameters"] = {{"rope_theta", 77.0}};
  EXPECT_EQ(parse(j).rotary_dim, 16);
  // Legacy rope_scaling wins over rope_parameters (transformers: `rope_scaling or
  // rope_parameters`).
  j["rope_scaling"] = {{"type", "default"}, {"rope_theta", 123.0}, {"mrope_section", {4, 2, 2}}};
  c = parse(j);
  EXPECT_DOUBLE_EQ(c.rope_theta, 123.0);
  EXPECT_EQ(c.mrope_section, (std::vector<int>{4, 2, 2}));
  EXPECT_FALSE(c.mrope_interleaved);
  j["rope_scaling"] = nullptr;
  EXPECT_DOUBLE_EQ(parse(j).rope_theta, 77.0);
  // Scaled RoPE is refused rather than silently ignored.
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  expect_bad(j, {"rope_type 'yarn'", "rope_parameters"});
}

TEST(ModelConfig, WrapperTieEmbeddingsAndSpecialTokens) {
  json w = {
      {"model_type", "qwen3_5"}, {"text_config", small_text()}, {"tie_word_embeddings", true}};
  w["text_config"].erase("model_type");
  ModelConfig c = parse(w);
  EXPECT_TRUE(c.is_wrapper);
  EXPECT_TRUE(c.tie_word_embeddings);  // from the top level
  w["text_config"]["tie_word_embeddings"] = false;
  EXPECT_FALSE(parse(w).tie_word_embeddings);  // text_config wins
  w["eos_token_id"] = 7;                       // top level used when text_config has none
  EXPECT_EQ(parse(w).eos_token_ids, (std::vector<int>{7}));
  w["text_config"]["eos_token_id"] = {5, 6};
  w["text_config"]["bos_token_id"] = 1;
  c = parse(w);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{5, 6}));
  EXPECT_EQ(c.bos_token_id, 1);
}

TEST(ModelConfig, RoundTripThroughJson) {
  for (bool wrapper : {false, true}) {
    ModelConfig c = tiny_model_config(333);
    c.eos_token_ids = {1, 2};
    c.rms_norm_eps = 1e-5f;
    ModelConfig r = parse_model_config(model_config_to_json(c, wrapper), "x");
    EXPECT_EQ(r.is_wrapper, wrapper);
    EXPECT_EQ(r.vocab_size, 333);
    EXPECT_EQ(r.layer_types, c.layer_types);
    EXPECT_EQ(r.rotary_dim, c.rotary_dim);
    EXPECT_EQ(r.rms_norm_eps, c.rms_norm_eps);
    EXPECT_EQ(r.eos_token_ids, c.eos_token_ids);
    EXPECT_EQ(r.n_params_text(), c.n_params_text());
    EXPECT_EQ(r.mrope_section, c.mrope_section);
    EXPECT_NE(model_config_to_json(c, wrapper).find("1e-05"), std::string::npos);
  }
}

TEST(ModelConfig, Errors) {
  expect_error([] { parse_model_config("{\"model_type\": ", "test/config.json"); },
               {"test/config.json", "invalid JSON"});
  expect_error([] { parse_model_config("[1, 2]", "test/config.json"); },
               {"test/config.json", "object"});
  expect_error([] { load_model_config("/nonexistent/config.json"); },
               {"/nonexistent/config.json", "cannot open"});
  // Not a file, endless, too deep: clear errors, no hang and no memory blow-up (found by fuzzing).
  expect_error([] { load_model_config("/dev/zero"); }, {"/dev/zero", "not a regular file"});
  expect_error([] { load_model_config("/tmp"); }, {"/tmp", "is a directory"});
  expect_error([] { parse_model_config(std::string(1000, '[') + std::string(1000, ']'), "c.json"); },
               {"c.json", "nested deeper than 64"});
  expect_bad(json{{"hidden_size", 64}}, {"model_type"});
  expect_bad(json{{"model_type", "llama"}}, {"unsupported model_type 'llama'"});
  expect_bad(json{{"model_type", "qwen3_5_moe"}}, {"qwen3_5_moe", "not supported"});
  expect_bad(json{{"model_type", "qwen3_5"}}, {"text_config"});
  expect_bad(json{{"model_type", "qwen3_5"}, {"text_config", 3}}, {"text_config", "object"});

  auto with = [](const char* key, json v) {
    json j = small_text();
    j[key] = v;
    return j;
  };
  expect_bad(with("hidden_size", 0), {"hidden_size", "positive"});
  expect_bad(with("hidden_size", "64"), {"hidden_size", "integer", "string"});
  expect_bad(with("hidden_size", 64.5), {"hidden_size", "integer"});
  expect_bad(with("num_hidden_layers", -1), {"num_hidden_layers"});
  expect_bad(with("num_attention_heads", 1ll << 40), {"num_attention_heads", "out of range"});
  expect_bad(with("vocab_size", 1 << 30), {"vocab_size"});
  expect_bad(with("num_key_value_heads", 3),
             {"num_attention_heads (8)", "num_key_value_heads (3)"});
  expect_bad(with("linear_num_value_heads", 5),
             {"linear_num_value_heads (5)", "linear_num_key_heads (2)"});
  expect_bad(with("partial_rotary_factor", 0.1), {"rotary", "even"});  // 32 * 0.1 = 3
  expect_bad(with("partial_rotary_factor", 1.5), {"partial_rotary_factor"});
  expect_bad(with("rms_norm_eps", -1.0), {"rms_norm_eps"});
  expect_bad(with("rope_theta", 0.5), {"rope_theta"});
  expect_bad(with("layer_types", json::array({"linear_attention"})),
             {"layer_types has 1 entries", "8"});
  expect_bad(with("layer_types", json::array({"linear_attention", "sliding_attention"})),
             {"layer_types[1]", "sliding_attention"});
  expect_bad(with("layer_types", "full_attention"), {"layer_types", "list"});
  expect_bad(with("full_attention_interval", 0), {"full_attention_interval", "positive"});
  expect_bad(with("eos_token_id", 5000), {"eos_token_id 5000", "vocabulary"});
  expect_bad(with("eos_token_id", json::array({1, "x"})), {"eos_token_id[1]"});
  expect_bad(with("hidden_act", "gelu"), {"hidden_act", "gelu"});
  expect_bad(with("attention_bias", true), {"attention_bias"});
  expect_bad(with("tie_word_embeddings", "yes"), {"tie_word_embeddings", "true or false"});
  expect_bad(with("linear_conv_kernel_dim", 1000), {"linear_conv_kernel_dim"});
  expect_bad(with("num_hidden_layers", 5000), {"num_hidden_layers", "implausibly large"});
  {  // each size alone is fine, together they overflow any derived int64 size
    json big = small_text();
    big["hidden_size"] = 1 << 20;
    big["intermediate_size"] = 1 << 20;
    big["num_hidden_layers"] = 4000;
    big.erase("layer_types");
    expect_bad(big, {"implausibly large"});
  }
  // Wrapper errors name the text_config field.
  json w = {{"model_type", "qwen3_5"}, {"text_config", with("head_dim", -4)}};
  expect_bad(w, {"head_dim"});
  w = {{"model_type", "qwen3_5"}, {"text_config", with("hidden_size", "x")}};
  expect_bad(w, {"text_config.hidden_size"});
}

TEST(ModelConfig, ParamCountMatchesTable) {
  ModelConfig c = tiny_model_config();
  HostWeights w = make_synthetic_weights(c, 1);
  int64_t n = w.embed.numel() + w.final_norm.numel() + w.lm_head.numel();
  for (const LayerWeights& l : w.layers) {
    for (auto f : {&LayerWeights::input_norm, &LayerWeights::post_norm, &LayerWeights::mlp_gate_up,
                   &LayerWeights::mlp_down, &LayerWeights::attn_qkv, &LayerWeights::attn_o,
                   &LayerWeights::q_norm, &LayerWeights::k_norm, &LayerWeights::gdn_in,
                   &LayerWeights::gdn_conv, &LayerWeights::gdn_dt_bias, &LayerWeights::gdn_A_log,
                   &LayerWeights::gdn_norm, &LayerWeights::gdn_out}) {
      if (!(l.*f).empty()) n += (l.*f).numel();
    }
  }
  EXPECT_EQ(n, c.n_params_text());
  c.tie_word_embeddings = true;
  EXPECT_EQ(n - w.lm_head.numel(), c.n_params_text());
}

}  // namespace
}  // namespace ds
