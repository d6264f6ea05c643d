// Scheduler tests against a fake paged Backend (no model): budgets, chunking, FCFS admission,
// the waiting bound, preemption by recompute under memory pressure, cancellation freeing memory at
// once, capacity stops, and batch invariance (a sequence's tokens are the same alone and among
// 32 concurrent ones, with preemptions).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "core/error.h"
#include "runtime/scheduler.h"

namespace ds {
namespace {

// A paged backend whose "model" predicts the next token as a hash of the whole sequence so far:
// outputs depend only on the tokens, never on batching, so any scheduling bug (a lost chunk,
// a token run twice, a slot mixed up) changes the output.
class FakeBackend : public Backend {
 public:
  FakeBackend(int n_slots, int page_size, int64_t n_blocks, int vocab = 97)
      : page_(page_size), blocks_total_(n_blocks), history_(n_slots) {
    cfg_.vocab_size = vocab;
  }
  const ModelConfig& config() const override { return cfg_; }
  std::string name() const override { return "fake"; }
  int n_slots() const override { return static_cast<int>(history_.size()); }
  int max_seq_len() const override { return 1 << 20; }
  int slot_len(int slot) const override { return static_cast<int>(history_.at(slot).size()); }
  bool can_grow(int slot, int n_new) const override {
    return blocks_used() - blocks(slot_len(slot)) + blocks(slot_len(slot) + n_new) <= blocks_total_;
  }
  void reset_slot(int slot) override { history_.at(slot).clear(); }
  MemoryUsage memory() const override {
    MemoryUsage m;
    m.kv_blocks_total = blocks_total_;
    m.kv_blocks_used = blocks_used();
    m.page_size = page_;
    m.state_slots_total = n_slots();
    for (const auto& h : history_) m.state_slots_used += h.empty() ? 0 : 1;
    return m;
  }
  void step(std::span<const SeqWork> work, std::vector<float>& logits) override {
    std::set<int> slots;
    logits.clear();
    ++n_steps;
    for (const SeqWork& w : work) {
      if (!slots.insert(w.slot).second) throw_error("fake: slot ", w.slot, " twice in one step");
      if (w.tokens.empty()) throw_error("fake: empty work item");
      if (!can_grow(w.slot, static_cast<int>(w.tokens.size())))
        throw_error("fake: KV pool overflow");
      auto& h = history_.at(w.slot);
      h.insert(h.end(), w.tokens.begin(), w.tokens.end());
      max_tokens_in_step = std::max<int>(max_tokens_in_step, static_cast<int>(w.tokens.size()));
      std::vector<float> row(cfg_.vocab_size, 0.0f);
      row[next_token(h)] = 1.0f;
      logits.insert(logits.end(), row.begin(), row.end());
    }
  }
  int next_token(const std::vector<int32_t>& h) const {
    uint64_t x = 1469598103934665603ull;
    for (int32_t t : h) x = (x ^ static_cast<uint64_t>(t)) * 1099511628211ull;
    return static_cast<int>(x % static_cast<uint64_t>(cfg_.vocab_size));
  }
  int64_t blocks(int64_t n) const { return (n + page_ - 1) / page_; }
  int64_t blocks_used() const {
    int64_t b = 0;
    for (const auto& h : history_) b += blocks(static_cast<int64_t>(h.size()));
    return b;
  }
  int n_steps = 0;
  int max_tokens_in_step = 0;

 private:
  ModelConfig cfg_;
  int page_;
  int64_t blocks_total_;
  std::vector<std::vector<int32_t>> history_;
};

// A minimal engine loop: greedy argmax, `max_new` tokens per sequence.
struct Driver {
  Driver(FakeBackend& b, Scheduler& s) : backend(b), sched(s) {}
  FakeBackend& backend;
  Scheduler& sched;
  std::map<uint64_t, int> max_new;
  std::map<uint64_t, std::vector<int32_t>> out;
  std::set<uint64_t> capacity_stopped;
  int64_t max_running = 0;
  std::vector<StepPlan> history;  // plans without spans (checked right after planning)
  struct Span {
    uint64_t id;
    int begin, end;
  };
  std::vector<std::vector<Span>> logit_items;  // per step: the items run with all_logits

