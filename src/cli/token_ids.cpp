// Token-id list parsing (see token_ids.h).
#include "cli/token_ids.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace ds::cli {

namespace {
std::vector<int32_t> parse_list(const std::string& s, const std::string& where) {
  std::vector<int32_t> ids;
  size_t i = 0;
  const size_t n = s.size();
  auto is_sep = [](char c) {
    return std::isspace(static_cast<unsigned char>(c)) || c == ',' || c == '[' || c == ']';
  };
  while (i < n) {
    while (i < n && is_sep(s[i])) ++i;
    if (i >= n) break;
    size_t j = i;
    while (j < n && !is_sep(s[j])) ++j;
    const std::string item = s.substr(i, j - i);
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (end != item.c_str() + item.size() || errno == ERANGE || v < 0 || v > INT32_MAX) {
      throw_error(where, ": '", item, "' (item ", ids.size() + 1,
                  ") is not a token id (a non-negative integer)");
    }
    ids.push_back(static_cast<int32_t>(v));
    i = j;
  }
  return ids;
}
}  // namespace

std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& what) {
  std::error_code ec;
  std::vector<int32_t> ids;
  if (!text.empty() && std::filesystem::is_regular_file(text, ec)) {
    std::ifstream f(text);
    DS_CHECK(f, what, ": cannot read ", text);
    std::stringstream ss;
    ss << f.rdbuf();
    ids = parse_list(ss.str(), what + " file " + text);
    DS_CHECK(!ids.empty(), what, " file ", text, ": no token ids in it");
  } else {
    ids = parse_list(text, what);
    DS_CHECK(!ids.empty(), what, ": no token ids given (expected e.g. 1,2,3 or a file of ids)");
  }
  return ids;
}

void check_token_ids(const std::vector<int32_t>& ids, int vocab, const std::string& what) {
  for (size_t i = 0; i < ids.size(); ++i) {
    DS_CHECK(ids[i] >= 0 && ids[i] < vocab, what, ": token id ", ids[i], " at position ", i,
             " is outside the model's vocabulary [0, ", vocab, ")");
  }
}

}  // namespace ds::cli
