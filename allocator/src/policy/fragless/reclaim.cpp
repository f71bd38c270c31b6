// The fragless policy's reclaim (fragless_policy.h): whole handles taken from under free blocks for the
// growth in progress, and the audit of Note [Complete re-backing].
#include <algorithm>
#include <limits>
#include <set>

#include "policy/fragless/fragless_policy.h"

namespace fragless {

// The pages of free block b that reclaim may take: its whole mappings beyond the run being grown (a
// block the run ends in keeps the part the run needs).
bool FraglessPolicy::reclaimable(const Block* b, const Growth& g, std::size_t* lo, std::size_t* hi) const {
  if (!whole_pages(b, lo, hi)) return false;
  const Segment& seg = *b->segment;
  if (b->ptr < g.run_hi && b->ptr + b->size > g.run_lo) {
    if (b->ptr < g.run_lo || g.run_hi <= seg.base) return false;
    *lo = std::max(*lo, round_up(g.run_hi - seg.base, page_) / page_);
  }
  return whole_mappings(seg, lo, hi);
}

// Free blocks of the default pools (never private ones) on `stream` (or on every other stream), outside
// the run being grown, with the whole mappings inside them.
// With `idle_only`, other streams' holes only where the stream has no unfinished work.
std::vector<FraglessPolicy::Candidate>& FraglessPolicy::candidates(Growth& g, Stream stream, bool other_streams,
                                                                   bool idle_only) {
  std::vector<Candidate>& cands = cands_;
  cands.clear();
  // The pools' free blocks are ordered by stream, then size: the walk skips the streams outside the group,
  // and each stream's blocks smaller than a page (they hold no whole page), without looking at them. A pool
  // whose free blocks are all on `stream` has none on another (the first and the last say so).
  Block key;
  for (const BlockPool* bp : {&s_.default_pools.large, &s_.default_pools.small}) {
    if (bp->paged == 0) continue;  // no free block holds a whole page
    if (other_streams && (bp->blocks.empty() || ((*bp->blocks.begin())->stream == stream &&
                                                 (*bp->blocks.rbegin())->stream == stream)))
      continue;
    for (auto it = bp->blocks.begin(); it != bp->blocks.end();) {
      Block* b = *it;
      if ((b->stream == stream) == other_streams) {  // on to the next stream
        if (b->stream == std::numeric_limits<Stream>::max()) break;
        key.stream = b->stream + 1;
        key.size = 0;
        it = bp->blocks.lower_bound(&key);
        continue;
      }
      if (b->size < page_) {  // on to this stream's blocks of a page or more
        key.stream = b->stream;
        key.size = page_;
        it = bp->blocks.lower_bound(&key);
        continue;
      }
      ++it;
      if (!b->segment->growable) continue;
      if (idle_only && other_streams && !idle(g, b->stream)) continue;
      std::size_t lo, hi;
      if (reclaimable(b, g, &lo, &hi)) cands.push_back({b, lo, hi});
    }
  }
  if (g.keep_small) {  // Note [The small pool keeps a cell]
    std::size_t small = 0;
    for (const Candidate& c : cands) small += c.b->segment->small ? c.hi - c.lo : 0;
    if (small <= small_keep()) std::erase_if(cands, [](const Candidate& c) { return c.b->segment->small; });
  }
  return cands;
}

std::size_t FraglessPolicy::reclaimable_pages(Growth& g) {
  std::size_t n = 0;
  for (bool other : {false, true})  // stream 0 and every other stream: each block once
    for (const Candidate& c : candidates(g, 0, other)) n += c.hi - c.lo;  // before keep_small is decided: all
  return n;
}

// Takes whole handles from holes until the request's need is met, never more than its room. Largest
// holes first; inside a hole, from the top down (the low part stays next to its allocated neighbour),
// adjacent handles in one unmap. Same-stream holes lend without a sync; other streams' holes wait for
// their streams first (counted).
void FraglessPolicy::reclaim(Growth& g, bool other_streams, std::size_t need, std::size_t room, bool busy_too) {
  const Stream stream = g.stream;
  std::vector<Candidate>& cands = candidates(g, stream, other_streams, /*idle_only=*/other_streams && !busy_too);
  if (cands.empty()) return;
  std::sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) { return a.hi - a.lo > b.hi - b.lo; });
  std::vector<Candidate> groups;
  std::size_t got = g.planned;
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
  std::set<Stream> failed;
  if (!lend && !waitless) {
    std::set<Stream> streams;
    for (const Candidate& c : groups) streams.insert(c.b->stream);
    for (Stream st : streams)  // cuMemUnmap is not stream-ordered; a failed wait takes nothing
      if (s_.forced_sync(st) != Status::ok) failed.insert(st);
  }
  const Unmap how{lend ? Unmap::Why::lend : Unmap::Why::reclaim, &g};
  for (const Candidate& c : groups)
    if (!failed.count(c.b->stream)) unmap_block_pages(c.b, c.lo, c.hi, how);
}

