// fragless: growable segments with page-granular (2 MiB) pages whose physical memory comes from a
// device-wide pool of whole handles (handle_pool.h).
//
// Note [Whole handles]
// CUDA maps a physical handle only whole, at offset 0 (driver.h, R5), and unmaps whole mappings only (R7).
// So the unit that can move from one address to another is a handle, and its size is a policy choice:
// one page per handle moves the finest but costs a cuMemCreate per page; one handle per growth costs one
// call but pins the whole growth while any byte of it is live. `handles:ends` puts the body of a growth in
// one handle and its last page, the one a neighbour may share, in a handle of its own, and `handles:cells`
// creates what expandable segments would (Note [Cells]); a free multi-page handle is split into pieces in
// the background (Note [Split in the background]). docs/RESULTS.md, "Handle shapes", measures them. A handle larger than what a request still needs
// is mapped whole anyway when the unmapped room after the request holds it: the extra pages become free
// space at the segment's end, so no held memory is ever unusable for lack of a split.
//
// Note [Complete re-backing]
// Invariant, checked after every operation: fragless creates new physical memory only when no physical
// memory it already holds and could put under the request without waiting remains — no idle handle that
// fits the room, and no whole handle under a free block of a default pool on the requesting stream, or, with
// lend_across_streams, on another stream that has no unfinished work (Note [Lending across streams]) (holes
// and free segment tails alike), outside the run being grown. A growth in which a hole's unmap failed (a
// driver error) is exempt. One exception ends cycles (Note
// [Refills]): a growth into pages that reclaims stripped twice within the last kRefillWindow growths
// creates its memory.
//
// Note [Refills]
// A repeated step can make re-backing cycle: a miss at R takes memory from hole H, the next step's miss at
// H takes it back from R, and so on, an unmap and a map every step for ever. The sign is a growth into
// pages that reclaims stripped twice within kRefillWindow growths: the memory taken from there keeps being
// needed there. (Once is no sign: a step of another shape re-backs there legitimately.) Such a growth
// creates new memory instead (idle handles still come first), so both places keep memory and the
// step reaches a steady state with no driver call. A refill is bounded: it may not take reserved past
// reserve_slack above the peak of live bytes plus two pages; a larger growth into stripped pages (a
// repeated chain of doubling activations, whose second pass lands where the first pass took memory from)
// re-backs completely instead, at the price of its driver calls. Lent ranges whose events have
// completed are unmapped first, so their handles count too. Holes on other streams need a
// synchronisation before their memory can move (cuMemUnmap is not stream-ordered); taking them is a
// counted last resort, used only when creating would exceed the device. Private pools (graph capture)
// are never reclaimed from: their addresses are baked into graphs.
//
// Note [Lending across streams]
// The rule: a hole on another stream S is taken for a request on stream T, with no wait at all, when S has
// no unfinished work (an event recorded on S at that moment has already completed: the work that used the
// hole is done, and so is everything else S had queued). A hole of a busy S is taken only as the last
// resort, when creating the memory would exceed the device: then T is made to wait, on the device, for
// an event recorded on S (cuStreamWaitEvent), the old mapping stays until that event completes, and the
// host never waits. (CUDA's stream-ordered pools reuse memory across streams the same way,
// cudaMemPoolReuseAllowInternalDependencies.)
// Why: the event can only be recorded when the hole is taken, not when it was freed (recording one at
// every free would put a driver call, a cuEventRecord of about a microsecond, on the fast path of every
// free; the cache-hit pair costs well under that), so waiting for it makes T wait for everything queued on S
// since the free too: a pending NCCL receive on a communication stream would stall compute, and two ranks
// could wait on each other. Measured on the libcuda double's virtual clock (test_cuda_path.cpp, "lending
// across streams waits for what it must"): a hole freed on S, then a kernel of 100000 ticks queued on S;
// lending it to T the old way delayed T's next kernel by 100100 ticks, with this rule by 0 (T gets new
// memory); on a full device the last resort delays it by the same 100100 ticks and the host by 0.
// Per-thread default streams (driver.h, R16) are asked through the mark their own thread records at each
// free there (engine_state.h). `lend_across_streams:False` takes other streams' holes only as the last
// resort, after synchronising S on the host.
//
// Note [Lending pages without a sync]
// cuMemUnmap is not stream-ordered, so unmapping a hole while its stream may still run work that used it
// needs a synchronisation first (PyTorch synchronises before every unmap). But a hole on the requesting
// stream need not be unmapped first: its handles are mapped at the new address while the old mappings stay
// (R9: one handle may be mapped at several addresses). The new block's work is queued on the same stream
// after everything that used the hole, so stream order makes the sharing safe. An event recorded on the
// stream at that moment tells when the old mappings may go; they are unmapped once the event has completed
// (by the background worker, or polled on later slow paths: lent_ranges.h), or, if their address range is needed again before that, after waiting for
// the event, which counts as a forced synchronisation. Until its old mapping is gone a lent range is
// `unmapped` to the engine and no other request maps it.
//
// In a steady state (the same step again) every request hits the cache, so no driver call and no
// synchronisation happen at all; the driver is only touched when the working set changes shape.
#include <algorithm>
#include <deque>
#include <map>
#include <set>

