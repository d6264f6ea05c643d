// BPE merging by rank with a heap over adjacent pairs (see bpe.h), plus the merge table (open
// addressing on the packed id pair) and the piece cache.
#include "tokenizer/bpe.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace ds {
namespace {

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

inline size_t hash_key(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return static_cast<size_t>(k);
}

struct Symbol {
  int32_t id;
  int32_t prev;  // index of the previous live symbol, -1 at the start
  int32_t next;  // index of the next live symbol, -1 at the end
  int32_t len;   // bytes covered; 0 once merged into its left neighbour
};

struct Candidate {
  int32_t rank;
  int32_t pos;  // index of the left symbol
  int32_t merged;
  int32_t left, right;  // the pair's ids when pushed
};

// Heap order: the lowest rank first, then the leftmost position (HF's Merge ordering).
inline bool later(const Candidate& x, const Candidate& y) {
  return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
}

}  // namespace

BpeModel::BpeModel()
    : cache_(new CacheSlot[kCacheSlots]()), locks_(new std::atomic<bool>[kStripes]) {
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  merges_.assign(1024, MergeSlot{kEmpty, 0, 0});
  for (size_t i = 0; i < kStripes; ++i) locks_[i].store(false, std::memory_order_relaxed);
}

BpeModel::~BpeModel() = default;

void BpeModel::add_token(std::string bytes, int32_t id) {
  if (bytes.size() == 1) byte_ids_[static_cast<uint8_t>(bytes[0])] = id;
  if (ignore_merges_) vocab_[std::move(bytes)] = id;  // only ignore_merges looks pieces up whole
}

void BpeModel::grow_merges() {
  std::vector<MergeSlot> old = std::move(merges_);
  merges_.assign(old.size() * 2, MergeSlot{kEmpty, 0, 0});
  const size_t mask = merges_.size() - 1;
  for (const MergeSlot& s : old) {
    if (s.key == kEmpty) continue;
    size_t h = hash_key(s.key) & mask;
    while (merges_[h].key != kEmpty) h = (h + 1) & mask;
    merges_[h] = s;
  }
}

void BpeModel::add_merge(int32_t a, int32_t b, int32_t merged) {
  if ((n_merges_ + 1) * 2 > merges_.size()) grow_merges();
  const uint64_t key = pair_key(a, b);
  const size_t mask = merges_.size() - 1;
  size_t h = hash_key(key) & mask;
  while (merges_[h].key != kEmpty && merges_[h].key != key) h = (h + 1) & mask;
  if (merges_[h].key == kEmpty) ++n_merges_;
  merges_[h] = MergeSlot{key, next_rank_++, merged};
}

const BpeModel::MergeSlot* BpeModel::find_merge(int32_t a, int32_t b) const {
  const uint64_t key = pair_key(a, b);
  const size_t mask = merges_.size() - 1;
  size_t h = hash_key(key) & mask;
  while (true) {
    const MergeSlot& s = merges_[h];
    if (s.key == key) return &s;
    if (s.key == kEmpty) return nullptr;
    h = (h + 1) & mask;
  }
}

