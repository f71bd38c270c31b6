// The driver seam: the handful of operations the engine needs from CUDA's virtual memory and stream API.
//
// Three implementations: `cuda` (the real driver, loaded at run time), `host` (real host memory with the
// same semantics, for tests and the LibTorch CPU adapter) and `sim` (no memory, counted and costed calls,
// for the replay benchmark). The engine only ever talks to this interface.
//
// Every public operation is non-virtual: it counts the call, charges its modelled cost and forwards to the
// private `do_*` hook (the RMM pattern), so call accounting is identical for every driver.
//
// The driver contract. These are the rules the CUDA driver states or, where its documentation is
// ambiguous, the stricter reading of them. The base class enforces them for every driver (cuda, host and
// sim) before the call reaches the implementation, so the host and sim drivers never accept what CUDA
// refuses, and a bug in a policy fails the same way on a CPU as on a GPU. The libcuda test double
// (tests/fake_cuda) enforces the same rules on its own, at the C ABI. A broken rule returns
// invalid_argument, and last_error() names the rule.
//
//  R1 granularity: every size, address and offset is a multiple of granularity(), sizes are non-zero
//     (cuda.h, cuMemCreate/cuMemMap/cuMemAddressReserve: "must be a multiple of the granularity").
//  R2 reserve: on ok, [*va, *va+size) is reserved address space, aligned to granularity(), inaccessible.
//  R3 free_reservation: (va, size) is exactly one earlier reservation, and nothing inside it is mapped
//     (cuMemAddressFree; NVIDIA's VMM blog: unmap, release, then free the address range).
//  R4 create: on ok, *handle names `size` bytes of physical memory; out_of_memory when the device (or the
//     driver's budget) cannot give them, and nothing is held then.
//  R5 map: a mapping is one whole handle: `offset` must be 0 (cuda.h, cuMemMap: "offset - Offset into the
//     memory represented by ... Note: currently must be zero") and `size` must be the handle's whole
//     size (the header allows a partial size; no production allocator relies on it and XLA's VMM work
//     found only whole handles map, so we take the stricter reading). [va, va+size) lies in one
//     reservation and overlaps no mapping. The handle must not have been released. The range is mapped
//     but not yet accessible ("calling cuMemMap does not make the address accessible").
//  R6 set_access: [va, va+size) consists of whole, adjacent mappings (cuMemSetAccess: "the range must be
//     fully mapped"; the stricter reading: it starts and ends on mapping boundaries); afterwards it is
//     readable and writable by the device.
//  R7 unmap: [va, va+size) consists of whole, adjacent mappings, never part of one (cuMemUnmap: "the
//     range must cover entire mappings"; several adjacent mappings in one call are allowed, as NVIDIA's
//     VectorMemMap sample does); afterwards it is plain reservation again, with no access.
//  R8 release: the handle is known and not yet released. Releasing a handle that is still mapped is
//     allowed: its memory stays until its last mapping is unmapped (cuMemRelease: "the memory will be
//     freed when all outstanding mappings to the memory are unmapped"), and it can no longer be mapped.
//     A handle's value names it until its memory is gone; then the driver may give the same value to a later
//     handle (cuda.h promises no uniqueness; cuMemRetainAllocationHandle's handle "is guaranteed to be the
//     same handle value used to map the memory" and is released again, so a value names a counted driver
//     object, whose value a later one may take; RMM's issue 649 reports CUDA reusing stream values at once). The host
//     and sim drivers and the libcuda double give the most recently gone value first
//     (allocator/src/driver/handle_ids.h), so an engine that kept a value past its handle meets it again.
//  R9 one handle may be mapped at several addresses at once; all of them see the same bytes.
//  R10 (cuda driver) cuGetProcAddress is asked for at most the driver's own version (cuDriverGetVersion);
//     the stricter reading of cuda.h ("cudaVersion: the CUDA version to look for the requested driver
//     symbol") is that a driver refuses a version newer than itself. It first appeared in CUDA 11.3.
//  R11 (cuda driver) a handle is created with a shareable handle type (requestedHandleTypes) only when one
//     is asked for: CU_MEM_HANDLE_TYPE_NONE otherwise (cuMemCreate takes any type the device supports; a
//     type the process does not need is not requested).
//  R12 (cuda driver) contexts: every call but initialisation, device queries, primary-context management and
//     the context stack needs a current context (cuda.h: CUDA_ERROR_INVALID_CONTEXT otherwise); streams and
//     events belong to the context current at their creation, stream 0 to the current one; cuEventRecord of
//     an event and a stream of different contexts is CUDA_ERROR_INVALID_HANDLE (cuda.h, cuCtxRecordEvent /
//     cuEventRecord); an event of another context may be waited for (cuStreamWaitEvent: "hEvent may be from a
//     different context or device than hStream"), queried and synchronised. A stream of another context
//     (record_stream onto another device's stream) gets an event made in that stream's context
//     (cuStreamGetCtx), destroyed when released under that context (cuEventDestroy may fail with
//     CUDA_ERROR_INVALID_CONTEXT, and cuda.h does not say whose context: the libcuda double takes the stricter
//     reading, the event's own), as PyTorch records under the stream's device. The driver runs every other
//     call under its device's primary context, pushed when it is not current and popped after, so the calling thread is left as it was (PyTorch frees from threads with no
//     device guard). It retains that context on the device's first use, never at start-up (a context costs
//     device memory), and releases it with the driver.
//  R13 asynchrony: cuMemUnmap, cuMemRelease and cuMemAddressFree are not stream-ordered (NVIDIA's VMM blog;
//     PyTorch's expandable segments synchronise before unmapping; cudaFree synchronises the device): memory
//     is unmapped only after the work queued on its streams is done. Work still running over it is an
//     illegal-address fault, sticky for the context. A synchronisation that returns an error proves
//     nothing: the memory it was to wait for stays where it is (engine_state.h, Note [Failed waits]).
//     Graph-private memory may be used by a replay on any stream: it goes only after R17's wait.
//  R14 stream capture (cuda.h, cuStreamBeginCapture / cuThreadExchangeStreamCaptureMode; PyTorch's
//     CUDACachingAllocator, which skips process_events during capture): querying or synchronising a
//     captured event or a capturing stream, or synchronising its context, fails and invalidates the
//     capture; under a global-mode capture, "potentially unsafe" calls (the stricter reading: every VMM
//     call, cuMemGetInfo, event queries and synchronisations) from a thread not in relaxed mode fail and
//     invalidate it too. The driver runs its VMM calls, cuMemGetInfo, event queries and synchronisations in
//     relaxed mode, so a capture on another device (or another pool) does not forbid them; the engine issues
//     no event query or synchronisation while a capture of its own may be under way (engine_state.h,
//     Note [Capture rules]), since querying a captured event or syncing a capturing stream fails in any mode;
//     a capture it is told of without a pool (LD_PRELOAD's cudaStreamBeginCapture) counts the same. Recording
//     an event on a capturing stream makes it part of the graph (cuda.h, cuEventRecord): none is recorded.
//  The libcuda double (tests/fake_cuda) models R12-R14 as well: contexts, a virtual clock with work that
//  touches memory, faults, and captures. It judges work by the physical memory it touches (R9: one handle
//  mapped at two addresses is one memory), ordering by happens-before, and unmaps by their addresses.
//  R15 unmap over several mappings: cuda.h asks cuMemUnmap for "the entire contiguous address range that was
//     mapped to"; R7's reading allows several adjacent mappings in one call. A driver that refuses such a
//     range (invalid_argument while the range holds more than one mapping) gets one unmap per mapping from
//     then on: the base class falls back and remembers the answer for the process.
//  R16 per-thread default streams (cuda.h, CU_STREAM_PER_THREAD; cudaStreamPerThread; stream 0 of the _ptsz
//     entry points): a different stream for every thread, which only its own thread can name. fragless
//     keys such a stream by its thread (per_thread_stream(): a value no stream handle takes) and the cuda
//     driver passes it to CUDA as CU_STREAM_PER_THREAD, never as 0 (fragless resolves entry points with
//     legacy default-stream semantics, where 0 is the legacy stream). Another thread's per-thread stream
//     cannot be named (CUDA has no name for it: CU_STREAM_PER_THREAD is the calling thread's): the cuda
//     driver fails such a call with invalid_argument; the host and sim drivers, whose streams are only
//     values, accept it.
//  R17 device-wide synchronisation (cuCtxSynchronize on the device's primary context): waits for the work
//     of every stream of the device, those the allocator does not know among them (a graph replayed on the
//     caller's stream), and of streams destroyed with work still queued (cuda.h, cuCtxSynchronize: "Blocks
//     until the current context has completed all preceding requested tasks"; cuStreamDestroy: the stream's
//     resources are released "once the device has completed all work" in it, the call returning at once).
//     It fails, and would invalidate it, while a capture on the device is under way.
//  R18 export (cuda.h, cuMemExportToShareableHandle; CU_MEM_HANDLE_TYPE_NONE "does not allow any export
//     mechanism"): a handle is exported only if it was created with the type asked for among its
//     requestedHandleTypes (CUmemAllocationProp; R11 says when fragless asks), else the call fails (the
//     stricter reading: every other type refuses, none falls back). For CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
//     the result is an int, a new file descriptor the caller owns and closes; flags must be 0. "Once all
//     shareable handles are closed and the allocation is released, the allocated memory referenced will be
//     released": the memory lives while the handle, any exported descriptor or any imported handle does.
//     The descriptor travels to another process only as a file descriptor does (SCM_RIGHTS over a Unix
//     socket, or pidfd_getfd): NVIDIA's memMapIPCDrv sample. Fabric handles: R26.
//  R19 import (cuMemImportFromShareableHandle): for a POSIX file descriptor, osHandle is the descriptor
//     itself cast to a pointer ((void*)(uintptr_t)fd, as NVIDIA's memMapIPCDrv sample passes it), and the
//     descriptor stays the caller's. The result is a handle like a created one: mapped whole at offset 0
//     (R5), its access set by the importer for its own device (cuMemMap: "the process must use cuMemMap to
//     map the memory ... before setting accessibility with cuMemSetAccess"), released with release (R8),
//     after which its mappings keep the memory. "There is no guarantee that the contents of handle will be
//     the same CUDA memory handle for the same given OS shareable handle": two imports of one descriptor
//     are two handles, each released on its own. The import does not say the allocation's size: the
//     importer is told it (with the descriptor), and a map of another size fails (R5). The host driver
//     checks the size at the import (a memfd's size); the libcuda double, at both.
//  LD_PRELOAD's driver half (torch_plugin/preload_driver.cpp) rests on these:
//  R20 how programs reach the driver. cuda.h maps cuMemAlloc, cuMemAllocPitch, cuMemFree, cuMemGetInfo and
//     cuMemGetAddressRange to their _v2 symbols (CUDA 3.2's ABI), cuGetProcAddress to cuGetProcAddress_v2
//     (CUDA 12.0, with symbolStatus), and under --default-stream per-thread the stream calls to their _ptsz
//     symbols. cuGetProcAddress(symbol, pfn, cudaVersion, flags) names the base symbol; the entry point it
//     hands out has the ABI of cudaVersion (so cuMemAlloc below 3020 is the old 32-bit one, cuGetProcAddress
//     below 12000 the four-argument one), and CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM selects the _ptsz
//     form. CU_GET_PROC_ADDRESS_DEFAULT means per-thread only for code built for per-thread streams, which
//     cuda.h's inline wrapper of cuGetProcAddress_v2 turns into the flag before the call: at the ABI it is
//     the legacy stream. The CUDA 13.0 runtime (libcudart.so.13, observed with a logging libcuda) dlopens
//     libcuda.so.1, takes cuGetProcAddress_v2 through a lookup that reaches an LD_PRELOAD library's export
//     first, asks it for cuGetProcAddress at 11030 and 12000, then for every entry point with flags 0 or 2 and
//     the version of its ABI (cuMemAlloc 3020, cuMemAllocAsync 11020, cuPointerGetAttributes 7000); it
//     passes no symbolStatus. XLA and TensorFlow (xla/tsl/cuda/cuda_stub.cc over tsl's dso_loader) dlopen
//     libcuda.so.1 with RTLD_NOW | RTLD_LOCAL and dlsym each exported name (cuMemAlloc_v2...) in that handle,
//     which searches only the driver and its dependencies: an LD_PRELOAD export is never found that way, so
//     the interposer answers dlsym for the driver's handle too. A driver's cuGetProcAddress is assumed to
//     hand out its own entry points, not ones an interposer could capture (the double links -Bsymbolic);
//     should one not, the interposer's recursion guard forwards such calls (Note [No recursion]).
//  R21 cuMemAllocPitch (cuda.h): element sizes 4, 8 or 16; the pitch "is guaranteed to match or exceed the
//     alignment requirement for texture binding": fragless rounds the width up to
//     CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT and refuses a pitch above CU_DEVICE_ATTRIBUTE_MAX_PITCH.
//     cuMemAlloc of 0 bytes is CUDA_ERROR_INVALID_VALUE (the driver's answer is passed on). cuMemFree takes
//     only an address an allocation call returned and "may perform implicit synchronization" (for memory not
//     from the stream-ordered allocator); a pointer freed already, by either API, is no allocation any more:
//     its second free (cuMemFree, cuMemFreeAsync; cuda_runtime_api.h, cudaFree: "If cudaFree(devPtr) has
//     already been called before, an error is returned") is CUDA_ERROR_INVALID_VALUE (cudaErrorInvalidValue),
//     also while fragless defers the first behind its fence, and R22's queries no longer answer for it as
//     fragless's; cuMemFreeAsync is stream-ordered; during a capture cuMemAllocAsync
//     and cuMemAllocFromPoolAsync create graph-owned memory and cuMemFreeAsync "must be passed the address
//     of a graph allocation" (cuda.h and cuda_runtime_api.h, cudaFreeAsync, in the same words): those go to
//     the driver, and a cuMemFreeAsync or cudaFreeAsync of fragless memory on a capturing stream (never a
//     graph allocation) is refused with CUDA_ERROR_INVALID_VALUE (cudaErrorInvalidValue; the stricter reading
//     of "must", which the libcuda double applies to its own non-graph allocations too).
//  R22 queries (cuda.h): cuMemGetAddressRange answers for "the allocation by cuMemAlloc() or
//     cuMemAllocPitch()"; for cuMemMap'd memory it gives "the size of the mapped region" and
//     CU_POINTER_ATTRIBUTE_RANGE_START_ADDR/RANGE_SIZE "the mappable address range (e.g. from
//     cuMemAddressReserve)": for fragless memory the driver would describe fragless's mapping or
//     reservation, not the block, so the interposer answers the range queries, the device ordinal, memory
//     type, device pointer, managed flag, pool (the one the block was allocated from, else none), buffer id
//     (R25) and context (the device's primary context) for any address inside a block; the others are the
//     driver's (it sees fragless's mapping). cuPointerGetAttributes never fails for a non-CUDA pointer (the
//     attributes get their defaults).
//  R23 memory pools (cuda.h, CUmemPoolProps and CUmemPool_attribute): a pool's properties cannot be queried
//     back, so the interposer knows the pools it saw made (cuMemPoolCreate, cuDeviceGetDefaultMemPool) and the
//     access cuMemPoolSetAccess granted. It serves a pool's allocations when fragless can honour the pool:
//     pinned device memory of one device, no shareable handle type (cuMemPoolExportPointer needs the pool's
//     own memory), no maxSize, no usage flags, and no peer granted access that fragless does not grant
//     (peer_access); else, and for pools it does not know, the driver serves them. Not honoured, and said:
//     the release threshold and the reuse attributes govern the pool's own memory, not fragless's cache
//     (fragless caches by its policy and releases on empty_cache and out-of-memory; its reuse is stream-ordered
//     as record_stream, never opportunistic); cuMemAllocFromPoolAsync on a stream of another device than the
//     pool's goes to the driver (fragless orders a block on its own device's streams only).
//  R24 a device's current pool and a pool's statistics (cuda.h, cuDeviceSetMemPool, cuDeviceGetMemPool,
//     CUDA 13's cuMemSetMemPool and cuMemGetMemPool, CUmemPool_attribute). cuMemAllocAsync "allocates from the
//     current mempool of the provided stream's device", the default pool until cuDeviceSetMemPool (or
//     cuMemSetMemPool for a device location and pinned memory) names another, which "must be local to the
//     specified device": the interposer follows the current pool and serves cuMemAllocAsync, and the
//     runtime's cudaMallocAsync (which allocates from the same current pool, cudaDeviceSetMemPool being
//     cuDeviceSetMemPool), only when it could serve that pool (R23); the Get calls are the driver's. USED_MEM_CURRENT is "memory from the pool
//     that is currently in use by the application", RESERVED_MEM_CURRENT "backing memory currently allocated
//     for the mempool", the HIGH ones their high-water marks "since the last time it was reset", which "can
//     only be reset to zero" (cuMemPoolSetAttribute: "illegal to set this attribute to a non-zero value").
//     For a pool the interposer knows, each answer is the driver's plus fragless's part: the sizes asked of
//     the blocks fragless allocated from the pool and the program has not freed, for both USED and RESERVED
//     (fragless keeps no memory for any one pool: its cache is the device's, and shows in cuMemGetInfo's
//     free). Assumed: a reset the driver accepted restarts fragless's high-water marks from its current part,
//     and the driver's part of a HIGH is added to fragless's, exact while only one of the two serves the pool
//     (the driver serves a pool fragless serves only during captures, and for allocations from it on another
//     device's stream: R23), an upper bound otherwise. Known pools
//     are those R23 lists; a pool the program never made or asked for is the driver's alone.
//  R25 CU_POINTER_ATTRIBUTE_BUFFER_ID (cuda.h): "a buffer ID which is guaranteed to be unique within the
//     process". For fragless memory the driver would give the id of fragless's mapping, shared by every block
//     in it; the interposer gives each block an id of its own when first asked, dropped at the block's free
//     (through either half), so a new block at the same address gets a new one. Assumed: the driver numbers
//     its buffers from 1 upwards and never reaches 2^63 in a process; fragless's ids have that bit set.
//  Sharing, continued:
//  R26 fabric handles (cuda.h: CUmemFabricHandle, "an opaque handle representing a memory allocation that can
//     be exported to processes in same or different nodes"; CU_MEM_HANDLE_TYPE_FABRIC;
//     CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, "device supports exporting memory to a fabric handle
//     with cuMemExportToShareableHandle() or requested with cuMemCreate()"). Read strictly: cuMemCreate with
//     the fabric type among requestedHandleTypes on a device without the attribute fails (cuMemCreate lists
//     CUDA_ERROR_NOT_SUPPORTED), so fragless asks for the type only where the device reports it and refuses
//     shareable_handles:fabric elsewhere, naming the attribute. Export follows R18: only a handle created with
//     the fabric type exports one (a POSIX-only handle refuses, and a fabric-only handle refuses a POSIX
//     descriptor); the result is the 64 bytes of a CUmemFabricHandle, data that travels as bytes (no
//     descriptor). Import (cuMemImportFromShareableHandle) takes osHandle as a pointer to those 64 bytes; "If
//     shHandleType is CU_MEM_HANDLE_TYPE_FABRIC and the importer process has not been granted access to the
//     same IMEX channel as the exporter process, this API will error as CUDA_ERROR_NOT_PERMITTED" (cuMemCreate:
//     both sides need an IMEX channel, /dev/nvidia-caps-imex-channels). Bytes that name no exported
//     allocation (forged) are refused (the stricter reading: CUDA_ERROR_INVALID_VALUE, nothing imported). The
//     imported handle maps, releases and keeps its memory as R19's does.
//  Events: record_event marks the current end of a stream's queue; query_event says ok once the work
//  before it is done, else not_ready; synchronize_* wait (each one is a forced sync the engine counts);
//  stream_wait_event(s, e) makes work queued on s later start after e (cuStreamWaitEvent; the host goes on),
//  so an event recorded on s afterwards completes only after e has.
#pragma once
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include "fragless/spin_mutex.h"
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fragless/flat_table.h"

