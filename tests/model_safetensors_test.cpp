// Tests of the safetensors header parser and the sharded-checkpoint index: every corruption
// (truncation, absurd header length, bad JSON, offsets out of range / overlapping / reversed /
// with gaps, byte length != shape x dtype, unknown dtype) is rejected with the file named.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "core/error.h"
#include "core/file_io.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace ds {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A safetensors byte image from a header JSON text and a data section.
std::vector<std::byte> image(const std::string& header, size_t data_bytes,
                             uint64_t declared_len = UINT64_MAX) {
  uint64_t n = declared_len == UINT64_MAX ? header.size() : declared_len;
  std::vector<std::byte> out(8 + header.size() + data_bytes, std::byte{0});
  for (int i = 0; i < 8; ++i) out[i] = std::byte(uint8_t(n >> (8 * i)));
  std::memcpy(out.data() + 8, header.data(), header.size());
  for (size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = std::byte(uint8_t(i));
  return out;
}

SafetensorsHeader parse(const std::vector<std::byte>& b) {
  return parse_safetensors_header(b.data(), b.size(), "f.safetensors");
}

void expect_bad(const std::vector<std::byte>& b, std::initializer_list<std::string> parts) {
  try {
    parse(b);
    ADD_FAILURE() << "expected ds::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("f.safetensors"), std::string::npos) << msg;
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

const std::string kGood =
    R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
    R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";

TEST(ModelSafetensors, ParsesAValidHeader) {
  auto b = image(kGood, 12);
  SafetensorsHeader h = parse(b);
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "a");  // sorted by offset
  EXPECT_EQ(h.tensors[1].name, "b");
  EXPECT_EQ(h.data_start, 8 + kGood.size());
  EXPECT_EQ(h.metadata.at("format"), "pt");
  ASSERT_NE(h.find("b"), nullptr);
  EXPECT_EQ(h.find("b")->shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(h.find("zz"), nullptr);
  DType dt;
  EXPECT_TRUE(h.find("a")->engine_dtype(&dt));
  EXPECT_EQ(dt, DType::kBF16);
  // Empty file (header only, no tensors) and zero-sized tensors are valid.
  EXPECT_EQ(parse(image("{}", 0)).tensors.size(), 0u);
  EXPECT_EQ(
      parse(image(R"({"e":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]}})", 0)).tensors.size(),
      1u);
  // Header padded with spaces (as the reference writer does).
  EXPECT_EQ(parse(image(kGood + "    ", 12)).tensors.size(), 2u);
  // Other dtypes parse (they may belong to tensors the engine ignores).
  SafetensorsHeader h2 =
      parse(image(R"({"i":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8));
  EXPECT_FALSE(h2.tensors[0].engine_dtype(&dt));
}

TEST(ModelSafetensors, TruncatedAndHeaderLength) {
  auto b = image(kGood, 12);
  expect_bad(std::vector<std::byte>(b.begin(), b.begin() + 5), {"truncated", "8-byte"});
  expect_bad(std::vector<std::byte>(b.begin(), b.begin() + 30), {"truncated", "header length"});
  expect_bad(std::vector<std::byte>(b.begin(), b.end() - 1), {"past the end", "'b'"});
  expect_bad(image(kGood, 12, 1ull << 40), {"header length", "limit"});
  expect_bad(image(kGood, 12, 0), {"header length 0"});
  expect_bad(image(kGood, 12, kSafetensorsMaxHeader - 1), {"truncated", "header length"});
}

TEST(ModelSafetensors, BadJson) {
  expect_bad(image("{\"a\": [", 0), {"invalid JSON"});
  expect_bad(image("[1,2,3]", 0), {"expected a JSON object"});
  expect_bad(image(R"({"a": 3})", 0), {"'a'", "not an object"});
  expect_bad(image(R"({"__metadata__": {"k": 1}})", 0), {"__metadata__"});
  expect_bad(image(std::string("{\"a\xff\": 1}"), 0), {"invalid JSON"});
}

TEST(ModelSafetensors, BadEntries) {
  expect_bad(image(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4), {"'a'", "dtype"});
  expect_bad(image(R"({"a":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,4]}})", 4),
             {"'a'", "unknown dtype 'Q4_K'"});
  expect_bad(image(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4), {"'a'", "shape"});
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
             {"'a'", "negative"});
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4),
             {"'a'", "non-integer"});
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4),
             {"'a'", "data_offsets"});
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,-4]}})", 4),
             {"'a'", "data_offsets"});
  expect_bad(
      image(
          R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})",
          4),
      {"'a'", "too large"});
}

