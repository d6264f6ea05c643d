// Backend over the CPU reference forward: n_slots independent sequences, each a CpuSeqState
// (growing KV cache for the attention layers, conv + recurrent state for the GDN layers). No
// paged pool: a slot grows until max_seq_len. Work items of one step run one after the other
// (each matmul is multithreaded inside).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cpu/forward.h"
#include "runtime/backend.h"

namespace ds {

class CpuBackend : public Backend {
 public:
  // opts.n_slots >= 1; opts.max_seq_len 0 means the model's max_position_embeddings;
  // opts.chunk_size (<= 0: unbounded) splits long work items. Throws ds::Error on bad options.
  CpuBackend(const HostWeights& weights, const BackendOptions& opts);

  const ModelConfig& config() const override { return model_.config(); }
  std::string name() const override { return "cpu"; }
  int n_slots() const override { return static_cast<int>(slots_.size()); }
  int max_seq_len() const override { return max_seq_len_; }
  int slot_len(int slot) const override;
  bool can_grow(int slot, int n_new) const override;
  void reset_slot(int slot) override;
  MemoryUsage memory() const override;
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override;

  const CpuModel& model() const { return model_; }

 private:
  void check_slot(int slot) const;
  CpuModel model_;
  int max_seq_len_ = 0;
  int chunk_size_ = 0;
  std::vector<CpuSeqState> slots_;
};

}  // namespace ds
