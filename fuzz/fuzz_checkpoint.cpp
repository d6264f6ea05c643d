// libFuzzer harness: load_host_weights on a fuzzed model.safetensors next to a fixed small
// config.json (both layer kinds). Exercises name classification, shape / dtype checks, fused
// copies and dtype widening on top of the header parser. Any outcome other than loaded weights
// or a ds::Error is a finding; loaded weights must have every view inside its storage.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "model/weights.h"

namespace {

// d_model 8, 2 layers (GDN + attention), GQA 2, 2 value heads per key head, vocab 8.
ds::ModelConfig fuzz_config() {
  ds::ModelConfig c = ds::tiny_model_config(8);
  c.d_model = 8;
  c.d_ff = 8;
  c.n_layers = 2;
  c.layer_types = {ds::LayerType::kLinear, ds::LayerType::kFull};
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.partial_rotary_factor = 0.5f;
  c.rotary_dim = 2;
  c.n_k_heads = 1;
  c.n_v_heads = 2;
  c.d_k = 2;
  c.d_v = 2;
  c.validate();
  return c;
}

std::string& dir() {
  static std::string d;
  return d;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  dir() = (std::filesystem::temp_directory_path() / ("ds_fuzz_ckpt_" + std::to_string(::getpid())))
              .string();
  std::filesystem::create_directories(dir());
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(dir(), ec);
  });
  std::ofstream(dir() + "/config.json") << ds::model_config_to_json(fuzz_config(), true);
  // DS_FUZZ_WRITE_SEED=DIR: write seed checkpoints (bf16 / f32, both layouts) and exit.
  if (const char* seed_dir = std::getenv("DS_FUZZ_WRITE_SEED")) {
    int k = 0;
    for (ds::DType dt : {ds::DType::kBF16, ds::DType::kF32}) {
      for (bool wrapper : {false, true}) {
        ds::HostWeights w = ds::make_synthetic_weights(fuzz_config(), 1, dt);
        std::string tmp = dir() + "/seed";
        ds::write_checkpoint(w, tmp, 1, wrapper);
        std::filesystem::copy_file(tmp + "/model.safetensors",
                                   std::string(seed_dir) + "/seed" + std::to_string(k++),
                                   std::filesystem::copy_options::overwrite_existing);
      }
    }
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    FILE* f = std::fopen((dir() + "/model.safetensors").c_str(), "wb");
    if (f == nullptr) std::abort();
    if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
    std::fclose(f);
  }
  try {
    ds::HostWeights w = ds::load_host_weights(dir());
    // Widen every view: ASan checks that each lies inside its mmap or owned buffer.
    float sink = 0;
    auto touch = [&](const ds::TensorView& t) {
      if (!t.empty() && t.numel() > 0) sink += t.at(0) + t.at(t.numel() - 1);
    };
    touch(w.embed);
    touch(w.final_norm);
    touch(w.lm_head);
    for (const ds::LayerWeights& l : w.layers) {
      for (auto fld :
           {&ds::LayerWeights::input_norm, &ds::LayerWeights::post_norm,
            &ds::LayerWeights::mlp_gate_up, &ds::LayerWeights::mlp_down,
            &ds::LayerWeights::attn_qkv, &ds::LayerWeights::attn_o, &ds::LayerWeights::q_norm,
            &ds::LayerWeights::k_norm, &ds::LayerWeights::gdn_in, &ds::LayerWeights::gdn_conv,
            &ds::LayerWeights::gdn_dt_bias, &ds::LayerWeights::gdn_A_log,
            &ds::LayerWeights::gdn_norm, &ds::LayerWeights::gdn_out}) {
        touch(l.*fld);
      }
    }
    volatile float keep = sink;
    (void)keep;
  } catch (const ds::Error&) {
  }
  return 0;
}
