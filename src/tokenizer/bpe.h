// Byte-level BPE model: turns one pre-tokenized piece (raw bytes) into token ids by applying the
// merges in rank order, exactly like HF tokenizers' `Word::merge_all`: a min-heap of candidate
// adjacent pairs keyed by (rank, position) over a doubly linked list of symbols, so a piece of n
// bytes costs O(n log n) (a 1 MB piece without spaces is fine). Results for short pieces are
// memoised in a bounded, thread-safe cache (one cache line per lookup).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace ds {

class BpeModel {
 public:
  BpeModel();
  ~BpeModel();

  // Vocabulary entry: the token's raw bytes (after undoing the byte-level mapping).
  void add_token(std::string bytes, int32_t id);
  // Next merge in rank order: tokens a + b -> merged. A later duplicate of the same pair
  // overrides the earlier one (as in HF, whose merge map is built by collecting into a HashMap).
  void add_merge(int32_t a, int32_t b, int32_t merged);
  void set_unk(std::optional<int32_t> unk_id, bool fuse_unk) {
    unk_id_ = unk_id;
    fuse_unk_ = fuse_unk;
  }
  // HF `ignore_merges`: a piece that is itself a vocabulary token maps to it directly. Must be
  // set before the tokens are added.
  void set_ignore_merges(bool v) { ignore_merges_ = v; }

  size_t merge_count() const { return n_merges_; }

  // Appends the ids of one piece to out.
  void encode_piece(std::string_view bytes, std::vector<int32_t>& out) const;

 private:
  struct MergeSlot {
    uint64_t key;  // (a << 32) | b, kEmpty when free
    int32_t rank;
    int32_t merged;
  };
  static constexpr uint64_t kEmpty = ~0ull;

  const MergeSlot* find_merge(int32_t a, int32_t b) const;
  void grow_merges();
  void merge_uncached(std::string_view bytes, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;  // raw bytes -> id (ignore_merges only)
  int32_t byte_ids_[256];                           // id of each single byte, -1 if absent
  std::vector<MergeSlot> merges_;                   // open addressing, power-of-two size
  size_t n_merges_ = 0;
  int32_t next_rank_ = 0;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;

  // Memo of piece -> ids: a direct-mapped table of cache-line slots (short pieces only), each
  // guarded by one of kStripes spin locks. A colliding piece simply evicts the old one.
  static constexpr size_t kKeyMax = 22, kIdsMax = 8;
  struct alignas(64) CacheSlot {
    uint64_t hash;  // 0: empty
    uint8_t key_len;
    uint8_t n_ids;
    char key[kKeyMax];
    int32_t ids[kIdsMax];
  };
  static constexpr size_t kCacheSlots = size_t{1} << 17;  // 8 MiB
  static constexpr size_t kStripes = 1024;
  std::unique_ptr<CacheSlot[]> cache_;
  std::unique_ptr<std::atomic<bool>[]> locks_;
};

}  // namespace ds
