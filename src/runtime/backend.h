// The engine seen from the scheduler, server, CLI and benchmarks: a fixed number of sequence
// slots, each with its own KV cache / GDN state, and a step that runs a batch of work items (a
// prompt chunk or one decode token per slot) and returns logits. Implemented by the CPU reference
// (CpuBackend) and the CUDA engine (CudaBackend).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/config.h"

namespace ds {

struct SeqWork {
  int slot = 0;                       // which sequence
  std::span<const int32_t> tokens;    // appended after what the slot already holds
  bool all_logits = false;            // logits for every token (scoring) or only the last
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
};

struct BackendOptions {
  std::string device = "cpu";  // "cpu" or "cuda" / "cuda:N"
  int n_slots = 8;
  int max_seq_len = 0;         // 0: the model's max_position_embeddings, capped by memory
  int chunk_size = 4096;       // prompt chunk (tokens per step per sequence)
};

}  // namespace ds
