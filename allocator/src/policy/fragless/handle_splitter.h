// The fragless policy's background job: a free mapping of several pages becomes pieces of it (or pages).
//
// Note [Split in the background]
// Re-backing moves whole handles (Note [Whole handles]), so it moves memory as finely as the handles are small: one
// 2 MiB handle per page moves the finest, but costs a cuMemCreate per page while memory first grows, when the
// caller waits for every one (docs/RESULTS.md, "Handle shapes"). So a growth creates its memory in large handles
// (nothing held could be re-backed at that moment anyway), and once such a handle is free (no live block overlaps
// it) after an allocation used part of it (one no block has used stays whole: freed() below), the background
// worker replaces it in place by pieces of 1, 1, 2, 4, ... pages from the bottom up (each piece
// no larger than all below it together, the last one what is left: piece_sizes), so k pages cost about log2(k) + 2
// creates instead of k. Re-backing takes pieces from the top of a hole down while they fit the room, so a hole
// gives a request any number of pages up to its size; an allocation that lands in the hole from the bottom pins at
// most the one piece its end falls in. A piece that a later allocation covered is split again when that allocation
// is freed (freed() queues only the handles the freed block overlaps), so memory that is used in small parts
// becomes pages, and memory that is not stays in few handles: fewer creates for the worker, and fewer cuMemRelease
// calls when empty_cache gives it back (an empty_cache waits for one release per handle). A piece is split into
// pages, not pieces again, so a repeated step's splits end after a few passes (the fixed-length transformer step
// of the steady-state test: its allocation path by the third, the worker by the fifth; a step whose re-backing
// keeps cycling still maps pages every step, docs/RESULTS.md "Repeated steps"); except once the engine has given its free memory back (empty_cache or an OOM retry: release_free): such a
// program pays one cuMemRelease per handle each time it does so (mercuryb1's program calls empty_cache 28 times,
// and pages made its releases 48,417 where expandable's 20 MiB pages made 5,799), so from then on a piece is split
// into pieces again (any number of pages can still be re-backed, a piece at a time), and a repeated step takes up
// to log2 of its largest piece more passes to reach its steady state. The worker's split: it takes the range out of
// the pool (a busy block), waits for the work queued on its stream (R13: the unmap is not stream-ordered), unmaps
// it, releases the old handle, creates the pieces, maps them at the same addresses and grants access; then the
// range goes back to its pool, free, with the same address and size. The old handle is released before the pieces
// are created, so a split never holds more memory than it started with. A split that cannot finish (a create
// refused, an abort) gives the range back: unmapped, its memory released, as an empty_cache would.
//
// A handle that a live block still overlaps stays as it is until that block is freed: partly live, it can be
// re-backed only whole, and only once free. Private pools are never split (graphs hold their addresses, and may be
// replaying over them). A queued split names its handle, not a place: when re-backing moves a queued handle before
// its turn, the split follows it (where_) and keeps its turn, and runs there if the handle is free then; a handle
// that went idle meanwhile is queued again when it is freed where it is mapped next. The largest queued handle goes
// first (the oldest among equals): a split of k pages costs about log2(k) + 2 creates and makes k pages movable,
// and when the worker is behind (the replay's `random` and `unet3d` workloads keep it busy for nearly all the
// compute time between their events), what it has split by the peak is what re-backing can move there. Measured
// at 3486302 against oldest-first, over the inputs of docs/RESULTS.md's driver table: `random` 6.73% → 3.38% over
// live, `unet3d` 1.71% → 1.01%, no peak up by more than 4 MiB, the path's driver time +0.7% (2,713 → 2,732 ms).
//
// Note [Handle aliases]
// A split releases its old handle without the device lock (run) and the books forget it only under the lock
// (finish). In between, the driver may give the same value to a new handle (driver.h, R8: a value comes back
// once its memory is gone, and the unmap just before the release made it go), and a growth on the allocation path
// may map that new handle while the books still hold the old one under the value: the pool's, the splitter's and
// the page table's entries of two handles would then be one, and finish would erase the new one's. So when a
// split is taken, under the lock, the engine renames the old handle everywhere it keeps it (HandlePool, where_,
// pieces_, the range's page-table entries) to an alias no driver gives (kEngineHandleBit and a serial); finish
// forgets the alias, or, when the split was cancelled before anything was released, renames it back. The pieces
// a split creates are new values the books take only in finish, after the alias is gone. Only the driver's own
// value (job.handle) goes to the driver: run releases it, and a release that failed defers it (the handle is
// then still the driver's, so its value cannot have come back).
#pragma once
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <utility>

