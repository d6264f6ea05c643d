// Pre-tokenizer regex split (HF `Split` with behavior "Isolated"): every match of the pattern
// becomes its own piece and the text between matches becomes pieces too. Patterns are written
// for Oniguruma (what HF tokenizers uses); we run them with PCRE2 (UTF + UCP, JIT) after
// rewriting `\s` / `\S` to Oniguruma's exact Unicode whitespace set (PCRE2's UCP `\s` also
// matches U+180E, which Oniguruma does not).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace ds {

class RegexSplitter {
 public:
  // Throws ds::Error (naming `what`, e.g. the tokenizer file) when the pattern does not compile.
  // The Qwen2/Qwen3 and Qwen3.5 split patterns run on a hand-written matcher with exactly the
  // regex's backtracking semantics (about 4x faster than PCRE2 JIT) unless allow_fast is false.
  RegexSplitter(const std::string& onig_pattern, const std::string& what, bool allow_fast = true);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // Calls emit(piece) for each non-empty piece of text, in order; the pieces concatenate to
  // text. text must be valid UTF-8 (not re-checked: PCRE2 runs with NO_UTF_CHECK).
  template <typename F>
  void split(std::string_view text, F&& emit) const {
    size_t pos = 0, prev = 0;
    size_t start = 0, end = 0;
    while (pos < text.size() && next_match(text, pos, &start, &end)) {
      if (start > prev) emit(text.substr(prev, start - prev));
      emit(text.substr(start, end - start));
      prev = pos = end;
    }
    if (prev < text.size()) emit(text.substr(prev));
  }

  // The PCRE2 pattern actually compiled (after the `\s` rewrite); for error messages and tests.
  const std::string& pcre2_pattern() const { return pattern_; }
  bool uses_fast_matcher() const { return fast_ != Fast::kNone; }

 private:
  enum class Fast { kNone, kQwen2, kQwen35 };
  // Finds the next non-empty match at or after pos; false when there is none.
  bool next_match(std::string_view text, size_t pos, size_t* start, size_t* end) const;
  // End of the match of the fast pattern starting exactly at i, or 0 when none starts there.
  size_t fast_match_at(std::string_view text, size_t i) const;

  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code*
  Fast fast_ = Fast::kNone;
};

// Rewrites an Oniguruma pattern for PCRE2 (see above). Exposed for tests.
std::string onig_to_pcre2(const std::string& pattern);

}  // namespace ds
