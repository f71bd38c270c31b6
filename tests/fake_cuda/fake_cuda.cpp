// A test double of libcuda: the driver-API functions fragless uses, with their C ABI, over host memory.
// Physical allocations are memfds; reservations are PROT_NONE mappings; cuMemMap maps the memfd over the
// reservation (still inaccessible, as CUDA leaves it) and cuMemSetAccess makes it readable and writable,
// so programs really read and write what they allocate.
//
// It models what CUDA does, in the strictest reading of its documentation, and is never more permissive:
//  - the VMM rules R1-R9 of allocator/include/fragless/driver.h (CUDA_ERROR_INVALID_VALUE when broken);
//  - contexts: a primary context per device (retained, released, its state), a per-thread stack of current
//    contexts (a new thread has none), push, pop, set, get. Every call except initialisation, device queries,
//    primary-context management, context-stack calls, error strings and cuGetProcAddress needs a current,
//    live context (CUDA_ERROR_INVALID_CONTEXT). Streams and events belong to the context current at their
//    creation; stream 0 (and CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) is the current context's. Recording an
//    event on a stream of another context is CUDA_ERROR_INVALID_HANDLE, as cuda.h says of cuEventRecord.
//    A stream the program never created is CUDA_ERROR_INVALID_HANDLE.
//  - asynchrony, on a virtual clock: a test enqueues work (fakecuda_launch) that touches an address range for
//    some ticks. Work on a stream runs in order, after whatever the stream waited for (cuStreamWaitEvent);
//    an event completes when the work before it has. The clock moves when the test advances it, or when the
//    host waits (a stream, event or context synchronisation waits exactly until that work is done). A held
//    stream (fakecuda_hold_stream) makes no progress until it is released or synchronised.
//    Work touches physical memory: its address range is resolved through the mappings at launch to
//    (handle, offset) ranges. Judged on physical memory, whatever the addresses: work touching memory that
//    unfinished work of another stream touches without being ordered after it (happens-before through
//    stream order and cuStreamWaitEvent, never mere timing: the allocator handed a block out too early),
//    and a handle's memory going (released, last mapping unmapped) under unfinished work. Judged on
//    addresses: unmapping or freeing an address range that unfinished work was launched on, and work
//    launched on an address that is not mapped and accessible to its device. Unmapping one address of a
//    handle while work uses it through another is legal (R9). Each is an illegal-address fault: counted,
//    described, and sticky (every later call then fails with CUDA_ERROR_ILLEGAL_ADDRESS, as a context does
//    after a fault). The census reports them.
//  - stream capture: cuStreamBeginCapture (and ToGraph, into a graph not modelled)/EndCapture/IsCapturing/GetCaptureInfo and
//    cuThreadExchangeStreamCaptureMode. During a capture, querying or synchronising a captured event or a
//    capturing stream, synchronising the context, and (from a thread whose mode is not relaxed, in global
//    mode from any thread) calls CUDA deems unsafe - the VMM calls, cuMemGetInfo, event queries and every
//    synchronisation - fail with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (or CUDA_ERROR_CAPTURED_EVENT) and
//    invalidate the capture; cuStreamEndCapture then fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. Work
//    launched on a capturing stream is recorded, not run.
//  - per-thread default streams: CU_STREAM_PER_THREAD is a different stream on every thread (and context),
//    never the legacy stream; a thread that exits leaves its per-thread stream behind, never to another thread.
//  - memory handles (R8): a handle's value comes back for a later handle (created, imported, or the double's
//    own allocation) once its memory is gone, the most recently gone value first; work is judged on the
//    handle's serial number, never its value, so work on the old memory is never taken for work on the new.
//  - stream handles: cuStreamDestroy returns at once and the stream's work still completes; its handle value
//    is given to a later stream only once that work is done (as CUDA may reuse it), or at once while
//    fakecuda_reuse_stream_values_at_once is set (RMM's issue 649 reports CUDA doing so); the new stream's
//    work is not ordered after the old one's. cuStreamGetCtx and
//    cuCtxGetDevice tell a stream's device.
//  - memory pools: each device's default pool and its current pool (cuDeviceSetMemPool, cuMemSetMemPool: a
//    pool of that device only), which cuMemAllocAsync allocates from; a pool's statistics (the sizes asked,
//    used and reserved alike) and their high-water marks, which reset to zero only (CUDA_ERROR_INVALID_VALUE
//    for any other value) and then follow the pool's use.
//  - unmaps: fakecuda_refuse_multi_mapping_unmap makes cuMemUnmap refuse a range of several mappings, the
//    strict reading of "the entire contiguous address range that was mapped to" (counted as
//    "cuMemUnmap:refused").
//  - versions: cuDriverGetVersion is settable; cuGetProcAddress refuses a version above it.
// Failure injection: fakecuda_fail("cuMemMap", n, e), or FAKECUDA_FAIL=cuMemMap:n:e. Environment: FAKECUDA_DEVICES (default 2),
// FAKECUDA_CAPACITY_MB (per device, default 1024; a comma list gives each device its own), FAKECUDA_DRIVER_VERSION.
#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fake_cuda.h"

#define FAKE_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr std::size_t kGranularity = 2u << 20;
constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();

// One operation queued on a stream: a kernel, an event record or a wait. It completes at `done` on the
// virtual clock; while its stream is held or something it depends on is unresolved, `done` is kNever and the
// node is `blocked`, remembering what it waits for.
//
// Ordering is judged by happens-before, never by timing: each node carries a vector clock (for every stream
// it is ordered after, the position of the last node of that stream it follows), inherited from its
// stream's previous node and from the events it waits for. Work on stream T is ordered after work W on
// stream S only when T's node follows W through stream order and cuStreamWaitEvent, or when W is done
// (the host waited for it, or the clock passed it). Work that merely happens to start later is not ordered.
using Clock = std::map<std::uint64_t, std::uint64_t>;  // stream id -> position
struct Node {
  CUstream stream = nullptr;
  std::uint64_t stream_id = 0, position = 0;      // the stream (an identity never reused) and its n-th node
  Clock clock;                                    // happens-before: what this node is ordered after
  std::uint64_t duration = 0;
  std::uint64_t done = kNever;
  bool blocked = false;
  std::shared_ptr<Node> after_stream;             // the stream's previous node (while blocked)
  std::vector<std::shared_ptr<Node>> after_events; // waited-for events (while blocked)
  bool follows(const Node& w) const {
    auto it = clock.find(w.stream_id);
    return it != clock.end() && it->second >= w.position;
  }
};
using NodeP = std::shared_ptr<Node>;

// types: requestedHandleTypes at cuMemCreate (what it may be exported as, R18); imported: made by
// cuMemImportFromShareableHandle (another allocation's memory: no capacity of this device's).
// serial: the handle's identity, never reused (its value is, once its memory is gone: R8).
struct Handle {
  int fd;
  std::size_t size;
  int device;
  int map_count;
  bool released;
  unsigned types = 0;
  bool imported = false;
  std::uint64_t serial = 0;
};
struct Mapping { std::size_t size; CUmemGenericAllocationHandle handle; bool accessible; };
struct Fault { int countdown; CUresult error; };
struct FakeEvent { CUcontext ctx; NodeP node; unsigned long long capture = 0; };
// `runtime`: made by fakecuda_stream_create/adopt, standing for the CUDA runtime's streams; the runtime keeps
// its primary context retained, so they outlive the retains the program under test takes and drops.
struct FakeStream {
  CUcontext ctx;
  NodeP tail;
  bool held = false;
  unsigned long long capture = 0;
  bool runtime = false;
  std::uint64_t id = 0;         // identity for happens-before (a reused handle value is a new stream)
  std::uint64_t positions = 0;  // nodes queued so far
};
// Physical memory: bytes [lo, hi) of a handle, named by its serial (Handle::serial).
struct PhysRange { std::uint64_t serial; std::size_t lo, hi; };
// Work that touches memory: the addresses it was launched on (an unmap is judged on them) and the physical
// memory they resolved to at launch (ordering between streams and releases are judged on it: one handle
// may be mapped at several addresses, R9).
struct Touch { CUdeviceptr va; std::size_t size; CUstream stream; NodeP node; std::vector<PhysRange> phys; };
struct Capture { CUstream origin; CUstreamCaptureMode mode; std::thread::id thread; bool invalidated = false; };
struct Primary { int retains = 0; };
// Memory the double allocates itself (the driver's own allocator): its mapping, device, size asked for,
// buffer id, pool (stream-ordered allocations) and whether it came from the stream-ordered allocator.
struct OwnAllocation {
  std::size_t size = 0, mapped = 0;
  int device = 0;
  unsigned long long buffer_id = 0;
  CUmemoryPool pool = nullptr;
  bool async = false;
  bool graph = false;  // allocated on a capturing stream: a graph allocation (cuMemFreeAsync during a capture)
};
// A memory pool (cuMemPoolCreate, or a device's default pool): its properties, access and attributes.
struct MemPool {
  CUmemPoolProps props{};
  bool is_default = false;
  std::map<int, CUmemAccess_flags> access;  // other devices granted access
  cuuint64_t release_threshold = 0;
  int follow_events = 1, opportunistic = 1, internal_dependencies = 1;
  // In use (the sizes asked; the double reserves exactly that) and the high-water marks since their reset.
  std::size_t used = 0, used_high = 0, reserved_high = 0;
};

