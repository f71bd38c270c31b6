// The books of DeviceEngine::State (state/engine_state.h): blocks made and deleted, pools and the unmapped
// sets kept in order, splits and merges, the driver resources given back (or deferred when the driver
// refuses), reserved bytes, and the stream questions the request path asks (forced syncs, idle streams).
#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <type_traits>

#include "fragless/engine.h"
#include "state/engine_state.h"

namespace fragless {

// ---------------------------------------------------------------------------------------------------------
// Page tables

// All-zero bytes are an invalid PageRef: calloc's chunks need no constructor run.
static_assert(std::is_trivially_destructible_v<PageRef> && std::is_trivially_copyable_v<PageRef>);

const PageRef PageTable::kInvalid{};

bool PageTable::allocate(std::size_t n) {
  if (chunks_ || n == 0 || n > SIZE_MAX / sizeof(PageRef)) return false;
  n_ = n;
  chunks_ = static_cast<PageRef**>(std::calloc(chunk_count(), sizeof(PageRef*)));
  if (!chunks_) {
    n_ = 0;
    return false;
  }
  if (chunk_count() == 1 && !prepare(0, n)) {  // a one-chunk table is made whole now
    std::free(chunks_);
    chunks_ = nullptr;
    n_ = 0;
    return false;
  }
  return true;
}

PageRef* PageTable::new_chunk(std::size_t k) noexcept {
  // The last chunk holds only the entries left (a classic segment's table is one entry).
  const std::size_t entries = std::min(kChunk, n_ - (k << kChunkShift));
  return static_cast<PageRef*>(std::calloc(entries, sizeof(PageRef)));
}

bool PageTable::prepare(std::size_t first, std::size_t n) noexcept {
  if (n == 0) return true;
  for (std::size_t k = first >> kChunkShift; k <= (first + n - 1) >> kChunkShift; ++k)
    if (!chunks_[k] && !(chunks_[k] = new_chunk(k))) return false;
  return true;
}

std::size_t PageTable::chunks_made() const {
  std::size_t made = 0;
  for (std::size_t k = 0; chunks_ && k < chunk_count(); ++k) made += chunks_[k] != nullptr;
  return made;
}

PageTable::~PageTable() {
  if (!chunks_) return;
  for (std::size_t k = 0; k < chunk_count(); ++k) std::free(chunks_[k]);
  std::free(chunks_);
}

// ---------------------------------------------------------------------------------------------------------
// State basics

void DeviceEngine::State::give_back_mapping(DevicePtr va, std::size_t size) {
  if (driver->unmap(va, size) != Status::ok) driver->still_mapped(va, size, &deferred_unmaps);
}

void DeviceEngine::State::give_back_handle(PhysHandle h) {
  if (driver->release(h) != Status::ok) deferred_handles.push_back(h);
}

void DeviceEngine::State::give_back_reservation(DevicePtr va, std::size_t size) {
  if (driver->free_reservation(va, size) != Status::ok) deferred_reservations.emplace_back(va, size);
}

// Note [Memory the driver would not give back]
// A handle whose cuMemRelease failed, or a mapping whose cuMemUnmap failed (a released handle's memory goes
// with its last mapping, R8), leaves the books at once: reserved_bytes and the stats drop, as PyTorch's
// would after its free. But the device still holds that memory until a retry (retry_deferred) gets it back;
// so does a released idle handle that a lent range whose wait failed still maps. So the memory fraction
// (capacity_allows, the fragless policy's creatable pages and its estimate of the device's free memory) and
// the collection threshold weigh held_bytes(): the books, or, where it is more, what the driver's handles
// still hold (DriverContract::live_bytes, kept as handles are created and their memory goes, imports
// excluded). A running sum of what went onto the deferred lists counted one handle two or three times (its
// mapping and itself when both failed in an undo; a lent range's old mapping, whose handles are still on the
// books under the growth that took them) and was kept only for handles the engine had let go; the driver's
// count is the device's own, each handle once. It is also larger than the books, rightly, while a handle a
// lent range still maps is split (the worker releases it and creates its pieces while the lent mapping keeps
// its memory). The worker changes it without the engine's lock, so a decision reads it once. While a split
// is in flight (the old handle released, its pieces not yet created) it reads low by up to that handle, which
// matters only where it is above the books, after a failure: a growth then may pass a limit by up to that
// much until the worker's creates are refused. The OOM message names the difference.
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

Block* DeviceEngine::State::add_segment(const AllocParams& p, DevicePtr va, std::size_t va_size,
                                       std::size_t page_size, BlockState state) {
  auto seg = std::make_unique<Segment>();
  seg->base = va;
  seg->va_size = va_size;
  seg->page_size = page_size;
  seg->small = p.pool->small;
  seg->stream = p.stream;
  seg->owner = p.pool->owner;
  Block* b = new_block();
  b->ptr = va;
  b->size = va_size;
  b->segment = seg.get();
  b->pool = p.pool;
  b->stream = p.stream;
  b->state = state;
  seg->first = b;
  segments.push_back(std::move(seg));
  return b;
}

void DeviceEngine::State::delete_block(Block* b) {
  *b = Block{};
  spare_blocks.push_back(b);
}

void DeviceEngine::State::pool_insert(Block* b) {
  b->gc_count_base = static_cast<std::uint32_t>(b->pool->get_free_blocks_call_count);  // its age starts as it is freed
  b->pool->blocks.insert(b);
  b->in_size_set = true;
  b->pool->paged += b->paged();
  if (!b->segment->growable && b->is_split()) {
    stats.inactive_split.add(b->pool->small, 1);
    stats.inactive_split_bytes.add(b->pool->small, static_cast<std::int64_t>(b->size));
  }
}

void DeviceEngine::State::pool_erase(Block* b) {
  // By iterator: std::set's erase by key looks for the equal range, a second walk down the tree.
  if (auto it = b->pool->blocks.find(b); it != b->pool->blocks.end()) {
    b->pool->blocks.erase(it);
    b->pool->paged -= b->paged();
  }
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
  if (retired(st)) {  // Note [Destroyed streams]: its event stands in for it
    Retired& r = retired_streams[st];
    if (r.pending) {
      ++stats.num_forced_syncs;
      if (driver->synchronize_event(r.event) != Status::ok) return wait_failed("the synchronisation of a destroyed stream's work");
      driver->release_event(r.event);
      r.pending = false;
    }
    if (!r.named) return Status::ok;
    retired_streams.erase(st);  // the old work is done: the value is the new stream's alone, waited for below
  }
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

bool DeviceEngine::State::retired(Stream st) {
  if (retired_streams.empty()) return false;
  auto it = retired_streams.find(st);
  if (it == retired_streams.end()) return false;
  Retired& r = it->second;
  if (!r.named || !r.done(*driver)) return true;
  retired_streams.erase(it);  // named again and the old work done: a stream like any other
  return false;
}

void DeviceEngine::State::sweep_retired() {
  std::size_t kept = 0;
  for (Stream st : retired_unchecked) {
    auto it = retired_streams.find(st);
    if (it == retired_streams.end() || it->second.named || it->second.done(*driver)) continue;
    retired_unchecked[kept++] = st;
  }
  retired_unchecked.resize(kept);
}

bool DeviceEngine::State::retired_done(Stream st) {
  Retired& r = retired_streams[st];
  // Named again after a failed wait: the new stream's work counts too, and is not covered by the event.
  return r.done(*driver) && !r.named;
}

Status DeviceEngine::State::stream_named(Stream st) {
  auto it = retired_streams.find(st);
  if (it == retired_streams.end()) return Status::ok;
  Retired& r = it->second;
  if (r.pending) {
    // A wait on the stream is not made during a capture: the stream may be the one capturing, and the wait
    // would become a node of its graph.
    if (driver->query_event(r.event) != Status::ok && (capturing() || driver->stream_wait_event(st, r.event) != Status::ok)) {
      ++stats.num_forced_syncs;
      if (driver->synchronize_event(r.event) != Status::ok) {
        r.named = true;  // both streams' work counts from now on (retired, retired_done, forced_sync)
        return wait_failed("the synchronisation of a destroyed stream's work");
      }
    }
    driver->release_event(r.event);
  }
  retired_streams.erase(it);
  return Status::ok;
}

bool DeviceEngine::State::stream_idle(Stream st) {
  if (retired(st)) return retired_done(st);
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
  if (!memory_limited) return true;
  const std::size_t held = held_bytes();  // Note [Memory the driver would not give back]
  return held <= allowed_memory_maximum && extra <= allowed_memory_maximum - held;
}

PoolSet& DeviceEngine::State::pool_set_for(Stream st) {
  for (auto it = routes.rbegin(); it != routes.rend(); ++it)
    if (!it->second || it->second(st)) return *it->first;
  return default_pools;
}


}  // namespace fragless
