// DeviceEngine: the engine's public face (engine.h) over its books, State (state/engine_state.h): the
// engine's construction and teardown, and each public call. The request and free paths and the retry chain
// are in engine/allocate.cpp, the bookkeeping of blocks and pools in state/books.cpp.
#include "fragless/engine.h"

#include "fragless/allocator.h"

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

// The wait failures of an operation (Note [Failed waits]) as its result.
Status report_waits(std::string* wait_error, AllocError* err) {
  if (wait_error->empty()) return Status::ok;
  set_error(err, Status::driver_error, std::move(*wait_error));
  wait_error->clear();
  return Status::driver_error;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Construction and teardown

DeviceEngine::State::State(const Options& o, std::unique_ptr<Driver> d) : opts(o), driver(std::move(d)) {
  default_pools.small.owner = &default_pools;
  default_pools.small.small = true;
  default_pools.large.owner = &default_pools;
  std::size_t free_b = 0;
  driver->memory_info(&free_b, &device_total);
  memory_limited = opts.per_process_memory_fraction < 1.0;
  if (memory_limited) allowed_memory_maximum = static_cast<std::size_t>(opts.per_process_memory_fraction * device_total);
  stats.max_split_size = opts.max_split_size == SIZE_MAX ? -1 : static_cast<std::int64_t>(opts.max_split_size);
  policy = make_policy(opts.policy, *this);
  background.set_work(policy.get(), driver.get());
  // Note [Imports across fork] (engine/share.cpp): a forked child closes its copies of the imports' leases.
  hold_across_fork_first(&State::fork_nothing, &State::fork_nothing, &State::imports_in_forked_child, this);
}

DeviceEngine::State::~State() {
  stop_holding_across_fork(this);
  background.stop();  // Note [Background work]: the worker never outlives the engine
  close_all_shares();  // Note [Sharing]: what other processes opened keeps its memory through their handles
  // Give everything back, live blocks too: the process is done with this device. Work on streams other than a
  // block's own (record_stream) may still use memory given back here: a block freed with events pending, one
  // freed during a capture whose events were deferred, a live block with stream uses. The per-stream waits of
  // release_free cover only the blocks' own streams, and a device-wide wait only this device's: each pending
  // event is waited for, and each stream a block still lists (another device's too).
  std::set<Stream> used;
  active_blocks.for_each([&](DevicePtr, Block* b) { used.insert(b->stream_uses.begin(), b->stream_uses.end()); });
  for (auto& [id, ev] : pending_events)
    for (auto& [e, b] : ev) {
      driver->synchronize_event(e);  // (a wait that fails is the driver's to report: the process is done here)
      driver->release_event(e);
    }
  pending_events.clear();
  for (Stream st : used) forced_sync(st);  // a destroyed stream's event, another thread's per-thread mark
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
  for (auto& [st, r] : retired_streams)
    if (r.pending) driver->release_event(r.event);
}

// ---------------------------------------------------------------------------------------------------------
// Public API

DeviceEngine::DeviceEngine(const Options& options, std::unique_ptr<Driver> driver)
    : s_(std::make_unique<State>(options, std::move(driver))) {}

DeviceEngine::~DeviceEngine() = default;

void* DeviceEngine::allocate(std::size_t size, Stream stream, AllocError* err) {
  if (err) {
    err->status = Status::ok;
    err->alloc_size = 0;
  }
  if (size == 0) return nullptr;
  State& s = *s_;
  if (size >= kMaxRequest) {
    set_error(err, Status::out_of_memory,
              "CUDA out of memory. Tried to allocate more than 1EB memory. (fragless: " + std::to_string(size) +
                  " bytes requested on device " + std::to_string(s.driver->device()) + ")");
    return nullptr;  // refused before any search, and not counted as an out-of-memory (PyTorch checks it first too)
  }
  std::lock_guard lk(s.mu);
  if (!s.capturing()) {  // Note [Capture rules]: no event query while a capture may be under way
    if (!s.deferred_until_no_capture.empty()) s.retry_deferred_events();
    if (s.pending_event_count) s.process_events();
  }
  // Note [Destroyed streams]: a value retired before is a new stream, after the old one's work.
  if (!s.retired_streams.empty() && s.stream_named(stream) != Status::ok) {
    report_waits(&s.wait_error, err);
    return nullptr;
  }
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

namespace {
enum class FreeKind { now, defer, deferred };
}  // namespace

// free, defer_free and free_deferred: one check of the block, then what each does.
static Status free_as(DeviceEngine::State& s, void* ptr, FreeKind kind, AllocError* err, std::size_t* size = nullptr);

Status DeviceEngine::free(void* ptr, AllocError* err) {
  if (ptr == nullptr) return Status::ok;
  return free_as(*s_, ptr, FreeKind::now, err);
}

Status DeviceEngine::defer_free(void* ptr, AllocError* err, std::size_t* size) {
  return free_as(*s_, ptr, FreeKind::defer, err, size);
}

Status DeviceEngine::free_deferred(void* ptr, AllocError* err) { return free_as(*s_, ptr, FreeKind::deferred, err); }

static Status free_as(DeviceEngine::State& s, void* ptr, FreeKind kind, AllocError* err, std::size_t* size) {
  std::lock_guard lk(s.mu);
  Block* b = s.active_blocks.get(reinterpret_cast<DevicePtr>(ptr));
  // A deferred block is freed only by free_deferred, and a block whose owner freed it while exported is not
  // deferred again (free_exported refuses its second free itself).
  if (!b || b->state != BlockState::allocated || b->deferred != (kind == FreeKind::deferred) ||
      (kind == FreeKind::defer && b->exported && s.exports.at(b->ptr).owner_freed)) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "fragless: free of pointer %p on device %d that fragless did not allocate or already freed; "
                  "nothing was changed",
                  ptr, s.driver->device());
    const bool opened = !b && s.imports.count(reinterpret_cast<DevicePtr>(ptr));
    set_error(err, Status::invalid_argument, opened ? s.imported_free_message(ptr) : std::string(buf));
    return Status::invalid_argument;
  }
  if (kind == FreeKind::defer) {
    b->deferred = true;
    if (size) *size = b->size;
    return Status::ok;
  }
  b->deferred = false;
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
    if (!s.deferred_until_no_capture.empty()) s.retry_deferred_events();
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
  if (!b || b->state != BlockState::allocated || b->deferred) return Status::invalid_argument;
  // Note [Destroyed streams]: a value retired before is a new stream, even the block's own (a stream given the
  // value of the one it was allocated on, as CUDA may do at once). If the old work could not be ordered (a
  // failed wait), the value stays retired, named: later waits then cover both streams' work.
  if (!s.retired_streams.empty()) s.stream_named(stream);
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

void* DeviceEngine::allocation_containing(void* ptr, std::size_t* size, bool* freed) {
  State& s = *s_;
  const auto p = reinterpret_cast<DevicePtr>(ptr);
  std::lock_guard lk(s.mu);
  auto found = [&](const Block* b) -> void* {
    if (b->state != BlockState::allocated) return nullptr;
    if (size) *size = b->size;
    if (freed) *freed = b->deferred || (b->exported && s.exports.at(b->ptr).owner_freed);
    return reinterpret_cast<void*>(b->ptr);
  };
  if (const Block* b = s.active_blocks.get(p); b && b->state == BlockState::allocated) return found(b);  // its start
  for (const auto& seg : s.segments) {
    if (p < seg->base || p >= seg->base + seg->va_size) continue;
    for (Block* b = seg->first; b; b = b->next)
      if (p >= b->ptr && p < b->ptr + b->size) return found(b);
    return nullptr;
  }
  return nullptr;
}

Status DeviceEngine::empty_cache(AllocError* err) {
  std::lock_guard lk(s_->mu);
  if (s_->capturing()) return Status::ok;  // Note [Capture rules]: nothing is released while a capture may be under way
  emit(*s_, TraceAction::empty_cache, 0, 0, 0, 0);
  if (!s_->deferred_until_no_capture.empty()) s_->retry_deferred_events();
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
  // Note [Destroyed streams]: an event stands in for the stream; no wait now. The stream is not capturing (the
  // caller's promise), so its event is no node of a graph, also while another stream captures. Without an
  // event, the wait, which a capture under way forbids (the stream then stays as it was).
  if (auto it = s.retired_streams.find(stream); it != s.retired_streams.end()) {
    if (!it->second.named) return Status::ok;  // retired already (the runtime's destroy goes on to the driver's)
    // Named again after a failed wait and destroyed again: both streams' work, waited for now; failing that,
    // the new stream's event replaces the old one (the failed waits are reported).
    if (s.forced_sync(stream) == Status::ok) {
      s.retired_streams[stream] = State::Retired{};
      return report_waits(&s.wait_error, err);
    }
    State::Retired& r = s.retired_streams[stream];
    if (r.pending) s.driver->release_event(r.event);
    r = State::Retired{};
    r.pending = s.driver->record_event(stream, &r.event) == Status::ok;
    if (r.pending) s.retired_unchecked.push_back(stream);
    return report_waits(&s.wait_error, err);
  }
  if (s.retired_unchecked.size() >= 64) s.sweep_retired();
  State::Retired r;
  r.pending = s.driver->record_event(stream, &r.event) == Status::ok;
  if (r.pending) s.retired_unchecked.push_back(stream);
  if (r.pending || (!s.capturing() && s.forced_sync(stream) == Status::ok)) s.retired_streams.emplace(stream, r);
  return report_waits(&s.wait_error, err);
}

void DeviceEngine::flush_trace() {
  // Not by a thread that holds the lock already (Note [Exit while the lock is held]): taking it again would
  // never return, and the sink may be halfway through a record.
  if (s_->mu.held_by_this_thread()) return;
  std::lock_guard lk(s_->mu);
  if (s_->sink) s_->sink->flush();
}

Status DeviceEngine::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) return Status::invalid_argument;
  std::lock_guard lk(s_->mu);
  s_->opts.per_process_memory_fraction = fraction;
  s_->memory_limited = fraction < 1.0;
  s_->allowed_memory_maximum = s_->memory_limited ? static_cast<std::size_t>(fraction * s_->device_total) : 0;
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
  ++ps->uses;  // Note [Shared private pools]
  ps->released = false;
  s.background.routing_changed(true);  // Note [Background work]: no job while a capture may be under way
  s.routes.emplace_back(ps.get(), std::move(filter));
}

