// What `deltaserve inspect` reports about a checkpoint folder, gathered from config.json and the
// safetensors headers only (no tensor data is read, so it is instant even for 27B). The same
// checks as load_host_weights run: names, dtypes and shapes against the config.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "model/config.h"
#include "model/weight_table.h"
#include "model/weights.h"

namespace ds {

struct CheckpointInfo {
  std::string dir;
  ModelConfig config;
  bool has_weights = false;  // false: only config.json is present (counts come from the config)
  std::string listing;       // model.safetensors or the index file
  CheckpointStats stats;
  std::array<int64_t, kNumParamKinds> params_by_kind{};  // indexed by ParamKind
  std::array<int64_t, kNumParamKinds> bytes_by_kind{};
  std::map<std::string, int64_t> text_tensors_by_dtype;  // "BF16" -> count
  int64_t text_params() const;
  int64_t text_bytes() const;
};

// Throws ds::Error (naming file and tensor) exactly where load_host_weights would.
CheckpointInfo inspect_checkpoint(const std::string& model_dir);

}  // namespace ds
