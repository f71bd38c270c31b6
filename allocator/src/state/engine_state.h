// Internal state of one DeviceEngine. Layering (top to bottom): PoolSet → BlockPool → Segment → Block,
// with address space and physical pages managed by the policy (policy.h).
//
// Invariants (checked by check_invariants after every operation in the randomized tests):
//  I1  The blocks of a segment tile [base, base + va_size) exactly, in address order, linked by prev/next.
//  I2  An allocated or free block lies entirely in mapped, accessible pages; an unmapped block lies
//      entirely in unmapped pages and starts and ends on page boundaries.
//  I3  A block is in its BlockPool's size set iff it is free, mapped, and has no pending events;
//      in the unmapped set iff it is unmapped (a busy block, held by background work, is in neither).
//      No two adjacent free mapped blocks without events exist (they are merged), nor two adjacent
//      unmapped blocks.
//  I4  A physical page (handle, offset) backs at most one mapped page of one segment.
//  I5  Stats equal a recount from the block lists; reserved equals physical bytes held from the driver.
//  I6  Every allocated or pending block is in `active_blocks` under its address, and nothing else is.
#pragma once
#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fragless/engine.h"
#include "fragless/node_slab.h"
#include "fragless/rounding.h"
#include "state/background.h"
#include "state/block_map.h"
#include "fragless/spin_mutex.h"

namespace fragless {

class EventSink;
struct Segment;
struct BlockPool;
struct PoolSet;

// busy: held by a background job (policy.h, BackgroundJob): mapped, in no pool, not allocated; only the job's
// finish changes it.
enum class BlockState : std::uint8_t { free, allocated, unmapped, busy };

// Streams recorded on a block with record_stream (not its allocation stream). Almost always empty, so it
// costs one pointer in the block until the first use.
class StreamUses {
 public:
  bool empty() const { return !v_ || v_->empty(); }
  void clear() { v_.reset(); }
  void add(Stream s) {
    if (!v_) v_ = std::make_unique<std::vector<Stream>>();
    for (Stream x : *v_)
      if (x == s) return;
    v_->push_back(s);
  }
  const Stream* begin() const { return v_ ? v_->data() : nullptr; }
  const Stream* end() const { return v_ ? v_->data() + v_->size() : nullptr; }

 private:
  std::unique_ptr<std::vector<Stream>> v_;
};

struct Block {
  DevicePtr ptr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;   // meaningful only while allocated or pending
  Block* prev = nullptr;       // neighbours within the segment, address order
  Block* next = nullptr;
  Segment* segment = nullptr;
  BlockPool* pool = nullptr;
  Stream stream = 0;
  StreamUses stream_uses;           // streams recorded with record_stream (not the allocation stream)
  std::uint32_t gc_count_base = 0;  // the pool's GC clock when it went into the pool (ages compare modulo 2^32)
  std::uint16_t event_count = 0;    // outstanding events recorded at free, one per stream use
  BlockState state = BlockState::free;
  bool in_size_set : 1 = false;
  // May overlap a physical mapping of several pages (fragless): its free is reported to the policy, which
  // may split such a mapping into pieces in the background. Conservative: kept by splits, or-ed by merges.
  bool multi : 1 = false;
  // Allocated and exported (Note [Sharing]): listed in State::exports; its free waits for every lease.
  bool exported : 1 = false;
  // Allocated, but the program freed it already and its caller defers the free (DeviceEngine::defer_free:
  // LD_PRELOAD's cudaFree behind the fence): no longer the program's; only free_deferred frees it.
  bool deferred : 1 = false;

  bool mapped() const { return state != BlockState::unmapped; }
  // How many of its neighbours are mapped (0 to 2): Note [Mapped ranges are segments].
  int mapped_neighbours() const { return (prev && prev->mapped()) + (next && next->mapped()); }
  // A growable segment's block of a page or more: what BlockPool::paged counts among the free ones.
  bool paged() const;
  bool is_split() const { return prev != nullptr || next != nullptr; }
  bool pending() const { return state == BlockState::free && event_count > 0; }
  // Free, mapped, no outstanding events: may be reused or merged.
  bool reusable() const { return state == BlockState::free && event_count == 0 && stream_uses.empty(); }
};

struct BySize {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};
struct ByAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    return a->ptr < b->ptr;
  }
};

