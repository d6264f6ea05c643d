// `deltaserve make-tiny --out DIR`: writes a tiny Qwen3.5 checkpoint with deterministic RANDOM
// weights (tiny_model_config: both layer kinds, the 27B head ratios) in the HF layout, text-only
// or vision-language wrapper, optionally sharded. For trying the engine without a download and
// for tests; its output text is meaningless.
#include <cstdio>
#include <filesystem>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "model/weights.h"

namespace ds::cli {
namespace {

struct MakeTinyOpts {
  std::string out;
  uint64_t seed = 1;
  int vocab = 1024;
  int shards = 1;
  bool wrapper = false;
  bool tied = false;
  bool force = false;
  std::string dtype = "bf16";
};

std::function<int()> setup_make_tiny(CLI::App& app) {
  auto o = std::make_shared<MakeTinyOpts>();
  app.add_option("--out", o->out, "Folder to write (config.json + safetensors)")->required();
  app.add_option("--seed", o->seed, "Random seed (same seed, same bytes)")->capture_default_str();
  app.add_option("--vocab", o->vocab, "Vocabulary size")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--shards", o->shards,
                 "Number of safetensors files (> 1 writes model.safetensors.index.json)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_flag("--wrapper", o->wrapper,
               "Vision-language wrapper layout (model_type qwen3_5, names model.language_model.*)");
  app.add_flag("--tied", o->tied, "Tie lm_head to the embedding (no lm_head.weight written)");
  app.add_option("--dtype", o->dtype, "Weight dtype: bf16, f16 or f32")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "f16", "f32"}));
  app.add_flag("--force", o->force,
               "Write into a non-empty folder (its checkpoint files are replaced)");
  return [o]() {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::exists(o->out, ec) && !fs::is_directory(o->out, ec))
      throw_error(o->out, ": exists and is not a folder");
    if (fs::is_directory(o->out, ec) && !fs::is_empty(o->out, ec) && !o->force) {
      throw_error(o->out, ": folder is not empty (use --force to overwrite the checkpoint in it)");
    }
    if (o->force && fs::is_directory(o->out, ec)) {
      // Old shards of another shard count would otherwise mix with the new ones.
      for (const auto& e : fs::directory_iterator(o->out)) {
        std::string n = e.path().filename().string();
        if (n == "config.json" || n == "model.safetensors.index.json" ||
            (n.rfind("model", 0) == 0 && e.path().extension() == ".safetensors")) {
          fs::remove(e.path());
        }
      }
    }
    ModelConfig c = tiny_model_config(o->vocab);
    c.tie_word_embeddings = o->tied;
    DType dt = o->dtype == "f32" ? DType::kF32 : o->dtype == "f16" ? DType::kF16 : DType::kBF16;
    HostWeights w = make_synthetic_weights(c, o->seed, dt);
    write_checkpoint(w, o->out, o->shards, o->wrapper);
    std::printf("wrote a tiny Qwen3.5 checkpoint with RANDOM weights (seed %llu) to %s\n",
                static_cast<unsigned long long>(o->seed), o->out.c_str());
    std::printf("  %s\n", c.summary().c_str());
    std::printf("  %d file(s), %s layout, %s; its generations are meaningless token ids\n",
                o->shards, o->wrapper ? "wrapper (model.language_model.*)" : "text-only (model.*)",
                o->dtype.c_str());
    return 0;
  };
}

}  // namespace

DS_COMMAND("make-tiny",
           "Write a tiny checkpoint with deterministic random weights (for trying the engine)",
           setup_make_tiny);

}  // namespace ds::cli
