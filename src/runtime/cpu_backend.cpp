// CpuBackend (see cpu_backend.h).
#include "runtime/cpu_backend.h"

#include <algorithm>

#include "core/error.h"

namespace ds {

CpuBackend::CpuBackend(const HostWeights& weights, const BackendOptions& opts) : model_(weights) {
  DS_CHECK(opts.n_slots >= 1, "cpu backend: n_slots must be >= 1, got ", opts.n_slots);
  DS_CHECK(opts.max_seq_len >= 0, "cpu backend: max_seq_len must be >= 0, got ", opts.max_seq_len);
  const int model_max = model_.config().max_position_embeddings;
  max_seq_len_ = opts.max_seq_len > 0 ? opts.max_seq_len : (model_max > 0 ? model_max : 32768);
  chunk_size_ = opts.chunk_size;
  slots_.reserve(opts.n_slots);
  for (int i = 0; i < opts.n_slots; ++i) slots_.push_back(model_.new_state());
}

void CpuBackend::check_slot(int slot) const {
  DS_CHECK(slot >= 0 && slot < n_slots(), "cpu backend: slot ", slot, " out of range [0, ",
           n_slots(), ")");
}

int CpuBackend::slot_len(int slot) const {
  check_slot(slot);
  return slots_[slot].n_past;
}

bool CpuBackend::can_grow(int slot, int n_new) const {
  check_slot(slot);
  return n_new >= 0 && static_cast<int64_t>(slots_[slot].n_past) + n_new <= max_seq_len_;
}

void CpuBackend::reset_slot(int slot) {
  check_slot(slot);
  slots_[slot] = model_.new_state();
}

MemoryUsage CpuBackend::memory() const {
  MemoryUsage m;
  m.state_slots_total = n_slots();
  m.state_slots_used = static_cast<int>(std::count_if(
      slots_.begin(), slots_.end(), [](const CpuSeqState& s) { return s.n_past > 0; }));
  return m;  // no paged KV pool: kv_blocks_* and page_size stay 0
}

void CpuBackend::step(std::span<const SeqWork> work, std::vector<float>& logits) {
  logits.clear();
  // Validate the whole step first so a bad item changes no slot.
  std::vector<bool> seen(slots_.size(), false);
  for (const SeqWork& w : work) {
    check_slot(w.slot);
    DS_CHECK(!seen[w.slot], "cpu backend: slot ", w.slot, " appears twice in one step");
    seen[w.slot] = true;
    DS_CHECK(!w.tokens.empty(), "cpu backend: empty work item for slot ", w.slot);
    DS_CHECK(can_grow(w.slot, static_cast<int>(w.tokens.size())), "cpu backend: slot ", w.slot,
             " holds ", slots_[w.slot].n_past, " tokens; ", w.tokens.size(),
             " more exceed max_seq_len ", max_seq_len_);
    const int V = model_.config().vocab_size;
    for (int32_t t : w.tokens) {
      DS_CHECK(t >= 0 && t < V, "cpu backend: token id ", t, " (slot ", w.slot,
               ") outside the vocabulary [0, ", V, ")");
    }
  }
  for (const SeqWork& w : work) {
    model_.forward(slots_[w.slot], w.tokens, chunk_size_, w.all_logits, logits);
  }
}

}  // namespace ds