TEST(ModelSafetensors, OffsetErrors) {
  // Out of range.
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
             {"'a'", "past the end"});
  // Reversed.
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4),
             {"'a'", "reversed"});
  // Wrong length for the shape.
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
             {"'a'", "byte length 8", "[3]", "F32"});
  expect_bad(image(R"({"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,4]}})", 4),
             {"'a'", "byte length 4"});
  // Overlapping.
  expect_bad(
      image(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          12),
      {"overlap", "'a'", "'b'"});
  // Two tensors on the same bytes.
  expect_bad(
      image(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
          4),
      {"overlap"});
  // Gap between tensors and trailing unaccounted data.
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
             {"unaccounted", "'a'"});
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8),
             {"cover 4 bytes", "8 bytes"});
}

std::string temp_dir() {
  fs::path p = fs::temp_directory_path() / ("ds_st_test_" + std::to_string(::getpid()) + "_" +
                                            std::to_string(std::random_device{}()));
  fs::create_directories(p);
  return p.string();
}

TEST(ModelSafetensors, WriterRoundTripAndMmap) {
  std::string d = temp_dir();
  std::vector<float> x = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
  std::vector<uint16_t> y = {0x3f80, 0x4000};
  write_safetensors(d + "/m.safetensors",
                    {{"x", DType::kF32, {2, 3}, reinterpret_cast<const std::byte*>(x.data())},
                     {"y", DType::kBF16, {2}, reinterpret_cast<const std::byte*>(y.data())}});
  SafetensorsFile f(d + "/m.safetensors");
  EXPECT_EQ(f.header().data_start % 8, 0u);
  const SafetensorsEntry* e = f.header().find("x");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(f.tensor_data(*e), x.data(), 24), 0);
  EXPECT_EQ(std::memcmp(f.tensor_data(*f.header().find("y")), y.data(), 4), 0);
  // Errors of files on disk name the path.
  try {
    SafetensorsFile g(d + "/missing.safetensors");
    ADD_FAILURE();
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find(d + "/missing.safetensors"), std::string::npos);
  }
  std::ofstream(d + "/short.safetensors") << "abc";
  try {
    SafetensorsFile g(d + "/short.safetensors");
    ADD_FAILURE();
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("short.safetensors: truncated"), std::string::npos)
        << err.what();
  }
  fs::remove_all(d);
}

TEST(ModelSafetensors, ShardedIndex) {
  std::string d = temp_dir();
  std::vector<float> x = {1.f, 2.f};
  auto p = reinterpret_cast<const std::byte*>(x.data());
  write_safetensors(d + "/s1.safetensors", {{"a", DType::kF32, {2}, p}});
  write_safetensors(d + "/s2.safetensors",
                    {{"b", DType::kF32, {1}, p}, {"c", DType::kF32, {1}, p + 4}});
  auto write_index = [&](const json& map) {
    std::ofstream(d + "/model.safetensors.index.json")
        << json{{"metadata", {{"total_size", 16}}}, {"weight_map", map}}.dump();
  };
  write_index({{"a", "s1.safetensors"}, {"b", "s2.safetensors"}, {"c", "s2.safetensors"}});
  {
    SafetensorsCheckpoint ck(d);
    EXPECT_EQ(ck.files().size(), 2u);
    EXPECT_EQ(ck.names(), (std::vector<std::string>{"a", "b", "c"}));
    const TensorLocation* c = ck.find("c");
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->file->path(), d + "/s2.safetensors");
    float v;
    std::memcpy(&v, c->file->tensor_data(*c->entry), 4);
    EXPECT_EQ(v, 2.f);
    EXPECT_EQ(ck.find("zz"), nullptr);
  }
  auto expect_ck_error = [&](std::initializer_list<std::string> parts) {
    try {
      SafetensorsCheckpoint ck(d);
      ADD_FAILURE() << "expected ds::Error";
    } catch (const Error& e) {
      std::string msg = e.what();
      for (const std::string& s : parts)
        EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' not in: " << msg;
    }
  };
  // A listed shard file that does not exist.
  write_index({{"a", "s1.safetensors"}, {"b", "s3.safetensors"}});
  expect_ck_error({"model.safetensors.index.json", "s3.safetensors", "'b'", "does not exist"});
  // A tensor placed in the wrong shard.
  write_index({{"a", "s2.safetensors"}});
  expect_ck_error({"'a'", "s2.safetensors", "does not hold it"});
  // Paths leaving the folder.
  write_index({{"a", "../s1.safetensors"}});
  expect_ck_error({"invalid shard file"});
  // Broken index JSON / layout.
  std::ofstream(d + "/model.safetensors.index.json") << "{";
  expect_ck_error({"model.safetensors.index.json", "invalid JSON"});
  std::ofstream(d + "/model.safetensors.index.json") << "{\"weight_map\": []}";
  expect_ck_error({"model.safetensors.index.json", "weight_map"});
  // A corrupt shard is reported with its own path.
  write_index({{"a", "s1.safetensors"}, {"b", "s2.safetensors"}});
  fs::resize_file(d + "/s2.safetensors", fs::file_size(d + "/s2.safetensors") - 2);
  expect_ck_error({"s2.safetensors", "past the end"});
  fs::remove_all(d);
}

