// Minimal .npy (NumPy format 1.0) writer/reader for float32 / int32 arrays, little-endian, C order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ds {

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);
// Reads a float32 .npy written by numpy (format 1.0/2.0, '<f4', C order); throws ds::Error.
std::vector<float> read_npy_f32(const std::string& path, std::vector<int64_t>* shape);

}  // namespace ds
