// SAX reader for tokenizer.json / vocab.json (see vocab_reader.h).
#include "tokenizer/vocab_reader.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/file_io.h"

namespace ds {
namespace {

using json = nlohmann::json;

class Handler {
 public:
  Handler(const std::string& where, const std::vector<std::string>& vocab_path,
          const std::vector<std::string>& merges_path, VocabFile& out)
      : where_(where), vocab_path_(vocab_path), merges_path_(merges_path), out_(out) {}

  bool null() { return value(json()); }
  bool boolean(bool v) { return value(json(v)); }
  bool number_integer(json::number_integer_t v) {
    if (mode_ == Mode::kVocab) return vocab_id(v);
    return value(json(v));
  }
  bool number_unsigned(json::number_unsigned_t v) {
    if (mode_ == Mode::kVocab) {
      return vocab_id(v > static_cast<uint64_t>(INT64_MAX) ? -1 : static_cast<int64_t>(v));
    }
    return value(json(v));
  }
  bool number_float(json::number_float_t v, const json::string_t&) { return value(json(v)); }
  bool binary(json::binary_t&) { throw_error(where_, ": unexpected binary value"); }

  bool string(json::string_t& s) {
    switch (mode_) {
      case Mode::kMerges: {
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
          throw_error(where_, ": merges[", out_.merges.size(), "] `", s,
                      "` is not two tokens separated by one space");
        }
        out_.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
        return true;
      }
      case Mode::kMergePair:
        pair_.push_back(std::move(s));
        return true;
      case Mode::kVocab:
        throw_error(where_, ": vocabulary entry `", key_, "` is not an integer id");
      default:
        return value(json(std::move(s)));
    }
  }

  bool key(json::string_t& k) {
    key_ = std::move(k);
    return true;
  }

  bool start_object(size_t) {
    if (mode_ == Mode::kVocab)
      throw_error(where_, ": vocabulary entry `", key_, "` is not an integer id");
    if (mode_ != Mode::kNormal)
      throw_error(where_, ": merges[", out_.merges.size(), "] is malformed");
    const std::vector<std::string> child = child_path();
    if (child == vocab_path_) {
      saved_key_ = key_;
      mode_ = Mode::kVocab;
      out_.has_vocab = true;
      return true;
    }
    return open(json::object(), child);
  }
  bool end_object() {
    if (mode_ == Mode::kVocab) {
      mode_ = Mode::kNormal;
      key_ = saved_key_;
      return value(json());
    }
    return close();
  }

  bool start_array(size_t) {
    if (mode_ == Mode::kVocab)
      throw_error(where_, ": vocabulary entry `", key_, "` is not an integer id");
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kMergePair;
      pair_.clear();
      return true;
    }
    if (mode_ == Mode::kMergePair)
      throw_error(where_, ": merges[", out_.merges.size(), "] is malformed");
    const std::vector<std::string> child = child_path();
    if (child == merges_path_) {
      mode_ = Mode::kMerges;
      out_.has_merges = true;
      return true;
    }
    return open(json::array(), child);
  }
  bool end_array() {
    if (mode_ == Mode::kMergePair) {
      if (pair_.size() != 2) {
        throw_error(where_, ": merges[", out_.merges.size(), "] must be [\"a\", \"b\"]");
      }
      out_.merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
      mode_ = Mode::kMerges;
      return true;
    }
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kNormal;
      return value(json());
    }
    return close();
  }

  bool parse_error(size_t position, const std::string&, const nlohmann::detail::exception& ex) {
    throw_error(where_, ": invalid JSON at byte ", position, ": ", ex.what());
  }

 private:
  enum class Mode { kNormal, kVocab, kMerges, kMergePair };

  std::vector<std::string> child_path() const {
    std::vector<std::string> p = path_;
    if (!stack_.empty()) p.push_back(stack_.back()->is_object() ? key_ : std::string("#"));
    return p;
  }

  bool vocab_id(int64_t v) {
    if (v < 0 || v >= (int64_t{1} << 30)) {
      throw_error(where_, ": vocabulary entry `", key_, "` has id ", v, " out of range");
    }
    out_.vocab.emplace_back(std::move(key_), v);
    return true;
  }

  bool value(json&& v) {
    if (mode_ == Mode::kMerges || mode_ == Mode::kMergePair) {
      throw_error(where_, ": merges[", out_.merges.size(), "] is malformed");
    }
    if (mode_ == Mode::kVocab)
      throw_error(where_, ": vocabulary entry `", key_, "` is not an integer id");
    if (stack_.empty()) {
      out_.rest = std::move(v);
    } else if (stack_.back()->is_object()) {
      (*stack_.back())[key_] = std::move(v);
    } else {
      stack_.back()->push_back(std::move(v));
    }
    return true;
  }

  bool open(json&& container, std::vector<std::string> child) {
    json* slot;
    if (stack_.empty()) {
      out_.rest = std::move(container);
      slot = &out_.rest;
    } else if (stack_.back()->is_object()) {
      slot = &((*stack_.back())[key_] = std::move(container));
    } else {
      stack_.back()->push_back(std::move(container));
      slot = &stack_.back()->back();
    }
    stack_.push_back(slot);
    path_ = std::move(child);
    return true;
  }

  bool close() {
    stack_.pop_back();
    if (!path_.empty()) path_.pop_back();
    return true;
  }

  const std::string& where_;
  const std::vector<std::string>& vocab_path_;
  const std::vector<std::string>& merges_path_;
  VocabFile& out_;
  Mode mode_ = Mode::kNormal;
  std::vector<json*> stack_;
  std::vector<std::string> path_;  // keys ("#" for array elements) down to the current container
  std::string key_;
  std::string saved_key_;  // key of the vocabulary object while its entries are read
  std::vector<std::string> pair_;
};

}  // namespace

VocabFile read_vocab_file(const std::string& path, const std::vector<std::string>& vocab_path,
                          const std::vector<std::string>& merges_path) {
  const std::string text = read_regular_file(path, kMaxTokenizerFileBytes);
  VocabFile out;
  Handler h(path, vocab_path, merges_path, out);
  json::sax_parse(text, &h);
  return out;
}

}  // namespace ds
