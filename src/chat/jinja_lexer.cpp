// Jinja lexer, following jinja2.lexer with the environment transformers uses: trim_blocks (the
// first newline after a block or comment tag is dropped), lstrip_blocks (spaces and tabs from the
// start of a line up to a block or comment tag are dropped), `-` / `+` whitespace control, one
// trailing newline of the template removed, \r\n and \r read as \n.
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <string_view>

#include "chat/jinja_ast.h"

namespace ds::jinja {
namespace {

class Lexer {
 public:
  explicit Lexer(const std::string& source) {
    // Newline normalisation, then drop one trailing newline (keep_trailing_newline=False).
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    size_t n = src_.size();
    size_t pos = 0;
    bool line_starting = true;
    while (pos < n) {
      size_t t = pos;
      while (t + 1 < n &&
             !(src_[t] == '{' && (src_[t + 1] == '{' || src_[t + 1] == '%' || src_[t + 1] == '#')))
        ++t;
      if (t + 1 >= n) {
        emit_data(src_.substr(pos), pos);
        break;
      }
      std::string text = src_.substr(pos, t - pos);
      char kind = src_[t + 1];
      size_t p = t + 2;
      char sign = 0;
      if (p < n && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];

      size_t raw_end = 0;
      bool raw = kind == '%' && match_raw_begin(p, &raw_end);
      text = strip_before_tag(text, sign, kind != '{', line_starting);
      emit_data(text, pos);

      if (raw) {
        pos = lex_raw(raw_end, &line_starting);
        continue;
      }
      if (kind == '#') {
        pos = lex_comment(t, p, &line_starting);
        continue;
      }
      push(kind == '%' ? Tok::kBlockBegin : Tok::kVarBegin, kind == '%' ? "{%" : "{{", t);
      pos = lex_tag(p, kind == '%', &line_starting);
    }
    push(Tok::kEof, "", src_.size());
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(size_t pos, const std::string& msg) {
    auto [line, col] = line_col(pos);
    throw TemplateError(msg, line, col, false);
  }

  std::pair<int, int> line_col(size_t pos) const {
    size_t lo = 0, hi = line_starts_.size();
    while (hi - lo > 1) {
      size_t mid = (lo + hi) / 2;
      if (line_starts_[mid] <= pos)
        lo = mid;
      else
        hi = mid;
    }
    return {static_cast<int>(lo + 1), static_cast<int>(pos - line_starts_[lo] + 1)};
  }

  void push(Tok type, std::string text, size_t pos) {
    Token tok;
    tok.type = type;
    tok.text = std::move(text);
    auto [line, col] = line_col(pos);
    tok.line = line;
    tok.col = col;
    tokens_.push_back(std::move(tok));
  }

  void emit_data(const std::string& text, size_t pos) {
    if (!text.empty()) push(Tok::kData, text, pos);
  }

  // Whitespace (Python's \s, Unicode-aware) starting at pos: its byte length, or 0.
  size_t space_len(size_t pos) const {
    unsigned char c = static_cast<unsigned char>(src_[pos]);
    if (c < 0x80) return is_python_space(c) ? 1 : 0;
    size_t len = (c >= 0xF0) ? 4 : (c >= 0xE0) ? 3 : 2;
    if (pos + len > src_.size()) return 0;
    std::vector<uint32_t> cp = utf8_decode(std::string_view(src_).substr(pos, len));
    return cp.size() == 1 && is_python_space(cp[0]) ? len : 0;
  }
  size_t skip_ws(size_t pos) const {
    while (pos < src_.size()) {
      size_t l = space_len(pos);
      if (!l) break;
      pos += l;
    }
    return pos;
  }
  bool starts_with(size_t pos, std::string_view s) const {
    return src_.compare(pos, s.size(), s) == 0;
  }

  static std::string rstrip_ws(const std::string& text) {
    std::vector<uint32_t> cps = utf8_decode(text);
    size_t keep = cps.size();
    while (keep > 0 && is_python_space(cps[keep - 1])) --keep;
    std::string out;
    for (size_t i = 0; i < keep; ++i) utf8_append(out, cps[i]);
    return out;
  }

  // jinja2's OptionalLStrip: `-` strips all whitespace before the tag; otherwise lstrip_blocks
  // strips the whitespace between the line start and a block/comment tag.
  static std::string strip_before_tag(const std::string& text, char sign, bool lstrip_applies,
                                      bool line_starting) {
    if (sign == '-') return rstrip_ws(text);
    if (sign == '+' || !lstrip_applies) return text;
    size_t nl = text.rfind('\n');
    size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
    if (l_pos == 0 && !line_starting) return text;
    std::string tail = text.substr(l_pos);
    if (tail.empty()) return text;
    for (uint32_t cp : utf8_decode(tail))
      if (!is_python_space(cp)) return text;
    return text.substr(0, l_pos);
  }

  // `{%[-+]? raw [-]%}` after the `{%` and sign: sets *end past the tag.
  bool match_raw_begin(size_t p, size_t* end) const {
    size_t q = skip_ws(p);
    if (!starts_with(q, "raw")) return false;
    q = skip_ws(q + 3);
    if (starts_with(q, "-%}")) {
      *end = skip_ws(q + 3);
      return true;
    }
    if (starts_with(q, "%}")) {
      *end = q + 2;
      return true;
    }
    return false;
  }

  size_t lex_raw(size_t pos, bool* line_starting) {
    *line_starting = pos > 0 && src_[pos - 1] == '\n';
    for (size_t t = src_.find("{%", pos); t != std::string::npos; t = src_.find("{%", t + 1)) {
      size_t p = t + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      size_t q = skip_ws(p);
      if (!starts_with(q, "endraw")) continue;
      q = skip_ws(q + 6);
      size_t end;
      if (starts_with(q, "+%}"))
        end = q + 3;
      else if (starts_with(q, "-%}"))
        end = skip_ws(q + 3);
      else if (starts_with(q, "%}"))
        end = q + 2 + (q + 2 < src_.size() && src_[q + 2] == '\n');
      else
        continue;
      emit_data(strip_before_tag(src_.substr(pos, t - pos), sign, true, *line_starting), pos);
      *line_starting = src_[end - 1] == '\n';
      return end;
    }
    fail(pos, "Missing end of raw directive");
  }

  size_t lex_comment(size_t begin, size_t p, bool* line_starting) {
    for (size_t q = p; q < src_.size(); ++q) {
      size_t end = 0;
      if (starts_with(q, "+#}"))
        end = q + 3;
      else if (starts_with(q, "-#}"))
        end = skip_ws(q + 3);
      else if (starts_with(q, "#}"))
        end = q + 2 + (q + 2 < src_.size() && src_[q + 2] == '\n');
      if (end) {
        *line_starting = src_[end - 1] == '\n';
        return end;
      }
    }
    fail(begin, "Missing end of comment tag");
  }

  size_t lex_tag(size_t pos, bool block, bool* line_starting) {
    std::vector<char> balance;
    size_t n = src_.size();
    while (true) {
      pos = skip_ws(pos);
      if (pos >= n)
        fail(pos, block ? "unexpected end of template, expected '%}'"
                        : "unexpected end of template, expected '}}'");
      if (balance.empty()) {
        size_t end = 0;
        if (block) {
          if (starts_with(pos, "+%}"))
            end = pos + 3;
          else if (starts_with(pos, "-%}"))
            end = skip_ws(pos + 3);
          else if (starts_with(pos, "%}"))
            end = pos + 2 + (pos + 2 < n && src_[pos + 2] == '\n');
        } else {
          if (starts_with(pos, "-}}"))
            end = skip_ws(pos + 3);
          else if (starts_with(pos, "}}"))
            end = pos + 2;
        }
        if (end) {
          push(block ? Tok::kBlockEnd : Tok::kVarEnd, block ? "%}" : "}}", pos);
          *line_starting = src_[end - 1] == '\n';
          return end;
        }
      }
      char c = src_[pos];
      if (c >= '0' && c <= '9') {
        pos = lex_number(pos);
      } else if (c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
        size_t e = pos;
        while (e < n && (src_[e] == '_' || std::isalnum(static_cast<unsigned char>(src_[e])))) ++e;
        push(Tok::kName, src_.substr(pos, e - pos), pos);
        pos = e;
      } else if (c == '\'' || c == '"') {
        pos = lex_string(pos);
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                     "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                     ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};
        std::string op;
        for (const char* o : kOps) {
          if (starts_with(pos, o)) {
            op = o;
            break;
          }
        }
        if (op.empty()) fail(pos, std::string("unexpected char '") + c + "'");
        if (op == "(" || op == "[" || op == "{") {
          balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
        } else if (op == ")" || op == "]" || op == "}") {
          if (balance.empty()) fail(pos, "unexpected '" + op + "'");
          if (balance.back() != op[0])
            fail(pos, "unexpected '" + op + "', expected '" + std::string(1, balance.back()) + "'");
          balance.pop_back();
        }
        push(Tok::kOp, op, pos);
        pos += op.size();
      }
    }
  }

  size_t lex_number(size_t pos) {
    size_t n = src_.size();
    auto digits = [&](size_t p) {  // (\d+_)*\d+
      size_t e = p;
      while (e < n && (std::isdigit(static_cast<unsigned char>(src_[e])) ||
                       (src_[e] == '_' && e + 1 < n &&
                        std::isdigit(static_cast<unsigned char>(src_[e + 1])) && e > p)))
        ++e;
      return e;
    };
    size_t e = digits(pos);
    bool is_float = false;
    bool after_dot = pos > 0 && src_[pos - 1] == '.';
    if (!after_dot) {
      if (e + 1 < n && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
        e = digits(e + 1);
        is_float = true;
      }
      if (e < n && (src_[e] == 'e' || src_[e] == 'E')) {
        size_t x = e + 1;
        if (x < n && (src_[x] == '+' || src_[x] == '-')) ++x;
        if (x < n && std::isdigit(static_cast<unsigned char>(src_[x]))) {
          e = digits(x);
          is_float = true;
        }
      }
    }
    std::string text;
    for (size_t i = pos; i < e; ++i)
      if (src_[i] != '_') text += src_[i];
    Token tok;
    tok.type = is_float ? Tok::kFloat : Tok::kInt;
    tok.text = text;
    auto [line, col] = line_col(pos);
    tok.line = line;
    tok.col = col;
    if (is_float) {
      tok.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      tok.int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) fail(pos, "integer literal " + text + " is too large");
    }
    tokens_.push_back(std::move(tok));
    return e;
  }

