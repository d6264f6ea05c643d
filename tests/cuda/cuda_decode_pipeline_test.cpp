// Pipelined greedy decode (Backend::launch_greedy_decode / collect_greedy_decode, issue 6) on the
// CUDA engine against the synchronous step_greedy loop: the 27B shapes with 4 layers (3 GDN + 1
// attention), synthetic weights, prompts of 1000+ random tokens, 256 greedy steps at batch 1 and
// 4 where each step's input is the previous step's argmax. The pipelined run launches step t+1
// (tokens fed on the device from step t's argmax) before it collects step t; both runs must give
// bit-identical token sequences (same graph, same inputs), and the graph must have been replayed.
// DropRowWhileInFlight: at batch 4 one sequence leaves mid-run, as the engine handles an EOS: its
// slot is reset while the step after its last one, which still decodes it, is queued; that
// step's token for it is discarded. The others must still match a synchronous run that drops the
// same row at the same step, and the slot must serve a new sequence correctly afterwards (the
// same tokens as a slot reset with nothing in flight).
// Misuse: step() with launched steps pending, feed_row without a launch before, too many in
// flight: ds::Error, never a wrong answer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda_test_util.h"

namespace ds {
namespace {

ModelConfig config_27b_4_layers() {
  ModelConfig c = synthetic_model_config("27b");
  c.n_layers = 4;
  c.layer_types.resize(4);
  return c;
}

std::unique_ptr<Backend> make_engine(const ModelConfig& c, int slots) {
  BackendOptions o;
  o.device = "cuda";
  o.n_slots = slots;
  o.chunk_size = 2048;
  CudaEngineOptions e;
  e.verbose = false;
  e.max_kv_tokens = int64_t(slots) * 2048;
  return make_cuda_backend_synthetic(o, c, 7, e);
}

std::vector<std::vector<int32_t>> prompts_for(int batch, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> p(batch);
  for (int s = 0; s < batch; ++s) {
    p[s].resize(1000 + 37 * s);
    for (auto& x : p[s]) x = int32_t(rng() % uint32_t(vocab));
  }
  return p;
}

// Prefills slot s with prompts[s] and returns each slot's greedy first token.
std::vector<int32_t> prefill(Backend& b, const std::vector<std::vector<int32_t>>& prompts) {
  std::vector<int32_t> first;
  for (size_t s = 0; s < prompts.size(); ++s) {
    b.reset_slot(static_cast<int>(s));
    SeqWork w{static_cast<int>(s), prompts[s], false, true};
    StepOutput out;
    b.step_greedy(std::span<const SeqWork>(&w, 1), out);
    first.push_back(out.tokens.at(0));
  }
  return first;
}

// tokens[step][row]; rows leave at drop_step (row drop_row) when drop_step >= 0.
using Trace = std::vector<std::vector<int32_t>>;

Trace run_sync(Backend& b, std::vector<int32_t> cur, int steps, int drop_step, int drop_row) {
  std::vector<int> slots(cur.size());
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int>(i);
  Trace trace;
  for (int st = 0; st < steps; ++st) {
    if (st == drop_step) {
      b.reset_slot(slots[drop_row]);
      slots.erase(slots.begin() + drop_row);
      cur.erase(cur.begin() + drop_row);
    }
    std::vector<std::vector<int32_t>> tok(cur.size(), std::vector<int32_t>(1));
    std::vector<SeqWork> work(cur.size());
    for (size_t i = 0; i < cur.size(); ++i) {
      tok[i][0] = cur[i];
      work[i] = {slots[i], tok[i], false, true};
    }
    StepOutput out;
    b.step_greedy(work, out);
    trace.push_back(out.tokens);
    cur = out.tokens;
  }
  return trace;
}

// The engine loop's shape: launch step t+1 (fed), then collect step t. A row that leaves at
// drop_step does so as the engine handles an EOS: step drop_step is launched with the row still
// in it (fed; the host does not know yet), step drop_step - 1 is collected and the row's slot is
// reset right away, while step drop_step still holds it in the queue; step drop_step + 1 is
// launched without it, and its token from step drop_step (the wasted one) is discarded.
Trace run_pipelined(Backend& b, const std::vector<int32_t>& first, int steps, int drop_step,
                    int drop_row) {
  std::vector<DecodeItem> items(first.size());
  for (size_t i = 0; i < first.size(); ++i) items[i] = {static_cast<int>(i), first[i], -1};
  b.launch_greedy_decode(items);
  Trace trace;
  std::vector<int32_t> got;
  for (int st = 0; st < steps; ++st) {
    // Step st is in flight; launch st + 1 from it.
    if (st + 1 < steps) {
      std::vector<DecodeItem> next;
      for (size_t i = 0; i < items.size(); ++i) {
        if (st == drop_step && static_cast<int>(i) == drop_row) continue;  // gone from st + 1 on
        next.push_back({items[i].slot, 0, static_cast<int>(i)});
      }
      b.launch_greedy_decode(next);
      items = next;
    }
    b.collect_greedy_decode(got);
    if (st == drop_step) got.erase(got.begin() + drop_row);  // the wasted row
    trace.push_back(got);
    if (st + 1 == drop_step) {
      // The row's last token is in: its slot is reset while step drop_step, which still
      // decodes it, is queued (launched above).
      b.reset_slot(drop_row);
    }
  }
  return trace;
}

TEST(CudaDecodePipeline, TokensMatchSynchronous27bShapes) {
  DS_REQUIRE_GPU();
  const ModelConfig c = config_27b_4_layers();
  auto b = make_engine(c, 4);
  for (int batch : {1, 4}) {
    const auto prompts = prompts_for(batch, c.vocab_size, 11 + batch);
    const auto first = prefill(*b, prompts);
    const Trace ref = run_sync(*b, first, 256, -1, 0);
    const int64_t replays0 = cuda_graph_stats(*b).replays;
    const auto first2 = prefill(*b, prompts);
    ASSERT_EQ(first, first2);
    const Trace got = run_pipelined(*b, first2, 256, -1, 0);
    EXPECT_GE(cuda_graph_stats(*b).replays - replays0, 250) << "batch " << batch;
    ASSERT_EQ(got.size(), ref.size());
    int first_diff = -1;
    for (size_t st = 0; st < ref.size() && first_diff < 0; ++st)
      if (got[st] != ref[st]) first_diff = static_cast<int>(st);
    EXPECT_EQ(first_diff, -1) << "batch " << batch << ": pipelined tokens differ from step "
                              << first_diff;
    std::set<int32_t> distinct;
    for (const auto& row : ref) distinct.insert(row.begin(), row.end());
    std::printf(
        "  batch %d: 256 pipelined greedy steps equal the synchronous ones (%zu distinct "
        "tokens; graph replays %lld)\n",
        batch, distinct.size(), static_cast<long long>(cuda_graph_stats(*b).replays - replays0));
    EXPECT_GT(distinct.size(), 8u) << "a constant token stream proves little";
    EXPECT_EQ(b->decode_in_flight(), 0);
  }
  EXPECT_EQ(cuda_graph_stats(*b).failures, 0);
}

TEST(CudaDecodePipeline, DropRowWhileInFlight) {
  DS_REQUIRE_GPU();
  const ModelConfig c = config_27b_4_layers();
  auto b = make_engine(c, 4);
  const auto prompts = prompts_for(4, c.vocab_size, 99);
  const Trace ref = run_sync(*b, prefill(*b, prompts), 96, 40, 2);
  const Trace got = run_pipelined(*b, prefill(*b, prompts), 96, 40, 2);
  ASSERT_EQ(got.size(), ref.size());
  for (size_t st = 0; st < ref.size(); ++st)
    ASSERT_EQ(got[st], ref[st]) << "step " << st << " (row 2 leaves at step 40)";
  // The slot reset while a step for it was queued serves a new sequence exactly like a slot
  // reset with nothing in flight (slot 1, synchronously; same engine, so same GEMM plans).
  const std::vector<int32_t> fresh_prompt = prompts_for(1, c.vocab_size, 5)[0];
  b->reset_slot(1);
  SeqWork w1{1, fresh_prompt, false, true};
  StepOutput out;
  b->step_greedy(std::span<const SeqWork>(&w1, 1), out);
  std::vector<int32_t> cur = out.tokens;
  Trace want;
  for (int st = 0; st < 32; ++st) {
    std::vector<int32_t> t1(1, cur[0]);
    SeqWork d{1, t1, false, true};
    b->step_greedy(std::span<const SeqWork>(&d, 1), out);
    want.push_back(out.tokens);
    cur = out.tokens;
  }
  SeqWork w2{2, fresh_prompt, false, true};
  b->step_greedy(std::span<const SeqWork>(&w2, 1), out);
  std::vector<DecodeItem> it = {{2, out.tokens[0], -1}};
  Trace again;
  std::vector<int32_t> got_tok;
  b->launch_greedy_decode(it);
  it[0].feed_row = 0;
  for (int st = 0; st < 32; ++st) {
    if (st + 1 < 32) b->launch_greedy_decode(it);
    b->collect_greedy_decode(got_tok);
    again.push_back(got_tok);
  }
  EXPECT_EQ(again, want) << "slot 2 after the dropped row";
}

TEST(CudaDecodePipeline, MisuseIsAnError) {
  DS_REQUIRE_GPU();
  const ModelConfig c = config_27b_4_layers();
  auto b = make_engine(c, 2);
  const auto prompts = prompts_for(2, c.vocab_size, 3);
  const auto first = prefill(*b, prompts);
  std::vector<DecodeItem> fed = {{0, 0, 0}};
  EXPECT_THROW(b->launch_greedy_decode(fed), Error) << "feed_row after a plain step";
  std::vector<DecodeItem> empty_slot = {{1, 5, -1}};
  b->reset_slot(1);
  EXPECT_THROW(b->launch_greedy_decode(empty_slot), Error) << "a slot without tokens";
  std::vector<DecodeItem> one = {{0, first[0], -1}};
  b->launch_greedy_decode(one);
  EXPECT_THROW(b->launch_greedy_decode(std::vector<DecodeItem>{{0, 0, 3}}), Error)
      << "feed_row past the previous step's rows";
  b->launch_greedy_decode(fed);
  EXPECT_THROW(b->launch_greedy_decode(fed), Error) << "a third step in flight";
  std::vector<float> logits;
  std::vector<int32_t> t(1, first[0]);
  SeqWork w{0, t, false};
  EXPECT_THROW(b->step(std::span<const SeqWork>(&w, 1), logits), Error)
      << "step with steps pending";
  std::vector<int32_t> got;
  b->collect_greedy_decode(got);
  b->collect_greedy_decode(got);
  EXPECT_THROW(b->collect_greedy_decode(got), Error) << "nothing left to collect";
  EXPECT_EQ(b->slot_len(0), static_cast<int>(prompts[0].size()) + 2);
}

}  // namespace
}  // namespace ds