namespace {
// Device lock held: a routing has ended. PyTorch ends the capture (cudaStreamEndCapture) before it ends the
// routing: with no other capture under way, events may be recorded now.
void routing_ended(DeviceEngine::State& s) {
  if (!s.capturing()) {
    s.after_capture();
    s.background.routing_changed(false);
  }
}

// Note [Routing by stream]
// PyTorch 2.1 and 2.2 route a capture by its stream: beginAllocateStreamToPool(device, stream, pool) and
// endAllocateStreamToPool(device, stream), which names no pool. Two graphs may share a pool (Note [Shared
// private pools]) and be captured at once on two streams, so an end must take away the route of its own
// stream, not the newest of the pool: ending the other one would send that capture's allocations to the
// default pool, where ordinary tensors reuse them while the graph replays. A stream's route is told from
// the others by its filter's type (OnStream, which holds the stream), with no new field in the routes.
struct OnStream {
  Stream stream;
  bool operator()(Stream s) const { return s == stream; }
};
}  // namespace

Status DeviceEngine::end_allocate_to_pool(PoolId id) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  auto it = std::find_if(s.routes.rbegin(), s.routes.rend(), [&](auto& r) { return r.first->id == id; });
  if (it == s.routes.rend()) return Status::invalid_argument;  // no begin for this pool (or ended since)
  s.routes.erase(std::next(it).base());
  routing_ended(s);
  return Status::ok;
}

