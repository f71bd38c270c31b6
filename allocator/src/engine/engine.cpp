// DeviceEngine: pools, blocks, the retry chain and stats. See engine.h for the call chain and
// engine_state.h for the invariants.
#include "fragless/engine.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "state/engine_state.h"
#include "policy/policy.h"
#include "state/trace_emit.h"

namespace fragless {

namespace {

std::unique_ptr<Policy> make_policy(PolicyKind k, DeviceEngine::State& s) {
  switch (k) {
    case PolicyKind::classic: return make_classic_policy(s);
    case PolicyKind::expandable: return make_expandable_policy(s);
    case PolicyKind::fragless: break;
  }
  return make_fragless_policy(s);
}

std::string format_bytes(std::size_t b) {
  char buf[64];
  const double v = static_cast<double>(b);
  if (b >= (1ull << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", v / (1ull << 30));
  else if (b >= (1ull << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", v / (1ull << 20));
  else if (b >= (1ull << 10)) std::snprintf(buf, sizeof buf, "%.2f KiB", v / (1ull << 10));
  else std::snprintf(buf, sizeof buf, "%zu bytes", b);
  return buf;
}

void set_error(AllocError* e, Status st, std::string msg) {
  if (e) { e->status = st; e->message = std::move(msg); }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// State basics

DeviceEngine::State::State(const Options& o, std::unique_ptr<Driver> d) : opts(o), driver(std::move(d)) {
  default_pools.small.owner = &default_pools;
  default_pools.small.small = true;
  default_pools.large.owner = &default_pools;
  std::size_t free_b = 0;
  driver->memory_info(&free_b, &device_total);
  if (opts.per_process_memory_fraction < 1.0)
    allowed_memory_maximum = static_cast<std::size_t>(opts.per_process_memory_fraction * device_total);
  stats.max_split_size = opts.max_split_size == SIZE_MAX ? -1 : static_cast<std::int64_t>(opts.max_split_size);
  policy = make_policy(opts.policy, *this);
  background.set_work(policy.get(), driver.get());
}

DeviceEngine::State::~State() {
  background.stop();  // Note [Background work]: the worker never outlives the engine
  close_all_shares();  // Note [Sharing]: what other processes opened keeps its memory through their handles
  // Give everything back, live blocks too: the process is done with this device.
  for (auto& [id, ev] : pending_events)
    for (auto& [e, b] : ev) driver->release_event(e);
  pending_events.clear();
  active_blocks.for_each([](DevicePtr, Block* b) {
    b->state = BlockState::free;
    b->event_count = 0;
    b->stream_uses.clear();
  });
  active_blocks.clear();
  // Reinsert every free block, merged with its free neighbours (a block that was pending sat beside free
  // ones unmerged, and a page two free blocks share is unmapped by neither), so the policy sees the whole
  // cache; then release it all.
  for (auto& seg : segments)
    for (Block* b = seg->first; b; b = b->next)
      if (b->state == BlockState::free && !b->in_size_set) {
        b = merge_free(b);
        pool_insert(b);
      }
  routes.clear();
  external_captures = 0;
  // Graph-private memory may still be used by a replay on a stream the engine does not know (R17).
  const bool device_synced = !private_pools.empty() && synchronize_device();
  // Twice: a give-back that failed once (a transient driver error) gets another chance.
  for (int attempt = 0; attempt < 2; ++attempt) {
    policy->release_free(nullptr, false);
    for (auto& [id, ps] : private_pools) policy->release_free(ps.get(), device_synced);
    retry_deferred();
  }
  policy.reset();
  retry_deferred();
  for (auto& [st, m] : per_thread_marks)
    if (m.valid) driver->release_event(m.event);
}

void DeviceEngine::State::give_back_mapping(DevicePtr va, std::size_t size) {
  if (driver->unmap(va, size) == Status::ok) return;
  // What is still mapped of the range, mapping by mapping (an unmap one mapping at a time, R15, may have
  // stopped part way).
  for (DevicePtr at = va; at < va + size; at += driver->granularity())
    if (const std::size_t n = driver->mapping_size(at)) {
      deferred_unmaps.emplace_back(at, n);
      at += n - driver->granularity();
    }
}

void DeviceEngine::State::give_back_handle(PhysHandle h) {
  if (driver->release(h) != Status::ok) deferred_handles.push_back(h);
}

void DeviceEngine::State::give_back_reservation(DevicePtr va, std::size_t size) {
  if (driver->free_reservation(va, size) != Status::ok) deferred_reservations.emplace_back(va, size);
}

bool DeviceEngine::State::retry_deferred() {
  // Mappings first (a reservation cannot be freed while mapped), then handles, then address ranges.
  std::erase_if(deferred_unmaps, [&](const auto& m) { return driver->unmap(m.first, m.second) == Status::ok; });
  std::erase_if(deferred_handles, [&](PhysHandle h) { return driver->release(h) == Status::ok; });
  std::erase_if(deferred_reservations,
                [&](const auto& r) { return driver->free_reservation(r.first, r.second) == Status::ok; });
  return !has_deferred();
}

Block* DeviceEngine::State::new_block() {
  if (spare_blocks.empty()) {
    constexpr std::size_t kSlab = 256;
    block_slabs.push_back(std::make_unique<Block[]>(kSlab));
    for (std::size_t i = 0; i < kSlab; ++i) spare_blocks.push_back(&block_slabs.back()[i]);
  }
  Block* b = spare_blocks.back();
  spare_blocks.pop_back();
  return b;
}

void DeviceEngine::State::delete_block(Block* b) {
  *b = Block{};
  spare_blocks.push_back(b);
}

void DeviceEngine::State::pool_insert(Block* b) {
  b->pool->blocks.insert(b);
  b->in_size_set = true;
  if (!b->segment->growable && b->is_split()) {
    stats.inactive_split.add(b->pool->small, 1);
    stats.inactive_split_bytes.add(b->pool->small, static_cast<std::int64_t>(b->size));
  }
}

void DeviceEngine::State::pool_erase(Block* b) {
  b->pool->blocks.erase(b);
  b->in_size_set = false;
  if (!b->segment->growable && b->is_split()) {
    stats.inactive_split.add(b->pool->small, -1);
    stats.inactive_split_bytes.add(b->pool->small, -static_cast<std::int64_t>(b->size));
  }
}

void DeviceEngine::State::unmapped_insert(Block* b) { b->pool->unmapped.insert(b); }
void DeviceEngine::State::unmapped_erase(Block* b) { b->pool->unmapped.erase(b); }

Block* DeviceEngine::State::split_after(Block* b, DevicePtr at) {
  Block* r = new_block();
  r->ptr = at;
  r->size = b->ptr + b->size - at;
  r->segment = b->segment;
  r->pool = b->pool;
  r->stream = b->stream;
  r->state = b->state;
  r->multi = b->multi;
  r->prev = b;
  r->next = b->next;
  if (r->next) r->next->prev = r;
  b->next = r;
  b->size = at - b->ptr;
  return r;
}

void DeviceEngine::State::absorb_next(Block* b) {
  Block* n = b->next;
  b->size += n->size;
  b->multi = b->multi || n->multi;
  b->next = n->next;
  if (b->next) b->next->prev = b;
  delete_block(n);
}

Block* DeviceEngine::State::merge_free(Block* b) {
  if (Block* p = b->prev; p && p->reusable()) {
    pool_erase(p);
    absorb_next(p);
    b = p;
  }
  if (Block* n = b->next; n && n->reusable()) {
    pool_erase(n);
    absorb_next(b);
  }
  return b;
}

Block* DeviceEngine::State::merge_unmapped(Block* b) {
  if (Block* p = b->prev; p && p->state == BlockState::unmapped) {
    unmapped_erase(p);
    absorb_next(p);
    b = p;
  }
  if (Block* n = b->next; n && n->state == BlockState::unmapped) {
    unmapped_erase(n);
    absorb_next(b);
  }
  return b;
}

void DeviceEngine::State::add_reserved(bool small, std::int64_t bytes) {
  stats.reserved_bytes.add(small, bytes);
  total_reserved = static_cast<std::size_t>(static_cast<std::int64_t>(total_reserved) + bytes);
}

Status DeviceEngine::State::forced_sync(Stream st) {
  if (retired_streams.count(st)) return Status::ok;  // waited for when it was destroyed
  ++stats.num_forced_syncs;
  Status r = Status::ok;
  if (is_per_thread_stream(st) && st != per_thread_stream()) {
    // R16: another thread's per-thread stream; its mark was recorded at its latest free there. No mark: no
    // block was freed there by its thread, so its free memory came back behind a fence or its events.
    auto it = per_thread_marks.find(st);
    if (it != per_thread_marks.end())
      r = it->second.valid ? driver->synchronize_event(it->second.event) : Status::driver_error;
  } else {
    r = driver->synchronize_stream(st);
  }
  return r == Status::ok ? r : wait_failed("a stream synchronisation");
}

Status DeviceEngine::State::wait_failed(const char* what) {
  ++stats.num_failed_waits;
  if (wait_error.empty())
    wait_error = std::string("fragless: ") + what + " on device " + std::to_string(driver->device()) +
                 " failed (" + driver->last_error() + "); the memory under that work stays cached and the release "
                 "is tried again later";
  return Status::driver_error;
}

void DeviceEngine::State::mark_per_thread_free(Stream st) {
  Mark& m = per_thread_marks[st];
  if (m.valid) driver->release_event(m.event);
  m.valid = driver->record_event(st, &m.event) == Status::ok;
}

bool DeviceEngine::State::stream_idle(Stream st) {
  if (retired_streams.count(st)) return true;
  if (is_per_thread_stream(st) && st != per_thread_stream()) {
    auto it = per_thread_marks.find(st);
    return it == per_thread_marks.end() || (it->second.valid && driver->query_event(it->second.event) == Status::ok);
  }
  Event e = 0;
  if (driver->record_event(st, &e) != Status::ok) return false;
  const bool idle = driver->query_event(e) == Status::ok;
  driver->release_event(e);
  return idle;
}

bool DeviceEngine::State::synchronize_device() {
  ++stats.num_forced_syncs;
  if (driver->synchronize_device() == Status::ok) return true;
  wait_failed("a device-wide synchronisation (before graph-private memory goes)");
  return false;
}

bool DeviceEngine::State::capacity_allows(std::size_t extra) const {
  return allowed_memory_maximum == 0 || total_reserved + extra <= allowed_memory_maximum;
}

PoolSet& DeviceEngine::State::pool_set_for(Stream st) {
  for (auto it = routes.rbegin(); it != routes.rend(); ++it)
    if (!it->second || it->second(st)) return *it->first;
  return default_pools;
}

// ---------------------------------------------------------------------------------------------------------
// Fast path

// The smallest free block of `pool` on p's stream that holds p.rounded bytes, or end().
std::set<Block*, BySize>::iterator DeviceEngine::State::best_fit(BlockPool& pool, const AllocParams& p) {
  Block key;
  key.stream = p.stream;
  key.size = p.rounded;
  auto it = pool.blocks.lower_bound(&key);
  return it != pool.blocks.end() && (*it)->stream == p.stream ? it : pool.blocks.end();
}

Block* DeviceEngine::State::find_free_block(AllocParams& p) {
  BlockPool& pool = *p.pool;
  if (allowed_memory_maximum && opts.garbage_collection_threshold > 0) ++pool.get_free_blocks_call_count;
  auto it = best_fit(pool, p);
  if (it == pool.blocks.end()) return nullptr;
  if ((*it)->segment->growable && policy->prefer_non_growable()) {
    auto growable_size = [](const Block* b) {
      return b->size + (b->next && b->next->state == BlockState::unmapped ? b->next->size : 0);
    };
    for (auto next = std::next(it); next != pool.blocks.end() && (*next)->stream == p.stream &&
                                    growable_size(*next) < growable_size(*it);
         ++next)
      it = next;
  }
  Block* b = *it;
  // Oversize rules: small requests never take an oversize block; an oversize request takes a block at
  // most max_non_split_rounding_size larger.
  if (p.rounded < opts.max_split_size && b->size >= opts.max_split_size) return nullptr;
  if (p.rounded >= opts.max_split_size && b->size >= p.rounded + opts.max_non_split_rounding_size) return nullptr;
  pool_erase(b);
  return b;
}

// Note [Small requests in large remnants]
// A free block of the large pool smaller than kSmallSize fits no large request: it waits for a neighbour
// to be freed. Meanwhile it pins the pages under it. A small request that would otherwise grow the small
// pool takes the best-fitting such remnant instead; the block then belongs to the large pool (its stats
// too) and goes back there when freed.
Block* DeviceEngine::State::take_large_remnant(AllocParams& p) {
  BlockPool& large = p.pool->owner->large;
  auto it = best_fit(large, p);
  if (it == large.blocks.end() || (*it)->size >= kSmallSize) return nullptr;
  Block* b = *it;
  pool_erase(b);
  p.pool = &large;
  return b;
}

Block* DeviceEngine::State::take_block(Block* b, AllocParams& p) {
  const bool small = p.pool->small;
  if (policy->should_split(b, p.rounded)) pool_insert(split_after(b, b->ptr + p.rounded));
  b->state = BlockState::allocated;
  b->requested = p.requested;
  b->gc_count_base = static_cast<std::uint32_t>(p.pool->get_free_blocks_call_count);
  const auto size = static_cast<std::int64_t>(b->size);
  const auto req = static_cast<std::int64_t>(p.requested);
  stats.allocation.add(small, 1);
  stats.allocated_bytes.add(small, size);
  stats.active.add(small, 1);
  stats.active_bytes.add(small, size);
  stats.requested_bytes.add(small, req);
  stats.live_bytes.add(req);
  if (b->size >= opts.max_split_size) stats.oversize_allocations.add(1);
  active_blocks.put(b->ptr, b);
  emit(*this, TraceAction::alloc, b->stream, b->ptr, p.requested, b->size);
  return b;
}

void DeviceEngine::State::free_block(Block* b, bool traced) {
  const bool small = b->pool->small;
  const auto size = static_cast<std::int64_t>(b->size);
  stats.active.add(small, -1);
  stats.active_bytes.add(small, -size);
  stats.requested_bytes.add(small, -static_cast<std::int64_t>(b->requested));
  active_blocks.erase(b->ptr);
  if (traced) emit(*this, TraceAction::free_completed, b->stream, b->ptr, b->requested, b->size);
  b->state = BlockState::free;
  b->stream_uses.clear();
  const DevicePtr lo = b->ptr, hi = b->ptr + b->size;  // what the caller freed, before the merge
  b = merge_free(b);
  pool_insert(b);
  if (b->multi) policy->freed(b, lo, hi);
}

bool DeviceEngine::State::insert_events(Block* b) {
  StreamUses left;
  for (Stream st : b->stream_uses) {
    Event e = 0;
    if (driver->record_event(st, &e) != Status::ok) {
      // Could not record: wait for the stream instead, so the block is safe to reuse; if that fails too,
      // the use stays and is tried again later (Note [Failed waits]).
      if (forced_sync(st) != Status::ok) left.add(st);
      continue;
    }
    ++b->event_count;
    ++pending_event_count;
    pending_events[st].emplace_back(e, b);
  }
  b->stream_uses = std::move(left);
  return b->stream_uses.empty();
}

void DeviceEngine::State::defer_events(Block* b) {
  ++b->event_count;  // the placeholder: never reusable while listed
  deferred_until_no_capture.push_back(b);
}

void DeviceEngine::State::process_events() {
  for (auto it = pending_events.begin(); it != pending_events.end();) {
    auto& q = it->second;
    while (!q.empty()) {
      auto [e, b] = q.front();
      if (driver->query_event(e) != Status::ok) break;  // not_ready: later events on this stream are too
      driver->release_event(e);
      q.pop_front();
      --pending_event_count;
      if (--b->event_count == 0) free_block(b);
    }
    it = q.empty() ? pending_events.erase(it) : std::next(it);
  }
}

void DeviceEngine::State::synchronize_and_free_events() {
  if (pending_events.empty()) return;
  ++stats.num_sync_all_streams;
  for (auto it = pending_events.begin(); it != pending_events.end();) {
    auto& q = it->second;
    while (!q.empty()) {
      auto [e, b] = q.front();
      ++stats.num_forced_syncs;
      if (driver->synchronize_event(e) != Status::ok) {  // the block stays pending (Note [Failed waits])
        wait_failed("an event synchronisation");
        break;
      }
      driver->release_event(e);
      q.pop_front();
      --pending_event_count;
      if (--b->event_count == 0) free_block(b);
    }
    it = q.empty() ? pending_events.erase(it) : std::next(it);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Slow path: the retry chain

bool DeviceEngine::State::garbage_collect(AllocParams& p) {
  // PyTorch's rule: only with a memory fraction and a threshold; only whole-segment (non-split),
  // non-growable free blocks of the large pool, oldest first by the pool's allocation clock.
  if (!allowed_memory_maximum || opts.garbage_collection_threshold <= 0) return false;
  const auto threshold = static_cast<std::size_t>(opts.garbage_collection_threshold *
                                                  static_cast<double>(allowed_memory_maximum));
  if (total_reserved <= threshold) return false;
  const std::size_t target = total_reserved - threshold;
  BlockPool& pool = p.pool->owner->large;
  auto eligible = [](const Block* b) { return !b->is_split() && !b->segment->growable; };
  std::size_t reclaimed = 0;
  bool freed = true;
  while (reclaimed < target && freed) {
    freed = false;
    double total_age = 0;
    std::size_t n = 0;
    for (const Block* b : pool.blocks)
      if (eligible(b)) {
        total_age += static_cast<double>(static_cast<std::uint32_t>(pool.get_free_blocks_call_count) - b->gc_count_base);
        ++n;
      }
    if (n == 0) break;
    const double age_threshold = total_age / static_cast<double>(n);
    std::vector<Block*> victims;
    for (Block* b : pool.blocks)
      if (eligible(b) &&
          static_cast<double>(static_cast<std::uint32_t>(pool.get_free_blocks_call_count) - b->gc_count_base) >= age_threshold)
        victims.push_back(b);
    for (Block* b : victims) {
      if (reclaimed >= target) break;
      const std::size_t size = b->size;
      if (policy->release_whole_segment(b)) {
        reclaimed += size;
        freed = true;
      }
    }
  }
  return reclaimed > 0;
}

bool DeviceEngine::State::release_available_cached_blocks(AllocParams& p) {
  if (opts.max_split_size == SIZE_MAX) return false;
  BlockPool& pool = *p.pool;
  auto oversize = [&](const Block* b) {
    return b->stream == p.stream && !b->segment->growable && !b->is_split() && b->size >= opts.max_split_size;
  };
  // The smallest oversize block that covers the request on its own...
  const std::size_t want = std::max(p.rounded, opts.max_split_size);
  Block* best = nullptr;
  for (Block* b : pool.blocks)
    if (oversize(b) && b->size >= want && (!best || b->size < best->size)) best = b;
  if (best) return policy->release_whole_segment(best);
  // ...else oversize blocks from the largest down until enough is released.
  std::vector<Block*> big;
  for (Block* b : pool.blocks)
    if (oversize(b)) big.push_back(b);
  std::sort(big.begin(), big.end(), [](const Block* a, const Block* b) { return a->size > b->size; });
  std::size_t total = 0;
  for (Block* b : big) {
    if (total >= p.rounded) break;
    const std::size_t size = b->size;
    if (policy->release_whole_segment(b)) total += size;
  }
  return total >= p.rounded;
}

void DeviceEngine::State::release_cached_blocks(PoolSet* only) {
  background.quiesce();  // what a job holds is given back too (Note [Background work])
  synchronize_and_free_events();
  policy->release_free(only ? only : &default_pools, false);
  if (!only) maybe_free_private_pools();
  retry_deferred();
}

void DeviceEngine::State::maybe_free_private_pools() {
  // Graph-private memory may be used by a replay on any stream (PyTorch replays on the caller's stream):
  // a device-wide synchronisation first, as cudaFree's, never while a capture may be under way (it would
  // invalidate it; Note [Capture rules]). If it fails, nothing goes (Note [Failed waits]).
  const bool any = std::any_of(private_pools.begin(), private_pools.end(), [&](const auto& kv) {
    return kv.second->released && std::any_of(segments.begin(), segments.end(),
                                              [&](const auto& seg) { return seg->owner == kv.second.get(); });
  });
  if (capturing() || (any && !synchronize_device())) return;
  for (auto it = private_pools.begin(); it != private_pools.end();) {
    PoolSet* ps = it->second.get();
    if (!ps->released) { ++it; continue; }
    policy->release_free(ps, /*device_synchronized=*/true);
    const bool empty = std::none_of(segments.begin(), segments.end(),
                                    [&](const auto& seg) { return seg->owner == ps; });
    it = empty ? private_pools.erase(it) : std::next(it);
  }
}

void DeviceEngine::State::after_capture() {
  std::vector<Block*> blocks;
  blocks.swap(deferred_until_no_capture);
  for (Block* b : blocks) {
    --b->event_count;  // its placeholder
    if (!insert_events(b)) defer_events(b);
    else if (b->event_count == 0) free_block(b);
  }
  maybe_free_private_pools();
}

Block* DeviceEngine::State::allocate_slow(AllocParams& p, AllocError* err) {
  if (capturing()) {
    // Note [Capture rules]: grow or fail; nothing is released, synchronised or lent.
    if (p.pool->small && policy->small_from_large_remnants())
      if (Block* b = take_large_remnant(p)) return b;
    if (Block* b = policy->grow(p)) return b;
    return fail_allocation(p, err);
  }
  if (has_deferred()) retry_deferred();
  if (!exports.empty()) reap_exports();  // Note [Sharing]: blocks freed by their owner, no longer open anywhere
  garbage_collect(p);
  if (p.pool->small && policy->small_from_large_remnants())
    if (Block* b = take_large_remnant(p)) return b;
  Block* b = policy->grow(p);
  if (!b && p.status == Status::out_of_memory && release_available_cached_blocks(p)) b = policy->grow(p);
  if (!b && p.status == Status::out_of_memory) {
    release_cached_blocks(nullptr);
    ++stats.num_alloc_retries;
    // The pool may hold a fitting block again (events completed and merged): try the cache first.
    b = find_free_block(p);
    if (!b) b = policy->grow(p);
  }
  if (b) return b;
  return fail_allocation(p, err);
}

Block* DeviceEngine::State::fail_allocation(AllocParams& p, AllocError* err) {
  const std::string driver_msg = p.status == Status::out_of_memory ? std::string() : driver->last_error();
  std::size_t free_b = 0, total_b = 0;
  driver->memory_info(&free_b, &total_b);
  if (p.status == Status::out_of_memory) {
    ++stats.num_ooms;
    emit(*this, TraceAction::oom, p.stream, free_b, p.requested, p.rounded);
  }
  set_error(err, p.status, oom_message(p, driver_msg));
  return nullptr;
}

std::string DeviceEngine::State::oom_message(const AllocParams& p, const std::string& driver_error) {
  std::size_t free_b = 0, total_b = 0;
  driver->memory_info(&free_b, &total_b);
  std::size_t largest = 0, total_free = 0;
  for (PoolSet* ps : {&default_pools}) {
    for (BlockPool* bp : {&ps->small, &ps->large})
      for (Block* b : bp->blocks) {
        largest = std::max(largest, b->size);
        total_free += b->size;
      }
  }
  const std::size_t allocated = static_cast<std::size_t>(stats.allocated_bytes.all().current);
  const std::size_t unallocated = total_reserved > allocated ? total_reserved - allocated : 0;
  std::string m;
  if (p.status != Status::out_of_memory) {
    m = "fragless: driver error while allocating " + format_bytes(p.requested) + " on device " +
        std::to_string(driver->device()) + ": " + driver_error;
    return m;
  }
  // The first sentences are PyTorch's, word for word: tools match them (accelerate's batch-size finder).
  m = "CUDA out of memory. Tried to allocate " + format_bytes(p.requested) + ". GPU " +
      std::to_string(driver->device()) + " has a total capacity of " + format_bytes(total_b) + " of which " +
      format_bytes(free_b) + " is free. fragless (policy " + std::string(policy_name(opts.policy)) + "): " +
      format_bytes(p.rounded) + " after rounding.";
  if (allowed_memory_maximum)
    m += " This process is limited to " + format_bytes(allowed_memory_maximum) +
         " (per_process_memory_fraction).";
  m += " Of the reserved memory " + format_bytes(allocated) + " is allocated and " + format_bytes(unallocated) +
       " is reserved but unallocated; the largest free cached range is " + format_bytes(largest);
  if (total_free > 0) {
    char pct[32];
    std::snprintf(pct, sizeof pct, "%.1f%%",
                  100.0 * (1.0 - static_cast<double>(largest) / static_cast<double>(total_free)));
    m += std::string(" (external fragmentation ") + pct + ")";
  }
  m += ". Live (requested) bytes: " + format_bytes(static_cast<std::size_t>(stats.live_bytes.current)) + ".";
  if (opts.policy == PolicyKind::classic && unallocated > total_b / 20)
    m += " Much memory is reserved but unallocated: try FRAGLESS_CONF=policy:fragless to avoid fragmentation.";
  else
    m += " Try a smaller batch or sequence length, free tensors you no longer need, or raise "
         "per_process_memory_fraction.";
  return m;
}

// ---------------------------------------------------------------------------------------------------------
// Public API

DeviceEngine::DeviceEngine(const Options& options, std::unique_ptr<Driver> driver)
    : s_(std::make_unique<State>(options, std::move(driver))) {}

DeviceEngine::~DeviceEngine() = default;

void* DeviceEngine::allocate(std::size_t size, Stream stream, AllocError* err) {
  if (err) err->status = Status::ok;
  if (size == 0) return nullptr;
  State& s = *s_;
  if (size >= kMaxRequest) {
    set_error(err, Status::out_of_memory,
              "CUDA out of memory. Tried to allocate more than 1EB memory. (fragless: " + std::to_string(size) +
                  " bytes requested on device " + std::to_string(s.driver->device()) + ")");
    std::lock_guard lk(s.mu);
    ++s.stats.num_ooms;
    return nullptr;
  }
  std::lock_guard lk(s.mu);
  if (!s.capturing()) {  // Note [Capture rules]: no event query while a capture may be under way
    if (!s.deferred_until_no_capture.empty()) s.after_capture();
    if (s.pending_event_count) s.process_events();
  }
  if (!s.retired_streams.empty()) s.retired_streams.erase(stream);  // a new stream with that handle value
  AllocParams p;
  p.requested = size;
  p.rounded = round_size(size, s.opts);
  p.stream = stream;
  p.pool = &(s.routes.empty() ? s.default_pools : s.pool_set_for(stream)).pool(is_small(p.rounded));
  Block* b = s.find_free_block(p);
  if (!b) b = s.allocate_slow(p, err);
  if (!b) return nullptr;
  return reinterpret_cast<void*>(s.take_block(b, p)->ptr);
}

Status DeviceEngine::free(void* ptr, AllocError* err) {
  if (ptr == nullptr) return Status::ok;
  State& s = *s_;
  std::lock_guard lk(s.mu);
  Block* b = s.active_blocks.get(reinterpret_cast<DevicePtr>(ptr));
  if (!b || b->state != BlockState::allocated) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "fragless: free of pointer %p on device %d that fragless did not allocate or already freed; "
                  "nothing was changed",
                  ptr, s.driver->device());
    const bool opened = !b && s.imports.count(reinterpret_cast<DevicePtr>(ptr));
    set_error(err, Status::invalid_argument, opened ? s.imported_free_message(ptr) : std::string(buf));
    return Status::invalid_argument;
  }
  if (b->exported) return s.free_exported(b, err);  // Note [Sharing]: held while another process has it open
  s.free_live(b);
  return Status::ok;
}

void DeviceEngine::State::free_live(Block* b) {
  State& s = *this;
  const bool small = b->pool->small;
  const auto size = static_cast<std::int64_t>(b->size);
  s.stats.allocation.add(small, -1);
  s.stats.allocated_bytes.add(small, -size);
  s.stats.live_bytes.add(-static_cast<std::int64_t>(b->requested));
  if (b->size >= s.opts.max_split_size) s.stats.oversize_allocations.add(-1);
  if (is_per_thread_stream(b->stream) && b->stream == per_thread_stream()) {
    // R16: mark the stream for other threads; no event goes into a capture (a stale mark is no mark).
    if (!s.capturing()) {
      s.mark_per_thread_free(b->stream);
    } else if (auto& m = s.per_thread_marks[b->stream]; m.valid) {
      s.driver->release_event(m.event);
      m.valid = false;
    }
  }
  if (!b->stream_uses.empty()) {
    emit(s, TraceAction::free_requested, b->stream, b->ptr, b->requested, b->size);
    b->state = BlockState::free;  // not allocated any more, but waits for its events (active_pending_free)
    if (s.capturing()) {
      // Note [Capture rules]: its events are recorded when the routing ends; until then it stays pending.
      s.defer_events(b);
      return;
    }
    if (!s.deferred_until_no_capture.empty()) s.after_capture();
    if (!s.insert_events(b)) {
      s.defer_events(b);  // Note [Failed waits]: tried again at the next allocation
      return;
    }
    if (b->event_count == 0) {
      b->state = BlockState::allocated;
      s.free_block(b);
    }
  } else {
    emit(s, TraceAction::free, b->stream, b->ptr, b->requested, b->size);
    s.free_block(b, /*traced=*/false);
  }
}

Status DeviceEngine::record_stream(void* ptr, Stream stream) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  Block* b = s.active_blocks.get(reinterpret_cast<DevicePtr>(ptr));
  if (!b || b->state != BlockState::allocated) return Status::invalid_argument;
  if (stream == b->stream) return Status::ok;
  b->stream_uses.add(stream);
  return Status::ok;
}

bool DeviceEngine::owns(void* ptr) {
  std::lock_guard lk(s_->mu);
  return s_->active_blocks.count(reinterpret_cast<DevicePtr>(ptr)) != 0;
}

void* DeviceEngine::base_allocation(void* ptr, std::size_t* size) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  Block* b = s.active_blocks.get(reinterpret_cast<DevicePtr>(ptr));
  if (!b) return nullptr;
  if (b->segment->growable) {  // the block itself is the base: growable segments are not shareable as a whole
    if (size) *size = b->size;
    return ptr;
  }
  if (size) *size = b->segment->va_size;
  return reinterpret_cast<void*>(b->segment->base);
}

void* DeviceEngine::allocation_containing(void* ptr, std::size_t* size) {
  State& s = *s_;
  const auto p = reinterpret_cast<DevicePtr>(ptr);
  std::lock_guard lk(s.mu);
  for (const auto& seg : s.segments) {
    if (p < seg->base || p >= seg->base + seg->va_size) continue;
    for (Block* b = seg->first; b; b = b->next)
      if (p >= b->ptr && p < b->ptr + b->size) {
        if (b->state != BlockState::allocated) return nullptr;
        if (size) *size = b->size;
        return reinterpret_cast<void*>(b->ptr);
      }
    return nullptr;
  }
  return nullptr;
}

namespace {
// The wait failures of an operation (Note [Failed waits]) as its result.
Status report_waits(std::string* wait_error, AllocError* err) {
  if (wait_error->empty()) return Status::ok;
  set_error(err, Status::driver_error, std::move(*wait_error));
  wait_error->clear();
  return Status::driver_error;
}
}  // namespace

Status DeviceEngine::empty_cache(AllocError* err) {
  std::lock_guard lk(s_->mu);
  if (s_->capturing()) return Status::ok;  // Note [Capture rules]: nothing is released while a capture may be under way
  emit(*s_, TraceAction::empty_cache, 0, 0, 0, 0);
  if (!s_->deferred_until_no_capture.empty()) s_->after_capture();
  if (!s_->exports.empty()) s_->reap_exports();
  s_->release_cached_blocks(nullptr);
  return report_waits(&s_->wait_error, err);
}

void DeviceEngine::capture_began() {
  std::lock_guard lk(s_->mu);
  ++s_->external_captures;
  s_->background.routing_changed(true);  // Note [Background work]: no job while a capture may be under way
}

void DeviceEngine::capture_ended() {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  if (s.external_captures > 0 && --s.external_captures == 0 && !s.capturing()) {
    s.after_capture();
    s.background.routing_changed(false);
  }
}

Status DeviceEngine::retire_stream(Stream stream, AllocError* err) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  if (s.capturing()) return Status::ok;  // no synchronisation during a capture; the stream stays as it was
  if (s.forced_sync(stream) == Status::ok) s.retired_streams.insert(stream);
  return report_waits(&s.wait_error, err);
}

void DeviceEngine::flush_trace() {
  std::lock_guard lk(s_->mu);
  if (s_->sink) s_->sink->flush();
}

Status DeviceEngine::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) return Status::invalid_argument;
  std::lock_guard lk(s_->mu);
  s_->opts.per_process_memory_fraction = fraction;
  s_->allowed_memory_maximum = fraction < 1.0 ? static_cast<std::size_t>(fraction * s_->device_total) : 0;
  return Status::ok;
}

void DeviceEngine::begin_allocate_to_pool(PoolId id, StreamFilter filter) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  auto& ps = s.private_pools[id];
  if (!ps) {
    ps = std::make_unique<PoolSet>();
    ps->id = id;
    ps->small.owner = ps.get();
    ps->small.small = true;
    ps->large.owner = ps.get();
  }
  ps->released = false;
  s.background.routing_changed(true);  // Note [Background work]: no job while a capture may be under way
  s.routes.emplace_back(ps.get(), std::move(filter));
}

void DeviceEngine::end_allocate_to_pool(PoolId id) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  auto it = std::find_if(s.routes.rbegin(), s.routes.rend(), [&](auto& r) { return r.first->id == id; });
  if (it != s.routes.rend()) s.routes.erase(std::next(it).base());
  // PyTorch ends the capture (cudaStreamEndCapture) before it ends the routing: events may be recorded now.
  if (!s.capturing()) {
    s.after_capture();
    s.background.routing_changed(false);
  }
}