namespace fragless {

using DevicePtr = std::uintptr_t;
using PhysHandle = std::uint64_t;
// R8: driver handle values are nonzero and below 2^63 (the cuda driver refuses others); the engine names a
// handle with this bit set while the driver may already have given its value to another (Note [Handle aliases]).
inline constexpr PhysHandle kEngineHandleBit = PhysHandle{1} << 63;
using Stream = std::uintptr_t;  // a cudaStream_t as an integer; 0 is the default stream
using Event = std::uint64_t;

enum class Status : int {
  ok = 0,
  out_of_memory,     // physical memory (or address space) exhausted: the engine may free its cache and retry
  invalid_argument,  // a pre-condition was broken: a bug in the caller
  not_ready,         // query_event: the work is not done yet
  not_supported,     // the device or driver cannot do this (no VMM support, no GPU)
  driver_error,      // anything else the driver reported
};

const char* status_name(Status s);

enum class DriverCall : int {
  reserve, free_reservation, create, release, map, unmap, set_access,
  record_event, query_event, synchronize_event, synchronize_stream, release_event, stream_wait_event,
  synchronize_device, export_handle, import_handle, memory_info, count_
};
inline constexpr int kDriverCallCount = static_cast<int>(DriverCall::count_);
const char* driver_call_name(DriverCall c);

// R16: the calling thread's per-thread default stream, as fragless keys it (set bits no stream handle has:
// user-space pointers never reach the top of the address space), and whether a stream is such a key.
Stream per_thread_stream();
inline bool is_per_thread_stream(Stream s) { return (s >> 60) == 0xF; }

// Modelled cost of one call, in microseconds: us + per_mib × the call's size in MiB (calls with a size:
// reserve, free_reservation, create, map, unmap, set_access). Defaults: published A100 figures at 2 MiB
// (kvcached bench_vmm), no size term; a memory query (cuMemGetInfo) 10 µs (published figures, driver.cpp).
// `fragless-replay --costs FILE` fits both terms from a probe of a real driver (tools/gpu_probe.cpp).
struct CostModel {
  std::array<double, kDriverCallCount> us{};
  std::array<double, kDriverCallCount> per_mib{};
  static CostModel a100();
};

// Calls and modelled time: all of them, and the part made by background work (a thread inside a
// BackgroundCalls scope), so that what a caller waited for is the difference.
struct DriverCounters {
  std::array<std::uint64_t, kDriverCallCount> calls{};
  double modelled_us = 0;
  std::array<std::uint64_t, kDriverCallCount> background_calls{};
  double background_us = 0;
  std::uint64_t operator[](DriverCall c) const { return calls[static_cast<int>(c)]; }
  std::uint64_t background(DriverCall c) const { return background_calls[static_cast<int>(c)]; }
  // Calls made, and time spent, on the caller's path (everything but background work).
  std::uint64_t on_path(DriverCall c) const { return (*this)[c] - background(c); }
  double on_path_us() const { return modelled_us - background_us; }
};

// While one is alive on a thread, the driver calls that thread makes are counted as background work
// (DriverCounters::background_*). The background worker holds one for its life; a replay stepping the
// background by hand holds one per step.
class BackgroundCalls {
 public:
  BackgroundCalls();
  ~BackgroundCalls();
  BackgroundCalls(const BackgroundCalls&) = delete;
  BackgroundCalls& operator=(const BackgroundCalls&) = delete;
  static bool active();
};

// What the driver holds, as the contract sees it: reservations, handles and mappings. The base class keeps
// one and checks every VMM call against it (R1-R9 above); each check returns nullptr when the call may go
// ahead, else the rule it breaks.
//
// Note [The contract's tables]
// Every VMM call of every driver passes through these tables, so they are on the replay's hot path: a
// fragless replay makes about one create and one map per event, mostly of single pages, and releases tens
// of thousands of handles at its end. No check needs mappings in address order: a range of whole, adjacent
// mappings (R6, R7) is walked from its start, one exact lookup per mapping (the next must start where the
// last ended), and an overlap (R3, R5) is a question about pages, which a bitmap of mapped pages answers
// (one bit per page of granularity, in 64-page words kept only while a page of theirs is mapped). So the
// mappings, the handles and the bitmap's words are flat hash tables (Note [Flat tables]): a lookup is a
// cache line or two, and neither the checks nor the records call malloc once the tables have grown. Only
// the reservations, few (one per segment), stay ordered, to find the one an address falls in.
class DriverContract {
 public:
  explicit DriverContract(std::size_t granularity) : g_(granularity) {}
  DriverContract(const DriverContract&) = delete;
  DriverContract& operator=(const DriverContract&) = delete;
  const char* check_reserve(std::size_t size) const;
  const char* check_free_reservation(DevicePtr va, std::size_t size) const;
  const char* check_create(std::size_t size) const;
  const char* check_release(PhysHandle h) const;
  const char* check_map(DevicePtr va, std::size_t size, PhysHandle h, std::size_t offset) const;
  const char* check_set_access(DevicePtr va, std::size_t size) const;
  const char* check_unmap(DevicePtr va, std::size_t size) const;
  const char* check_export(PhysHandle h) const;

