// Model configuration of the Qwen3.5 text model, read from config.json. Every size comes from the
// file (never from the model's name); see ../shared/SPEC.md for the meaning of each field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ds {

enum class LayerType : uint8_t { kLinear, kFull };  // Gated DeltaNet / gated full attention

struct ModelConfig {
  std::string model_type;   // "qwen3_5_text" (after unwrapping a "qwen3_5" wrapper)
  bool is_wrapper = false;  // config.json had the vision-language wrapper (text under text_config)
  std::string source;       // file (or "<synthetic>") the config came from, named in errors

  int d_model = 0;   // hidden_size
  int n_layers = 0;  // num_hidden_layers
  int d_ff = 0;      // intermediate_size
  int vocab_size = 0;
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  std::vector<LayerType> layer_types;  // [n_layers]

  // Gated full attention.
  int n_heads = 0;     // num_attention_heads (query heads)
  int n_kv_heads = 0;  // num_key_value_heads
  int head_dim = 0;
  bool attn_output_gate = true;
  double rope_theta = 1e7;
  float partial_rotary_factor = 0.25f;
  int rotary_dim = 0;  // head_dim * partial_rotary_factor (even)
  int max_position_embeddings = 0;
  std::vector<int> mrope_section;  // e.g. [11, 11, 10]; text-only input makes it plain RoPE
  bool mrope_interleaved = false;

  // Gated DeltaNet.
  int n_k_heads = 0;    // linear_num_key_heads
  int n_v_heads = 0;    // linear_num_value_heads
  int d_k = 0;          // linear_key_head_dim
  int d_v = 0;          // linear_value_head_dim
  int conv_kernel = 4;  // linear_conv_kernel_dim

  // Special tokens (from config.json when present; -1 when absent).
  int bos_token_id = -1;
  std::vector<int> eos_token_ids;

  // Derived sizes.
  int q_proj_dim() const { return n_heads * head_dim * (attn_output_gate ? 2 : 1); }
  int kv_dim() const { return n_kv_heads * head_dim; }
  int attn_out_dim() const { return n_heads * head_dim; }
  int gdn_qkv_dim() const { return 2 * n_k_heads * d_k + n_v_heads * d_v; }  // conv channels
  int gdn_z_dim() const { return n_v_heads * d_v; }
  // Fused GDN input projection rows: [qkv | z | b | a].
  int gdn_in_dim() const { return gdn_qkv_dim() + gdn_z_dim() + 2 * n_v_heads; }
  int n_full_layers() const;
  int n_linear_layers() const;
  int64_t n_params_text() const;  // text-model parameters (embedding + layers + norm + lm_head)
  // Parameters of one layer (norms, mixer, MLP) of the given type.
  int64_t n_params_layer(LayerType type) const;

  // Throws ds::Error naming the field when the config is inconsistent.
  void validate() const;
  std::string summary() const;  // one human-readable paragraph
};

// Parses config.json (text in a string) / a file path. Accepts model_type "qwen3_5" (wrapper,
// text fields under "text_config") and "qwen3_5_text". `where` names the source in errors.
ModelConfig parse_model_config(const std::string& json_text, const std::string& where);
ModelConfig load_model_config(const std::string& path);

// config.json text in the HF layout: a "qwen3_5_text" config, or the "qwen3_5" wrapper with the
// text fields under "text_config" when `wrapper`. parse_model_config reads it back unchanged.
std::string model_config_to_json(const ModelConfig& c, bool wrapper);

}  // namespace ds
