// Memory plan: see memory_plan.h.
#include "model/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>

#include "core/error.h"

namespace ds {

MemoryPlan plan_memory(const ModelConfig& c, int64_t weight_bytes, const MemoryPlanOptions& opt) {
  DS_CHECK(opt.gpu_bytes >= 0 && opt.reserve_bytes >= 0, "memory plan: negative budget");
  DS_CHECK(opt.context_tokens > 0, "memory plan: context length must be positive, got ",
           opt.context_tokens);
  MemoryPlan p;
  p.weight_bytes = weight_bytes;
  // Attention layers cache K (after norm + RoPE) and V: 2 x kv_dim per token and layer.
  p.kv_bytes_per_token = int64_t(c.n_full_layers()) * 2 * c.kv_dim() * opt.kv_elem_bytes;
  // GDN layers keep a ring of the last conv_kernel pre-conv inputs of the conv channels (the CUDA
  // engine's layout, src/cuda/gdn.h: row p % 4; the conv itself needs conv_kernel - 1 of them) and
  // S [n_v, d_k, d_v] fp32.
  p.conv_state_bytes_per_layer =
      int64_t(c.conv_kernel) * c.gdn_qkv_dim() * opt.conv_state_elem_bytes;
  p.recurrent_state_bytes_per_layer = int64_t(c.n_v_heads) * c.d_k * c.d_v * 4;
  p.gdn_state_bytes_per_seq = int64_t(c.n_linear_layers()) *
                              (p.conv_state_bytes_per_layer + p.recurrent_state_bytes_per_layer);
  p.budget_bytes = opt.gpu_bytes;
  p.reserve_bytes = opt.reserve_bytes;
  p.free_bytes = opt.gpu_bytes - weight_bytes - opt.reserve_bytes;
  p.context_tokens = opt.context_tokens;
  p.max_position_embeddings = c.max_position_embeddings;
  const int64_t per_token = std::max<int64_t>(1, p.kv_bytes_per_token);
  if (p.free_bytes > p.gdn_state_bytes_per_seq) {
    p.max_tokens_one_seq =
        p.kv_bytes_per_token > 0 ? (p.free_bytes - p.gdn_state_bytes_per_seq) / per_token : 0;
    if (p.kv_bytes_per_token == 0)
      p.max_tokens_one_seq = INT64_MAX;  // no attention layer: unbounded
    // context * per-token bytes can exceed int64 for absurd --context values: compare first.
    if (p.kv_bytes_per_token > 0 && opt.context_tokens > (INT64_MAX / 2) / p.kv_bytes_per_token) {
      p.max_seqs_at_context = 0;
    } else {
      int64_t per_seq = p.gdn_state_bytes_per_seq + opt.context_tokens * p.kv_bytes_per_token;
      p.max_seqs_at_context = per_seq > 0 ? p.free_bytes / per_seq : 0;
    }
  }
  return p;
}

std::string format_bytes(int64_t bytes) {
  char buf[64];
  double b = static_cast<double>(bytes);
  if (std::abs(b) >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  } else if (std::abs(b) >= 1024.0 * 1024) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024));
  } else if (std::abs(b) >= 1024.0) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", b / 1024.0);
  } else {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  }
  return buf;
}

std::string MemoryPlan::to_text() const {
  std::ostringstream os;
  auto line = [&](const char* k, const std::string& v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "  %-38s ", k);
    os << buf << v << "\n";
  };
  line("weights", format_bytes(weight_bytes));
  line("KV cache per token", format_bytes(kv_bytes_per_token));
  line("GDN state per sequence", format_bytes(gdn_state_bytes_per_seq) + " (per layer: conv " +
                                     format_bytes(conv_state_bytes_per_layer) + " + recurrent " +
                                     format_bytes(recurrent_state_bytes_per_layer) + ")");
  line("memory budget", format_bytes(budget_bytes) + " (reserve " + format_bytes(reserve_bytes) +
                            " for activations and workspaces)");
  line("free for KV + GDN state", format_bytes(free_bytes));
  if (!fits()) {
    line("fits", "NO: the weights and reserve do not fit in the budget");
    return os.str();
  }
  std::string max_tokens = max_tokens_one_seq == INT64_MAX
                               ? std::string("unbounded (no attention layer)")
                               : std::to_string(max_tokens_one_seq);
  if (max_tokens_one_seq > max_position_embeddings) {
    max_tokens +=
        " (above the model's limit of " + std::to_string(max_position_embeddings) + " positions)";
  }
  line("KV capacity in tokens (one sequence)", max_tokens);
  line(("sequences at " + std::to_string(context_tokens) + " tokens").c_str(),
       std::to_string(max_seqs_at_context));
  return os.str();
}

}  // namespace ds
