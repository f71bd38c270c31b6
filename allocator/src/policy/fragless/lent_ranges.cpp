#include "policy/fragless/lent_ranges.h"

#include <algorithm>
#include <thread>

#include "state/trace_emit.h"

namespace fragless {

void LentRanges::add(Segment& seg, std::size_t first, std::size_t n, Event event, std::vector<PhysHandle> handles) {
  Range& r = ranges_.emplace_back();
  r.seg = &seg;
  r.first = first;
  r.n = n;
  r.event = event;
  r.id = next_id_++;
  r.handles = std::move(handles);
}

bool LentRanges::hold_released(PhysHandle h, std::size_t bytes) {
  for (Range& r : ranges_)
    if (r.state.load(std::memory_order_acquire) != unmapped &&
        std::find(r.handles.begin(), r.handles.end(), h) != r.handles.end()) {
      r.held_bytes += bytes;
      return true;
    }
  return false;
}

std::size_t LentRanges::held_bytes() const {
  std::size_t n = 0;
  for (const Range& r : ranges_) n += r.held_bytes;
  return n;
}

std::size_t LentRanges::room_before(const Segment& seg, std::size_t first, std::size_t need, std::size_t room) const {
  for (const Range& r : ranges_)
    if (r.seg == &seg && r.first >= first + need && r.first < first + room) room = r.first - first;
  return room;
}

bool LentRanges::overlaps(const Segment& seg, std::size_t first, std::size_t n) const {
  for (const Range& r : ranges_)
    if (hits(r, &seg, first, n)) return true;
  return false;
}

bool LentRanges::pending(const Segment& seg, std::size_t first, std::size_t n) {
  for (Range& r : ranges_) {
    if (!hits(r, &seg, first, n)) continue;
    const int st = r.state.load(std::memory_order_acquire);
    if (st == unmapped || st == claimed) continue;  // gone, or being unmapped by the worker now
    if (st == waiting || s_.driver->query_event(r.event) != Status::ok) return true;
  }
  return false;
}

int LentRanges::settle(const Range& r) {
  int st;
  while ((st = r.state.load(std::memory_order_acquire)) == claimed) std::this_thread::yield();
  return st;
}

void LentRanges::drop(Range& r) {
  if (r.state.load(std::memory_order_acquire) != unmapped)
    s_.give_back_mapping(r.seg->base + r.first * page_, r.n * page_);
  s_.driver->release_event(r.event);
  if (r.held_bytes) {  // the memory of handles released while this mapping held them goes now
    s_.add_reserved(false, -static_cast<std::int64_t>(r.held_bytes));
    emit(s_, TraceAction::phys_release, 0, 0, r.held_bytes, r.held_bytes);
  }
}

bool LentRanges::poll(bool background) {
  if (background) {  // the worker unmaps them; only give it another go at those that were not done
    bool any = false;
    for (Range& r : ranges_) {
      int expected = waiting;
      r.state.compare_exchange_strong(expected, open, std::memory_order_relaxed);
      any |= r.state.load(std::memory_order_relaxed) == open;
    }
    return any;
  }
  for (auto it = ranges_.begin(); it != ranges_.end();) {
    const int st = it->state.load(std::memory_order_acquire);
    if (st == claimed || (st != unmapped && s_.driver->query_event(it->event) != Status::ok)) {
      ++it;
      continue;
    }
    drop(*it);
    it = ranges_.erase(it);
  }
  return false;
}

bool LentRanges::finish(const Segment* seg, std::size_t first, std::size_t n) {
  bool all = true;
  for (auto it = ranges_.begin(); it != ranges_.end();) {
    if (!hits(*it, seg, first, n)) {
      ++it;
      continue;
    }
    if (settle(*it) != unmapped && s_.driver->query_event(it->event) != Status::ok) {
      ++s_.stats.num_forced_syncs;
      if (s_.driver->synchronize_event(it->event) != Status::ok) {
        s_.wait_failed("a lent range's event");  // the old mapping stays (Note [Failed waits])
        it->state.store(waiting, std::memory_order_relaxed);
        all = false;
        ++it;
        continue;
      }
    }
    drop(*it);
    it = ranges_.erase(it);
  }
  return all;
}

// ---- Background work ----

bool LentRanges::take(BackgroundJob* job) {
  for (Range& r : ranges_) {
    if (r.state.load(std::memory_order_relaxed) != open) continue;
    r.state.store(claimed, std::memory_order_relaxed);
    job->kind = BackgroundJob::Kind::unmap_lent;
    job->va = r.seg->base + r.first * page_;
    job->pages = r.n;
    job->event = r.event;
    job->id = r.id;
    job->claim = &r.state;
    return true;
  }
  return false;
}

void LentRanges::run(Driver& d, BackgroundJob& job, const std::atomic<bool>& abort) {
  // The range is the worker's until it stores another state: no one else queries its event or unmaps it.
  int st = waiting;  // not done yet, or the unmap failed: a later slow path or the next round deals with it
  if (!abort.load(std::memory_order_relaxed) && d.query_event(job.event) == Status::ok &&
      d.unmap(job.va, job.pages * d.granularity()) == Status::ok)
    st = unmapped;
  job.outcome = st == unmapped ? BackgroundJob::Outcome::done : BackgroundJob::Outcome::cancelled;
  job.claim->store(st, std::memory_order_release);
}

void LentRanges::finish_job(BackgroundJob& job) {
  if (job.outcome != BackgroundJob::Outcome::done) return;  // still lent: the range stays as it is
  for (auto it = ranges_.begin(); it != ranges_.end(); ++it)
    if (it->id == job.id) {  // (the allocation path may have dropped it already)
      drop(*it);
      ranges_.erase(it);
      return;
    }
}

std::string LentRanges::check() const {
  for (const Range& r : ranges_) {
    const DevicePtr lo = r.seg->base + r.first * page_, hi = lo + r.n * page_;
    if (r.first + r.n > r.seg->pages.size()) return "fragless: a lent range lies outside its segment";
    for (std::size_t i = r.first; i < r.first + r.n; ++i)
      if (r.seg->pages[i].valid()) return "fragless: a lent range was mapped again before its old mapping went";
    // The engine sees the range as unmapped: it must lie inside unmapped blocks.
    for (Block* b = r.seg->first; b; b = b->next)
      if (b->ptr < hi && b->ptr + b->size > lo && b->state != BlockState::unmapped)
        return "fragless: a lent range overlaps a block that is not unmapped";
  }
  return {};
}

}  // namespace fragless
