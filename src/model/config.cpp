// Parses the Hugging Face config.json of a Qwen3.5 model (the "qwen3_5" vision-language wrapper or
// a text-only "qwen3_5_text" config) into ModelConfig, with the field names and defaults of
// transformers' Qwen3_5TextConfig (transformers 5.x), and checks it for consistency.
#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/file_io.h"

namespace ds {
namespace {

using nlohmann::json;

// A JSON object plus the dotted path that names it in errors ("text_config.").
struct Section {
  const json* obj = nullptr;
  std::string path;
  const std::string* where = nullptr;

  const json* find(const char* key) const {
    if (obj == nullptr) return nullptr;
    auto it = obj->find(key);
    if (it == obj->end() || it->is_null()) return nullptr;
    return &*it;
  }
  std::string field(const char* key) const { return path + key; }

  [[noreturn]] void type_error(const char* key, const char* expected, const json& v) const {
    throw_error(*where, ": field '", field(key), "' must be ", expected, ", got ", v.type_name(),
                " (", v.dump().substr(0, 60), ")");
  }

  int64_t get_int64(const char* key, int64_t def) const {
    const json* v = find(key);
    if (v == nullptr) return def;
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() &&
          v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
        throw_error(*where, ": field '", field(key), "' is out of range (", v->dump(), ")");
      }
      return v->get<int64_t>();
    }
    // Some writers emit integral values as floats (e.g. 4096.0); accept those exactly.
    if (v->is_number_float()) {
      double d = v->get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15)
        return static_cast<int64_t>(d);
    }
    type_error(key, "an integer", *v);
  }
  int get_int(const char* key, int def) const {
    int64_t v = get_int64(key, def);
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
      throw_error(*where, ": field '", field(key), "' is out of range (", v, ")");
    }
    return static_cast<int>(v);
  }
  double get_double(const char* key, double def) const {
    const json* v = find(key);
    if (v == nullptr) return def;
    if (!v->is_number()) type_error(key, "a number", *v);
    return v->get<double>();
  }
  bool get_bool(const char* key, bool def) const {
    const json* v = find(key);
    if (v == nullptr) return def;
    if (!v->is_boolean()) type_error(key, "true or false", *v);
    return v->get<bool>();
  }
  std::string get_string(const char* key, const std::string& def) const {
    const json* v = find(key);
    if (v == nullptr) return def;
    if (!v->is_string()) type_error(key, "a string", *v);
    return v->get<std::string>();
  }
  bool has(const char* key) const { return find(key) != nullptr; }
};

std::vector<int> parse_int_list(const Section& s, const char* key) {
  const json* v = s.find(key);
  std::vector<int> out;
  if (v == nullptr) return out;
  if (v->is_number()) {
    out.push_back(s.get_int(key, 0));
    return out;
  }
  if (!v->is_array()) s.type_error(key, "an integer or a list of integers", *v);
  for (size_t i = 0; i < v->size(); ++i) {
    const json& e = (*v)[i];
    if (!e.is_number_integer() || e.get<int64_t>() < std::numeric_limits<int>::min() ||
        e.get<int64_t>() > std::numeric_limits<int>::max()) {
      throw_error(*s.where, ": field '", s.field(key), "[", i, "]' must be an integer, got ",
                  e.dump().substr(0, 60));
    }
    out.push_back(e.get<int>());
  }
  return out;
}

