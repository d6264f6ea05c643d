// Tokenizer loading (tokenizer.json / vocab.json + merges.txt / tokenizer_config.json), the encode
// pipeline (added tokens -> NFC -> regex split -> byte-level BPE) and decoding. See tokenizer.h.
#include "tokenizer/tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/file_io.h"
#include "tokenizer/bpe.h"
#include "tokenizer/regex_split.h"
#include "tokenizer/utf8.h"
#include "tokenizer/vocab_reader.h"

namespace ds {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The split regex of Qwen2/Qwen3 (`tokenization_qwen2.PRETOKENIZE_REGEX`), used for
// vocab.json + merges.txt when tokenizer_config.json has no `pretokenize_regex`.
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// The GPT-2 regex the ByteLevel pre-tokenizer applies when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to U+0100 + n.
struct ByteLevelMap {
  std::array<uint32_t, 256> byte_to_cp{};
  std::array<int16_t, 512> cp_to_byte{};  // -1: not in the alphabet (all code points are < 512)
  ByteLevelMap() {
    cp_to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
  // Raw bytes of a byte-level token string; nullopt when a character is outside the alphabet.
  std::optional<std::string> to_bytes(std::string_view token) const {
    std::string out;
    out.reserve(token.size());
    size_t i = 0;
    while (i < token.size()) {
      if (utf8::sequence_length(token, i) == 0) return std::nullopt;
      const uint32_t cp = utf8::decode(token, i);
      if (cp >= cp_to_byte.size() || cp_to_byte[cp] < 0) return std::nullopt;
      out += static_cast<char>(cp_to_byte[cp]);
    }
    return out;
  }
};

const ByteLevelMap& byte_level() {
  static const ByteLevelMap m;
  return m;
}

std::string read_file(const fs::path& path) {
  return read_regular_file(path.string(), kMaxTokenizerFileBytes);
}

json parse_json_file(const fs::path& path) {
  const std::string text = read_file(path);
  check_json_depth(text, kMaxTokenizerJsonDepth, path.string());
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw_error(path.string(), ": invalid JSON: ", e.what());
  }
}

bool get_bool(const json& obj, const char* key, bool dflt, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return dflt;
  DS_CHECK(it->is_boolean(), where, ": field `", key, "` must be a boolean");
  return it->get<bool>();
}

std::string get_type(const json& obj, const std::string& where) {
  DS_CHECK(obj.is_object(), where, " must be an object");
  auto it = obj.find("type");
  DS_CHECK(it != obj.end() && it->is_string(), where, ": missing string field `type`");
  return it->get<std::string>();
}

// \w of Rust's regex crate (used by HF for single_word): alphabetic, marks, decimal digits,
// connector punctuation, join controls.
bool is_word_char(uint32_t cp) {
  if (cp == 0x200C || cp == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// Unicode White_Space (\s of Rust's regex crate, used by HF for lstrip / rstrip).
bool is_space_char(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Code point ending just before byte offset end (s valid UTF-8, end > 0).
uint32_t last_cp(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  return utf8::decode(s, i);
}

// NFC through utf8proc.
std::string utf8proc_nfc(std::string_view s) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(
      reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
      &out, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) throw_error("NFC normalisation failed: ", utf8proc_errmsg(n));
  std::string r(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return r;
}

// True when cp is left alone by NFC whatever surrounds it: a starter (ccc 0) without canonical
// decomposition that takes part in no composition (neither as first nor as second), and not
// Hangul (composed algorithmically).
bool nfc_inert(uint32_t cp) {
  if ((cp >= 0x1100 && cp <= 0x11FF) || (cp >= 0xA960 && cp <= 0xA97F) ||
      (cp >= 0xAC00 && cp <= 0xD7FF)) {
    return false;
  }
  const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
  if (p->combining_class != 0 || p->comb_index != UINT16_MAX) return false;
  return p->decomp_seqindex == UINT16_MAX || p->decomp_type != 0;  // only canonical ones matter
}

// Code points HF's NFC knows (assigned in Unicode 9.0, the version of its tables); see
// tools/make_unicode_classes.py. Later ones are inert for HF: no decomposition, combining class 0.
struct CodeRange {
  uint32_t first, last;
};
constexpr CodeRange kNfcKnown[] = {
#include "tokenizer/nfc_known.inc"
};

bool hf_nfc_knows(uint32_t cp) {
  const CodeRange* end = kNfcKnown + std::size(kNfcKnown);
  const CodeRange* it = std::upper_bound(
      kNfcKnown, end, cp, [](uint32_t c, const CodeRange& r) { return c < r.first; });
  return it != kNfcKnown && cp <= (it - 1)->last;
}

// NFC of a run that needs it, as HF computes it: code points unknown to HF's tables are copied
// as they are and cut the run (for HF they are starters that compose with nothing).
void nfc_run(std::string_view s, std::string& out) {
  size_t i = 0, piece = 0;
  while (i < s.size()) {
    const size_t at = i;
    const uint32_t cp = utf8::decode(s, i);
    if (cp < 0x80 || hf_nfc_knows(cp)) continue;
    if (at > piece) out += utf8proc_nfc(s.substr(piece, at - piece));
    out.append(s.data() + at, i - at);
    piece = i;
  }
  if (s.size() > piece) out += utf8proc_nfc(s.substr(piece));
}

// NFC(s). Text is cut before ASCII characters (always starters that compose with nothing before
// them), and only runs of non-ASCII characters that hold a non-inert character go through
// utf8proc, together with the ASCII character before them (it may compose with a mark).
std::string nfc_normalize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0, emitted = 0;
  const size_t n = s.size();
  while (i < n) {
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t run_start = i;
    bool inert = true;
    while (i < n && static_cast<uint8_t>(s[i]) >= 0x80) {
      if (!nfc_inert(utf8::decode(s, i))) inert = false;
    }
    if (inert) continue;
    const size_t seg = run_start > 0 ? run_start - 1 : 0;
    out.append(s.data() + emitted, seg - emitted);
    nfc_run(s.substr(seg, i - seg), out);
    emitted = i;
  }
  out.append(s.data() + emitted, n - emitted);
  return out;
}

// Leftmost-longest matcher over the added tokens' contents (what HF's Aho-Corasick with
// MatchKind::LeftmostLongest finds), as a byte trie.
class TokenMatcher {
 public:
  void add(std::string_view pattern, int32_t index) {
    if (pattern.empty()) return;
    int32_t node = 0;
    for (char c : pattern) {
      const auto b = static_cast<uint8_t>(c);
      int32_t child = find_child(node, b);
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_.push_back({});
        nodes_[node].children.push_back({b, child});
      }
      node = child;
    }
    nodes_[node].index = index;
    first_byte_[static_cast<uint8_t>(pattern[0])] = true;
    empty_ = false;
  }
  bool empty() const { return empty_; }
  // Next match starting at or after pos: returns false when none.
  bool next(std::string_view s, size_t pos, size_t* start, size_t* end, int32_t* index) const {
    if (empty_) return false;
    for (size_t i = pos; i < s.size(); ++i) {
      if (!first_byte_[static_cast<uint8_t>(s[i])]) continue;
      int32_t node = 0;
      int32_t best = -1;
      size_t best_end = 0;
      for (size_t j = i; j < s.size(); ++j) {
        node = find_child(node, static_cast<uint8_t>(s[j]));
        if (node < 0) break;
        if (nodes_[node].index >= 0) {
          best = nodes_[node].index;
          best_end = j + 1;
        }
      }
      if (best >= 0) {
        *start = i;
        *end = best_end;
        *index = best;
        return true;
      }
    }
    return false;
  }

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    int32_t index = -1;
  };
  int32_t find_child(int32_t node, uint8_t b) const {
    for (const auto& [c, child] : nodes_[node].children) {
      if (c == b) return child;
    }
    return -1;
  }
  std::vector<Node> nodes_{Node{}};
  std::array<bool, 256> first_byte_{};
  bool empty_ = true;
};

}  // namespace

