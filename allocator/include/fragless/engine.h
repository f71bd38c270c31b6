// The per-device caching engine.
//
// Call chain (fast path first):
//   allocate ─ process_events (only if events are pending)
//            ─ round_size, pick pool (private pool if one is routed, else small/large)
//            ─ find_free_block (best fit on the same stream)      ◄ cache hit: done, split if worth it
//            └ allocate_slow: garbage_collect → policy grow
//                             → release oversize blocks (max_split_size) → grow
//                             → release_cached_blocks (sync events, give back) → grow (num_alloc_retries)
//                             → OOM: message with requested, free, reserved-but-unallocated, largest free range
//   free     ─ stream uses recorded? events per stream, block waits (active_pending_free)
//            └ else back to its pool, merged with free neighbours of the same segment
//
// Policies (policy.h) decide how address space and physical pages back blocks: classic (one physical
// segment per cudaMalloc), expandable (one growing segment per stream and pool, whole pages), fragless
// (growing segments whose pages are re-backed from a device-wide page pool before new memory is created).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fragless/config.h"
#include "fragless/driver.h"
#include "fragless/share.h"
#include "fragless/stats.h"

namespace fragless {

using PoolId = std::pair<std::uint64_t, std::uint64_t>;  // PyTorch's MempoolId_t; {0,0} is the default pool
using StreamFilter = std::function<bool(Stream)>;

class EventSink;  // trace.h

struct AllocError {
  Status status = Status::ok;
  std::string message;
  // Out of memory: the size PyTorch's allocator would have asked the driver for (get_allocation_size of the
  // rounded request), which its message names and its OOM observers are given; 0 otherwise.
  std::size_t alloc_size = 0;
};

// A block as seen from outside (snapshots, tests).
struct BlockInfo {
  DevicePtr address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  enum State { active_allocated, active_pending_free, inactive, unmapped } state = inactive;
  // Held for other processes or NCCL (Note [Sharing], engine/share.cpp): the block stays allocated.
  bool held = false;
  bool owner_freed = false;       // its owner freed it; it goes back when the last hold goes
  std::size_t exported_bytes = 0; // the whole handles under it (exported_bytes stat), 0 when never shared
  std::size_t leases = 0;         // shares of it not yet closed everywhere
  int registrations = 0;          // register_range holds
};

// Another process's block mapped here by open_shared (snapshots): in no segment, counted in imported_bytes.
struct ImportInfo {
  DevicePtr address = 0;         // what open_shared returned
  std::size_t size = 0;          // the block's size
  DevicePtr mapped_address = 0;  // the whole handles under it, mapped here
  std::size_t mapped_size = 0;
  int exporter_pid = 0;
  bool small = false;            // the exporter's block is in its small pool
};

struct SegmentInfo {
  DevicePtr address = 0;          // start of the segment (or of the mapped range, for growable ones)
  std::size_t total_size = 0;
  std::size_t allocated_size = 0, active_size = 0, requested_size = 0;
  Stream stream = 0;
  bool small = false;
  bool expandable = false;
  PoolId pool{0, 0};
  std::size_t exported_bytes = 0;  // the exported_bytes of its blocks (BlockInfo)
  std::vector<BlockInfo> blocks;
};

class DeviceEngine {
 public:
  DeviceEngine(const Options& options, std::unique_ptr<Driver> driver);
  ~DeviceEngine();  // gives everything back to the driver (live blocks too)
  DeviceEngine(const DeviceEngine&) = delete;
  DeviceEngine& operator=(const DeviceEngine&) = delete;