// Rope parameters, following transformers' convert_rope_params_to_dict: `rope_scaling` (legacy
// name) wins over `rope_parameters`; values inside that dict win over top-level keys; theta
// defaults to 10000 and partial_rotary_factor to 0.25 (Qwen3_5TextConfig's default).
void parse_rope(const Section& text, ModelConfig& c) {
  Section rope{nullptr, "", text.where};
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const json* v = text.find(key);
    if (v == nullptr) continue;
    if (!v->is_object()) text.type_error(key, "an object", *v);
    if (v->empty()) continue;  // `rope_scaling or rope_parameters`: an empty dict is falsy
    rope = Section{v, text.path + key + ".", text.where};
    break;
  }
  // Rope parameters nested per layer type: the attention layers use the "full_attention" entry.
  if (const json* nested = rope.find("full_attention"); nested != nullptr && nested->is_object()) {
    rope = Section{nested, rope.path + "full_attention.", text.where};
  }
  c.rope_theta = rope.get_double("rope_theta", text.get_double("rope_theta", 10000.0));
  c.partial_rotary_factor = static_cast<float>(
      rope.get_double("partial_rotary_factor", text.get_double("partial_rotary_factor", 0.25)));
  std::string rope_type = rope.get_string("rope_type", rope.get_string("type", "default"));
  if (rope_type != "default" && rope_type != "mrope") {
    throw_error(*text.where, ": rope_type '", rope_type, "' (field '", rope.path,
                "rope_type') is not supported; only the default (unscaled) RoPE is implemented");
  }
  c.mrope_section = parse_int_list(rope, "mrope_section");
  if (c.mrope_section.empty() && !rope.has("mrope_section")) c.mrope_section = {11, 11, 10};
  c.mrope_interleaved = rope.get_bool("mrope_interleaved", false);
  // HF: dim = int(head_dim * partial_rotary_factor) (truncation).
  double rd = static_cast<double>(c.head_dim) * c.partial_rotary_factor;
  c.rotary_dim = (std::isfinite(rd) && rd >= 0 && rd < 1e9) ? static_cast<int>(rd) : -1;
}

std::vector<LayerType> parse_layer_types(const Section& text, int n_layers) {
  std::vector<LayerType> types;
  if (const json* v = text.find("layer_types"); v != nullptr) {
    if (!v->is_array()) text.type_error("layer_types", "a list of strings", *v);
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      std::string s = e.is_string() ? e.get<std::string>() : e.dump().substr(0, 60);
      if (s == "linear_attention") {
        types.push_back(LayerType::kLinear);
      } else if (s == "full_attention") {
        types.push_back(LayerType::kFull);
      } else {
        throw_error(*text.where, ": field '", text.field("layer_types"), "[", i, "]' is '", s,
                    "'; expected \"linear_attention\" or \"full_attention\"");
      }
    }
    return types;
  }
  int interval = text.get_int("full_attention_interval", 4);
  if (interval <= 0) {
    throw_error(*text.where, ": field '", text.field("full_attention_interval"),
                "' must be positive, got ", interval);
  }
  if (n_layers < 0 || n_layers > (1 << 20)) return types;  // validate() reports it
  for (int i = 0; i < n_layers; ++i) {
    types.push_back((i + 1) % interval == 0 ? LayerType::kFull : LayerType::kLinear);
  }
  return types;
}

}  // namespace

// config.json is a few KB; its nesting a handful of levels (text_config, rope_parameters).
constexpr uint64_t kMaxConfigBytes = 16ull << 20;
constexpr int kMaxConfigJsonDepth = 64;