  void reserved(DevicePtr va, std::size_t size) { reservations_[va] = size; }
  void freed_reservation(DevicePtr va) { reservations_.erase(va); }
  // A value the driver gives again while another thread's release or unmap of the handle that had it is not yet
  // recorded (R8; the cuda driver's calls run concurrently) replaces that entry: each entry has its own serial,
  // and a record that finds another serial than its check saw leaves the entry alone (the old handle's memory
  // went before the driver could give its value again).
  void created(PhysHandle h, std::size_t size, bool imported = false) {
    if (const HandleState* old = handles_.find(h); old && !old->imported) drop_live(old->size);  // its value reused
    handles_[h] = HandleState{size, 0, false, imported, next_serial_++};
    if (!imported) add_live(size);
  }
  std::uint64_t serial_of(PhysHandle h) const {
    const HandleState* s = handles_.find(h);
    return s ? s->serial : 0;
  }
  // The release of h (as its check saw it: `serial`) went through. Returns true when the memory goes now (no
  // mapping left); else it goes with the last unmap.
  bool released(PhysHandle h, std::uint64_t serial);
  void mapped(DevicePtr va, std::size_t size, PhysHandle h);
  // Appends to `gone` the released handles whose last mapping this unmap removed.
  void unmapped(DevicePtr va, std::size_t size, std::vector<PhysHandle>* gone);

