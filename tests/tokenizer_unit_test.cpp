// Unit tests of the tokenizer pieces: UTF-8 repair, the Oniguruma->PCRE2 rewrite, the regex
// split, BPE merge order, added-token flags, decoding, streaming, and load errors. The expected
// ids for tests/data/tokenizer/tiny were produced by HF tokenizers 0.23 on the same file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/error.h"
#include "tokenizer/regex_split.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace ds {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;

const std::string kTiny = std::string(DS_TEST_DATA) + "/tokenizer/tiny";

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("ds_tok_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

void write(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
}

TEST(Utf8, RepairMatchesPythonReplace) {
  // Expected strings: bytes.decode("utf-8", "replace") in Python.
  EXPECT_EQ(utf8::repair("abc"), "abc");
  EXPECT_EQ(utf8::repair("\xff"), "\xEF\xBF\xBD");
  EXPECT_EQ(utf8::repair("\xe4\xb8"), "\xEF\xBF\xBD");                              // one subpart
  EXPECT_EQ(utf8::repair("\xed\xa0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(utf8::repair("\xc0\xaf"), "\xEF\xBF\xBD\xEF\xBF\xBD");                  // overlong
  EXPECT_EQ(utf8::repair("\xf0\x9f\x98 x"), "\xEF\xBF\xBD x");
  EXPECT_EQ(utf8::repair("\xf4\x90\x80\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_TRUE(utf8::is_valid("h\xc3\xa9llo \xf0\x9f\x98\x80"));
  EXPECT_FALSE(utf8::is_valid("h\xc3"));
}

TEST(Utf8, CompletePrefixHoldsBackOnlyTruncatedTail) {
  std::string out;
  EXPECT_EQ(utf8::repair_complete_prefix("ab\xe4\xb8", out), 2u);
  EXPECT_EQ(out, "ab");
  out.clear();
  EXPECT_EQ(utf8::repair_complete_prefix("a\xff\xe4", out), 2u);  // \xff is bad for good
  EXPECT_EQ(out, "a\xEF\xBF\xBD");
}

TEST(Regex, RewritesWhitespaceToOnigurumaSet) {
  const std::string p = onig_to_pcre2(R"(\s+(?!\S)|[^\s\p{L}]+|\\s)");
  EXPECT_EQ(p.find("\\s"), p.rfind("\\s"));  // only the escaped literal `\\s` keeps "\s"
  EXPECT_NE(p.find("[^\\t\\n"), std::string::npos);
  EXPECT_THROW(onig_to_pcre2(R"([\S])"), Error);
  // U+180E is not whitespace for Oniguruma (nor Unicode >= 6.3), although PCRE2's \s says so.
  RegexSplitter re(R"(\s+|\S+)", "test");
  std::vector<std::string> pieces;
  re.split("a \xe1\xa0\x8e b", [&](std::string_view s) { pieces.emplace_back(s); });
  EXPECT_EQ(pieces, (std::vector<std::string>{"a", " ", "\xe1\xa0\x8e", " ", "b"}));
}

TEST(Regex, IsolatedKeepsUnmatchedGaps) {
  RegexSplitter re(R"(\d+)", "test");
  std::vector<std::string> pieces;
  re.split("ab12cd3", [&](std::string_view s) { pieces.emplace_back(s); });
  EXPECT_EQ(pieces, (std::vector<std::string>{"ab", "12", "cd", "3"}));
  EXPECT_THROW(RegexSplitter("(unclosed", "tokenizer.json"), Error);
}

std::vector<std::string> split_all(const RegexSplitter& re, std::string_view text) {
  std::vector<std::string> pieces;
  re.split(text, [&](std::string_view p) { pieces.emplace_back(p); });
  return pieces;
}

TEST(Regex, FastQwenMatchersAgreeWithPcre2) {
  const char* patterns[] = {
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
  };
  // Characters of every class the patterns distinguish, ASCII and not.
  const std::vector<std::string> alphabet = {"a",
                                             "Z",
                                             "s",
                                             "S",
                                             "t",
                                             "l",
                                             "L",
                                             "r",
                                             "e",
                                             "E",
                                             "v",
                                             "m",
                                             "d",
                                             "'",
                                             "0",
                                             "7",
                                             " ",
                                             " ",
                                             "\t",
                                             "\n",
                                             "\r",
                                             "\v",
                                             "\f",
                                             "!",
                                             ".",
                                             "-",
                                             "_",
                                             "(",
                                             "\"",
                                             "\xc5\xbf" /* long s */,
                                             "\xc3\xa9",
                                             "\xcc\x81" /* U+0301 */,
                                             "\xe2\x83\x9d" /* U+20DD Me */,
                                             "\xe4\xb8\xad",
                                             "\xd9\xa3" /* Arabic-Indic 3 */,
                                             "\xe2\x85\xa0" /* Roman numeral (Nl) */,
                                             "\xc2\xbd" /* 1/2 (No) */,
                                             "\xc2\xa0",
                                             "\xe3\x80\x80",
                                             "\xc2\x85",
                                             "\xe1\xa0\x8e",
                                             "\xe2\x80\x8b",
                                             "\xe2\x80\xa8",
                                             "\xf0\x9f\x98\x80",
                                             "\xe0\xa4\xbe" /* Mc */,
                                             "\xd7\x90",
                                             "\xe3\x81\x82"};
  std::mt19937 rng(42);
  for (const char* pattern : patterns) {
    RegexSplitter fast(pattern, "test"), slow(pattern, "test", false);
    ASSERT_TRUE(fast.uses_fast_matcher());
    ASSERT_FALSE(slow.uses_fast_matcher());
    for (int iter = 0; iter < 20000; ++iter) {
      std::string text;
      const int len = static_cast<int>(rng() % 16);
      for (int k = 0; k < len; ++k) text += alphabet[rng() % alphabet.size()];
      ASSERT_EQ(split_all(fast, text), split_all(slow, text)) << "text: " << text;
    }
  }
}

class Tiny : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tok_ = new Tokenizer(Tokenizer::load(kTiny)); }
  static void TearDownTestSuite() { delete tok_; }
  static Tokenizer* tok_;
};
Tokenizer* Tiny::tok_ = nullptr;

TEST_F(Tiny, EncodeMatchesHf) {
  const std::vector<std::pair<std::string, Ids>> cases = {
      {"abc", {257}},
      {"bca", {259, 64}},  // (b,c) merges first: (c,a) has no merge
      {"aaa", {260, 64}},  // equal ranks: leftmost first
      {" abc hello world", {220, 257, 220, 266, 271}},
      {"caf\xc3\xa9", {275}},
      {"cafe\xcc\x81", {275}},  // NFD input, NFC normaliser
      {"x<|sp|>y", {87, 276, 88}},
      {"x<|sp|>xy", {87, 280, 88}},                                     // leftmost-longest
      {"a  <mask>  b", {64, 277, 65}},                                  // lstrip + rstrip
      {"a[w]b a [w] b", {64, 58, 86, 60, 65, 258, 220, 278, 220, 65}},  // single_word
      {"[w]", {278}},
      {"e\xcc\x81! \xc3\xa9!", {279, 220, 279}},  // normalized=true token matches after NFC
      {"an added token!", {281, 0}},
      {"", {}},
      {"<|sp|>", {276}},
      {"hello\nworld", {266, 198, 86, 78, 81, 75, 67}},
  };
  for (const auto& [text, ids] : cases) EXPECT_EQ(tok_->encode(text), ids) << text;
}

TEST_F(Tiny, NoSpecialTreatsSpecialTextAsText) {
  EXPECT_EQ(tok_->encode("x<|sp|>y", false), (Ids{87, 27, 91, 82, 79, 91, 29, 88}));
  // Non-special added tokens still match (HF encode_special_tokens=True).
  EXPECT_EQ(tok_->encode("x<|sp|>xy", false), (Ids{87, 280, 88}));
}

TEST_F(Tiny, DecodeAndMetadata) {
  EXPECT_EQ(tok_->vocab_size(), 282);
  EXPECT_EQ(tok_->decode(Ids{276, 277, 256}), "<|sp|><mask>ab");
  EXPECT_EQ(tok_->decode(Ids{276, 277, 256}, true), "<mask>ab");
  EXPECT_EQ(tok_->decode(Ids{195, 169}), "\x07\xEF\xBF\xBD");  // lone continuation byte
  EXPECT_EQ(tok_->decode(Ids{281}), "an added token");         // not byte-level: raw content
  EXPECT_THROW(tok_->decode(Ids{282}), Error);
  EXPECT_THROW(tok_->decode(Ids{-1}), Error);
  EXPECT_EQ(tok_->token_id("<|sp|>"), 276);
  EXPECT_EQ(tok_->token_id("abc"), 257);
  EXPECT_FALSE(tok_->token_id("nope").has_value());
  EXPECT_TRUE(tok_->is_special(276));
  EXPECT_FALSE(tok_->is_special(277));
  EXPECT_EQ(tok_->eos_ids(), (Ids{276}));
}

// The vocabulary strings (HF convert_ids_to_tokens): byte-level form for BPE tokens (space is
// U+0120, byte 0x07 is U+0107), an added token's content as is.
TEST_F(Tiny, TokenStrings) {
  EXPECT_EQ(tok_->token_string(257), "abc");
  EXPECT_EQ(tok_->token_string(220), "\xc4\xa0");    // ' ' -> U+0120
  EXPECT_EQ(tok_->token_string(195), "\xc4\x87");    // byte 0x07 (see decode above) -> U+0107
  EXPECT_EQ(tok_->token_string(7), "(");               // printable bytes are themselves
  EXPECT_EQ(tok_->token_string(276), "<|sp|>");
  EXPECT_EQ(tok_->token_string(281), "an added token");  // not byte-level: raw content
  EXPECT_EQ(tok_->token_string(275), "caf\xc3\x83\xc2\xa9");  // "café": é is bytes C3 A9
  EXPECT_THROW(tok_->token_string(282), Error);
  EXPECT_THROW(tok_->token_string(-1), Error);
}

TEST_F(Tiny, StreamDecoderHoldsBackIncompleteUtf8) {
  const std::string text = "caf\xc3\xa9 \xf0\x9f\x98\x80 \xe4\xb8\xad!";
  const Ids ids = tok_->encode(text);
  StreamDecoder dec(*tok_);
  std::string all;
  for (int32_t id : ids) {
    const std::string piece = dec.push(id);
    EXPECT_TRUE(utf8::is_valid(piece));
    all += piece;
  }
  all += dec.flush();
  EXPECT_EQ(all, text);
  // The emoji's four byte tokens: nothing until the last one.
  StreamDecoder d2(*tok_);
  const Ids emoji = tok_->encode("\xf0\x9f\x98\x80");
  ASSERT_EQ(emoji.size(), 4u);
  EXPECT_EQ(d2.push(emoji[0]), "");
  EXPECT_EQ(d2.push(emoji[1]), "");
  EXPECT_EQ(d2.push(emoji[2]), "");
  EXPECT_EQ(d2.push(emoji[3]), "\xf0\x9f\x98\x80");
  // A truncated sequence left at the end becomes U+FFFD on flush, like decode().
  StreamDecoder d3(*tok_, true);
  EXPECT_EQ(d3.push(emoji[0]), "");
  EXPECT_EQ(d3.push(276), "");  // special, skipped
  EXPECT_EQ(d3.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(tok_->decode(Ids{emoji[0], 276}, true), "\xEF\xBF\xBD");
  EXPECT_THROW(d3.push(100000), Error);
}

TEST_F(Tiny, NfcUsesHfUnicodeVersion) {
  // HF's NFC tables are Unicode 9.0: U+0898 (14.0, ccc 230) is an inert starter for it, so it is
  // not reordered after U+0336 (ccc 1) as utf8proc alone would; U+08D4 (9.0) is.
  EXPECT_EQ(tok_->decode(tok_->encode("a\xe0\xa2\x98\xcc\xb6")), "a\xe0\xa2\x98\xcc\xb6");
  EXPECT_EQ(tok_->decode(tok_->encode("a\xe0\xa3\x94\xcc\xb6")), "a\xcc\xb6\xe0\xa3\x94");
  EXPECT_EQ(tok_->decode(tok_->encode("e\xcc\x81")), "\xc3\xa9");
}

TEST_F(Tiny, ConcurrentEncodeIsConsistent) {
  // Threads share the piece cache (striped locks); results must equal the serial ones.
  std::mt19937 rng(9);
  const char* words[] = {"abc", " hello", " world", "caf\xc3\xa9", "<|sp|>", " <mask> ", "aaa", "\n",
                         " bca", "\xe4\xb8\xad\xe6\x96\x87", " abcabcabcabcabcabcabcabc"};
  std::vector<std::string> texts(64);
  for (auto& t : texts) {
    for (int k = 0; k < 200; ++k) t += words[rng() % std::size(words)];
  }
  std::vector<Ids> serial;
  for (const auto& t : texts) serial.push_back(tok_->encode(t));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      for (int rep = 0; rep < 20; ++rep) {
        for (size_t i = th; i < texts.size(); i += 2) {
          if (tok_->encode(texts[i]) != serial[i]) ++mismatches;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(Tiny, InvalidUtf8InputIsRepairedFirst) {
  EXPECT_EQ(tok_->encode("a\xff"), tok_->encode("a\xEF\xBF\xBD"));
}

TEST_F(Tiny, HugePieceIsNotQuadratic) {
  // 1 MB of letters without a space is one pre-token; the heap merge keeps it O(n log n).
  std::mt19937 rng(1);
  std::string s(1 << 20, 'a');
  for (char& c : s) c = "abc"[rng() % 3];
  const auto t0 = std::chrono::steady_clock::now();
  const Ids ids = tok_->encode(s);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(tok_->decode(ids), s);
  EXPECT_LT(secs, 10.0);  // quadratic would be hours; measured ~0.2 s
}

TEST(TokenizerLoad, ClearErrors) {
  EXPECT_THROW(Tokenizer::load("/nonexistent/tokenizer"), Error);
  const fs::path dir = temp_dir("errors");
  try {
    Tokenizer::load(dir.string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("neither tokenizer.json nor vocab.json"),
              std::string::npos);
  }
  auto expect_error = [&](const std::string& json_text, const std::string& needle) {
    write(dir / "tokenizer.json", json_text);
    try {
      Tokenizer::load(dir.string());
      FAIL() << "expected an error containing " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("tokenizer.json"), std::string::npos) << e.what();
    }
  };
  expect_error("{not json", "invalid JSON");
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})",
               "not in the vocabulary");
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": "x"}, "merges": []}})",
               "not an integer id");
  expect_error(R"({"model": {"type": "WordPiece", "vocab": {"a": 0}, "merges": []}})", "only BPE");
  expect_error(R"({"normalizer": {"type": "NFKC"},
                   "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})",
               "NFKC");
  expect_error(R"({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "("},
                   "behavior": "Isolated"},
                   "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})",
               "does not compile");
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a"]}})", "two tokens");
  // An id far past the entries: a clear error, not a ~32 GB table (std::bad_alloc).
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1000000000}, "merges": []}})",
               "far beyond the vocabulary's 2 entries");
  fs::remove_all(dir);
}

