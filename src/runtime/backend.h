// The engine seen from the scheduler, server, CLI and benchmarks: a fixed number of sequence
// slots, each with its own KV cache / GDN state, and a step that runs a batch of work items (a
// prompt chunk or one decode token per slot) and returns logits. Implemented by the CPU reference
// (CpuBackend) and the CUDA engine (CudaBackend). step_greedy() is the same step for callers that
// sample some rows greedily: those rows come back as one token id each (argmax on the device for
// the CUDA engine: 4 bytes copied instead of a vocab-sized fp32 row).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/config.h"

namespace ds {

struct SeqWork {
  int slot = 0;                       // which sequence
  std::span<const int32_t> tokens;    // appended after what the slot already holds
  bool all_logits = false;            // logits for every token (scoring) or only the last
  // Only the greedy token of the last row is wanted (step_greedy): argmax, lowest id on ties.
  // step() ignores it; step_greedy() ignores it on items with all_logits.
  bool greedy = false;
};

// What step_greedy() returns.
struct StepOutput {
  // [rows, vocab]: the rows of the items without `greedy` (or with all_logits), in work order,
  // one per item or one per token where all_logits (step()'s layout minus the greedy items).
  std::vector<float> logits;
  // [work.size()]: for items with `greedy`, the argmax of their last row (lowest id on ties), or
  // -1 when that row holds NaN or +inf; -1 for the other items.
  std::vector<int32_t> tokens;
};

struct MemoryUsage {
  int64_t kv_blocks_total = 0, kv_blocks_used = 0;  // paged KV pool (attention layers)
  int state_slots_total = 0, state_slots_used = 0;  // GDN state slots (linear layers)
  int page_size = 0;                                 // tokens per KV block
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::string name() const = 0;      // "cpu" / "cuda:<device>"
  virtual int n_slots() const = 0;           // concurrent sequences it can hold
  virtual int max_seq_len() const = 0;       // tokens one sequence may hold
  virtual int slot_len(int slot) const = 0;  // tokens the slot holds now
  // True when `n_new` more tokens for `slot` fit in the KV pool now.
  virtual bool can_grow(int slot, int n_new) const = 0;
  virtual void reset_slot(int slot) = 0;     // frees the slot's KV blocks and clears its state
  virtual MemoryUsage memory() const = 0;
  // Runs the work items (distinct slots) as one step. logits: rows in work order, `vocab` floats
  // each; one row per item, or one per token where all_logits.
  virtual void step(std::span<const SeqWork> work, std::vector<float>& logits) = 0;
  // The same step (same state changes, same validation); items with `greedy` get their token in
  // out.tokens and no logits row. This default runs step() and takes the argmax on the host
  // (CpuBackend uses it); the CUDA engine computes it on the device.
  virtual void step_greedy(std::span<const SeqWork> work, StepOutput& out);
};

// The greedy token of a logits row as step_greedy() defines it: argmax, lowest id on ties, -1 if
// the row holds NaN or +inf (the host sampler refuses such rows too). Inline, like
// Backend::step_greedy, so that the GPU library (below the runtime) needs no runtime code.
inline int32_t greedy_token(std::span<const float> row) {
  DS_CHECK(!row.empty(), "greedy_token: empty logits row");
  int32_t best = 0;
  for (size_t i = 0; i < row.size(); ++i) {
    const float v = row[i];
    if (std::isnan(v) || v == INFINITY) return -1;
    if (v > row[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

inline void Backend::step_greedy(std::span<const SeqWork> work, StepOutput& out) {
  std::vector<float> all;
  step(work, all);
  const size_t V = static_cast<size_t>(config().vocab_size);
  out.tokens.assign(work.size(), -1);
  bool any = false;
  for (const SeqWork& w : work) any |= w.greedy && !w.all_logits;
  if (!any) {
    out.logits.swap(all);
    return;
  }
  out.logits.clear();
  size_t row = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    const SeqWork& w = work[i];
    const size_t n_rows = w.all_logits ? w.tokens.size() : 1;
    DS_CHECK((row + n_rows) * V <= all.size(), "step_greedy: the backend returned ",
             all.size() / V, " logits rows, fewer than the work needs");
    if (w.greedy && !w.all_logits) {
      out.tokens[i] = greedy_token(std::span<const float>(all.data() + row * V, V));
    } else {
      out.logits.insert(out.logits.end(), all.begin() + row * V, all.begin() + (row + n_rows) * V);
    }
    row += n_rows;
  }
}

struct BackendOptions {
  std::string device = "cpu";  // "cpu" or "cuda" / "cuda:N"
  int n_slots = 8;
  int max_seq_len = 0;         // 0: the model's max_position_embeddings, capped by memory
  int chunk_size = 4096;       // prompt chunk (tokens per step per sequence)
};

}  // namespace ds