#include "policy/fragless/handle_pool.h"
#include "policy/fragless/handle_splitter.h"
#include "policy/fragless/lent_ranges.h"
#include "policy/growable.h"
#include "state/trace_emit.h"

namespace fragless {
namespace {

class FraglessPolicy final : public GrowablePolicy {
 public:
  using GrowablePolicy::GrowablePolicy;
  PolicyKind kind() const override { return PolicyKind::fragless; }
  std::size_t idle_bytes() const override { return pool_.idle_pages() * page_; }
  bool small_from_large_remnants() const override { return s_.opts.small_in_remnants; }

  std::string check() const override {
    audit_on_ = true;  // Note [Auditing creations]
    if (!audit_.empty()) return audit_;
    std::size_t mapped = 0;
    for (const auto& seg : s_.segments)
      if (seg->growable) mapped += seg->mapped_bytes / page_;
    if (std::string e = pool_.check(mapped); !e.empty()) return e;
    if (std::string e = check_multi(); !e.empty()) return e;
    return lent_.check();
  }

 protected:
  std::size_t page_size(bool) const override { return page_; }

  // Whole pages of b, narrowed to the whole mappings inside them (R7).
  bool unmappable_pages(const Block* b, std::size_t* lo, std::size_t* hi) const override {
    return whole_pages(b, lo, hi) && whole_mappings(*b->segment, lo, hi);
  }

