// The engine seen from the scheduler, server, CLI and benchmarks: a fixed number of sequence
// slots, each with its own KV cache / GDN state, and a step that runs a batch of work items (a
// prompt chunk or one decode token per slot) and returns logits. Implemented by the CPU reference
// (CpuBackend) and the CUDA engine (CudaBackend). step_greedy() is the same step for callers that
// sample some rows greedily: those rows come back as one token id each (argmax on the device for
// the CUDA engine: 4 bytes copied instead of a vocab-sized fp32 row).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/config.h"

namespace ds {

struct SeqWork {
  int slot = 0;                     // which sequence
  std::span<const int32_t> tokens;  // appended after what the slot already holds
  bool all_logits = false;          // logits for every token (scoring) or only the last
  // Only the greedy token of the last row is wanted (step_greedy): argmax, lowest id on ties.
  // step() ignores it; step_greedy() ignores it on items with all_logits.
  bool greedy = false;
  // step_greedy() of backends whose max_score_top() reaches it (prompt logprobs): >= 0 scores
  // the item's rows on the device instead of returning them. Row k's target is tokens[k + 1], the last
  // row's `score_next`; with score_next < 0 the last row is not scored but treated as usual
  // (greedy token or logits row), else it gives no token and no logits row. Each scored row adds
  // a RowScore with score_top ids to StepOutput::scores, in work order.
  int score_top = -1;
  int32_t score_next = -1;
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};
// One scored row (SeqWork::score_top; the host's position_logprobs too): the logprob of its target
// token, the target's rank (how many ids have a logit >= its own, so 1 is the most probable) and
// the most probable ids with their logprobs, best first (ties: the lower id first).
struct RowScore {
  float logprob = 0.0f;
  int32_t rank = 0;
  std::vector<TokenLogprob> top;
};

// What step_greedy() returns.
struct StepOutput {
  // [rows, vocab]: the rows of the items without `greedy` (or with all_logits), in work order,
  // one per item or one per token where all_logits (step()'s layout minus the greedy items).
  std::vector<float> logits;
  // [work.size()]: for items with `greedy`, the argmax of their last row (lowest id on ties), or
  // -1 when that row holds NaN or +inf; -1 for the other items.
  std::vector<int32_t> tokens;
  // The scored rows (SeqWork::score_top), in work order.
  std::vector<RowScore> scores;
};

// One row of a pipelined greedy decode step (Backend::launch_greedy_decode).
struct DecodeItem {
  int slot = 0;
  int32_t token = 0;  // the token appended to the slot (when feed_row < 0)
  // >= 0: the token appended is instead the greedy token of row `feed_row` of the step launched
  // just before this one (the CUDA engine copies it on the device: the host need not know it yet;
  // an invalid one, -1, goes in as id 0).
  int feed_row = -1;
};

struct MemoryUsage {
  int64_t kv_blocks_total = 0, kv_blocks_used = 0;  // paged KV pool (attention layers)
  int state_slots_total = 0, state_slots_used = 0;  // GDN state slots (linear layers)
  int page_size = 0;                                // tokens per KV block
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
  virtual void reset_slot(int slot) = 0;  // frees the slot's KV blocks and clears its state
  virtual MemoryUsage memory() const = 0;
  // Runs the work items (distinct slots) as one step. logits: rows in work order, `vocab` floats
  // each; one row per item, or one per token where all_logits.
  virtual void step(std::span<const SeqWork> work, std::vector<float>& logits) = 0;
  // The same step (same state changes, same validation); items with `greedy` get their token in
  // out.tokens and no logits row. This default runs step() and takes the argmax on the host
  // (CpuBackend uses it); the CUDA engine computes it on the device.
  virtual void step_greedy(std::span<const SeqWork> work, StepOutput& out);