ModelConfig parse_model_config(const std::string& json_text, const std::string& where) {
  check_json_depth(json_text, kMaxConfigJsonDepth, where);
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    throw_error(where, ": invalid JSON: ", e.what());
  }
  if (!root.is_object())
    throw_error(where, ": expected a JSON object at the top level, got ", root.type_name());
  Section top{&root, "", &where};

  ModelConfig c;
  c.source = where;
  std::string model_type = top.get_string("model_type", "");
  Section text = top;
  if (model_type == "qwen3_5") {
    const json* tc = top.find("text_config");
    if (tc == nullptr) throw_error(where, ": model_type 'qwen3_5' needs a 'text_config' object");
    if (!tc->is_object()) top.type_error("text_config", "an object", *tc);
    text = Section{tc, "text_config.", &where};
    c.is_wrapper = true;
    std::string inner = text.get_string("model_type", "qwen3_5_text");
    if (inner != "qwen3_5_text") {
      throw_error(where, ": field 'text_config.model_type' is '", inner,
                  "'; expected 'qwen3_5_text'");
    }
  } else if (model_type == "qwen3_5_text") {
    c.is_wrapper = false;
  } else if (model_type.empty()) {
    throw_error(where, ": missing field 'model_type' (expected 'qwen3_5' or 'qwen3_5_text')");
  } else if (model_type.rfind("qwen3_5_moe", 0) == 0 || model_type == "qwen3_next") {
    throw_error(
        where, ": model_type '", model_type,
        "' (mixture-of-experts) is not supported; deltaserve serves the dense Qwen3.5 models "
        "(model_type 'qwen3_5' / 'qwen3_5_text')");
  } else {
    throw_error(where, ": unsupported model_type '", model_type,
                "' (expected 'qwen3_5' or 'qwen3_5_text')");
  }
  c.model_type = "qwen3_5_text";

  // Defaults are those of transformers' Qwen3_5TextConfig.
  c.vocab_size = text.get_int("vocab_size", 248320);
  c.d_model = text.get_int("hidden_size", 4096);
  c.d_ff = text.get_int("intermediate_size", 12288);
  c.n_layers = text.get_int("num_hidden_layers", 32);
  c.n_heads = text.get_int("num_attention_heads", 16);
  c.n_kv_heads = text.get_int("num_key_value_heads", 4);
  c.head_dim = text.get_int("head_dim", 256);
  c.max_position_embeddings = text.get_int("max_position_embeddings", 32768);
  c.rms_norm_eps = static_cast<float>(text.get_double("rms_norm_eps", 1e-6));
  c.attn_output_gate = text.get_bool("attn_output_gate", true);
  c.conv_kernel = text.get_int("linear_conv_kernel_dim", 4);
  c.d_k = text.get_int("linear_key_head_dim", 128);
  c.d_v = text.get_int("linear_value_head_dim", 128);
  c.n_k_heads = text.get_int("linear_num_key_heads", 16);
  c.n_v_heads = text.get_int("linear_num_value_heads", 32);
  // tie_word_embeddings may sit at either level; the text_config value wins when present.
  c.tie_word_embeddings =
      text.get_bool("tie_word_embeddings", top.get_bool("tie_word_embeddings", false));

  std::string act = text.get_string("hidden_act", "silu");
  if (act != "silu") {
    throw_error(where, ": field '", text.field("hidden_act"), "' is '", act,
                "'; only 'silu' is supported");
  }
  if (text.get_bool("attention_bias", false)) {
    throw_error(where, ": field '", text.field("attention_bias"),
                "' is true; attention projections with a bias are not supported");
  }
  c.layer_types = parse_layer_types(text, c.n_layers);
  parse_rope(text, c);

  // Special tokens: text_config first, then the top level.
  for (const Section* s : {&text, &top}) {
    if (c.bos_token_id < 0 && s->has("bos_token_id"))
      c.bos_token_id = s->get_int("bos_token_id", -1);
    if (c.eos_token_ids.empty() && s->has("eos_token_id"))
      c.eos_token_ids = parse_int_list(*s, "eos_token_id");
  }

  c.validate();
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  return parse_model_config(read_regular_file(path, kMaxConfigBytes), path);
}

int ModelConfig::n_full_layers() const {
  int n = 0;
  for (LayerType t : layer_types) n += t == LayerType::kFull;
  return n;
}

int ModelConfig::n_linear_layers() const {
  int n = 0;
  for (LayerType t : layer_types) n += t == LayerType::kLinear;
  return n;
}

int64_t ModelConfig::n_params_layer(LayerType type) const {
  const int64_t h = d_model;
  int64_t n = 2 * h + 3 * h * int64_t(d_ff);  // two norms + gate/up/down
  if (type == LayerType::kFull) {
    n += (int64_t(q_proj_dim()) + 2 * int64_t(kv_dim())) * h + h * attn_out_dim() +
         2 * int64_t(head_dim);
  } else {
    n += int64_t(gdn_in_dim()) * h + int64_t(gdn_qkv_dim()) * conv_kernel + 2 * int64_t(n_v_heads) +
         d_v + h * gdn_z_dim();
  }
  return n;
}

int64_t ModelConfig::n_params_text() const {
  int64_t n = int64_t(vocab_size) * d_model * (tie_word_embeddings ? 1 : 2) + d_model;
  for (LayerType t : layer_types) n += n_params_layer(t);
  return n;
}

