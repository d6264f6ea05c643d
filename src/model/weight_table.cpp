// The checkpoint-name table (see weight_table.h) and the per-tensor synthetic-init rules.
#include "model/weight_table.h"

#include <cmath>

#include "core/error.h"

namespace ds {
namespace {

using Shape = std::vector<int64_t>;

Shape shape_embed(const ModelConfig& c) { return {c.vocab_size, c.d_model}; }
Shape shape_hidden(const ModelConfig& c) { return {c.d_model}; }
Shape shape_gate_up(const ModelConfig& c) { return {c.d_ff, c.d_model}; }
Shape shape_down(const ModelConfig& c) { return {c.d_model, c.d_ff}; }
Shape shape_q(const ModelConfig& c) { return {c.q_proj_dim(), c.d_model}; }
Shape shape_kv(const ModelConfig& c) { return {c.kv_dim(), c.d_model}; }
Shape shape_o(const ModelConfig& c) { return {c.d_model, c.attn_out_dim()}; }
Shape shape_head_dim(const ModelConfig& c) { return {c.head_dim}; }
Shape shape_gdn_qkv(const ModelConfig& c) { return {c.gdn_qkv_dim(), c.d_model}; }
Shape shape_gdn_z(const ModelConfig& c) { return {c.gdn_z_dim(), c.d_model}; }
Shape shape_gdn_ba(const ModelConfig& c) { return {c.n_v_heads, c.d_model}; }
Shape shape_conv(const ModelConfig& c) { return {c.gdn_qkv_dim(), 1, c.conv_kernel}; }
Shape shape_v_heads(const ModelConfig& c) { return {c.n_v_heads}; }
Shape shape_d_v(const ModelConfig& c) { return {c.d_v}; }
Shape shape_gdn_out(const ModelConfig& c) { return {c.d_model, c.gdn_z_dim()}; }

constexpr auto kN = SyntheticKind::kNormal;
using HW = HostWeights;
using LW = LayerWeights;

// clang-format off
const std::vector<WeightSpec> kTable = {
  // name                                 scope                     kind                  global field      layer field        part parts shape            init: kind mean std lo hi
  {"embed_tokens.weight",                 LayerScope::kGlobal,      ParamKind::kEmbedding, &HW::embed,      nullptr,           0, 1, shape_embed,      kN, 0.0f, 0.02f, 0, 0},
  {"norm.weight",                         LayerScope::kGlobal,      ParamKind::kNorm,      &HW::final_norm, nullptr,           0, 1, shape_hidden,     kN, 0.0f, 0.1f, 0, 0},
  {"lm_head.weight",                      LayerScope::kGlobal,      ParamKind::kLmHead,    &HW::lm_head,    nullptr,           0, 1, shape_embed,      kN, 0.0f, 0.0f, 0, 0},
  {"input_layernorm.weight",              LayerScope::kAnyLayer,    ParamKind::kNorm,      nullptr, &LW::input_norm,           0, 1, shape_hidden,     kN, 0.0f, 0.1f, 0, 0},
  {"post_attention_layernorm.weight",     LayerScope::kAnyLayer,    ParamKind::kNorm,      nullptr, &LW::post_norm,            0, 1, shape_hidden,     kN, 0.0f, 0.1f, 0, 0},
  {"self_attn.q_proj.weight",             LayerScope::kFullLayer,   ParamKind::kAttention, nullptr, &LW::attn_qkv,             0, 3, shape_q,          kN, 0.0f, 0.0f, 0, 0},
  {"self_attn.k_proj.weight",             LayerScope::kFullLayer,   ParamKind::kAttention, nullptr, &LW::attn_qkv,             1, 3, shape_kv,         kN, 0.0f, 0.0f, 0, 0},
  {"self_attn.v_proj.weight",             LayerScope::kFullLayer,   ParamKind::kAttention, nullptr, &LW::attn_qkv,             2, 3, shape_kv,         kN, 0.0f, 0.0f, 0, 0},
  {"self_attn.o_proj.weight",             LayerScope::kFullLayer,   ParamKind::kAttention, nullptr, &LW::attn_o,               0, 1, shape_o,          kN, 0.0f, 0.0f, 0, 0},
  {"self_attn.q_norm.weight",             LayerScope::kFullLayer,   ParamKind::kNorm,      nullptr, &LW::q_norm,               0, 1, shape_head_dim,   kN, 0.0f, 0.1f, 0, 0},
  {"self_attn.k_norm.weight",             LayerScope::kFullLayer,   ParamKind::kNorm,      nullptr, &LW::k_norm,               0, 1, shape_head_dim,   kN, 0.0f, 0.1f, 0, 0},
  {"linear_attn.in_proj_qkv.weight",      LayerScope::kLinearLayer, ParamKind::kGdn,       nullptr, &LW::gdn_in,               0, 4, shape_gdn_qkv,    kN, 0.0f, 0.0f, 0, 0},
  {"linear_attn.in_proj_z.weight",        LayerScope::kLinearLayer, ParamKind::kGdn,       nullptr, &LW::gdn_in,               1, 4, shape_gdn_z,      kN, 0.0f, 0.0f, 0, 0},
  {"linear_attn.in_proj_b.weight",        LayerScope::kLinearLayer, ParamKind::kGdn,       nullptr, &LW::gdn_in,               2, 4, shape_gdn_ba,     kN, 0.0f, 0.0f, 0, 0},
  {"linear_attn.in_proj_a.weight",        LayerScope::kLinearLayer, ParamKind::kGdn,       nullptr, &LW::gdn_in,               3, 4, shape_gdn_ba,     kN, 0.0f, 0.0f, 0, 0},
  {"linear_attn.conv1d.weight",           LayerScope::kLinearLayer, ParamKind::kGdn,       nullptr, &LW::gdn_conv,             0, 1, shape_conv,       kN, 0.0f, 0.0f, 0, 0},
  {"linear_attn.dt_bias",                 LayerScope::kLinearLayer, ParamKind::kGdn,       nullptr, &LW::gdn_dt_bias,          0, 1, shape_v_heads,    kN, 0.0f, 0.1f, 0, 0},
  {"linear_attn.A_log",                   LayerScope::kLinearLayer, ParamKind::kGdn,       nullptr, &LW::gdn_A_log,            0, 1, shape_v_heads,    SyntheticKind::kLogUniform, 0, 0, 1.0f, 16.0f},
  {"linear_attn.norm.weight",             LayerScope::kLinearLayer, ParamKind::kNorm,      nullptr, &LW::gdn_norm,             0, 1, shape_d_v,        kN, 1.0f, 0.1f, 0, 0},
  {"linear_attn.out_proj.weight",         LayerScope::kLinearLayer, ParamKind::kGdn,       nullptr, &LW::gdn_out,              0, 1, shape_gdn_out,    kN, 0.0f, 0.0f, 0, 0},
  {"mlp.gate_proj.weight",                LayerScope::kAnyLayer,    ParamKind::kMlp,       nullptr, &LW::mlp_gate_up,          0, 2, shape_gate_up,    kN, 0.0f, 0.0f, 0, 0},
  {"mlp.up_proj.weight",                  LayerScope::kAnyLayer,    ParamKind::kMlp,       nullptr, &LW::mlp_gate_up,          1, 2, shape_gate_up,    kN, 0.0f, 0.0f, 0, 0},
  {"mlp.down_proj.weight",                LayerScope::kAnyLayer,    ParamKind::kMlp,       nullptr, &LW::mlp_down,             0, 1, shape_down,       kN, 0.0f, 0.0f, 0, 0},
};
// clang-format on

bool in_layer(LayerScope s, LayerType t) {
  return s == LayerScope::kAnyLayer || (s == LayerScope::kFullLayer && t == LayerType::kFull) ||
         (s == LayerScope::kLinearLayer && t == LayerType::kLinear);
}

// 64-bit FNV-1a of a name, the per-tensor part of synthetic seeds.
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

const char* param_kind_name(ParamKind k) {
  switch (k) {
    case ParamKind::kEmbedding:
      return "embedding";
    case ParamKind::kLmHead:
      return "lm_head";
    case ParamKind::kAttention:
      return "attention";
    case ParamKind::kGdn:
      return "gdn";
    case ParamKind::kMlp:
      return "mlp";
    case ParamKind::kNorm:
      return "norms";
  }
  return "?";
}

const std::vector<WeightSpec>& weight_table() { return kTable; }

int64_t CheckpointTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<CheckpointTensor> checkpoint_tensors(const ModelConfig& c) {
  std::vector<CheckpointTensor> out;
  for (const WeightSpec& s : kTable) {
    if (s.scope != LayerScope::kGlobal) continue;
    if (s.kind == ParamKind::kLmHead && c.tie_word_embeddings) continue;
    out.push_back({s.name, &s, -1, s.shape(c), 0});
  }
  for (int il = 0; il < c.n_layers; ++il) {
    LayerType t = c.layer_types.at(il);
    // Row offsets inside each fused field, accumulated in table (= part) order.
    int64_t rows_gdn_in = 0, rows_qkv = 0, rows_gate_up = 0;
    for (const WeightSpec& s : kTable) {
      if (s.scope == LayerScope::kGlobal || !in_layer(s.scope, t)) continue;
      Shape shape = s.shape(c);
      int64_t* acc = s.layer_field == &LW::gdn_in        ? &rows_gdn_in
                     : s.layer_field == &LW::attn_qkv    ? &rows_qkv
                     : s.layer_field == &LW::mlp_gate_up ? &rows_gate_up
                                                         : nullptr;
      int64_t offset = 0;
      if (acc != nullptr) {
        offset = *acc;
        *acc += shape[0];
      }
      out.push_back(
          {"layers." + std::to_string(il) + "." + s.name, &s, il, std::move(shape), offset});
    }
  }
  return out;
}

SyntheticSpec synthetic_tensor_spec(const ModelConfig& c, const std::string& name,
                                    uint64_t model_seed) {
  const WeightSpec* spec = nullptr;
  std::string suffix = name;
  if (name.rfind("layers.", 0) == 0) {
    size_t dot = name.find('.', 7);
    if (dot != std::string::npos) suffix = name.substr(dot + 1);
  }
  for (const WeightSpec& s : kTable) {
    if (suffix == s.name) spec = &s;
  }
  if (spec == nullptr) throw_error("synthetic weights: unknown tensor name '", name, "'");
  SyntheticSpec out;
  out.seed = mix64(mix64(model_seed ^ 0x5eed5eed5eed5eedull) ^ fnv1a(name));
  out.kind = spec->init_kind;
  out.mean = spec->init_mean;
  out.std = spec->init_std;
  out.lo = spec->init_lo;
  out.hi = spec->init_hi;
  if (out.kind == SyntheticKind::kNormal && out.std == 0.0f) {
    Shape shape = spec->shape(c);
    out.std = 1.0f / std::sqrt(static_cast<float>(shape.back()));  // 1/sqrt(fan_in)
  }
  return out;
}

}  // namespace ds