// Note [Complete re-backing], checked: just before memory is created, an independent recount (from the
// segments' block lists, not the pools' size sets) finds nothing on the requesting stream, nor, with
// lend_across_streams, on another stream with no unfinished work, that could still go under the request
// without waiting.
//
// Note [Auditing creations]
// The recount walks every block of every segment, as check_invariants does, and a growth that creates
// memory is frequent while memory first grows: run on every creation it was half of fragless's
// BM_GrowthPath. So it runs only in an engine whose invariants are being checked: from the first check()
// on (the randomized tests and the fuzzers call it after every operation).
void FraglessPolicy::audit_creation(Growth& g, const Segment& target, std::size_t missing, std::size_t room) {
  if (pool_.reserve_pages() >= missing) {
    audit_ = "fragless: created memory while the reserve held all it missed (Note [Growth reserve])";
    return;
  }
  if (pool_.idle_pages_within(room) > 0) {
    audit_ = "fragless: created memory while an idle handle fitted the request (Note [Complete re-backing])";
    return;
  }
  if (g.keep_small && (target.small || !can_create(g, missing))) {
    audit_ = "fragless: kept the small pool's free pages from a growth that could not create (Note [The small "
             "pool keeps a cell])";
    return;
  }
  // Pages of whole handles under free blocks of seg that fit the room.
  auto fitting = [&](const Segment& seg) {
    std::size_t n = 0;
    for (Block* b = seg.first; b; b = b->next) {
      if (!b->reusable()) continue;
      std::size_t lo, hi;
      if (!whole_pages(b, &lo, &hi)) continue;
      if (b->ptr < g.run_hi && b->ptr + b->size > g.run_lo) {  // the run's own part is not for taking
        if (b->ptr < g.run_lo) continue;
        lo = std::max(lo, (g.run_hi - seg.base + page_ - 1) / page_);
      }
      for (std::size_t i = lo; i < hi; ++i) {
        const std::size_t start = mapping_start(seg, i), len = pool_.pages(seg.pages[i].handle);
        n += start >= lo && start + len <= hi && len <= room;
      }
    }
    return n;
  };
  auto eligible = [&](const Segment& seg) {
    return seg.growable && seg.owner == &s_.default_pools &&
           (seg.stream == target.stream || (lend_across() && idle(g, seg.stream)));  // else it would need a wait
  };
  // Note [The small pool keeps a cell]: the small pool's free pages, on the stream and on other streams.
  std::size_t small_pages[2] = {0, 0};
  if (g.keep_small)
    for (const auto& seg : s_.segments)
      if (seg->small && eligible(*seg)) small_pages[seg->stream != target.stream] += fitting(*seg);
  for (const auto& seg : s_.segments) {
    if (!eligible(*seg)) continue;
    if (g.keep_small && seg->small && small_pages[seg->stream != target.stream] <= small_keep()) continue;
    if (fitting(*seg)) {
      audit_ = "fragless: created " + std::to_string(missing) + " pages while a free block on the stream "
               "held a whole handle that fitted (Note [Complete re-backing])";
      return;
    }
  }
}

}  // namespace fragless