void ModelConfig::validate() const {
  const std::string& where = source.empty() ? std::string("config") : source;
  auto positive = [&](const char* field, int64_t v) {
    if (v <= 0) throw_error(where, ": field '", field, "' must be positive, got ", v);
    // Keeps every derived size (products of two of these) inside int and int64 arithmetic.
    if (v > (1 << 24)) throw_error(where, ": field '", field, "' is implausibly large (", v, ")");
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", d_model);
  positive("intermediate_size", d_ff);
  positive("num_hidden_layers", n_layers);
  positive("num_attention_heads", n_heads);
  positive("num_key_value_heads", n_kv_heads);
  positive("head_dim", head_dim);
  positive("linear_num_key_heads", n_k_heads);
  positive("linear_num_value_heads", n_v_heads);
  positive("linear_key_head_dim", d_k);
  positive("linear_value_head_dim", d_v);
  positive("linear_conv_kernel_dim", conv_kernel);
  positive("max_position_embeddings", max_position_embeddings);
  if (conv_kernel > 64)
    throw_error(where, ": field 'linear_conv_kernel_dim' is implausibly large (", conv_kernel, ")");
  // Derived projection widths must fit an int (they index rows of a matrix).
  auto fits = [&](const char* what, int64_t v) {
    if (v > std::numeric_limits<int>::max() / 4)
      throw_error(where, ": ", what, " (", v, ") is implausibly large");
  };
  fits("num_attention_heads * head_dim", int64_t(n_heads) * head_dim * 2);
  fits("num_key_value_heads * head_dim", int64_t(n_kv_heads) * head_dim);
  fits("linear_num_key_heads * linear_key_head_dim", int64_t(n_k_heads) * d_k * 2);
  fits("linear_num_value_heads * linear_value_head_dim", int64_t(n_v_heads) * d_v * 2);
  fits("linear_num_value_heads * linear_key_head_dim", int64_t(n_v_heads) * d_k);
  fits("linear_conv_kernel_dim * conv channels",
       (int64_t(n_k_heads) * d_k * 2 + int64_t(n_v_heads) * d_v) * conv_kernel);
  if (int64_t(vocab_size) * d_model > (int64_t(1) << 40) ||
      int64_t(d_ff) * d_model > (int64_t(1) << 40)) {
    throw_error(where, ": hidden_size x vocab_size / intermediate_size is implausibly large");
  }
  if (n_layers > 4096)
    throw_error(where, ": field 'num_hidden_layers' is implausibly large (", n_layers, ")");
  // Whole-model sizes in floating point (no overflow possible), so that every int64 size derived
  // from a config that passes is far from overflowing.
  {
    const double h = d_model, layers = n_layers;
    double per_layer = 3.0 * h * d_ff + (2.0 * n_heads + 2.0 * n_kv_heads) * head_dim * h +
                       h * n_heads * head_dim + (4.0 * n_k_heads * d_k + 3.0 * n_v_heads * d_v) * h;
    double total = 2.0 * vocab_size * h + layers * per_layer;
    double state = layers * (double(n_v_heads) * d_k * d_v +
                             double(conv_kernel) * (2.0 * n_k_heads * d_k + n_v_heads * d_v));
    if (total > 1e15 || state > 1e15) {
      throw_error(where, ": the model sizes are implausibly large (", total, " parameters)");
    }
  }
  if (n_heads % n_kv_heads != 0) {
    throw_error(where, ": num_attention_heads (", n_heads,
                ") must be a multiple of num_key_value_heads (", n_kv_heads, ")");
  }
  if (n_v_heads % n_k_heads != 0) {
    throw_error(where, ": linear_num_value_heads (", n_v_heads,
                ") must be a multiple of linear_num_key_heads (", n_k_heads, ")");
  }
  if (!(partial_rotary_factor > 0.0f && partial_rotary_factor <= 1.0f)) {
    throw_error(where, ": partial_rotary_factor must be in (0, 1], got ", partial_rotary_factor);
  }
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim) {
    throw_error(where, ": rotary dimension head_dim * partial_rotary_factor = ", head_dim, " * ",
                partial_rotary_factor, " = ", rotary_dim,
                " must be even, positive and <= head_dim");
  }
  if (!(rope_theta > 1.0) || !std::isfinite(rope_theta)) {
    throw_error(where, ": rope_theta must be a finite number > 1, got ", rope_theta);
  }
  if (!(rms_norm_eps > 0.0f) || !std::isfinite(rms_norm_eps) || rms_norm_eps > 1.0f) {
    throw_error(where, ": rms_norm_eps must be in (0, 1], got ", rms_norm_eps);
  }
  if (static_cast<int64_t>(layer_types.size()) != n_layers) {
    throw_error(where, ": layer_types has ", layer_types.size(),
                " entries but num_hidden_layers is ", n_layers);
  }
  for (int id : eos_token_ids) {
    if (id < 0 || id >= vocab_size) {
      throw_error(where, ": eos_token_id ", id, " is outside the vocabulary [0, ", vocab_size, ")");
    }
  }
  if (bos_token_id >= vocab_size) {
    throw_error(where, ": bos_token_id ", bos_token_id, " is outside the vocabulary [0, ",
                vocab_size, ")");
  }
}