// Free blocks of one pool kind (small or large) of one PoolSet, across streams.
// The sets' nodes come from the pool's own slab (Note [Node slabs]), declared first so that it outlives them.
using BlockSizeSet = std::set<Block*, BySize, SlabAllocator<Block*>>;
using BlockAddressSet = std::set<Block*, ByAddress, SlabAllocator<Block*>>;
struct BlockPool {
  BlockPool() : blocks(BySize{}, SlabAllocator<Block*>(&nodes)), unmapped(ByAddress{}, SlabAllocator<Block*>(&nodes)) {}
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;
  NodeSlab nodes;
  BlockSizeSet blocks;       // free, mapped, no events
  BlockAddressSet unmapped;  // unmapped blocks of growable segments
  // Of `blocks`, those of growable segments a page or more long: without one, a reclaim has nothing to take
  // here, and its walk (one step per stream) is skipped; a process with thousands of streams made every
  // growth walk them all.
  std::size_t paged = 0;
  PoolSet* owner = nullptr;
  bool small = false;
  std::uint64_t get_free_blocks_call_count = 0;  // GC clock
};

// The default pool or one private pool (MemPool / graph capture).
struct PoolSet {
  PoolId id{0, 0};
  BlockPool small, large;
  // Note [Shared private pools]: begin_allocate_to_pool calls not yet matched by a release_pool; at 0 the pool
  // is released: nothing new is allocated here, and its memory goes once its blocks are free.
  int uses = 0;
  bool released = false;
  BlockPool& pool(bool is_small) { return is_small ? small : large; }
};

// Where one page of a segment gets its physical memory.
struct PageRef {
  PhysHandle handle = 0;
  std::size_t offset = 0;
  bool valid() const { return handle != 0; }
};

// A segment's page table: one PageRef per page (a classic segment is one page), all invalid at first. A
// growable segment reserves 9/8 of the device's memory and most of its pages are never mapped, so the table
// is in chunks of kChunk entries (8 KiB), each made, zero-filled, the first time an entry in it is written:
// a segment costs host memory only for the stretches it has mapped, and making one costs two small
// allocations, where one array would cost 9 MiB per segment on the replay's 1 TiB device (720 KiB on an 80
// GB GPU) or, left to the kernel's first-touch zero-fill, an mmap and munmap per segment. Reading an entry
// never makes its chunk: one in a chunk not yet made is an invalid PageRef. Writing goes through slot().
class PageTable {
 public:
  static constexpr std::size_t kChunkShift = 9, kChunk = std::size_t{1} << kChunkShift;
  PageTable() = default;
  ~PageTable();
  PageTable(const PageTable&) = delete;
  PageTable& operator=(const PageTable&) = delete;
  void swap(PageTable& o) noexcept {
    std::swap(chunks_, o.chunks_);
    std::swap(n_, o.n_);
  }
  // n invalid entries, once, on an empty table; false when the memory could not be had.
  bool allocate(std::size_t n);
  std::size_t size() const { return n_; }
  const PageRef& operator[](std::size_t i) const {
    const PageRef* c = chunks_[i >> kChunkShift];
    return c ? c[i & (kChunk - 1)] : kInvalid;
  }
  // Makes the chunks of entries [first, first + n) now; false when the host memory could not be had. Called
  // before the driver work whose result the entries record, so that running out of host memory is an
  // out-of-memory like any other, with nothing done (a one-chunk table, a classic segment's, is made whole by
  // allocate()).
  bool prepare(std::size_t first, std::size_t n) noexcept;
  // Entry i for writing; makes its chunk if needed (std::bad_alloc if the host has no 8 KiB left: callers
  // prepare() first).
  PageRef& slot(std::size_t i) {
    PageRef*& c = chunks_[i >> kChunkShift];
    if (!c && !(c = new_chunk(i >> kChunkShift))) throw std::bad_alloc();
    return c[i & (kChunk - 1)];
  }
  // Chunks made (tests: reading never makes one).
  std::size_t chunks_made() const;

