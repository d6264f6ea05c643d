// PCRE2-backed "Isolated" regex split. One JIT stack and match-data block per thread (PCRE2 match
// state must not be shared between threads); patterns compile once per tokenizer.
#include "tokenizer/regex_split.h"

#include <pcre2.h>
#include <utf8proc.h>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace ds {
namespace {

// Oniguruma's Unicode \s: U+0009..U+000D, U+0020, U+0085, U+00A0, U+1680, U+2000..U+200A,
// U+2028, U+2029, U+202F, U+205F, U+3000 (the Unicode White_Space property).
constexpr const char* kSpaceClassBody =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

struct ThreadMatchState {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    md = pcre2_match_data_create(1, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (mctx && stack) pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(mctx);
    pcre2_match_data_free(md);
  }
};

// The split patterns of Qwen2/Qwen3 and of Qwen3.5 (`[\p{L}\p{M}]` where Qwen2 has `\p{L}`).
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen35Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Character classes the fast matcher needs.
enum : uint8_t { kL = 1, kN = 2, kM = 4, kS = 8 /* Oniguruma \s */, kNl = 16 /* \r or \n */ };

struct CharInfo {
  uint32_t cp;
  uint8_t len;
  uint8_t cls;
};

struct AsciiTable {
  uint8_t cls[128] = {};
  AsciiTable() {
    for (int c = 0; c < 128; ++c) {
      if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) cls[c] = kL;
      if (c >= '0' && c <= '9') cls[c] = kN;
      if ((c >= 0x09 && c <= 0x0D) || c == 0x20) cls[c] = kS;
    }
    cls['\r'] |= kNl;
    cls['\n'] |= kNl;
  }
};
const AsciiTable kAscii;

uint8_t unicode_class(uint32_t cp) {
  if (cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
      cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000) {
    return kS;
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
      return kL;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return kN;
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
      return kM;
    default:
      return 0;
  }
}

// The character at s[i] (s is valid UTF-8).
inline CharInfo char_at(std::string_view s, size_t i) {
  const auto b = static_cast<uint8_t>(s[i]);
  if (b < 0x80) return {b, 1, kAscii.cls[b]};
  size_t j = i;
  const uint32_t cp = utf8::decode(s, j);
  return {cp, static_cast<uint8_t>(j - i), unicode_class(cp)};
}

ThreadMatchState& thread_state() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

std::string onig_to_pcre2(const std::string& p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  size_t class_start = 0;  // index in p just after '[' or '[^'
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 's') {
        if (in_class) {
          out += kSpaceClassBody;
        } else {
          out += "[";
          out += kSpaceClassBody;
          out += "]";
        }
      } else if (e == 'S') {
        if (in_class) throw_error("regex `", p, "`: \\S inside a character class is not supported");
        out += "[^";
        out += kSpaceClassBody;
        out += "]";
      } else {
        out += c;
        out += e;
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') {
        out += '^';
        ++i;
      }
      class_start = i + 1;
      continue;
    }
    if (in_class && c == ']' && i != class_start) in_class = false;
    out += c;
  }
  return out;
}

RegexSplitter::RegexSplitter(const std::string& onig_pattern, const std::string& what,
                             bool allow_fast)
    : pattern_(onig_to_pcre2(onig_pattern)) {
  if (allow_fast && onig_pattern == kQwen2Pattern) fast_ = Fast::kQwen2;
  if (allow_fast && onig_pattern == kQwen35Pattern) fast_ = Fast::kQwen35;
  int err = 0;
  PCRE2_SIZE err_off = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern_.data()), pattern_.size(),
                             PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
  if (!code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof(buf));
    throw_error(what, ": split regex `", onig_pattern, "` does not compile (PCRE2 at offset ",
                err_off, "): ", reinterpret_cast<const char*>(buf));
  }
  // JIT is an optimisation: when unavailable, pcre2_match falls back to the interpreter.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
}