TEST(TokenizerLoad, VocabJsonMergesTxtFallback) {
  // The tiny tokenizer rewritten as vocab.json + merges.txt + tokenizer_config.json.
  std::ifstream f(kTiny + "/tokenizer.json");
  const auto j = nlohmann::json::parse(f);
  const fs::path dir = temp_dir("fallback");
  write(dir / "vocab.json", j["model"]["vocab"].dump());
  std::string merges = "#version: 0.2\n";
  for (const auto& m : j["model"]["merges"]) merges += m.get<std::string>() + "\n";
  write(dir / "merges.txt", merges);
  nlohmann::json config = {
      {"eos_token", "<|sp|>"},
      {"pretokenize_regex", j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]}};
  for (const auto& t : j["added_tokens"])
    config["added_tokens_decoder"][std::to_string(t["id"].get<int>())] = t;
  write(dir / "tokenizer_config.json", config.dump());
  const Tokenizer a = Tokenizer::load(dir.string());
  const Tokenizer b = Tokenizer::load(kTiny);
  for (const char* text :
       {"abc hello world", "cafe\xcc\x81 x<|sp|>y", "a  <mask>  b", "e\xcc\x81!"}) {
    EXPECT_EQ(a.encode(text), b.encode(text)) << text;
  }
  EXPECT_EQ(a.vocab_size(), b.vocab_size());
  fs::remove_all(dir);
}

TEST(TokenizerLoad, AddedTokenIdsFollowHf) {
  // HF assigns added tokens the next free id after the model vocabulary and ignores the id in
  // the file when it would leave a gap; a content already in the vocabulary keeps its id.
  const fs::path dir = temp_dir("added_ids");
  nlohmann::json j;
  j["model"] = {
      {"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 1}}}, {"merges", nlohmann::json::array()}};
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  j["decoder"] = {{"type", "ByteLevel"}};
  j["added_tokens"] = {{{"id", 10}, {"content", "<x>"}, {"special", true}},
                       {{"id", 20}, {"content", "b"}, {"special", true}},
                       {{"id", 30}, {"content", "<y>"}, {"special", false}}};
  write(dir / "tokenizer.json", j.dump());
  const Tokenizer t = Tokenizer::load(dir.string());
  EXPECT_EQ(t.token_id("<x>"), 2);
  EXPECT_EQ(t.token_id("b"), 1);
  EXPECT_TRUE(t.is_special(1));
  EXPECT_EQ(t.token_id("<y>"), 3);
  EXPECT_EQ(t.vocab_size(), 4);
  EXPECT_EQ(t.encode("a<x>b<y>"), (Ids{0, 2, 1, 3}));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace ds