Status DeviceEngine::release_pool(PoolId id, AllocError* err) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  auto it = s.private_pools.find(id);
  if (it == s.private_pools.end()) return Status::ok;
  std::erase_if(s.routes, [&](auto& r) { return r.first == it->second.get(); });
  it->second->released = true;
  // Freed now (after a device-wide synchronisation), or once no capture may be under way (Note [Capture
  // rules]).
  if (!s.capturing()) {
    s.after_capture();
    s.background.routing_changed(false);
  }
  return report_waits(&s.wait_error, err);
}

DeviceStats DeviceEngine::stats() {
  std::lock_guard lk(s_->mu);
  if (!s_->exports.empty()) s_->reap_exports();
  return s_->stats;
}

DeviceEngine::Usage DeviceEngine::usage() {
  std::lock_guard lk(s_->mu);
  return {s_->stats.allocated_bytes.all().current, s_->stats.reserved_bytes.all().current,
          s_->stats.live_bytes.current};
}

void DeviceEngine::reset_peak_stats() {
  std::lock_guard lk(s_->mu);
  s_->stats.reset_peaks();
}

void DeviceEngine::reset_accumulated_stats() {
  std::lock_guard lk(s_->mu);
  s_->stats.reset_accumulated();
}

std::vector<SegmentInfo> DeviceEngine::snapshot() {
  std::lock_guard lk(s_->mu);
  return s_->snapshot();
}

