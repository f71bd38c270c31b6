// fragless: growable segments with page-granular (2 MiB) pages whose physical memory comes from a
// device-wide page pool.
//
// Note [Re-backing instead of growing]
// Classic caching fragments because freed memory sits in holes of the wrong shape; expandable segments
// fix the address-space side but still hold every page of every hole until empty_cache. Here a page's
// physical memory is not tied to its address: before new physical memory is created, whole free pages
// are unmapped from holes (any stream of the default pool, once the stream's queued work is done) and
// mapped where the request needs them. Physical memory is created in chunks (one handle, several pages,
// each page mapped on its own so that it can be unmapped on its own) to amortise cuMemCreate, with the
// chunk bounded by a small fraction of what is already reserved so idle pages cost little. Private pools
// (graph capture) are never reclaimed from: their addresses are baked into graphs.
//
// In a steady state (the same step again) every request hits the cache, so no driver call and no
// synchronisation happen at all; the driver is only touched when the working set changes shape.
#include <algorithm>
#include <set>
#include <unordered_map>

#include "policy_growable.h"
#include "trace_emit.h"

namespace fragless {
namespace {

class FraglessPolicy final : public GrowablePolicy {
 public:
  using GrowablePolicy::GrowablePolicy;
  PolicyKind kind() const override { return PolicyKind::fragless; }
  std::size_t idle_bytes() const override { return idle_.size() * page_; }

  std::string check() const override {
    std::size_t chunk_bytes = 0, in_use = 0;
    for (auto& [h, c] : chunks_) {
      chunk_bytes += c.pages * page_;
      in_use += c.in_use;
    }
    if (in_use + idle_.size() != chunk_bytes / page_) return "fragless page pool: pages in use + idle != created";
    return {};
  }

 protected:
  std::size_t page_size(bool) const override { return page_; }

  Status map_pages(Segment& seg, std::size_t first, std::size_t n) override {
    if (idle_.size() < n && s_.total_reserved + (n - idle_.size()) * page_ > budget(n)) {
      auto cands = reclaim_candidates();
      std::size_t reclaimable = 0;
      for (const auto& c : cands) reclaimable += c.hi - c.lo;
      // Touch nothing when even everything together cannot succeed: the retry chain takes over.
      if (idle_.size() + reclaimable + creatable_pages() < n) return Status::out_of_memory;
      reclaim(std::move(cands), n - idle_.size());
    }
    if (idle_.size() < n) {
      if (Status st = create_pages(n - idle_.size()); st != Status::ok) return st;
    }
    Driver& d = *s_.driver;
    std::size_t done = 0;
    Status st = Status::ok;
    for (; done < n; ++done) {
      const PageRef r = idle_.back();
      if ((st = d.map(seg.base + (first + done) * page_, page_, r.handle, r.offset)) != Status::ok) break;
      idle_.pop_back();
      seg.pages[first + done] = r;
      ++chunks_[r.handle].in_use;
    }
    if (st == Status::ok) st = d.set_access(seg.base + first * page_, n * page_);
    if (st != Status::ok) {
      if (done) s_.give_back_mapping(seg.base + first * page_, done * page_);
      give_back(seg, first, done);
      return st;
    }
    if (seg.small) move_reserved(true, n * page_);
    return Status::ok;
  }

  std::size_t unmap_pages(Segment& seg, std::size_t first, std::size_t n) override {
    if (s_.driver->unmap(seg.base + first * page_, n * page_) != Status::ok) return 0;
    give_back(seg, first, n);
    if (seg.small) move_reserved(false, n * page_);
    return n;
  }

  // After a release (empty_cache, OOM retry): give back every chunk none of whose pages is mapped.
  void after_release() override {
    std::vector<PageRef> keep;
    std::unordered_map<PhysHandle, std::size_t> idle_count;
    for (const PageRef& r : idle_) ++idle_count[r.handle];
    for (const PageRef& r : idle_) {
      auto it = chunks_.find(r.handle);
      if (it->second.in_use == 0 && idle_count[r.handle] == it->second.pages) continue;  // released below
      keep.push_back(r);
    }
    for (auto it = chunks_.begin(); it != chunks_.end();) {
      if (it->second.in_use != 0) { ++it; continue; }
      s_.give_back_handle(it->first);
      const std::size_t bytes = it->second.pages * page_;
      s_.add_reserved(false, -static_cast<std::int64_t>(bytes));
      emit(s_, TraceAction::phys_release, 0, 0, bytes, bytes);
      it = chunks_.erase(it);
    }
    idle_ = std::move(keep);
  }

 private:
  struct Chunk { std::size_t pages = 0, in_use = 0; };

  void give_back(Segment& seg, std::size_t first, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      PageRef& r = seg.pages[first + i];
      --chunks_[r.handle].in_use;
      idle_.push_back(r);
      r = PageRef{};
    }
  }

  // Reserved is reported per pool as mapped bytes; idle pages count as large-pool reserve.
  void move_reserved(bool to_small, std::size_t bytes) {
    const auto b = static_cast<std::int64_t>(bytes);
    auto& st = s_.stats.reserved_bytes;
    st.by_pool[kSmallPool].add(to_small ? b : -b);
    st.by_pool[kLargePool].add(to_small ? -b : b);
  }

