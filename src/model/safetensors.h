// safetensors reader: parses and validates the header (8-byte little-endian length + JSON) of one
// file, mmaps files read-only, and resolves tensor names across a sharded checkpoint
// (model.safetensors.index.json). Every error names the file (and the tensor when there is one).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/weights.h"

namespace ds {

// Header length limit: real headers are ~100 KB for 27B shards.
constexpr uint64_t kSafetensorsMaxHeader = 100ull << 20;

struct SafetensorsEntry {
  std::string name;
  std::string dtype_str;  // as in the file: "BF16", "F16", "F32", "F8_E4M3", "I64", ...
  int elem_bits = 0;      // bits per element of dtype_str
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // data_offsets, relative to the start of the data section
  int64_t numel() const;
  // The engine dtype when it is one of BF16 / F16 / F32 / F8_E4M3; false for the others.
  bool engine_dtype(DType* out) const;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;                      // 8 + header length: where data_offsets count from
  std::vector<SafetensorsEntry> tensors;        // in file-offset order
  std::map<std::string, std::string> metadata;  // "__metadata__" (string -> string)
  std::unordered_map<std::string, size_t> index;  // name -> position in tensors
  const SafetensorsEntry* find(const std::string& name) const;
};

// Parses and validates the header of a safetensors file held in memory (`size` bytes: the whole
// file, or at least the header when `file_size` gives the real size). Checks: header length sane
// and inside the file, valid JSON object, known dtypes, shapes non-negative, byte length ==
// numel * dtype size, data_offsets inside the file, sorted without gaps or overlaps and covering
// the data section exactly. `where` (the file path) prefixes every error.
SafetensorsHeader parse_safetensors_header(const std::byte* data, size_t size, uint64_t file_size,
                                           const std::string& where);
inline SafetensorsHeader parse_safetensors_header(const std::byte* data, size_t size,
                                                  const std::string& where) {
  return parse_safetensors_header(data, size, size, where);
}

// One mmapped safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  uint64_t size() const { return size_; }
  const std::byte* tensor_data(const SafetensorsEntry& e) const {
    return base_ + header_.data_start + e.begin;
  }

 private:
  std::string path_;
  const std::byte* base_ = nullptr;
  uint64_t size_ = 0;
  SafetensorsHeader header_;
};

// All tensors of a checkpoint folder: model.safetensors, or the shards listed by
// model.safetensors.index.json (every listed file must exist and hold the tensors the index
// places in it).
struct TensorLocation {
  const SafetensorsFile* file = nullptr;
  const SafetensorsEntry* entry = nullptr;
};

class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::string& model_dir);

  const std::string& dir() const { return dir_; }
  // The index file when sharded, else the single safetensors file (named in "missing" errors).
  const std::string& listing() const { return listing_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // Tensor names in a deterministic order (sorted).
  const std::vector<std::string>& names() const { return names_; }
  const TensorLocation* find(const std::string& name) const;

 private:
  std::string dir_, listing_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorLocation> tensors_;
  std::vector<std::string> names_;
};

// Writes one safetensors file: `tensors` (name, dtype, shape, data) in the given order, header
// padded with spaces to a multiple of 8 bytes. Throws ds::Error naming `path` on I/O failure.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const std::byte* data;
};
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace ds