struct Tokenizer::Impl {
  std::string source;  // file(s) it was loaded from, for messages
  BpeModel bpe;
  bool nfc = false;
  std::vector<std::unique_ptr<RegexSplitter>> splitters;  // applied in order, each "Isolated"
  std::vector<AddedToken> added;
  TokenMatcher raw_matcher;   // added tokens with normalized=false, on the raw text
  TokenMatcher norm_matcher;  // added tokens with normalized=true, on the NFC text
  std::unordered_map<std::string, int32_t> token_to_id;  // vocab (byte-level form) + added
  std::vector<std::string> id_bytes;                     // decoded bytes per id
  std::vector<uint8_t> id_flags;                         // kPresent | kSpecial | kText
  std::vector<int32_t> eos;
  int64_t model_vocab_len = 0;  // entries in the model vocabulary (HF's get_vocab_size)
  // kText: the token's string has characters outside the byte-level alphabet, so it decodes to
  // its own UTF-8 text (id_bytes is that text) instead of the bytes its characters name.
  static constexpr uint8_t kPresent = 1, kSpecial = 2, kText = 4;

  // bytes: what the token decodes to; nullopt: its string `text` as is (kText).
  void set_id(int32_t id, std::optional<std::string> bytes, const std::string& text,
              bool special) {
    if (static_cast<size_t>(id) >= id_bytes.size()) {
      id_bytes.resize(static_cast<size_t>(id) + 1);
      id_flags.resize(static_cast<size_t>(id) + 1, 0);
    }
    id_flags[id] = static_cast<uint8_t>(kPresent | (special ? kSpecial : 0) | (bytes ? 0 : kText));
    id_bytes[id] = bytes ? std::move(*bytes) : text;
  }