  Status map_pages(Segment& seg, std::size_t first, std::size_t* n_io, std::size_t room) override {
    const std::size_t need = *n_io;
    ++tick_;
    if (s_.capturing()) {
      // Note [Capture rules] (engine_state.h): no event query, no wait, no reclaim; idle and new handles only.
      if (lent_.overlaps(seg, first, need)) return fail_request(Status::out_of_memory, {});
    } else {
      if (lent_.poll(background())) s_.background.wake();
      lent_.finish(&seg, first, need);  // the range may still be mapped to handles lent out without a sync
      // An unmap of a lent range that failed just now is retried before anything maps over the range.
      if (s_.has_deferred()) s_.retry_deferred();
    }
    room = lent_.room_before(seg, first, need, room);
    planned_ = 0;
    idle_.clear();
    unmap_failed_ = false;
    take_idle(need, room);
    const bool refill = planned_ < need && refills(seg, first, need - planned_);
    if (planned_ < need && !refill && !s_.capturing()) {
      // Touch nothing when even everything together cannot succeed: the retry chain takes over.
      if (planned_ + reclaimable_pages() + creatable_pages() < need) return fail_request(Status::out_of_memory, {});
      reclaim(seg.stream, /*other_streams=*/false, need, room);  // Note [Complete re-backing]
      // Holes of other streams that have no unfinished work, with no wait (Note [Lending across streams]).
      if (planned_ < need && lend_across()) reclaim(seg.stream, /*other_streams=*/true, need, room);
    }
    // Holes of busy streams (lent in device order), or of every other stream without lending across
    // streams (after a host wait): the last resort, when creating would exceed the device.
    if (planned_ < need && !can_create(need - planned_) && !s_.capturing())
      reclaim(seg.stream, /*other_streams=*/true, need, room, /*busy_too=*/true);
    std::vector<PhysHandle> created;
    if (planned_ < need) {
      // (During a capture creating is the only way: holes are not taken, Note [Capture rules].)
      if (audit_on_ && !refill && !s_.capturing() && !unmap_failed_) audit_creation(seg, need - planned_, room - planned_);
      // A refill creates exactly what it misses: the memory it puts back is what the cycle moved.
      if (Status st = create(need - planned_, refill ? need - planned_ : room - planned_, first + planned_, seg.small,
                               first + room == seg.pages.size(), &created);
          st != Status::ok)
        return fail_request(st, created);
    }

    // Map every taken handle whole, in order, from `first`; then one set_access over them all (R6).
    Driver& d = *s_.driver;
    const std::vector<PhysHandle>& order = pool_.taken();
    std::size_t at = first, mapped = 0;
    Status st = Status::ok;
    for (; mapped < order.size(); ++mapped) {
      const PhysHandle h = order[mapped];
      const std::size_t k = pool_.pages(h);
      if ((st = d.map(seg.base + at * page_, k * page_, h, 0)) != Status::ok) break;
      for (std::size_t i = 0; i < k; ++i) seg.pages[at + i] = PageRef{h, i * page_};
      pool_.mark_mapped(h);
      splitter_.mapped(seg, at, h);
      at += k;
    }
    if (st == Status::ok) st = d.set_access(seg.base + first * page_, (at - first) * page_);
    pool_.forget_taken(mapped);
    if (st != Status::ok) {
      if (at > first) s_.give_back_mapping(seg.base + first * page_, (at - first) * page_);
      give_back(seg, first, at - first, /*to_request=*/false);
      return fail_request(st, created);
    }
    if (seg.small) move_reserved(true, (at - first) * page_);
    *n_io = at - first;
    return Status::ok;
  }

  std::size_t unmap_pages(Segment& seg, std::size_t first, std::size_t n) override {
    if (unmap_for_ == UnmapFor::lend) {
      // Note [Lending pages without a sync]: the old mappings stay until the stream's queued work is done.
      Event e = 0;
      if (s_.driver->record_event(seg.stream, &e) == Status::ok &&
          (seg.stream == lend_to_ || s_.driver->stream_wait_event(lend_to_, e) == Status::ok)) {
        lent_.add(seg, first, n, e);
        s_.background.wake();  // Note [Unmaps in the background]
        give_back(seg, first, n, /*to_request=*/true);
        if (seg.small) move_reserved(false, n * page_);
        return n;
      }
      // No event: wait for the stream instead, then unmap at once; a failed wait unmaps nothing.
      if (s_.forced_sync(seg.stream) != Status::ok) return 0;
    }
    if (s_.driver->unmap(seg.base + first * page_, n * page_) != Status::ok) {
      unmap_failed_ = true;  // the hole keeps its memory: no fault of the placement (Note [Complete re-backing])
      return 0;
    }
    give_back(seg, first, n, /*to_request=*/unmap_for_ != UnmapFor::release);
    if (seg.small) move_reserved(false, n * page_);
    return n;
  }

  void release_free(PoolSet* only, bool device_synchronized) override {
    lent_.finish(nullptr, 0, 0);
    GrowablePolicy::release_free(only, device_synchronized);
  }

  // ---- Background work: splitting free multi-page handles (Note [Split in the background]) ----

