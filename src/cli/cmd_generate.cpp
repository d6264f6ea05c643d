// `deltaserve generate --model DIR (--prompt-ids 1,2,3 | --prompt TEXT) --max-tokens N ...`:
// one completion (no chat template), streamed to stdout as it is generated: text through the
// model folder's tokenizer, or token ids as one JSON list (--output ids, or when the folder has
// no tokenizer). Greedy by default (--temperature 0); stops at the EOS ids of config.json and of
// the tokenizer unless --ignore-eos. Timings go to stderr.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "cli/command.h"
#include "cli/token_ids.h"
#include "core/error.h"
#include "model/weights.h"
#include "runtime/backend_factory.h"
#include "runtime/sampling.h"
#include "tokenizer/tokenizer.h"

namespace ds::cli {
namespace {

struct GenerateOpts {
  std::string model, prompt_ids, prompt, tokenizer, output = "text", device = "cpu";
  int max_tokens = 64;
  int chunk_size = 512;
  SamplingParams sampling;
  uint64_t seed = 0;
  bool ignore_eos = false, skip_special = false, quiet = false;
  bool use_text = false;  // --prompt given (else --prompt-ids)
};

bool has_tokenizer(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  return fs::exists(fs::path(dir) / "tokenizer.json", ec) ||
         fs::exists(fs::path(dir) / "vocab.json", ec);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run_generate(const GenerateOpts& o) {
  using clock = std::chrono::steady_clock;

  // Tokenizer: --tokenizer DIR, else the model folder when it has one.
  std::optional<Tokenizer> tok;
  if (!o.tokenizer.empty()) {
    tok = Tokenizer::load(o.tokenizer);
  } else if (has_tokenizer(o.model)) {
    tok = Tokenizer::load(o.model);
  }
  std::vector<int32_t> prompt;
  if (o.use_text) {
    DS_CHECK(tok.has_value(), "--prompt needs a tokenizer: ", o.model,
             " has no tokenizer.json (or vocab.json + merges.txt); pass --tokenizer DIR or use "
             "--prompt-ids");
    prompt = tok->encode(o.prompt);
    DS_CHECK(!prompt.empty(), "--prompt: the text encodes to no tokens");
  } else {
    prompt = parse_token_ids(o.prompt_ids, "--prompt-ids");
  }

  const auto t_load = clock::now();
  HostWeights w = load_host_weights(o.model);
  const ModelConfig& cfg = w.config;
  check_token_ids(prompt, cfg.vocab_size, o.use_text ? "--prompt" : "--prompt-ids");
  const int64_t total = static_cast<int64_t>(prompt.size()) + o.max_tokens;
  if (cfg.max_position_embeddings > 0) {
    DS_CHECK(total <= cfg.max_position_embeddings, "prompt (", prompt.size(),
             " tokens) + --max-tokens ", o.max_tokens,
             " exceed the model's max_position_embeddings ", cfg.max_position_embeddings);
  }
  BackendOptions bo;
  bo.device = o.device;
  bo.n_slots = 1;
  bo.max_seq_len = static_cast<int>(total);
  bo.chunk_size = o.chunk_size;
  std::unique_ptr<Backend> be = make_backend(bo, w);
  const double load_s = seconds_since(t_load);

  std::set<int32_t> eos;
  if (!o.ignore_eos) {
    eos.insert(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end());
    if (tok) {
      for (int32_t id : tok->eos_ids()) eos.insert(id);
    }
  }
  Sampler sampler(o.sampling);
  const bool ids_out = o.output == "ids" || !tok;
  if (!ids_out && !o.quiet) {
    std::fprintf(stderr, "note: printing text through the tokenizer of %s\n",
                 (o.tokenizer.empty() ? o.model : o.tokenizer).c_str());
  } else if (o.output == "text" && !tok && !o.quiet) {
    std::fprintf(stderr, "note: %s has no tokenizer; printing token ids\n", o.model.c_str());
  }

  // Prefill in chunks of --chunk-size tokens (one backend step each).
  const auto t_prefill = clock::now();
  std::vector<float> logits;
  const std::span<const int32_t> ps(prompt);
  const int chunk = o.chunk_size > 0 ? o.chunk_size : static_cast<int>(prompt.size());
  for (size_t start = 0; start < prompt.size(); start += chunk) {
    const size_t n = std::min(prompt.size() - start, static_cast<size_t>(chunk));
    SeqWork work{0, ps.subspan(start, n), false};
    be->step(std::span<const SeqWork>(&work, 1), logits);
  }
  const double prefill_s = seconds_since(t_prefill);

  // Decode: sample, stream, feed back.
  const auto t_decode = clock::now();
  std::optional<StreamDecoder> dec;
  if (!ids_out) dec.emplace(*tok, o.skip_special);
  std::vector<int32_t> generated;
  int n_untokenizable = 0;
  std::string stop = "length";
  if (ids_out) std::fputs("[", stdout);
  for (int i = 0; i < o.max_tokens; ++i) {
    const int32_t next = sampler.sample(logits, generated);
    if (eos.count(next)) {
      stop = "eos (token " + std::to_string(next) + ")";
      break;
    }
    generated.push_back(next);
    if (ids_out) {
      std::fprintf(stdout, "%s%d", generated.size() > 1 ? ", " : "", next);
    } else if (next < tok->vocab_size()) {
      const std::string piece = dec->push(next);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
    } else {
      ++n_untokenizable;  // the model's padded vocabulary rows have no token (HF decodes them to
                          // "")
    }
    std::fflush(stdout);
    if (i + 1 == o.max_tokens) break;  // no forward needed for a token we will not sample after
    SeqWork work{0, std::span<const int32_t>(&generated.back(), 1), false};
    be->step(std::span<const SeqWork>(&work, 1), logits);
  }
  if (ids_out) {
    std::fputs("]\n", stdout);
  } else {
    const std::string rest = dec->flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputs("\n", stdout);
  }
  std::fflush(stdout);
  const double decode_s = seconds_since(t_decode);

  if (!o.quiet) {
    if (n_untokenizable > 0) {
      std::fprintf(stderr,
                   "note: %d generated id(s) are past the tokenizer's vocabulary (%d) and print as "
                   "nothing\n",
                   n_untokenizable, tok->vocab_size());
    }
    std::fprintf(stderr,
                 "[%s] load %.2f s | prompt %zu tokens in %.3f s (%.1f tok/s) | generated %zu "
                 "tokens in %.3f s "
                 "(%.1f tok/s) | stop: %s\n",
                 be->name().c_str(), load_s, prompt.size(), prefill_s,
                 prompt.size() / std::max(prefill_s, 1e-9), generated.size(), decode_s,
                 generated.size() / std::max(decode_s, 1e-9), stop.c_str());
  }
  return 0;
}

std::function<int()> setup_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOpts>();
  app.add_option("--model", o->model, "Checkpoint folder (config.json + safetensors)")->required();
  auto* ids = app.add_option("--prompt-ids", o->prompt_ids,
                             "Prompt token ids: 1,2,3 or a file holding them");
  auto* text = app.add_option(
      "--prompt", o->prompt, "Prompt text (encoded with the folder's tokenizer; no chat template)");
  ids->excludes(text);
  app.add_option("--tokenizer", o->tokenizer, "Tokenizer folder (default: the model folder)");
  app.add_option("--max-tokens", o->max_tokens, "Tokens to generate at most")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--temperature", o->sampling.temperature, "Sampling temperature; 0 = greedy")
      ->default_val(0.0f)
      ->check(CLI::Range(0.0f, 100.0f));
  app.add_option("--top-p", o->sampling.top_p, "Nucleus sampling mass (0, 1]")
      ->capture_default_str();
  app.add_option("--top-k", o->sampling.top_k, "Sample among the k most likely tokens; 0 = off")
      ->capture_default_str();
  app.add_option("--min-p", o->sampling.min_p, "Drop tokens below min_p x the top probability")
      ->capture_default_str();
  app.add_option("--repetition-penalty", o->sampling.repetition_penalty,
                 "Penalty > 1 for generated tokens")
      ->capture_default_str();
  app.add_option("--presence-penalty", o->sampling.presence_penalty,
                 "OpenAI presence penalty [-2, 2]")
      ->capture_default_str();
  app.add_option("--frequency-penalty", o->sampling.frequency_penalty,
                 "OpenAI frequency penalty [-2, 2]")
      ->capture_default_str();
  auto* seed =
      app.add_option("--seed", o->seed, "Random seed (same seed, same tokens); default: random");
  app.add_option("--chunk-size", o->chunk_size, "Prompt tokens per forward step")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--output", o->output,
                 "text (streamed through the tokenizer) or ids (one JSON list)")
      ->capture_default_str()
      ->check(CLI::IsMember({"text", "ids"}));
  app.add_flag("--ignore-eos", o->ignore_eos, "Do not stop at the EOS tokens");
  app.add_flag("--skip-special", o->skip_special, "Leave special tokens out of the text");
  app.add_flag("-q,--quiet", o->quiet, "No notes or timings on stderr");
  add_device_option(app, o->device);
  return [o, seed, ids, text]() {
    DS_CHECK(ids->count() + text->count() == 1, "give one of --prompt-ids and --prompt");
    GenerateOpts opts = *o;
    opts.use_text = text->count() > 0;
    if (seed->count() > 0) opts.sampling.seed = opts.seed;
    opts.sampling.validate();
    return run_generate(opts);
  };
}

}  // namespace

DS_COMMAND("generate", "Generate a completion from a prompt (text or token ids), streamed",
           setup_generate);

}  // namespace ds::cli