  static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  // A quoted literal decoded like Python's unicode-escape (what jinja2 does).
  size_t lex_string(size_t pos) {
    char quote = src_[pos];
    std::string out;
    size_t i = pos + 1, n = src_.size();
    while (true) {
      if (i >= n) fail(pos, "unexpected end of string literal");
      char c = src_[i];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++i;
        continue;
      }
      if (i + 1 >= n) fail(pos, "unexpected end of string literal");
      char e = src_[i + 1];
      i += 2;
      switch (e) {
        case '\n':
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
        case 'u':
        case 'U': {
          int len = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (int k = 0; k < len; ++k) {
            int h = i + k < n ? hex_value(src_[i + k]) : -1;
            if (h < 0) fail(pos, std::string("truncated \\") + e + " escape in string literal");
            cp = cp * 16 + static_cast<uint32_t>(h);
          }
          if (cp > 0x10FFFF) fail(pos, "illegal Unicode character in string literal");
          utf8_append(out, cp);
          i += static_cast<size_t>(len);
          break;
        }
        case 'N':
          fail(pos, "\\N{...} escapes are not supported in string literals");
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && i < n && src_[i] >= '0' && src_[i] <= '7'; ++k)
              cp = cp * 8 + static_cast<uint32_t>(src_[i++] - '0');
            utf8_append(out, cp);
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    push(Tok::kString, out, pos);
    return i + 1;
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(const std::string& source) { return Lexer(source).run(); }

}  // namespace ds::jinja