  // Every multi-page mapping is known to the splitter, and every block that overlaps one says so
  // (Block::multi), so its free is reported.
  std::string check_multi() const {
    if (std::string e = splitter_.check(); !e.empty()) return e;
    std::size_t multi = 0;
    for (const auto& seg : s_.segments) {
      if (!seg->growable) continue;
      for (std::size_t i = 0; i < seg->pages.size(); ++i)
        if (seg->pages[i].valid() && seg->pages[i].offset == 0 && pool_.pages(seg->pages[i].handle) > 1) {
          ++multi;
          if (!splitter_.any_multi(*seg, i, 1)) return "fragless: a multi-page mapping the splitter does not know";
        }
      for (const Block* b = seg->first; b; b = b->next) {
        if (b->multi || b->state == BlockState::unmapped) continue;
        const std::size_t lo = (b->ptr - seg->base) / page_, hi = (b->ptr + b->size - seg->base + page_ - 1) / page_;
        for (std::size_t i = lo; i < hi; ++i)
          if (seg->pages[i].valid() && pool_.pages(seg->pages[i].handle) > 1)
            return "fragless: a block overlaps a multi-page mapping but is not marked (Block::multi)";
      }
    }
    if (multi != splitter_.multi_count()) return "fragless: the splitter knows a multi-page mapping that is gone";
    return {};
  }

  bool multi_page(const Segment& seg, std::size_t first, std::size_t n) const override {
    return splitter_.any_multi(seg, first, n);
  }
  void freed(Block* b, DevicePtr lo, DevicePtr hi) override {
    if (splitter_.freed(b, lo, hi)) s_.background.wake();
  }
  // Unmaps of lent ranges first (one call each, and they free address space), then splits.
  bool take_background_job(BackgroundJob* job) override {
    return !s_.capturing() && (lent_.take(job) || splitter_.take(job));
  }
  void run_background_job(BackgroundJob& job, const std::atomic<bool>& abort, bool manual) override {
    if (job.kind == BackgroundJob::Kind::unmap_lent) LentRanges::run(*s_.driver, job, abort);
    else HandleSplitter::run(*s_.driver, page_, job, abort, manual);
  }
  void finish_background_job(BackgroundJob& job) override {
    if (job.kind == BackgroundJob::Kind::unmap_lent) lent_.finish_job(job);
    else splitter_.finish(job);
  }
  bool background() const { return s_.opts.background != BackgroundMode::off; }

  // After a release (empty_cache, OOM retry): every idle handle goes back to the driver.
  void after_release() override {
    pool_.release_idle([&](PhysHandle h, std::size_t pages) { release_handle(h, pages); });
  }

 private:
  struct Stripped { const Segment* seg; std::size_t lo, hi; std::uint64_t tick; std::uint32_t times; };
  static constexpr std::uint64_t kRefillWindow = 256;  // growths
  // Whole mappings [lo, hi) (segment pages) inside the free block b.
  struct Candidate { Block* b; std::size_t lo, hi; };

  static std::size_t mapping_start(const Segment& seg, std::size_t page) {
    return page - seg.pages[page].offset / seg.page_size;
  }
  // Narrows mapped pages [*lo, *hi) of seg to the whole mappings inside them; false if none.
  bool whole_mappings(const Segment& seg, std::size_t* lo, std::size_t* hi) const {
    if (*hi <= *lo) return false;
    if (seg.pages[*lo].offset != 0) *lo = mapping_start(seg, *lo) + pool_.pages(seg.pages[*lo].handle);
    if (*hi > *lo) {
      const std::size_t last = mapping_start(seg, *hi - 1);
      if (last + pool_.pages(seg.pages[*hi - 1].handle) > *hi) *hi = last;
    }
    return *hi > *lo;
  }
  // The pages of free block b that reclaim may take: its whole mappings beyond the run being grown (a
  // block the run ends in keeps the part the run needs).
  bool reclaimable(const Block* b, std::size_t* lo, std::size_t* hi) const {
    if (!whole_pages(b, lo, hi)) return false;
    const Segment& seg = *b->segment;
    if (b->ptr < run_hi_ && b->ptr + b->size > run_lo_) {
      if (b->ptr < run_lo_ || run_hi_ <= seg.base) return false;
      *lo = std::max(*lo, round_up(run_hi_ - seg.base, page_) / page_);
    }
    return whole_mappings(seg, lo, hi);
  }

  // ---- Placement: idle handles ----

  void take_idle(std::size_t need, std::size_t room) {
    while (planned_ < need) {
      const PhysHandle h = pool_.pick(need - planned_, room - planned_);
      if (!h) return;
      pool_.take_idle(h);
      planned_ += pool_.pages(h);
    }
  }

