// classic: PyTorch's native (non-expandable) behaviour. Each segment is one cudaMalloc-sized physical
// allocation (reserve + create + map + set access), carved into blocks; blocks never cross segments;
// only whole free segments go back to the driver.
#include <set>
#include <unordered_set>
#include <vector>

#include "policy/policy.h"
#include "state/trace_emit.h"

namespace fragless {
namespace {

class ClassicPolicy final : public Policy {
 public:
  using Policy::Policy;
  PolicyKind kind() const override { return PolicyKind::classic; }

  bool should_split(const Block* b, std::size_t rounded) const override {
    const std::size_t remaining = b->size - rounded;
    if (b->pool->small) return remaining >= kMinBlockSize;
    return rounded < s_.opts.max_split_size && remaining > kSmallSize;
  }

  Block* grow(AllocParams& p) override {
    const std::size_t size = classic_segment_size(p.rounded);
    const std::size_t va_size = round_up(size, s_.driver->granularity());
    if (!s_.capacity_allows(va_size)) {
      p.status = Status::out_of_memory;
      return nullptr;
    }
    PageTable table;  // the segment's one page
    if (!table.allocate(1)) {
      p.status = Status::out_of_memory;
      return nullptr;
    }
    Driver& d = *s_.driver;
    DevicePtr va = 0;
    PhysHandle h = 0;
    Status st = d.reserve(va_size, &va);
    if (st == Status::ok) {
      st = d.create(va_size, &h);
      if (st == Status::ok) {
        st = d.map(va, va_size, h, 0);
        if (st == Status::ok) {
          st = d.set_access(va, va_size);
          if (st != Status::ok) s_.give_back_mapping(va, va_size);
        }
        if (st != Status::ok) s_.give_back_handle(h);
      }
      if (st != Status::ok) s_.give_back_reservation(va, va_size);
    }
    if (st != Status::ok) {
      p.status = st;
      return nullptr;
    }
    Block* b = s_.add_segment(p, va, va_size, va_size, BlockState::free);
    b->segment->mapped_bytes = va_size;
    table.slot(0) = PageRef{h, 0};
    b->segment->pages.swap(table);
    s_.add_reserved(p.pool->small, static_cast<std::int64_t>(va_size));
    s_.stats.segment.add(p.pool->small, 1);
    if (va_size >= s_.opts.max_split_size) s_.stats.oversize_segments.add(1);
    ++s_.stats.num_device_alloc;
    emit(s_, TraceAction::segment_alloc, p.stream, va, va_size, va_size);
    return b;
  }

  bool release_whole_segment(Block* b) override {
    Segment* seg = give_back_segment(b);
    if (seg) std::erase_if(s_.segments, [&](const auto& p) { return p.get() == seg; });
    return seg != nullptr;
  }

  void release_free(PoolSet* only, bool device_synchronized) override {
    // One synchronisation per stream for the whole release, not one per segment (none after a device-wide
    // one).
    std::vector<Block*> whole;
    for (PoolSet* ps : pool_sets(only))
      for (BlockPool* bp : {&ps->small, &ps->large})
        for (Block* b : bp->blocks)
          if (!b->is_split() && !b->segment->growable && b->reusable()) whole.push_back(b);
    for (Block* b : whole) {
      const Stream st = b->segment->stream;
      if (synced_.count(st) || failed_.count(st)) continue;
      if (device_synchronized || s_.forced_sync(st) == Status::ok) synced_.insert(st);
      else failed_.insert(st);
    }
    // The segments given back leave the list in one pass: one pass each made a release of n segments
    // (empty_cache, teardown) cost n^2 (a million live 1 MiB blocks: 26 s of a 28 s replay).
    std::unordered_set<const Segment*> gone;
    for (Block* b : whole)
      if (Segment* seg = give_back_segment(b)) gone.insert(seg);
    if (!gone.empty()) std::erase_if(s_.segments, [&](const auto& p) { return gone.count(p.get()) > 0; });
    synced_.clear();
    failed_.clear();
  }

 private:
  // Gives whole segment b's memory back to the driver and deletes b; the segment, still on the list, is
  // returned (null when b is not a whole reusable segment or its memory stays).
  Segment* give_back_segment(Block* b) {
    if (b->is_split() || b->segment->growable || !b->reusable()) return nullptr;
    Segment* seg = b->segment;
    Driver& d = *s_.driver;
    // cuMemUnmap and cuMemRelease are not stream-ordered (cudaFree, which PyTorch calls here, synchronises
    // the device): kernels queued on the segment's stream before the free may still use it. Other streams'
    // uses are behind the block's events, which have completed (the block is reusable). A failed wait
    // keeps the segment (Note [Failed waits]).
    if (failed_.count(seg->stream)) return nullptr;
    if (!synced_.count(seg->stream) && s_.forced_sync(seg->stream) != Status::ok) return nullptr;
    s_.pool_erase(b);
    // A failure here leaves the memory where it was: keep the segment cached rather than lose track of it.
    if (d.unmap(seg->base, seg->va_size) != Status::ok) {
      s_.pool_insert(b);
      return nullptr;
    }
    s_.give_back_handle(seg->pages[0].handle);
    s_.give_back_reservation(seg->base, seg->va_size);
    s_.add_reserved(seg->small, -static_cast<std::int64_t>(seg->va_size));
    s_.stats.segment.add(seg->small, -1);
    if (seg->va_size >= s_.opts.max_split_size) s_.stats.oversize_segments.add(-1);
    ++s_.stats.num_device_free;
    emit(s_, TraceAction::segment_free, seg->stream, seg->base, seg->va_size, seg->va_size);
    s_.delete_block(b);
    return seg;
  }

  std::set<Stream> synced_;  // streams synchronised for the release under way
  std::set<Stream> failed_;  // streams whose synchronisation failed in it
};

}  // namespace

std::unique_ptr<Policy> make_classic_policy(DeviceEngine::State& s) { return std::make_unique<ClassicPolicy>(s); }

}  // namespace fragless
