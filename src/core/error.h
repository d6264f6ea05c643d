// Errors: one exception type for everything the user can cause (bad files, bad requests, bad
// flags). Messages name the file / tensor / field involved. Internal invariants use DS_ASSERT.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace ds {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// Builds a message from any streamable parts: throw_error("tensor ", name, " has shape ", s).
template <typename... Args>
[[noreturn]] void throw_error(Args&&... args);

}  // namespace ds

#include <sstream>

namespace ds {
template <typename... Args>
[[noreturn]] void throw_error(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  throw Error(os.str());
}
}  // namespace ds

#define DS_CHECK(cond, ...)                                 \
  do {                                                      \
    if (!(cond)) ::ds::throw_error(__VA_ARGS__);            \
  } while (0)

#define DS_ASSERT(cond)                                                                       \
  do {                                                                                        \
    if (!(cond)) ::ds::throw_error("internal error: ", #cond, " at ", __FILE__, ":", __LINE__); \
  } while (0)
