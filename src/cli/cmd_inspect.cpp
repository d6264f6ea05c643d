// `deltaserve inspect --model DIR`: the config summary, parameter counts and bytes by kind, the
// tensors the engine ignores (vision tower, MTP head, others), and the GPU memory plan (weights,
// KV bytes per token, GDN state per sequence, tokens / sequences that fit). Reads config.json and
// the safetensors headers only, so it is instant for any size, and runs the loader's checks.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "model/checkpoint_info.h"
#include "model/memory_plan.h"

namespace ds::cli {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct InspectOpts {
  std::string model;
  double gpu_memory_gib = 0.8 * 141.0;  // 80% of an H200
  double reserve_gib = 2.0;
  int64_t context = 8192;
  bool json = false;
};

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return v < 0 ? "-" + s : s;
}

nlohmann::ordered_json to_json(const CheckpointInfo& info, const MemoryPlan& plan) {
  const ModelConfig& c = info.config;
  nlohmann::ordered_json j;
  j["model"] = info.dir;
  j["has_weights"] = info.has_weights;
  std::vector<std::string> types;
  for (LayerType t : c.layer_types)
    types.push_back(t == LayerType::kFull ? "full_attention" : "linear_attention");
  j["config"] = {{"model_type", c.model_type},
                 {"wrapper", c.is_wrapper},
                 {"hidden_size", c.d_model},
                 {"num_hidden_layers", c.n_layers},
                 {"n_linear_layers", c.n_linear_layers()},
                 {"n_full_layers", c.n_full_layers()},
                 {"intermediate_size", c.d_ff},
                 {"vocab_size", c.vocab_size},
                 {"num_attention_heads", c.n_heads},
                 {"num_key_value_heads", c.n_kv_heads},
                 {"head_dim", c.head_dim},
                 {"rotary_dim", c.rotary_dim},
                 {"rope_theta", c.rope_theta},
                 {"linear_num_key_heads", c.n_k_heads},
                 {"linear_num_value_heads", c.n_v_heads},
                 {"linear_key_head_dim", c.d_k},
                 {"linear_value_head_dim", c.d_v},
                 {"linear_conv_kernel_dim", c.conv_kernel},
                 {"tie_word_embeddings", c.tie_word_embeddings},
                 {"max_position_embeddings", c.max_position_embeddings},
                 {"eos_token_ids", c.eos_token_ids},
                 {"layer_types", types}};
  nlohmann::ordered_json params, bytes;
  for (int k = 0; k < kNumParamKinds; ++k) {
    params[param_kind_name(ParamKind(k))] = info.params_by_kind[k];
    bytes[param_kind_name(ParamKind(k))] = info.bytes_by_kind[k];
  }
  params["total"] = info.text_params();
  bytes["total"] = info.text_bytes();
  j["parameters"] = params;
  j["bytes"] = bytes;
  if (info.has_weights) {
    j["checkpoint"] = {{"listing", info.listing},
                       {"files", info.stats.n_files},
                       {"text_tensors", info.stats.n_text_tensors},
                       {"text_tensors_by_dtype", info.text_tensors_by_dtype},
                       {"visual_tensors", info.stats.n_visual_tensors},
                       {"visual_params", info.stats.visual_params},
                       {"mtp_tensors", info.stats.n_mtp_tensors},
                       {"mtp_params", info.stats.mtp_params},
                       {"other_tensors", info.stats.other_tensor_names}};
  }
  j["memory_plan"] = {{"weight_bytes", plan.weight_bytes},
                      {"kv_bytes_per_token", plan.kv_bytes_per_token},
                      {"gdn_conv_state_bytes_per_layer", plan.conv_state_bytes_per_layer},
                      {"gdn_recurrent_state_bytes_per_layer", plan.recurrent_state_bytes_per_layer},
                      {"gdn_state_bytes_per_seq", plan.gdn_state_bytes_per_seq},
                      {"budget_bytes", plan.budget_bytes},
                      {"reserve_bytes", plan.reserve_bytes},
                      {"free_bytes", plan.free_bytes},
                      {"fits", plan.fits()},
                      {"max_tokens_one_seq", plan.max_tokens_one_seq},
                      {"context_tokens", plan.context_tokens},
                      {"max_seqs_at_context", plan.max_seqs_at_context}};
  return j;
}