void DeviceEngine::begin_allocate_stream_to_pool(PoolId id, Stream stream) {
  begin_allocate_to_pool(id, OnStream{stream});  // Note [Routing by stream]
}

Status DeviceEngine::end_allocate_stream_to_pool(Stream stream, PoolId* id) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  auto it = std::find_if(s.routes.rbegin(), s.routes.rend(), [&](auto& r) {
    const OnStream* f = r.second.template target<OnStream>();
    return f && f->stream == stream;
  });
  if (it == s.routes.rend()) return Status::invalid_argument;  // no begin for this stream (or released since)
  if (id) *id = it->first->id;
  s.routes.erase(std::next(it).base());
  routing_ended(s);
  return Status::ok;
}

// Note [Shared private pools]
// Several graphs may share one private pool (torch.cuda.graph(g2, pool=g1.pool()), what CUDA-graph trees and
// serving engines do): each capture begins allocating to it, and each graph's reset() releases it. PyTorch's own
// allocator counts the uses (create_or_incref_pool, releasePool's use_count) and frees the pool's memory only
// when the last one is released; a pool freed at the first release would hand g2's addresses to other tensors
// while g2 still replays into them. So each begin_allocate_to_pool counts a use and each release_pool ends one;
// the pool is released when none is left. A release of a pool with no use left, or of one never begun, changes
// nothing and is invalid_argument (PyTorch asserts; a plug-in cannot throw into PyTorch).
Status DeviceEngine::release_pool(PoolId id, AllocError* err) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  auto it = s.private_pools.find(id);
  if (it == s.private_pools.end() || it->second->uses == 0) {
    set_error(err, Status::invalid_argument,
              "fragless: release_pool: pool (" + std::to_string(id.first) + ", " + std::to_string(id.second) +
                  ") of device " + std::to_string(s.driver->device()) + " has no use to release (never begun with "
                  "begin_allocate_to_pool, or released as many times as it was begun); nothing changed");
    return Status::invalid_argument;
  }
  // Note [Shared private pools]: another graph (or a later use of the pool) still holds it.
  if (--it->second->uses > 0) return Status::ok;
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