#include "fragless/flat_table.h"
#include "fragless/node_slab.h"

#include "policy/fragless/handle_pool.h"
#include "policy/policy.h"

namespace fragless {

class HandleSplitter {
 public:
  HandleSplitter(DeviceEngine::State& s, HandlePool& pool, std::size_t page) : s_(s), pool_(pool), page_(page) {}

  // Bookkeeping of where multi-page handles are mapped (device lock held).
  void mapped(Segment& seg, std::size_t first, PhysHandle h);
  void unmapped(const Segment& seg, std::size_t first, PhysHandle h);
  // Whether pages [first, first + n) of seg include a multi-page mapping.
  bool any_multi(const Segment& seg, std::size_t first, std::size_t n) const;
  std::size_t multi_count() const { return multi_.size(); }
  // Handle h goes back to the driver (its id may come back for another handle).
  // Its queue entry, if any, goes stale (take() skips an entry whose handle is no longer in queued_).
  void released(PhysHandle h) {
    pieces_.erase(h);
    where_.erase(h);
    hints_.erase(h);
    if (queued_.erase(h)) std::erase(retry_, h);
  }
  // The engine gave its free memory back: pieces are split into pieces from now on (Note [Split in the background]).
  void coarse() { coarse_ = true; }

  // Free block b (Block::multi) is back in its pool, [lo, hi) the block the caller freed before it merged
  // with its neighbours: queues the multi-page handles b now covers whole that [lo, hi) overlaps, and clears
  // b->multi when b overlaps none. True when something was queued.
  bool freed(Block* b, DevicePtr lo, DevicePtr hi);

  // The three steps of a split (Note [Background work]).
  bool take(BackgroundJob* job);
  static void run(Driver& d, std::size_t page, BackgroundJob& job, const std::atomic<bool>& abort, bool manual);
  void finish(BackgroundJob& job);

  std::string check() const;

 private:
  static void piece_sizes(std::size_t pages, std::vector<std::size_t>* sizes);  // what a split of `pages` creates
  // A queued split names its handle, not a place: re-backing may move a queued handle, and its split follows
  // it there (where_), keeping its turn. hints_ keeps, per queued handle, the free block last seen over it (each
  // freed() that finds the handle under its block renews it), where covering() starts looking.
  Block* covering(Segment& seg, Block* hint, DevicePtr va, std::size_t len) const;
  Block* carve(Block* b, DevicePtr va, std::size_t len);  // b's [va, va + len) becomes a busy block
  void release_busy(Block* busy, bool mapped, bool multi = false);  // busy back to free (mapped) or unmapped
  // Mapped multi-page handle `from`, at pages [first, ...) of seg, is called `to` in the books from now on.
  void rename(Segment& seg, std::size_t first, PhysHandle from, PhysHandle to);

  DeviceEngine::State& s_;
  HandlePool& pool_;
  std::size_t page_;
  // The tables by handle are flat (Note [Flat tables]): a split's finish and every release touch them.
  using Place = std::pair<const Segment*, std::size_t>;
  NodeSlab multi_nodes_;  // Note [Node slabs]; declared before multi_, which it outlives
  // (segment, first page) of multi-page mappings
  std::set<Place, std::less<>, SlabAllocator<Place>> multi_{SlabAllocator<Place>(&multi_nodes_)};
  FlatTable<std::pair<Segment*, std::size_t>> where_;  // the same, by handle
  // Free multi-page handles to split, by pages, the largest first; oldest first among equals.
  std::map<std::size_t, std::deque<PhysHandle>, std::greater<>> queue_;
  FlatTable<bool> queued_;                                  // the handles in queue_ or retry_
  FlatTable<Block*> hints_;                                 // for some of them: the free block last seen over it
  std::vector<PhysHandle> retry_;                           // cancelled: queued again at the next freed()
  FlatTable<bool> pieces_;                                  // multi-page pieces of earlier splits (split into pages)
  bool coarse_ = false;                                     // ...or into pieces, after a release (coarse())
  PhysHandle next_alias_ = 1;                               // Note [Handle aliases]
};

}  // namespace fragless
