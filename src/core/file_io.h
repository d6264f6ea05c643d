// Reading the small text files of a checkpoint or tokenizer (config.json, the safetensors index,
// tokenizer.json, tokenizer_config.json, vocab.json) without trusting them: only a regular file
// (a FIFO would block the reader, /dev/zero would never end), at most a stated size, and JSON no
// deeper than a stated nesting (nlohmann's parser recurses and its values take ~75 bytes per
// level: 100 MB of '[' took 7.5 GB).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ds {

// The whole file at `path` (symlinks followed). Throws ds::Error naming the path when it cannot
// be opened, is not a regular file (a directory, FIFO, device) or holds more than max_bytes.
std::string read_regular_file(const std::string& path, uint64_t max_bytes);

// The limits for a tokenizer folder's files (tokenizer.json, vocab.json, tokenizer_config.json):
// Qwen3's tokenizer.json is ~11 MB and a few levels deep.
constexpr uint64_t kMaxTokenizerFileBytes = 512ull << 20;
constexpr int kMaxTokenizerJsonDepth = 128;

// Whether JSON text nests arrays / objects deeper than max_depth (strings skipped; malformed text
// is left to the parser). Linear, no allocation.
bool json_nested_deeper_than(std::string_view text, int max_depth);

// Throws ds::Error "<where>: JSON nested deeper than <max_depth> levels" when it is.
void check_json_depth(std::string_view text, int max_depth, const std::string& where);

}  // namespace ds