struct State {
  std::mutex mu;
  int devices = 2;
  std::map<int, std::size_t> capacity, used;
  std::vector<Primary> primaries;
  std::unordered_map<CUmemGenericAllocationHandle, Handle> handles;
  CUmemGenericAllocationHandle next_handle = 1;
  std::vector<CUmemGenericAllocationHandle> gone_handles;  // values free to come back, the most recent last
  std::uint64_t next_handle_serial = 1;
  std::map<CUdeviceptr, std::size_t> reservations;
  std::map<CUdeviceptr, Mapping> mappings;
  std::unordered_map<std::string, Fault> faults;
  std::unordered_map<std::string, unsigned long> calls;
  // enter()'s counters by the address of the literal naming the call (a node of `calls` never moves), so a
  // call costs no string: the double is cheap enough for the interposer's benchmarks to measure the interposer.
  std::unordered_map<const char*, unsigned long*> calls_by_literal;
  std::unordered_map<std::string, unsigned> delays_us;
  std::unordered_map<CUevent, FakeEvent> events;
  std::map<CUstream, FakeStream> streams;          // created (or adopted) streams
  std::map<CUcontext, FakeStream> null_streams;    // each context's legacy stream
  // Each thread's per-thread default stream of each context (CU_STREAM_PER_THREAD): one per thread, as CUDA's.
  // Keyed by a serial number per thread, never reused (a thread id may be, once its thread has exited).
  std::map<std::pair<std::uint64_t, CUcontext>, FakeStream> per_thread_streams;
  // Destroyed streams: a handle value is given to a new stream only once the old one's work is done (at once,
  // work or not, while reuse_streams_at_once is set).
  std::vector<std::pair<CUstream, NodeP>> destroyed_streams;
  // The queued work of destroyed streams, by context: cuCtxSynchronize (and cuMemFree's implicit
  // synchronisation) waits for all preceding work of the context (cuda.h), a destroyed stream's included,
  // whether or not its handle value was given to a new stream since.
  std::vector<std::pair<CUcontext, NodeP>> orphaned_work;
  bool refuse_multi_unmap = false;  // fakecuda_refuse_multi_mapping_unmap
  bool reuse_streams_at_once = false;  // fakecuda_reuse_stream_values_at_once
  std::vector<NodeP> blocked;                      // in enqueue order
  std::vector<Touch> touches;                      // work that touches memory, until it is done
  std::map<unsigned long long, Capture> captures;  // capture id -> capture under way
  unsigned long long next_capture = 1;
  std::uintptr_t next_event = 0x1000, next_stream = 0x5000, next_graph = 0x9000;
  std::uint64_t now = 0;
  std::uint64_t next_stream_id = 1;
  long fault_count = 0, invalidated_captures = 0;
  unsigned long injected_failures = 0;  // injected errors returned so far (fakecuda_fail)
  std::string first_fault;
  bool initialised = false;
  int driver_version = 13000;
  unsigned last_handle_types = 0;
  bool fabric = false;  // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, and an IMEX channel (FAKECUDA_FABRIC=1)
  std::map<CUdeviceptr, std::set<int>> access_of;  // per mapping (by its address): devices granted access
  // The double's own allocations (cuMemAlloc, cuMemAllocPitch, the stream-ordered allocator): each one
  // reservation, handle and mapping of its own, by its address.
  std::map<CUdeviceptr, OwnAllocation> own;
  unsigned long long next_buffer_id = 1;
  std::map<CUmemoryPool, MemPool> pools;  // created and default pools
  std::map<int, CUmemoryPool> current_pools;  // cuDeviceSetMemPool / cuMemSetMemPool, per device
  std::uintptr_t next_pool = 0xB000;
  State() {
    if (const char* v = std::getenv("FAKECUDA_DRIVER_VERSION")) driver_version = std::max(1, std::atoi(v));
    if (const char* d = std::getenv("FAKECUDA_DEVICES")) devices = std::max(1, std::atoi(d));
    if (const char* f = std::getenv("FAKECUDA_FABRIC")) fabric = std::atoi(f) != 0;
    std::vector<std::size_t> caps;
    if (const char* c = std::getenv("FAKECUDA_CAPACITY_MB"))
      for (const char* q = c; *q;) {
        caps.push_back(static_cast<std::size_t>(std::max(1, std::atoi(q))));
        const char* comma = std::strchr(q, ',');
        if (!comma) break;
        q = comma + 1;
      }
    for (int i = 0; i < devices; ++i) {
      const std::size_t mb = caps.empty() ? 1024 : caps[std::min<std::size_t>(static_cast<std::size_t>(i), caps.size() - 1)];
      capacity[i] = mb << 20;
      used[i] = 0;
    }
    primaries.resize(static_cast<std::size_t>(devices));
    // FAKECUDA_FAIL=fn:nth:error[,fn:nth:error...]: failures injected from the start, for programs (the GPU
    // check) that do not call fakecuda_fail themselves.
    if (const char* f = std::getenv("FAKECUDA_FAIL"))
      for (const char* q = f; *q;) {
        const char* end = std::strchr(q, ',');
        const std::string item(q, end ? static_cast<std::size_t>(end - q) : std::strlen(q));
        const auto c1 = item.find(':'), c2 = item.rfind(':');
        if (c1 != std::string::npos && c2 > c1)
          faults[item.substr(0, c1)] = {std::atoi(item.c_str() + c1 + 1), static_cast<CUresult>(std::atoi(item.c_str() + c2 + 1))};
        if (!end) break;
        q = end + 1;
      }
  }
};

State& st() {
  static State* s = new State();
  return *s;
}

// fork() holds the double's lock, so that a child forked while another thread was inside a call of the
// double finds it free (a real driver's state is its own business; a test's child that calls the double
// must not wait for ever on a lock whose holder is not in it). Registered when the double loads, before
// fragless's handlers, whose prepare handler therefore runs first and waits for the device locks while
// calls of the double can still finish.
__attribute__((constructor)) void hold_the_double_across_fork() {
  st();
  pthread_atfork([] { st().mu.lock(); }, [] { st().mu.unlock(); }, [] { st().mu.unlock(); });
}

thread_local std::vector<CUcontext> t_ctx_stack;
std::uint64_t thread_serial() {
  static std::atomic<std::uint64_t> next{1};
  thread_local const std::uint64_t serial = next.fetch_add(1);
  return serial;
}
thread_local CUstreamCaptureMode t_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

CUcontext primary_ctx(int dev) { return reinterpret_cast<CUcontext>(static_cast<std::uintptr_t>(0xC0 + dev)); }
int ctx_device(CUcontext c) { return static_cast<int>(reinterpret_cast<std::uintptr_t>(c) - 0xC0); }
bool ctx_live(CUcontext c) {
  const int d = ctx_device(c);
  return c && d >= 0 && d < st().devices && st().primaries[static_cast<std::size_t>(d)].retains > 0;
}
CUcontext current() { return t_ctx_stack.empty() ? nullptr : t_ctx_stack.back(); }

void fault(const std::string& what) {
  State& s = st();
  if (s.fault_count++ == 0) s.first_fault = what;
}

// Counts a call named by a string literal (caller holds st().mu).
void count_call(const char* fn) {
  State& s = st();
  unsigned long*& count = s.calls_by_literal[fn];
  if (!count) count = &s.calls[fn];
  ++*count;
}

// Counts the call and returns the injected error, or CUDA_SUCCESS. Caller holds st().mu.
CUresult enter(const char* fn) {
  State& s = st();
  count_call(fn);
  if (s.faults.empty()) return CUDA_SUCCESS;
  auto it = s.faults.find(fn);
  if (it != s.faults.end() && it->second.countdown > 0 && --it->second.countdown == 0) {
    const CUresult e = it->second.error;
    s.faults.erase(it);
    ++s.injected_failures;
    return e;
  }
  return CUDA_SUCCESS;
}

// A call that needs a current, live context; a fault earlier makes every such call fail (sticky).
CUresult need_context() {
  if (!ctx_live(current())) return CUDA_ERROR_INVALID_CONTEXT;
  if (st().fault_count) return CUDA_ERROR_ILLEGAL_ADDRESS;
  return CUDA_SUCCESS;
}

// ---- Stream capture --------------------------------------------------------------------------------------

// Invalidates capture `id` (CUDA does so when a capture sees an unsupported call).
void invalidate(unsigned long long id) {
  auto it = st().captures.find(id);
  if (it != st().captures.end() && !it->second.invalidated) {
    it->second.invalidated = true;
    ++st().invalidated_captures;
  }
}