  void finish_added_tokens();
  void encode_pretokenized(std::string_view s, size_t level, std::vector<int32_t>& out) const;
  void encode_normalized_segment(std::string_view s, bool allow_special,
                                 std::vector<int32_t>& out) const;
  // HF AddedVocabulary::find_matches: calls on_text(range) / on_token(id) in order.
  template <typename OnText>
  void split_added(std::string_view s, const TokenMatcher& m, bool allow_special,
                   std::vector<int32_t>& out, OnText&& on_text) const;
};

void Tokenizer::Impl::finish_added_tokens() {
  // Ids as HF tokenizers assigns them when it loads the file (AddedVocabulary::add_tokens, one
  // token at a time in file order): a content already known (model vocabulary or an earlier
  // added token) keeps that id; otherwise the next id after the model vocabulary / the highest
  // added id. The id written in the file is ignored, exactly as HF does; for every well-formed
  // tokenizer (added ids contiguous after the vocabulary) this is the file's id.
  std::vector<AddedToken> listed = std::move(added);
  added.clear();
  std::unordered_map<std::string, size_t> by_content;
  int64_t max_added = -1;
  for (AddedToken& t : listed) {
    if (t.content.empty()) continue;
    auto known = token_to_id.find(t.content);
    if (known != token_to_id.end()) {
      t.id = known->second;
    } else {
      t.id = static_cast<int32_t>(max_added >= 0 &&
                                          (max_added >= model_vocab_len || model_vocab_len == 0)
                                      ? max_added + 1
                                      : model_vocab_len);
    }
    max_added = std::max<int64_t>(max_added, t.id);
    token_to_id[t.content] = t.id;
    auto dup = by_content.find(t.content);
    if (dup != by_content.end()) {
      added[dup->second] = t;
    } else {
      by_content[t.content] = added.size();
      added.push_back(t);
    }
  }
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& t = added[i];
    if (t.normalized) {
      norm_matcher.add(nfc ? nfc_normalize(t.content) : t.content, static_cast<int32_t>(i));
    } else {
      raw_matcher.add(t.content, static_cast<int32_t>(i));
    }
    // ByteLevel decoder rule: a token whose characters are all in the byte alphabet decodes to
    // those bytes, otherwise to its UTF-8 text as is.
    set_id(t.id, byte_level().to_bytes(t.content), t.content, t.special);
  }
}