  // ---- Reclaim: whole handles under free blocks ----

  // Free blocks of the default pools (never private ones) on `stream` (or on every other stream), outside
  // the run being grown, with the whole mappings inside them.
  // With `idle_only`, other streams' holes only where the stream has no unfinished work.
  std::vector<Candidate> candidates(Stream stream, bool other_streams, bool idle_only = false) {
    std::vector<Candidate> cands;
    for (const BlockPool* bp : {&s_.default_pools.large, &s_.default_pools.small})
      for (Block* b : bp->blocks) {
        if (!b->segment->growable || (b->stream == stream) == other_streams) continue;
        if (idle_only && other_streams && !idle(b->stream)) continue;
        std::size_t lo, hi;
        if (reclaimable(b, &lo, &hi)) cands.push_back({b, lo, hi});
      }
    return cands;
  }

  std::size_t reclaimable_pages() {
    std::size_t n = 0;
    for (bool other : {false, true})  // stream 0 and every other stream: each block once
      for (const Candidate& c : candidates(0, other)) n += c.hi - c.lo;
    return n;
  }

  // Takes whole handles from holes until the request's need is met, never more than its room. Largest
  // holes first; inside a hole, from the top down (the low part stays next to its allocated neighbour),
  // adjacent handles in one unmap. Same-stream holes lend without a sync; other streams' holes wait for
  // their streams first (counted).
  void reclaim(Stream stream, bool other_streams, std::size_t need, std::size_t room, bool busy_too = false) {
    std::vector<Candidate> cands = candidates(stream, other_streams, /*idle_only=*/other_streams && !busy_too);
    std::sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) { return a.hi - a.lo > b.hi - b.lo; });
    std::vector<Candidate> groups;
    std::size_t got = planned_;
    for (const Candidate& c : cands) {
      const Segment& seg = *c.b->segment;
      std::size_t at = c.hi, top = c.hi;
      while (at > c.lo && got < need) {
        const std::size_t start = mapping_start(seg, at - 1), len = at - start;
        if (got + len <= room) {
          got += len;
        } else {
          if (top > at) groups.push_back({c.b, at, top});
          top = start;
        }
        at = start;
      }
      if (top > at) groups.push_back({c.b, at, top});
      if (got >= need) break;
    }
    // Same-stream holes lend (old mappings kept in stream order); idle streams' holes need no wait at all;
    // busy streams' holes lend with a device-side wait, or without lend_across_streams after a host wait.
    const bool lend = s_.opts.lend_pages && (!other_streams || (busy_too && lend_across()));
    const bool waitless = other_streams && !busy_too;
    lend_to_ = stream;
    std::set<Stream> failed;
    if (!lend && !waitless) {
      std::set<Stream> streams;
      for (const Candidate& g : groups) streams.insert(g.b->stream);
      for (Stream st : streams)  // cuMemUnmap is not stream-ordered; a failed wait takes nothing
        if (s_.forced_sync(st) != Status::ok) failed.insert(st);
    }
    unmap_for_ = lend ? UnmapFor::lend : UnmapFor::reclaim;
    for (const Candidate& g : groups)
      if (!failed.count(g.b->stream)) unmap_block_pages(g.b, g.lo, g.hi);
    unmap_for_ = UnmapFor::release;
  }

