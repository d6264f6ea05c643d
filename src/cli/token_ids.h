// Token-id lists on the command line: "1,2,3" / "1 2 3" / "[1, 2, 3]", or the path of a file
// holding such a list (a JSON array or whitespace / comma separated ids). Used by generate and
// score.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ds::cli {

// Parses `text` (a list, or a file when a file of that name exists). `what` names the flag in
// errors. Throws ds::Error naming the offending item (and the file).
std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& what);

// Checks every id is in [0, vocab); the error names the position and the id.
void check_token_ids(const std::vector<int32_t>& ids, int vocab, const std::string& what);

}  // namespace ds::cli