template <typename OnText>
void Tokenizer::Impl::split_added(std::string_view s, const TokenMatcher& m, bool allow_special,
                                  std::vector<int32_t>& out, OnText&& on_text) const {
  size_t offset = 0;  // end of what has been emitted
  size_t pos = 0;     // where the next search starts (the end of the previous match)
  size_t start = 0, stop = 0;
  int32_t index = -1;
  while (pos < s.size() && m.next(s, pos, &start, &stop, &index)) {
    pos = stop;
    const AddedToken& t = added[index];
    if (!allow_special && t.special) continue;
    if (t.single_word) {
      const bool start_ok = start == 0 || !is_word_char(last_cp(s, start));
      bool stop_ok = stop == s.size();
      if (!stop_ok) {
        size_t k = stop;
        stop_ok = !is_word_char(utf8::decode(s, k));
      }
      if (!start_ok || !stop_ok) continue;
    }
    if (t.lstrip) {
      size_t k = start;
      while (k > 0 && is_space_char(last_cp(s, k))) {
        --k;
        while (k > 0 && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
      }
      start = std::max(k, offset);
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        size_t k = stop;
        if (!is_space_char(utf8::decode(s, k))) break;
        stop = k;
      }
    }
    if (start > offset) on_text(s.substr(offset, start - offset));
    out.push_back(t.id);
    offset = std::max(offset, stop);
  }
  if (offset < s.size()) on_text(s.substr(offset));
}

void Tokenizer::Impl::encode_pretokenized(std::string_view s, size_t level,
                                          std::vector<int32_t>& out) const {
  if (level == splitters.size()) {
    bpe.encode_piece(s, out);
    return;
  }
  splitters[level]->split(
      s, [&](std::string_view piece) { encode_pretokenized(piece, level + 1, out); });
}

void Tokenizer::Impl::encode_normalized_segment(std::string_view s, bool allow_special,
                                                std::vector<int32_t>& out) const {
  if (norm_matcher.empty()) {
    encode_pretokenized(s, 0, out);
    return;
  }
  split_added(s, norm_matcher, allow_special, out,
              [&](std::string_view text) { encode_pretokenized(text, 0, out); });
}

// ---- loading ----------------------------------------------------------------------------------