  std::size_t mapping_count() const { return mappings_.size(); }
  // Whether [va, va+size), a range check_unmap accepted (whole, adjacent mappings), holds more than one:
  // whether the first ends before it does.
  bool several_mappings(DevicePtr va, std::size_t size) const { return mapping_size(va) < size; }
  std::size_t mapping_size(DevicePtr va) const {
    const MappingState* m = mappings_.find(va);
    return m ? m->size : 0;
  }
  std::size_t handle_size(PhysHandle h) const {
    const HandleState* s = handles_.find(h);
    return s ? s->size : 0;
  }
  std::size_t handle_count() const { return handles_.size(); }
  // The bytes of the handles this driver created whose memory has not gone yet (not released, or released
  // and still mapped, R8): what the device holds for the process through it. Imports are another process's.
  // Read without the tables' lock (an allocation's growth asks it several times); changed under it.
  std::size_t live_bytes() const { return live_bytes_.load(std::memory_order_relaxed); }

 private:
  struct HandleState {
    std::size_t size = 0, map_count = 0;
    bool released = false;
    bool imported = false;  // another process's memory (import_handle)
    std::uint64_t serial = 0;
  };
  struct MappingState {
    std::size_t size = 0;
    PhysHandle handle = 0;
    std::uint64_t serial = 0;  // the handle's, when it was mapped
  };
  bool aligned(std::size_t v) const { return v % g_ == 0; }
  bool whole_mappings(DevicePtr va, std::size_t size) const;
  // The bitmap of mapped pages (Note [The contract's tables]): whether a page of [va, va+size) is mapped;
  // marks the pages of [va, va+size) mapped (on) or not.
  bool any_mapped(DevicePtr va, std::size_t size) const;
  void mark(DevicePtr va, std::size_t size, bool on);

