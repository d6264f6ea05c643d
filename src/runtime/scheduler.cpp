// Continuous-batching scheduler: see scheduler.h for the policy.
#include "runtime/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace ds {

Scheduler::Scheduler(Backend& backend, const SchedulerOptions& options)
    : backend_(backend), opt_(options) {
  DS_CHECK(opt_.max_batch >= 1, "scheduler: max_batch must be >= 1 (got ", opt_.max_batch, ")");
  DS_CHECK(opt_.max_num_batched_tokens >= 1, "scheduler: max_num_batched_tokens must be >= 1");
  DS_CHECK(opt_.chunk_size >= 1, "scheduler: chunk_size must be >= 1");
  DS_CHECK(opt_.max_waiting >= 0, "scheduler: max_waiting must be >= 0");
  DS_CHECK(opt_.max_logit_rows >= 1, "scheduler: max_logit_rows must be >= 1");
  opt_.max_batch = std::min(opt_.max_batch, backend_.n_slots());
  // Highest slot last so that pop_back hands out slot 0 first.
  for (int s = backend_.n_slots() - 1; s >= 0; --s) {
    backend_.reset_slot(s);
    free_slots_.push_back(s);
  }
}

bool Scheduler::add(uint64_t id, std::vector<int32_t> prompt, PromptRows rows) {
  DS_CHECK(!prompt.empty(), "scheduler: sequence ", id, " has an empty prompt");
  DS_CHECK(!seqs_.count(id), "scheduler: duplicate sequence id ", id);
  if (static_cast<int>(waiting_.size()) >= opt_.max_waiting) return false;
  SchedSeq s;
  s.id = id;
  s.arrival = next_arrival_++;
  s.n_prompt = static_cast<int>(prompt.size());
  // The last prompt position's row samples the first token: only those before it score.
  s.logits_until = rows != PromptRows::kNone ? s.n_prompt - 1 : 0;
  s.rows_on_host = rows == PromptRows::kHost;
  s.tokens = std::move(prompt);
  seqs_.emplace(id, std::move(s));
  waiting_.push_back(id);
  return true;
}