namespace {

AddedToken parse_added_token(const json& j, int32_t id, const std::string& where) {
  DS_CHECK(j.is_object(), where, " must be an object");
  auto c = j.find("content");
  DS_CHECK(c != j.end() && c->is_string(), where, ": missing string field `content`");
  AddedToken t;
  t.content = c->get<std::string>();
  DS_CHECK(utf8::is_valid(t.content), where, ": `content` is not valid UTF-8");
  t.id = id;
  t.special = get_bool(j, "special", false, where);
  t.lstrip = get_bool(j, "lstrip", false, where);
  t.rstrip = get_bool(j, "rstrip", false, where);
  t.single_word = get_bool(j, "single_word", false, where);
  // HF default: special tokens are not normalised, others are.
  t.normalized = get_bool(j, "normalized", !t.special, where);
  return t;
}

int32_t parse_id(const json& v, const std::string& where) {
  DS_CHECK(v.is_number_integer(), where, " must be an integer id");
  const auto id = v.get<int64_t>();
  DS_CHECK(id >= 0 && id < (int64_t{1} << 30), where, ": id ", id, " is out of range");
  return static_cast<int32_t>(id);
}

// Fills the BPE model from the vocabulary entries and the merges (in rank order).
void load_vocab_and_merges(Tokenizer::Impl& impl, const VocabFile& vf,
                           const std::string& vocab_where, const std::string& merges_where) {
  impl.token_to_id.reserve(vf.vocab.size() + 64);
  // Ids index a table (a string per id): one far past the number of entries would make it huge
  // (id 10^9: ~32 GB, a bad_alloc or the OOM killer). Real vocabularies are dense.
  const int64_t max_id = static_cast<int64_t>(vf.vocab.size()) + (int64_t{1} << 20);
  for (const auto& [token, id64] : vf.vocab) {
    DS_CHECK(id64 < max_id, vocab_where, ": `", token, "` has id ", id64,
             ", far beyond the vocabulary's ", vf.vocab.size(), " entries");
  }
  for (const auto& [token, id64] : vf.vocab) {
    const auto id = static_cast<int32_t>(id64);
    impl.token_to_id[token] = id;
    auto bytes = byte_level().to_bytes(token);
    if (bytes) impl.bpe.add_token(*bytes, id);
    impl.set_id(id, std::move(bytes), token, false);
  }
  impl.model_vocab_len = static_cast<int64_t>(impl.token_to_id.size());
  DS_CHECK(!vf.vocab.empty(), vocab_where, ": the vocabulary is empty");
  std::string joined;
  auto lookup = [&](const std::string& tok, size_t i) {
    auto f = impl.token_to_id.find(tok);
    if (f == impl.token_to_id.end()) {
      throw_error(merges_where, "[", i, "]: token `", tok, "` is not in the vocabulary");
    }
    return f->second;
  };
  for (size_t i = 0; i < vf.merges.size(); ++i) {
    const auto& [a, b] = vf.merges[i];
    joined.assign(a);
    joined += b;
    impl.bpe.add_merge(lookup(a, i), lookup(b, i), lookup(joined, i));
  }
}

std::vector<std::pair<std::string, std::string>> read_merges_txt(const fs::path& path) {
  const std::string text = read_file(path);
  std::vector<std::pair<std::string, std::string>> merges;
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string_view line(text.data() + pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line.starts_with("#version")) continue;
    const size_t sp = line.find(' ');
    DS_CHECK(sp != std::string_view::npos && line.find(' ', sp + 1) == std::string_view::npos,
             path.string(), ":", line_no, ": `", line,
             "` is not two tokens separated by one space");
    merges.emplace_back(std::string(line.substr(0, sp)), std::string(line.substr(sp + 1)));
  }
  return merges;
}

void load_normalizer(Tokenizer::Impl& impl, const json& n, const std::string& where) {
  if (n.is_null()) return;
  const std::string type = get_type(n, where);
  if (type == "NFC") {
    impl.nfc = true;
  } else if (type == "Sequence") {
    auto it = n.find("normalizers");
    DS_CHECK(it != n.end() && it->is_array(), where, ": Sequence needs an array `normalizers`");
    for (size_t i = 0; i < it->size(); ++i) {
      load_normalizer(impl, (*it)[i], where + ".normalizers[" + std::to_string(i) + "]");
    }
  } else {
    throw_error(where, ": normalizer type `", type, "` is not supported (only NFC)");
  }
}

std::string regex_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

void load_pre_tokenizer(Tokenizer::Impl& impl, const json& p, const std::string& where,
                        bool* byte_level_seen) {
  if (p.is_null()) return;
  const std::string type = get_type(p, where);
  if (type == "Sequence") {
    auto it = p.find("pretokenizers");
    DS_CHECK(it != p.end() && it->is_array(), where, ": Sequence needs an array `pretokenizers`");
    for (size_t i = 0; i < it->size(); ++i) {
      load_pre_tokenizer(impl, (*it)[i], where + ".pretokenizers[" + std::to_string(i) + "]",
                         byte_level_seen);
    }
  } else if (type == "Split") {
    auto pat = p.find("pattern");
    DS_CHECK(pat != p.end() && pat->is_object(), where, ": Split needs an object `pattern`");
    std::string regex;
    if (auto r = pat->find("Regex"); r != pat->end() && r->is_string()) {
      regex = r->get<std::string>();
    } else if (auto s = pat->find("String"); s != pat->end() && s->is_string()) {
      regex = regex_escape(s->get<std::string>());
    } else {
      throw_error(where, ".pattern: needs a string `Regex` or `String`");
    }
    auto beh = p.find("behavior");
    const std::string behavior = beh != p.end() && beh->is_string() ? beh->get<std::string>() : "";
    DS_CHECK(behavior == "Isolated", where, ": Split behavior `", behavior,
             "` is not supported (only Isolated)");
    DS_CHECK(!get_bool(p, "invert", false, where), where,
             ": Split with invert=true is not supported");
    impl.splitters.push_back(std::make_unique<RegexSplitter>(regex, where));
  } else if (type == "ByteLevel") {
    DS_CHECK(!get_bool(p, "add_prefix_space", false, where), where,
             ": ByteLevel add_prefix_space=true is not supported");
    if (get_bool(p, "use_regex", true, where)) {
      impl.splitters.push_back(std::make_unique<RegexSplitter>(kGpt2Pattern, where));
    }
    *byte_level_seen = true;
  } else {
    throw_error(where, ": pre-tokenizer type `", type,
                "` is not supported (Split, ByteLevel, Sequence)");
  }
}