  std::size_t g_;
  std::map<DevicePtr, std::size_t> reservations_;
  FlatTable<HandleState> handles_;
  FlatTable<MappingState> mappings_;  // by start address
  // The bitmap's words, by page / 64: bit i of word w is page 64w + i (a page: an address / granularity).
  FlatTable<std::uint64_t> mapped_pages_;
  std::uint64_t next_serial_ = 1;
  void add_live(std::size_t bytes) {  // under the tables' lock
    live_bytes_.store(live_bytes_.load(std::memory_order_relaxed) + bytes, std::memory_order_relaxed);
  }
  void drop_live(std::size_t bytes) {  // under the tables' lock
    live_bytes_.store(live_bytes_.load(std::memory_order_relaxed) - bytes, std::memory_order_relaxed);
  }
  std::atomic<std::size_t> live_bytes_{0};
};

// R26: a CUmemFabricHandle's bytes.
struct FabricHandle {
  unsigned char data[64] = {};
};

class Driver {
 public:
  virtual ~Driver() = default;
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  virtual const char* name() const = 0;
  std::size_t granularity() const { return granularity_; }
  int device() const { return device_; }

  Status reserve(std::size_t size, DevicePtr* va);
  Status free_reservation(DevicePtr va, std::size_t size);
  Status create(std::size_t size, PhysHandle* h);
  Status release(PhysHandle h);
  Status map(DevicePtr va, std::size_t size, PhysHandle h, std::size_t offset);
  Status unmap(DevicePtr va, std::size_t size);
  Status set_access(DevicePtr va, std::size_t size);
  // R18: a new file descriptor for handle h's memory (*fd, owned by the caller); not_supported when h was not
  // created exportable or the driver cannot share.
  Status export_handle(PhysHandle h, int* fd);
  // R19: a new handle (*h) for `size` bytes of memory another process (or this one) exported as descriptor
  // fd, which stays the caller's. Map it whole, release it like a created handle.
  Status import_handle(int fd, std::size_t size, PhysHandle* h);
  // R26: the same through fabric handles: *out gets h's fabric handle (not_supported when h was not created
  // with the fabric type), and a fabric handle another process exported imports as a new handle.
  Status export_handle(PhysHandle h, FabricHandle* out);
  Status import_handle(const FabricHandle& f, std::size_t size, PhysHandle* h);
  // Whether this driver's exportable memory is created with the fabric type (shareable_handles:fabric, R26):
  // shares then carry fabric handles, not descriptors.
  virtual bool fabric_handles() const { return false; }
  Status record_event(Stream s, Event* e) {
    return event_call(DriverCall::record_event, [&] { return do_record_event(s, e); });
  }
  Status query_event(Event e) { return event_call(DriverCall::query_event, [&] { return do_query_event(e); }); }
  Status synchronize_event(Event e) {
    return event_call(DriverCall::synchronize_event, [&] { return do_synchronize_event(e); });
  }
  Status release_event(Event e) { return event_call(DriverCall::release_event, [&] { return do_release_event(e); }); }
  Status synchronize_stream(Stream s) {
    return event_call(DriverCall::synchronize_stream, [&] { return do_synchronize_stream(s); });
  }
  // Work queued on s from now on starts only after event e has completed (cuStreamWaitEvent): a device-side
  // dependency, the host does not wait.
  Status stream_wait_event(Stream s, Event e) {
    return event_call(DriverCall::stream_wait_event, [&] { return do_stream_wait_event(s, e); });
  }
  // Waits for all work queued on the device, on every stream (R17).
  Status synchronize_device() {
    return event_call(DriverCall::synchronize_device, [&] { return do_synchronize_device(); });
  }
  // The size of the mapping that starts at va (0: none starts there).
  std::size_t mapping_size(DevicePtr va) const {
    std::lock_guard lk(mu_);
    return contract_.mapping_size(va);
  }
  // The memory the device holds for the handles created through this driver (DriverContract::live_bytes).
  std::size_t live_bytes() const { return contract_.live_bytes(); }
  // Appends to `out` each mapping still inside [va, va + size), as (address, size): what an unmap of the
  // range that failed left (R15: an unmap one mapping at a time may stop part way), for a retry.
  void still_mapped(DevicePtr va, std::size_t size, std::vector<std::pair<DevicePtr, std::size_t>>* out) const {
    for (DevicePtr at = va; at < va + size; at += granularity())
      if (const std::size_t n = mapping_size(at)) {
        out->emplace_back(at, n);
        at += n - granularity();
      }
  }

