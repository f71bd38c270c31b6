// The fragless policy's placement (fragless_policy.h): a growth's steps in order, the unmaps that give
// memory to it or back to the idle handles, refills, failure, the background hooks and check().
#include <algorithm>

#include "policy/fragless/fragless_policy.h"
#include "state/trace_emit.h"

namespace fragless {

std::string FraglessPolicy::check() const {
  audit_on_ = true;  // Note [Auditing creations]
  if (!audit_.empty()) return audit_;
  std::size_t mapped = 0;
  for (const auto& seg : s_.segments)
    if (seg->growable) mapped += seg->mapped_bytes / page_;
  if (std::string e = pool_.check(mapped); !e.empty()) return e;
  if (std::string e = check_multi(); !e.empty()) return e;
  // A strip is added after the older ones are forgotten (forget_old_strips), so all lie within one window of
  // the newest.
  if (!stripped_.empty() && stripped_.back().tick - stripped_.front().tick >= kRefillWindow)
    return "fragless: a strip older than the refill window kept (" + std::to_string(stripped_.size()) + " kept)";
  return lent_.check();
}

bool FraglessPolicy::whole_mappings(const Segment& seg, std::size_t* lo, std::size_t* hi) const {
  if (*hi <= *lo) return false;
  if (seg.pages[*lo].offset != 0) *lo = mapping_start(seg, *lo) + pool_.pages(seg.pages[*lo].handle);
  if (*hi > *lo) {
    const std::size_t last = mapping_start(seg, *hi - 1);
    if (last + pool_.pages(seg.pages[*hi - 1].handle) > *hi) *hi = last;
  }
  return *hi > *lo;
}

bool FraglessPolicy::idle(Growth& g, Stream st) {
  auto [it, fresh] = g.idle.try_emplace(st, false);
  if (fresh) it->second = s_.stream_idle(st);
  return it->second;
}

Status FraglessPolicy::map_pages(Segment& seg, std::size_t first, std::size_t* n_io, std::size_t room,
                                 const Run& run) {
  const std::size_t need = *n_io;
  ++tick_;
  gap_demand_ *= 1 - kReserveDecay;
  if (s_.capturing()) {
    // Note [Capture rules] (engine_state.h): no event query, no wait, no reclaim; idle and new handles only.
    if (lent_.overlaps(seg, first, need)) return fail_request(Status::out_of_memory, {});
  } else {
    if (lent_.poll(background())) s_.background.wake();
    // The range may still be mapped to handles lent out without a sync. If a wait for one fails, its old mapping
    // stays (Note [Failed waits]) and nothing can be mapped there: the growth fails with the wait's error.
    if (!lent_.finish(&seg, first, need)) return fail_request(Status::driver_error, {});
    // An unmap of a lent range that failed just now is retried before anything maps over the range.
    if (s_.has_deferred()) s_.retry_deferred();
  }
  room = lent_.room_before(seg, first, need, room);
  Growth g;
  g.stream = seg.stream;
  g.small = seg.small;
  g.run_lo = run.lo;
  g.run_hi = run.hi;
  g.need = need;
  take_idle(g, need, room);
  const bool refill = g.planned < need && refills(seg, first, need - g.planned);
  if (g.planned < need && !refill && !s_.capturing()) {
    // Touch nothing when even everything together cannot succeed: the retry chain takes over.
    // (The recount of what could be reclaimed walks the free blocks: only when creating alone falls short.)
    const std::size_t creatable = creatable_pages(g);
    const std::size_t has = g.planned + pool_.reserve_pages();
    if (has + creatable < need && has + reclaimable_pages(g) + creatable < need)
      return fail_request(Status::out_of_memory, {});
    // Note [The small pool keeps a cell]: only where all that is missing could be created instead.
    g.keep_small = !seg.small && creatable >= need - g.planned;
    reclaim(g, /*other_streams=*/false, need, room);  // Note [Complete re-backing]
    // Holes of other streams that have no unfinished work, with no wait (Note [Lending across streams]).
    if (g.planned < need && lend_across()) reclaim(g, /*other_streams=*/true, need, room);
  }
  // Note [Growth reserve]: what a growth into a gap still misses is the reserve's demand.
  if (g.planned < need) reserve_demand(g, /*gap=*/first + room != seg.pages.size());
  std::vector<PhysHandle>& created = created_;  // Note [Growth buffers]
  created.clear();
  for (bool again = false;; again = true) {
    // Holes of busy streams (lent in device order), or of every other stream without lending across
    // streams (after a host wait): the last resort, when creating would exceed the device. The small pool's
    // kept pages come before it (the device's free memory may have changed since it was asked).
    if (g.planned < need && !can_create(g, need - g.planned) && !s_.capturing()) {
      // The reserve's pages first, for part of the growth too: they need no wait (Note [Growth reserve]).
      g.planned += pool_.take_reserve(need - g.planned);
      if (g.planned < need && g.keep_small) {
        g.keep_small = false;
        reclaim(g, /*other_streams=*/false, need, room);
        if (g.planned < need && lend_across()) reclaim(g, /*other_streams=*/true, need, room);
      }
      if (g.planned < need && !can_create(g, need - g.planned))
        reclaim(g, /*other_streams=*/true, need, room, /*busy_too=*/true);
    }
    if (g.planned >= need) break;
    // The reserve covers all that is missing: no create (taking less would save none).
    if (pool_.reserve_pages() >= need - g.planned) {
      g.planned += pool_.take_reserve(need - g.planned);
      break;
    }
    // (During a capture creating is the only way: holes are not taken, Note [Capture rules].)
    if (audit_on_ && !refill && !s_.capturing() && !g.unmap_failed)
      audit_creation(g, seg, need - g.planned, room - g.planned);
    // A refill creates exactly what it misses: the memory it puts back is what the cycle moved.
    const Status st = create(g, need - g.planned, refill ? need - g.planned : room - g.planned, first + g.planned,
                             seg.small, first + room == seg.pages.size(), &created);
    if (st == Status::ok) break;
    // The driver refused what an answer known without asking allowed (Note [Asking for free memory]): the
    // growth keeps what it has, asks, and takes the last resort's steps with the driver's answer, once.
    if (st == Status::out_of_memory && g.known && g.refused && !again) {
      g.asked = g.known = false;
      continue;
    }
    return fail_request(st, created);
  }
  refill_reserve();

  // Map every taken handle whole, in order, from `first`; then one set_access over them all (R6).
  Driver& d = *s_.driver;
  const std::vector<PhysHandle>& order = pool_.taken();
  std::size_t at = first, mapped = 0;
  // The page table's entries first (host memory; g.planned pages are taken): running out of it fails the
  // request before any mapping.
  Status st = seg.pages.prepare(first, g.planned) ? Status::ok : Status::out_of_memory;
  for (; st == Status::ok && mapped < order.size(); ++mapped) {
    const PhysHandle h = order[mapped];
    const std::size_t k = pool_.pages(h);
    if ((st = d.map(seg.base + at * page_, k * page_, h, 0)) != Status::ok) break;
    for (std::size_t i = 0; i < k; ++i) seg.pages.slot(at + i) = PageRef{h, i * page_};
    pool_.mark_mapped(h);
    splitter_.mapped(seg, at, h);
    at += k;
  }
  if (st == Status::ok) st = d.set_access(seg.base + first * page_, (at - first) * page_);
  pool_.forget_taken(mapped);
  if (st != Status::ok) {
    // The handles mapped so far go idle too: some may have been lent (fail_request waits for them).
    const std::vector<PhysHandle> idled = handles_at(seg, first, at - first);
    if (at > first) s_.give_back_mapping(seg.base + first * page_, (at - first) * page_);
    give_back(seg, first, at - first, /*to_request=*/nullptr);
    return fail_request(st, created, idled);
  }
  if (seg.small) move_reserved(true, (at - first) * page_);
  *n_io = at - first;
  return Status::ok;
}

std::size_t FraglessPolicy::unmap_pages(Segment& seg, std::size_t first, std::size_t n, const Unmap& how) {
  if (how.why == Unmap::Why::lend) {
    // Note [Lending pages without a sync]: the old mappings stay until the stream's queued work is done.
    const Stream to = how.growth->stream;
    Event e = 0;
    bool recorded = false, ordered = false;
    if (!s_.retired(seg.stream)) {
      recorded = s_.driver->record_event(seg.stream, &e) == Status::ok;
      ordered = recorded && (seg.stream == to || s_.driver->stream_wait_event(to, e) == Status::ok);
    } else if (const auto& r = s_.retired_streams[seg.stream]; !r.named && !s_.capturing()) {
      // Note [Destroyed streams]: `to` waits for the destroyed stream's event, and an event recorded on `to`
      // then follows both (never on a stream that may be capturing: it would be a node of the graph).
      ordered = (!r.pending || s_.driver->stream_wait_event(to, r.event) == Status::ok) &&
                (recorded = s_.driver->record_event(to, &e) == Status::ok);
    }
    if (recorded && !ordered) s_.driver->release_event(e);
    if (ordered) {
      lent_.add(seg, first, n, e, handles_at(seg, first, n));
      s_.background.wake();  // Note [Unmaps in the background]
      give_back(seg, first, n, how.growth);
      if (seg.small) move_reserved(false, n * page_);
      return n;
    }
    // No event: wait for the stream (a destroyed one's event) instead, then unmap at once; a failed wait
    // unmaps nothing.
    if (s_.forced_sync(seg.stream) != Status::ok) return 0;
  }
  if (s_.driver->unmap(seg.base + first * page_, n * page_) != Status::ok) {
    if (how.growth) how.growth->unmap_failed = true;  // the hole keeps its memory: no fault of the placement
    return 0;
  }
  give_back(seg, first, n, how.why == Unmap::Why::release ? nullptr : how.growth);
  if (seg.small) move_reserved(false, n * page_);
  return n;
}

void FraglessPolicy::release_free(PoolSet* only, bool device_synchronized) {
  lent_.finish(nullptr, 0, 0);
  splitter_.coarse();  // Note [Split in the background]: releases cost one call per handle
  releasing_defaults_ = only == nullptr || only == &s_.default_pools;
  GrowablePolicy::release_free(only, device_synchronized);
  releasing_defaults_ = false;
}

// ---- Background work: splitting free multi-page handles (Note [Split in the background]) ----

// Every multi-page mapping is known to the splitter, and every block that overlaps one says so
// (Block::multi), so its free is reported.
std::string FraglessPolicy::check_multi() const {
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

void FraglessPolicy::freed(Block* b, DevicePtr lo, DevicePtr hi) {
  if (splitter_.freed(b, lo, hi)) s_.background.wake();
}

// A free-memory question first (one short call, and growths are waiting to use its answer), then unmaps of
// lent ranges (one call each, and they free address space), then the reserve's pages (growths are creating
// on their path without them: Note [Growth reserve]), then splits.
bool FraglessPolicy::take_background_job(BackgroundJob* job) {
  return !s_.capturing() && (take_memory_info(job) || lent_.take(job) || take_reserve_job(job) || splitter_.take(job));
}

void FraglessPolicy::run_background_job(BackgroundJob& job, const std::atomic<bool>& abort, bool manual) {
  switch (job.kind) {
    case BackgroundJob::Kind::memory_info:
      if (!abort.load(std::memory_order_relaxed)) {
        s_.driver->memory_info(&job.free_bytes, &job.total_bytes);
        job.outcome = BackgroundJob::Outcome::done;
      }
      break;
    case BackgroundJob::Kind::unmap_lent: LentRanges::run(*s_.driver, job, abort); break;
    case BackgroundJob::Kind::reserve: run_reserve(*s_.driver, page_, job, abort); break;
    default: HandleSplitter::run(*s_.driver, page_, job, abort, manual);
  }
}

void FraglessPolicy::finish_background_job(BackgroundJob& job) {
  switch (job.kind) {
    case BackgroundJob::Kind::memory_info: finish_memory_info(job); break;
    case BackgroundJob::Kind::unmap_lent: lent_.finish_job(job); break;
    case BackgroundJob::Kind::reserve: finish_reserve(job); break;
    default: splitter_.finish(job);
  }
}

// ---- Placement: idle handles ----

void FraglessPolicy::take_idle(Growth& g, std::size_t need, std::size_t room) {
  while (g.planned < need) {
    const PhysHandle h = pool_.pick(need - g.planned, room - g.planned);
    if (!h) return;
    pool_.take_idle(h);
    g.planned += pool_.pages(h);
  }
}

// ---- Failure and bookkeeping ----

// A failed request: the handles it was lent (used or not) become idle, which any stream may take, so the
// lenders' queued work must be done first; what it created goes back to the driver. `idled`: handles the
// request had mapped and already gave back idle (a map or set_access that failed part way), which may have
// been lent too. When a lender's wait fails, its range stays mapped at its old address (Note [Failed waits]):
// every handle of the request then goes back to the driver instead of becoming idle, so none is handed to
// another stream before the lender's work is done; one that range still maps keeps its memory, and its place
// in reserved, until the range goes (R8, LentRanges::hold_released).
Status FraglessPolicy::fail_request(Status st, const std::vector<PhysHandle>& created,
                                    const std::vector<PhysHandle>& idled) {
  // (During a capture nothing was lent: the taken handles were idle or new, and nothing need wait.)
  bool waited = true;
  if (!lent_.empty() && (!pool_.taken().empty() || !idled.empty()) && !s_.capturing())
    waited = lent_.finish(nullptr, 0, 0);
  std::vector<PhysHandle> release = created;
  if (!waited) {
    release.insert(release.end(), pool_.taken().begin(), pool_.taken().end());
    release.insert(release.end(), idled.begin(), idled.end());
    std::sort(release.begin(), release.end());
    release.erase(std::unique(release.begin(), release.end()), release.end());
  }
  pool_.return_taken();
  for (PhysHandle h : release) {
    const std::size_t pages = pool_.pages(h);
    pool_.remove_idle(h);
    // One a lent range still maps keeps its memory (and its place in reserved) until that range goes.
    const bool held = !waited && lent_.hold_released(h, pages * page_);
    release_handle(h, pages, /*memory_goes=*/!held);
  }
  return st;
}

std::vector<PhysHandle> FraglessPolicy::handles_at(const Segment& seg, std::size_t first, std::size_t n) {
  std::vector<PhysHandle> out;
  for (std::size_t i = first; i < first + n; ++i)
    if (seg.pages[i].offset == 0) out.push_back(seg.pages[i].handle);
  return out;
}

// Unmapped pages [first, first + n) of seg: their handles go to the growth `to_request`, or idle when null.
void FraglessPolicy::give_back(Segment& seg, std::size_t first, std::size_t n, Growth* to_request) {
  for (std::size_t i = first; i < first + n; ++i) {
    PageRef& r = seg.pages.slot(i);
    if (r.offset == 0) {
      splitter_.unmapped(seg, i, r.handle);
      to_request ? pool_.unmapped_to_taken(r.handle) : pool_.unmapped_to_idle(r.handle);
    }
    r = PageRef{};
  }
  if (to_request) {
    to_request->planned += n;
    // A range stripped again while an earlier strip of it is still recent counts twice: a cycle.
    forget_old_strips();
    std::uint32_t times = 1;
    for (const Stripped& s : stripped_)
      if (s.seg == &seg && s.lo < first + n && s.hi > first) times = std::max(times, s.times + 1);
    stripped_.push_back({&seg, first, first + n, tick_, times});
  }
}

// Whether creating `missing` pages at pages [first, ...) of seg is a refill (Note [Refills]): the pages
// were stripped by a reclaim lately, and the new memory keeps reserved within reserve_slack of the peak
// of live bytes plus two pages, so a refill never raises the overhead over live beyond that.
bool FraglessPolicy::refills(const Segment& seg, std::size_t first, std::size_t missing) {
  if (past_refill_bound(missing * page_)) return false;
  forget_old_strips();
  const std::size_t n = missing;
  for (const Stripped& s : stripped_)
    if (s.times >= 2 && s.seg == &seg && s.lo < first + n && s.hi > first) return true;
  return false;
}

// Strips older than kRefillWindow growths are forgotten where strips are added and read, so the list holds one
// window's strips: forgotten only where a refill was asked, a reclaim beyond the refill bound (a growing job's,
// every growth) kept every strip it made, and each unmap scanned them all (a million-operation random
// workload: 17 s, against 0.9 s for expandable).
void FraglessPolicy::forget_old_strips() {
  while (!stripped_.empty() && tick_ - stripped_.front().tick >= kRefillWindow) stripped_.pop_front();
}

// Whether `bytes` more would take reserved past reserve_slack above the peak of live bytes plus two pages: the
// bound of a refill (Note [Refills]) and of the reserve (Note [Growth reserve]).
bool FraglessPolicy::past_refill_bound(std::size_t bytes) const {
  const auto peak = static_cast<double>(std::max<std::int64_t>(0, s_.stats.live_bytes.peak));
  return static_cast<double>(s_.total_reserved + bytes) > peak * (1 + s_.opts.reserve_slack) + 2.0 * page_;
}

// Reserved is reported per pool as mapped bytes; idle handles count as large-pool reserve.
void FraglessPolicy::move_reserved(bool to_small, std::size_t bytes) {
  const auto b = static_cast<std::int64_t>(bytes);
  auto& st = s_.stats.reserved_bytes;
  st.by_pool[kSmallPool].add(to_small ? b : -b);
  st.by_pool[kLargePool].add(to_small ? -b : b);
  // One pool gave the pages up and the other took them: in `all`, reserved as much as freed, so that every
  // field of `all` stays the sum of the two pools' (PyTorch's stats keep that, and memory_summary shows both).
  st.by_pool[kAllPools].allocated += b;
  st.by_pool[kAllPools].freed += b;
}

void FraglessPolicy::release_handle(PhysHandle h, std::size_t pages, bool memory_goes) {
  splitter_.released(h);
  s_.give_back_handle(h);
  if (!memory_goes) return;  // LentRanges::hold_released: it goes when the range that maps it is dropped
  const std::size_t bytes = pages * page_;
  s_.add_reserved(false, -static_cast<std::int64_t>(bytes));
  emit(s_, TraceAction::phys_release, 0, 0, bytes, bytes);
}

std::unique_ptr<Policy> make_fragless_policy(DeviceEngine::State& s) { return std::make_unique<FraglessPolicy>(s); }

}  // namespace fragless
