// Continuous-batching scheduler (host only, no GPU): decides, step by step, which tokens of which
// sequences the Backend runs. Each step mixes one decode token of every running sequence with
// prompt chunks of sequences still prefilling or newly admitted, under a token budget.
//
// Policy (FCFS, the vLLM v1 / Sarathi shape):
//   1. running sequences that decode (one pending token), in arrival order;
//   2. running sequences still prefilling, a chunk each (<= chunk_size, <= what is left of the
//      budget, shrunk to what the KV pool holds now);
//   3. admission of waiting sequences, strictly in order, while a slot is free (<= max_batch
//      running), the budget lasts and the KV pool can take the whole remaining prompt.
// Memory: Backend::can_grow for every item, plus (paged backends) the free KV blocks of
// Backend::memory() counted down across the step so that items planned together fit together.
// A decode that cannot grow preempts the latest-arrived running sequence (recompute: its slot is
// freed and it goes back to the front of the waiting queue with prompt + generated tokens); a
// lone sequence that the whole pool cannot grow any more is stopped (reason kCapacity), never
// failed. The waiting queue is bounded (add() refuses beyond max_waiting; preempted sequences
// always get back in).
//
// Threading: not thread-safe; the engine thread owns it.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <vector>

#include "runtime/backend.h"

namespace ds {

struct SchedulerOptions {
  int max_batch = 8;                  // running sequences at most (<= Backend::n_slots)
  int max_num_batched_tokens = 2048;  // tokens per step: decode tokens + prompt chunks
  int chunk_size = 512;               // prompt tokens per sequence per step
  int max_waiting = 256;              // waiting-queue bound (add() refuses beyond it)
  // Rows of every-token logits per step (sequences added with PromptRows::kHost: their prompt
  // chunks come back with one logits row per token, vocab floats each, so they are cut to this).
  int max_logit_rows = 256;
};

enum class SeqStatus : uint8_t { kWaiting, kRunning };

struct SchedSeq {
  uint64_t id = 0;
  uint64_t arrival = 0;         // order of add(); FCFS and preemption order
  std::vector<int32_t> tokens;  // prompt + generated so far
  int n_prompt = 0;             // tokens of the original prompt
  int n_cached = 0;             // tokens[0, n_cached) are held by the backend slot
  int slot = -1;                // backend slot while running, -1 while waiting
  // Prompt positions [logits_from, logits_until) still need their logits row (prompt logprobs:
  // the row at p scores token p + 1); both 0 once all have run. A recompute after preemption
  // asks again only from logits_from on.
  int logits_from = 0;
  int logits_until = 0;
  bool rows_on_host = false;  // those rows count against max_logit_rows
  int n_preemptions = 0;
  SeqStatus status = SeqStatus::kWaiting;
  int pending() const { return static_cast<int>(tokens.size()) - n_cached; }
  // Whether tokens[begin, end) run with their logits rows (they reach the positions still due).
  bool rows_due(int begin, int end) const { return begin < logits_until && end > logits_from; }
};

// One work item of a step: tokens[begin, end) of a sequence. When `sample` (end reaches the last
// token) the item's logits row gives the sequence's next token. Items of a sequence whose prompt
// rows are due (SchedSeq::logits_until) run with SeqWork::all_logits: a row per token.
struct ScheduledItem {
  uint64_t seq_id = 0;
  int slot = 0;
  int begin = 0, end = 0;
  bool sample = false;
};

struct StepPlan {
  std::vector<ScheduledItem> items;
  std::vector<SeqWork> work;               // for Backend::step: same order as items
  std::vector<uint64_t> preempted;         // sent back to waiting while planning this step
  std::vector<uint64_t> capacity_stopped;  // removed: the KV pool cannot hold one more token
  int n_tokens = 0;                        // tokens in the step
  int n_decode = 0;                        // items that are single decode tokens
  bool empty() const { return items.empty(); }
};

class Scheduler {
 public:
  Scheduler(Backend& backend, const SchedulerOptions& options);

  // Queues a new sequence. Returns false (and does nothing) when the waiting queue is full.
  // Throws ds::Error for an empty prompt or a duplicate id. `rows`: the logits row of every prompt
  // position is wanted (prompt logprobs; its items get all_logits): kHost, max_logit_rows per
  // step at most; kScored, the backend scores them itself (no cap).
  enum class PromptRows : uint8_t { kNone, kHost, kScored };
  bool add(uint64_t id, std::vector<int32_t> prompt, PromptRows rows = PromptRows::kNone);

  // Plans the next step (may preempt or stop sequences, see the header comment). The plan's
  // spans point into the sequences' token vectors: valid until the next call that changes them.
  StepPlan schedule();

  // After Backend::step ran `plan`: the items' tokens are now cached in their slots.
  void complete(const StepPlan& plan);

  // A token sampled for a running sequence (after complete()).
  void append_token(uint64_t id, int32_t token);

  // Removes a sequence (finished or cancelled), waiting or running; a running one's slot is reset
  // at once. Unknown ids are ignored (the sequence may have been stopped by the scheduler).
  void remove(uint64_t id);

  const SchedSeq* find(uint64_t id) const;
  int n_waiting() const { return static_cast<int>(waiting_.size()); }
  int n_running() const { return static_cast<int>(running_.size()); }
  bool idle() const { return waiting_.empty() && running_.empty(); }
  int64_t n_preemptions() const { return n_preemptions_; }
  const SchedulerOptions& options() const { return opt_; }

 private:
  void preempt(uint64_t id, StepPlan& plan);
  void free_slot(SchedSeq& s);

  Backend& backend_;
  SchedulerOptions opt_;
  std::map<uint64_t, SchedSeq> seqs_;
  std::deque<uint64_t> waiting_;   // front = next to admit
  std::vector<uint64_t> running_;  // arrival order
  std::vector<int> free_slots_;    // backend slots not in use
  uint64_t next_arrival_ = 0;
  int64_t n_preemptions_ = 0;
};

}  // namespace ds