// A potentially unsafe call (cuda.h, cuThreadExchangeStreamCaptureMode): prohibited from a thread whose own
// capture is not relaxed, and from any thread while a global-mode capture is under way, unless the calling
// thread's mode is relaxed. A prohibited call fails and invalidates the captures it conflicts with.
CUresult unsafe_call() {
  State& s = st();
  if (s.captures.empty() || t_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  bool prohibited = false;
  for (auto& [id, c] : s.captures) {
    const bool mine = c.thread == std::this_thread::get_id();
    if ((mine && c.mode != CU_STREAM_CAPTURE_MODE_RELAXED) || c.mode == CU_STREAM_CAPTURE_MODE_GLOBAL) {
      prohibited = true;
      invalidate(id);
    }
  }
  return prohibited ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

// The stream a handle names for the calling thread: created streams by handle; 0 and CU_STREAM_LEGACY as the
// current context's legacy stream; CU_STREAM_PER_THREAD as the calling thread's own per-thread stream of the
// current context (a different stream on every thread). nullptr when it names none.
FakeStream* stream_of(CUstream h) {
  State& s = st();
  if (h == nullptr || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
    CUcontext c = current();
    if (!c) return nullptr;
    auto& n = h == CU_STREAM_PER_THREAD ? s.per_thread_streams[{thread_serial(), c}] : s.null_streams[c];
    n.ctx = c;
    if (!n.id) n.id = s.next_stream_id++;
    return &n;
  }
  auto it = s.streams.find(h);
  return it == s.streams.end() ? nullptr : &it->second;
}

// Every blocking stream of context c that may capture: created streams and per-thread streams.
template <typename F>
void for_each_stream(CUcontext c, F f) {
  for (auto& [h, fs] : st().streams)
    if (fs.ctx == c) f(fs);
  for (auto& [key, fs] : st().per_thread_streams)
    if (fs.ctx == c) f(fs);
}

// Using a stream while a capture is under way: the legacy stream synchronises with every blocking stream of
// its context, so using it while one of them captures invalidates that capture (cudaStreamLegacy semantics).
CUresult legacy_use(CUstream h, FakeStream* fs) {
  if (h != nullptr && h != CU_STREAM_LEGACY) return CUDA_SUCCESS;
  bool conflict = false;
  for_each_stream(fs->ctx, [&](FakeStream& other) {
    if (other.capture) {
      invalidate(other.capture);
      conflict = true;
    }
  });
  return conflict ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
}

// ---- The virtual clock -----------------------------------------------------------------------------------

// Works out every blocked node that can now be placed on the clock (streams not held, dependencies placed).
void resolve() {
  State& s = st();
  bool progress = true;
  while (progress && !s.blocked.empty()) {
    progress = false;
    for (auto it = s.blocked.begin(); it != s.blocked.end();) {
      Node& n = **it;
      const FakeStream* fs = nullptr;
      if (auto f = s.streams.find(n.stream); f != s.streams.end()) fs = &f->second;
      bool ready = !(fs && fs->held) && (!n.after_stream || !n.after_stream->blocked);
      for (auto& d : n.after_events) ready = ready && !d->blocked;
      if (!ready) {
        ++it;
        continue;
      }
      std::uint64_t start = s.now;
      if (n.after_stream) start = std::max(start, n.after_stream->done);
      for (auto& d : n.after_events) start = std::max(start, d->done);
      n.done = start + n.duration;
      n.blocked = false;
      n.after_stream.reset();
      n.after_events.clear();
      it = s.blocked.erase(it);
      progress = true;
    }
  }
}

// Queues a node on stream fs: after the stream's previous node and `waits`, for `duration` ticks.
NodeP enqueue(FakeStream& fs, CUstream h, std::uint64_t duration, std::vector<NodeP> waits = {}) {
  State& s = st();
  auto n = std::make_shared<Node>();
  n->stream = h;
  n->duration = duration;
  if (!fs.id) fs.id = s.next_stream_id++;
  n->stream_id = fs.id;
  n->position = ++fs.positions;
  if (fs.tail) n->clock = fs.tail->clock;
  for (auto& w : waits)
    for (auto [id, pos] : w->clock) n->clock[id] = std::max(n->clock[id], pos);
  n->clock[fs.id] = n->position;
  bool blocked = fs.held || (fs.tail && fs.tail->blocked);
  for (auto& w : waits) blocked = blocked || w->blocked;
  if (!blocked) {
    std::uint64_t start = s.now;
    if (fs.tail) start = std::max(start, fs.tail->done);
    for (auto& w : waits) start = std::max(start, w->done);
    n->done = start + duration;
  } else {
    n->blocked = true;
    n->after_stream = fs.tail;
    n->after_events = std::move(waits);
    s.blocked.push_back(n);
  }
  fs.tail = n;
  return n;
}

// Moves the clock to `t` (never back) and forgets the work that is done by then.
void advance_to(std::uint64_t t) {
  State& s = st();
  s.now = std::max(s.now, t);
  std::erase_if(s.touches, [&](const Touch& w) { return !w.node->blocked && w.node->done <= s.now; });
}

bool node_done(const NodeP& n) { return !n || (!n->blocked && n->done <= st().now); }

// The host waits for node n: holds on the streams it waits behind end (the work is running, and finishes),
// then the clock moves to its completion.
void wait_for(const NodeP& n) {
  if (!n) return;
  State& s = st();
  if (n->blocked) {
    std::vector<Node*> todo{n.get()};
    std::set<Node*> seen;
    while (!todo.empty()) {
      Node* x = todo.back();
      todo.pop_back();
      if (!x->blocked || !seen.insert(x).second) continue;
      if (auto f = s.streams.find(x->stream); f != s.streams.end()) f->second.held = false;
      if (x->after_stream) todo.push_back(x->after_stream.get());
      for (auto& d : x->after_events) todo.push_back(d.get());
    }
    resolve();
  }
  if (!n->blocked) advance_to(n->done);
}

// All work queued on the context so far: its streams', its legacy stream's and its destroyed streams'.
void wait_for_context(CUcontext c) {
  for_each_stream(c, [&](FakeStream& fs) { wait_for(fs.tail); });
  if (auto n = st().null_streams.find(c); n != st().null_streams.end()) wait_for(n->second.tail);
  auto& orphans = st().orphaned_work;
  for (auto& [ctx, n] : orphans)
    if (ctx == c) wait_for(n);
  std::erase_if(orphans, [&](const auto& o) { return o.first == c; });
}

// A stream destroyed with its work still queued: that work still completes (cuStreamDestroy returns at once).
void stream_destroyed(CUstream h, const FakeStream& fs) {
  st().destroyed_streams.emplace_back(h, fs.tail);
  if (fs.tail && !node_done(fs.tail)) st().orphaned_work.emplace_back(fs.ctx, fs.tail);
}

// Unfinished work touching [va, va+size): an unmap, release or free of it is an illegal-address fault.
bool still_touched(CUdeviceptr va, std::size_t size, const char* what) {
  for (const Touch& w : st().touches)
    if (!node_done(w.node) && w.va < va + size && va < w.va + w.size) {
      fault(std::string(what) + " of memory that unfinished work on stream " +
            std::to_string(reinterpret_cast<std::uintptr_t>(w.stream)) + " still touches");
      return true;
    }
  return false;
}

// ---- VMM bookkeeping -------------------------------------------------------------------------------------

bool overlaps_mapping(State& s, CUdeviceptr va, std::size_t size) {
  auto it = s.mappings.lower_bound(va);
  if (it != s.mappings.end() && it->first < va + size) return true;
  if (it != s.mappings.begin() && std::prev(it)->first + std::prev(it)->second.size > va) return true;
  return false;
}

// Whether [va, va+size) consists of whole, adjacent mappings (R6, R7).
bool whole_mappings(State& s, CUdeviceptr va, std::size_t size) {
  if (size == 0) return false;
  std::size_t covered = 0;
  for (auto it = s.mappings.find(va); it != s.mappings.end() && it->first < va + size; ++it) {
    if (it->first != va + covered) return false;
    covered += it->second.size;
  }
  return covered == size;
}

// Whether device `dev` may access all of [va, va+size): mapped, with access granted to it.
bool accessible(State& s, CUdeviceptr va, std::size_t size, int dev) {
  CUdeviceptr at = va;
  while (at < va + size) {
    auto it = s.mappings.upper_bound(at);
    if (it == s.mappings.begin()) return false;
    --it;
    if (it->first + it->second.size <= at) return false;
    auto a = s.access_of.find(it->first);
    if (a == s.access_of.end() || !a->second.count(dev)) return false;
    at = it->first + it->second.size;
  }
  return true;
}

// The physical memory [va, va+size) resolves to through the mappings now (the range is mapped: checked).
std::vector<PhysRange> physical(State& s, CUdeviceptr va, std::size_t size) {
  std::vector<PhysRange> out;
  for (CUdeviceptr at = va; at < va + size;) {
    auto it = std::prev(s.mappings.upper_bound(at));
    const CUdeviceptr end = std::min<CUdeviceptr>(va + size, it->first + it->second.size);
    out.push_back({s.handles.at(it->second.handle).serial, at - it->first, end - it->first});  // mappings start at offset 0 (R5)
    at = end;
  }
  return out;
}

bool overlap(const std::vector<PhysRange>& a, const std::vector<PhysRange>& b) {
  for (const PhysRange& x : a)
    for (const PhysRange& y : b)
      if (x.serial == y.serial && x.lo < y.hi && y.lo < x.hi) return true;
  return false;
}

std::string stream_name(CUstream h) { return std::to_string(reinterpret_cast<std::uintptr_t>(h)); }

// The memory of a released handle goes once nothing maps it (R8); work still using it faults.
void drop_if_unused(State& s, CUmemGenericAllocationHandle h) {
  auto it = s.handles.find(h);
  if (it == s.handles.end() || !it->second.released || it->second.map_count > 0) return;
  for (const Touch& w : s.touches)
    if (!node_done(w.node) && std::any_of(w.phys.begin(), w.phys.end(), [&](const PhysRange& r) { return r.serial == it->second.serial; })) {
      fault("the memory of handle " + std::to_string(h) + " went (released, last mapping gone) while unfinished work on stream " +
            stream_name(w.stream) + " still uses it");
      break;
    }
  close(it->second.fd);
  if (!it->second.imported) s.used[it->second.device] -= it->second.size;
  s.handles.erase(it);
  s.gone_handles.push_back(h);
}

// A value for a new handle (caller holds the lock): the most recently gone one, else a new one (R8).
CUmemGenericAllocationHandle new_handle(State& s, const Handle& hd) {
  CUmemGenericAllocationHandle h = s.next_handle;
  if (s.gone_handles.empty()) {
    ++s.next_handle;
  } else {
    h = s.gone_handles.back();
    s.gone_handles.pop_back();
  }
  Handle& made = s.handles[h] = hd;
  made.serial = s.next_handle_serial++;
  return h;
}

bool in_reservation(State& s, CUdeviceptr va, std::size_t size) {
  auto it = s.reservations.upper_bound(va);
  if (it == s.reservations.begin()) return false;
  --it;
  return va + size <= it->first + it->second;
}

// A test-set delay (fakecuda_set_delay): the call takes this long, outside the double's lock. The call
// counts as "<fn>:started" at once (the call itself is counted after the delay). A delay set again while a
// call waits applies to it (from the call's start): a test may hold a call until it lets it go.
void delay(const char* fn) {
  const std::string name(fn);
  {
    std::lock_guard lk(st().mu);
    ++st().calls[name + ":started"];
  }
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    unsigned us = 0;
    {
      std::lock_guard lk(st().mu);
      auto it = st().delays_us.find(name);
      if (it != st().delays_us.end()) us = it->second;
    }
    const auto left = start + std::chrono::microseconds(us) - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero()) return;
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(left, std::chrono::milliseconds(1)));
  }
}

#define ENTER(name)                              \
  std::lock_guard lk(st().mu);                   \
  if (CUresult e_ = enter(name); e_) return e_;

#define NEED_CONTEXT()                                    \
  if (CUresult c_ = need_context(); c_) return c_;

#define UNSAFE_DURING_CAPTURE()                           \
  if (CUresult u_ = unsafe_call(); u_) return u_;

}  // namespace

FAKE_API CUresult cuInit(unsigned) {
  delay("cuInit");  // loading the driver takes from milliseconds to seconds
  ENTER("cuInit");
  st().initialised = true;
  return CUDA_SUCCESS;
}

