// safetensors header parsing and validation, read-only mmap of files, sharded checkpoint index,
// and a small writer (used by write_checkpoint and the tests).
#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/file_io.h"

namespace ds {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

struct DtypeInfo {
  const char* name;
  int bits;
};
// The dtypes of the safetensors format (0.4-0.8). Only BF16/F16/F32 are usable as weights.
constexpr DtypeInfo kDtypes[] = {
    {"BOOL", 8},    {"U8", 8},   {"I8", 8},   {"F8_E5M2", 8}, {"F8_E4M3", 8},
    {"F8_E8M0", 8}, {"I16", 16}, {"U16", 16}, {"F16", 16},    {"BF16", 16},
    {"I32", 32},    {"U32", 32}, {"F32", 32}, {"F64", 64},    {"I64", 64},
    {"U64", 64},    {"C64", 64}, {"F4", 4},   {"F6_E2M3", 6}, {"F6_E3M2", 6},
};

int dtype_bits(const std::string& s) {
  for (const DtypeInfo& d : kDtypes) {
    if (s == d.name) return d.bits;
  }
  return 0;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool SafetensorsEntry::engine_dtype(DType* out) const {
  if (dtype_str == "BF16")
    *out = DType::kBF16;
  else if (dtype_str == "F16")
    *out = DType::kF16;
  else if (dtype_str == "F32")
    *out = DType::kF32;
  else if (dtype_str == "F8_E4M3")
    *out = DType::kF8E4M3;
  else
    return false;
  return true;
}

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  auto it = index.find(name);
  return it == index.end() ? nullptr : &tensors[it->second];
}

SafetensorsHeader parse_safetensors_header(const std::byte* data, size_t size, uint64_t file_size,
                                           const std::string& where) {
  if (size < 8) {
    throw_error(where, ": truncated safetensors file (", file_size,
                " bytes; the 8-byte header length is missing)");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(data[i]);  // little-endian
  if (n < 2) throw_error(where, ": corrupt safetensors file: header length ", n, " is too small");
  if (n > kSafetensorsMaxHeader) {
    throw_error(where, ": corrupt safetensors file: header length ", n, " bytes exceeds the ",
                kSafetensorsMaxHeader, "-byte limit (not a safetensors file?)");
  }
  if (8 + n > file_size || 8 + n > size) {
    throw_error(where, ": truncated safetensors file: header length ", n, " but the file has only ",
                file_size, " bytes");
  }
  SafetensorsHeader h;
  h.data_start = 8 + n;
  const uint64_t data_size = file_size - h.data_start;

  const char* text = reinterpret_cast<const char*>(data + 8);
  // A header is {name: {dtype, shape: [...], data_offsets: [...]}, "__metadata__": {...}}: three
  // levels. Deeper text is refused before the parser builds it (100 MB of '[' took 7.5 GB).
  if (json_nested_deeper_than(std::string_view(text, n), 16))
    throw_error(where, ": corrupt safetensors header: JSON nested deeper than 16 levels");
  json root;
  try {
    root = json::parse(text, text + n);
  } catch (const json::exception& e) {
    throw_error(where, ": corrupt safetensors header (invalid JSON): ", e.what());
  }
  if (!root.is_object()) {
    throw_error(where, ": corrupt safetensors header: expected a JSON object, got ",
                root.type_name());
  }

  for (auto& item : root.items()) {
    const std::string& name = item.key();  // (not a structured binding: lambdas below capture it)
    const json& v = item.value();
    if (name == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object())
        throw_error(where, ": safetensors __metadata__ must be an object of strings");
      for (auto& [k, mv] : v.items()) {
        if (!mv.is_string())
          throw_error(where, ": safetensors __metadata__ value '", k, "' is not a string");
        h.metadata[k] = mv.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& why) -> void {
      throw_error(where, ": corrupt safetensors header: tensor '", name, "': ", why);
    };
    if (!v.is_object()) bad("entry is not an object");
    SafetensorsEntry e;
    e.name = name;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) bad("missing or non-string 'dtype'");
    e.dtype_str = dt->get<std::string>();
    e.elem_bits = dtype_bits(e.dtype_str);
    if (e.elem_bits == 0) bad("unknown dtype '" + e.dtype_str.substr(0, 40) + "'");
    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) bad("missing or non-list 'shape'");
    if (sh->size() > 8) bad("shape has " + std::to_string(sh->size()) + " dimensions");
    // numel * bits must stay far from overflow: every real tensor is < 2^40 elements.
    constexpr int64_t kMaxNumel = int64_t(1) << 50;
    int64_t numel = 1;
    for (const json& d : *sh) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0)) {
        bad("shape has a non-integer or negative dimension " + d.dump().substr(0, 40));
      }
      if (d.is_number_unsigned() && d.get<uint64_t>() > uint64_t(kMaxNumel))
        bad("shape dimension too large");
      int64_t dim = d.get<int64_t>();
      e.shape.push_back(dim);
      if (dim != 0 && numel > kMaxNumel / dim) bad("shape is too large");
      numel *= dim;
    }
    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      bad("'data_offsets' must be a list of two non-negative integers");
    }
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    if (e.end < e.begin) {
      bad("data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
          "] are reversed");
    }
    if (e.end > data_size) {
      bad("data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
          "] go past the end of the file (data section is " + std::to_string(data_size) +
          " bytes; truncated file?)");
    }
    uint64_t bits = static_cast<uint64_t>(numel) * static_cast<uint64_t>(e.elem_bits);
    if (bits % 8 != 0 || bits / 8 != e.end - e.begin) {
      std::ostringstream os;
      os << "byte length " << e.end - e.begin << " does not match shape [";
      for (size_t i = 0; i < e.shape.size(); ++i) os << (i ? ", " : "") << e.shape[i];
      os << "] x " << e.dtype_str << " (" << bits / 8.0 << " bytes)";
      bad(os.str());
    }
    h.tensors.push_back(std::move(e));
  }

  // Sorted by offset, the tensors must tile the data section exactly (as the reference
  // implementation requires): a gap or an overlap means a corrupt or hand-edited file.
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  uint64_t pos = 0;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const SafetensorsEntry& e = h.tensors[i];
    if (e.begin < pos) {
      throw_error(where, ": corrupt safetensors header: tensor '", e.name, "' data_offsets [",
                  e.begin, ", ", e.end, "] overlap tensor '", h.tensors[i - 1].name, "' (ends at ",
                  pos, ")");
    }
    if (e.begin > pos) {
      throw_error(where, ": corrupt safetensors header: ", e.begin - pos,
                  " unaccounted bytes before tensor '", e.name, "' (data_offsets [", e.begin, ", ",
                  e.end, "], previous data ends at ", pos, ")");
    }
    pos = e.end;
  }
  if (pos != data_size) {
    throw_error(where, ": corrupt safetensors file: tensors cover ", pos,
                " bytes of data but the data section has ", data_size, " bytes");
  }
  for (size_t i = 0; i < h.tensors.size(); ++i) h.index[h.tensors[i].name] = i;
  return h;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  // O_NONBLOCK: a FIFO would block the open (waiting for a writer) before the type is checked.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw_error(path, ": cannot open: ", errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string why = errno_text();
    ::close(fd);
    throw_error(path, ": cannot stat: ", why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw_error(path, ": not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    throw_error(path, ": truncated safetensors file (", size_,
                " bytes; the 8-byte header length is missing)");
  }
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  std::string why = p == MAP_FAILED ? errno_text() : "";
  ::close(fd);  // the mapping stays valid
  if (p == MAP_FAILED) throw_error(path, ": mmap failed: ", why);
  base_ = static_cast<const std::byte*>(p);
  try {
    header_ = parse_safetensors_header(base_, size_, size_, path_);
  } catch (...) {
    ::munmap(const_cast<std::byte*>(base_), size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<std::byte*>(base_), size_);
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& model_dir) : dir_(model_dir) {
  fs::path dir(model_dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw_error(model_dir, ": not a directory (expected a checkpoint folder)");
  fs::path index_path = dir / "model.safetensors.index.json";
  fs::path single_path = dir / "model.safetensors";

  if (fs::exists(index_path, ec)) {
    listing_ = index_path.string();
    // An index lists each tensor once: a few MB for the largest checkpoints, three levels deep.
    const std::string text = read_regular_file(listing_, 256ull << 20);
    check_json_depth(text, 16, listing_);
    json idx;
    try {
      idx = json::parse(text);
    } catch (const json::exception& e) {
      throw_error(listing_, ": invalid JSON: ", e.what());
    }
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object()) {
      throw_error(listing_,
                  ": expected an object with a 'weight_map' object (tensor name -> shard file)");
    }
    std::map<std::string, size_t> file_ids;
    for (auto& [name, fv] : idx["weight_map"].items()) {
      if (!fv.is_string())
        throw_error(listing_, ": weight_map entry for tensor '", name, "' is not a file name");
      std::string fname = fv.get<std::string>();
      // Shards live next to the index: refuse paths that leave the folder.
      if (fname.empty() || fname.find('/') != std::string::npos ||
          fname.find('\\') != std::string::npos || fname == "." || fname == "..") {
        throw_error(listing_, ": weight_map entry for tensor '", name,
                    "' names an invalid shard file '", fname, "'");
      }
      auto it = file_ids.find(fname);
      if (it == file_ids.end()) {
        fs::path shard = dir / fname;
        if (!fs::exists(shard, ec)) {
          throw_error(listing_, ": shard file ", shard.string(), " (listed for tensor '", name,
                      "') does not exist");
        }
        files_.push_back(std::make_unique<SafetensorsFile>(shard.string()));
        it = file_ids.emplace(fname, files_.size() - 1).first;
      }
      const SafetensorsFile* file = files_[it->second].get();
      const SafetensorsEntry* e = file->header().find(name);
      if (e == nullptr) {
        throw_error(listing_, ": the index places tensor '", name, "' in ", file->path(),
                    " but that file does not hold it");
      }
      tensors_[name] = TensorLocation{file, e};
    }
    if (files_.empty()) throw_error(listing_, ": weight_map is empty");
  } else if (fs::exists(single_path, ec)) {
    listing_ = single_path.string();
    files_.push_back(std::make_unique<SafetensorsFile>(listing_));
    for (const SafetensorsEntry& e : files_[0]->header().tensors)
      tensors_[e.name] = TensorLocation{files_[0].get(), &e};
  } else {
    throw_error(model_dir, ": no model.safetensors or model.safetensors.index.json in this folder");
  }
  names_.reserve(tensors_.size());
  for (auto& [name, loc] : tensors_) names_.push_back(name);
}

const TensorLocation* SafetensorsCheckpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> seen;
  for (const TensorToWrite& t : tensors) {
    if (!seen.insert(t.name).second) throw_error(path, ": tensor '", t.name, "' written twice");
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    uint64_t bytes = static_cast<uint64_t>(numel) * dtype_size(t.dtype);
    const char* dt = t.dtype == DType::kBF16  ? "BF16"
                     : t.dtype == DType::kF16 ? "F16"
                     : t.dtype == DType::kF32 ? "F32"
                                              : "F8_E4M3";
    header[t.name] = {
        {"dtype", dt}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw_error(path, ": cannot create: ", errno_text());
  bool ok = true;
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t(text.size()) >> (8 * i));
  ok = ok && std::fwrite(len, 1, 8, f) == 8;
  ok = ok && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const TensorToWrite& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    size_t bytes = static_cast<size_t>(numel) * dtype_size(t.dtype);
    if (ok && bytes > 0) ok = std::fwrite(t.data, 1, bytes, f) == bytes;
  }
  std::string why = ok ? "" : errno_text();
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    why = errno_text();
  }
  if (!ok) throw_error(path, ": write failed: ", why);
}

}  // namespace ds
