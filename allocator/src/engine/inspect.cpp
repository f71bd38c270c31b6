// The invariant checker (I1–I6 in engine_state.h) and snapshots.
#include <set>
#include <sstream>

#include "state/engine_state.h"
#include "policy/policy.h"

namespace fragless {

namespace {

struct Recount {
  std::int64_t allocation[3]{}, allocated_bytes[3]{}, active[3]{}, active_bytes[3]{}, requested[3]{};
  std::int64_t segment[3]{}, inactive_split[3]{}, inactive_split_bytes[3]{}, mapped[3]{};
  std::int64_t live = 0;
  void add(std::int64_t* a, bool small, std::int64_t v) {
    a[0] += v;
    a[small ? 1 : 2] += v;
  }
};

}  // namespace

std::string DeviceEngine::State::check_invariants() {
  std::ostringstream err;
  auto fail = [&](const std::string& what, const Block* b) {
    if (err.tellp() > 2000) return;
    err << what;
    if (b) err << " (block 0x" << std::hex << b->ptr << std::dec << " size " << b->size << ")";
    err << "; ";
  };
  Recount rc;
  std::set<std::pair<PhysHandle, std::size_t>> backing;
  std::size_t in_pools = 0, in_unmapped = 0, active_count = 0;
  for (const auto& segp : segments) {
    const Segment& seg = *segp;
    const bool small = seg.small;
    DevicePtr at = seg.base;
    std::size_t mapped = 0;
    if (!seg.growable) rc.add(rc.segment, small, 1);
    else  // Note [Mapped ranges are segments]: one per run of mapped blocks
      for (const Block* b = seg.first; b; b = b->next)
        if (b->mapped() && !(b->prev && b->prev->mapped())) rc.add(rc.segment, small, 1);
    for (std::size_t i = 0; i < seg.pages.size(); ++i)
      if (seg.pages[i].valid()) {
        mapped += seg.page_size;
        if (!backing.insert({seg.pages[i].handle, seg.pages[i].offset}).second)
          fail("I4: a physical page backs two mapped pages", nullptr);
      }
    if (mapped != seg.mapped_bytes) fail("segment mapped_bytes differs from its page table", nullptr);
    rc.add(rc.mapped, small, static_cast<std::int64_t>(mapped));
    const Block* prev = nullptr;
    for (const Block* b = seg.first; b; prev = b, b = b->next) {
      if (b->ptr != at) fail("I1: blocks do not tile the segment", b);
      if (b->prev != prev) fail("I1: broken prev link", b);
      if (b->segment != &seg) fail("I1: block points at another segment", b);
      if (b->size == 0) fail("I1: empty block", b);
      at += b->size;
      const std::size_t first_page = (b->ptr - seg.base) / seg.page_size;
      const std::size_t last_page = (b->ptr + b->size - 1 - seg.base) / seg.page_size;
      for (std::size_t p = first_page; p <= last_page && p < seg.pages.size(); ++p) {
        const bool page_mapped = seg.pages[p].valid();
        if (b->mapped() && !page_mapped) fail("I2: a mapped block touches an unmapped page", b);
        if (!b->mapped() && page_mapped) fail("I2: an unmapped block covers a mapped page", b);
      }
      if (b->state == BlockState::busy && !background.in_flight() && !background.job_lost())
        fail("a busy block while no background job is in flight", b);
      if (b->state == BlockState::unmapped) {
        if ((b->ptr - seg.base) % seg.page_size || b->size % seg.page_size) fail("I2: unaligned unmapped block", b);
        if (!b->pool->unmapped.count(const_cast<Block*>(b))) fail("I3: unmapped block missing from its set", b);
        ++in_unmapped;
        if (prev && prev->state == BlockState::unmapped) fail("I3: adjacent unmapped blocks", b);
      }
      const bool should_be_in_pool = b->state == BlockState::free && b->event_count == 0;
      if (b->in_size_set != should_be_in_pool || (should_be_in_pool && !b->pool->blocks.count(const_cast<Block*>(b))))
        fail("I3: pool membership wrong", b);
      if (should_be_in_pool) {
        ++in_pools;
        if (prev && prev->reusable()) fail("I3: adjacent free blocks not merged", b);
        if (!seg.growable && b->is_split()) {
          rc.add(rc.inactive_split, small, 1);
          rc.add(rc.inactive_split_bytes, small, static_cast<std::int64_t>(b->size));
        }
      }
      const bool allocated = b->state == BlockState::allocated;
      const bool pending = b->pending();
      if (allocated || pending) {
        ++active_count;
        if (active_blocks.get(b->ptr) != b) fail("I6: active block not in the address map", b);
        rc.add(rc.active, small, 1);
        rc.add(rc.active_bytes, small, static_cast<std::int64_t>(b->size));
        rc.add(rc.requested, small, static_cast<std::int64_t>(b->requested));
      }
      if (allocated) {
        rc.add(rc.allocation, small, 1);
        rc.add(rc.allocated_bytes, small, static_cast<std::int64_t>(b->size));
        rc.live += static_cast<std::int64_t>(b->requested);
      }
    }
    if (at != seg.base + seg.va_size) fail("I1: blocks do not cover the segment", nullptr);
  }
  std::size_t pool_total = 0, unmapped_total = 0;
  auto count_pools = [&](PoolSet& ps) {
    pool_total += ps.small.blocks.size() + ps.large.blocks.size();
    unmapped_total += ps.small.unmapped.size() + ps.large.unmapped.size();
    for (const BlockPool* bp : {&ps.small, &ps.large}) {
      std::size_t paged = 0;
      for (const Block* b : bp->blocks) paged += b->paged();
      if (paged != bp->paged) fail("I3: a pool's count of free blocks of a page or more is stale", nullptr);
    }
  };
  count_pools(default_pools);
  for (auto& [id, ps] : private_pools) count_pools(*ps);
  if (pool_total != in_pools) fail("I3: pools hold blocks that are not free", nullptr);
  if (unmapped_total != in_unmapped) fail("I3: unmapped sets hold stale blocks", nullptr);
  if (active_blocks.size() != active_count) fail("I6: address map holds stale entries", nullptr);

  auto cmp = [&](const char* name, const StatArray& a, const std::int64_t* want) {
    for (int k = 0; k < 3; ++k)
      if (a.by_pool[k].current != want[k]) {
        std::ostringstream m;
        m << "I5: " << name << "[" << k << "] is " << a.by_pool[k].current << ", recount " << want[k];
        fail(m.str(), nullptr);
      }
    // As in PyTorch's stats: `all` is the two pools' sum, in what is reserved and freed over time too.
    const Stat &all = a.by_pool[kAllPools], &sm = a.by_pool[kSmallPool], &lg = a.by_pool[kLargePool];
    if (all.allocated != sm.allocated + lg.allocated || all.freed != sm.freed + lg.freed) {
      std::ostringstream m;
      m << "I5: " << name << ".all's allocated/freed " << all.allocated << "/" << all.freed
        << " are not the pools' sums " << sm.allocated + lg.allocated << "/" << sm.freed + lg.freed;
      fail(m.str(), nullptr);
    }
  };
  cmp("allocation", stats.allocation, rc.allocation);
  cmp("allocated_bytes", stats.allocated_bytes, rc.allocated_bytes);
  cmp("active", stats.active, rc.active);
  cmp("active_bytes", stats.active_bytes, rc.active_bytes);
  cmp("requested_bytes", stats.requested_bytes, rc.requested);
  cmp("segment", stats.segment, rc.segment);
  cmp("inactive_split", stats.inactive_split, rc.inactive_split);
  cmp("inactive_split_bytes", stats.inactive_split_bytes, rc.inactive_split_bytes);
  if (stats.live_bytes.current != rc.live) fail("I5: live bytes differ from recount", nullptr);
  const auto idle = static_cast<std::int64_t>(policy->idle_bytes());
  const std::int64_t want_reserved[3] = {rc.mapped[0] + idle, rc.mapped[1], rc.mapped[2] + idle};
  cmp("reserved_bytes", stats.reserved_bytes, want_reserved);
  if (static_cast<std::int64_t>(total_reserved) != stats.reserved_bytes.all().current)
    fail("I5: total_reserved differs from reserved_bytes", nullptr);
  if (std::string p = policy->check(); !p.empty()) fail(p, nullptr);
  if (std::string p = check_sharing(); !p.empty()) fail(p, nullptr);
  return err.str();
}

std::vector<SegmentInfo> DeviceEngine::State::snapshot() {
  std::vector<SegmentInfo> out;
  for (const auto& segp : segments) {
    const Segment& seg = *segp;
    SegmentInfo cur;
    bool open = false;
    auto close = [&] {
      if (open && cur.total_size) out.push_back(std::move(cur));
      cur = SegmentInfo{};
      open = false;
    };
    // Growable segments appear as one segment per contiguous mapped range, as in PyTorch.
    for (const Block* b = seg.first; b; b = b->next) {
      if (!b->mapped()) {
        close();
        continue;
      }
      if (!open) {
        cur.address = b->ptr;
        cur.stream = seg.stream;
        cur.small = seg.small;
        cur.expandable = seg.growable;
        cur.pool = seg.owner->id;
        open = true;
      }
      BlockInfo bi;
      bi.address = b->ptr;
      bi.size = b->size;
      if (b->state == BlockState::allocated) {
        bi.state = BlockInfo::active_allocated;
        bi.requested_size = b->requested;
        cur.allocated_size += b->size;
        cur.active_size += b->size;
        cur.requested_size += b->requested;
      } else if (b->pending() || !b->stream_uses.empty()) {
        bi.state = BlockInfo::active_pending_free;
        bi.requested_size = b->requested;
        cur.active_size += b->size;
        cur.requested_size += b->requested;
      } else {
        bi.state = BlockInfo::inactive;
      }
      if (b->exported) describe_hold(*b, &bi);
      cur.exported_bytes += bi.exported_bytes;
      cur.total_size += b->size;
      cur.blocks.push_back(bi);
    }
    close();
  }
  return out;
}

}  // namespace fragless