void check_decoder(const json& d, const std::string& where) {
  DS_CHECK(!d.is_null(), where, ": a ByteLevel decoder is required");
  const std::string type = get_type(d, where);
  if (type == "Sequence") {
    auto it = d.find("decoders");
    DS_CHECK(it != d.end() && it->is_array() && it->size() == 1, where,
             ": only a Sequence holding one ByteLevel decoder is supported");
    check_decoder((*it)[0], where + ".decoders[0]");
    return;
  }
  DS_CHECK(type == "ByteLevel", where, ": decoder type `", type,
           "` is not supported (only ByteLevel)");
}

void load_bpe_options(Tokenizer::Impl& impl, const json& m, const std::string& where) {
  if (auto it = m.find("type"); it != m.end() && !it->is_null()) {
    DS_CHECK(it->is_string() && it->get<std::string>() == "BPE", where, ": model type `",
             it->dump(), "` is not supported (only BPE)");
  }
  if (auto it = m.find("dropout"); it != m.end() && !it->is_null()) {
    DS_CHECK(it->is_number() && it->get<double>() == 0.0, where,
             ": BPE dropout is not supported (must be null)");
  }
  DS_CHECK(!get_bool(m, "byte_fallback", false, where), where,
           ": byte_fallback=true is not supported (byte-level BPE only)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    auto it = m.find(key);
    DS_CHECK(it == m.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty()),
             where, ": non-empty `", key, "` is not supported");
  }
  impl.bpe.set_ignore_merges(get_bool(m, "ignore_merges", false, where));
}

void set_unk(Tokenizer::Impl& impl, const json& m, const std::string& where) {
  auto it = m.find("unk_token");
  if (it == m.end() || it->is_null()) return;
  DS_CHECK(it->is_string(), where, ".unk_token must be a string");
  auto f = impl.token_to_id.find(it->get<std::string>());
  DS_CHECK(f != impl.token_to_id.end(), where, ".unk_token `", it->get<std::string>(),
           "` is not in the vocabulary");
  impl.bpe.set_unk(f->second, get_bool(m, "fuse_unk", false, where));
}

