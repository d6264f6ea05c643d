#include "core/npy.h"

#include <cstring>
#include <fstream>

#include "core/error.h"

namespace ds {

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    header += std::to_string(shape[i]);
    header += (shape.size() == 1 || i + 1 < shape.size()) ? ", " : "";
    n *= shape[i];
  }
  header += "), }";
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  DS_CHECK(f, "cannot open ", path, " for writing");
  const char magic[] = "\x93NUMPY\x01\x00";
  f.write(magic, 8);
  uint16_t hl = static_cast<uint16_t>(header.size());
  f.write(reinterpret_cast<const char*>(&hl), 2);
  f.write(header.data(), header.size());
  f.write(reinterpret_cast<const char*>(data), n * 4);
  DS_CHECK(f.good(), "write to ", path, " failed");
}

std::vector<float> read_npy_f32(const std::string& path, std::vector<int64_t>* shape) {
  std::ifstream f(path, std::ios::binary);
  DS_CHECK(f, "cannot open ", path);
  char magic[8];
  f.read(magic, 8);
  DS_CHECK(f && std::memcmp(magic, "\x93NUMPY", 6) == 0, path, ": not a .npy file");
  uint32_t hl = 0;
  if (magic[6] == 1) {
    uint16_t h16;
    f.read(reinterpret_cast<char*>(&h16), 2);
    hl = h16;
  } else {
    f.read(reinterpret_cast<char*>(&hl), 4);
  }
  DS_CHECK(f && hl < (1u << 20), path, ": bad .npy header");
  std::string header(hl, '\0');
  f.read(header.data(), hl);
  DS_CHECK(header.find("'<f4'") != std::string::npos, path, ": expected float32 ('<f4') data");
  DS_CHECK(header.find("'fortran_order': False") != std::string::npos, path, ": expected C order");
  auto lp = header.find("'shape': (");
  DS_CHECK(lp != std::string::npos, path, ": no shape in header");
  auto rp = header.find(')', lp);
  std::string dims = header.substr(lp + 10, rp - lp - 10);
  std::vector<int64_t> s;
  int64_t n = 1;
  size_t pos = 0;
  while (pos < dims.size()) {
    while (pos < dims.size() && (dims[pos] == ' ' || dims[pos] == ',')) ++pos;
    if (pos >= dims.size()) break;
    size_t end = pos;
    while (end < dims.size() && dims[end] >= '0' && dims[end] <= '9') ++end;
    DS_CHECK(end > pos, path, ": bad shape in header");
    s.push_back(std::stoll(dims.substr(pos, end - pos)));
    n *= s.back();
    pos = end;
  }
  std::vector<float> out(n);
  f.read(reinterpret_cast<char*>(out.data()), n * 4);
  DS_CHECK(f.gcount() == n * 4, path, ": truncated data");
  if (shape) *shape = s;
  return out;
}

}  // namespace ds