  // nullptr for size 0 (legal, nothing allocated, error->status ok) and on failure (error filled).
  void* allocate(std::size_t size, Stream stream, AllocError* error);
  // Status::invalid_argument for a pointer this engine does not own (unknown or already freed, deferred
  // frees included).
  Status free(void* ptr, AllocError* error = nullptr);
  // A free the caller does later (LD_PRELOAD's cudaFree behind its fence): the block at ptr stays allocated but
  // is no longer the program's: a second defer_free, free, record_stream and share of it are invalid_argument,
  // allocation_containing reports it freed, and only free_deferred frees it (once). invalid_argument for a
  // pointer that is not the start of a live allocation (freed already, deferred or not). *size (when given):
  // the block's size.
  Status defer_free(void* ptr, AllocError* error = nullptr, std::size_t* size = nullptr);
  Status free_deferred(void* ptr, AllocError* error = nullptr);
  // The block holding ptr is also used on `stream`: it is reused only after that stream's work queued
  // before its free completes. Ignored for the allocation stream. invalid_argument if ptr is unknown.
  Status record_stream(void* ptr, Stream stream);
  // Base address and size of the segment holding ptr (getBaseAllocation); nullptr if unknown.
  void* base_allocation(void* ptr, std::size_t* size);
  bool owns(void* ptr);
  // The allocated block holding ptr (its first byte or any byte inside it): its address, and its size in
  // *size; nullptr when no allocated block of this engine holds ptr. *freed (when given): whether the program
  // freed it already (defer_free, or an exported block held for other processes after its owner's free).
  // A block's first byte is looked up at once; a byte inside a block walks the segments (for queries such as
  // LD_PRELOAD's cuMemGetAddressRange, not for the allocation path).
  void* allocation_containing(void* ptr, std::size_t* size, bool* freed = nullptr);

  // Gives back every cached byte it can. A wait that failed keeps the memory under that work cached (tried
  // again at the next release) and is reported: driver_error with *error's message (Note [Failed waits]).
  Status empty_cache(AllocError* error = nullptr);
  // 0 <= fraction <= 1 of the device's total memory; invalid_argument otherwise.
  Status set_memory_fraction(double fraction);

  // Private pools (CUDA graph capture, MemPool): while routed, allocations on streams accepted by
  // `filter` (an empty one: every stream) come from pool `id`, kept apart from everything else until
  // released. What the filter throws leaves allocate, which then changed nothing. The end takes away the
  // pool's newest routing; invalid_argument, changing nothing, when it has none.
  void begin_allocate_to_pool(PoolId id, StreamFilter filter);
  Status end_allocate_to_pool(PoolId id);
  // The same routing by stream (PyTorch 2.1 and 2.2's beginAllocateStreamToPool): allocations on `stream`
  // alone come from pool `id`, a use of the pool counted as begin_allocate_to_pool counts one. The end names
  // the stream, not the pool, and ends that stream's newest routing (Note [Routing by stream], engine.cpp);
  // invalid_argument, changing nothing, when `stream` has none. *id (when given) is the pool it routed to.
  void begin_allocate_stream_to_pool(PoolId id, Stream stream);
  Status end_allocate_stream_to_pool(Stream stream, PoolId* id = nullptr);
  // Each begin counts a use of the pool and each release ends one (Note [Shared private pools], engine.cpp);
  // when none is left the pool's memory goes once its blocks are free, after a device-wide synchronisation (a
  // replay may run on any stream), never while a capture may be under way. Failed waits are reported as
  // empty_cache's. A release of a pool with no use left (never begun, or released as often as begun) is
  // invalid_argument with *error's message, and changes nothing.
  Status release_pool(PoolId id, AllocError* error = nullptr);

  // A capture this engine does not allocate for (LD_PRELOAD: cudaStreamBeginCapture on the device) begins or
  // ends; while one is under way the engine follows Note [Capture rules] (engine_state.h).
  void capture_began();
  void capture_ended();
  // `stream` is about to be destroyed (cudaStreamDestroy) and is not capturing: an event recorded on it stands
  // in for it from now on, without a wait (Note [Destroyed streams], engine_state.h), so this engine names it
  // no more; a later stream with the same handle value is a new stream, ordered after that event. Without an
  // event, it waits for the stream (not during a capture: the stream then stays as it was). Failed waits (no
  // event and the wait failed, or a value named again after a failed wait destroyed again) are reported.
  Status retire_stream(Stream stream, AllocError* error = nullptr);