  // Note [Complete re-backing], checked: just before memory is created, an independent recount (from the
  // segments' block lists, not the pools' size sets) finds nothing on the requesting stream that could
  // still go under the request without waiting.
  //
  // Note [Auditing creations]
  // The recount walks every block of every segment, as check_invariants does, and a growth that creates
  // memory is frequent while memory first grows: run on every creation it was half of fragless's
  // BM_GrowthPath. So it runs only in an engine whose invariants are being checked: from the first check()
  // on (the randomized tests and the fuzzers call it after every operation).
  void audit_creation(const Segment& target, std::size_t missing, std::size_t room) {
    if (pool_.idle_pages_within(room) > 0) {
      audit_ = "fragless: created memory while an idle handle fitted the request (Note [Complete re-backing])";
      return;
    }
    for (const auto& seg : s_.segments) {
      if (!seg->growable || seg->owner != &s_.default_pools) continue;
      if (seg->stream != target.stream && (!lend_across() || !idle(seg->stream))) continue;  // would need a wait
      for (Block* b = seg->first; b; b = b->next) {
        if (!b->reusable()) continue;
        std::size_t lo, hi;
        if (!whole_pages(b, &lo, &hi)) continue;
        if (b->ptr < run_hi_ && b->ptr + b->size > run_lo_) {  // the run's own part is not for taking
          if (b->ptr < run_lo_) continue;
          lo = std::max(lo, (run_hi_ - seg->base + page_ - 1) / page_);
        }
        for (std::size_t i = lo; i < hi; ++i) {
          const std::size_t start = mapping_start(*seg, i), len = pool_.pages(seg->pages[i].handle);
          if (start >= lo && start + len <= hi && len <= room) {
            audit_ = "fragless: created " + std::to_string(missing) + " pages while a free block on the stream "
                     "held a whole handle that fitted (Note [Complete re-backing])";
            return;
          }
        }
      }
    }
  }

  // ---- Failure and bookkeeping ----

  // A failed request: the handles it was lent (used or not) become idle, which any stream may take, so the
  // lenders' queued work must be done first; what it created goes back to the driver.
  Status fail_request(Status st, const std::vector<PhysHandle>& created) {
    // (During a capture nothing was lent: the taken handles were idle or new, and nothing need wait.)
    if (!lent_.empty() && !pool_.taken().empty() && !s_.capturing()) lent_.finish(nullptr, 0, 0);
    pool_.return_taken();
    for (PhysHandle h : created) {
      const std::size_t pages = pool_.pages(h);
      pool_.remove_idle(h);
      release_handle(h, pages);
    }
    return st;
  }

  // Unmapped pages [first, first + n) of seg: their handles go to the request being mapped, or idle.
  void give_back(Segment& seg, std::size_t first, std::size_t n, bool to_request) {
    for (std::size_t i = first; i < first + n; ++i) {
      PageRef& r = seg.pages[i];
      if (r.offset == 0) {
        splitter_.unmapped(seg, i, r.handle);
        to_request ? pool_.unmapped_to_taken(r.handle) : pool_.unmapped_to_idle(r.handle);
      }
      r = PageRef{};
    }
    if (to_request) {
      planned_ += n;
      // A range stripped again while an earlier strip of it is still recent counts twice: a cycle.
      std::uint32_t times = 1;
      for (const Stripped& s : stripped_)
        if (s.seg == &seg && s.lo < first + n && s.hi > first) times = std::max(times, s.times + 1);
      stripped_.push_back({&seg, first, first + n, tick_, times});
    }
  }

  // Whether creating `missing` pages at pages [first, ...) of seg is a refill (Note [Refills]): the pages
  // were stripped by a reclaim lately, and the new memory keeps reserved within reserve_slack of the peak
  // of live bytes plus two pages, so a refill never raises the overhead over live beyond that.
  bool refills(const Segment& seg, std::size_t first, std::size_t missing) {
    const auto peak = static_cast<double>(std::max<std::int64_t>(0, s_.stats.live_bytes.peak));
    if (static_cast<double>(s_.total_reserved + missing * page_) > peak * (1 + s_.opts.reserve_slack) + 2.0 * page_)
      return false;
    while (!stripped_.empty() && tick_ - stripped_.front().tick >= kRefillWindow) stripped_.pop_front();
    const std::size_t n = missing;
    for (const Stripped& s : stripped_)
      if (s.times >= 2 && s.seg == &seg && s.lo < first + n && s.hi > first) return true;
    return false;
  }

  // Reserved is reported per pool as mapped bytes; idle handles count as large-pool reserve.
  void move_reserved(bool to_small, std::size_t bytes) {
    const auto b = static_cast<std::int64_t>(bytes);
    auto& st = s_.stats.reserved_bytes;
    st.by_pool[kSmallPool].add(to_small ? b : -b);
    st.by_pool[kLargePool].add(to_small ? -b : b);
  }