const SchedSeq* Scheduler::find(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

void Scheduler::free_slot(SchedSeq& s) {
  if (s.slot < 0) return;
  backend_.reset_slot(s.slot);
  free_slots_.push_back(s.slot);
  s.slot = -1;
  s.n_cached = 0;
}

void Scheduler::preempt(uint64_t id, StepPlan& plan) {
  SchedSeq& s = seqs_.at(id);
  free_slot(s);
  s.status = SeqStatus::kWaiting;
  ++s.n_preemptions;
  ++n_preemptions_;
  running_.erase(std::find(running_.begin(), running_.end(), id));
  waiting_.push_front(id);  // preempted latest-first, so earlier arrivals end up in front
  plan.preempted.push_back(id);
}

void Scheduler::remove(uint64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  SchedSeq& s = it->second;
  if (s.status == SeqStatus::kRunning) {
    free_slot(s);
    running_.erase(std::find(running_.begin(), running_.end(), id));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
  }
  seqs_.erase(it);
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  int budget = opt_.max_num_batched_tokens;
  int logit_rows = opt_.max_logit_rows;  // every-token rows left in this step
  // s's next chunk brings prompt rows to the host: it counts against logit_rows.
  auto host_rows = [](const SchedSeq& s) {
    return s.rows_on_host && s.n_cached >= s.logits_from && s.n_cached < s.logits_until;
  };
  // Tokens of s's next chunk, at most `want`, that the logits-row budget lets run. A recompute
  // of positions whose rows were taken stops where they end, so that it needs none.
  auto rows_cap = [&](const SchedSeq& s, int want) {
    if (s.rows_on_host && s.n_cached < s.logits_from)
      return std::min(want, s.logits_from - s.n_cached);
    return host_rows(s) ? std::min(want, logit_rows) : want;
  };

  // Paged KV accounting across the step (can_grow alone checks each item against the pool as it
  // is now, not against what the items planned before it take).
  const MemoryUsage mem = backend_.memory();
  const bool paged = mem.page_size > 0 && mem.kv_blocks_total > 0;
  int64_t free_blocks = mem.kv_blocks_total - mem.kv_blocks_used;
  auto blocks_for = [&](int64_t n_tokens) -> int64_t {
    return (n_tokens + mem.page_size - 1) / mem.page_size;
  };
  auto need_blocks = [&](const SchedSeq& s, int n) -> int64_t {
    return paged ? blocks_for(s.n_cached + n) - blocks_for(s.n_cached) : 0;
  };
  auto fits = [&](const SchedSeq& s, int n) -> bool {
    return need_blocks(s, n) <= free_blocks && backend_.can_grow(s.slot, n);
  };
  std::vector<uint64_t> scheduled;  // ids with an item in this plan
  auto emit = [&](SchedSeq& s, int n) {
    free_blocks -= need_blocks(s, n);
    budget -= n;
    if (host_rows(s)) logit_rows -= n;
    ScheduledItem item;
    item.seq_id = s.id;
    item.slot = s.slot;
    item.begin = s.n_cached;
    item.end = s.n_cached + n;
    item.sample = item.end == static_cast<int>(s.tokens.size());
    plan.items.push_back(item);
    plan.n_tokens += n;
    if (s.pending() == 1) ++plan.n_decode;
    scheduled.push_back(s.id);
  };
  // The largest n <= want that fits now (0 when none does); can_grow is monotone in n.
  auto largest_fit = [&](const SchedSeq& s, int want) -> int {
    if (fits(s, want)) return want;
    int lo = 0, hi = want;  // fits(lo) (or lo == 0), !fits(hi)
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      if (fits(s, mid))
        lo = mid;
      else
        hi = mid;
    }
    return lo;
  };

  // 1. Decodes of running sequences, in arrival order; preempt the latest arrival to make room.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    SchedSeq& s = seqs_.at(running_[i]);
    if (s.pending() != 1) continue;
    bool preempted_self = false;
    while (!fits(s, 1)) {
      const uint64_t victim = running_.back();
      if (victim == s.id && running_.size() == 1) {
        // Alone and still no room: the pool cannot hold this sequence any longer.
        plan.capacity_stopped.push_back(s.id);
        free_slot(s);
        running_.clear();
        seqs_.erase(s.id);
        preempted_self = true;
        break;
      }
      const bool is_self = victim == s.id;
      preempt(victim, plan);
      if (is_self) {
        preempted_self = true;
        break;
      }
      // Freed memory: recount the blocks of this step from the backend's view plus what the
      // items planned so far take.
      const MemoryUsage m = backend_.memory();
      free_blocks = m.kv_blocks_total - m.kv_blocks_used;
      for (const ScheduledItem& it : plan.items)
        free_blocks -= need_blocks(seqs_.at(it.seq_id), it.end - it.begin);
    }
    if (preempted_self) break;  // everything after it in arrival order is gone too
    emit(s, 1);
  }

  // 2. Chunks of running sequences still prefilling (no preemption for them: they wait).
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    SchedSeq& s = seqs_.at(running_[i]);
    if (s.pending() <= 1) continue;
    const int n = largest_fit(s, rows_cap(s, std::min({s.pending(), opt_.chunk_size, budget})));
    if (n > 0) emit(s, n);
  }

  // 3. Admission, strictly FCFS.
  while (!waiting_.empty() && budget > 0 && !free_slots_.empty() &&
         static_cast<int>(running_.size()) < opt_.max_batch) {
    SchedSeq& s = seqs_.at(waiting_.front());
    s.slot = free_slots_.back();
    s.n_cached = 0;
    // The whole remaining prompt must fit the pool now, so that admission does not thrash.
    const int64_t whole = need_blocks(s, s.pending());
    const int n = rows_cap(s, std::min({s.pending(), opt_.chunk_size, budget}));
    if (n == 0 || whole > free_blocks || !backend_.can_grow(s.slot, s.pending()) || !fits(s, n)) {
      s.slot = -1;
      break;
    }
    free_slots_.pop_back();
    waiting_.pop_front();
    s.status = SeqStatus::kRunning;
    running_.push_back(s.id);
    std::sort(running_.begin(), running_.end(),
              [&](uint64_t a, uint64_t b) { return seqs_.at(a).arrival < seqs_.at(b).arrival; });
    emit(s, n);
  }

  // Nothing could run although sequences hold memory (prefills blocking each other): free the
  // latest arrival and plan again.
  if (plan.items.empty() && !running_.empty()) {
    if (running_.size() == 1 && waiting_.empty()) {
      // A lone prefill the pool cannot take: stop it rather than loop.
      SchedSeq& s = seqs_.at(running_[0]);
      plan.capacity_stopped.push_back(s.id);
      free_slot(s);
      running_.clear();
      seqs_.erase(s.id);
      return plan;
    }
    StepPlan again;
    preempt(running_.back(), again);
    StepPlan next = schedule();
    next.preempted.insert(next.preempted.begin(), again.preempted.begin(), again.preempted.end());
    next.capacity_stopped.insert(next.capacity_stopped.end(), plan.capacity_stopped.begin(),
                                 plan.capacity_stopped.end());
    return next;
  }

  plan.work.reserve(plan.items.size());
  for (const ScheduledItem& it : plan.items) {
    const SchedSeq& s = seqs_.at(it.seq_id);
    SeqWork w;
    w.slot = it.slot;
    w.tokens = std::span<const int32_t>(s.tokens.data() + it.begin, it.end - it.begin);
    w.all_logits = s.rows_due(it.begin, it.end);
    plan.work.push_back(w);
  }
  return plan;
}

void Scheduler::complete(const StepPlan& plan) {
  for (const ScheduledItem& it : plan.items) {
    auto found = seqs_.find(it.seq_id);
    DS_ASSERT(found != seqs_.end());
    DS_ASSERT(found->second.n_cached == it.begin);
    SchedSeq& s = found->second;
    s.n_cached = it.end;
    if (s.rows_due(it.begin, it.end)) s.logits_from = it.end;  // the rows were taken
    if (s.logits_from >= s.logits_until) s.logits_from = s.logits_until = 0;
  }
}

void Scheduler::append_token(uint64_t id, int32_t token) {
  SchedSeq& s = seqs_.at(id);
  DS_ASSERT(s.status == SeqStatus::kRunning && s.pending() == 0);
  s.tokens.push_back(token);
}

}  // namespace ds