 private:
  std::size_t chunk_count() const { return (n_ + kChunk - 1) >> kChunkShift; }
  PageRef* new_chunk(std::size_t k) noexcept;  // nullptr when calloc fails
  static const PageRef kInvalid;
  PageRef** chunks_ = nullptr;
  std::size_t n_ = 0;
};

struct Segment {
  DevicePtr base = 0;
  std::size_t va_size = 0;      // reserved address space
  std::size_t page_size = 0;    // classic: va_size (one page); growable: the policy's page size
  std::size_t mapped_bytes = 0;
  bool growable = false;
  bool small = false;
  Stream stream = 0;
  PoolSet* owner = nullptr;
  Block* first = nullptr;
  PageTable pages;              // growable: one entry per page; invalid = unmapped
  std::size_t requested_va = 0; // classic: the cudaMalloc size (va_size may be rounded to granularity)
};

inline bool Block::paged() const { return segment->growable && size >= segment->page_size; }

struct AllocParams {
  std::size_t requested = 0;
  std::size_t rounded = 0;
  Stream stream = 0;
  BlockPool* pool = nullptr;
  Status status = Status::ok;  // of the last driver failure, for the OOM decision
};

class Policy;

struct DeviceEngine::State {
  State(const Options& o, std::unique_ptr<Driver> d);
  ~State();

  SpinMutex mu;  // one lock per device, never recursive
  Options opts;
  std::unique_ptr<Driver> driver;
  std::unique_ptr<Policy> policy;
  Background background{mu, opts.background};  // stopped first in ~State
  EventSink* sink = nullptr;

  PoolSet default_pools;
  std::map<PoolId, std::unique_ptr<PoolSet>> private_pools;
  std::vector<std::pair<PoolSet*, StreamFilter>> routes;  // begin_allocate_to_pool, newest last
  // Note [Capture rules]: while any pool routing is active a CUDA graph capture may be under way. The engine
  // then queries no event and synchronises nothing (a destroyed stream's event excepted, Note [Destroyed
  // streams]), unmaps and releases nothing (but what a growth that failed had just created and mapped, which
  // no work has used), lends no page, and defers the
  // events of frees with uses on other streams until the routing ends (PyTorch's
  // needs_events_deferred_until_no_capture): an event query or a synchronisation during a capture fails and
  // invalidates it, and an unmap is not stream-ordered. It only grows (create and map, in relaxed capture
  // mode), or reports out of memory.
  // Captures the engine does not allocate for (LD_PRELOAD: cudaStreamBeginCapture on this device) count too.
  bool capturing() const { return !routes.empty() || external_captures > 0; }
  int external_captures = 0;
  // Freed with uses on other streams whose events are still to be recorded: during a capture, after a
  // record and the wait that stands in for it both failed (Note [Failed waits]), or with a use on a destroyed
  // stream whose work still runs (Note [Destroyed streams]). Each holds one placeholder in its event_count
  // while listed; each allocation (and free) outside a capture tries them again.
  std::vector<Block*> deferred_until_no_capture;
  // Their events again (each allocation, free and release outside a capture); wait_retired: a destroyed
  // stream's work is waited for on the host (a release: the OOM retry, empty_cache) instead of leaving the
  // block listed. No private pool is freed here: a released one whose blocks are still live would make each
  // call synchronise the device.
  void retry_deferred_events(bool wait_retired = false);
  std::vector<Block*> deferred_retrying;  // retry_deferred_events' list while it runs (its storage kept)
  void after_capture();  // a routing or capture ended: their events, and the private pools released meanwhile

  // Note [Failed waits]
  // A synchronisation that fails (a driver error) proves nothing about the work it was to wait for. Memory
  // under such work is never unmapped, released, lent or handed out: it stays cached (counted in reserved,
  // shown by snapshots), the failure is counted (num_failed_waits) and reported to the caller of the release
  // (empty_cache's error, hence fragless_last_error()), and the next release tries again.
  std::string wait_error;  // the first failed wait since the last report
  Status forced_sync(Stream s);  // waits for s (R16: another thread's per-thread stream through its mark)
  Status wait_failed(const char* what);