  // Free and total physical memory as the device sees it (cuMemGetInfo): a driver call like the others,
  // counted and charged (DriverCall::memory_info), so a policy that asks it on every growth pays for it.
  void memory_info(std::size_t* free_bytes, std::size_t* total_bytes) {
    charge(DriverCall::memory_info);
    do_memory_info(free_bytes, total_bytes);
  }
  // Text of the last failure, for error messages ("cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (out of memory)",
  // or the contract rule a call broke).
  // The last failure of a call made by the calling thread (threads do not see each other's errors: the rule
  // a call broke, or the driver's text given with set_error, are kept per thread).
  std::string last_error() const;
  // Not synchronised: read it only while no other thread calls this driver (tests).
  const DriverContract& contract() const { return contract_; }

  DriverCounters counters() const;
  double background_us() const;  // counters().background_us, without copying the rest
  void reset_counters();
  void set_cost_model(const CostModel& m);
  // Calls begun so far that can change the device's free memory (create, release, unmap), from any thread;
  // never reset. Equal before and after a memory_info, no call of this driver changed what it answers.
  std::uint64_t memory_changes() const { return memory_changes_.load(std::memory_order_acquire); }

 protected:
  Driver(int device, std::size_t granularity)
      : device_(device), granularity_(granularity), contract_(granularity) {}
  // The text of this thread's last failure, for a driver that does not give it with set_error ("" if none).
  virtual std::string do_last_error() const { return {}; }
  // The text of the failure the calling thread's call is about to return, kept for this thread alone: two
  // threads failing at once each see their own (last_error()). Every failure of a driver that uses it sets it.
  void set_error(std::string text) const;
  // memory_info's answer (a driver that is not concurrent_calls() takes impl_lock() here itself).
  virtual void do_memory_info(std::size_t* free_bytes, std::size_t* total_bytes) = 0;
  // Whether do_* may run on two threads at once (libcuda is thread-safe). When false, the base class runs
  // them one at a time, and the driver takes impl_lock() in memory_info and anything else it shares.
  virtual bool concurrent_calls() const { return false; }
  std::unique_lock<std::mutex> impl_lock() const {
    return concurrent_calls() ? std::unique_lock<std::mutex>() : std::unique_lock<std::mutex>(impl_mu_);
  }
  // The lock of the contract's tables, counters and cost model (Note [Driver calls from two threads]),
  // taken after impl_lock() where both are held; for a driver's fork() handlers.
  SpinMutex& tables_mutex() const { return mu_; }
  // The memory of a released handle goes back once its last mapping is gone (R8). Drivers that account
  // memory themselves (host, sim) free it here; the cuda driver leaves it to CUDA.
  virtual void memory_gone(PhysHandle) {}