std::optional<std::string> token_content(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object()) {
    auto c = v.find("content");
    if (c != v.end() && c->is_string()) return c->get<std::string>();
  }
  return std::nullopt;
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& dir_arg) {
  auto impl = std::make_shared<Impl>();
  fs::path dir = dir_arg;
  fs::path tok_json;
  if (fs::is_regular_file(dir)) {
    tok_json = dir;
    dir = dir.parent_path();
  } else {
    DS_CHECK(fs::is_directory(dir), "tokenizer folder ", dir_arg, " does not exist");
    tok_json = dir / "tokenizer.json";
  }
  const fs::path config_path = dir / "tokenizer_config.json";
  json config = json::object();
  if (fs::is_regular_file(config_path)) {
    config = parse_json_file(config_path);
    DS_CHECK(config.is_object(), config_path.string(), " must hold a JSON object");
  }
  const std::string cfg_where = config_path.string();

  if (fs::is_regular_file(tok_json)) {
    const std::string where = tok_json.string();
    impl->source = where;
    const VocabFile vf = read_vocab_file(where, {"model", "vocab"}, {"model", "merges"});
    const json& j = vf.rest;
    DS_CHECK(j.is_object(), where, " must hold a JSON object");
    auto model = j.find("model");
    DS_CHECK(model != j.end() && model->is_object(), where, ": missing object `model`");
    load_bpe_options(*impl, *model, where + ": model");
    DS_CHECK(vf.has_vocab, where, ": missing object `model.vocab`");
    DS_CHECK(vf.has_merges, where, ": missing array `model.merges`");
    load_vocab_and_merges(*impl, vf, where + ": model.vocab", where + ": model.merges");
    set_unk(*impl, *model, where + ": model");
    load_normalizer(*impl, j.value("normalizer", json()), where + ": normalizer");
    bool byte_level_seen = false;
    load_pre_tokenizer(*impl, j.value("pre_tokenizer", json()), where + ": pre_tokenizer",
                       &byte_level_seen);
    DS_CHECK(byte_level_seen, where,
             ": pre_tokenizer has no ByteLevel step (only byte-level BPE "
             "tokenizers are supported)");
    check_decoder(j.value("decoder", json()), where + ": decoder");
    if (auto at = j.find("added_tokens"); at != j.end() && !at->is_null()) {
      DS_CHECK(at->is_array(), where, ": `added_tokens` must be an array");
      for (size_t i = 0; i < at->size(); ++i) {
        const std::string w = where + ": added_tokens[" + std::to_string(i) + "]";
        const json& e = (*at)[i];
        DS_CHECK(e.is_object() && e.contains("id"), w, ": missing `id`");
        impl->added.push_back(parse_added_token(e, parse_id(e["id"], w + ".id"), w));
      }
    }
  } else {
    const fs::path vocab_path = dir / "vocab.json", merges_path = dir / "merges.txt";
    DS_CHECK(fs::is_regular_file(vocab_path) && fs::is_regular_file(merges_path),
             "tokenizer folder ", dir.string(),
             " has neither tokenizer.json nor vocab.json + merges.txt");
    impl->source = vocab_path.string() + " + " + merges_path.string();
    VocabFile vf = read_vocab_file(vocab_path.string(), {}, {"\x01"});
    DS_CHECK(vf.has_vocab, vocab_path.string(), " must hold a JSON object of token -> id");
    vf.merges = read_merges_txt(merges_path);
    load_vocab_and_merges(*impl, vf, vocab_path.string(), merges_path.string());
    // What transformers' Qwen2Tokenizer does: NFC, then its split regex, then byte-level BPE.
    impl->nfc = true;
    std::string pattern = kQwen2Pattern;
    if (auto it = config.find("pretokenize_regex"); it != config.end() && it->is_string()) {
      pattern = it->get<std::string>();
    }
    impl->splitters.push_back(std::make_unique<RegexSplitter>(pattern, cfg_where));
    if (auto it = config.find("added_tokens_decoder"); it != config.end() && it->is_object()) {
      for (auto e = it->begin(); e != it->end(); ++e) {
        const std::string w = cfg_where + ": added_tokens_decoder[\"" + e.key() + "\"]";
        int64_t id = -1;
        try {
          size_t used = 0;
          id = std::stoll(e.key(), &used);
          if (used != e.key().size()) id = -1;
        } catch (const std::exception&) {
          id = -1;
        }
        DS_CHECK(id >= 0 && id < (int64_t{1} << 30), w, ": key is not a token id");
        impl->added.push_back(parse_added_token(e.value(), static_cast<int32_t>(id), w));
      }
    }
  }
  impl->finish_added_tokens();

  // Stop ids.
  auto add_eos = [&](int32_t id) {
    if (std::find(impl->eos.begin(), impl->eos.end(), id) == impl->eos.end()) {
      impl->eos.push_back(id);
    }
  };
  if (auto it = config.find("eos_token"); it != config.end() && !it->is_null()) {
    auto content = token_content(*it);
    DS_CHECK(content, cfg_where, ": `eos_token` must be a string or {\"content\": ...}");
    auto f = impl->token_to_id.find(*content);
    DS_CHECK(f != impl->token_to_id.end(), cfg_where, ": eos_token `", *content,
             "` is not a token of ", impl->source);
    add_eos(f->second);
  }
  const fs::path gen_path = dir / "generation_config.json";
  if (fs::is_regular_file(gen_path)) {
    const json g = parse_json_file(gen_path);
    if (auto it = g.find("eos_token_id"); g.is_object() && it != g.end() && !it->is_null()) {
      if (it->is_array()) {
        for (size_t i = 0; i < it->size(); ++i) {
          add_eos(
              parse_id((*it)[i], gen_path.string() + ": eos_token_id[" + std::to_string(i) + "]"));
        }
      } else {
        add_eos(parse_id(*it, gen_path.string() + ": eos_token_id"));
      }
    }
  } else if (auto f = impl->token_to_id.find("<|endoftext|>"); f != impl->token_to_id.end()) {
    const int32_t id = f->second;
    if (impl->id_flags[id] & Impl::kSpecial) add_eos(id);
  }
  return Tokenizer(std::move(impl));
}