  void release_handle(PhysHandle h, std::size_t pages) {
    splitter_.released(h);
    s_.give_back_handle(h);
    const std::size_t bytes = pages * page_;
    s_.add_reserved(false, -static_cast<std::int64_t>(bytes));
    emit(s_, TraceAction::phys_release, 0, 0, bytes, bytes);
  }

  // ---- New memory ----

  // Pages that could still be created within the device's free memory and the memory fraction.
  std::size_t creatable_pages() {
    std::size_t free_b = 0, total_b = 0;
    s_.driver->memory_info(&free_b, &total_b);
    if (s_.allowed_memory_maximum)
      free_b = std::min(free_b, s_.allowed_memory_maximum > s_.total_reserved
                                    ? s_.allowed_memory_maximum - s_.total_reserved : 0);
    return free_b / page_;
  }
  bool can_create(std::size_t pages) { return s_.capacity_allows(pages * page_) && creatable_pages() >= pages; }

  // The handles a growth of `missing` pages, the first at segment page `at`, creates (Note [Whole
  // handles]). With `ends` and `whole`, the last one may be rounded up to chunk_size, but by no more than
  // reserve_slack of live bytes and never past the room: fewer cuMemCreate calls at a bounded cost in idle
  // memory.
  std::vector<std::size_t> shape(std::size_t missing, std::size_t room, std::size_t at, bool small, bool frontier) {
    if (s_.opts.handle_shape == HandleShape::pages) return std::vector<std::size_t>(missing, 1);
    const std::size_t chunk = std::max<std::size_t>(1, s_.opts.chunk_size / page_);
    const auto live = static_cast<double>(std::max<std::int64_t>(0, s_.stats.live_bytes.current));
    const auto slack = static_cast<std::size_t>(live * s_.opts.reserve_slack) / page_;
    if (s_.opts.handle_shape == HandleShape::cells)  // Note [Cells]
      return cells(missing, room, at, small ? std::max<std::size_t>(1, kSmallBuffer / page_) : std::clamp<std::size_t>(slack, 1, chunk),
                   frontier);
    std::size_t extra = std::min(room, std::max(missing, std::min(chunk, missing + slack))) - missing;
    if (extra && !can_create(missing + extra)) extra = 0;
    if (s_.opts.handle_shape == HandleShape::whole || missing < 2) return {missing + extra};
    // The body in handles of at most handle_max pages, then the last page (which a neighbour may share)
    // with the slack: a live block that later straddles a body handle pins less than handle_max of it.
    const std::size_t body_max = std::max<std::size_t>(1, s_.opts.handle_max / page_);
    std::vector<std::size_t> sizes;
    for (std::size_t left = missing - 1; left > 0;) {
      const std::size_t k = std::min(left, body_max);
      sizes.push_back(k);
      left -= k;
    }
    sizes.push_back(1 + extra);
    return sizes;
  }

  // Note [Cells]
  // handles:cells creates new memory the way expandable segments do, in cells of the segment (in the large
  // pool chunk_size_mb, expandable's 20 MiB page, but no more than reserve_slack of live bytes, so a small
  // job's free tail stays small; in the small pool one 2 MiB page), so a growth makes no more cuMemCreate
  // calls than the cells it touches and leaves a free tail no longer than a cell: a handle never crosses a
  // cell boundary, a growth at the end of what its segment maps ends on one (the rest of the last cell is
  // free space after the request, as in expandable's last page; a growth into a gap between mapped pages
  // creates only what it needs, leaving no free tail between live blocks), and the cells that lie wholly inside the request are one handle (of at most
  // handle_max_mb): only the request uses them, so nothing else pins them, and a large request costs one
  // call, not one per cell. Once free, every multi-page handle is split into pieces in the background (Note
  // [Split in the background]), so re-backing then moves that memory page by page.
  std::vector<std::size_t> cells(std::size_t missing, std::size_t room, std::size_t at, std::size_t chunk, bool frontier) {
    // Only a growth at the end of what the segment maps rounds up to a cell's end: one inside a gap (a hole
    // re-backed elsewhere) would leave its free tail between live blocks.
    std::size_t end = frontier ? std::min(at + room, (at + missing + chunk - 1) / chunk * chunk) : at + missing;
    if (end > at + missing && !can_create(end - at)) end = at + missing;
    const std::size_t body_max = std::max<std::size_t>(1, s_.opts.handle_max / page_);
    std::vector<std::size_t> sizes;
    // The cells covered whole by the request's pages but its last (a neighbour may share the last page).
    const std::size_t body_lo = (at + chunk - 1) / chunk * chunk, body_hi = (at + missing - 1) / chunk * chunk;
    if (body_hi <= body_lo) {  // no whole cell: one handle per cell touched
      for (std::size_t p = at; p < end;) {
        const std::size_t next = std::min(end, (p / chunk + 1) * chunk);
        sizes.push_back(next - p);
        p = next;
      }
      return sizes;
    }
    if (body_lo > at) sizes.push_back(body_lo - at);  // the rest of a cell begun earlier
    for (std::size_t p = body_lo; p < body_hi;) {
      const std::size_t k = std::min(body_hi - p, body_max);
      sizes.push_back(k);
      p += k;
    }
    sizes.push_back(end - body_hi);  // the last cell: the request's last page and the free space after it
    return sizes;
  }