  // R16: per-thread default streams. Only their own thread can name them, so each free on one by its own
  // thread records the stream's mark (an event); other threads wait for the mark instead of the stream.
  struct Mark { Event event = 0; bool valid = false; };
  std::unordered_map<Stream, Mark> per_thread_marks;
  void mark_per_thread_free(Stream s);
  // Note [Destroyed streams]
  // cuStreamDestroy returns at once and the stream's queued work still runs; the driver may then give its
  // handle value to a new stream (as soon as that work is done, the libcuda double's reading; RMM's issue 649
  // reports CUDA reusing stream values at once). A destroyed handle may not be named in a driver call again:
  // it is a freed driver object. retire_stream records one event on the stream before the program destroys
  // it, without waiting (the wait under the device lock held every thread of the device for as long as that
  // work ran) and from then on stands in for the stream: a forced sync synchronises it, an idle test queries
  // it, and a path that would record an event on the stream uses it instead: a lend makes the growth's stream
  // wait for it on the device, a split waits until it is done, and a free whose block the destroyed stream
  // still used (a record_stream onto a stream destroyed before the block's free) leaves the block listed in
  // deferred_until_no_capture while that work runs: each later allocation or free queries the event (once
  // per retry, however many blocks wait for it), a release (the OOM retry, empty_cache) waits for it, as it
  // waits for events, and a device-wide wait before graph memory goes covers it. When the program names the
  // value again (an allocation on it, a record_stream onto it) it is a stream again: while the old work is still pending, the new stream first
  // waits for the event (cuStreamWaitEvent, asynchronous), so that everything queued on the value after it,
  // which may reuse the old stream's free blocks, comes after the old work (during a capture the wait would
  // be a node of the graph if the value is the capturing stream: the engine synchronises the event then).
  // The stream is not capturing when it is retired (the interposer retires no capturing stream, whose destroy
  // fails), so the event is no node of a graph, and querying or synchronising it while another stream
  // captures is allowed: R14 forbids that for captured events and capturing streams only, and the driver
  // makes such calls in relaxed mode. This is the one exception to Note [Capture rules].
  // A value named again while neither the stream wait nor a synchronisation could order it after the old
  // work (a failed wait, Note [Failed waits]) stays retired, `named`, until the old work is seen done: until
  // then every wait for it waits for the event and then the stream, so both streams' work counts. Destroyed
  // again in that state, it is waited for at once (the stream's work and the old event), or, if that fails,
  // retired with a new event in place of the old one, which covers only the new stream's work (none if it
  // cannot be recorded either: a device whose waits fail is in error, Note [Failed waits]); a block listed
  // for the old stream's work then waits only for that event.
  // The events of retired streams nothing asked about are queried every 64 retirements and released once done,
  // so a program that makes and destroys streams without end holds only those whose work still runs; the
  // entries themselves (a few bytes each) stay until their value is named again.
  struct Retired {
    Event event = 0;
    bool pending = false;  // event recorded and not yet seen complete
    bool named = false;    // named again before the old work could be ordered
    // Queries a pending event and releases it once its work is done; true when nothing is pending.
    bool done(Driver& d) {
      if (pending && d.query_event(event) == Status::ok) {
        d.release_event(event);
        pending = false;
      }
      return !pending;
    }
  };
  std::unordered_map<Stream, Retired> retired_streams;
  std::vector<Stream> retired_unchecked;  // retired with a pending event, since the last sweep (retire_stream)
  // Whether st stands retired now (a named entry whose old work is done is forgotten here).
  bool retired(Stream st);
  // A retired stream whose work is done (its event queried); never for a named one.
  bool retired_done(Stream st);
  // Queries the pending events of retired_unchecked, releasing those done.
  void sweep_retired();
  // The program names st (an allocation or a record_stream on it): a value retired before is a new stream,
  // ordered after the old one's pending work. driver_error when neither the stream wait nor a synchronisation
  // could order it (wait_error says which); st stays retired, `named`, then.
  Status stream_named(Stream st);
  // Whether all work queued on s is done now (an event recorded and queried; a mark for another thread's
  // per-thread stream); a driver error counts as not idle.
  bool stream_idle(Stream s);

