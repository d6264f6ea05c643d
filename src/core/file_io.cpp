// See file_io.h.
#include "core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace ds {

std::string read_regular_file(const std::string& path, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; the type is then
  // checked on the descriptor itself (no window between a stat and the open).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw_error(path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw_error(path, ": cannot stat: ", std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw_error(path, S_ISDIR(st.st_mode) ? ": is a directory, not a file" : ": not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    ::close(fd);
    throw_error(path, ": ", size, " bytes, more than the ", max_bytes, "-byte limit for this file");
  }
  std::string out(size, '\0');
  uint64_t got = 0;
  while (got < size) {
    const ssize_t n = ::read(fd, out.data() + got, size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      throw_error(path, ": read error: ", std::strerror(e));
    }
    if (n == 0) break;  // shrank while read: keep what is there
    got += static_cast<uint64_t>(n);
  }
  ::close(fd);
  out.resize(got);
  return out;
}

bool json_nested_deeper_than(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

void check_json_depth(std::string_view text, int max_depth, const std::string& where) {
  if (json_nested_deeper_than(text, max_depth))
    throw_error(where, ": JSON nested deeper than ", max_depth, " levels");
}

}  // namespace ds
