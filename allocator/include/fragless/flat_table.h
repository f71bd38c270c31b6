// Note [Flat tables]
// A hash table from 64-bit keys to small values in one array: open addressing, linear probing, a
// power-of-two capacity at most half full, and an erase that moves the entries after it back into the gap
// (no tombstones, so a table that churns does not slow down). A lookup reads one or two cache lines where
// std::unordered_map follows a bucket, the node before and the node; nothing is allocated but the array
// when it doubles. Used where a table sits on the replay's per-call path: the driver contract's
// (driver.h, Note [The contract's tables]), the replay's own, from trace addresses to blocks, and the
// fragless policy's handle tables, read on every growth's map. Every key is allowed (a slot says whether it is used; no key
// value is reserved). An insert or an erase moves entries: pointers from find() last until the next one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fragless {

template <class V>
class FlatTable {
 public:
  std::size_t size() const { return size_; }
  std::size_t capacity() const { return slots_.size(); }  // what for_each walks: it never shrinks
  bool empty() const { return size_ == 0; }

  V* find(std::uint64_t key) {
    if (size_ == 0) return nullptr;
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (!s.used) return nullptr;
      if (s.key == key) return &s.value;
    }
  }
  const V* find(std::uint64_t key) const { return const_cast<FlatTable*>(this)->find(key); }

  // The value under key, a value-initialised one inserted first when there is none.
  V& operator[](std::uint64_t key) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    std::size_t i = home(key);
    for (; slots_[i].used; i = (i + 1) & mask_)
      if (slots_[i].key == key) return slots_[i].value;
    slots_[i] = Slot{key, V{}, true};
    ++size_;
    return slots_[i].value;
  }

  // False when key was not there.
  bool erase(std::uint64_t key) {
    if (size_ == 0) return false;
    std::size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      if (!slots_[i].used) return false;
      if (slots_[i].key == key) break;
    }
    // Backward shift: each entry after the gap whose probe path crosses it moves into it.
    for (std::size_t j = (i + 1) & mask_; slots_[j].used; j = (j + 1) & mask_) {
      const std::size_t from_home = (j - home(slots_[j].key)) & mask_;
      if (from_home >= ((j - i) & mask_)) {
        slots_[i] = std::move(slots_[j]);
        i = j;
      }
    }
    slots_[i].used = false;
    --size_;
    return true;
  }

  // f(key, value) for every entry, in no particular order.
  template <class F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.used) f(s.key, s.value);
  }

 private:
  struct Slot {
    std::uint64_t key = 0;
    V value{};
    bool used = false;
  };
  // Fibonacci hashing: the top bits of key × 2^64/φ, which spreads keys that differ only in their high
  // bits (addresses aligned to 2 MiB) as well as consecutive ones (handle ids).
  static std::size_t home(std::uint64_t key, unsigned shift) {
    return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> shift);
  }
  std::size_t home(std::uint64_t key) const { return home(key, shift_); }
  // The new array is made before anything changes: a bad_alloc leaves the table as it was.
  void grow() {
    const std::size_t capacity = slots_.empty() ? 16 : 2 * slots_.size();
    std::vector<Slot> fresh(capacity);
    const std::size_t mask = capacity - 1;
    unsigned shift = 64;
    for (std::size_t c = capacity; c > 1; c >>= 1) --shift;
    for (Slot& s : slots_) {  // the keys are distinct: each goes to the first free slot from its home
      if (!s.used) continue;
      std::size_t i = home(s.key, shift);
      while (fresh[i].used) i = (i + 1) & mask;
      fresh[i] = std::move(s);
    }
    slots_.swap(fresh);
    mask_ = mask;
    shift_ = shift;
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0, mask_ = 0;
  unsigned shift_ = 64;
};

}  // namespace fragless
