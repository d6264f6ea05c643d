// `deltaserve tokenize` / `deltaserve detokenize`: the tokenizer from the command line, for users
// debugging prompts and for the tests that compare us with HF tokenizers.
//   tokenize:   stdin bytes (UTF-8; invalid sequences become U+FFFD) -> one JSON id list.
//   detokenize: a JSON id list on stdin -> the text, with no newline added.
// --jsonl batches: one JSON string (tokenize) or id list (detokenize) per input line, one JSON
// result per output line.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace ds::cli {
namespace {

using json = nlohmann::json;

std::string read_stdin() {
  std::ios::sync_with_stdio(false);
  std::string s((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  DS_CHECK(!std::cin.bad(), "cannot read stdin");
  return s;
}

// Calls fn(line, line_number) for each non-empty line of s.
template <typename F>
void for_each_line(const std::string& s, F&& fn) {
  size_t pos = 0, line_no = 0;
  while (pos < s.size()) {
    size_t nl = s.find('\n', pos);
    if (nl == std::string::npos) nl = s.size();
    ++line_no;
    std::string_view line(s.data() + pos, nl - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.empty()) fn(line, line_no);
    pos = nl + 1;
  }
}

void write_out(const std::string& s) {
  if (!s.empty() && std::fwrite(s.data(), 1, s.size(), stdout) != s.size()) {
    throw_error("cannot write to stdout");
  }
}

std::vector<int32_t> parse_ids(std::string_view text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw_error(where, ": not valid JSON: ", e.what());
  }
  DS_CHECK(j.is_array(), where, ": expected a JSON list of token ids");
  std::vector<int32_t> ids;
  ids.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    DS_CHECK(j[i].is_number_integer(), where, ": element ", i, " (", j[i].dump(),
             ") is not an integer token id");
    const auto v = j[i].get<int64_t>();
    DS_CHECK(v >= INT32_MIN && v <= INT32_MAX, where, ": token id ", v, " is out of range");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

std::string dump_text(const std::string& s) {
  return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string decode_text(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special,
                        bool stream) {
  if (!stream) return tok.decode(ids, skip_special);
  StreamDecoder dec(tok, skip_special);
  std::string out;
  for (int32_t id : ids) out += dec.push(id);
  out += dec.flush();
  return out;
}

struct TokenizeOpts {
  std::string dir;
  bool no_special = false;
  bool jsonl = false;
};

std::function<int()> setup_tokenize(CLI::App& app) {
  auto o = std::make_shared<TokenizeOpts>();
  app.add_option("--tokenizer", o->dir, "Folder with tokenizer.json (or vocab.json + merges.txt)")
      ->required();
  app.add_flag("--no-special", o->no_special,
               "Treat special-token text (e.g. <|im_end|>) in the input as plain text");
  app.add_flag("--jsonl", o->jsonl,
               "Batch mode: each stdin line is a JSON string; prints one id list per line");
  return [o]() {
    const Tokenizer tok = Tokenizer::load(o->dir);
    const std::string input = read_stdin();
    const bool allow_special = !o->no_special;
    if (!o->jsonl) {
      write_out(json(tok.encode(input, allow_special)).dump() + "\n");
      return 0;
    }
    std::string out;
    for_each_line(input, [&](std::string_view line, size_t line_no) {
      json j;
      try {
        j = json::parse(line);
      } catch (const json::exception& e) {
        throw_error("stdin line ", line_no, ": not valid JSON: ", e.what());
      }
      DS_CHECK(j.is_string(), "stdin line ", line_no, ": expected a JSON string");
      out += json(tok.encode(j.get_ref<const std::string&>(), allow_special)).dump();
      out += '\n';
    });
    write_out(out);
    return 0;
  };
}

struct DetokenizeOpts {
  std::string dir;
  bool skip_special = false;
  bool jsonl = false;
  bool stream = false;
  bool token_strs = false;
};

// Each id's vocabulary string (HF convert_ids_to_tokens), null for ids that name no token.
std::string dump_token_strs(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  json list = json::array();
  for (int32_t id : ids) {
    const auto s = tok.token_string(id);
    list.push_back(s ? json(*s) : json(nullptr));
  }
  return list.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::function<int()> setup_detokenize(CLI::App& app) {
  auto o = std::make_shared<DetokenizeOpts>();
  app.add_option("--tokenizer", o->dir, "Folder with tokenizer.json (or vocab.json + merges.txt)")
      ->required();
  app.add_flag("--skip-special", o->skip_special, "Leave special tokens out of the text");
  app.add_flag("--jsonl", o->jsonl,
               "Batch mode: each stdin line is a JSON id list; prints one JSON string per line");
  app.add_flag("--stream", o->stream,
               "Decode through the streaming detokenizer (one id at a time); same text");
  app.add_flag("--token-strs", o->token_strs,
               "Print each id's vocabulary string (JSON list; HF convert_ids_to_tokens) instead "
               "of the text");
  return [o]() {
    const Tokenizer tok = Tokenizer::load(o->dir);
    const std::string input = read_stdin();
    if (!o->jsonl) {
      const auto ids = parse_ids(input, "stdin");
      write_out(o->token_strs ? dump_token_strs(tok, ids) + "\n"
                              : decode_text(tok, ids, o->skip_special, o->stream));
      return 0;
    }
    std::string out;
    for_each_line(input, [&](std::string_view line, size_t line_no) {
      const auto ids = parse_ids(line, "stdin line " + std::to_string(line_no));
      out += o->token_strs ? dump_token_strs(tok, ids)
                           : dump_text(decode_text(tok, ids, o->skip_special, o->stream));
      out += '\n';
    });
    write_out(out);
    return 0;
  };
}

}  // namespace

DS_COMMAND("tokenize", "Text on stdin -> token ids (JSON list)", setup_tokenize);
DS_COMMAND("detokenize", "Token ids (JSON list) on stdin -> text", setup_detokenize);

}  // namespace ds::cli