RegexSplitter::~RegexSplitter() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool RegexSplitter::next_match(std::string_view text, size_t pos, size_t* start,
                               size_t* end) const {
  if (fast_ != Fast::kNone) {
    for (size_t i = pos; i < text.size();) {
      const size_t e = fast_match_at(text, i);
      if (e > i) {
        *start = i;
        *end = e;
        return true;
      }
      i += char_at(text, i).len;
    }
    return false;
  }
  auto& st = thread_state();
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  while (pos < text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, st.md, st.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(rc, buf, sizeof(buf));
      throw_error("tokenizer split regex failed at byte ", pos, ": ",
                  reinterpret_cast<const char*>(buf));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.md);
    if (ov[1] > ov[0]) {
      *start = ov[0];
      *end = ov[1];
      return true;
    }
    // Empty match: Oniguruma's iterator moves on by one character; so do we.
    pos = ov[0] + 1;
    while (pos < text.size() && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) ++pos;
  }
  return false;
}

size_t RegexSplitter::fast_match_at(std::string_view s, size_t i) const {
  const size_t n = s.size();
  const bool marks = fast_ == Fast::kQwen35;  // Qwen3.5 keeps marks with letters
  const uint8_t letter = marks ? (kL | kM) : kL;
  const CharInfo c = char_at(s, i);

  // (?i:'s|'t|'re|'ve|'m|'ll|'d); case-insensitive, so 's also matches U+017F (long s).
  if (c.cp == '\'' && i + 1 < n) {
    const char a = static_cast<char>(s[i + 1] | 0x20);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') {
      if (static_cast<uint8_t>(s[i + 1]) < 0x80) return i + 2;
    }
    if (i + 2 < n && static_cast<uint8_t>(s[i + 1]) < 0x80) {
      const char b = static_cast<char>(s[i + 2] | 0x20);
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
    if (i + 2 < n && s[i + 1] == '\xC5' && s[i + 2] == '\xBF') return i + 3;  // 'ſ
  }
  // [^\r\n\p{L}\p{N}]?[\p{L}(\p{M})]+ : first with the optional prefix, then without it.
  auto letter_run = [&](size_t j) {
    while (j < n) {
      const CharInfo d = char_at(s, j);
      if (!(d.cls & letter)) break;
      j += d.len;
    }
    return j;
  };
  if (!(c.cls & (kNl | kL | kN))) {
    const size_t e = letter_run(i + c.len);
    if (e > i + c.len) return e;
  }
  if (c.cls & letter) return letter_run(i);
  // \p{N}
  if (c.cls & kN) return i + c.len;
  // ' ?[^\s\p{L}(\p{M})\p{N}]+[\r\n]*' (without the space the class cannot start at a space)
  {
    const uint8_t not_punct = kS | kL | kN | (marks ? kM : 0);
    const size_t j = c.cp == ' ' ? i + 1 : i;
    size_t e = j;
    while (e < n) {
      const CharInfo d = char_at(s, e);
      if (d.cls & not_punct) break;
      e += d.len;
    }
    if (e > j) {
      while (e < n && (s[e] == '\r' || s[e] == '\n')) ++e;
      return e;
    }
  }
  if (!(c.cls & kS)) return 0;
  // Whitespace run [i, k).
  size_t k = i, last_nl = SIZE_MAX, last_start = i;
  while (k < n) {
    const CharInfo d = char_at(s, k);
    if (!(d.cls & kS)) break;
    if (d.cls & kNl) last_nl = k;
    last_start = k;
    k += d.len;
  }
  // \s*[\r\n]+ : backtracking stops at the last newline of the run.
  if (last_nl != SIZE_MAX) return last_nl + 1;
  // \s+(?!\S) : the whole run at the end of text, else all but its last character.
  if (k == n) return n;
  if (last_start > i) return last_start;
  // \s+
  return k;
}

}  // namespace ds