  // Sharing across processes (Note [Sharing], engine/share.cpp). share: the block that starts at ptr (an
  // allocation of this engine, handed out and not freed), exported as whole handles (driver.h, R18); needs
  // memory created exportable (shareable_handles:True), not_supported otherwise. While any copy of the
  // share's lease is open (in this process, on its way, in a process that opened it) the block stays
  // allocated: its free is done when the last lease closes, so its pages are never re-backed, lent or
  // reused under another process.
  Status share(void* ptr, SharedBlock* out, AllocError* error = nullptr);
  // Maps a block another process (or this one) shared, on this engine's device: the pointer to the block and
  // *size. The description and descriptors are checked first; a forged or stale one is refused (nullptr,
  // *error says why) and nothing is mapped. The descriptors stay the caller's.
  void* open_shared(const std::string& description, const int* fds, std::size_t nfds, std::size_t* size,
                    AllocError* error = nullptr);
  // Unmaps a block open_shared mapped (after a device-wide synchronisation, R13/R17) and drops its lease.
  Status close_shared(void* ptr, AllocError* error = nullptr);
  // Frees the shared blocks whose owner freed them and whose leases are all closed now (this also happens on
  // every slow allocation, empty_cache and stats); waits up to `wait_us` for one (tests). Returns how many.
  std::size_t reap_shared(int wait_us = 0);
  // NCCL user-buffer registration (Note [Registered ranges]): [ptr, ptr+size), inside one live allocation, is
  // never re-backed until deregister_range(ptr) (its block stays allocated, whatever its owner frees). Call
  // it after ncclCommRegister, and deregister_range after ncclCommDeregister. invalid_argument otherwise.
  Status register_range(void* ptr, std::size_t size, AllocError* error = nullptr);
  Status deregister_range(void* ptr, AllocError* error = nullptr);

  DeviceStats stats();
  // Current allocated, reserved and live bytes: a cheap subset of stats() for per-event sampling.
  struct Usage { std::int64_t allocated = 0, reserved = 0, live = 0; };
  Usage usage();
  void reset_peak_stats();
  void reset_accumulated_stats();
  std::vector<SegmentInfo> snapshot();
  // A snapshot was handed out: a `snapshot` event (PyTorch's SNAPSHOT trace entry) with the bytes of the
  // active blocks it showed, so that the trace and the history mark when snapshots were taken.
  void mark_snapshot(std::size_t active_bytes);
  std::vector<ImportInfo> imports();  // open_shared mappings not yet closed, by address
  DriverCounters driver_counters();
  void reset_driver_counters();
  // Background work (Options::background). Manual mode: runs it on this thread until `budget_us` of
  // modelled driver time has gone into it or none is left, and returns the time spent; other modes: 0.
  double run_background(double budget_us);
  // Thread mode: returns once the worker has nothing left to do (tests); other modes: at once.
  void drain_background();
  // Stops the worker for good: the job in flight is asked to stop at its next driver call and the thread
  // is joined; work found later is not done (the engine stays usable). For process exit, so that no
  // background driver call runs while the CUDA driver tears down (capi.cpp's exit handler).
  void stop_background();
  // Largest free range in the cache and total free bytes in the cache (external fragmentation).
  std::pair<std::size_t, std::size_t> free_ranges();

  // Checks every invariant (engine/inspect.cpp); empty string when all hold.
  std::string check_invariants();

  void set_event_sink(EventSink* sink);  // nullptr = tracing off
  void flush_trace();                    // hands buffered trace records to the sink's writer
  const Options& options() const;
  Driver& driver();
  // The device's free and total memory as the driver reports them (cuMemGetInfo), under the engine's lock
  // with no background job in flight (a split releases its handle before it creates the pages, so the
  // driver's free memory moves for a moment while the books do not; the reading waits for one job at most).
  void memory_info(std::size_t* free_bytes, std::size_t* total_bytes);
  // The same and usage() read at one moment (what cudaMemGetInfo adds fragless's cached bytes from). False,
  // with nothing read, on a thread that holds this engine's lock (an event sink): it would wait for itself.
  bool memory_info_and_usage(std::size_t* free_bytes, std::size_t* total_bytes, Usage* usage);
  int device() const;

  struct State;

 private:
  std::unique_ptr<State> s_;
};

}  // namespace fragless
