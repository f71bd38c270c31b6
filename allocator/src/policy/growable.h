// Growable segments, shared by the expandable and fragless policies.
//
// A growable segment is a large address-space reservation (9/8 of device memory, like PyTorch's) whose
// pages are mapped on demand. Its blocks tile the whole reservation; unmapped stretches are blocks in
// state `unmapped`, kept in the pool's address-ordered `unmapped` set. Growing finds the lowest address
// where a run of reusable free and unmapped blocks fits the request and maps the missing pages;
// releasing unmaps every whole free page and drops segments that end up entirely unmapped.
//
// Note [Mapped ranges are segments]
// The `segment` statistics count, for a growable segment, its runs of mapped blocks: what a snapshot shows
// as segments (one per contiguous mapped range, as PyTorch's snapshot of an expandable segment does), so
// that memory_stats, memory_summary and the snapshot agree. PyTorch's own stat leaves expandable segments
// out (it would read 0 with gigabytes reserved). A map adds one range less its mapped neighbours (it may
// join two ranges into one: -1); an unmap removes one and adds back each mapped neighbour (it may cut a
// range in two: +1); a range a background split holds (busy) stays mapped. check_invariants recounts them.
//
// Subclasses decide where physical pages come from (map_pages / unmap_pages). What a step needs is passed
// to it as values: the run being grown (Run) down to map_pages, the reason for an unmap (Unmap) down to
// unmap_pages.
#pragma once
#include "policy/policy.h"

namespace fragless {

struct Growth;  // a subclass's growth in progress (the fragless policy's: policy/fragless/fragless_policy.h)

class GrowablePolicy : public Policy {
 public:
  using Policy::Policy;
  bool should_split(const Block* b, std::size_t rounded) const override {
    return b->size - rounded >= kMinBlockSize;
  }
  bool prefer_non_growable() const override { return true; }
  Block* grow(AllocParams& p) override;
  void release_free(PoolSet* only, bool device_synchronized) override;

 protected:
  // The run being grown by one grow() call, [lo, hi): what map_pages must not take memory from.
  struct Run {
    DevicePtr lo = 0, hi = 0;
  };
  // Why unmap_pages is called: a release (handles become idle), a reclaim for a request being mapped
  // (handles go to it), or a same-stream reclaim that lends without a sync (to it, the old mapping kept).
  struct Unmap {
    enum class Why : std::uint8_t { release, reclaim, lend } why = Why::release;
    Growth* growth = nullptr;   // reclaim and lend: the subclass's growth the handles go to (and, lending,
                                // whose stream they are lent to)
  };

  virtual std::size_t page_size(bool small) const = 0;
  // Backs pages [first, first + *n) of seg with physical memory, maps them and sets access; all or nothing.
  // The pages [first, first + room) are unmapped and free to use: a policy whose physical handles span
  // several pages may map more than asked (up to room), and says how many in *n. Adds to reserved what it
  // creates.
  // `run` is the run being grown.
  virtual Status map_pages(Segment& seg, std::size_t first, std::size_t* n, std::size_t room, const Run& run) = 0;
  // Unmaps pages [first, first + n) (the caller synchronised the stream, unless `how` lends); returns how
  // many leading pages were unmapped (n on success).
  virtual std::size_t unmap_pages(Segment& seg, std::size_t first, std::size_t n, const Unmap& how) = 0;
  virtual void after_release() {}
  // Whether map_pages may map pages [first, first + n) of seg now; a run where it may not is passed over.
  virtual bool may_map(const Segment&, std::size_t /*first*/, std::size_t /*n*/) const { return true; }
  // Whether pages [first, first + n) of seg, just mapped, include a mapping of several pages (Block::multi).
  virtual bool multi_page(const Segment&, std::size_t /*first*/, std::size_t /*n*/) const { return false; }

  // Unmaps whole pages [lo, hi) (segment page indices) inside reusable block b, which is in its pool.
  // Splits b into free head, unmapped middle and free tail. False if nothing could be unmapped.
  bool unmap_block_pages(Block* b, std::size_t lo, std::size_t hi, const Unmap& how);
  bool unmap_block_pages(Block* b, std::size_t lo, std::size_t hi) { return unmap_block_pages(b, lo, hi, Unmap{}); }
  // Whole pages inside b: [*lo, *hi); false if none.
  static bool whole_pages(const Block* b, std::size_t* lo, std::size_t* hi);
  // The pages inside b that can be unmapped: whole pages, narrowed by a policy whose mappings span several
  // pages to whole mappings (driver.h, R7). False if none.
  virtual bool unmappable_pages(const Block* b, std::size_t* lo, std::size_t* hi) const {
    return whole_pages(b, lo, hi);
  }
  // Note [Near fits]: how many pages extending a free block downwards must save against the lowest run
  // before a growth does that instead; 0 (expandable: its growths never move memory) never.
  virtual std::size_t near_fit_pages() const { return 0; }
  // Whether pages [first, first + n) of seg still have old mappings that a map there would first have to wait
  // for on the host (the fragless policy's lent ranges whose stream's work is not done): a near fit passes
  // over them. Not asked during a capture (may_map answers first).
  virtual bool maps_over_lent(const Segment&, std::size_t /*first*/, std::size_t /*n*/) { return false; }

 private:
  Segment* new_segment(AllocParams& p);
  Block* find_run(AllocParams& p);
  std::size_t pages_missing(const AllocParams& p, const Block* head) const;
  Block* near_fit(AllocParams& p, const Block* lowest, DevicePtr* at);
  Block* grow_below(AllocParams& p, Block* u, DevicePtr at);
  // Maps [at, at + bytes) of unmapped block u (page boundaries; map_pages may fill up to u's end) as one free
  // block, which it returns; what is left of u below and above stays unmapped. Null, *status set, on failure.
  Block* map_block(Block* u, DevicePtr at, std::size_t bytes, const Run& run, Status* status);
};

}  // namespace fragless