  // Creates the handles for `missing` pages; they join the request. A handle that cannot be had in one
  // piece is created page by page (the last resort when physical memory is too fragmented for a large one).
  Status create(std::size_t missing, std::size_t room, std::size_t at, bool small, bool frontier,
                std::vector<PhysHandle>* created) {
    for (std::size_t pages : shape(missing, room, at, small, frontier)) {
      if (!s_.capacity_allows(pages * page_)) return Status::out_of_memory;
      PhysHandle h = 0;
      Status st = s_.driver->create(pages * page_, &h);
      if (st == Status::ok) {
        add_created(h, pages, created);
        continue;
      }
      if (st != Status::out_of_memory || pages == 1) return st;
      for (std::size_t i = 0; i < pages; ++i) {
        if ((st = s_.driver->create(page_, &h)) != Status::ok) return st;
        add_created(h, 1, created);
      }
    }
    return Status::ok;
  }

  void add_created(PhysHandle h, std::size_t pages, std::vector<PhysHandle>* created) {
    pool_.add_taken(h, pages);
    planned_ += pages;
    created->push_back(h);
    s_.add_reserved(false, static_cast<std::int64_t>(pages * page_));
    emit(s_, TraceAction::phys_create, 0, 0, pages * page_, pages * page_);
  }

  std::size_t page_ = s_.driver->granularity();
  HandlePool pool_;
  HandleSplitter splitter_{s_, pool_, page_};  // Note [Split in the background]
  std::size_t planned_ = 0;        // pages taken for the request being mapped
  std::uint64_t tick_ = 0;         // growths so far
  Stream lend_to_ = 0;             // the stream of the request that lending serves
  std::map<Stream, bool> idle_;    // per growth: whether a stream had no unfinished work when asked
  bool unmap_failed_ = false;      // per growth: an unmap of a hole failed (the driver's fault)
  bool idle(Stream st) {
    auto [it, fresh] = idle_.try_emplace(st, false);
    if (fresh) it->second = s_.stream_idle(st);
    return it->second;
  }
  bool lend_across() const { return s_.opts.lend_pages && s_.opts.lend_across_streams; }
  std::deque<Stripped> stripped_;  // ranges reclaims took memory from, within kRefillWindow growths
  LentRanges lent_{s_, page_};    // lent ranges still mapped at their old address
  std::string audit_;              // a broken Note [Complete re-backing], for check()
  mutable bool audit_on_ = false;  // check() has been called: audit every creation (Note [Auditing creations])
  // Why unmap_pages is called: a release (handles become idle), a reclaim for the request being mapped
  // (handles go to it), or a same-stream reclaim that lends without a sync (to it, old mapping kept).
  enum class UnmapFor { release, reclaim, lend } unmap_for_ = UnmapFor::release;
};

}  // namespace

std::unique_ptr<Policy> make_fragless_policy(DeviceEngine::State& s) { return std::make_unique<FraglessPolicy>(s); }

}  // namespace fragless
