// Address → block for the allocated and pending blocks of an engine: an open-addressing table with linear
// probing and backward-shift deletion (no tombstones). 16 bytes a slot at a load of at most 0.7, against
// about 40 bytes an entry for std::unordered_map's nodes and buckets; one cache line per lookup.
#pragma once
#include <cstdint>
#include <memory>

#include "fragless/driver.h"

namespace fragless {

struct Block;

class BlockMap {
 public:
  Block* get(DevicePtr key) const {
    if (!slots_) return nullptr;
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return slots_[i].value;
      if (slots_[i].key == 0) return nullptr;
    }
  }
  std::size_t count(DevicePtr key) const { return get(key) ? 1 : 0; }
  std::size_t size() const { return size_; }

  void put(DevicePtr key, Block* value) {  // key != 0
    if ((size_ + 1) * 10 > capacity() * 7) grow();
    std::size_t i = home(key);
    while (slots_[i].key != 0 && slots_[i].key != key) i = (i + 1) & mask_;
    if (slots_[i].key == 0) ++size_;
    slots_[i] = {key, value};
  }

  bool erase(DevicePtr key) {
    if (!slots_) return false;
    std::size_t i = home(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == 0) return false;
      i = (i + 1) & mask_;
    }
    // Shift later members of the probe run back into the hole.
    for (std::size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
      const std::size_t h = home(slots_[j].key);
      // Move j to i if its home is not in the cyclic range (i, j].
      if (((j - h) & mask_) >= ((j - i) & mask_)) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = {};
    --size_;
    return true;
  }

  void clear() {
    slots_.reset();
    mask_ = 0;
    size_ = 0;
  }

  template <typename F>
  void for_each(F f) const {
    for (std::size_t i = 0; slots_ && i <= mask_; ++i)
      if (slots_[i].key) f(slots_[i].key, slots_[i].value);
  }

 private:
  struct Slot {
    DevicePtr key = 0;
    Block* value = nullptr;
  };
  std::size_t capacity() const { return slots_ ? mask_ + 1 : 0; }
  std::size_t home(DevicePtr key) const {
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & mask_;
  }
  void grow() {
    const std::size_t old_cap = capacity();
    const std::size_t cap = old_cap ? old_cap * 2 : 64;
    std::unique_ptr<Slot[]> old = std::move(slots_);
    slots_.reset(new Slot[cap]);
    mask_ = cap - 1;
    size_ = 0;
    for (std::size_t i = 0; old && i < old_cap; ++i)
      if (old[i].key) put(old[i].key, old[i].value);
  }

  std::unique_ptr<Slot[]> slots_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

}  // namespace fragless
