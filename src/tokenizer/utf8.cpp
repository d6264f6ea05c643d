// UTF-8 validation and lossy repair following the Unicode "maximal subpart" practice (the
// replacement policy of Rust's from_utf8_lossy, Python's "replace" handler and the WHATWG
// decoder), so our bytes->text conversions agree with HF tokenizers byte for byte.
#include "core/utf8.h"
#include "tokenizer/utf8.h"

namespace ds::utf8 {
namespace {
constexpr char kReplacement[] = "\xEF\xBF\xBD";
}

size_t sequence_length(std::string_view s, size_t i, size_t* maximal_subpart, bool* truncated) {
  const size_t n = s.size();
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (truncated) *truncated = false;
  if (b0 < 0x80) return 1;
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;  // no overlongs
    if (b0 == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    if (maximal_subpart) *maximal_subpart = 1;
    return 0;
  }
  size_t k = 1;
  for (; k < need; ++k) {
    if (i + k >= n) {
      if (maximal_subpart) *maximal_subpart = k;
      if (truncated) *truncated = true;
      return 0;
    }
    const auto b = static_cast<uint8_t>(s[i + k]);
    const uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) {
      if (maximal_subpart) *maximal_subpart = k;
      return 0;
    }
  }
  return need;
}

bool is_valid(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const size_t len = sequence_length(s, i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string repair(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  size_t i = 0;
  while (i < s.size()) {
    size_t bad = 0;
    const size_t len = sequence_length(s, i, &bad);
    if (len) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out += kReplacement;
      i += bad;
    }
  }
  return out;
}

size_t repair_complete_prefix(std::string_view s, std::string& out) {
  size_t i = 0;
  while (i < s.size()) {
    size_t bad = 0;
    bool truncated = false;
    const size_t len = sequence_length(s, i, &bad, &truncated);
    if (len) {
      out.append(s.data() + i, len);
      i += len;
    } else if (truncated) {
      break;  // may still become a valid character when more bytes arrive
    } else {
      out += kReplacement;
      i += bad;
    }
  }
  return i;
}

uint32_t decode(std::string_view s, size_t& i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  if (b0 < 0xE0) {
    const uint32_t cp = ((b0 & 0x1Fu) << 6) | (static_cast<uint8_t>(s[i + 1]) & 0x3Fu);
    i += 2;
    return cp;
  }
  if (b0 < 0xF0) {
    const uint32_t cp = ((b0 & 0x0Fu) << 12) | ((static_cast<uint8_t>(s[i + 1]) & 0x3Fu) << 6) |
                        (static_cast<uint8_t>(s[i + 2]) & 0x3Fu);
    i += 3;
    return cp;
  }
  const uint32_t cp = ((b0 & 0x07u) << 18) | ((static_cast<uint8_t>(s[i + 1]) & 0x3Fu) << 12) |
                      ((static_cast<uint8_t>(s[i + 2]) & 0x3Fu) << 6) |
                      (static_cast<uint8_t>(s[i + 3]) & 0x3Fu);
  i += 4;
  return cp;
}

void append(std::string& out, uint32_t cp) {
  append_utf8(out, cp);
}

}  // namespace ds::utf8
