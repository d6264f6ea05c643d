// libFuzzer harness: config.json parsing (parse_model_config) over arbitrary text. An accepted
// config must survive model_config_to_json -> parse unchanged, and the derived sizes, the name
// table and the memory plan must be computable without overflow (UBSan) or crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "model/config.h"
#include "model/memory_plan.h"
#include "model/weight_table.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  ds::ModelConfig c;
  try {
    c = ds::parse_model_config(text, "fuzz/config.json");
  } catch (const ds::Error&) {
    return 0;
  }
  (void)c.summary();
  (void)c.n_params_text();
  ds::MemoryPlanOptions o;
  o.gpu_bytes = int64_t(80) << 30;
  (void)ds::plan_memory(c, c.n_params_text() * 2, o);
  if (c.n_layers <= 256) {
    for (const ds::CheckpointTensor& t : ds::checkpoint_tensors(c)) {
      if (t.numel() < 0) std::abort();
    }
  }
  for (bool wrapper : {false, true}) {
    ds::ModelConfig r =
        ds::parse_model_config(ds::model_config_to_json(c, wrapper), "fuzz/roundtrip.json");
    if (r.d_model != c.d_model || r.n_layers != c.n_layers || r.layer_types != c.layer_types ||
        r.rotary_dim != c.rotary_dim || r.rope_theta != c.rope_theta ||
        r.rms_norm_eps != c.rms_norm_eps || r.eos_token_ids != c.eos_token_ids ||
        r.bos_token_id != c.bos_token_id || r.tie_word_embeddings != c.tie_word_embeddings ||
        r.n_params_text() != c.n_params_text() || r.mrope_section != c.mrope_section ||
        r.vocab_size != c.vocab_size) {
      std::abort();
    }
  }
  return 0;
}