namespace {
DeviceEngine::Usage usage_of(const DeviceEngine::State& s) {
  return {s.stats.allocated_bytes.all().current, s.stats.reserved_bytes.all().current, s.stats.live_bytes.current};
}
// Device lock held. A job in flight may hold less than the books say (a split releases its handle before
// creating the pages): the answer waits for it, and no other starts meanwhile, so free + reserved is the
// device's memory, as without background work.
void quiet_memory_info(DeviceEngine::State& s, std::size_t* free_bytes, std::size_t* total_bytes) {
  s.background.begin_quiet();
  s.driver->memory_info(free_bytes, total_bytes);
  s.background.end_quiet();
}
}  // namespace

DeviceEngine::Usage DeviceEngine::usage() {
  std::lock_guard lk(s_->mu);
  return usage_of(*s_);
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

void DeviceEngine::mark_snapshot(std::size_t active_bytes) {
  std::lock_guard lk(s_->mu);
  emit(*s_, TraceAction::snapshot, 0, 0, active_bytes, active_bytes);
}

std::vector<ImportInfo> DeviceEngine::imports() {
  std::lock_guard lk(s_->mu);
  std::vector<ImportInfo> out;
  for (const auto& [p, im] : s_->imports)
    out.push_back(ImportInfo{p, im.size, im.va, im.span, im.exporter_pid, im.small});
  std::sort(out.begin(), out.end(), [](const ImportInfo& a, const ImportInfo& b) { return a.address < b.address; });
  return out;
}

double DeviceEngine::run_background(double budget_us) { return s_->background.step(budget_us); }

void DeviceEngine::drain_background() { s_->background.drain(); }

void DeviceEngine::stop_background() {
  if (s_->mu.held_by_this_thread())  // Note [Exit while the lock is held]: Background::stop detaches the worker
    std::fprintf(stderr,
                 "fragless: exit while this thread holds device %d's allocator lock (exit() from a signal handler "
                 "or an event sink?): its background worker is left, not joined, and its last trace records are "
                 "not written\n",
                 device());
  s_->background.stop();
}

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
  quiet_memory_info(*s_, free_bytes, total_bytes);
}

bool DeviceEngine::memory_info_and_usage(std::size_t* free_bytes, std::size_t* total_bytes, Usage* usage) {
  if (s_->mu.held_by_this_thread()) return false;
  std::lock_guard lk(s_->mu);
  quiet_memory_info(*s_, free_bytes, total_bytes);
  *usage = usage_of(*s_);
  return true;
}
int DeviceEngine::device() const { return s_->driver->device(); }

}  // namespace fragless
