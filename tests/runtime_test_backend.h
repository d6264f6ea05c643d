// A host-only Backend for the engine tests (runtime_engine_test, runtime_decode_pipeline_test):
// each slot's history of tokens stands for its KV cache and state, in a paged pool of `blocks`
// blocks of `page` tokens. step() appends each item's tokens (a pool overflow throws, as the CUDA
// engine's validation does) and makes the logits row of each item one-hot at next_token(history)
// (plus a smaller second entry, so logprobs are finite and ordered); subclasses choose next_token.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "runtime/backend.h"
#include "runtime/sampling.h"

namespace ds::test {

class HistoryBackend : public Backend {
 public:
  // score_rows: the backend scores prompt rows itself (SeqWork::score_top), as the CUDA engine
  // does on the device (here with position_logprobs on its rows).
  HistoryBackend(std::string name, int n_slots, int page, int64_t blocks, int vocab,
                 bool score_rows = false)
      : name_(std::move(name)), page_(page), blocks_(blocks), score_rows_(score_rows),
        hist_(n_slots),
        rowless_(n_slots, false) {
    cfg_.vocab_size = vocab;
  }
  int max_score_top() const override { return score_rows_ ? 20 : -1; }
  void step_greedy(std::span<const SeqWork> work, StepOutput& out) override {
    if (!score_rows_) return Backend::step_greedy(work, out);
    std::vector<SeqWork> all_rows(work.begin(), work.end());
    for (SeqWork& w : all_rows) {
      if (w.score_top < 0) continue;
      if (w.all_logits) throw Error(name_ + ": an item both scores and returns its rows");
      w.all_logits = true;
    }
    std::vector<float> all;
    step(all_rows, all);
    const size_t V = static_cast<size_t>(cfg_.vocab_size);
    out.tokens.assign(work.size(), -1);
    out.logits.clear();
    out.scores.clear();
    size_t row = 0;
    for (size_t i = 0; i < work.size(); ++i) {
      const SeqWork& w = work[i];
      const size_t n = w.tokens.size();
      const size_t n_rows = all_rows[i].all_logits ? n : 1;
      const float* rows = all.data() + row * V;
      row += n_rows;
      size_t normal = n_rows;  // the rows returned as usual: all, or the last one
      if (w.score_top >= 0) {
        for (size_t k = 0; k < n; ++k) {
          const int32_t target = k + 1 < n ? w.tokens[k + 1] : w.score_next;
          if (target < 0) break;
          out.scores.push_back(
              position_logprobs(std::span<const float>(rows + k * V, V), target, w.score_top));
        }
        if (w.score_next >= 0) continue;  // no row, no token
        rows += (n - 1) * V;
        normal = 1;
      }
      if (w.greedy && !w.all_logits) {
        out.tokens[i] = greedy_token(std::span<const float>(rows, V));
      } else {
        out.logits.insert(out.logits.end(), rows, rows + normal * V);
      }
    }
  }
  const ModelConfig& config() const override { return cfg_; }
  std::string name() const override { return name_; }
  int n_slots() const override { return static_cast<int>(hist_.size()); }
  int max_seq_len() const override { return 4096; }
  int slot_len(int s) const override { return static_cast<int>(hist_.at(s).size()); }
  int64_t blocks(int64_t n) const { return (n + page_ - 1) / page_; }
  int64_t used() const {
    int64_t b = 0;
    for (const auto& h : hist_) b += blocks(static_cast<int64_t>(h.size()));
    return b;
  }
  bool can_grow(int s, int n) const override {
    return used() - blocks(slot_len(s)) + blocks(slot_len(s) + n) <= blocks_;
  }
  void reset_slot(int s) override {
    hist_.at(s).clear();
    rowless_.at(s) = false;
  }
  MemoryUsage memory() const override {
    MemoryUsage m;
    m.kv_blocks_total = blocks_;
    m.kv_blocks_used = used();
    m.page_size = page_;
    m.state_slots_total = n_slots();
    for (const auto& h : hist_) m.state_slots_used += h.empty() ? 0 : 1;
    return m;
  }
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override {
    size_t n_rows = 0;
    for (const SeqWork& w : work) n_rows += w.all_logits ? w.tokens.size() : 1;
    logits.assign(n_rows * static_cast<size_t>(cfg_.vocab_size), -10.0f);
    size_t r = 0;
    auto put_row = [&](const std::vector<int32_t>& h) {
      const int32_t next = next_token(h);
      float* row = logits.data() + r++ * cfg_.vocab_size;
      row[next] = 5.0f;
      row[(next + 1) % cfg_.vocab_size] = 1.0f;
    };
    for (size_t i = 0; i < work.size(); ++i) {
      auto& h = hist_.at(work[i].slot);
      if (!can_grow(work[i].slot, static_cast<int>(work[i].tokens.size())))
        throw Error(name_ + ": pool overflow");
      // all_logits: a row after every token (the history up to it), else after the last.
      for (int32_t t : work[i].tokens) {
        h.push_back(t);
        if (work[i].all_logits) put_row(h);
      }
      if (!work[i].all_logits) put_row(h);
      if (work[i].all_logits) {
        n_all_logits_rows_ += static_cast<int64_t>(work[i].tokens.size());
        max_item_rows_ = std::max<int64_t>(max_item_rows_, work[i].tokens.size());
        if (rowless_.at(work[i].slot)) ++n_rows_resumed_;
      }
      rowless_.at(work[i].slot) = !work[i].all_logits;
    }
  }

 protected:
  // The greedy token after `history` (the slot's tokens including this step's), in [0, vocab).
  virtual int32_t next_token(const std::vector<int32_t>& history) const = 0;
  int vocab() const { return cfg_.vocab_size; }
  std::vector<int32_t>& history(int slot) { return hist_.at(slot); }

 public:
  int64_t n_all_logits_rows_ = 0;  // rows of items run with all_logits (tests of the scheduler)
  int64_t max_item_rows_ = 0;      // the longest of those items
  // Items with all_logits after one without in the same slot: a recompute of a prompt whose
  // rows were partly taken, resuming its rows.
  int64_t n_rows_resumed_ = 0;

 private:
  ModelConfig cfg_;
  std::string name_;
  int page_;
  int64_t blocks_;
  bool score_rows_;
  std::vector<std::vector<int32_t>> hist_;
  std::vector<bool> rowless_;  // the slot's last item ran without all_logits
};

}  // namespace ds::test
