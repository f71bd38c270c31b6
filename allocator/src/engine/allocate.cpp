// The request and free paths of DeviceEngine::State: the fast path (best fit in a pool, split, events that
// hold a freed block back) and the slow path, the retry chain (grow, free what is cached, out of memory with
// its message). engine.h gives the call chain; state/engine_state.h the invariants.
#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "fragless/engine.h"
#include "fragless/rounding.h"
#include "policy/policy.h"
#include "state/engine_state.h"
#include "state/trace_emit.h"

namespace fragless {

namespace {

// PyTorch's format_size: a unit is used up to and including 1024 of it (1024 bytes, 1024.00 MiB).
std::string format_bytes(std::size_t b) {
  char buf[64];
  const double v = static_cast<double>(b);
  if (b <= (1ull << 10)) std::snprintf(buf, sizeof buf, "%zu bytes", b);
  else if (b <= (1ull << 20)) std::snprintf(buf, sizeof buf, "%.2f KiB", v / (1ull << 10));
  else if (b <= (1ull << 30)) std::snprintf(buf, sizeof buf, "%.2f MiB", v / (1ull << 20));
  else std::snprintf(buf, sizeof buf, "%.2f GiB", v / (1ull << 30));
  return buf;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Fast path

// The smallest free block of `pool` on p's stream that holds p.rounded bytes, or end().
BlockSizeSet::iterator DeviceEngine::State::best_fit(BlockPool& pool, const AllocParams& p) {
  Block key;
  key.stream = p.stream;
  key.size = p.rounded;
  auto it = pool.blocks.lower_bound(&key);
  return it != pool.blocks.end() && (*it)->stream == p.stream ? it : pool.blocks.end();
}

Block* DeviceEngine::State::find_free_block(AllocParams& p) {
  BlockPool& pool = *p.pool;
  if (memory_limited && opts.garbage_collection_threshold > 0) ++pool.get_free_blocks_call_count;
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
  // (As a difference: the sum wraps for a max_non_split_rounding_mb the parser saturated, which PyTorch's does.)
  if (p.rounded >= opts.max_split_size && b->size - p.rounded >= opts.max_non_split_rounding_size) return nullptr;
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
  const auto size = static_cast<std::int64_t>(b->size);
  const auto req = static_cast<std::int64_t>(p.requested);
  stats.allocation.add(small, 1);
  stats.allocated_bytes.add(small, size);
  if (small) small_allocated_high = std::max(small_allocated_high, stats.allocated_bytes.by_pool[kSmallPool].current);
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

bool DeviceEngine::State::insert_events(Block* b, bool wait_retired, std::vector<Stream>* running) {
  StreamUses left;
  for (Stream st : b->stream_uses) {
    if (running && std::find(running->begin(), running->end(), st) != running->end()) {
      left.add(st);  // a destroyed stream this retry already found running: not queried again per block
      continue;
    }
    if (retired(st)) {
      // Note [Destroyed streams]: no event on a destroyed stream. Its own, queried now; while its work runs
      // the use stays (the block waits in deferred_until_no_capture), or is waited for by a release.
      if (retired_done(st)) continue;
      if (!wait_retired || forced_sync(st) != Status::ok) {
        left.add(st);
        if (running) running->push_back(st);  // still running, or its wait failed: once per retry
      }
      continue;
    }
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
  ++stats.num_sync_all_streams;  // counted with no event to wait for too, as PyTorch counts it
  if (pending_events.empty()) return;
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
  if (!memory_limited || opts.garbage_collection_threshold <= 0) return false;
  const auto threshold = static_cast<std::size_t>(opts.garbage_collection_threshold *
                                                  static_cast<double>(allowed_memory_maximum));
  const std::size_t held = held_bytes();  // Note [Memory the driver would not give back]
  if (held <= threshold) return false;
  const std::size_t target = held - threshold;
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
    // Every block of at least the average age goes, past the target too (PyTorch's garbage_collect_cached_blocks:
    // a collection that stopped at the target would run again at the next miss).
    for (Block* b : victims) {
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

bool DeviceEngine::State::release_cached_blocks(PoolSet* only) {
  background.quiesce();  // what a job holds is given back too (Note [Background work])
  // The wait for a job in flight lets the device lock go: a begin_allocate_to_pool (and the caller's capture
  // right after it) may have come in meanwhile, and a synchronisation now would invalidate that capture
  // (Note [Capture rules]). Nothing is released then, as when the capture was under way at the call.
  if (capturing()) return false;
  // Blocks waiting for a destroyed stream's work (Note [Destroyed streams]) are waited for, as events are.
  if (!deferred_until_no_capture.empty()) retry_deferred_events(/*wait_retired=*/true);
  synchronize_and_free_events();
  policy->release_free(only ? only : &default_pools, false);
  if (!only) maybe_free_private_pools();
  retry_deferred();
  return true;
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
  // The device is idle now: blocks listed for a destroyed stream's work (Note [Destroyed streams]) go back
  // first, so that a pool they are in can go with the rest.
  if (any && !deferred_until_no_capture.empty()) retry_deferred_events();
  for (auto it = private_pools.begin(); it != private_pools.end();) {
    PoolSet* ps = it->second.get();
    if (!ps->released) { ++it; continue; }
    policy->release_free(ps, /*device_synchronized=*/true);
    const bool empty = std::none_of(segments.begin(), segments.end(),
                                    [&](const auto& seg) { return seg->owner == ps; });
    it = empty ? private_pools.erase(it) : std::next(it);
  }
}

void DeviceEngine::State::retry_deferred_events(bool wait_retired) {
  // The list is swapped with a kept, empty one, so that the list's storage is reused from retry to retry.
  std::vector<Block*>& blocks = deferred_retrying;
  blocks.clear();
  blocks.swap(deferred_until_no_capture);
  std::vector<Stream> running;  // destroyed streams found still running, each queried once per retry
  for (Block* b : blocks) {
    --b->event_count;  // its placeholder
    if (!insert_events(b, wait_retired, &running)) defer_events(b);
    else if (b->event_count == 0) free_block(b);
  }
  blocks.clear();
}

void DeviceEngine::State::after_capture() {
  retry_deferred_events();
  maybe_free_private_pools();
}

// Note [Larger than the device]
// A request whose rounded size exceeds the device's whole memory (cuMemGetInfo's total, read when the engine
// was made) cannot be had whatever is released, so no policy grows for it and no driver sees its size: a
// real driver's cuMemAddressReserve may refuse such a size as an invalid value, not as out of memory, which
// would surface as a driver error where PyTorch's callers (batch-size finders) catch
// torch.OutOfMemoryError; under expandable segments it would create page after page until the device was
// full, then undo them. The rest of the retry chain runs as PyTorch's does (its cudaMalloc refuses, it
// releases the cache, counts a retry, refuses again): the replay's fidelity rests on what an OOM leaves
// cached. Sizes of 1 EiB or more are refused earlier still, uncounted (DeviceEngine::allocate).
Block* DeviceEngine::State::grow(AllocParams& p) {
  if (larger_than_device(p.rounded)) {
    p.status = Status::out_of_memory;
    return nullptr;
  }
  return policy->grow(p);
}

Block* DeviceEngine::State::allocate_slow(AllocParams& p, AllocError* err) {
  if (capturing()) {
    // Note [Capture rules]: grow or fail; nothing is released, synchronised or lent.
    if (p.pool->small && policy->small_from_large_remnants())
      if (Block* b = take_large_remnant(p)) return b;
    if (Block* b = grow(p)) return b;
    return fail_allocation(p, err);
  }
  if (has_deferred()) retry_deferred();
  if (!exports.empty()) reap_exports();  // Note [Sharing]: blocks freed by their owner, no longer open anywhere
  garbage_collect(p);
  if (p.pool->small && policy->small_from_large_remnants())
    if (Block* b = take_large_remnant(p)) return b;
  Block* b = grow(p);
  if (!b && p.status == Status::out_of_memory && release_available_cached_blocks(p)) b = grow(p);
  if (!b && p.status == Status::out_of_memory && release_cached_blocks(nullptr)) {
    ++stats.num_alloc_retries;
    if (policy->retry_searches_cache()) b = find_free_block(p);
    if (!b) b = grow(p);
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
  set_error(err, p.status, oom_message(p, driver_msg, free_b, total_b));
  if (err && p.status == Status::out_of_memory) err->alloc_size = classic_segment_size(p.rounded);
  return nullptr;
}

std::string DeviceEngine::State::oom_message(const AllocParams& p, const std::string& driver_error,
                                            std::size_t free_b, std::size_t total_b) {
  std::size_t largest = 0, total_free = 0;
  for (PoolSet* ps : {&default_pools}) {
    for (BlockPool* bp : {&ps->small, &ps->large})
      for (Block* b : bp->blocks) {
        largest = std::max(largest, b->size);
        total_free += b->size;
      }
  }
  // As PyTorch: the free blocks of graphs' private pools are memory no other allocation can have, counted as
  // allocated ("in private pools"), not as reserved but unallocated.
  std::size_t in_private_pools = 0;
  for (const auto& [id, ps] : private_pools)
    for (BlockPool* bp : {&ps->small, &ps->large})
      for (Block* b : bp->blocks) in_private_pools += b->size;
  const std::size_t allocated = static_cast<std::size_t>(stats.allocated_bytes.all().current) + in_private_pools;
  const std::size_t unallocated = total_reserved > allocated ? total_reserved - allocated : 0;
  std::string m;
  if (p.status != Status::out_of_memory) {
    m = "fragless: driver error while allocating " + format_bytes(p.requested) + " on device " +
        std::to_string(driver->device()) + ": " + driver_error;
    return m;
  }
  // PyTorch's sentences first, word for word up to "reserved by PyTorch but unallocated." (tools and tests match
  // them: accelerate's batch-size finder): the size PyTorch's allocator would have asked cudaMalloc for
  // (get_allocation_size), its units (format_size), its "allowed; " for a memory fraction and its clause for
  // private pools; no per-process line (PyTorch's comes from NVML). Its last sentence, advice to set
  // expandable_segments, which does nothing to a pluggable allocator, gives way to fragless's own.
  m = "CUDA out of memory. Tried to allocate " + format_bytes(classic_segment_size(p.rounded)) + ". GPU " +
      std::to_string(driver->device()) + " has a total capacity of " + format_bytes(total_b) + " of which " +
      format_bytes(free_b) + " is free. ";
  if (memory_limited) m += format_bytes(allowed_memory_maximum) + " allowed; ";
  m += "Of the allocated memory " + format_bytes(allocated) + " is allocated by PyTorch, ";
  if (in_private_pools > 0)
    m += "with " + format_bytes(in_private_pools) + " allocated in private pools (e.g., CUDA Graphs), ";
  m += "and " + format_bytes(unallocated) + " is reserved by PyTorch but unallocated. fragless (policy " +
       std::string(policy_name(opts.policy)) + "): " + format_bytes(p.requested) + " requested, " +
       format_bytes(p.rounded) + " after rounding; the largest free cached range is " + format_bytes(largest);
  if (total_free > 0) {
    char pct[32];
    std::snprintf(pct, sizeof pct, "%.1f%%",
                  100.0 * (1.0 - static_cast<double>(largest) / static_cast<double>(total_free)));
    m += std::string(" (external fragmentation ") + pct + ")";
  }
  m += ". Live (requested) bytes: " + format_bytes(static_cast<std::size_t>(stats.live_bytes.current)) + ".";
  if (larger_than_device(p.rounded))  // Note [Larger than the device]
    m += " The request is larger than the device's whole memory.";
  // Note [Memory the driver would not give back]
  if (const std::size_t off_books = held_bytes() - total_reserved; off_books > 0)
    m += " The device holds " + format_bytes(off_books) + " more than fragless's books count (memory given up whose "
         "release, unmap or wait has not completed; retried at each slow allocation), counted against the limit.";
  if (opts.policy == PolicyKind::classic && unallocated > total_b / 20)
    m += " Much memory is reserved but unallocated: try FRAGLESS_CONF=policy:fragless to avoid fragmentation.";
  else if (memory_limited && !larger_than_device(p.rounded))  // a fraction below 1 is what stood in the way
    m += " Try a smaller batch or sequence length, free tensors you no longer need, or raise "
         "per_process_memory_fraction.";
  else
    m += " Try a smaller batch or sequence length, or free tensors you no longer need.";
  return m;
}


}  // namespace fragless