namespace {
// The errors the double can return (or be told to inject): code, name, description.
struct ErrorText { CUresult code; const char* name; const char* text; };
constexpr ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUDA_ERROR_CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"},
    {CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
     "dependency created on uncaptured work in another stream"},
    // Injected (FAKECUDA_FAIL) or returned by the module double (fake_modules.cpp) in the GPU check's tests.
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_JIT_COMPILER_NOT_FOUND, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND", "PTX JIT compiler library not found"},
    {CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
     "the provided PTX was compiled with an unsupported toolchain."},
    {CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
     "system has unsupported display driver / cuda driver combination"},
    {CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
     "forward compatibility was attempted on non supported HW"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
const ErrorText* error_text(CUresult e) {
  for (const auto& t : kErrors)
    if (t.code == e) return &t;
  return nullptr;
}
}  // namespace

FAKE_API CUresult cuGetErrorName(CUresult e, const char** s) {
  const ErrorText* t = error_text(e);
  *s = t ? t->name : "CUDA_ERROR_UNKNOWN";
  return t ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult cuGetErrorString(CUresult e, const char** s) {
  const ErrorText* t = error_text(e);
  *s = t ? t->text : "unknown error";
  return t ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult cuDeviceGetCount(int* n) {
  ENTER("cuDeviceGetCount");
  *n = st().devices;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  ENTER("cuDeviceGet");
  if (ordinal < 0 || ordinal >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  ENTER("cuDeviceGetAttribute");
  if (d < 0 || d >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  *v = a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ||
       a == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED ||
       a == CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED;
  if (a == CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT) *v = 512;  // kTexturePitchAlignment below
  if (a == CU_DEVICE_ATTRIBUTE_MAX_PITCH) *v = 1 << 21;            // kMaxPitch below
  if (a == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) *v = st().fabric;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  ENTER("cuDeviceGetName");
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, static_cast<std::size_t>(len), "fragless libcuda double %d", d);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
  ENTER("cuDeviceTotalMem");
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = st().capacity[d];
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceCanAccessPeer(int* can, CUdevice a, CUdevice b) {
  ENTER("cuDeviceCanAccessPeer");
  if (a < 0 || a >= st().devices || b < 0 || b >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  *can = a != b;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  delay("cuDevicePrimaryCtxRetain");  // a context's creation takes from milliseconds to seconds
  ENTER("cuDevicePrimaryCtxRetain");
  if (!c) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  ++st().primaries[static_cast<std::size_t>(d)].retains;
  *c = primary_ctx(d);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  ENTER("cuDevicePrimaryCtxRelease");
  if (d < 0 || d >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  int& r = st().primaries[static_cast<std::size_t>(d)].retains;
  if (r == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (--r == 0) {  // the context is destroyed: its streams and events go with it
    const CUcontext c = primary_ctx(d);
    std::erase_if(st().streams, [&](const auto& kv) { return kv.second.ctx == c && !kv.second.runtime; });
    std::erase_if(st().events, [&](const auto& kv) { return kv.second.ctx == c; });
    std::erase_if(st().orphaned_work, [&](const auto& o) { return o.first == c; });
    st().null_streams.erase(c);
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned* flags, int* active) {
  ENTER("cuDevicePrimaryCtxGetState");
  if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  *flags = 0;
  *active = st().primaries[static_cast<std::size_t>(d)].retains > 0;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxGetCurrent(CUcontext* c) {
  std::lock_guard lk(st().mu);
  count_call("cuCtxGetCurrent");
  if (!c) return CUDA_ERROR_INVALID_VALUE;
  *c = current();
  return CUDA_SUCCESS;
}

// cuda.h: replaces the top of the stack with c; a null c pops it (a no-op on an empty stack).
FAKE_API CUresult cuCtxSetCurrent(CUcontext c) {
  std::lock_guard lk(st().mu);
  count_call("cuCtxSetCurrent");
  if (c && !ctx_live(c)) return CUDA_ERROR_INVALID_CONTEXT;
  if (!c) {
    if (!t_ctx_stack.empty()) t_ctx_stack.pop_back();
  } else if (t_ctx_stack.empty()) {
    t_ctx_stack.push_back(c);
  } else {
    t_ctx_stack.back() = c;
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxPushCurrent_v2(CUcontext c) {
  std::lock_guard lk(st().mu);
  count_call("cuCtxPushCurrent");
  if (!ctx_live(c)) return CUDA_ERROR_INVALID_CONTEXT;
  t_ctx_stack.push_back(c);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxPopCurrent_v2(CUcontext* c) {
  std::lock_guard lk(st().mu);
  count_call("cuCtxPopCurrent");
  if (t_ctx_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (c) *c = t_ctx_stack.back();
  t_ctx_stack.pop_back();
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxSynchronize() {
  ENTER("cuCtxSynchronize");
  NEED_CONTEXT();
  const CUcontext c = current();
  // A context with a capturing stream cannot be synchronised, in any mode.
  bool capturing = false;
  for_each_stream(c, [&](FakeStream& fs) {
    if (fs.capture) {
      invalidate(fs.capture);
      capturing = true;
    }
  });
  if (capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  UNSAFE_DURING_CAPTURE();
  wait_for_context(c);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  ENTER("cuMemGetInfo");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  const int dev = ctx_device(current());
  *total = st().capacity[dev];
  *free_bytes = st().capacity[dev] - st().used[dev];
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* prop, CUmemAllocationGranularity_flags) {
  ENTER("cuMemGetAllocationGranularity");
  NEED_CONTEXT();
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  *g = kGranularity;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemAddressReserve(CUdeviceptr* p, size_t size, size_t alignment, CUdeviceptr, unsigned long long) {
  ENTER("cuMemAddressReserve");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  if (size == 0 || size % kGranularity) return CUDA_ERROR_INVALID_VALUE;
  const std::size_t align = std::max(alignment, kGranularity);
  void* m = mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const auto base = reinterpret_cast<CUdeviceptr>(m);
  const CUdeviceptr aligned = (base + align - 1) / align * align;
  if (aligned > base) munmap(m, aligned - base);
  if (base + size + align > aligned + size)
    munmap(reinterpret_cast<void*>(aligned + size), base + size + align - aligned - size);
  st().reservations[aligned] = size;
  *p = aligned;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
  ENTER("cuMemAddressFree");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  auto it = st().reservations.find(p);
  if (it == st().reservations.end() || it->second != size || overlaps_mapping(st(), p, size)) return CUDA_ERROR_INVALID_VALUE;
  still_touched(p, size, "cuMemAddressFree");
  munmap(reinterpret_cast<void*>(p), size);
  st().reservations.erase(it);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemCreate(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* prop, unsigned long long) {
  delay("cuMemCreate");
  ENTER("cuMemCreate");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  State& s = st();
  if (!prop || size == 0 || size % kGranularity || prop->location.id < 0 || prop->location.id >= s.devices)
    return CUDA_ERROR_INVALID_VALUE;
  const int dev = prop->location.id;
  // R26: the fabric type only on a device that has CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED.
  if ((prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) && !s.fabric) return CUDA_ERROR_NOT_SUPPORTED;
  if (s.used[dev] + size > s.capacity[dev]) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  s.used[dev] += size;
  s.last_handle_types = static_cast<unsigned>(prop->requestedHandleTypes);
  *h = new_handle(s, {fd, size, dev, 0, false, static_cast<unsigned>(prop->requestedHandleTypes)});
  return CUDA_SUCCESS;
}

// R26: the double's fabric handle names the exporting process, its descriptor of the handle's memfd and that
// file's identity (device, inode) and size; the rest is zero. An importer opens the memfd through
// /proc/<pid>/fd/<fd> (the double's stand-in for the fabric: the exporter's handle must still be there), and
// refuses any handle whose bytes do not name such a file exactly.
namespace {
struct FabricBytes {
  char magic[8];  // "FKCUFAB1"
  std::int32_t pid, fd;
  std::uint64_t dev, ino, size;
  unsigned char zero[64 - 40];
};
static_assert(sizeof(FabricBytes) == sizeof(CUmemFabricHandle));
constexpr char kFabricMagic[8] = {'F', 'K', 'C', 'U', 'F', 'A', 'B', '1'};

CUresult export_fabric(const Handle& h, void* out) {
  if (!st().fabric) return CUDA_ERROR_NOT_SUPPORTED;
  if (!(h.types & CU_MEM_HANDLE_TYPE_FABRIC)) return CUDA_ERROR_INVALID_VALUE;  // R18: not created with the type
  struct stat sb{};
  if (fstat(h.fd, &sb) != 0) return CUDA_ERROR_INVALID_VALUE;
  FabricBytes f{};
  std::memcpy(f.magic, kFabricMagic, sizeof f.magic);
  f.pid = getpid();
  f.fd = h.fd;
  f.dev = sb.st_dev;
  f.ino = sb.st_ino;
  f.size = h.size;
  std::memcpy(out, &f, sizeof f);
  return CUDA_SUCCESS;
}

// A descriptor of the memory a fabric handle names, or -1 when the bytes name none (forged, or gone).
int open_fabric(const void* bytes) {
  FabricBytes f;
  std::memcpy(&f, bytes, sizeof f);
  if (std::memcmp(f.magic, kFabricMagic, sizeof f.magic) != 0 || f.size == 0 || f.size % kGranularity != 0 ||
      std::any_of(std::begin(f.zero), std::end(f.zero), [](unsigned char c) { return c != 0; }))
    return -1;
  char path[64], target[256] = {};
  std::snprintf(path, sizeof path, "/proc/%d/fd/%d", f.pid, f.fd);
  if (readlink(path, target, sizeof target - 1) <= 0 || std::strncmp(target, "/memfd:fakecuda", 15) != 0) return -1;
  const int fd = open(path, O_RDWR | O_CLOEXEC);
  struct stat sb{};
  if (fd < 0 || fstat(fd, &sb) != 0 || sb.st_dev != f.dev || sb.st_ino != f.ino ||
      static_cast<std::uint64_t>(sb.st_size) != f.size) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}
}  // namespace

// R18: only a handle created with the type among its requestedHandleTypes is exported (the fabric type also
// needs the device's CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: CUDA_ERROR_NOT_SUPPORTED otherwise).
FAKE_API CUresult cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType type,
                                               unsigned long long flags) {
  ENTER("cuMemExportToShareableHandle");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  State& s = st();
  auto it = s.handles.find(h);
  if (!out || flags != 0 || it == s.handles.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  if (type == CU_MEM_HANDLE_TYPE_FABRIC) return export_fabric(it->second, out);
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !(it->second.types & type)) return CUDA_ERROR_INVALID_VALUE;
  const int fd = fcntl(it->second.fd, F_DUPFD, 0);  // CUDA does not document close-on-exec: none here
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}

// R19: osHandle is the descriptor itself, which stays the caller's; it must be a descriptor the double
// exported (a memfd of its own). R26: for the fabric type, osHandle points to the CUmemFabricHandle, which must
// name memory the double exported as fabric. The handle's device is the current context's (the importer maps
// it there).
FAKE_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os_handle,
                                                 CUmemAllocationHandleType type) {
  ENTER("cuMemImportFromShareableHandle");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  State& s = st();
  if (h && os_handle && type == CU_MEM_HANDLE_TYPE_FABRIC) {
    if (!s.fabric) return CUDA_ERROR_NOT_PERMITTED;  // no IMEX channel shared with the exporter
    const int own = open_fabric(os_handle);
    if (own < 0) return CUDA_ERROR_INVALID_VALUE;
    struct stat sb{};
    fstat(own, &sb);
    *h = new_handle(s, {own, static_cast<std::size_t>(sb.st_size), ctx_device(current()), 0, false, 0, true});
    return CUDA_SUCCESS;
  }
  if (!h || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  const int fd = static_cast<int>(reinterpret_cast<std::uintptr_t>(os_handle));
  char link[64], target[256] = {};
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, target, sizeof target - 1);
  struct stat sb{};
  if (n <= 0 || std::strncmp(target, "/memfd:fakecuda", 15) != 0 || fstat(fd, &sb) != 0 || sb.st_size <= 0)
    return CUDA_ERROR_INVALID_VALUE;  // not memory the double exported
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *h = new_handle(s, {own, static_cast<std::size_t>(sb.st_size), ctx_device(current()), 0, false, 0, true});
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  ENTER("cuMemRelease");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  State& s = st();
  auto it = s.handles.find(h);
  if (it == s.handles.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  it->second.released = true;  // a mapping keeps the memory until it is unmapped, as in CUDA
  drop_if_unused(s, h);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long) {
  ENTER("cuMemMap");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  State& s = st();
  auto it = s.handles.find(h);
  // R5: one whole, unreleased handle at offset 0 ("currently must be zero"), inside one reservation,
  // over nothing mapped.
  if (it == s.handles.end() || it->second.released || size == 0 || va % kGranularity || offset != 0 ||
      size != it->second.size || !in_reservation(s, va, size) || overlaps_mapping(s, va, size))
    return CUDA_ERROR_INVALID_VALUE;
  void* m = mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED, it->second.fd, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  s.mappings[va] = {size, h, false};
  ++it->second.map_count;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
  ENTER("cuMemUnmap");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  State& s = st();
  if (!whole_mappings(s, va, size)) return CUDA_ERROR_INVALID_VALUE;  // R7
  // The strict reading of "the entire contiguous address range that was mapped to", when asked for.
  if (s.refuse_multi_unmap && s.mappings.find(va)->second.size != size) {
    count_call("cuMemUnmap:refused");
    return CUDA_ERROR_INVALID_VALUE;
  }
  // cuMemUnmap is not stream-ordered: work still running over the range faults.
  still_touched(va, size, "cuMemUnmap");
  mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  std::vector<CUmemGenericAllocationHandle> touched;
  for (auto it = s.mappings.find(va); it != s.mappings.end() && it->first < va + size; ++it) {
    --s.handles[it->second.handle].map_count;
    touched.push_back(it->second.handle);
    s.access_of.erase(it->first);
  }
  s.mappings.erase(s.mappings.find(va), s.mappings.lower_bound(va + size));
  for (auto h : touched) drop_if_unused(s, h);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc* desc, size_t count) {
  ENTER("cuMemSetAccess");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  State& s = st();
  if (!desc || count == 0 || !whole_mappings(s, va, size)) return CUDA_ERROR_INVALID_VALUE;  // R6
  for (std::size_t i = 0; i < count; ++i)
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
        desc[i].location.id >= s.devices)
      return CUDA_ERROR_INVALID_DEVICE;
  for (auto it = s.mappings.find(va); it != s.mappings.end() && it->first < va + size; ++it) {
    it->second.accessible = true;
    for (std::size_t i = 0; i < count; ++i)
      if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) s.access_of[it->first].insert(desc[i].location.id);
  }
  mprotect(reinterpret_cast<void*>(va), size, PROT_READ | PROT_WRITE);
  return CUDA_SUCCESS;
}

namespace {
// A synchronous copy (the legacy stream): the device side must be mapped and accessible to the current device.
CUresult copy(void* dst, const void* src, size_t n, CUdeviceptr device_side, const char* what) {
  if (!accessible(st(), device_side, n, ctx_device(current()))) {
    fault(std::string(what) + " on memory the device may not access");
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  std::memcpy(dst, src, n);
  return CUDA_SUCCESS;
}
}  // namespace

FAKE_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  ENTER("cuMemcpyHtoD");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  return copy(reinterpret_cast<void*>(dst), src, n, dst, "cuMemcpyHtoD");
}

FAKE_API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  ENTER("cuMemcpyDtoH");
  NEED_CONTEXT();
  UNSAFE_DURING_CAPTURE();
  return copy(dst, reinterpret_cast<const void*>(src), n, src, "cuMemcpyDtoH");
}

namespace {
// A new stream's handle: the value of a destroyed stream whose work is done (cuda.h, cuStreamDestroy: its
// resources are released once the work completes, and CUDA may hand the value out again), or the most
// recently destroyed one's at once while reuse_streams_at_once is set; else a new one.
CUstream new_stream_handle() {
  State& s = st();
  if (s.reuse_streams_at_once && !s.destroyed_streams.empty()) {  // the most recently destroyed, work or not
    const CUstream h = s.destroyed_streams.back().first;
    s.destroyed_streams.pop_back();
    return h;
  }
  for (auto it = s.destroyed_streams.begin(); it != s.destroyed_streams.end(); ++it)
    if (node_done(it->second)) {
      const CUstream h = it->first;
      s.destroyed_streams.erase(it);
      return h;
    }
  return reinterpret_cast<CUstream>(s.next_stream++);
}
}  // namespace

FAKE_API CUresult cuStreamCreate(CUstream* out, unsigned) {
  ENTER("cuStreamCreate");
  NEED_CONTEXT();
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = new_stream_handle();
  st().streams[*out] = FakeStream{current(), nullptr};
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuStreamDestroy_v2(CUstream h) {
  ENTER("cuStreamDestroy");
  NEED_CONTEXT();
  auto it = st().streams.find(h);
  if (it == st().streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (it->second.capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  // Queued work still completes (cuStreamDestroy returns at once); the handle value may be reused after.
  stream_destroyed(h, it->second);
  st().streams.erase(it);
  return CUDA_SUCCESS;
}

// The ABI before CUDA 4.0, which libcuda still exports beside cuStreamDestroy_v2 (cuda.h declares it under
// __CUDA_API_VERSION_INTERNAL): the same call.
#undef cuStreamDestroy
FAKE_API CUresult cuStreamDestroy(CUstream h) { return cuStreamDestroy_v2(h); }

FAKE_API CUresult cuStreamGetCtx(CUstream h, CUcontext* out) {
  ENTER("cuStreamGetCtx");
  NEED_CONTEXT();
  FakeStream* fs = stream_of(h);
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  if (!fs) return CUDA_ERROR_INVALID_HANDLE;
  *out = fs->ctx;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxGetDevice(CUdevice* d) {
  ENTER("cuCtxGetDevice");
  NEED_CONTEXT();
  if (!d) return CUDA_ERROR_INVALID_VALUE;
  *d = ctx_device(current());
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventCreate(CUevent* e, unsigned) {
  ENTER("cuEventCreate");
  NEED_CONTEXT();
  *e = reinterpret_cast<CUevent>(st().next_event++);
  st().events[*e] = {current(), nullptr, 0};
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventRecord(CUevent e, CUstream h) {
  ENTER("cuEventRecord");
  NEED_CONTEXT();
  auto it = st().events.find(e);
  FakeStream* fs = stream_of(h);
  if (it == st().events.end() || !fs) return CUDA_ERROR_INVALID_HANDLE;
  if (it->second.ctx != fs->ctx) return CUDA_ERROR_INVALID_HANDLE;  // cuda.h: same context
  if (CUresult r = legacy_use(h, fs); r) return r;
  if (fs->capture) {  // a node of the graph being captured, not work that runs
    it->second.capture = fs->capture;
    it->second.node = nullptr;
    return CUDA_SUCCESS;
  }
  it->second.capture = 0;
  it->second.node = enqueue(*fs, h, 0);
  return CUDA_SUCCESS;
}

namespace {
// Event queries and waits on an event last recorded in a capture fail and invalidate it.
CUresult captured_event(const FakeEvent& ev) {
  if (!ev.capture) return CUDA_SUCCESS;
  invalidate(ev.capture);
  return CUDA_ERROR_CAPTURED_EVENT;
}
}  // namespace

FAKE_API CUresult cuEventQuery(CUevent e) {
  ENTER("cuEventQuery");
  NEED_CONTEXT();
  auto it = st().events.find(e);
  if (it == st().events.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (CUresult r = captured_event(it->second); r) return r;
  UNSAFE_DURING_CAPTURE();
  return node_done(it->second.node) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FAKE_API CUresult cuEventSynchronize(CUevent e) {
  ENTER("cuEventSynchronize");
  NEED_CONTEXT();
  auto it = st().events.find(e);
  if (it == st().events.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (CUresult r = captured_event(it->second); r) return r;
  UNSAFE_DURING_CAPTURE();
  wait_for(it->second.node);  // the host waits until the work before the event is done
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventDestroy_v2(CUevent e) {
  ENTER("cuEventDestroy");
  NEED_CONTEXT();
  auto it = st().events.find(e);
  if (it == st().events.end()) return CUDA_ERROR_INVALID_HANDLE;
  // cuda.h lists CUDA_ERROR_INVALID_CONTEXT and does not say whose context must be current: the stricter
  // reading (driver.h, R12) is the event's own.
  if (it->second.ctx != current()) return CUDA_ERROR_INVALID_CONTEXT;
  st().events.erase(it);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuStreamSynchronize(CUstream h) {
  ENTER("cuStreamSynchronize");
  NEED_CONTEXT();
  FakeStream* fs = stream_of(h);
  if (!fs) return CUDA_ERROR_INVALID_HANDLE;
  if (fs->capture) {
    invalidate(fs->capture);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  if (CUresult r = legacy_use(h, fs); r) return r;
  UNSAFE_DURING_CAPTURE();
  fs->held = false;
  resolve();
  wait_for(fs->tail);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuStreamWaitEvent(CUstream h, CUevent e, unsigned flags) {
  ENTER("cuStreamWaitEvent");
  NEED_CONTEXT();
  auto it = st().events.find(e);
  FakeStream* fs = stream_of(h);
  if (it == st().events.end() || !fs) return CUDA_ERROR_INVALID_HANDLE;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  // The event may be of another context or device (cuda.h). Joining a capture's event from outside it is
  // not allowed; a capturing stream waiting on uncaptured work takes it as an external dependency.
  if (it->second.capture && it->second.capture != fs->capture) {
    invalidate(it->second.capture);
    return CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
  }
  if (fs->capture) return CUDA_SUCCESS;
  if (CUresult r = legacy_use(h, fs); r) return r;
  if (it->second.node && !node_done(it->second.node)) enqueue(*fs, h, 0, {it->second.node});
  return CUDA_SUCCESS;
}

namespace {
// A capture begins on h: the work of every begin entry point (called by name from inside the library, an
// entry point would reach an interposer of that name instead).
CUresult begin_capture(const char* entry, CUstream h, CUstreamCaptureMode mode) {
  ENTER(entry);
  NEED_CONTEXT();
  if (h == nullptr || h == CU_STREAM_LEGACY) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;  // never the legacy stream
  FakeStream* fs = stream_of(h);
  if (!fs) return CUDA_ERROR_INVALID_HANDLE;
  if (fs->capture) return CUDA_ERROR_ILLEGAL_STATE;
  const unsigned long long id = st().next_capture++;
  st().captures[id] = Capture{h, mode, std::this_thread::get_id()};
  fs->capture = id;
  return CUDA_SUCCESS;
}
}  // namespace

FAKE_API CUresult cuStreamBeginCapture_v2(CUstream h, CUstreamCaptureMode mode) {
  return begin_capture("cuStreamBeginCapture", h, mode);
}

// CUDA 12.3's capture into an existing graph: captured as cuStreamBeginCapture captures (the graph it adds to
// and the dependencies are not modelled).
#if CUDA_VERSION >= 12030
FAKE_API CUresult cuStreamBeginCaptureToGraph(CUstream h, CUgraph, const CUgraphNode*, const CUgraphEdgeData*, size_t,
                                              CUstreamCaptureMode mode) {
#else
FAKE_API CUresult cuStreamBeginCaptureToGraph(CUstream h, CUgraph, const void*, const void*, size_t,
                                              CUstreamCaptureMode mode) {
#endif
  return begin_capture("cuStreamBeginCaptureToGraph", h, mode);
}

FAKE_API CUresult cuStreamEndCapture(CUstream h, CUgraph* graph) {
  ENTER("cuStreamEndCapture");
  NEED_CONTEXT();
  FakeStream* fs = stream_of(h);
  if (!fs || !graph) return CUDA_ERROR_INVALID_VALUE;
  auto it = st().captures.find(fs->capture);
  if (it == st().captures.end() || it->second.origin != h) return CUDA_ERROR_ILLEGAL_STATE;
  if (it->second.mode != CU_STREAM_CAPTURE_MODE_RELAXED && it->second.thread != std::this_thread::get_id())
    return CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
  const bool bad = it->second.invalidated;
  const unsigned long long id = it->first;
  st().captures.erase(it);
  for_each_stream(fs->ctx, [&](FakeStream& other) {
    if (other.capture == id) other.capture = 0;
  });
  for (auto& [eh, ev] : st().events)
    if (ev.capture == id) ev.capture = 0;
  *graph = bad ? nullptr : reinterpret_cast<CUgraph>(st().next_graph++);
  return bad ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
}

FAKE_API CUresult cuStreamIsCapturing(CUstream h, CUstreamCaptureStatus* status) {
  ENTER("cuStreamIsCapturing");
  NEED_CONTEXT();
  FakeStream* fs = stream_of(h);
  if (!fs || !status) return CUDA_ERROR_INVALID_VALUE;
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (auto it = st().captures.find(fs->capture); it != st().captures.end())
    *status = it->second.invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED : CU_STREAM_CAPTURE_STATUS_ACTIVE;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuStreamGetCaptureInfo_v3(CUstream h, CUstreamCaptureStatus* status, cuuint64_t* id, CUgraph* graph,
                                            const CUgraphNode** deps, const CUgraphEdgeData** edges, size_t* ndeps) {
  if (CUresult r = cuStreamIsCapturing(h, status); r) return r;
  std::lock_guard lk(st().mu);
  FakeStream* fs = stream_of(h);
  if (id) *id = fs && fs->capture ? fs->capture : 0;
  if (graph) *graph = nullptr;
  if (deps) *deps = nullptr;
  if (edges) *edges = nullptr;
  if (ndeps) *ndeps = 0;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  if (!mode) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lk(st().mu);
  count_call("cuThreadExchangeStreamCaptureMode");
  std::swap(*mode, t_capture_mode);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDriverGetVersion(int* v) {
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lk(st().mu);
  *v = st().driver_version;
  return CUDA_SUCCESS;
}

FAKE_API void fakecuda_set_driver_version(int v) {
  std::lock_guard lk(st().mu);
  st().driver_version = v;
}

FAKE_API void fakecuda_set_fabric(int supported) {
  std::lock_guard lk(st().mu);
  st().fabric = supported != 0;
}

FAKE_API unsigned fakecuda_last_handle_types() {
  std::lock_guard lk(st().mu);
  return st().last_handle_types;
}

// ---- The driver's own allocator: cuMemAlloc, cuMemAllocPitch, the stream-ordered allocator, pools ----------
// Each allocation is one reservation, handle and mapping of its own, accessible to its device (as the VMM
// calls leave it after cuMemSetAccess), so work may be launched on it and the census counts it. cuda.h's
// strict readings: cuMemAlloc of 0 bytes is CUDA_ERROR_INVALID_VALUE; cuMemFree takes only an address an
// allocation call returned (the start, not an address inside); cuMemAllocPitch takes element sizes 4, 8 and
// 16 only and pads the pitch to the device's texture pitch alignment; cuMemFree of memory from the
// stream-ordered allocator does not synchronise ("callers must ensure that all accesses ... have completed":
// work still on it is a fault), of other memory it synchronises the context (it "may perform implicit
// synchronization"). cuMemFreeAsync frees once the work queued on its stream before it is done (the double
// waits for it: stricter orderings between streams are the allocator under test's business, not the
// driver's own memory's). A pool's memory comes from its own location's device.
namespace {

constexpr int kTexturePitchAlignment = 512;  // CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT of the double
constexpr int kMaxPitch = 1 << 21;           // CU_DEVICE_ATTRIBUTE_MAX_PITCH of the double

// Allocates `size` bytes on `dev` (caller holds the lock).
CUresult own_alloc(State& s, std::size_t size, int dev, CUmemoryPool pool, bool async, CUdeviceptr* out) {
  const std::size_t mapped = (size + kGranularity - 1) / kGranularity * kGranularity;
  if (s.used[dev] + mapped > s.capacity[dev]) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = memfd_create("fakecuda-own", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
    if (fd >= 0) close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const auto va = reinterpret_cast<CUdeviceptr>(m);
  s.used[dev] += mapped;
  const CUmemGenericAllocationHandle h = new_handle(s, {fd, mapped, dev, 1, true});  // released at once: the mapping keeps it, as cuMemFree's unmap ends it
  s.reservations[va] = mapped;
  s.mappings[va] = {mapped, h, true};
  s.access_of[va].insert(dev);
  s.own[va] = {size, mapped, dev, s.next_buffer_id++, pool, async};
  *out = va;
  return CUDA_SUCCESS;
}

// Frees an allocation of the double's own (caller holds the lock): unmapped at once.
void own_release(State& s, std::map<CUdeviceptr, OwnAllocation>::iterator it) {
  const CUdeviceptr va = it->first;
  const std::size_t mapped = it->second.mapped;
  if (it->second.pool) {
    auto p = s.pools.find(it->second.pool);
    if (p != s.pools.end()) p->second.used -= it->second.size;
  }
  still_touched(va, mapped, "cuMemFree");
  const CUmemGenericAllocationHandle h = s.mappings[va].handle;
  munmap(reinterpret_cast<void*>(va), mapped);
  s.mappings.erase(va);
  s.access_of.erase(va);
  s.reservations.erase(va);
  --s.handles[h].map_count;
  drop_if_unused(s, h);
  s.own.erase(it);
}

// The own allocation holding va (any byte of it), or end().
std::map<CUdeviceptr, OwnAllocation>::iterator own_containing(State& s, CUdeviceptr va) {
  auto it = s.own.upper_bound(va);
  if (it == s.own.begin()) return s.own.end();
  --it;
  return va < it->first + it->second.size ? it : s.own.end();
}

CUmemoryPool default_pool(State& s, int dev);

// cuda.h, cuMemAllocAsync: "allocates from the current mempool of the provided stream's device" (its default
// pool until cuDeviceSetMemPool or cuMemSetMemPool); cuMemAllocFromPoolAsync from `pool`.
CUresult alloc_async(CUdeviceptr* p, size_t size, CUmemoryPool pool, CUstream h) {
  NEED_CONTEXT();
  State& s = st();
  FakeStream* fs = stream_of(h);
  if (!p || size == 0 || !fs) return CUDA_ERROR_INVALID_VALUE;
  int dev = ctx_device(fs->ctx);
  if (!pool) {
    auto c = s.current_pools.find(dev);
    pool = c != s.current_pools.end() ? c->second : default_pool(s, dev);
  }
  {
    auto it = s.pools.find(pool);
    if (it == s.pools.end()) return CUDA_ERROR_INVALID_VALUE;
    dev = it->second.props.location.id;
    if (it->second.props.maxSize && it->second.used + size > it->second.props.maxSize) return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUresult r = own_alloc(s, size, dev, pool, true, p);
  if (r == CUDA_SUCCESS) {
    s.own[*p].graph = fs->capture != 0;
    MemPool& m = s.pools[pool];
    m.used += size;
    m.used_high = std::max(m.used_high, m.used);
    m.reserved_high = std::max(m.reserved_high, m.used);
  }
  return r;
}

CUresult free_async(CUdeviceptr p, CUstream h) {
  NEED_CONTEXT();
  State& s = st();
  FakeStream* fs = stream_of(h);
  auto it = s.own.find(p);
  if (!fs || it == s.own.end()) return CUDA_ERROR_INVALID_VALUE;
  // cuda.h: "During stream capture, this function results in the creation of a free node and must therefore be
  // passed the address of a graph allocation" (driver.h R21); the stricter reading: anything else is refused.
  if (fs->capture && !it->second.graph) return CUDA_ERROR_INVALID_VALUE;
  if (!fs->capture) wait_for(fs->tail);
  own_release(s, it);
  return CUDA_SUCCESS;
}

CUstream per_thread_if_null(CUstream h) { return h ? h : CU_STREAM_PER_THREAD; }

CUmemoryPool default_pool(State& s, int dev) {
  for (auto& [h, pool] : s.pools)
    if (pool.is_default && pool.props.location.id == dev) return h;
  const auto h = reinterpret_cast<CUmemoryPool>(s.next_pool++);
  MemPool& pool = s.pools[h];
  pool.is_default = true;
  pool.props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  pool.props.location = {CU_MEM_LOCATION_TYPE_DEVICE, dev};
  return h;
}

}  // namespace

FAKE_API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t size) {
  ENTER("cuMemAlloc");
  NEED_CONTEXT();
  if (!p || size == 0) return CUDA_ERROR_INVALID_VALUE;
  return own_alloc(st(), size, ctx_device(current()), nullptr, false, p);
}

FAKE_API CUresult cuMemAllocPitch_v2(CUdeviceptr* p, size_t* pitch, size_t width, size_t height, unsigned element) {
  ENTER("cuMemAllocPitch");
  NEED_CONTEXT();
  if (!p || !pitch || width == 0 || height == 0 || (element != 4 && element != 8 && element != 16))
    return CUDA_ERROR_INVALID_VALUE;
  const std::size_t rounded = (width + kTexturePitchAlignment - 1) / kTexturePitchAlignment * kTexturePitchAlignment;
  if (rounded > static_cast<std::size_t>(kMaxPitch)) return CUDA_ERROR_INVALID_VALUE;
  const CUresult r = own_alloc(st(), rounded * height, ctx_device(current()), nullptr, false, p);
  if (r == CUDA_SUCCESS) *pitch = rounded;
  return r;
}

FAKE_API CUresult cuMemFree_v2(CUdeviceptr p) {
  ENTER("cuMemFree");
  NEED_CONTEXT();
  State& s = st();
  auto it = s.own.find(p);
  if (it == s.own.end()) return CUDA_ERROR_INVALID_VALUE;  // not an address an allocation call returned
  if (!it->second.async) {  // implicit synchronisation: the context's work is waited for
    wait_for_context(current());
  }
  own_release(s, it);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  ENTER("cuMemGetAddressRange");
  NEED_CONTEXT();
  auto it = own_containing(st(), p);
  // cuda.h answers for "the allocation by cuMemAlloc() or cuMemAllocPitch()" (the strict reading: the
  // driver's own allocations only, not memory mapped with cuMemMap).
  if (it == st().own.end()) return CUDA_ERROR_NOT_FOUND;
  if (base) *base = it->first;
  if (size) *size = it->second.size;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t size, CUstream h) {
  ENTER("cuMemAllocAsync");
  return alloc_async(p, size, nullptr, h);
}
FAKE_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr* p, size_t size, CUstream h) {
  ENTER("cuMemAllocAsync");
  return alloc_async(p, size, nullptr, per_thread_if_null(h));
}
FAKE_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr* p, size_t size, CUmemoryPool pool, CUstream h) {
  ENTER("cuMemAllocFromPoolAsync");
  if (!pool) return CUDA_ERROR_INVALID_VALUE;
  return alloc_async(p, size, pool, h);
}
FAKE_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* p, size_t size, CUmemoryPool pool, CUstream h) {
  ENTER("cuMemAllocFromPoolAsync");
  if (!pool) return CUDA_ERROR_INVALID_VALUE;
  return alloc_async(p, size, pool, per_thread_if_null(h));
}
FAKE_API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream h) {
  ENTER("cuMemFreeAsync");
  return free_async(p, h);
}
FAKE_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream h) {
  ENTER("cuMemFreeAsync");
  return free_async(p, per_thread_if_null(h));
}

// cuda.h, CUmemPoolProps: allocType "currently must be" pinned; the location a device here; the Windows
// security attributes "required to be zero" elsewhere; the reserved bytes "must be 0".
FAKE_API CUresult cuMemPoolCreate(CUmemoryPool* pool, const CUmemPoolProps* props) {
  ENTER("cuMemPoolCreate");
  State& s = st();
  if (!pool || !props || props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
      props->location.type != CU_MEM_LOCATION_TYPE_DEVICE || props->location.id < 0 || props->location.id >= s.devices ||
      props->win32SecurityAttributes ||
      std::any_of(std::begin(props->reserved), std::end(props->reserved), [](unsigned char c) { return c != 0; }))
    return CUDA_ERROR_INVALID_VALUE;
  const auto h = reinterpret_cast<CUmemoryPool>(s.next_pool++);
  s.pools[h].props = *props;
  *pool = h;
  return CUDA_SUCCESS;
}

// cuda.h: "A device's default memory pool cannot be destroyed"; a pool with allocations outstanding goes
// once they are freed (its handle is unusable at once).
FAKE_API CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  ENTER("cuMemPoolDestroy");
  State& s = st();
  auto it = s.pools.find(pool);
  if (it == s.pools.end() || it->second.is_default) return CUDA_ERROR_INVALID_VALUE;
  s.pools.erase(it);
  for (auto c = s.current_pools.begin(); c != s.current_pools.end();)  // the device's default pool is current again
    c = c->second == pool ? s.current_pools.erase(c) : std::next(c);
  for (auto& [va, o] : s.own)
    if (o.pool == pool) o.pool = nullptr;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool, CUdevice dev) {
  ENTER("cuDeviceGetDefaultMemPool");
  if (!pool) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  *pool = default_pool(st(), dev);
  return CUDA_SUCCESS;
}

// cuda.h, cuDeviceSetMemPool: "The memory pool must be local to the specified device"; cuDeviceGetMemPool:
// "the last pool provided to cuDeviceSetMemPool for this device or the device's default memory pool".
// cuMemSetMemPool / cuMemGetMemPool (CUDA 13) do the same for a location and allocation type: the double has
// device memory only (a host location or another type is CUDA_ERROR_NOT_SUPPORTED here).
namespace {
CUresult set_current_pool(int dev, CUmemoryPool pool) {
  State& s = st();
  auto it = s.pools.find(pool);
  if (dev < 0 || dev >= s.devices) return CUDA_ERROR_INVALID_DEVICE;
  if (it == s.pools.end() || it->second.props.location.id != dev) return CUDA_ERROR_INVALID_VALUE;
  s.current_pools[dev] = pool;
  return CUDA_SUCCESS;
}
CUresult get_current_pool(CUmemoryPool* pool, int dev) {
  State& s = st();
  if (!pool) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= s.devices) return CUDA_ERROR_INVALID_DEVICE;
  auto c = s.current_pools.find(dev);
  *pool = c != s.current_pools.end() ? c->second : default_pool(s, dev);
  return CUDA_SUCCESS;
}
CUresult device_location(const CUmemLocation* location, CUmemAllocationType type) {
  if (!location) return CUDA_ERROR_INVALID_VALUE;
  return location->type == CU_MEM_LOCATION_TYPE_DEVICE && type == CU_MEM_ALLOCATION_TYPE_PINNED ? CUDA_SUCCESS
                                                                                                 : CUDA_ERROR_NOT_SUPPORTED;
}
}  // namespace

FAKE_API CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
  ENTER("cuDeviceSetMemPool");
  return set_current_pool(dev, pool);
}

FAKE_API CUresult cuDeviceGetMemPool(CUmemoryPool* pool, CUdevice dev) {
  ENTER("cuDeviceGetMemPool");
  return get_current_pool(pool, dev);
}

FAKE_API CUresult cuMemSetMemPool(CUmemLocation* location, CUmemAllocationType type, CUmemoryPool pool) {
  ENTER("cuMemSetMemPool");
  if (CUresult r = device_location(location, type)) return r;
  return set_current_pool(location->id, pool);
}

FAKE_API CUresult cuMemGetMemPool(CUmemoryPool* pool, CUmemLocation* location, CUmemAllocationType type) {
  ENTER("cuMemGetMemPool");
  if (CUresult r = device_location(location, type)) return r;
  return get_current_pool(pool, location->id);
}

FAKE_API CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc* map, size_t count) {
  ENTER("cuMemPoolSetAccess");
  State& s = st();
  auto it = s.pools.find(pool);
  if (it == s.pools.end() || (count && !map)) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; ++i)
    if (map[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || map[i].location.id < 0 || map[i].location.id >= s.devices)
      return CUDA_ERROR_INVALID_DEVICE;
  for (size_t i = 0; i < count; ++i) it->second.access[map[i].location.id] = map[i].flags;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemPoolGetAccess(CUmemAccess_flags* flags, CUmemoryPool pool, CUmemLocation* location) {
  ENTER("cuMemPoolGetAccess");
  auto it = st().pools.find(pool);
  if (!flags || !location || it == st().pools.end() || location->type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  auto a = it->second.access.find(location->id);
  *flags = location->id == it->second.props.location.id ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
           : a == it->second.access.end()               ? CU_MEM_ACCESS_FLAGS_PROT_NONE
                                                        : a->second;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  ENTER("cuMemPoolSetAttribute");
  auto it = st().pools.find(pool);
  if (it == st().pools.end() || !value) return CUDA_ERROR_INVALID_VALUE;
  MemPool& p = it->second;
  switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: p.follow_events = *static_cast<int*>(value); break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: p.opportunistic = *static_cast<int*>(value); break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: p.internal_dependencies = *static_cast<int*>(value); break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: p.release_threshold = *static_cast<cuuint64_t*>(value); break;
    // cuda.h: a high watermark "can only be reset to zero" (the RESERVED one: "It is illegal to set this
    // attribute to a non-zero value"); after the reset it tracks the pool from its current use.
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
      if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;
      (attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH ? p.used_high : p.reserved_high) = p.used;
      break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  ENTER("cuMemPoolGetAttribute");
  auto it = st().pools.find(pool);
  if (it == st().pools.end() || !value) return CUDA_ERROR_INVALID_VALUE;
  MemPool& p = it->second;
  switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: *static_cast<int*>(value) = p.follow_events; break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: *static_cast<int*>(value) = p.opportunistic; break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *static_cast<int*>(value) = p.internal_dependencies; break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *static_cast<cuuint64_t*>(value) = p.release_threshold; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *static_cast<cuuint64_t*>(value) = p.used; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *static_cast<cuuint64_t*>(value) = p.used_high; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *static_cast<cuuint64_t*>(value) = p.reserved_high; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

// Pointer attributes (cuda.h, cuPointerGetAttribute). For the double's own allocations: the allocation; for
// memory mapped with cuMemMap: the range attributes are "the mappable address range ptr references (e.g.
// from cuMemAddressReserve)", the context is the current one's when its device has access (the strict
// reading: a VMM mapping belongs to no context), no buffer id. Anything else: CUDA_ERROR_INVALID_VALUE.
namespace {
CUresult pointer_attribute(State& s, void* data, CUpointer_attribute attr, CUdeviceptr p) {
  auto o = own_containing(s, p);
  CUdeviceptr start = 0;
  std::size_t size = 0;
  int dev = -1;
  if (o != s.own.end()) {
    start = o->first;
    size = o->second.size;
    dev = o->second.device;
  } else {
    auto r = s.reservations.upper_bound(p);
    if (r == s.reservations.begin()) return CUDA_ERROR_INVALID_VALUE;
    --r;
    if (p >= r->first + r->second) return CUDA_ERROR_INVALID_VALUE;
    auto m = s.mappings.upper_bound(p);
    if (m == s.mappings.begin() || p >= std::prev(m)->first + std::prev(m)->second.size) {
      if (attr == CU_POINTER_ATTRIBUTE_MAPPED) {
        *static_cast<int*>(data) = 0;
        return CUDA_SUCCESS;
      }
      return CUDA_ERROR_INVALID_VALUE;
    }
    start = r->first;
    size = r->second;
    dev = s.handles.count(std::prev(m)->second.handle) ? s.handles[std::prev(m)->second.handle].device : -1;
  }
  switch (attr) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *static_cast<unsigned*>(data) = CU_MEMORYTYPE_DEVICE; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int*>(data) = dev; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *static_cast<CUdeviceptr*>(data) = p; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *static_cast<CUdeviceptr*>(data) = start; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *static_cast<size_t*>(data) = size; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED: *static_cast<int*>(data) = 1; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *static_cast<int*>(data) = 0; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_CONTEXT:
      *static_cast<CUcontext*>(data) = o != s.own.end() ? primary_ctx(dev) : nullptr;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
      if (o == s.own.end()) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<unsigned long long*>(data) = o->second.buffer_id;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
      *static_cast<CUmemoryPool*>(data) = o != s.own.end() ? o->second.pool : nullptr;
      return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}
}  // namespace

FAKE_API CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attr, CUdeviceptr p) {
  ENTER("cuPointerGetAttribute");
  NEED_CONTEXT();
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  return pointer_attribute(st(), data, attr, p);
}

// cuda.h: unlike cuPointerGetAttribute, an invalid pointer is no error: every attribute gets its default
// (null, zero) and the call succeeds.
FAKE_API CUresult cuPointerGetAttributes(unsigned n, CUpointer_attribute* attrs, void** data, CUdeviceptr p) {
  ENTER("cuPointerGetAttributes");
  NEED_CONTEXT();
  if (!attrs || !data) return CUDA_ERROR_INVALID_VALUE;
  for (unsigned i = 0; i < n; ++i) {
    if (!data[i]) continue;
    if (pointer_attribute(st(), data[i], attrs[i], p) != CUDA_SUCCESS) {
      const std::size_t width = attrs[i] == CU_POINTER_ATTRIBUTE_MEMORY_TYPE || attrs[i] == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL ||
                                        attrs[i] == CU_POINTER_ATTRIBUTE_MAPPED || attrs[i] == CU_POINTER_ATTRIBUTE_IS_MANAGED
                                    ? 4
                                    : 8;
      std::memset(data[i], 0, width);
    }
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream h, CUstreamCaptureMode mode) {
  return cuStreamBeginCapture_v2(per_thread_if_null(h), mode);
}
FAKE_API CUresult cuStreamEndCapture_ptsz(CUstream h, CUgraph* graph) { return cuStreamEndCapture(per_thread_if_null(h), graph); }
FAKE_API CUresult cuStreamIsCapturing_ptsz(CUstream h, CUstreamCaptureStatus* status) {
  return cuStreamIsCapturing(per_thread_if_null(h), status);
}

#undef cuGetProcAddress  // cuda.h maps the name to the _v2 entry point; the double exports both ABIs
namespace {
// cuGetProcAddress's table: a base name, the CUDA version its ABI here dates from (an older one asked for is
// CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: the double has no older ABI), and the entry points for legacy
// and per-thread default-stream semantics (CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM; DEFAULT is the
// legacy one at the ABI, cuda.h's inline wrapper adding the flag for code built for per-thread streams).
struct ProcEntry {
  int since;
  void* legacy;
  void* ptsz;
  void* before = nullptr;  // the older ABI's entry point, for a version below `since`
};
template <typename F>
ProcEntry any(F f) {
  return {0, reinterpret_cast<void*>(f), reinterpret_cast<void*>(f)};
}
template <typename F, typename G>
ProcEntry since(int v, F legacy, G ptsz) {
  return {v, reinterpret_cast<void*>(legacy), reinterpret_cast<void*>(ptsz)};
}
CUresult get_proc(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags, CUdriverProcAddressQueryResult* status);
}  // namespace

FAKE_API CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags) {
  return get_proc(symbol, pfn, cuda_version, flags, nullptr);
}
FAKE_API CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                                      CUdriverProcAddressQueryResult* status) {
  return get_proc(symbol, pfn, cuda_version, flags, status);
}

namespace {
// R10: a version newer than the driver's own is refused.
CUresult get_proc(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags, CUdriverProcAddressQueryResult* status) {
  {
    std::lock_guard lk(st().mu);
    count_call("cuGetProcAddress");
    if (cuda_version > st().driver_version) {
      if (pfn) *pfn = nullptr;
      if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      return CUDA_ERROR_NOT_FOUND;
    }
  }
  if (flags & ~static_cast<cuuint64_t>(CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
    return CUDA_ERROR_INVALID_VALUE;
  if (symbol) {  // counted by the flags asked with (0 is the legacy stream at the ABI: R20); not the table's making
    std::lock_guard lk(st().mu);
    count_call(flags == CU_GET_PROC_ADDRESS_LEGACY_STREAM                  ? "cuGetProcAddress:legacy"
               : flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM ? "cuGetProcAddress:per-thread"
               : flags == 0                                             ? "cuGetProcAddress:default"
                                                                        : "cuGetProcAddress:both");
  }
  static const std::unordered_map<std::string, ProcEntry> table = {
      {"cuInit", any(&cuInit)},
      {"cuGetErrorName", any(&cuGetErrorName)},
      {"cuGetErrorString", any(&cuGetErrorString)},
      {"cuDriverGetVersion", any(&cuDriverGetVersion)},
      {"cuGetProcAddress", since(12000, &cuGetProcAddress_v2, &cuGetProcAddress_v2)},
      {"cuDeviceGetCount", any(&cuDeviceGetCount)},
      {"cuDeviceGet", any(&cuDeviceGet)},
      {"cuDeviceGetAttribute", any(&cuDeviceGetAttribute)},
      {"cuDeviceTotalMem", any(&cuDeviceTotalMem_v2)},
      {"cuDeviceCanAccessPeer", any(&cuDeviceCanAccessPeer)},
      {"cuDevicePrimaryCtxRetain", any(&cuDevicePrimaryCtxRetain)},
      {"cuDevicePrimaryCtxRelease", any(&cuDevicePrimaryCtxRelease_v2)},
      {"cuDevicePrimaryCtxGetState", any(&cuDevicePrimaryCtxGetState)},
      {"cuCtxGetCurrent", any(&cuCtxGetCurrent)},
      {"cuCtxSetCurrent", any(&cuCtxSetCurrent)},
      {"cuCtxPushCurrent", any(&cuCtxPushCurrent_v2)},
      {"cuCtxPopCurrent", any(&cuCtxPopCurrent_v2)},
      {"cuCtxSynchronize", any(&cuCtxSynchronize)},
      {"cuMemGetInfo", any(&cuMemGetInfo_v2)},
      {"cuMemGetAllocationGranularity", any(&cuMemGetAllocationGranularity)},
      {"cuMemAddressReserve", any(&cuMemAddressReserve)},
      {"cuMemAddressFree", any(&cuMemAddressFree)},
      {"cuMemCreate", any(&cuMemCreate)},
      {"cuMemRelease", any(&cuMemRelease)},
      {"cuMemExportToShareableHandle", any(&cuMemExportToShareableHandle)},
      {"cuMemImportFromShareableHandle", any(&cuMemImportFromShareableHandle)},
      {"cuMemMap", any(&cuMemMap)},
      {"cuMemUnmap", any(&cuMemUnmap)},
      {"cuMemSetAccess", any(&cuMemSetAccess)},
      {"cuMemAlloc", since(3020, &cuMemAlloc_v2, &cuMemAlloc_v2)},
      {"cuMemAllocPitch", since(3020, &cuMemAllocPitch_v2, &cuMemAllocPitch_v2)},
      {"cuMemFree", since(3020, &cuMemFree_v2, &cuMemFree_v2)},
      {"cuMemGetAddressRange", since(3020, &cuMemGetAddressRange_v2, &cuMemGetAddressRange_v2)},
      {"cuPointerGetAttribute", any(&cuPointerGetAttribute)},
      {"cuPointerGetAttributes", any(&cuPointerGetAttributes)},
      {"cuMemAllocAsync", since(11020, &cuMemAllocAsync, &cuMemAllocAsync_ptsz)},
      {"cuMemAllocFromPoolAsync", since(11020, &cuMemAllocFromPoolAsync, &cuMemAllocFromPoolAsync_ptsz)},
      {"cuMemFreeAsync", since(11020, &cuMemFreeAsync, &cuMemFreeAsync_ptsz)},
      {"cuMemPoolCreate", since(11020, &cuMemPoolCreate, &cuMemPoolCreate)},
      {"cuMemPoolDestroy", since(11020, &cuMemPoolDestroy, &cuMemPoolDestroy)},
      {"cuDeviceGetDefaultMemPool", since(11020, &cuDeviceGetDefaultMemPool, &cuDeviceGetDefaultMemPool)},
      {"cuMemPoolSetAccess", since(11020, &cuMemPoolSetAccess, &cuMemPoolSetAccess)},
      {"cuMemPoolGetAccess", since(11020, &cuMemPoolGetAccess, &cuMemPoolGetAccess)},
      {"cuMemPoolSetAttribute", since(11020, &cuMemPoolSetAttribute, &cuMemPoolSetAttribute)},
      {"cuMemPoolGetAttribute", since(11020, &cuMemPoolGetAttribute, &cuMemPoolGetAttribute)},
      {"cuDeviceSetMemPool", since(11020, &cuDeviceSetMemPool, &cuDeviceSetMemPool)},
      {"cuDeviceGetMemPool", since(11020, &cuDeviceGetMemPool, &cuDeviceGetMemPool)},
      {"cuMemSetMemPool", since(13000, &cuMemSetMemPool, &cuMemSetMemPool)},
      {"cuMemGetMemPool", since(13000, &cuMemGetMemPool, &cuMemGetMemPool)},
      {"cuStreamCreate", any(&cuStreamCreate)},
      {"cuStreamGetCtx", any(&cuStreamGetCtx)},
      {"cuCtxGetDevice", any(&cuCtxGetDevice)},
      {"cuStreamDestroy", {4000, reinterpret_cast<void*>(&cuStreamDestroy_v2), reinterpret_cast<void*>(&cuStreamDestroy_v2),
                           reinterpret_cast<void*>(&cuStreamDestroy)}},
      {"cuEventCreate", any(&cuEventCreate)},
      {"cuEventRecord", any(&cuEventRecord)},
      {"cuEventQuery", any(&cuEventQuery)},
      {"cuEventSynchronize", any(&cuEventSynchronize)},
      {"cuEventDestroy", any(&cuEventDestroy_v2)},
      {"cuStreamSynchronize", any(&cuStreamSynchronize)},
      {"cuStreamWaitEvent", any(&cuStreamWaitEvent)},
      {"cuStreamBeginCapture", since(10010, &cuStreamBeginCapture_v2, &cuStreamBeginCapture_v2_ptsz)},
      {"cuStreamBeginCaptureToGraph", any(&cuStreamBeginCaptureToGraph)},
      {"cuStreamEndCapture", since(10000, &cuStreamEndCapture, &cuStreamEndCapture_ptsz)},
      {"cuStreamIsCapturing", since(10000, &cuStreamIsCapturing, &cuStreamIsCapturing_ptsz)},
      {"cuStreamGetCaptureInfo", any(&cuStreamGetCaptureInfo_v3)},
      {"cuThreadExchangeStreamCaptureMode", any(&cuThreadExchangeStreamCaptureMode)},
  };
  auto it = table.find(symbol ? symbol : "");
  if (it != table.end() && cuda_version < it->second.since && it->second.before) {
    if (!pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = it->second.before;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
  }
  if (it == table.end() || cuda_version < it->second.since) {
    if (pfn) *pfn = nullptr;
    if (status)
      *status = it == table.end() ? CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND : CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    return CUDA_ERROR_NOT_FOUND;
  }
  if (!pfn) return CUDA_ERROR_INVALID_VALUE;
  *pfn = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM ? it->second.ptsz : it->second.legacy;
  if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}

// get_proc's table is made when the double loads: a function's static whose first making a fork interrupted
// (another thread was loading the driver) leaves the child waiting for ever on its guard.
__attribute__((constructor)) void make_the_proc_table_at_load() { get_proc(nullptr, nullptr, 0, 0, nullptr); }
}  // namespace

// ---- Controls for tests ----------------------------------------------------------------------------------

FAKE_API void fakecuda_fail(const char* fn, int nth, int error) {
  std::lock_guard lk(st().mu);
  if (nth <= 0) st().faults.erase(fn);
  else st().faults[fn] = {nth, static_cast<CUresult>(error)};
}

FAKE_API void fakecuda_reset_failures() {
  std::lock_guard lk(st().mu);
  st().faults.clear();
}

FAKE_API unsigned long fakecuda_injected_failures() {
  std::lock_guard lk(st().mu);
  return st().injected_failures;
}

FAKE_API void fakecuda_set_delay(const char* fn, unsigned microseconds) {
  std::lock_guard lk(st().mu);
  st().delays_us[fn] = microseconds;
}

FAKE_API unsigned long fakecuda_calls(const char* fn) {
  std::lock_guard lk(st().mu);
  auto it = st().calls.find(fn);
  return it == st().calls.end() ? 0 : it->second;
}

FAKE_API void fakecuda_get_census(fakecuda_census* out) {
  std::lock_guard lk(st().mu);
  out->handles = static_cast<long>(st().handles.size());
  out->mappings = static_cast<long>(st().mappings.size());
  out->reservations = static_cast<long>(st().reservations.size());
  out->events = static_cast<long>(st().events.size());
  out->used_bytes = 0;
  for (auto& [d, u] : st().used) out->used_bytes += u;
  out->faults = st().fault_count;
  out->invalidated_captures = st().invalidated_captures;
  out->context_retains = 0;
  for (auto& p : st().primaries) out->context_retains += p.retains;
  out->own_allocations = static_cast<long>(st().own.size());
}

FAKE_API const char* fakecuda_first_fault() {
  std::lock_guard lk(st().mu);
  return st().first_fault.c_str();
}

FAKE_API void fakecuda_clear_faults() {
  std::lock_guard lk(st().mu);
  st().fault_count = 0;
  st().invalidated_captures = 0;
  st().first_fault.clear();
}

FAKE_API void fakecuda_hold_stream(void* stream, int hold) {
  std::lock_guard lk(st().mu);
  auto it = st().streams.find(reinterpret_cast<CUstream>(stream));
  if (it == st().streams.end()) return;
  it->second.held = hold != 0;
  if (!hold) resolve();  // its work runs now
}

FAKE_API void fakecuda_set_capacity(int device, std::size_t bytes) {
  std::lock_guard lk(st().mu);
  st().capacity[device] = bytes;
}

FAKE_API void* fakecuda_stream_create(int device) {
  std::lock_guard lk(st().mu);
  if (device < 0 || device >= st().devices) return nullptr;
  CUstream h = new_stream_handle();
  st().streams[h] = FakeStream{primary_ctx(device), nullptr, false, 0, true};
  return h;
}

FAKE_API int fakecuda_stream_destroy(void* stream) {
  std::lock_guard lk(st().mu);
  auto it = st().streams.find(reinterpret_cast<CUstream>(stream));
  if (it == st().streams.end() || !it->second.runtime) return CUDA_ERROR_INVALID_HANDLE;
  stream_destroyed(it->first, it->second);
  st().streams.erase(it);
  return CUDA_SUCCESS;
}

FAKE_API void fakecuda_reuse_stream_values_at_once(int at_once) {
  std::lock_guard lk(st().mu);
  st().reuse_streams_at_once = at_once != 0;
}

FAKE_API void fakecuda_refuse_multi_mapping_unmap(int refuse) {
  std::lock_guard lk(st().mu);
  st().refuse_multi_unmap = refuse != 0;
}

FAKE_API int fakecuda_adopt_stream(void* handle, int device) {
  std::lock_guard lk(st().mu);
  auto h = reinterpret_cast<CUstream>(handle);
  if (device < 0 || device >= st().devices || h == nullptr || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) return 0;
  st().streams[h] = FakeStream{primary_ctx(device), nullptr, false, 0, true};
  return 1;
}

FAKE_API int fakecuda_launch(void* stream, const void* ptr, std::size_t bytes, unsigned long long ticks) {
  std::lock_guard lk(st().mu);
  State& s = st();
  auto h = reinterpret_cast<CUstream>(stream);
  // Launches go to the stream's own context's work: the caller need not have a context current, except for
  // CU_STREAM_PER_THREAD, the calling thread's per-thread stream of its current context.
  FakeStream* fs = nullptr;
  if (h == CU_STREAM_PER_THREAD) fs = stream_of(h);
  else if (auto it = s.streams.find(h); it != s.streams.end()) fs = &it->second;
  if (!fs) return CUDA_ERROR_INVALID_HANDLE;
  if (fs->capture) return CUDA_SUCCESS;  // recorded in the graph, runs at replay
  const auto va = reinterpret_cast<CUdeviceptr>(ptr);
  const int dev = ctx_device(fs->ctx);
  if (bytes && !accessible(s, va, bytes, dev)) {
    fault("work on device " + std::to_string(dev) + " touches memory it may not access (unmapped, or no access granted)");
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  NodeP n = enqueue(*fs, h, ticks);
  if (!bytes) return CUDA_SUCCESS;
  // Unfinished work over the same physical memory, through any address, must happen before this one.
  std::vector<PhysRange> phys = physical(s, va, bytes);
  for (const Touch& w : s.touches)
    if (!node_done(w.node) && !n->follows(*w.node) && overlap(w.phys, phys)) {
      fault("work on stream " + stream_name(h) + " touches memory that unfinished work on stream " +
            stream_name(w.stream) + " still uses, without being ordered after it (handed out again too early)");
      break;
    }
  s.touches.push_back({va, bytes, h, n, std::move(phys)});
  return CUDA_SUCCESS;
}

FAKE_API int fakecuda_stream_wait(void* waiter, void* waited) {
  std::lock_guard lk(st().mu);
  State& s = st();
  auto w = s.streams.find(reinterpret_cast<CUstream>(waiter));
  auto d = s.streams.find(reinterpret_cast<CUstream>(waited));
  if (w == s.streams.end() || d == s.streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (w->second.capture || d->second.capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (d->second.tail && !node_done(d->second.tail)) enqueue(w->second, w->first, 0, {d->second.tail});
  return CUDA_SUCCESS;
}

FAKE_API unsigned long long fakecuda_stream_done_at(void* stream) {
  std::lock_guard lk(st().mu);
  auto it = st().streams.find(reinterpret_cast<CUstream>(stream));
  if (it == st().streams.end() || !it->second.tail) return 0;
  return it->second.tail->blocked ? std::numeric_limits<unsigned long long>::max() : it->second.tail->done;
}

FAKE_API void fakecuda_advance(unsigned long long ticks) {
  std::lock_guard lk(st().mu);
  resolve();
  advance_to(st().now + ticks);
}

FAKE_API std::size_t fakecuda_free_bytes(int device) {
  std::lock_guard lk(st().mu);
  return device < 0 || device >= st().devices ? 0 : st().capacity[device] - st().used[device];
}

FAKE_API void* fakecuda_foreign_alloc(int device, std::size_t bytes) {
  std::lock_guard lk(st().mu);
  CUdeviceptr p = 0;
  if (device < 0 || device >= st().devices || bytes == 0 || own_alloc(st(), bytes, device, nullptr, false, &p) != CUDA_SUCCESS)
    return nullptr;
  return reinterpret_cast<void*>(p);
}

FAKE_API unsigned long long fakecuda_now() {
  std::lock_guard lk(st().mu);
  return st().now;
}