 private:
  Status refuse(const char* rule);
  // A failure the implementation reported: its own text is the last error now (for this thread).
  Status fail_through(Status st);
  void charge(DriverCall c, std::size_t bytes = 0);
  void charge_locked(DriverCall c, std::size_t bytes = 0);  // mu_ held: a check's lock counts the call too
  // Event calls: counted, then run (one at a time unless concurrent_calls()).
  template <class F>
  Status event_call(DriverCall c, F&& f) {
    charge(c);
    auto lk = impl_lock();
    return fail_through(f());
  }

  virtual Status do_reserve(std::size_t size, DevicePtr* va) = 0;
  virtual Status do_free_reservation(DevicePtr va, std::size_t size) = 0;
  virtual Status do_create(std::size_t size, PhysHandle* h) = 0;
  virtual Status do_release(PhysHandle h) = 0;
  virtual Status do_map(DevicePtr va, std::size_t size, PhysHandle h, std::size_t offset) = 0;
  virtual Status do_unmap(DevicePtr va, std::size_t size) = 0;
  virtual Status do_set_access(DevicePtr va, std::size_t size) = 0;
  virtual Status do_record_event(Stream s, Event* e) = 0;
  virtual Status do_query_event(Event e) = 0;
  virtual Status do_synchronize_event(Event e) = 0;
  virtual Status do_release_event(Event e) = 0;
  virtual Status do_synchronize_stream(Stream s) = 0;
  virtual Status do_stream_wait_event(Stream s, Event e) = 0;
  virtual Status do_synchronize_device() = 0;
  // R18, R19: drivers that cannot share memory (sim) keep these.
  virtual Status do_export_handle(PhysHandle, int*) { return unsupported("export_handle: this driver cannot share memory"); }
  virtual Status do_import_handle(int, std::size_t, PhysHandle*) {
    return unsupported("import_handle: this driver cannot share memory");
  }
  virtual Status do_export_fabric(PhysHandle, FabricHandle*) {
    return unsupported("export_handle: this driver has no fabric handles (R26)");
  }
  virtual Status do_import_fabric(const FabricHandle&, std::size_t, PhysHandle*) {
    return unsupported("import_handle: this driver has no fabric handles (R26)");
  }
  // export_handle and import_handle's checks and counts around `call` (a do_* of either kind).
  template <class Call> Status exporting(PhysHandle h, Call call);
  template <class Call> Status importing(std::size_t size, PhysHandle* h, Call call);
  Status unsupported(const char* what);
  Status unmap_each_mapping(DevicePtr va, std::size_t size);  // R15's fallback

  // Note [Driver calls from two threads]: the engine's thread and the background worker call one driver
  // at once, on distinct objects (the worker creates new handles, and maps, unmaps and releases only what
  // the engine handed it). `mu_` keeps the contract's tables, the counters and the cost model whole; it is
  // never held across a do_* call, so a slow cuMemCreate on one thread does not stall the other. Its critical
  // sections are a few table operations (and a fork, held by the host driver's handlers), so it is the device
  // lock's kind (spin_mutex.h), which an uncontended call takes with one compare-exchange: a std::mutex's two
  // calls into the C library were about a tenth of the instructions of a fragless replay, which passes every
  // driver call through here.
  int device_;
  std::size_t granularity_;
  mutable SpinMutex mu_;
  mutable std::mutex impl_mu_;  // do_* one at a time, for drivers without concurrent_calls()
  DriverCounters counters_;
  std::atomic<std::uint64_t> memory_changes_{0};
  CostModel costs_ = CostModel::a100();
  DriverContract contract_;
};

}  // namespace fragless
