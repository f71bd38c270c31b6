// fragless: growable segments with page-granular (2 MiB) pages whose physical memory comes from a
// device-wide page pool.
//
// Note [Re-backing instead of growing]
// Classic caching fragments because freed memory sits in holes of the wrong shape; expandable segments
// fix the address-space side but still hold every page of every hole until empty_cache. Here a page's
// physical memory is not tied to its address: before new physical memory is created beyond a small
// budget (Note [Reserve budget]), whole free pages are taken from holes of the default pool and mapped
// where the request needs them. Physical memory is created in chunks (one handle, several pages, each page
// mapped on its own so that it can be unmapped on its own) to amortise cuMemCreate. Private pools (graph
// capture) are never reclaimed from: their addresses are baked into graphs.
//
// Note [Lending pages without a sync]
// cuMemUnmap is not stream-ordered, so unmapping a hole while its stream may still run work that used it
// needs a synchronisation first (PyTorch synchronises before every unmap). But a hole on the requesting
// stream need not be unmapped first: its pages are mapped at the new address while the old mapping stays
// (one handle may be mapped at several addresses). The new block's work is queued on the same stream after
// everything that used the hole, so stream order makes the sharing safe. An event recorded on the stream
// at that moment tells when the old mapping may go; it is unmapped once the event has completed (polled on
// later slow paths), or, if its address range is needed again before that, after waiting for the event,
// which counts as a forced synchronisation. Holes on other streams are still unmapped after synchronising
// their streams. Until its old mapping is gone a lent range is `unmapped` to the engine and no other
// request maps it.
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
  bool small_from_large_remnants() const override { return s_.opts.small_in_remnants; }

  std::string check() const override {
    std::size_t chunk_bytes = 0, in_use = 0;
    for (auto& [h, c] : chunks_) {
      chunk_bytes += c.pages * page_;
      in_use += c.in_use;
    }
    if (in_use + idle_.size() != chunk_bytes / page_) return "fragless page pool: pages in use + idle != created";
    if (!fresh_.empty()) return "fragless page pool: pages lent to a request were left over";
    for (const Pending& p : pending_) {
      const DevicePtr lo = p.seg->base + p.first * page_, hi = lo + p.n * page_;
      if (p.first + p.n > p.seg->pages.size()) return "fragless: a lent range lies outside its segment";
      for (std::size_t i = p.first; i < p.first + p.n; ++i)
        if (p.seg->pages[i].handle) return "fragless: a lent range was mapped again before its old mapping went";
      // The engine sees the range as unmapped: it must lie inside unmapped blocks.
      for (Block* b = p.seg->first; b; b = b->next)
        if (b->ptr < hi && b->ptr + b->size > lo && b->state != BlockState::unmapped)
          return "fragless: a lent range overlaps a block that is not unmapped";
    }
    return {};
  }

 protected:
  std::size_t page_size(bool) const override { return page_; }

  Status map_pages(Segment& seg, std::size_t first, std::size_t n) override {
    poll_pending();
    finish_pending(&seg, first, n);  // the range may still be mapped to pages lent out without a sync
    fresh_.clear();
    if (idle_.size() < n && s_.total_reserved + (n - idle_.size()) * page_ > budget(n)) {
      auto cands = reclaim_candidates();
      std::size_t reclaimable = 0;
      for (const auto& c : cands) reclaimable += c.hi - c.lo;
      // Touch nothing when even everything together cannot succeed: the retry chain takes over.
      if (idle_.size() + reclaimable + creatable_pages() < n) return Status::out_of_memory;
      reclaim(std::move(cands), n - idle_.size(), seg.stream);
    }
    if (idle_.size() + fresh_.size() < n) {
      if (Status st = create_pages(n - idle_.size() - fresh_.size()); st != Status::ok) {
        return_fresh();
        return st;
      }
    }
    Driver& d = *s_.driver;
    std::size_t done = 0;
    Status st = Status::ok;
    for (; done < n; ++done) {
      // Pages taken from this stream's holes without a sync go first: only this stream may use them yet.
      std::vector<PageRef>& from = fresh_.empty() ? idle_ : fresh_;
      const PageRef r = from.back();
      if ((st = d.map(seg.base + (first + done) * page_, page_, r.handle, r.offset)) != Status::ok) break;
      from.pop_back();
      seg.pages[first + done] = r;
      ++chunks_[r.handle].in_use;
    }
    if (st == Status::ok) st = d.set_access(seg.base + first * page_, n * page_);
    if (st != Status::ok) {
      if (done) s_.give_back_mapping(seg.base + first * page_, done * page_);
      give_back(seg, first, done, idle_);
      return_fresh();
      return st;
    }
    if (seg.small) move_reserved(true, n * page_);
    return Status::ok;
  }

  std::size_t unmap_pages(Segment& seg, std::size_t first, std::size_t n) override {
    const DevicePtr va = seg.base + first * page_;
    if (unmap_for_ == UnmapFor::lend) {
      // Note [Lending pages without a sync]: the old mapping stays until the stream's queued work is done.
      Event e = 0;
      if (s_.driver->record_event(seg.stream, &e) == Status::ok) {
        pending_.push_back({&seg, first, n, e});
        give_back(seg, first, n, fresh_);
        if (seg.small) move_reserved(false, n * page_);
        return n;
      }
      s_.forced_sync(seg.stream);  // no event: wait for the stream instead, then unmap at once
    }
    if (s_.driver->unmap(va, n * page_) != Status::ok) return 0;
    give_back(seg, first, n, unmap_for_ == UnmapFor::release ? idle_ : fresh_);
    if (seg.small) move_reserved(false, n * page_);
    return n;
  }

  void release_free(PoolSet* only) override {
    finish_pending(nullptr, 0, 0);
    GrowablePolicy::release_free(only);
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
  // A range whose pages were lent to a request on the same stream while the old mapping stayed: unmapped
  // once the event (recorded on the segment's stream at lending time) has completed.
  struct Pending { Segment* seg; std::size_t first, n; Event event; };

  // Unmaps the lent ranges whose work is done, without waiting.
  void poll_pending() {
    std::erase_if(pending_, [&](const Pending& p) {
      if (s_.driver->query_event(p.event) != Status::ok) return false;
      unmap_lent(p);
      return true;
    });
  }

  // Unmaps the lent ranges of seg overlapping pages [first, first + n), or all of them when seg is null,
  // waiting for their events where needed (a forced sync, counted).
  void finish_pending(const Segment* seg, std::size_t first, std::size_t n) {
    std::erase_if(pending_, [&](const Pending& p) {
      if (seg && (p.seg != seg || p.first >= first + n || p.first + p.n <= first)) return false;
      if (s_.driver->query_event(p.event) != Status::ok) {
        s_.driver->synchronize_event(p.event);
        ++s_.stats.num_forced_syncs;
      }
      unmap_lent(p);
      return true;
    });
  }

  void unmap_lent(const Pending& p) {
    s_.give_back_mapping(p.seg->base + p.first * page_, p.n * page_);
    s_.driver->release_event(p.event);
  }

  // After a failed request: the pages it was lent (used or not) become idle pages, which any stream may
  // take, so the lenders' queued work must be done first.
  void return_fresh() {
    if (!pending_.empty()) finish_pending(nullptr, 0, 0);
    idle_.insert(idle_.end(), fresh_.begin(), fresh_.end());
    fresh_.clear();
  }

  // Unmapped pages [first, first + n) of seg go back to `to` (the idle pages, or the request's).
  void give_back(Segment& seg, std::size_t first, std::size_t n, std::vector<PageRef>& to) {
    for (std::size_t i = 0; i < n; ++i) {
      PageRef& r = seg.pages[first + i];
      --chunks_[r.handle].in_use;
      to.push_back(r);
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

  // Creates physical memory for at least `missing` pages, in one chunk of at least chunk_size (default
  // 16 MiB) so that cuMemCreate calls stay few, but never past the reserve budget, so the chunk's idle tail
  // stays small. 16 MiB is below PyTorch's own 20 MiB large page: at a new peak our overshoot is at most
  // what expandable segments round up to anyway (docs/RESULTS.md, "Policy parameters").
  Status create_pages(std::size_t missing) {
    const std::size_t growth = std::max<std::size_t>(1, s_.opts.chunk_size / page_);
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
  // Creating memory raises reserved; re-backing from holes costs an unmap and a map but, for holes on the
  // requesting stream, no synchronisation (Note [Lending pages without a sync]). We create freely only
  // while reserved stays within reserve_slack (default 1/64) of what is live now plus the request, and
  // re-back from holes beyond that. Counting live now, not the peak so far, matters: when a step's shape
  // changes below an earlier peak, the holes the old shape left are reused before new memory is made.
  std::size_t budget(std::size_t pages_needed) const {
    const auto live = static_cast<std::size_t>(
        std::max<std::int64_t>(0, s_.stats.live_bytes.current) + static_cast<std::int64_t>(pages_needed * page_));
    return live + static_cast<std::size_t>(static_cast<double>(live) * s_.opts.reserve_slack);
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

  // Takes up to `want` whole free pages from the candidates for a request on `stream`. Holes on the same
  // stream come first, largest first: their pages are lent without a sync (Note [Lending pages without a
  // sync]). Holes on other streams are unmapped after their streams have finished their queued work.
  void reclaim(std::vector<Candidate> cands, std::size_t want, Stream stream) {
    if (cands.empty()) return;
    std::sort(cands.begin(), cands.end(), [&](const Candidate& a, const Candidate& b) {
      const bool sa = a.b->stream == stream, sb = b.b->stream == stream;
      if (sa != sb) return sa;
      return a.hi - a.lo > b.hi - b.lo;
    });
    std::size_t got = 0, n = 0;
    std::set<Stream> streams;
    for (; n < cands.size() && got < want; ++n) {
      got += cands[n].hi - cands[n].lo;
      if (cands[n].b->stream != stream || !s_.opts.lend_pages) streams.insert(cands[n].b->stream);
    }
    // Unmapping is not stream-ordered: other streams' holes wait for their streams' queued work.
    for (Stream st : streams) s_.forced_sync(st);
    std::size_t left = want;
    for (std::size_t i = 0; i < n && left > 0; ++i) {
      auto& c = cands[i];
      const std::size_t take = std::min(left, c.hi - c.lo);
      unmap_for_ = c.b->stream == stream && s_.opts.lend_pages ? UnmapFor::lend : UnmapFor::reclaim;
      // Take the top pages of the hole: the low part stays mapped next to its allocated neighbour.
      if (unmap_block_pages(c.b, c.hi - take, c.hi)) left -= take;
      unmap_for_ = UnmapFor::release;
    }
  }

  std::size_t page_ = s_.driver->granularity();
  std::unordered_map<PhysHandle, Chunk> chunks_;
  std::vector<PageRef> idle_;
  std::vector<PageRef> fresh_;     // pages reclaimed for the request being mapped
  std::vector<Pending> pending_;   // lent ranges still mapped at their old address
  // Why unmap_pages is called: a release (pages become idle), a reclaim for the request being mapped
  // (pages go to fresh_), or a same-stream reclaim that lends without a sync (fresh_, old mapping kept).
  enum class UnmapFor { release, reclaim, lend } unmap_for_ = UnmapFor::release;
};

}  // namespace

std::unique_ptr<Policy> make_fragless_policy(DeviceEngine::State& s) { return std::make_unique<FraglessPolicy>(s); }

}  // namespace fragless