// ---- encode / decode --------------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  const Impl& im = *impl_;
  std::string repaired;
  if (!utf8::is_valid(text)) {
    repaired = utf8::repair(text);
    text = repaired;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  auto on_raw_text = [&](std::string_view segment) {
    if (im.nfc) {
      const std::string normalized = nfc_normalize(segment);
      im.encode_normalized_segment(normalized, allow_special, out);
    } else {
      im.encode_normalized_segment(segment, allow_special, out);
    }
  };
  if (im.raw_matcher.empty()) {
    if (!text.empty()) on_raw_text(text);
  } else {
    im.split_added(text, im.raw_matcher, allow_special, out, on_raw_text);
  }
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& im = *impl_;
  std::string bytes;
  for (const int32_t id : ids) {
    DS_CHECK(id >= 0 && static_cast<size_t>(id) < im.id_bytes.size(), "token id ", id,
             " is out of range (vocabulary size ", im.id_bytes.size(), ")");
    const uint8_t f = im.id_flags[id];
    if (!(f & Impl::kPresent)) continue;
    if (skip_special && (f & Impl::kSpecial)) continue;
    bytes += im.id_bytes[id];
  }
  if (utf8::is_valid(bytes)) return bytes;
  return utf8::repair(bytes);
}

int Tokenizer::vocab_size() const { return static_cast<int>(impl_->id_bytes.size()); }

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  auto it = impl_->token_to_id.find(std::string(token));
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_flags.size() &&
         (impl_->id_flags[id] & Impl::kSpecial);
}

std::vector<int32_t> Tokenizer::eos_ids() const { return impl_->eos; }

const std::string& Tokenizer::token_bytes(int32_t id) const {
  DS_CHECK(id >= 0 && static_cast<size_t>(id) < impl_->id_bytes.size(), "token id ", id,
           " is out of range (vocabulary size ", impl_->id_bytes.size(), ")");
  return impl_->id_bytes[id];
}

std::optional<std::string> Tokenizer::token_string(int32_t id) const {
  DS_CHECK(id >= 0 && static_cast<size_t>(id) < impl_->id_bytes.size(), "token id ", id,
           " is out of range (vocabulary size ", impl_->id_bytes.size(), ")");
  const uint8_t flags = impl_->id_flags[id];
  if (!(flags & Impl::kPresent)) return std::nullopt;
  const std::string& bytes = impl_->id_bytes[id];
  if (flags & Impl::kText) return bytes;
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) utf8::append(out, byte_level().byte_to_cp[b]);
  return out;
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }

// ---- streaming --------------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special)
    : tok_(tok), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  const std::string& bytes = tok_.token_bytes(id);  // throws when out of range
  if (skip_special_ && tok_.is_special(id)) return {};
  pending_ += bytes;
  std::string out;
  const size_t used = utf8::repair_complete_prefix(pending_, out);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8::repair(pending_);
  pending_.clear();
  return out;
}

}  // namespace ds