std::string ModelConfig::summary() const {
  std::ostringstream os;
  os << model_type << (is_wrapper ? " (vision-language wrapper config, text model only)" : "")
     << ": " << n_layers << " layers (" << n_linear_layers() << " Gated DeltaNet + "
     << n_full_layers() << " gated attention), d_model " << d_model << ", d_ff " << d_ff
     << ", vocab " << vocab_size << (tie_word_embeddings ? " (tied embeddings)" : "")
     << ". Attention: " << n_heads << " query / " << n_kv_heads << " kv heads x " << head_dim
     << " (GQA " << n_heads / std::max(1, n_kv_heads) << "), RoPE theta " << rope_theta << " on "
     << rotary_dim << " dims" << (attn_output_gate ? ", output gate" : "")
     << ". Gated DeltaNet: " << n_k_heads << " key / " << n_v_heads << " value heads, d_k " << d_k
     << ", d_v " << d_v << ", conv kernel " << conv_kernel << ". rms_norm_eps " << rms_norm_eps
     << ", max positions " << max_position_embeddings << ". " << n_params_text()
     << " text parameters (" << std::fixed << std::setprecision(2) << n_params_text() / 1e9
     << "B).";
  return os.str();
}

}  // namespace ds

namespace ds {
namespace {
// A float as the shortest decimal that reads back to it (1e-06, not 9.99999997e-07).
double tidy(float f) {
  char buf[32];
  for (int prec = 6; prec <= 9; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, static_cast<double>(f));
    if (std::strtof(buf, nullptr) == f) break;
  }
  return std::strtod(buf, nullptr);
}
}  // namespace

std::string model_config_to_json(const ModelConfig& c, bool wrapper) {
  nlohmann::ordered_json t;
  t["model_type"] = "qwen3_5_text";
  if (!wrapper) t["architectures"] = {"Qwen3_5ForCausalLM"};
  t["vocab_size"] = c.vocab_size;
  t["hidden_size"] = c.d_model;
  t["intermediate_size"] = c.d_ff;
  t["num_hidden_layers"] = c.n_layers;
  t["num_attention_heads"] = c.n_heads;
  t["num_key_value_heads"] = c.n_kv_heads;
  t["head_dim"] = c.head_dim;
  t["hidden_act"] = "silu";
  t["max_position_embeddings"] = c.max_position_embeddings;
  t["rms_norm_eps"] = tidy(c.rms_norm_eps);
  t["attn_output_gate"] = c.attn_output_gate;
  t["linear_conv_kernel_dim"] = c.conv_kernel;
  t["linear_key_head_dim"] = c.d_k;
  t["linear_value_head_dim"] = c.d_v;
  t["linear_num_key_heads"] = c.n_k_heads;
  t["linear_num_value_heads"] = c.n_v_heads;
  std::vector<std::string> types;
  for (LayerType lt : c.layer_types)
    types.push_back(lt == LayerType::kFull ? "full_attention" : "linear_attention");
  t["layer_types"] = types;
  nlohmann::ordered_json rope;
  rope["rope_type"] = "default";
  rope["rope_theta"] = c.rope_theta;
  rope["partial_rotary_factor"] = tidy(c.partial_rotary_factor);
  if (!c.mrope_section.empty()) rope["mrope_section"] = c.mrope_section;
  rope["mrope_interleaved"] = c.mrope_interleaved;
  t["rope_parameters"] = rope;
  t["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.bos_token_id >= 0) t["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) t["eos_token_id"] = c.eos_token_ids[0];
  if (c.eos_token_ids.size() > 1) t["eos_token_id"] = c.eos_token_ids;
  t["dtype"] = "bfloat16";
  if (!wrapper) return t.dump(2);
  nlohmann::ordered_json w;
  w["architectures"] = {"Qwen3_5ForConditionalGeneration"};
  w["model_type"] = "qwen3_5";
  w["tie_word_embeddings"] = c.tie_word_embeddings;
  w["text_config"] = t;
  return w.dump(2);
}

}  // namespace ds
