// What the two halves of the LD_PRELOAD interposer share: the runtime half (preload.cpp: cudaMalloc and
// friends) and the driver half (preload_driver.cpp: cuMemAlloc and friends, cuGetProcAddress, dlsym). One
// allocator, one owner lookup, one queue of frees behind the fence and one record of captures serve both, so
// memory allocated through one API may be freed through the other.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "fragless/allocator.h"

namespace fragless_preload {

// The process's allocator, created on first use with no engine (nullptr when fragless is off: the
// configuration or the driver could not be loaded; everything is then forwarded).
fragless::Allocator* allocator();

// The device whose existing engine owns p, or -1. Never creates an engine or a context.
int owner(const void* p);

// cudaFree's and cuMemFree's promise: p (owned by `device`'s engine) goes back to the cache only behind a
// device-wide fence, run when enough frees are pending (Note [Frees behind the fence], preload.cpp). From
// this call on p is no longer the program's (DeviceEngine::defer_free). False: p was freed already (behind the
// fence or otherwise): the caller returns the invalid-value error, as CUDA does for a second free.
bool free_behind_fence(int device, void* p);

// cudaFreeAsync's and cuMemFreeAsync's promise: p (owned by `device`'s engine) is reused by stream s (fragless's
// key) at once and by other streams only after the work queued on s before the free is done. False: the
// engine refused the pointer.
bool free_on_stream(int device, void* p, fragless::Stream s);

namespace cu {
struct KnownPool;  // a pool the driver half knows (preload_driver.h)
}

// R24 (driver.h): cudaMallocAsync and cuMemAllocAsync allocate from the current memory pool of `device`. That
// pool when fragless can serve it as the driver would (the block is then counted in it with count_in), else
// nullptr, said once on stderr: the call goes to the runtime or the driver. The driver half's, for both halves.
cu::KnownPool* current_pool_served(int device);

// Block p (`asked` bytes) of `device` was allocated from pool k: the pool's statistics count it until its free.
void count_in(int device, const void* p, cu::KnownPool* k, std::uint64_t asked);

// Every free of fragless memory, from either half, tells the driver half first (preload_driver.cpp): what it
// keeps about the block (a pool's statistics, a buffer id) goes with it.
void forget(int device, const void* p);

// Every free of fragless memory also drops the legacy IPC export of the allocation at p, if it has one
// (preload_ipc.cpp, Note [Legacy IPC handles]): its handle is refused from then on, and the processes that
// opened it keep the memory until they close it. Called once the engine took the free (Note [Exports and
// frees], preload_ipc.cpp). True when there was an export.
bool forget_export(int device, const void* p);

// Runs the fence for `device` now and gives its deferred frees back; false when it could not run (a capture
// is under way, or the synchronisation failed: the frees stay deferred).
bool drain(int device);

// A capture began on `stream` (fragless's key of it) of `device`; it ended. Until every capture has ended
// the fence does not run and the device's engine follows the capture rules.
void capture_began(fragless::Stream stream, int device);
void capture_ended(fragless::Stream stream);

// The program destroys `stream` (fragless's key of it) of `device` (cudaStreamDestroy, cuStreamDestroy): it is
// retired without waiting for its work (Note [Destroyed streams], engine_state.h), so that device's engine
// names it no more and a later stream given the same handle value is a new stream. Nothing for a device
// without an engine; another device's engine (a block of its used on the stream by record_stream) is not
// told.
void retire_stream(fragless::Stream stream, int device);

// Note [Forwarded allocations out of memory]
// An allocation fragless hands to the driver on a device where it has an engine (cuMemAllocAsync from a
// current pool fragless cannot serve as the driver would, cuMemAllocFromPoolAsync from such a pool the
// interposer knows (one it never saw made is forwarded as it is) or on a
// stream of another device than the pool's; the runtime's cudaMallocAsync to such a pool, which reaches the
// driver half as a recursion and is retried by the runtime half) competes with fragless's cache for the
// device's memory. When the driver (or the runtime) says it is out of
// memory, the caller calls this and, when it returns true, tries once more: the fence's deferred frees
// go back, then fragless's cached memory on the device (empty_cache), as a caching allocator frees its cache
// before it fails. True when fragless's reserved memory there fell. Not for a pool whose own maximum size
// explains the failure (its reserved memory and the request exceed it: no cache of fragless's is in the way),
// and not during a capture (empty_cache releases nothing then). The driver API keeps no last error; the
// runtime does, and before the retry the first try's error is taken back (cudaGetLastError, when
// cudaPeekAtLastError still shows it), as PyTorch does after an allocation it retries: a failed retry sets
// it again.
bool release_for_forwarded(int device);
// Whether an allocation of `size` from `device`'s current pool fails for that pool's own maximum size.
bool current_pool_cap_reached(int device, size_t size);

// Note [Free memory at one moment]: cudaMemGetInfo and cuMemGetInfo answer the driver's free memory plus what
// fragless holds cached (reserved less allocated). The real call comes first, with no lock held (its error,
// and the runtime's set-up on a thread's first call); then count_cached_as_free reads the device's free
// memory again through the engine's own driver (the real driver, never an interposed entry point) together
// with the books, under the engine's lock with no background job in flight (DeviceEngine::
// memory_info_and_usage): a split releases its handle before creating the pages, so readings apart could
// count one split's bytes twice or not at all. ReadingFreeMemory marks the runtime's real call: the runtime
// reaches the interposed cuMemGetInfo through its driver table, which then forwards it as it is. A thread
// that holds the engine's lock (an event sink) gets the driver's answer alone.
struct ReadingFreeMemory {
  ReadingFreeMemory();
  ~ReadingFreeMemory();
  ReadingFreeMemory(const ReadingFreeMemory&) = delete;
  ReadingFreeMemory& operator=(const ReadingFreeMemory&) = delete;
};
bool reading_free_memory();
void count_cached_as_free(fragless::DeviceEngine* e, size_t* free_bytes, size_t* total);

// Note [No recursion] (preload_driver_lookup.cpp): a thread inside fragless (allocating or freeing for an
// interposed call) that comes back into an interposed entry point is counted and forwarded to the driver or
// runtime, never served (fragless's engine lock is held). Inside marks the scope; recursing() tells and counts.
// Forwarding marks a call the runtime half hands on to the real runtime from inside (an allocation fragless
// does not serve: a capture, a pool with a maximum size, a device without an engine): the runtime implements
// it with the driver (cudaMallocAsync is cuMemAllocAsync, cudaMalloc is cuMemAlloc), so it comes back through
// the driver half, which forwards it to the driver as it should, and does not count it.
struct Inside {
  Inside();
  ~Inside();
  Inside(const Inside&) = delete;
  Inside& operator=(const Inside&) = delete;
};
struct Forwarding {
  Forwarding();
  ~Forwarding();
  Forwarding(const Forwarding&) = delete;
  Forwarding& operator=(const Forwarding&) = delete;
};
bool recursing();

struct Counters {
  std::atomic<unsigned long> mallocs{0}, frees{0}, forwarded_frees{0}, fences{0}, fallbacks{0};
  // The driver half: allocations served and pointers forwarded, calls that would have recursed (a call the
  // runtime half forwarded, coming back, is not one).
  std::atomic<unsigned long> driver_mallocs{0}, driver_forwarded{0}, recursions{0};
  // Calls that came back through an interposed entry point from a call the runtime half forwarded (Forwarding),
  // handed on to the driver.
  std::atomic<unsigned long> handed_on{0};
};
Counters& counters();

}  // namespace fragless_preload
