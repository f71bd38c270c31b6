#include "policy/fragless/handle_splitter.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "state/trace_emit.h"

namespace fragless {

// ---- Where multi-page handles are mapped ----

void HandleSplitter::mapped(Segment& seg, std::size_t first, PhysHandle h) {
  if (pool_.pages(h) < 2) return;
  // A growth at the end of the highest-addressed segment comes last: no search then (else the hint is ignored).
  multi_.emplace_hint(multi_.end(), &seg, first);
  where_[h] = {&seg, first};
}

void HandleSplitter::unmapped(const Segment& seg, std::size_t first, PhysHandle h) {
  if (pool_.pages(h) < 2) return;
  multi_.erase({&seg, first});
  where_.erase(h);  // a queued split of h waits for h to be mapped again, wherever that is
}

bool HandleSplitter::any_multi(const Segment& seg, std::size_t first, std::size_t n) const {
  auto it = multi_.lower_bound({&seg, first});
  return it != multi_.end() && it->first == &seg && it->second < first + n;
}

// ---- Finding work ----

bool HandleSplitter::freed(Block* b, DevicePtr lo_va, DevicePtr hi_va) {
  const Segment& seg = *b->segment;
  const std::size_t lo = (b->ptr - seg.base) / page_, hi = (b->ptr + b->size - seg.base + page_ - 1) / page_;
  // A multi-page mapping that starts before b may still reach into it: start from the one before lo.
  auto it = multi_.lower_bound({&seg, lo});
  if (it != multi_.begin() && std::prev(it)->first == &seg) --it;
  bool overlaps = false, queued = false;
  for (; it != multi_.end() && it->first == &seg && it->second < hi; ++it) {
    const std::size_t start = it->second;
    const PhysHandle h = seg.pages[start].handle;
    const std::size_t end = start + pool_.pages(h);
    if (end <= lo) continue;
    overlaps = true;
    const DevicePtr va = seg.base + start * page_, va_end = seg.base + end * page_;
    if (va < b->ptr || va_end > b->ptr + b->size) continue;  // a live neighbour still uses part of it
    if (seg.owner != &s_.default_pools) continue;
    if (queued_.find(h)) {  // already queued: b is where its split will look first
      hints_[h] = b;
      continue;
    }
    if (va_end <= lo_va || va >= hi_va) continue;  // untouched since it was created: left whole
    queued_[h] = true;
    hints_[h] = b;
    queue_[pool_.pages(h)].push_back(h);
    queued = true;
  }
  if (!overlaps) b->multi = false;
  if (!retry_.empty()) {  // new activity: what was cancelled gets another chance
    for (PhysHandle h : retry_) {
      if (where_.find(h)) {
        queue_[pool_.pages(h)].push_back(h);
      } else {  // idle, or gone: queued again when it is freed where it is mapped next
        queued_.erase(h);
        hints_.erase(h);
      }
    }
    retry_.clear();
    queued = true;
  }
  return queued;
}

// The free block of seg holding [va, va + len), found by walking seg's blocks by address from `hint`. A block
// object is never given back to the heap (a deleted one is reset, its segment null, and reused), so the hint
// is safe to read however stale: while its segment is still seg it is one of seg's blocks, wherever it is now,
// and the walk from it is short (the hint was the block over the handle when it was queued); otherwise the
// walk starts at the segment's first block.
Block* HandleSplitter::covering(Segment& seg, Block* hint, DevicePtr va, std::size_t len) const {
  Block* b = hint && hint->segment == &seg ? hint : seg.first;
  while (b && b->ptr > va) b = b->prev;
  while (b && b->ptr + b->size <= va) b = b->next;
  const bool holds = b && b->state == BlockState::free && b->in_size_set && va + len <= b->ptr + b->size;
  return holds ? b : nullptr;
}

Block* HandleSplitter::carve(Block* b, DevicePtr va, std::size_t len) {
  s_.pool_erase(b);
  Block* mid = b;
  if (va > b->ptr) {
    mid = s_.split_after(b, va);
    s_.pool_insert(b);
  }
  if (va + len < mid->ptr + mid->size) s_.pool_insert(s_.split_after(mid, va + len));
  mid->state = BlockState::busy;
  return mid;
}

bool HandleSplitter::take(BackgroundJob* job) {
  while (!queue_.empty()) {  // the largest first, the oldest among equals (Note [Split in the background])
    auto largest = queue_.begin();
    const PhysHandle h = largest->second.front();
    largest->second.pop_front();
    if (largest->second.empty()) queue_.erase(largest);
    if (!queued_.erase(h)) continue;  // stale: its handle went back to the driver after it was queued
    Block* hint = nullptr;
    if (Block** kept = hints_.find(h)) {
      hint = *kept;
      hints_.erase(h);
    }
    const auto* w = where_.find(h);
    if (!w) continue;  // idle, or gone: queued again when it is freed where it is mapped next
    Segment& seg = *w->first;
    // Queued in the default pool, a handle may since have gone idle and been taken by a private pool's growth:
    // a graph may replay into it on a stream the split's event does not cover, so it is never split there.
    if (seg.owner != &s_.default_pools) continue;
    const std::size_t first = w->second, k = pool_.pages(h);
    const DevicePtr va = seg.base + first * page_;
    Block* b = covering(seg, hint, va, k * page_);
    if (!b) continue;  // reused, or merged into a range with a live block
    // The range's last users queued their work on its stream before it went back to the pool; an event
    // recorded now completes after all of it (R13: what is unmapped must not be in use). It is recorded
    // here, under the lock: once the lock is free the program may destroy the stream (Note [Destroyed
    // streams]). A destroyed stream's work is waited for by its own event: the split waits until it is done.
    Event e = 0;
    const bool retired = s_.retired(b->stream);
    if (retired ? !s_.retired_done(b->stream) : s_.driver->record_event(b->stream, &e) != Status::ok) {
      queued_[h] = true;  // another chance at the next free, as a cancelled split gets
      retry_.push_back(h);
      hints_[h] = b;
      continue;
    }
    job->event = e;
    job->waits = !retired;
    job->kind = BackgroundJob::Kind::split;
    job->segment = &seg;
    job->first = first;
    job->pages = k;
    job->va = va;
    job->handle = h;
    job->to_pages = !coarse_ && pieces_.find(h);
    job->stream = b->stream;
    job->busy = carve(b, va, k * page_);
    job->alias = kEngineHandleBit | next_alias_++;
    rename(seg, first, h, job->alias);
    job->created.clear();
    job->unreleased.clear();
    job->still_mapped.clear();
    job->outcome = BackgroundJob::Outcome::cancelled;
    job->release_failed = false;
    return true;
  }
  return false;
}

// Note [Handle aliases]: while the job runs, the engine calls the handle job.alias (driver.h, R8).
void HandleSplitter::rename(Segment& seg, std::size_t first, PhysHandle from, PhysHandle to) {
  const std::size_t k = pool_.pages(from);
  pool_.rename_mapped(from, to);
  where_.erase(from);
  where_[to] = {&seg, first};
  if (pieces_.erase(from)) pieces_[to] = true;
  for (std::size_t i = 0; i < k; ++i) seg.pages.slot(first + i).handle = to;
}

// ---- The driver calls (no lock) ----

// Note [Split in the background]: 1, 1, 2, 4, ... from the bottom, the last piece what is left.
void HandleSplitter::piece_sizes(std::size_t pages, std::vector<std::size_t>* sizes) {
  sizes->assign(1, 1);
  for (std::size_t total = 1; total < pages;) {
    const std::size_t k = std::min(total, pages - total);
    sizes->push_back(k);
    total += k;
  }
}

void HandleSplitter::run(Driver& d, std::size_t page, BackgroundJob& job, const std::atomic<bool>& abort,
                         bool manual) {
  using Outcome = BackgroundJob::Outcome;
  auto aborted = [&] { return abort.load(std::memory_order_relaxed); };
  // The event take() recorded on the range's stream (R13: what is unmapped must not be in use).
  Status q = Status::ok;
  if (job.waits) {
    for (auto wait = std::chrono::microseconds(20); (q = d.query_event(job.event)) == Status::not_ready;) {
      if (manual || aborted() || wait > std::chrono::milliseconds(50)) break;  // try again later
      std::this_thread::sleep_for(wait);
      wait *= 2;
    }
    d.release_event(job.event);
  }
  if (q != Status::ok || aborted()) return;
  if (d.unmap(job.va, job.pages * page) != Status::ok) return;  // nothing changed
  job.outcome = Outcome::gave_back;  // from here on, a failure leaves the range unmapped and released
  if (d.release(job.handle) != Status::ok) {
    job.release_failed = true;
    return;
  }
  if (job.to_pages)
    job.sizes.assign(job.pages, 1);
  else
    piece_sizes(job.pages, &job.sizes);
  for (std::size_t k : job.sizes) {
    PhysHandle h = 0;
    if (aborted() || d.create(k * page, &h) != Status::ok) break;
    job.created.push_back(h);
  }
  std::size_t mapped = 0, n = 0;
  if (job.created.size() == job.sizes.size())
    for (; n < job.sizes.size() && d.map(job.va + mapped * page, job.sizes[n] * page, job.created[n], 0) == Status::ok; ++n)
      mapped += job.sizes[n];
  if (mapped == job.pages && d.set_access(job.va, job.pages * page) == Status::ok) {
    job.outcome = Outcome::done;
    return;
  }
  // Undo: nothing of the new pages stays. What the driver refuses here goes to the engine's deferred
  // unmaps and releases (finish), retried before anything maps over the range and at every release, as the
  // path's own failed give-backs are: a handle whose release failed here was lost until the process ended.
  if (mapped && d.unmap(job.va, mapped * page) != Status::ok) d.still_mapped(job.va, mapped * page, &job.still_mapped);
  job.sizes.clear();
  for (PhysHandle h : job.created)
    if (d.release(h) != Status::ok) job.unreleased.push_back(h);
  job.created.clear();
}

// ---- The results (lock held) ----

void HandleSplitter::release_busy(Block* busy, bool mapped, bool multi) {
  if (mapped) {
    busy->state = BlockState::free;
    busy->multi = multi;
    s_.pool_insert(s_.merge_free(busy));
    return;
  }
  busy->state = BlockState::unmapped;
  s_.stats.segment.add(busy->segment->small, busy->mapped_neighbours() - 1);  // Note [Mapped ranges are segments]
  s_.unmapped_insert(s_.merge_unmapped(busy));
}

void HandleSplitter::finish(BackgroundJob& job) {
  using Outcome = BackgroundJob::Outcome;
  Segment& seg = *job.segment;
  const std::size_t bytes = job.pages * page_;
  if (job.outcome == Outcome::cancelled) {  // the handle is still the driver's (never released)
    rename(seg, job.first, job.alias, job.handle);
    job.busy->state = BlockState::free;
    Block* back = s_.merge_free(job.busy);
    s_.pool_insert(back);
    if (!queued_.find(job.handle)) {
      queued_[job.handle] = true;
      retry_.push_back(job.handle);
    }
    hints_[job.handle] = back;
    return;
  }
  multi_.erase({&seg, job.first});
  where_.erase(job.alias);
  if (job.release_failed) s_.deferred_handles.push_back(job.handle);
  s_.deferred_unmaps.insert(s_.deferred_unmaps.end(), job.still_mapped.begin(), job.still_mapped.end());
  s_.deferred_handles.insert(s_.deferred_handles.end(), job.unreleased.begin(), job.unreleased.end());
  emit(s_, TraceAction::phys_release, 0, 0, bytes, bytes);
  if (job.outcome == Outcome::done) {
    pool_.replace_mapped(job.alias, job.created, job.sizes);
    pieces_.erase(job.alias);
    bool multi = false;
    for (std::size_t i = 0, at = job.first; i < job.created.size(); at += job.sizes[i], ++i) {
      for (std::size_t j = 0; j < job.sizes[i]; ++j) seg.pages.slot(at + j) = PageRef{job.created[i], j * page_};
      mapped(seg, at, job.created[i]);
      if (job.sizes[i] > 1) {
        multi = true;
        pieces_[job.created[i]] = true;
      }
      emit(s_, TraceAction::phys_create, 0, 0, job.sizes[i] * page_, job.sizes[i] * page_);
    }
    release_busy(job.busy, /*mapped=*/true, multi);  // its multi-page pieces split once used and freed
    return;
  }
  // Gave back: the range is unmapped and its memory released (or deferred), as by a release.
  pool_.remove_mapped(job.alias);
  pieces_.erase(job.alias);
  for (std::size_t i = 0; i < job.pages; ++i) seg.pages.slot(job.first + i) = PageRef{};
  seg.mapped_bytes -= bytes;
  s_.add_reserved(seg.small, -static_cast<std::int64_t>(bytes));
  ++s_.stats.num_device_free;
  emit(s_, TraceAction::segment_unmap, seg.stream, job.va, bytes, bytes);
  release_busy(job.busy, /*mapped=*/false);
}

std::string HandleSplitter::check() const {
  if (where_.size() != multi_.size()) return "fragless splitter: multi-page mappings miscounted by handle";
  bool unqueued_hint = false, misplaced = false;
  hints_.for_each([&](PhysHandle h, Block*) { unqueued_hint = unqueued_hint || !queued_.find(h); });
  if (unqueued_hint) return "fragless splitter: a hint kept for a handle that is not queued";
  where_.for_each([&](PhysHandle h, const std::pair<Segment*, std::size_t>& at) {
    const auto& [seg, first] = at;
    misplaced = misplaced || !multi_.count({seg, first}) || !s_.has_segment(seg) || seg->pages[first].handle != h;
  });
  if (misplaced) return "fragless splitter: a multi-page handle is not where the splitter has it";
  for (const auto& [seg, first] : multi_) {
    if (first >= seg->pages.size() || !seg->pages[first].valid() || seg->pages[first].offset != 0)
      return "fragless splitter: a recorded multi-page mapping is not mapped";
    if (pool_.pages(seg->pages[first].handle) < 2) return "fragless splitter: a recorded multi-page mapping is one page";
  }
  return {};
}

}  // namespace fragless