// Found by fuzzing checkpoints (session 35): a FIFO named model.safetensors or config.json hung
// the loader in open(); config.json or the index linked to /dev/zero read until memory ran out;
// 100 MB of '[' in a header took 7.5 GB in the JSON parser. Each is now a clear error.
TEST(ModelSafetensors, NonRegularFilesSizesAndNesting) {
  std::string d = temp_dir();
  auto expect_error = [](auto&& fn, std::initializer_list<std::string> parts) {
    try {
      fn();
      ADD_FAILURE() << "expected ds::Error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      for (const std::string& p : parts)
        EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    }
  };
  ASSERT_EQ(::mkfifo((d + "/model.safetensors").c_str(), 0600), 0);
  expect_error([&] { SafetensorsFile f(d + "/model.safetensors"); }, {"not a regular file"});
  expect_error([&] { SafetensorsCheckpoint ck(d); }, {"not a regular file"});
  fs::remove(d + "/model.safetensors");
  ASSERT_EQ(::mkfifo((d + "/model.safetensors.index.json").c_str(), 0600), 0);
  expect_error([&] { SafetensorsCheckpoint ck(d); }, {"index.json", "not a regular file"});
  fs::remove(d + "/model.safetensors.index.json");
  fs::create_symlink("/dev/zero", d + "/model.safetensors.index.json");
  expect_error([&] { SafetensorsCheckpoint ck(d); }, {"index.json", "not a regular file"});
  fs::remove(d + "/model.safetensors.index.json");
  fs::create_directory(d + "/model.safetensors.index.json");
  expect_error([&] { SafetensorsCheckpoint ck(d); }, {"index.json", "is a directory"});
  fs::remove(d + "/model.safetensors.index.json");
  // The reader's own checks.
  std::ofstream(d + "/small.json") << R"({"a": [1, {"b": "[[[["}]})";
  EXPECT_EQ(read_regular_file(d + "/small.json", 100), R"({"a": [1, {"b": "[[[["}]})");
  expect_error([&] { read_regular_file(d + "/small.json", 10); }, {"small.json", "10-byte limit"});
  expect_error([&] { read_regular_file(d + "/missing.json", 100); }, {"missing.json", "cannot open"});
  EXPECT_FALSE(json_nested_deeper_than(R"({"a": [1, {"b": "[[[["}]})", 3));
  EXPECT_TRUE(json_nested_deeper_than(R"({"a": [1, {"b": "[[[["}]})", 2));
  EXPECT_FALSE(json_nested_deeper_than(R"(["\"[[[[", []])", 2));
  // A deeply nested header (inside the size limit) is refused before it is parsed.
  expect_bad(image(std::string(100000, '[') + std::string(100000, ']'), 0), {"nested deeper"});
  expect_bad(image(R"({"a":{"dtype":"F32","shape":[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]],"data_offsets":[0,4]}})", 4),
             {"nested deeper"});
  fs::remove_all(d);
}

}  // namespace
}  // namespace ds
