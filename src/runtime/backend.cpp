// Backend's default step_greedy() (the host argmax over step()'s logits) and greedy_token().
#include "runtime/backend.h"

#include <cmath>

#include "core/error.h"

namespace ds {

int32_t greedy_token(std::span<const float> row) {
  DS_CHECK(!row.empty(), "greedy_token: empty logits row");
  int32_t best = 0;
  for (size_t i = 0; i < row.size(); ++i) {
    const float v = row[i];
    if (std::isnan(v) || v == INFINITY) return -1;
    if (v > row[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

void Backend::step_greedy(std::span<const SeqWork> work, StepOutput& out) {
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

}  // namespace ds
