// `deltaserve score --model DIR --prompt-ids FILE_OR_LIST [--logits-out FILE.npy]`: one
// teacher-forced pass over the ids; prints the mean negative log-likelihood (nats) and the
// perplexity of tokens 2..T given their prefixes, and optionally writes every position's logits
// as a [T, vocab] float32 .npy (to compare with other engines / HF). Prompt chunks of
// --chunk-size tokens run as separate steps, the state carried across.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "cli/token_ids.h"
#include "core/error.h"
#include "core/npy.h"
#include "model/weights.h"
#include "runtime/backend_factory.h"
#include "runtime/sampling.h"

namespace ds::cli {
namespace {

struct ScoreOpts {
  std::string model, prompt_ids, logits_out, device = "cpu";
  int chunk_size = 512;
  bool json = false;
};

int run_score(const ScoreOpts& o) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> ids = parse_token_ids(o.prompt_ids, "--prompt-ids");
  DS_CHECK(ids.size() >= 2, "--prompt-ids: need at least 2 tokens to score (got ", ids.size(), ")");
  HostWeights w = load_host_weights(o.model);
  const ModelConfig& cfg = w.config;
  const int V = cfg.vocab_size;
  check_token_ids(ids, V, "--prompt-ids");
  if (cfg.max_position_embeddings > 0) {
    DS_CHECK(static_cast<int64_t>(ids.size()) <= cfg.max_position_embeddings,
             "--prompt-ids: ", ids.size(), " tokens exceed the model's max_position_embeddings ",
             cfg.max_position_embeddings);
  }
  BackendOptions bo;
  bo.device = o.device;
  bo.n_slots = 1;
  bo.max_seq_len = static_cast<int>(ids.size());
  bo.chunk_size = o.chunk_size;
  std::unique_ptr<Backend> be = make_backend(bo, w);

  const size_t T = ids.size();
  std::vector<float> all;  // [T, V] only when written out
  if (!o.logits_out.empty()) all.reserve(T * static_cast<size_t>(V));
  double nll = 0.0;
  std::vector<float> logits, lp;
  const std::span<const int32_t> span(ids);
  for (size_t start = 0; start < T; start += o.chunk_size) {
    const size_t n = std::min(T - start, static_cast<size_t>(o.chunk_size));
    SeqWork work{0, span.subspan(start, n), true};
    be->step(std::span<const SeqWork>(&work, 1), logits);
    DS_ASSERT(logits.size() == n * static_cast<size_t>(V));
    for (size_t r = 0; r < n; ++r) {
      const size_t pos = start + r;  // row pos predicts token pos + 1
      if (pos + 1 < T) {
        nll -= token_logprob(std::span<const float>(&logits[r * V], V), ids[pos + 1]);
      }
    }
    if (!o.logits_out.empty()) all.insert(all.end(), logits.begin(), logits.end());
  }
  const double mean_nll = nll / static_cast<double>(T - 1);
  const double ppl = std::exp(mean_nll);
  if (!o.logits_out.empty()) {
    write_npy_f32(o.logits_out, all.data(), {static_cast<int64_t>(T), static_cast<int64_t>(V)});
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (o.json) {
    nlohmann::ordered_json j;
    j["tokens"] = T;
    j["scored"] = T - 1;
    j["mean_nll"] = mean_nll;
    j["perplexity"] = ppl;
    j["device"] = be->name();
    if (!o.logits_out.empty()) j["logits_out"] = o.logits_out;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("tokens %zu | scored %zu | mean NLL %.6f nats | perplexity %.4f\n", T, T - 1,
                mean_nll, ppl);
    if (!o.logits_out.empty())
      std::printf("wrote logits [%zu, %d] float32 to %s\n", T, V, o.logits_out.c_str());
  }
  std::fprintf(stderr, "[%s] %.2f s\n", be->name().c_str(), secs);
  return 0;
}

std::function<int()> setup_score(CLI::App& app) {
  auto o = std::make_shared<ScoreOpts>();
  app.add_option("--model", o->model, "Checkpoint folder (config.json + safetensors)")->required();
  app.add_option("--prompt-ids", o->prompt_ids,
                 "Token ids to score: 1,2,3 or a file holding them (JSON list or "
                 "whitespace / comma separated)")
      ->required();
  app.add_option("--logits-out", o->logits_out,
                 "Write all logits [T, vocab] as a float32 .npy here");
  app.add_option("--chunk-size", o->chunk_size, "Tokens per forward step")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_flag("--json", o->json, "Print the result as one JSON object");
  add_device_option(app, o->device);
  return [o]() { return run_score(*o); };
}

}  // namespace

DS_COMMAND("score",
           "Teacher-forced scoring of token ids: mean NLL, perplexity, optional logits .npy",
           setup_score);

}  // namespace ds::cli