  std::vector<std::unique_ptr<Segment>> segments;
  // Whether seg is one of the segments now. A pointer kept across a release may point at a segment that is
  // gone, or at a new one the heap placed at the same address (Note [Strips die with their segment]).
  bool has_segment(const Segment* seg) const {
    return std::any_of(segments.begin(), segments.end(), [&](const auto& p) { return p.get() == seg; });
  }
  BlockMap active_blocks;
  std::map<Stream, std::deque<std::pair<Event, Block*>>> pending_events;
  std::size_t pending_event_count = 0;

  DeviceStats stats;
  // The small pool's allocated bytes at their highest since the engine began, never reset (peaks in stats
  // are reset by the program): what the small pool has shown it needs (Note [The small pool keeps a cell]).
  std::int64_t small_allocated_high = 0;
  std::size_t total_reserved = 0;              // physical bytes held
  // per_process_memory_fraction below 1: the process may hold at most allowed_memory_maximum bytes, which may
  // be 0 (fraction 0, or one that rounds to 0 bytes: nothing can be allocated, as in PyTorch's set_fraction).
  bool memory_limited = false;
  std::size_t allowed_memory_maximum = 0;
  std::size_t device_total = 0;

  // Block object pool (avoids a heap allocation per split).
  std::vector<std::unique_ptr<Block[]>> block_slabs;
  std::vector<Block*> spare_blocks;
  Block* new_block();
  void delete_block(Block* b);
  // A new segment over the reservation [va, va + va_size) for p's pool and stream, with pages of
  // `page_size`, covered by one block in `state` (not yet in any pool); returns that block.
  Block* add_segment(const AllocParams& p, DevicePtr va, std::size_t va_size, std::size_t page_size,
                     BlockState state);

  // Pool membership, with the inactive_split stats that go with it.
  void pool_insert(Block* b);
  void pool_erase(Block* b);
  // Splices b->next into b (sizes add up); the caller has taken both out of their sets.
  void absorb_next(Block* b);
  // Cuts b at address `at` (inside it): b keeps [b->ptr, at), the returned new block, in no set and in b's
  // state, holds the rest.
  Block* split_after(Block* b, DevicePtr at);
  // Merges b with reusable neighbours; b must be free, mapped, no events, not in the pool. Returns the result.
  Block* merge_free(Block* b);
  void unmapped_insert(Block* b);
  void unmapped_erase(Block* b);
  // Merges an unmapped block with unmapped neighbours.
  Block* merge_unmapped(Block* b);

  BlockSizeSet::iterator best_fit(BlockPool& pool, const AllocParams& p);
  Block* find_free_block(AllocParams& p);
  Block* take_block(Block* b, AllocParams& p);  // split if worth it, mark allocated, stats
  void free_block(Block* b, bool traced = true);  // allocated/pending -> free in pool
  void process_events();
  void synchronize_and_free_events();
  // Records an event on each stream use of b (or waits for the stream where recording fails); true when
  // every use is covered. The uses it could not cover stay on b: a destroyed stream whose work still runs
  // among them unless wait_retired (see retry_deferred_events). running: the destroyed streams this retry
  // found still running, added to and not queried again.
  bool insert_events(Block* b, bool wait_retired = false, std::vector<Stream>* running = nullptr);
  void defer_events(Block* b);  // to deferred_until_no_capture, with its placeholder

  Block* allocate_slow(AllocParams& p, AllocError* err);
  Block* grow(AllocParams& p);  // the policy's growth, never for more than the device (Note [Larger than the device])
  Block* fail_allocation(AllocParams& p, AllocError* err);  // counts the OOM, fills err, returns nullptr
  // False when it released nothing: a capture began while it waited for the worker (Note [Capture rules]).
  bool release_cached_blocks(PoolSet* only);
  // Before graph-private memory is released: a device-wide synchronisation (R17). False (a wait failure)
  // when it failed.
  bool synchronize_device();
  bool garbage_collect(AllocParams& p);
  bool release_available_cached_blocks(AllocParams& p);
  void maybe_free_private_pools();

  PoolSet& pool_set_for(Stream s);
  bool capacity_allows(std::size_t extra_bytes) const;
  // free_b, total_b: the device's memory as the driver answered just now (cuMemGetInfo, asked once).
  std::string oom_message(const AllocParams& p, const std::string& driver_error, std::size_t free_b,
                          std::size_t total_b);
  void add_reserved(bool small, std::int64_t bytes);
  Block* take_large_remnant(AllocParams& p);

