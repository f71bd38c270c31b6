// The fragless policy's new memory (fragless_policy.h): how much may still be created, the shape of new
// handles (Note [Whole handles], Note [Cells]), and their creation.
#include <algorithm>

#include "policy/fragless/fragless_policy.h"
#include "state/trace_emit.h"

namespace fragless {

// Note [Asking for free memory]
// A growth decides from the device's free memory whether it could create what it misses (the last resort
// of Note [Lending across streams], Note [The small pool keeps a cell]) and whether it is near the limit
// (Note [Cells]). Asking the driver (cuMemGetInfo) is a call of about 10 µs; asked at every decision it was
// 2 to 4 calls per growth (on the nothanmin forward trace 2,263 calls, 23 ms of the allocation path), where
// the peers ask nothing: they create and handle the failure. So a growth asks at most once, and usually not
// at all: fragless knows what it changed since the driver last answered (its reserved bytes, every create
// and release of its own), so the free memory now is that answer less what fragless has added since.
// Other users of the device (other processes, NCCL's and cuBLAS's own allocations) change it unseen, so the
// driver is asked again where a wrong answer would change a decision: when the known answer is within an
// eighth of the device of what the growth misses, or of where memory_tight turns (half of what the process
// may hold, above what it misses); after kAskEvery growths that used the known answer (growths that idle
// handles serve whole, and refills, need no answer and count nothing; a growth that takes holes counts, as it
// weighs what it could create before it reclaims); and after any create the driver refused.
// An answer that is too high by more than that eighth can still mislead memory_tight until the next ask
// (handles of up to handle_max_mb near the limit, for at most kAskEvery growths); one that is too low costs
// an ask. A too high answer that leads to a create the driver refuses costs that call: the growth keeps
// what it has, asks, and takes the last resort's steps with the driver's answer (lending a busy stream's
// hole in device order, where the out-of-memory path would synchronise), once. With the sim driver, which
// has no other users, the known answer is the driver's: the replay's decisions are the same as when every
// decision asked (docs/RESULTS.md, "Driver time on the allocation path").
// The periodic question need not wait on a caller: after kRefreshAt growths on one answer, the background
// worker (Note [Background work]) asks, and its answer replaces the old one if no call that changes free
// memory (a create, release or unmap, counted by the driver: Driver::memory_changes) began while it asked and
// the path has neither asked nor forgotten since; an answer not kept makes the next growth want another. So
// with the worker on, the path asks only near a decision's threshold, after a refused create, or when the
// worker is kept from answering for kAskEvery - kRefreshAt growths (a capture, a busy worker, growths that
// keep changing memory while it asks). A question alone starts no worker thread: the start (tens of µs)
// would fall on the path of the growth that wanted it, and BM_GrowthPath, which builds an engine per
// iteration, went from 1.97 to 2.6 times expandable's time when it did. Until other work starts the worker (a
// split, any range lent without a synchronisation, or a reserve of pages that gap growths want, Note [Growth
// reserve]: their first wake pays that start once), in a program that never has such work (handles:pages with
// nothing lent), after it stopped at exit, and with `background:False`, the path asks every kAskEvery growths.
void FraglessPolicy::device_free(Growth& g) {
  KnownFree& k = known_free_;
  const std::size_t missing = (g.need > g.planned ? g.need - g.planned : 0) * page_;
  if (k.valid && k.uses < kAskEvery) {
    const std::size_t known = known_now(k, s_.held_bytes());
    const std::size_t margin = k.total / 8;
    const std::size_t tight_at = missing + process_limit(k.total) / 2;  // where memory_tight turns
    if (known >= missing + margin && (known >= tight_at + margin || known + margin <= tight_at)) {
      // The worker asks before the path must; again at the next growth if its answer was not kept.
      if (++k.uses >= kRefreshAt && refresh_ == Refresh::none && s_.background.running()) {
        refresh_ = Refresh::wanted;
        s_.background.wake();
      }
      g.free_bytes = known;
      g.total_bytes = k.total;
      g.asked = g.known = true;
      return;
    }
  }
  s_.driver->memory_info(&g.free_bytes, &g.total_bytes);
  g.asked = true;
  k = KnownFree{true, g.free_bytes, g.total_bytes, s_.held_bytes(), 0};
  new_answer();
}

bool FraglessPolicy::take_memory_info(BackgroundJob* job) {
  if (refresh_ != Refresh::wanted) return false;
  refresh_ = Refresh::asking;
  job->kind = BackgroundJob::Kind::memory_info;
  job->changes = s_.driver->memory_changes();
  job->id = answers_;
  job->outcome = BackgroundJob::Outcome::cancelled;
  return true;
}

void FraglessPolicy::finish_memory_info(const BackgroundJob& job) {
  if (refresh_ == Refresh::asking) refresh_ = Refresh::none;
  // Kept only if no create, release or unmap began while it was asked (the driver may or may not count
  // such a call in its answer: a release and an equal create between take and finish leave what fragless
  // holds the same but the answer too high), and if the path has asked or forgotten nothing since (its
  // answer is as new, or a refused create says memory went unseen). A driver that could not answer says
  // 0 of 0 (cuda_driver.cpp): not an answer. Otherwise the next growth wants another question.
  if (job.outcome == BackgroundJob::Outcome::done && job.total_bytes > 0 &&
      job.changes == s_.driver->memory_changes() && job.id == answers_)
    known_free_ = KnownFree{true, job.free_bytes, job.total_bytes, s_.held_bytes(), 0};
}

// Pages that could still be created within the device's free memory and the memory fraction, as the
// growth knows them (device_free).
std::size_t FraglessPolicy::creatable_pages(Growth& g, std::size_t* limit_pages) {
  if (!g.asked) device_free(g);
  std::size_t free_b = g.free_bytes;
  // The held bytes are read once: the worker's creates change them without the engine's lock.
  if (s_.memory_limited) free_b = within_fraction(free_b, s_.held_bytes());
  if (limit_pages) *limit_pages = process_limit(g.total_bytes) / page_;
  return free_b / page_;
}

bool FraglessPolicy::memory_tight(Growth& g, std::size_t pages) {
  std::size_t limit = 0;
  return creatable_pages(g, &limit) < pages + limit / 2;
}

// Appends `pages` to sizes as handles of at most `most` pages each.
static void push_capped(std::vector<std::size_t>& sizes, std::size_t pages, std::size_t most) {
  for (; pages > 0; pages -= sizes.back()) sizes.push_back(std::min(pages, most));
}

// The handles a growth of `missing` pages, the first at segment page `at`, creates (Note [Whole
// handles]). With `ends` and `whole`, the last one may be rounded up to chunk_size, but by no more than
// reserve_slack of live bytes and never past the room: fewer cuMemCreate calls at a bounded cost in idle
// memory.
const std::vector<std::size_t>& FraglessPolicy::shape(Growth& g, std::size_t missing, std::size_t room, std::size_t at,
                                                      bool small, bool frontier) {
  std::vector<std::size_t>& sizes = shape_;
  sizes.clear();
  if (s_.opts.handle_shape == HandleShape::pages) {
    sizes.assign(missing, 1);
    return sizes;
  }
  const std::size_t chunk = std::max<std::size_t>(1, s_.opts.chunk_size / page_);
  const auto live = static_cast<double>(std::max<std::int64_t>(0, s_.stats.live_bytes.current));
  const auto slack = static_cast<std::size_t>(live * s_.opts.reserve_slack) / page_;
  if (s_.opts.handle_shape == HandleShape::cells)  // Note [Cells]
    return cells(g, missing, room, at, cell_pages(small), frontier);
  std::size_t extra = std::min(room, std::max(missing, std::min(chunk, missing + slack))) - missing;
  if (extra && !can_create(g, missing + extra)) extra = 0;
  if (s_.opts.handle_shape == HandleShape::whole || missing < 2) {
    sizes.push_back(missing + extra);
    return sizes;
  }
  // The body in handles of at most handle_max pages, then the last page (which a neighbour may share)
  // with the slack: a live block that later straddles a body handle pins less than handle_max of it.
  const std::size_t body_max = std::max<std::size_t>(1, s_.opts.handle_max / page_);
  push_capped(sizes, missing - 1, body_max);
  push_capped(sizes, 1 + extra, body_max);
  return sizes;
}

// A cell of Note [Cells], in pages: one small buffer (2 MiB) in the small pool; in the large pool
// reserve_slack of live bytes, at least a page and at most chunk_size.
std::size_t FraglessPolicy::cell_pages(bool small) const {
  if (small) return std::max<std::size_t>(1, kSmallBuffer / page_);
  const std::size_t chunk = std::max<std::size_t>(1, s_.opts.chunk_size / page_);
  const auto live = static_cast<double>(std::max<std::int64_t>(0, s_.stats.live_bytes.current));
  return std::clamp<std::size_t>(static_cast<std::size_t>(live * s_.opts.reserve_slack) / page_, 1, chunk);
}

// Note [Cells]
// handles:cells creates new memory the way expandable segments do, in cells of the segment (in the large pool
// chunk_size_mb, expandable's 20 MiB page, but no more than reserve_slack of live bytes, so a small job's free tail
// stays small; in the small pool one 2 MiB page), so a growth makes no more cuMemCreate calls than the cells it
// touches and leaves a free tail no longer than a cell: at the end of what its segment maps, a growth ends on a
// cell boundary (the rest of the last cell is free space after the request, as in expandable's last page); the
// cells that lie wholly inside the request, with the rest of a cell begun earlier below them, are one handle (of
// at most handle_max_mb): only the request uses them, so nothing else pins them, and a large request costs one
// call, not one per cell; the last cell is a handle of its own, as a later neighbour may share the request's
// last page, and then pins no more than that cell. (The rest of a cell
// begun earlier was a handle of its own too until 2026-12-03, one create more for every growth that starts
// mid-cell, which re-backing makes common: joined, over every input of docs/RESULTS.md's driver table the path's
// driver time fell by 1.4% and transformer-train's peak by 96 MiB; no peak rose by more than 4 MiB, and the zoo's
// property test found as many draws above a peer over 25 new seeds, 32.) A growth that covers no whole cell (a
// request of about a cell or less) is one handle from its first page to the end of its last cell, across the cell
// boundary it may cross: cut there, its lower part would be pinned by the request alone while it lives, as the
// whole is (once the request is freed, a block left in the tail pins the whole handle, where the cut left the lower
// part free to move), and the cut cost a create on every growth that starts where re-backing left the end of the
// mapped pages mid-cell (measured against cutting at ad92272, over every input of the driver table in
// docs/RESULTS.md: the path's driver time fell by a further 0.5%, transformer-infer's by 14%, and no input's peak
// rose by more than 2 MiB). A growth into a gap between mapped pages (a hole whose memory re-backing moved
// elsewhere) creates only what it misses, leaving no free tail between live blocks, and with no tail to bound it is
// not cut at cell boundaries either: its pages are one handle (of at most handle_max_mb), one call where cutting
// cost up to three (the rest of a cell, the body, the last page). Only its last page can be shared with a later
// neighbour, which pins the handle until both are freed; measured against cutting at 6a8cbb6, over every input
// of docs/RESULTS.md's driver table the allocation path's driver time fell by 3% (transformer-infer's by 15%) for the
// same peaks within 14 MiB. Once an allocation that used part of a multi-page handle of a default pool is freed
// and the handle is free, it is split into pieces in the background (Note [Split in the background]; a handle
// no block has used stays whole), so re-backing then moves that memory a piece at a time.
//
// Near the limit no handle is larger than chunk_size_mb (expandable's page): once a growth would leave less than
// half of what the process may hold (the device, or per_process_memory_fraction of it) still creatable, its body is
// created in handles of at most that. A handle of handle_max_mb that a smaller block reuses before its split pins the
// rest of it until that block goes, and an out-of-memory retry cannot give that back (it is mapped, and a mapping is
// unmapped whole): far from the limit that costs reserved memory, near it an allocation. Not the cell: a small job's
// cell is a page, and on a GPU that others half fill a large tensor would be created page by page. With unlimited
// memory (the replay's default device) nothing changes. Measured with `fragless-replay --fit --fit-step 0.0625`
// (docs/RESULTS.md, "What fits"): three `random` variants need less device (the worst, 2 streams and a 16 GiB live
// cap, from 17.62 to 17.06 GiB, as expandable), the dev traces' fits are unchanged, the largest moe token count
// grows on every device size; `serving` needs 1/16 GiB more (12.81 against 12.75).
const std::vector<std::size_t>& FraglessPolicy::cells(Growth& g, std::size_t missing, std::size_t room, std::size_t at,
                                                      std::size_t chunk, bool frontier) {
  // Only a growth at the end of what the segment maps rounds up to a cell's end: one inside a gap (a hole
  // re-backed elsewhere) would leave its free tail between live blocks.
  std::size_t end = frontier ? std::min(at + room, (at + missing + chunk - 1) / chunk * chunk) : at + missing;
  if (end > at + missing && !can_create(g, end - at)) end = at + missing;
  std::size_t body_max = std::max<std::size_t>(1, s_.opts.handle_max / page_);
  // Near the limit: no handle larger than expandable's page (chunk_size_mb), nor than a cell where cells are larger.
  if (const std::size_t near = std::max(chunk, s_.opts.chunk_size / page_);
      body_max > near && memory_tight(g, end - at))
    body_max = near;
  std::vector<std::size_t>& sizes = shape_;
  sizes.clear();
  if (!frontier) {  // a gap: what it misses, in handles of at most handle_max
    push_capped(sizes, missing, body_max);
    return sizes;
  }
  // The cells covered whole by the request's pages but its last (a neighbour may share the last page).
  const std::size_t body_lo = (at + chunk - 1) / chunk * chunk, body_hi = (at + missing - 1) / chunk * chunk;
  if (body_hi <= body_lo) {  // no whole cell: the request and the rest of its last cell, in one handle
    push_capped(sizes, end - at, body_max);
    return sizes;
  }
  push_capped(sizes, body_hi - at, body_max);   // the rest of a cell begun earlier and the whole cells
  push_capped(sizes, end - body_hi, body_max);  // the last cell: the request's last page and the tail after it
  return sizes;
}

// Creates the handles for `missing` pages; they join the request. A handle that cannot be had in one
// piece is created page by page (the last resort when physical memory is too fragmented for a large one).
Status FraglessPolicy::create(Growth& g, std::size_t missing, std::size_t room, std::size_t at, bool small,
                              bool frontier, std::vector<PhysHandle>* created) {
  for (std::size_t pages : shape(g, missing, room, at, small, frontier)) {
    if (!s_.capacity_allows(pages * page_)) return Status::out_of_memory;
    PhysHandle h = 0;
    Status st = s_.driver->create(pages * page_, &h);
    if (st == Status::ok) {
      add_created(g, h, pages, created);
      continue;
    }
    forget_device_free();  // the driver refused what its free memory seemed to allow: ask it next time
    g.refused = true;
    // Refused on an answer known without asking: the growth asks and plans again (map_pages), before any
    // page by page.
    if (st != Status::out_of_memory || pages == 1 || g.known) return st;
    for (std::size_t i = 0; i < pages; ++i) {
      if ((st = s_.driver->create(page_, &h)) != Status::ok) return st;
      add_created(g, h, 1, created);
    }
  }
  return Status::ok;
}

// Note [Growth reserve] (fragless_policy.h): a growth into a gap that still misses no more than a cell (after
// idle handles and holes) counts that as demand.
void FraglessPolicy::reserve_demand(const Growth& g, bool gap) {
  const std::size_t missing = g.need - g.planned;
  if (gap && !s_.capturing() && missing <= cell_pages(false)) gap_demand_ += static_cast<double>(missing);
}

// After a growth: the worker is woken if the reserve is short of its target. (The first wake starts the worker
// thread, on this growth's path, once: the demand says more such growths are coming.)
void FraglessPolicy::refill_reserve() {
  if (!reserve_in_flight_ && !s_.capturing() && background() && pool_.reserve_pages() < reserve_target())
    s_.background.wake();
}

std::size_t FraglessPolicy::reserve_target() const {
  if (!s_.opts.growth_reserve || gap_demand_ < kReserveMinDemand) return 0;
  return std::min(cell_pages(false), static_cast<std::size_t>(gap_demand_));
}

bool FraglessPolicy::take_reserve_job(BackgroundJob* job) {
  if (reserve_in_flight_) return false;
  const std::size_t have = pool_.reserve_pages(), want = reserve_target();
  if (have >= want) return false;
  // As a refill (Note [Refills]): never past reserve_slack above the peak of live bytes, plus two pages.
  // (Making as many pages as that leaves room for, when not all: the large rl draw's path 174.6 -> 162.8 ms, but
  // over the general table's five seeds 179 draws meeting every target against 180, and 758 MiB above a peer
  // against 748.)
  const std::size_t pages = want - have, bytes = pages * page_;
  if (past_refill_bound(bytes)) return false;
  // Only on an answer known without asking, and never near the limit: what is left creatable after the
  // pages must stay above half of what the process may hold (memory_tight's rule), within the fraction.
  // The answer must be one a growth would still use (kAskEvery), and the pages must leave that half with the
  // margin of Note [Asking for free memory] (another user of the device may have taken an eighth of it unseen).
  const KnownFree& k = known_free_;
  if (!k.valid || k.uses >= kAskEvery) return false;
  const std::size_t held = s_.held_bytes();
  const std::size_t creatable = s_.memory_limited ? within_fraction(known_now(k, held), held) : known_now(k, held);
  if (creatable < bytes + process_limit(k.total) / 2 + k.total / 8 || !s_.capacity_allows(bytes)) return false;
  job->kind = BackgroundJob::Kind::reserve;
  job->pages = pages;
  job->outcome = BackgroundJob::Outcome::done;
  reserve_in_flight_ = true;
  return true;
}

// Without the lock: page after page, until one is refused or the job is asked to stop.
void FraglessPolicy::run_reserve(Driver& d, std::size_t page, BackgroundJob& job, const std::atomic<bool>& abort) {
  for (std::size_t i = 0; i < job.pages && !abort.load(std::memory_order_relaxed); ++i) {
    PhysHandle h = 0;
    if (d.create(page, &h) != Status::ok) {
      job.create_refused = true;
      return;
    }
    job.created.push_back(h);
  }
}

// What was created joins the reserve (and reserved) even when the job was stopped: empty_cache and the
// out-of-memory retry wait for it, then give the reserve back. A refused create says the known free memory was
// wrong: it is forgotten (no job is taken again until a growth has asked the driver) and the demand halved,
// as a growth's refused create forgets it. A page past the memory fraction (lowered while the job ran) goes to
// the deferred releases, released at the next slow path with no driver call here.
void FraglessPolicy::finish_reserve(BackgroundJob& job) {
  reserve_in_flight_ = false;
  if (job.create_refused) {
    forget_device_free();
    gap_demand_ /= 2;
  }
  for (PhysHandle h : job.created) {
    if (s_.memory_limited && s_.total_reserved + page_ > s_.allowed_memory_maximum) {
      s_.deferred_handles.push_back(h);
      continue;
    }
    pool_.add_reserve(h);
    s_.add_reserved(false, static_cast<std::int64_t>(page_));
    emit(s_, TraceAction::phys_create, 0, 0, page_, page_);
  }
}

void FraglessPolicy::add_created(Growth& g, PhysHandle h, std::size_t pages, std::vector<PhysHandle>* created) {
  pool_.add_taken(h, pages);
  g.planned += pages;
  g.free_bytes -= std::min(g.free_bytes, pages * page_);  // what the driver would now answer
  created->push_back(h);
  s_.add_reserved(false, static_cast<std::int64_t>(pages * page_));
  emit(s_, TraceAction::phys_create, 0, 0, pages * page_, pages * page_);
}

}  // namespace fragless