double DeviceEngine::run_background(double budget_us) { return s_->background.step(budget_us); }

void DeviceEngine::drain_background() { s_->background.drain(); }

DriverCounters DeviceEngine::driver_counters() {
  std::lock_guard lk(s_->mu);
  return s_->driver->counters();
}

void DeviceEngine::reset_driver_counters() {
  std::lock_guard lk(s_->mu);
  s_->driver->reset_counters();
}

std::pair<std::size_t, std::size_t> DeviceEngine::free_ranges() {
  std::lock_guard lk(s_->mu);
  std::size_t largest = 0, total = 0;
  for (BlockPool* bp : {&s_->default_pools.small, &s_->default_pools.large})
    for (Block* b : bp->blocks) {
      largest = std::max(largest, b->size);
      total += b->size;
    }
  return {largest, total};
}

std::string DeviceEngine::check_invariants() {
  std::lock_guard lk(s_->mu);
  return s_->check_invariants();
}

void DeviceEngine::set_event_sink(EventSink* sink) {
  std::lock_guard lk(s_->mu);
  s_->sink = sink;
}

const Options& DeviceEngine::options() const { return s_->opts; }
Driver& DeviceEngine::driver() { return *s_->driver; }
void DeviceEngine::memory_info(std::size_t* free_bytes, std::size_t* total_bytes) {
  std::lock_guard lk(s_->mu);
  // A job in flight may hold less than the books say (a split releases its handle before creating the
  // pages): the answer waits for it, so free + reserved is the device's memory, as without background work.
  s_->background.wait_idle();
  s_->driver->memory_info(free_bytes, total_bytes);
}
int DeviceEngine::device() const { return s_->driver->device(); }

}  // namespace fragless