  // Giving memory back can fail (a driver error, an injected fault). The engine then forgets the memory
  // (its stats drop) but keeps the driver-side object here and retries at the next slow allocation,
  // release and teardown, so a transient failure never leaks a handle, a mapping or an address range.
  void give_back_mapping(DevicePtr va, std::size_t size);   // unmap, or retry later
  void give_back_handle(PhysHandle h);                      // release, or retry later
  void give_back_reservation(DevicePtr va, std::size_t size);  // free_reservation, or retry later
  bool retry_deferred();                                    // true when nothing is left
  bool has_deferred() const {
    return !deferred_unmaps.empty() || !deferred_handles.empty() || !deferred_reservations.empty();
  }
  std::vector<std::pair<DevicePtr, std::size_t>> deferred_unmaps, deferred_reservations;
  std::vector<PhysHandle> deferred_handles;
  // Note [Memory the driver would not give back]: what the process holds as far as its memory fraction is
  // concerned: the books, or the memory the driver's handles still hold where that is more.
  std::size_t held_bytes() const { return std::max(total_reserved, driver->live_bytes()); }
  // Note [Larger than the device]: no memory released could make room for a request this large.
  bool larger_than_device(std::size_t rounded) const { return device_total > 0 && rounded > device_total; }

  std::string check_invariants();
  std::vector<SegmentInfo> snapshot();

  // The free of an allocated block (stats, events, back to its pool); free() checked the pointer.
  void free_live(Block* b);

  // Note [Sharing] (engine/share.cpp). An exported block stays allocated, whole handles and all, while any
  // lease on it is open anywhere; its owner's free is then recorded (owner_freed) and done when the last
  // lease closes. Invariant (checked): a block is `exported` iff it is allocated and listed here; every
  // listed block is held (a lease open, or a registration).
  // A block registered with NCCL (register_range) is held the same way until its last deregistration.
  struct Export {
    std::vector<int> leases;   // this engine's end of each lease socket, one per share made
    std::size_t span = 0;      // bytes of the whole handles under the block (exported_bytes), 0 if never shared
    int registrations = 0;     // register_range calls not yet deregistered (Note [Registered ranges])
    bool owner_freed = false;  // freed by its owner; goes back to the cache with the last lease
    bool held() const { return !leases.empty() || registrations > 0; }
  };
  std::unordered_map<DevicePtr, Export> exports;  // by block address
  // Other processes' blocks mapped here by open_shared, by the pointer handed out.
  struct Import {
    DevicePtr va = 0;        // the reservation: the whole handles, mapped at their offsets
    std::size_t span = 0;
    std::size_t size = 0;    // the block's size
    int lease = -1;          // this process's copy of the lease (its close drops the reference)
    int exporter_pid = 0;
    bool small = false;      // the exporter's block is in its small pool (the imported_bytes pool)
  };
  std::unordered_map<DevicePtr, Import> imports;
  // The allocated block holding [p, p+size), or nullptr (a linear walk: registrations are rare).
  Block* live_block_holding(DevicePtr p, std::size_t size) const;
  // Drops one hold's worth of bookkeeping once nothing holds the block: unlisted, and freed if its owner did.
  bool release_if_unheld(std::unordered_map<DevicePtr, Export>::iterator it);
  Status free_exported(Block* b, AllocError* err);
  // Closes the leases nobody holds any more and frees the blocks their owners freed; with `waited_us` > 0
  // (tests) waits that long for a lease to close. Returns how many blocks went back.
  std::size_t reap_exports(int waited_us = 0);
  std::string imported_free_message(void* ptr) const;
  std::string check_sharing() const;
  void describe_hold(const Block& b, BlockInfo* out) const;  // snapshots: how an exported block is held
  void close_all_shares();  // teardown: every lease and import goes
  // fork(): nothing to hold; in the child, every import's lease is closed (Note [Imports across fork]).
  static void fork_nothing(void*) {}
  static void imports_in_forked_child(void* state);
};

// Fills `e` (when given) with a status and the message that explains it.
inline void set_error(AllocError* e, Status st, std::string msg) {
  if (e) {
    e->status = st;
    e->message = std::move(msg);
  }
}

}  // namespace fragless
