#include "policy/growable.h"

#include <algorithm>
#include <set>

#include "state/trace_emit.h"

namespace fragless {

bool GrowablePolicy::whole_pages(const Block* b, std::size_t* lo, std::size_t* hi) {
  const Segment& seg = *b->segment;
  const std::size_t start = b->ptr - seg.base, end = start + b->size;
  *lo = round_up(start, seg.page_size) / seg.page_size;
  *hi = end / seg.page_size;
  return *hi > *lo;
}

Segment* GrowablePolicy::new_segment(AllocParams& p) {
  const std::size_t page = page_size(p.pool->small);
  const std::size_t total = s_.device_total ? s_.device_total : (std::size_t{1} << 36);
  const std::size_t va_size = round_up(total + total / 8, page);
  PageTable table;
  if (!table.allocate(va_size / page)) {  // host memory for the page table: an out-of-memory like any other
    p.status = Status::out_of_memory;
    return nullptr;
  }
  DevicePtr va = 0;
  if (Status st = s_.driver->reserve(va_size, &va); st != Status::ok) {
    p.status = st;
    return nullptr;
  }
  Block* b = s_.add_segment(p, va, va_size, page, BlockState::unmapped);
  Segment* seg = b->segment;
  seg->growable = true;
  seg->pages.swap(table);
  s_.unmapped_insert(b);
  return seg;
}

// The lowest-address run of reusable and unmapped blocks on this stream that holds p.rounded bytes and
// contains at least one unmapped block, and whose pages the growth would map may be mapped now (may_map);
// returns its first block.
Block* GrowablePolicy::find_run(AllocParams& p) {
  Block key;
  key.stream = p.stream;
  auto fits = [&](Block* c) {
    std::size_t sum = 0;
    for (Block* b = c; b && (b->reusable() || b->state == BlockState::unmapped); b = b->next) {
      if (b->state == BlockState::unmapped) {  // grow() maps what is still missing from the block's start
        const Segment& seg = *b->segment;
        const std::size_t bytes = std::min(round_up(p.rounded - sum, seg.page_size), b->size);
        if (!may_map(seg, (b->ptr - seg.base) / seg.page_size, bytes / seg.page_size)) return false;
      }
      if ((sum += b->size) >= p.rounded) return true;
    }
    return false;
  };
  for (auto it = p.pool->unmapped.lower_bound(&key); it != p.pool->unmapped.end() && (*it)->stream == p.stream;
       ++it) {
    Block* c = *it;
    if (c->prev && c->prev->reusable()) c = c->prev;
    if (fits(c)) return c;
  }
  return nullptr;
}

Block* GrowablePolicy::map_block(Block* u, DevicePtr at, std::size_t bytes, const Run& run, Status* status) {
  Segment& seg = *u->segment;
  const std::size_t first = (at - seg.base) / seg.page_size;
  std::size_t n = bytes / seg.page_size;
  if (Status st = map_pages(seg, first, &n, (u->ptr + u->size - at) / seg.page_size, run); st != Status::ok) {
    *status = st;
    return nullptr;
  }
  bytes = n * seg.page_size;
  s_.unmapped_erase(u);
  Block* b = u;
  if (at > u->ptr) {  // the rest below stays unmapped
    b = s_.split_after(u, at);
    u->multi = false;
    s_.unmapped_insert(u);
  }
  if (bytes < b->size) {  // the rest above stays unmapped
    Block* rest = s_.split_after(b, b->ptr + bytes);
    rest->multi = false;
    s_.unmapped_insert(rest);
  }
  b->state = BlockState::free;
  b->multi = multi_page(seg, first, n);
  s_.stats.segment.add(seg.small, 1 - b->mapped_neighbours());  // Note [Mapped ranges are segments]
  seg.mapped_bytes += bytes;
  ++s_.stats.num_device_alloc;
  emit(s_, TraceAction::segment_map, seg.stream, b->ptr, bytes, bytes);
  return b;
}

// The pages a growth from run `head` (find_run's answer) maps: what the request needs past the free blocks
// the run begins with.
std::size_t GrowablePolicy::pages_missing(const AllocParams& p, const Block* head) const {
  std::size_t have = 0, missing = 0;
  for (const Block* b = head; b && have < p.rounded; b = b->next) {
    const std::size_t take = std::min(b->size, p.rounded - have);
    if (b->state == BlockState::unmapped) missing += round_up(take, b->segment->page_size) / b->segment->page_size;
    have += take;
  }
  return missing;
}

// Note [Near fits]
// A request that no free block holds grows the lowest run of free and unmapped blocks that fits it. A free
// block that almost holds it, with unmapped address space right below it, can instead be extended downwards by
// the few pages it lacks, so that the request lies over memory already mapped. The pattern this is for: Hugging
// Face's DynamicCache grows a KV cache by one token per decoding step, replacing each layer's keys and values by
// a tensor one token longer (torch.cat) while the old one is still live, so the hole the old one leaves misses
// the next tensor by a fraction of a page. Growing at the lowest run instead re-backs the largest holes
// (Note [Complete re-backing]), which is that hole, moving all of its pages for every layer and every token:
// workload:rl's allocation path spent 539 ms against expandable's 94, in 198,401 maps. Extended downwards, the
// hole keeps its pages and the growth maps the page or two it lacks.
//
// The free blocks from the request's size down to half of it are looked at (the largest first, at most
// kNearFitLooked of them); the one whose extension maps the fewest pages is taken when that saves at least
// near_fit_pages() pages against the lowest run: a saving of a few pages is not worth leaving the lowest address,
// which keeps the free space in long runs. Only downwards: a free block followed by unmapped space is already a
// run find_run looks at, and taking it out of address order as well (measured at 493b96e over the driver table
// of docs/RESULTS.md) put `serving` 58.9 ms over its driver target and `ckpt-accum` 18 MiB above a peer. The
// new pages go at the top of the unmapped block (grow_below), under the free block, which they join.
//
// The request goes at the top of the extended block, so its free bytes (less than a page) lie below it, next
// to the unmapped space. At the bottom, as a best fit places a request, they lay at its top, against the
// tensor above it; when that tensor was replaced first, its hole joined them and the new tensor began there, a
// little lower: a run of adjacent tensors slid down by a fraction of a page per token, and its lowest one needed
// a near fit every few tokens instead of once per page. Measured at 21a0ad0 against the request at the bottom:
// workload:rl's allocation path 239.0 → 205.9 ms (its set-access calls there 2,775 → 1,762; its peak 12,044 →
// 12,060 MiB), `random` 3.28% → 2.85% over live, the driver table of docs/RESULTS.md 2,938 → 2,905 ms on the
// path with the same 17 of 28 inputs meeting every target; over the general tables' seeds 1 to 3 the same
// draws and windows meet every target, and the draws' path is 104 ms shorter.
//
// A near fit never costs what the lowest run would not (both found by a review): a range whose lent pages the
// stream's queued work may still use (the fragless policy's lent ranges, Note [Lending pages without a sync])
// is passed over, as mapping there would wait for that work on the host (or fail with the wait's error); and a
// near fit that fails (its room is only the pages it lacks, so a larger idle handle or a hole's larger handle
// cannot go under it) leaves the request to the lowest run, which the retry chain, or during a capture the
// request's failure, would otherwise follow.
Block* GrowablePolicy::near_fit(AllocParams& p, const Block* lowest, DevicePtr* at) {
  const std::size_t gain = near_fit_pages();
  if (gain == 0) return nullptr;
  const std::size_t page = page_size(p.pool->small);
  const std::size_t low = lowest ? pages_missing(p, lowest) : round_up(p.rounded, page) / page;
  if (low <= gain) return nullptr;
  Block key;
  key.stream = p.stream;
  key.size = p.rounded;
  auto it = p.pool->blocks.lower_bound(&key);  // the free blocks below it are smaller than the request
  Block* best = nullptr;
  std::size_t best_pages = low - gain + 1;  // an extension must map fewer pages than this
  constexpr int kNearFitLooked = 32;
  for (int looked = 0; it != p.pool->blocks.begin() && looked < kNearFitLooked; ++looked) {
    Block* f = *--it;
    if (f->stream != p.stream || f->size < p.rounded / 2) break;
    Block* u = f->prev;
    if (!f->segment->growable || !f->reusable() || !u || u->state != BlockState::unmapped) continue;
    const Segment& seg = *f->segment;
    const std::size_t want = round_up(p.rounded - f->size, seg.page_size);
    const std::size_t pages = want / seg.page_size;
    if (pages >= best_pages || u->size < want) continue;
    const DevicePtr a = u->ptr + u->size - want;
    const std::size_t first = (a - seg.base) / seg.page_size;
    if (!may_map(seg, first, pages) || maps_over_lent(seg, first, pages)) continue;
    best = u;
    best_pages = pages;
    *at = a;
  }
  return best;
}

// Maps the top of unmapped block u, from `at` up, and makes it one free block with the free block above it;
// returns the top p.rounded bytes of it (the rest stays free, below them).
Block* GrowablePolicy::grow_below(AllocParams& p, Block* u, DevicePtr at) {
  const std::size_t page = u->segment->page_size;
  // The run holds the free block below u too: a reclaim that unmapped it would merge u into it.
  const DevicePtr lo = u->prev && u->prev->reusable() ? u->prev->ptr : u->ptr;
  const Run run{lo, at + round_up(p.rounded, page) + page};
  Block* head = map_block(u, at, u->ptr + u->size - at, run, &p.status);
  if (!head) return nullptr;
  // One free block with the free block the request extends, and with the free block below when u was mapped
  // whole.
  head = s_.merge_free(head);
  if (head->size == p.rounded) return head;
  // The request at the top, the free bytes below it (Note [Near fits]).
  Block* req = s_.split_after(head, head->ptr + head->size - p.rounded);
  s_.pool_insert(head);
  return req;
}

Block* GrowablePolicy::grow(AllocParams& p) {
  Block* head = find_run(p);
  if (DevicePtr at = 0; Block* u = near_fit(p, head, &at)) {
    if (Block* b = grow_below(p, u, at)) return b;
    // The lowest run next: it may have room for memory the near fit could not map (a handle larger than
    // the pages it lacked). The failed growth gave back what it took, so the run is looked for again.
    p.status = Status::ok;
    head = find_run(p);
  }
  if (!head) {
    Segment* seg = new_segment(p);
    if (!seg) return nullptr;
    head = seg->first;
  }
  const Run run{head->ptr, head->ptr + round_up(p.rounded, head->segment->page_size) + head->segment->page_size};
  if (head->state == BlockState::free) s_.pool_erase(head);
  for (;;) {
    if (head->state == BlockState::free && head->size >= p.rounded) break;
    Block* u = head->state == BlockState::unmapped ? head : head->next;
    const std::size_t have = head->state == BlockState::free ? head->size : 0;
    const std::size_t bytes = std::min(round_up(p.rounded - have, u->segment->page_size), u->size);
    if (!map_block(u, u->ptr, bytes, run, &p.status)) {
      if (head->state == BlockState::free) s_.pool_insert(head);
      return nullptr;
    }
    // u is now free and mapped; merge it with head (if free) and the reusable block after it.
    if (head != u) s_.absorb_next(head); else head = u;
    if (Block* n = head->next; n && n->reusable()) {
      s_.pool_erase(n);
      s_.absorb_next(head);
    }
  }
  return head;
}

bool GrowablePolicy::unmap_block_pages(Block* b, std::size_t lo, std::size_t hi, const Unmap& how) {
  Segment& seg = *b->segment;
  s_.pool_erase(b);
  const std::size_t done = unmap_pages(seg, lo, hi - lo, how);
  if (done == 0) {
    s_.pool_insert(b);
    return false;
  }
  hi = lo + done;
  const DevicePtr ulo = seg.base + lo * seg.page_size, uhi = seg.base + hi * seg.page_size;
  const DevicePtr end = b->ptr + b->size;
  Block* mid = b;
  if (ulo > b->ptr) {
    mid = s_.split_after(b, ulo);
    s_.pool_insert(b);  // the head stays free and mapped
  }
  if (uhi < end) s_.pool_insert(s_.split_after(mid, uhi));
  mid->state = BlockState::unmapped;
  s_.stats.segment.add(seg.small, mid->mapped_neighbours() - 1);  // Note [Mapped ranges are segments]
  s_.unmapped_insert(s_.merge_unmapped(mid));
  seg.mapped_bytes -= uhi - ulo;
  ++s_.stats.num_device_free;
  emit(s_, TraceAction::segment_unmap, seg.stream, ulo, uhi - ulo, uhi - ulo);
  return true;
}

void GrowablePolicy::release_free(PoolSet* only, bool device_synchronized) {
  const auto sets = pool_sets(only);
  struct Victim { Block* b; std::size_t lo, hi; };
  std::vector<Victim> victims;
  std::set<Stream> streams;
  for (PoolSet* ps : sets)
    for (BlockPool* bp : {&ps->small, &ps->large})
      for (Block* b : bp->blocks) {
        std::size_t lo, hi;
        if (b->segment->growable && unmappable_pages(b, &lo, &hi)) {
          victims.push_back({b, lo, hi});
          streams.insert(b->stream);
        }
      }
  // Unmapping is not stream-ordered: wait for the work queued on each stream first (as PyTorch does; not
  // after a device-wide synchronisation). A stream whose wait failed keeps its memory (Note [Failed waits]).
  std::set<Stream> failed;
  if (!device_synchronized)
    for (Stream st : streams)
      if (s_.forced_sync(st) != Status::ok) failed.insert(st);
  for (auto& v : victims)
    if (!failed.count(v.b->stream)) unmap_block_pages(v.b, v.lo, v.hi);
  // Drop segments that are entirely unmapped.
  std::erase_if(s_.segments, [&](const std::unique_ptr<Segment>& seg) {
    if (!seg->growable || seg->mapped_bytes != 0) return false;
    if (std::find(sets.begin(), sets.end(), seg->owner) == sets.end()) return false;
    Block* b = seg->first;
    if (b->next || b->state != BlockState::unmapped) return false;
    if (s_.driver->free_reservation(seg->base, seg->va_size) != Status::ok) return false;
    s_.unmapped_erase(b);
    s_.delete_block(b);
    return true;
  });
  after_release();
}

}  // namespace fragless
