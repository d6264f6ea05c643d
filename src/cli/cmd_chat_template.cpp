// `deltaserve chat-template`: renders the model's chat template from the command line, for users
// debugging prompts and for the tests that compare us with HF apply_chat_template.
//   stdin: {"messages": [...], "tools": [...], "add_generation_prompt": true, "enable_thinking":
//   false} stdout: the prompt exactly (no newline added). A template error (raise_exception or a
//   template bug) goes to stderr with exit code 1.
// --template FILE renders a template file instead (special tokens still from --tokenizer if given).
// --jsonl batches: one request per input line; one JSON line per request on stdout, either
// {"prompt": "..."} or {"error": "..."}.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "chat/chat_template.h"
#include "cli/command.h"
#include "core/error.h"

namespace ds::cli {
namespace {

using ojson = nlohmann::ordered_json;

std::string read_all_stdin() {
  std::ios::sync_with_stdio(false);
  std::string s((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  DS_CHECK(!std::cin.bad(), "cannot read stdin");
  return s;
}

ojson parse_request(const std::string& text, const std::string& where) {
  try {
    return ojson::parse(text);
  } catch (const ojson::exception& e) {
    throw_error(where, ": not valid JSON: ", e.what());
  }
}

void write_all(const std::string& s) {
  if (!s.empty() && std::fwrite(s.data(), 1, s.size(), stdout) != s.size())
    throw_error("cannot write to stdout");
}

struct Options {
  std::string tokenizer;
  std::string template_file;
  bool jsonl = false;
};

ChatTemplate load_template(const Options& opt) {
  DS_CHECK(!opt.tokenizer.empty() || !opt.template_file.empty(),
           "chat-template needs --tokenizer DIR or --template FILE");
  if (opt.template_file.empty()) return ChatTemplate::load(opt.tokenizer);
  std::ifstream f(opt.template_file, std::ios::binary);
  DS_CHECK(f, "cannot open template file ", opt.template_file);
  std::string source((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ojson special = ojson::object();
  if (!opt.tokenizer.empty()) {  // special tokens (eos_token, ...) from the tokenizer folder
    std::ifstream c(opt.tokenizer + "/tokenizer_config.json", std::ios::binary);
    if (c) special = ojson::parse(c, nullptr, /*allow_exceptions=*/false);
    if (special.is_discarded())
      throw_error(opt.tokenizer, "/tokenizer_config.json: not valid JSON");
  }
  return ChatTemplate::from_string(source, special);
}

int run_chat_template(const Options& opt) {
  ChatTemplate tmpl = load_template(opt);
  std::string input = read_all_stdin();
  if (!opt.jsonl) {
    std::string prompt = tmpl.render(parse_request(input, "stdin"));
    write_all(prompt);
    std::fflush(stdout);
    return 0;
  }
  size_t pos = 0, line_no = 0;
  while (pos < input.size()) {
    size_t nl = input.find('\n', pos);
    if (nl == std::string::npos) nl = input.size();
    std::string line = input.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (line.empty() || line == "\r") continue;
    ojson out = ojson::object();
    try {
      out["prompt"] = tmpl.render(parse_request(line, "stdin line " + std::to_string(line_no)));
    } catch (const Error& e) {
      out["error"] = e.what();
    }
    write_all(out.dump(-1, ' ', false, ojson::error_handler_t::replace) + "\n");
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

DS_COMMAND(
    "chat-template", "Render the model's chat template for a JSON request read on stdin",
    [](CLI::App& app) -> std::function<int()> {
      auto opt = std::make_shared<Options>();
      app.add_option(
          "--tokenizer", opt->tokenizer,
          "Folder with tokenizer_config.json or chat_template.jinja (a model folder works)");
      app.add_option(
          "--template", opt->template_file,
          "Jinja template file to use instead of the folder's template (for debugging templates)");
      app.add_flag("--jsonl", opt->jsonl,
                   "One request per stdin line; prints one JSON line {\"prompt\"} or {\"error\"} "
                   "per request");
      return [opt]() { return run_chat_template(*opt); };
    });

}  // namespace ds::cli
