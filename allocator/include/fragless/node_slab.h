// Note [Node slabs]: node containers on the allocation path take their nodes from a slab of their own
// instead of operator new: the free-block sets of a BlockPool (std::set<Block*>), and the handle table and
// the splitter's multi-page mappings of the fragless policy. Every free, split and merge inserts or erases
// a free-block node, so with the default allocator a cache-hit pair called malloc and free once or twice
// under the device lock; every handle the fragless policy creates or releases, a node of the others. A slab
// hands nodes out of 64-node chunks and keeps the ones given back on a free list; it gives memory back only
// when its owner goes (a BlockPool goes with its engine or its private pool). Bound: a container's nodes
// never outnumber the most elements it has held at once; for the free sets, the most blocks the pool had
// free at once (a block is in at most one set), the same bound the engine's block slabs have. Whatever
// guards the container guards its slab (the device lock for the engine's); a slab is never shared between
// two containers that different locks guard. A request of another size than the slab's first (several nodes
// at once, a bucket array) goes to operator new.
#pragma once
#include <cstddef>
#include <memory>
#include <new>
#include <vector>

namespace fragless {

class NodeSlab {
 public:
  NodeSlab() = default;
  NodeSlab(const NodeSlab&) = delete;
  NodeSlab& operator=(const NodeSlab&) = delete;

  // The slab serves nodes of one size, fixed by its first request.
  void* take(std::size_t size) {
    if (size_ == 0 && size >= sizeof(Free)) size_ = size;
    if (size != size_) return ::operator new(size);
    if (!free_) grow();
    Free* f = free_;
    free_ = f->next;
    return f;
  }
  void give(void* p, std::size_t size) noexcept {
    if (size != size_) return ::operator delete(p);
    auto* f = static_cast<Free*>(p);
    f->next = free_;
    free_ = f;
  }

 private:
  struct Free {
    Free* next;
  };
  static constexpr std::size_t kChunk = 64;
  void grow() {
    const std::size_t stride = (size_ + alignof(std::max_align_t) - 1) / alignof(std::max_align_t) *
                               alignof(std::max_align_t);
    chunks_.push_back(std::make_unique<std::max_align_t[]>(stride * kChunk / sizeof(std::max_align_t)));
    auto* base = reinterpret_cast<unsigned char*>(chunks_.back().get());
    for (std::size_t i = kChunk; i-- > 0;) give(base + i * stride, size_);
  }
  std::size_t size_ = 0;
  Free* free_ = nullptr;
  std::vector<std::unique_ptr<std::max_align_t[]>> chunks_;
};

// An allocator for node containers that takes single nodes from a NodeSlab. Copies (and rebinds) share the
// slab; the slab must outlive every container using it.
template <class T>
class SlabAllocator {
 public:
  using value_type = T;
  explicit SlabAllocator(NodeSlab* slab) noexcept : slab_(slab) {}
  template <class U>
  SlabAllocator(const SlabAllocator<U>& o) noexcept : slab_(o.slab()) {}

  T* allocate(std::size_t n) {
    if (n == 1) return static_cast<T*>(slab_->take(sizeof(T)));
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (n == 1) return slab_->give(p, sizeof(T));
    ::operator delete(p);
  }
  NodeSlab* slab() const noexcept { return slab_; }
  template <class U>
  bool operator==(const SlabAllocator<U>& o) const noexcept { return slab_ == o.slab(); }

 private:
  NodeSlab* slab_;
};

}  // namespace fragless