  // Creates physical memory for at least `missing` pages; the chunk grows with what is reserved already
  // (1/128 of it, at most 64 MiB) so cuMemCreate calls stay few while idle memory stays small.
  Status create_pages(std::size_t missing) {
    const std::size_t growth = std::clamp<std::size_t>(s_.total_reserved / 128 / page_, 1, (64u << 20) / page_);
    std::size_t pages = std::max(missing, growth);
    const std::size_t room = budget(missing) > s_.total_reserved ? (budget(missing) - s_.total_reserved) / page_ : 0;
    pages = std::max(missing, std::min(pages, room));
    if (!s_.capacity_allows(pages * page_)) pages = missing;
    if (!s_.capacity_allows(pages * page_)) return Status::out_of_memory;
    PhysHandle h = 0;
    Status st = s_.driver->create(pages * page_, &h);
    if (st == Status::out_of_memory && pages > missing) {
      pages = missing;
      st = s_.driver->create(pages * page_, &h);
    }
    if (st == Status::out_of_memory && missing > 1) return create_page_by_page(missing);
    if (st != Status::ok) return st;
    add_chunk(h, pages);
    return Status::ok;
  }

  // Last resort when one contiguous handle cannot be had: one page per handle.
  // All or nothing: on failure the pages created here are released again.
  Status create_page_by_page(std::size_t missing) {
    std::vector<PhysHandle> made;
    for (std::size_t i = 0; i < missing; ++i) {
      PhysHandle h = 0;
      if (Status st = s_.driver->create(page_, &h); st != Status::ok) {
        for (PhysHandle m : made) s_.give_back_handle(m);
        return st;
      }
      made.push_back(h);
    }
    for (PhysHandle h : made) add_chunk(h, 1);
    return Status::ok;
  }

  void add_chunk(PhysHandle h, std::size_t pages) {
    chunks_[h] = Chunk{pages, 0};
    for (std::size_t i = pages; i-- > 0;) idle_.push_back(PageRef{h, i * page_});
    s_.add_reserved(false, static_cast<std::int64_t>(pages * page_));
    emit(s_, TraceAction::phys_create, 0, 0, pages * page_, pages * page_);
  }

  struct Candidate { Block* b; std::size_t lo, hi; };

  // Note [Reserve budget]
  // Re-backing costs driver calls and a stream synchronisation; creating memory raises reserved. We create
  // freely while reserved stays within kSlack of the highest live footprint seen (counting the request),
  // and re-back from holes only beyond that. Peak reserved therefore stays within about kSlack of peak
  // live (plus partial pages at hole edges), while a workload that grows steadily never pays for reclaim.
  static constexpr std::size_t kSlackDivisor = 64;  // 1/64 = 1.6%
  std::size_t budget(std::size_t pages_needed) const {
    const auto live = static_cast<std::size_t>(std::max<std::int64_t>(
        s_.stats.live_bytes.peak, s_.stats.live_bytes.current + static_cast<std::int64_t>(pages_needed * page_)));
    return live + live / kSlackDivisor;
  }

  // Whole free pages in holes of the default pool, outside the run being grown.
  std::vector<Candidate> reclaim_candidates() {
    std::vector<Candidate> cands;
    for (BlockPool* bp : {&s_.default_pools.large, &s_.default_pools.small})
      for (Block* b : bp->blocks) {
        std::size_t lo, hi;
        if (!b->segment->growable || !whole_pages(b, &lo, &hi)) continue;
        if (b->ptr < run_hi_ && b->ptr + b->size > run_lo_) continue;
        cands.push_back({b, lo, hi});
      }
    return cands;
  }

  // Pages that could still be created within the device's free memory and the memory fraction.
  std::size_t creatable_pages() {
    std::size_t free_b = 0, total_b = 0;
    s_.driver->memory_info(&free_b, &total_b);
    if (s_.allowed_memory_maximum)
      free_b = std::min(free_b, s_.allowed_memory_maximum > s_.total_reserved
                                    ? s_.allowed_memory_maximum - s_.total_reserved : 0);
    return free_b / page_;
  }

  // Unmaps up to `want` whole free pages from the candidates, largest holes first, so their physical
  // memory can back the request instead of new memory.
  void reclaim(std::vector<Candidate> cands, std::size_t want) {
    if (cands.empty()) return;
    std::sort(cands.begin(), cands.end(),
              [](const Candidate& a, const Candidate& b) { return a.hi - a.lo > b.hi - b.lo; });
    std::size_t got = 0, n = 0;
    std::set<Stream> streams;
    for (; n < cands.size() && got < want; ++n) {
      got += cands[n].hi - cands[n].lo;
      streams.insert(cands[n].b->stream);
    }
    // Unmapping is not stream-ordered: the holes' streams must have finished their queued work.
    for (Stream st : streams) s_.forced_sync(st);
    std::size_t left = want;
    for (std::size_t i = 0; i < n && left > 0; ++i) {
      auto& c = cands[i];
      const std::size_t take = std::min(left, c.hi - c.lo);
      // Take the top pages of the hole: the low part stays mapped next to its allocated neighbour.
      if (unmap_block_pages(c.b, c.hi - take, c.hi)) left -= take;
    }
  }

  std::size_t page_ = s_.driver->granularity();
  std::unordered_map<PhysHandle, Chunk> chunks_;
  std::vector<PageRef> idle_;
};

}  // namespace

std::unique_ptr<Policy> make_fragless_policy(DeviceEngine::State& s) { return std::make_unique<FraglessPolicy>(s); }

}  // namespace fragless