  void add(uint64_t id, std::vector<int32_t> prompt, int n_new, bool prompt_rows = false) {
    ASSERT_TRUE(sched.add(id, std::move(prompt),
                          prompt_rows ? Scheduler::PromptRows::kHost : Scheduler::PromptRows::kNone));
    max_new[id] = n_new;
  }
  // Runs one step; returns false when idle.
  bool step() {
    if (sched.idle()) return false;
    StepPlan plan = sched.schedule();
    for (uint64_t id : plan.capacity_stopped) capacity_stopped.insert(id);
    max_running = std::max<int64_t>(max_running, sched.n_running());
    if (plan.empty()) return !sched.idle();
    std::vector<float> logits;
    backend.step(plan.work, logits);
    sched.complete(plan);
    const int vocab = backend.config().vocab_size;
    for (size_t i = 0; i < plan.items.size(); ++i) {
      const ScheduledItem& it = plan.items[i];
      if (!it.sample) continue;
      const float* row = logits.data() + i * vocab;
      const int32_t tok = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      auto& o = out[it.seq_id];
      o.push_back(tok);
      if (static_cast<int>(o.size()) >= max_new[it.seq_id]) {
        sched.remove(it.seq_id);
      } else {
        sched.append_token(it.seq_id, tok);
      }
    }
    logit_items.emplace_back();
    for (size_t i = 0; i < plan.items.size(); ++i) {
      if (plan.work[i].all_logits)
        logit_items.back().push_back({plan.items[i].seq_id, plan.items[i].begin, plan.items[i].end});
    }
    plan.work.clear();
    history.push_back(std::move(plan));
    return true;
  }
  void run(int max_steps = 100000) {
    for (int i = 0; i < max_steps && step(); ++i) {
    }
    ASSERT_TRUE(sched.idle()) << "did not finish in " << max_steps << " steps";
  }
};

std::vector<int32_t> make_prompt(int n, int seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (auto& t : p) t = static_cast<int32_t>(rng() % 97);
  return p;
}

// Reference: the same fake model run token by token, sequence alone.
std::vector<int32_t> reference(const FakeBackend& b, std::vector<int32_t> seq, int n_new) {
  std::vector<int32_t> out;
  for (int i = 0; i < n_new; ++i) {
    const int32_t t = b.next_token(seq);
    out.push_back(t);
    seq.push_back(t);
  }
  return out;
}

TEST(Scheduler, ChunkedPrefillThenDecode) {
  FakeBackend b(4, 16, 1000);
  SchedulerOptions o;
  o.chunk_size = 4;
  o.max_num_batched_tokens = 64;
  Scheduler s(b, o);
  Driver d(b, s);
  d.add(7, make_prompt(10, 1), 5);
  d.run();
  ASSERT_EQ(d.history.size(), 3u + 4u);  // chunks 4,4,2 (the last samples), then 4 decodes
  EXPECT_EQ(d.history[0].n_tokens, 4);
  EXPECT_FALSE(d.history[0].items[0].sample);
  EXPECT_EQ(d.history[2].n_tokens, 2);
  EXPECT_TRUE(d.history[2].items[0].sample);
  EXPECT_EQ(d.out[7], reference(b, make_prompt(10, 1), 5));
  EXPECT_EQ(b.memory().kv_blocks_used, 0);
  EXPECT_EQ(b.memory().state_slots_used, 0);
}

TEST(Scheduler, TokenBudgetAndDecodeFirst) {
  FakeBackend b(8, 16, 100000);
  SchedulerOptions o;
  o.max_batch = 8;
  o.chunk_size = 64;
  o.max_num_batched_tokens = 40;
  Scheduler s(b, o);
  Driver d(b, s);
  for (int i = 0; i < 8; ++i) d.add(i, make_prompt(50 + i, i), 20);
  d.run();
  for (const StepPlan& p : d.history) {
    EXPECT_LE(p.n_tokens, 40);
    // Decodes come before every prompt chunk in the step.
    bool seen_chunk = false;
    for (const ScheduledItem& it : p.items) {
      const bool decode = it.end - it.begin == 1;
      if (!decode) seen_chunk = true;
      if (seen_chunk && decode) {
        // A 1-token chunk at the end of a prefill is allowed after chunks; decodes are not.
        EXPECT_TRUE(it.sample);
      }
    }
  }
  EXPECT_LE(b.max_tokens_in_step, 40);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(d.out[i], reference(b, make_prompt(50 + i, i), 20)) << i;
}

TEST(Scheduler, MaxBatchAndFcfsAdmission) {
  FakeBackend b(8, 16, 100000);
  SchedulerOptions o;
  o.max_batch = 3;
  o.max_num_batched_tokens = 1000;
  o.chunk_size = 1000;
  Scheduler s(b, o);
  Driver d(b, s);
  for (int i = 0; i < 10; ++i) d.add(100 + i, make_prompt(5, i), 3 + (i % 4));
  std::vector<uint64_t> admitted;
  while (!s.idle()) {
    const size_t before = d.history.size();
    d.step();
    if (d.history.size() > before) {
      for (const auto& it : d.history.back().items)
        if (it.begin == 0) admitted.push_back(it.seq_id);
    }
  }
  EXPECT_EQ(d.max_running, 3);
  std::vector<uint64_t> expect;
  for (int i = 0; i < 10; ++i) expect.push_back(100 + i);
  EXPECT_EQ(admitted, expect);
}

TEST(Scheduler, WaitingQueueBound) {
  FakeBackend b(1, 16, 1000);
  SchedulerOptions o;
  o.max_batch = 1;
  o.max_waiting = 2;
  Scheduler s(b, o);
  EXPECT_TRUE(s.add(1, {1, 2}));
  EXPECT_TRUE(s.add(2, {1, 2}));
  EXPECT_FALSE(s.add(3, {1, 2}));  // full
  EXPECT_EQ(s.n_waiting(), 2);
  s.schedule();  // admits 1 -> room for one more
  EXPECT_TRUE(s.add(3, {1, 2}));
  EXPECT_THROW(s.add(3, {1}), Error);  // duplicate id
  EXPECT_THROW(s.add(4, {}), Error);   // empty prompt
}

TEST(Scheduler, PreemptionByRecomputeKeepsOutputs) {
  // 8 sequences want up to 8 * ceil(70/4) = 144 blocks; the pool has 40.
  FakeBackend b(8, 4, 40);
  SchedulerOptions o;
  o.max_batch = 8;
  o.chunk_size = 8;
  o.max_num_batched_tokens = 32;
  Scheduler s(b, o);
  Driver d(b, s);
  for (int i = 0; i < 8; ++i) d.add(i, make_prompt(20, 10 + i), 50);
  d.run();
  EXPECT_GT(s.n_preemptions(), 0);
  EXPECT_TRUE(d.capacity_stopped.empty());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(d.out[i], reference(b, make_prompt(20, 10 + i), 50)) << i;
  EXPECT_EQ(b.memory().kv_blocks_used, 0);
}

TEST(Scheduler, PromptRowsAreCutToTheRowBudget) {
  FakeBackend b(4, 16, 1000);
  SchedulerOptions o;
  o.chunk_size = 8;
  o.max_num_batched_tokens = 64;
  o.max_logit_rows = 6;
  Scheduler s(b, o);
  Driver d(b, s);
  d.add(1, make_prompt(20, 1), 3, true);
  d.add(2, make_prompt(20, 2), 3);
  d.add(3, make_prompt(9, 3), 3, true);
  d.run();
  // Sequence 1 in chunks of 6 ([0, 6) ... [18, 20): rows before the last prompt token are
  // wanted, so its last chunk still has them), sequence 2 in chunks of 8 and never with rows;
  // sequence 3 gets what the 6 rows per step leave once 1 is through.
  std::map<uint64_t, int> covered;  // prompt positions given rows, in order
  for (const auto& step : d.logit_items) {
    int rows = 0;
    for (const auto& it : step) {
      rows += it.end - it.begin;
      EXPECT_NE(it.id, 2u);
      EXPECT_EQ(it.begin, covered[it.id]) << "seq " << it.id;
      covered[it.id] = it.end;
    }
    EXPECT_LE(rows, 6);
  }
  EXPECT_EQ(covered[1], 20);
  EXPECT_EQ(covered[3], 9);
  EXPECT_EQ(d.history[0].items[0].end - d.history[0].items[0].begin, 6);
  EXPECT_EQ(d.history[0].items[1].end - d.history[0].items[1].begin, 8);
  for (uint64_t id = 1; id <= 3; ++id)
    EXPECT_EQ(d.out[id], reference(b, make_prompt(id == 3 ? 9 : 20, static_cast<int>(id)), 3));
  // A one-token prompt has no prompt rows to give.
  FakeBackend b1(1, 16, 100);
  Scheduler s1(b1, o);
  ASSERT_TRUE(s1.add(9, {5}, Scheduler::PromptRows::kHost));
  EXPECT_FALSE(s1.schedule().work.at(0).all_logits);
}

TEST(Scheduler, PromptRowsAfterPreemptionOnlyWhereNotYetRun) {
  // As PreemptionByRecomputeKeepsOutputs, every sequence asking for its prompt rows: a
  // recompute after the prompt ran asks for none, one before it runs the positions whose rows
  // were taken without rows (not against the row budget) and resumes exactly where they stopped.
  FakeBackend b(8, 4, 40);
  SchedulerOptions o;
  o.max_batch = 8;
  o.chunk_size = 8;
  o.max_num_batched_tokens = 32;
  o.max_logit_rows = 12;
  Scheduler s(b, o);
  Driver d(b, s);
  for (int i = 0; i < 8; ++i) d.add(i, make_prompt(20, 10 + i), 50, true);
  d.run();
  EXPECT_GT(s.n_preemptions(), 0);
  std::map<uint64_t, int> reached;  // highest prompt position given rows
  for (const auto& step : d.logit_items) {
    int rows = 0;
    for (const auto& it : step) {
      rows += it.end - it.begin;
      EXPECT_EQ(it.begin, reached[it.id]) << "rows skipped or repeated for seq " << it.id;
      EXPECT_LT(it.begin, 19) << "rows after the prompt for seq " << it.id;
      reached[it.id] = it.end;
    }
    EXPECT_LE(rows, 12);
  }
  // The case this test is for: sequences preempted part-way through their prompt rows.
  int recomputes_mid_rows = 0;
  std::map<uint64_t, int> cached;  // where each sequence's next item must begin
  for (size_t st = 0; st < d.history.size(); ++st) {
    for (const ScheduledItem& it : d.history[st].items) {
      if (it.begin == 0 && cached[it.seq_id] > 0 && cached[it.seq_id] < 19) ++recomputes_mid_rows;
      cached[it.seq_id] = it.end;
    }
  }
  EXPECT_GT(recomputes_mid_rows, 0);
  for (int i = 0; i < 8; ++i) {
    EXPECT_GE(reached[i], 19) << i;  // rows [0, 19): the one at 19 samples the first token
    EXPECT_EQ(d.out[i], reference(b, make_prompt(20, 10 + i), 50)) << i;
  }
}

TEST(Scheduler, RemoveFreesSlotAtOnce) {
  FakeBackend b(2, 4, 100);
  SchedulerOptions o;
  Scheduler s(b, o);
  Driver d(b, s);
  d.add(1, make_prompt(30, 1), 100);
  d.add(2, make_prompt(30, 2), 100);
  d.step();
  d.step();
  EXPECT_GT(b.memory().kv_blocks_used, 0);
  EXPECT_EQ(b.memory().state_slots_used, 2);
  s.remove(1);
  EXPECT_EQ(b.memory().state_slots_used, 1);
  EXPECT_EQ(b.memory().kv_blocks_used, b.blocks(b.slot_len(0)) + b.blocks(b.slot_len(1)));
  s.remove(2);
  s.remove(2);  // unknown now: ignored
  EXPECT_EQ(b.memory().kv_blocks_used, 0);
  EXPECT_TRUE(s.idle());
  // A waiting sequence can be removed too.
  ASSERT_TRUE(s.add(3, {1, 2, 3}));
  s.remove(3);
  EXPECT_TRUE(s.idle());
}

TEST(Scheduler, LoneSequenceBeyondPoolIsStoppedNotFailed) {
  FakeBackend b(2, 4, 5);  // 20 tokens in all
  SchedulerOptions o;
  Scheduler s(b, o);
  Driver d(b, s);
  d.add(1, make_prompt(12, 3), 100);
  d.run();
  EXPECT_EQ(d.capacity_stopped.count(1), 1u);
  EXPECT_EQ(d.out[1].size(), 20u - 12u + 1u);  // grew until the pool was full, plus the last sample
  EXPECT_EQ(b.memory().kv_blocks_used, 0);
}

TEST(Scheduler, PromptLargerThanPoolWaitsThenStops) {
  FakeBackend b(2, 4, 5);
  SchedulerOptions o;
  Scheduler s(b, o);
  Driver d(b, s);
  d.add(1, make_prompt(40, 3), 4);  // can never be admitted
  d.add(2, make_prompt(4, 4), 2);   // FCFS: waits behind it
  StepPlan p = s.schedule();
  EXPECT_TRUE(p.empty());
  EXPECT_EQ(s.n_waiting(), 2);
  // The engine validates prompt length against the pool before add(); removing it unblocks.
  s.remove(1);
  d.max_new.erase(1);
  d.run();
  EXPECT_EQ(d.out[2], reference(b, make_prompt(4, 4), 2));
}

TEST(Scheduler, BatchInvarianceWith32ConcurrentAndCancellations) {
  std::vector<std::vector<int32_t>> alone(32);
  {
    for (int i = 0; i < 32; ++i) {
      FakeBackend b(1, 16, 1000);
      Scheduler s(b, SchedulerOptions{});
      Driver d(b, s);
      d.add(i, make_prompt(5 + i * 3, 100 + i), 24);
      d.run();
      alone[i] = d.out[i];
    }
  }
  FakeBackend b(16, 8, 120);  // tight: forces preemptions
  SchedulerOptions o;
  o.max_batch = 16;
  o.chunk_size = 16;
  o.max_num_batched_tokens = 64;
  Scheduler s(b, o);
  Driver d(b, s);
  for (int i = 0; i < 32; ++i) d.add(i, make_prompt(5 + i * 3, 100 + i), 24);
  std::mt19937 rng(5);
  std::set<uint64_t> cancelled;
  for (int step = 0; step < 100000 && d.step(); ++step) {
    if (step % 7 == 3) {
      const uint64_t victim = rng() % 32;
      if (s.find(victim) && victim % 3 == 0) {
        s.remove(victim);
        cancelled.insert(victim);
      }
    }
  }
  ASSERT_TRUE(s.idle());
  EXPECT_GT(s.n_preemptions(), 0);
  for (int i = 0; i < 32; ++i) {
    if (cancelled.count(i)) {
      // A prefix of the alone output.
      const auto& o2 = d.out[i];
      EXPECT_TRUE(std::equal(o2.begin(), o2.end(), alone[i].begin())) << i;
    } else {
      EXPECT_EQ(d.out[i], alone[i]) << i;
    }
  }
  EXPECT_FALSE(cancelled.empty());
  EXPECT_EQ(b.memory().kv_blocks_used, 0);
  EXPECT_EQ(b.memory().state_slots_used, 0);
}

}  // namespace
}  // namespace ds
