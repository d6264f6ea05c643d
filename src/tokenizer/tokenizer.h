// Byte-level BPE tokenizer that reproduces Hugging Face `tokenizers` exactly for the Qwen family
// (and other GPT-2-style byte-level BPE tokenizers): reads tokenizer.json (+ tokenizer_config.json)
// or vocab.json + merges.txt.
//
// encode(text) == HF `Tokenizer.encode(text, add_special_tokens=False).ids`, where text is the
// input bytes decoded as UTF-8 with invalid sequences replaced by U+FFFD (what Python's
// `bytes.decode("utf-8", "replace")` gives). Pipeline: added tokens matched first on the raw text
// (leftmost-longest, honouring lstrip / rstrip / single_word; allow_special=false is HF's
// `encode_special_tokens=True`: special tokens are then plain text), NFC on the rest, added
// tokens with normalized=true matched on the normalised text, regex split (PCRE2), BPE by merge
// rank on the raw bytes. The post-processor is not applied (Qwen's adds nothing).
// decode(ids) == HF `Tokenizer.decode(ids, skip_special_tokens)`: ByteLevel decoding, lossy
// UTF-8 (U+FFFD for broken sequences); ids inside the vocabulary range that name no token are
// skipped like HF does; ids outside [0, vocab_size()) throw ds::Error.
// A Tokenizer is immutable after load (apart from an internal thread-safe cache): encode/decode
// may run concurrently; copies share the loaded tables.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ds {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;  // matched against the NFC-normalised text instead of the raw text
  bool single_word = false;
};

class Tokenizer {
 public:
  // dir holds tokenizer.json (+ tokenizer_config.json), or vocab.json + merges.txt
  // (+ tokenizer_config.json); dir may also be the path of a tokenizer.json. Throws ds::Error
  // naming the file and field on anything missing, malformed or unsupported.
  static Tokenizer load(const std::string& dir);

  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const;
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  int vocab_size() const;  // highest id + 1 (incl. added tokens)
  std::optional<int32_t> token_id(std::string_view token) const;  // e.g. "<|im_end|>"
  bool is_special(int32_t id) const;
  // Stop ids: tokenizer_config.json `eos_token`, generation_config.json `eos_token_id` (int or
  // list) when the folder has one, else also `<|endoftext|>` when it is a special token (the
  // ChatML convention: the Qwen generation configs stop on both).
  std::vector<int32_t> eos_ids() const;

  // Raw bytes id decodes to (empty for ids that name no token); throws when out of range.
  const std::string& token_bytes(int32_t id) const;
  // The token's string in the vocabulary (HF `convert_ids_to_tokens`: byte-level form, e.g.
  // "Ġhello", or an added token's content); nullopt for ids that name no token; throws when out
  // of range.
  std::optional<std::string> token_string(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Streaming detokenizer: feed ids one at a time, get the text that is complete so far (holds back
// incomplete UTF-8 sequences). The concatenation of every push() and the final flush() equals
// tok.decode(all ids, skip_special).
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tok, bool skip_special = false);
  std::string push(int32_t id);  // newly complete text
  std::string flush();           // whatever is left (invalid bytes as U+FFFD)

 private:
  Tokenizer tok_;
  bool skip_special_;
  std::string pending_;  // bytes not yet emitted (an incomplete UTF-8 sequence)
};

}  // namespace ds