void BpeModel::merge_uncached(std::string_view bytes, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    auto it = vocab_.find(std::string(bytes));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // Initial symbols: one per byte (a byte-level character is one byte). Bytes missing from the
  // vocabulary become the unknown token (fused when fuse_unk) or, without one, are dropped.
  // Scratch buffers reused across calls on this thread (no allocation per piece).
  thread_local std::vector<Symbol> sym;
  thread_local std::vector<Candidate> heap;
  sym.clear();
  heap.clear();
  // They grow to the longest piece seen and would keep that: one 6 MB word (inside the server's
  // body limit) left ~200 MB on its HTTP thread, and every thread can meet one. Past 64K bytes a
  // piece's buffers are freed on the way out.
  struct FreeLarge {
    ~FreeLarge() {
      if (sym.capacity() > (size_t{1} << 16)) std::vector<Symbol>().swap(sym);
      if (heap.capacity() > (size_t{1} << 16)) std::vector<Candidate>().swap(heap);
    }
  } free_large;
  bool pending_unk = false;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(bytes[i])];
    if (id >= 0) {
      pending_unk = false;
      sym.push_back({id, 0, 0, 1});
    } else if (unk_id_) {
      if (pending_unk && fuse_unk_) {
        sym.back().len += 1;
      } else {
        sym.push_back({*unk_id_, 0, 0, 1});
      }
      pending_unk = true;
    }
  }
  const auto n = static_cast<int32_t>(sym.size());
  for (int32_t i = 0; i < n; ++i) {
    sym[i].prev = i - 1;
    sym[i].next = i + 1 < n ? i + 1 : -1;
  }

  for (int32_t i = 0; i + 1 < n; ++i) {
    if (const MergeSlot* m = find_merge(sym[i].id, sym[i + 1].id)) {
      heap.push_back({m->rank, i, m->merged, sym[i].id, sym[i + 1].id});
    }
  }
  std::make_heap(heap.begin(), heap.end(), later);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next < 0) continue;
    Symbol& right = sym[cur.next];
    // Skip stale entries: the pair at this position changed since the candidate was pushed.
    // (HF re-looks the pair up and compares the merged id; symbols only ever grow, so a changed
    // pair always spells a different string, hence a different merged id: the same test.)
    if (cur.id != top.left || right.id != top.right) continue;
    cur.id = top.merged;
    cur.len += right.len;
    right.len = 0;
    cur.next = right.next;
    if (cur.next >= 0) sym[cur.next].prev = top.pos;
    if (cur.prev >= 0) {
      if (const MergeSlot* p = find_merge(sym[cur.prev].id, cur.id)) {
        heap.push_back({p->rank, cur.prev, p->merged, sym[cur.prev].id, cur.id});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
    if (cur.next >= 0) {
      if (const MergeSlot* q = find_merge(cur.id, sym[cur.next].id)) {
        heap.push_back({q->rank, top.pos, q->merged, cur.id, sym[cur.next].id});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
  }
  for (const Symbol& s : sym) {
    if (s.len != 0) out.push_back(s.id);
  }
}

namespace {

// 64-bit hash of a short byte string (8 bytes at a time, multiply-xorshift mixing).
inline uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 29;
  return h ? h : 1;
}

class SpinGuard {
 public:
  explicit SpinGuard(std::atomic<bool>& f) : f_(f) {
    while (f_.exchange(true, std::memory_order_acquire)) {
      while (f_.load(std::memory_order_relaxed)) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
  }
  ~SpinGuard() { f_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool>& f_;
};

}  // namespace

void BpeModel::encode_piece(std::string_view bytes, std::vector<int32_t>& out) const {
  if (bytes.size() == 1) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(bytes[0])];
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  if (bytes.size() > kKeyMax) {
    merge_uncached(bytes, out);
    return;
  }
  const uint64_t h = hash_bytes(bytes);
  const size_t slot_index = h & (kCacheSlots - 1);
  CacheSlot& slot = cache_[slot_index];
  std::atomic<bool>& lock = locks_[slot_index & (kStripes - 1)];
  {
    SpinGuard guard(lock);
    if (slot.hash == h && slot.key_len == bytes.size() &&
        std::memcmp(slot.key, bytes.data(), bytes.size()) == 0) {
      out.insert(out.end(), slot.ids, slot.ids + slot.n_ids);
      return;
    }
  }
  const size_t first = out.size();
  merge_uncached(bytes, out);
  const size_t n = out.size() - first;
  if (n > kIdsMax) return;
  SpinGuard guard(lock);
  slot.hash = h;
  slot.key_len = static_cast<uint8_t>(bytes.size());
  slot.n_ids = static_cast<uint8_t>(n);
  std::memcpy(slot.key, bytes.data(), bytes.size());
  std::memcpy(slot.ids, out.data() + first, n * sizeof(int32_t));
}

}  // namespace ds
