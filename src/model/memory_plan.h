// Memory plan of a Qwen3.5 model on one GPU: weight bytes, KV-cache bytes per token (attention
// layers only), fixed per-sequence Gated DeltaNet state (conv window + fp32 recurrent state), and
// how many tokens / sequences fit in a memory budget. `inspect` prints it; the CUDA engine's
// planner uses the same numbers.
#pragma once

#include <cstdint>
#include <string>

#include "model/config.h"

namespace ds {

struct MemoryPlanOptions {
  int64_t gpu_bytes = 0;          // the budget for this process (e.g. 80% of the GPU)
  int64_t reserve_bytes = 0;      // activations, workspaces, logits, CUDA graphs
  int kv_elem_bytes = 2;          // bf16 KV cache
  int conv_state_elem_bytes = 2;  // bf16 conv window
  int64_t context_tokens = 8192;  // context length used for the "sequences that fit" figure
};

struct MemoryPlan {
  int64_t weight_bytes = 0;
  int64_t kv_bytes_per_token = 0;               // all attention layers, K and V
  int64_t conv_state_bytes_per_layer = 0;       // per sequence, one GDN layer
  int64_t recurrent_state_bytes_per_layer = 0;  // per sequence, one GDN layer (fp32)
  int64_t gdn_state_bytes_per_seq = 0;          // all GDN layers, conv + recurrent
  int64_t budget_bytes = 0, reserve_bytes = 0;
  int64_t free_bytes = 0;          // budget - weights - reserve (may be negative: does not fit)
  int64_t max_tokens_one_seq = 0;  // KV tokens that fit next to one sequence's GDN state
  int64_t context_tokens = 0;
  int64_t max_position_embeddings = 0;  // the model's own limit on one sequence
  int64_t max_seqs_at_context = 0;  // sequences of context_tokens that fit (KV + GDN state each)
  bool fits() const { return free_bytes > 0 && max_tokens_one_seq > 0; }
  std::string to_text() const;  // aligned human-readable lines
};

MemoryPlan plan_memory(const ModelConfig& c, int64_t weight_bytes, const MemoryPlanOptions& opt);

// Bytes as "51.2 GB (47.7 GiB)"-style text.
std::string format_bytes(int64_t bytes);

}  // namespace ds