  // Pipelined greedy decode (the "overlap scheduler"): launch_greedy_decode() enqueues one decode
  // step (one token per item, distinct slots that already hold tokens, greedy rows only) and
  // collect_greedy_decode() returns the tokens of the oldest step launched and not yet collected
  // (tokens[i]: item i's greedy token, -1 for NaN / +inf logits, as step_greedy). A caller keeps
  // the device busy by launching step t+1 (its tokens fed from step t with feed_row) before it
  // collects step t, so the host's work between two steps (stop checks, the next step's metadata,
  // the graph launch) overlaps the GPU. At most max_decode_in_flight() steps may be launched and
  // not collected; slot_len() / can_grow() / memory() count the launched steps. reset_slot() may
  // be called while a launched step still holds the slot (its token is then collected and
  // ignored): the backend runs its steps in launch order, so the queued step's writes to the
  // slot's KV pages and GDN state land before any later step reuses them. step() / step_greedy()
  // need every launched step collected first, and feed_row refers to the last launch only when
  // no step() / step_greedy() ran after it (the CUDA engine enforces both). Validation errors
  // throw at launch before anything changes; a device error can also throw from launch after part
  // of the step was enqueued (the slots' state is then unknown: the engine ends those requests and
  // never re-runs the step); asynchronous (device) errors throw at collect.
  // This default runs each step synchronously inside launch (through step_greedy: the same
  // validation and tokens), so it behaves exactly like the plain loop; the CUDA engine overrides
  // it (pipelines_decode() true).
  virtual void launch_greedy_decode(std::span<const DecodeItem> items);
  virtual void collect_greedy_decode(std::vector<int32_t>& tokens);
  virtual bool pipelines_decode() const { return false; }
  // The most top ids step_greedy() scores rows with itself (SeqWork::score_top); -1: it does not
  // score rows, and a caller that wants prompt logprobs asks for all_logits rows instead.
  virtual int max_score_top() const { return -1; }
  virtual int max_decode_in_flight() const { return 2; }
  virtual int decode_in_flight() const { return static_cast<int>(launched_.size()); }

 protected:
  // The checks every implementation makes at launch: items, the in-flight bound, and feed rows
  // against the previous launched step's row count (prev_rows < 0: feeding is not possible now).
  void check_decode_launch(std::span<const DecodeItem> items, int prev_rows) const;

 private:
  // The default pipeline's results: tokens of the steps launched and not collected (oldest first)
  // and of the last step launched (what feed_row refers to).
  std::deque<std::vector<int32_t>> launched_;
  std::vector<int32_t> last_launched_;
  bool launched_any_ = false;
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
    DS_CHECK((row + n_rows) * V <= all.size(), "step_greedy: the backend returned ", all.size() / V,
             " logits rows, fewer than the work needs");
    if (w.greedy && !w.all_logits) {
      out.tokens[i] = greedy_token(std::span<const float>(all.data() + row * V, V));
    } else {
      out.logits.insert(out.logits.end(), all.begin() + row * V, all.begin() + (row + n_rows) * V);
    }
    row += n_rows;
  }
}

inline void Backend::check_decode_launch(std::span<const DecodeItem> items, int prev_rows) const {
  DS_CHECK(!items.empty(), "launch_greedy_decode: no items");
  DS_CHECK(decode_in_flight() < max_decode_in_flight(),
           "launch_greedy_decode: ", max_decode_in_flight(),
           " steps already launched and not collected");
  for (const DecodeItem& it : items) {
    if (it.feed_row >= 0) {
      DS_CHECK(prev_rows >= 0, "launch_greedy_decode: slot ", it.slot,
               " takes its token from the previous step (feed_row ", it.feed_row,
               "), but the backend's last call was not a launch");
      DS_CHECK(it.feed_row < prev_rows, "launch_greedy_decode: feed_row ", it.feed_row, " of slot ",
               it.slot, " is past the previous step's ", prev_rows, " rows");
    }
  }
}

inline void Backend::launch_greedy_decode(std::span<const DecodeItem> items) {
  check_decode_launch(items, launched_any_ ? static_cast<int>(last_launched_.size()) : -1);
  std::vector<int32_t> toks(items.size());
  std::vector<SeqWork> work(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const DecodeItem& it = items[i];
    // An invalid fed token (-1: NaN / inf logits) goes in as id 0, as on the device; the caller
    // saw the -1 in the earlier step's tokens and drops what follows.
    toks[i] = it.feed_row >= 0 ? std::max(0, last_launched_[it.feed_row]) : it.token;
    DS_CHECK(slot_len(it.slot) > 0, "launch_greedy_decode: slot ", it.slot,
             " holds no tokens (run its prompt with step() first)");
  }
  for (size_t i = 0; i < items.size(); ++i) {
    work[i].slot = items[i].slot;
    work[i].tokens = std::span<const int32_t>(&toks[i], 1);
    work[i].greedy = true;
  }
  StepOutput out;
  step_greedy(work, out);
  last_launched_ = out.tokens;
  launched_any_ = true;
  launched_.push_back(std::move(out.tokens));
}

inline void Backend::collect_greedy_decode(std::vector<int32_t>& tokens) {
  DS_CHECK(!launched_.empty(), "collect_greedy_decode: no launched step to collect");
  tokens = std::move(launched_.front());
  launched_.pop_front();
}

struct BackendOptions {
  std::string device = "cpu";  // "cpu" or "cuda" / "cuda:N"
  int n_slots = 8;
  int max_seq_len = 0;    // 0: the model's max_position_embeddings, capped by memory
  int chunk_size = 4096;  // prompt chunk (tokens per step per sequence)
};

}  // namespace ds