void print_text(const CheckpointInfo& info, const MemoryPlan& plan, const InspectOpts& o) {
  const ModelConfig& c = info.config;
  std::printf("model: %s\n%s\n\n", info.dir.c_str(), c.summary().c_str());
  if (info.has_weights) {
    std::string dtypes;
    for (auto& [dt, n] : info.text_tensors_by_dtype)
      dtypes += (dtypes.empty() ? "" : ", ") + dt + ": " + std::to_string(n);
    std::printf("checkpoint: %d file(s) via %s; %lld text tensors (%s)\n", info.stats.n_files,
                info.listing.c_str(), static_cast<long long>(info.stats.n_text_tensors),
                dtypes.c_str());
  } else {
    std::printf(
        "checkpoint: no safetensors files (config.json only); counts from the config, bf16 "
        "assumed\n");
  }
  std::printf("\nparameters (text model)          count             bytes\n");
  for (int k = 0; k < kNumParamKinds; ++k) {
    std::printf("  %-22s %20s  %14s\n", param_kind_name(ParamKind(k)),
                with_commas(info.params_by_kind[k]).c_str(),
                format_bytes(info.bytes_by_kind[k]).c_str());
  }
  std::printf("  %-22s %20s  %14s\n", "total", with_commas(info.text_params()).c_str(),
              format_bytes(info.text_bytes()).c_str());
  if (c.tie_word_embeddings) std::printf("  (lm_head tied to the embedding: counted once)\n");
  if (info.has_weights) {
    std::printf("ignored by the engine:\n");
    std::printf("  %-22s %20s  (%lld tensors)\n", "visual (model.visual.*)",
                with_commas(info.stats.visual_params).c_str(),
                static_cast<long long>(info.stats.n_visual_tensors));
    std::printf("  %-22s %20s  (%lld tensors)\n", "mtp (mtp.*)",
                with_commas(info.stats.mtp_params).c_str(),
                static_cast<long long>(info.stats.n_mtp_tensors));
    if (!info.stats.other_tensor_names.empty()) {
      std::printf("  other tensors (%zu):\n", info.stats.other_tensor_names.size());
      size_t shown = 0;
      for (const std::string& n : info.stats.other_tensor_names) {
        if (++shown > 20) {
          std::printf("    ... and %zu more\n", info.stats.other_tensor_names.size() - 20);
          break;
        }
        std::printf("    %s\n", n.c_str());
      }
    }
  }
  std::printf("\nmemory plan (--gpu-memory %.1f GiB, bf16 weights and KV cache):\n%s",
              o.gpu_memory_gib, plan.to_text().c_str());
}

std::function<int()> setup_inspect(CLI::App& app) {
  auto o = std::make_shared<InspectOpts>();
  app.add_option("--model", o->model,
                 "Checkpoint folder (config.json + safetensors; config.json alone also works)")
      ->required();
  app.add_option("--gpu-memory", o->gpu_memory_gib, "GPU memory budget in GiB for the memory plan")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--reserve", o->reserve_gib,
                 "GiB of the budget kept for activations and workspaces")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--context", o->context,
                 "Context length (tokens) for the 'sequences that fit' figure")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--json", o->json, "Print everything as one JSON object");
  return [o]() {
    CheckpointInfo info = inspect_checkpoint(o->model);
    MemoryPlanOptions mo;
    mo.gpu_bytes = static_cast<int64_t>(o->gpu_memory_gib * kGiB);
    mo.reserve_bytes = static_cast<int64_t>(o->reserve_gib * kGiB);
    mo.context_tokens = o->context;
    // The GPU engine keeps weights in bf16 whatever the checkpoint dtype.
    MemoryPlan plan = plan_memory(info.config, info.text_params() * 2, mo);
    if (o->json) {
      std::printf("%s\n", to_json(info, plan).dump(2).c_str());
    } else {
      print_text(info, plan, *o);
    }
    return 0;
  };
}

}  // namespace

DS_COMMAND("inspect",
           "Config, parameter counts and memory plan of a checkpoint (reads headers only)",
           setup_inspect);

}  // namespace ds::cli
