// UTF-8 helpers shared by the tokenizer: validation, lossy repair (each maximal ill-formed
// subsequence becomes U+FFFD, exactly as Rust's String::from_utf8_lossy and Python's
// bytes.decode("utf-8", "replace") do), and the "complete prefix" length a streaming decoder
// may emit without cutting a character in half.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ds::utf8 {

// Length of the well-formed UTF-8 sequence starting at s[i], or 0 if the bytes there are not a
// complete well-formed sequence. When it returns 0, *maximal_subpart (if given) receives the
// length (>= 1) of the maximal ill-formed subpart starting at i (the bytes one U+FFFD replaces),
// and *truncated is true when those bytes are a valid prefix cut short by the end of s.
size_t sequence_length(std::string_view s, size_t i, size_t* maximal_subpart = nullptr,
                       bool* truncated = nullptr);

// True iff s is entirely well-formed UTF-8 (no surrogates, no overlongs, <= U+10FFFF).
bool is_valid(std::string_view s);

// s with every maximal ill-formed subpart replaced by U+FFFD ("\xEF\xBF\xBD").
std::string repair(std::string_view s);

// Appends to out the text of s that is safe to emit now: all of s except a trailing incomplete
// (but so far valid) sequence, with ill-formed parts replaced by U+FFFD. Returns the number of
// bytes of s consumed (the rest must be kept for the next call).
size_t repair_complete_prefix(std::string_view s, std::string& out);

// Decodes the code point at s[i] (s must be valid there); advances i.
uint32_t decode(std::string_view s, size_t& i);

// Appends the UTF-8 encoding of code point cp.
void append(std::string& out, uint32_t cp);

}  // namespace ds::utf8
