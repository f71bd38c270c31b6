// libfragless.so: the C ABI over one process-wide Allocator (fragless.h). Only fragless_* symbols are
// exported (exports.map).
#include <cxxabi.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>

#include "engine_snapshot.h"
#include "stacks.h"
#include "fragless/allocator.h"
#include "fragless/rounding.h"
#include "fragless/fragless.h"
#include "fragless/tracer.h"

namespace fragless {

// What fragless_malloc throws when memory runs out.
class OutOfMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace {

// Note [Per-thread state at exit]
// Programs call in from thread_local objects' destructors, static destructors and atexit handlers (CUDA
// programs free memory there), after the C++ runtime has run the calling thread's thread_local destructors:
// a thread's run when it ends, and the main thread's when exit() begins, before the static destructors and
// the atexit handlers. So every per-thread variable here is trivially destructible, and a call at any point
// of a thread's or the process's end finds it as it was: the last error is a fixed buffer (a longer message is
// cut at a character's boundary and ends with "..."), the call's stack a pointer to the CallStack of the call
// under way, and the snapshot a sizing call keeps a pointer that a pthread key's destructor frees when the
// thread ends (that runs after the thread_local destructors, and resets the pointer). Before 2026-12-05 they
// were a std::string and a std::shared_ptr, and such a call wrote into the freed string
// (tests/capi/capi_bad_input.cpp, "exit").
constexpr std::size_t kErrorBytes = 4096;
thread_local char t_last_error[kErrorBytes];
// The stack of the C ABI call under way on this thread (Note [Stacks before locks]); events it causes carry it.
thread_local const std::shared_ptr<const stacks::Stack>* t_call_stack = nullptr;

void clear_error() { t_last_error[0] = '\0'; }

void set_error(std::string_view s) {
  std::size_t n = s.size();
  if (n < kErrorBytes) {
    std::memmove(t_last_error, s.data(), n);
    t_last_error[n] = '\0';
    return;
  }
  n = kErrorBytes - 4;  // room for "..." and the NUL
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // not inside a UTF-8 character
  std::memmove(t_last_error, s.data(), n);
  std::memcpy(t_last_error + n, "...", 4);
}

// The same from a format, with no allocation (what a caught std::bad_alloc reports).
__attribute__((format(printf, 1, 2))) void set_errorf(const char* format, ...) {
  char buf[kErrorBytes + 1];  // one more: a message longer than the buffer is cut as set_error cuts it
  std::va_list args;
  va_start(args, format);
  const int n = std::vsnprintf(buf, sizeof buf, format, args);
  va_end(args);
  set_error(std::string_view(buf, n < 0 ? 0 : std::min(static_cast<std::size_t>(n), sizeof buf - 1)));
}

// The last error, and the same on stderr: what the hooks PyTorch calls without looking at a result report.
void report_error() { std::fprintf(stderr, "%s\n", t_last_error); }
// fragless_set_oom_thrower: throws the host framework's own out-of-memory exception (torch.cuda.OutOfMemoryError).
std::atomic<void (*)(const char*)> g_oom_thrower{nullptr};
// fragless_set_oom_note: appended to the out-of-memory message when there is no thrower (why the error is not
// the framework's own). Each note set is kept for the process (a reader may still hold the previous one).
std::atomic<const std::string*> g_oom_note{nullptr};
// fragless_attach_oom_observer: called in the order added; a slot is read only once its count covers it, and a
// slot not yet stored (another thread is adding it) is skipped.
using OomObserver = void (*)(int, size_t, size_t, size_t);
constexpr int kMaxOomObservers = 64;
std::atomic<OomObserver> g_oom_observers[kMaxOomObservers];
std::atomic<int> g_oom_observer_count{0};

// What frames a history records, PyTorch's RecordContext (c10/cuda/CUDACachingAllocator.h): none; those of
// live blocks' allocations only ("state"); those of allocations on trace entries too ("alloc"); and of frees
// ("all").
constexpr int kContextNever = 0, kContextState = 1, kContextAlloc = 2, kContextAll = 3;

// A history entry's time: microseconds since the Unix epoch, as PyTorch's time_us, read from the wall clock
// once and advanced by the steady clock after, so that a wall clock set back meanwhile does not send the
// history back in time (which the snapshot reader refuses, kOutOfOrderUs).
std::int64_t history_time_us() {
  using namespace std::chrono;
  static const auto start = std::make_pair(system_clock::now(), steady_clock::now());
  const auto now = start.first + duration_cast<system_clock::duration>(steady_clock::now() - start.second);
  return duration_cast<microseconds>(now.time_since_epoch()).count();
}

// Per device: forwards to the tracer (if on) and keeps the last N events for snapshots (if on), with the
// stack of each allocation (and free, with context "all") when stacks are on (stacks.h).
class DeviceSink final : public EventSink {
 public:
  explicit DeviceSink(EventSink* tracer) : tracer_(tracer) {}
  void on_event(const TraceEvent& e) override {
    if (tracer_) tracer_->on_event(e);
    if (!on_.load(std::memory_order_relaxed)) return;  // no history (set_history's fields are read under mu_)
    // Note [The history counts snapshot entries]: the ring keeps the last max_entries entries as a snapshot
    // shows them, as PyTorch's does: events a snapshot has no entry for take no place in it, and a free that
    // completes at once is its two entries.
    if (!formats::snapshot_has_entry(e.action)) return;
    const bool alloc = e.action == TraceAction::alloc;
    const bool freed = e.action == TraceAction::free || e.action == TraceAction::free_completed;
    const bool free_call = freed || e.action == TraceAction::free_requested;
    // The memory an allocation made for itself carries its stack, as in PyTorch (alloc_block and the
    // expandable segment's map record the malloc's context): no capture of its own, so nothing on a cache hit.
    const bool segment_made = e.action == TraceAction::segment_alloc || e.action == TraceAction::segment_map;
    const bool segment_gone = e.action == TraceAction::segment_free || e.action == TraceAction::segment_unmap;
    Rec r;
    r.h.action = e.action;
    r.h.address = e.address;  // 0 for events without one (physical create/release, empty_cache)
    // An oom entry's size is the rounded request, as PyTorch's (params.size()); the others' the bytes asked.
    r.h.size = e.action == TraceAction::oom ? e.block_size : e.requested_size;
    r.h.stream = e.stream;
    r.h.time_us = history_time_us();
    std::lock_guard lk(mu_);
    if (max_entries_ == 0) return;
    std::shared_ptr<const stacks::Stack> st;
    if (stacks_ && t_call_stack && (alloc || segment_made || (context_ >= kContextAll && free_call))) st = *t_call_stack;
    if (context_ >= kContextAlloc) {  // context "state": frames for live blocks only
      r.stack = st;
      // An entry with no stack of its own carries what made the memory, as PyTorch's do (free() and
      // free_block() pass context_when_allocated, a segment's release context_when_segment_allocated).
      if (!r.stack && free_call) {
        if (auto it = block_stacks_.find(e.address); it != block_stacks_.end()) r.stack = it->second;
      } else if (!r.stack && segment_gone) {
        if (auto it = segment_stacks_.find(e.address); it != segment_stacks_.end()) r.stack = it->second;
      }
    }
    if (e.action == TraceAction::free) {
      r.h.action = TraceAction::free_requested;
      ring_.push_back(r);
      r.h.action = TraceAction::free_completed;
    }
    ring_.push_back(std::move(r));
    while (ring_.size() > max_entries_) ring_.pop_front();
    if (segment_made && st) {
      segment_stacks_[e.address] = st;  // the segment that starts here, if one does (Note [Segment frames])
    } else if (segment_gone) {
      segment_stacks_.erase(segment_stacks_.lower_bound(e.address), segment_stacks_.lower_bound(e.address + e.requested_size));
    }
    if (alloc && st) block_stacks_[e.address] = std::move(st);
    else if (alloc || freed) block_stacks_.erase(e.address);
  }
  void flush() override {
    if (tracer_) tracer_->flush();
  }
  // context: PyTorch's RecordContext (kContextNever .. kContextAll); stacks: stacks::python | stacks::cpp.
  // clear: the history kept so far is dropped (PyTorch's clear_history); turning it off drops it too.
  void set_history(std::size_t n, int context, int stacks, bool clear) {
    std::lock_guard lk(mu_);
    max_entries_ = n;
    on_.store(n != 0, std::memory_order_relaxed);
    context_ = n ? context : 0;
    stacks_ = n && context ? stacks : 0;
    wanted_alloc_.store(stacks_, std::memory_order_relaxed);
    wanted_free_.store(context_ >= kContextAll ? stacks_ : 0, std::memory_order_relaxed);
    if (clear) ring_.clear();
    while (ring_.size() > n) ring_.pop_front();
    if (!stacks_) {
      block_stacks_.clear();
      segment_stacks_.clear();
    }
  }
  // The history, and the frames of live blocks' allocations, named now (each stack once). The ring is copied
  // under the lock and named after it: naming may take the GIL, which an allocating thread may hold while
  // it waits for this lock.
  // with_history false: the blocks' and segments' frames only, no trace entries (a snapshot without traces,
  // which a history of a million entries would take seconds to name and write).
  void collect(formats::DeviceState* out, bool with_history = true) {
    std::vector<Rec> ring;
    std::vector<std::pair<std::uint64_t, std::shared_ptr<const stacks::Stack>>> blocks, segments;
    {
      std::lock_guard lk(mu_);
      if (with_history) ring.assign(ring_.begin(), ring_.end());
      blocks.assign(block_stacks_.begin(), block_stacks_.end());
      segments.assign(segment_stacks_.begin(), segment_stacks_.end());
    }
    stacks::Namer name;
    // Each distinct stack named once, and its frames shared by every event that captured it (the snapshot's
    // writer then writes them once; Note [Frames written once], snapshot_layout.cpp).
    std::unordered_map<const stacks::Stack*, std::shared_ptr<const std::vector<formats::Frame>>, stacks::HashFrames,
                       stacks::SameFrames>
        done;
    auto frames = [&](const std::shared_ptr<const stacks::Stack>& st) -> std::shared_ptr<const std::vector<formats::Frame>> {
      if (!st) return nullptr;
      auto& f = done[st.get()];
      if (!f) {
        auto v = std::make_shared<std::vector<formats::Frame>>();
        for (auto& x : name(*st)) v->push_back({std::move(x.filename), std::move(x.name), x.line});
        f = std::move(v);
      }
      return f;
    };
    out->history.clear();
    out->history.reserve(ring.size());
    for (const Rec& r : ring) {
      out->history.push_back(r.h);
      out->history.back().frames = frames(r.stack);
    }
    for (const auto& [addr, st] : blocks) out->block_frames[addr] = frames(st);
    for (const auto& [addr, st] : segments) out->segment_frames[addr] = frames(st);
  }
  bool needed() const { return tracer_ != nullptr || on_.load(std::memory_order_relaxed); }
  // fork() holds the ring's lock (fragless::hold_across_fork): collect and set_history take it without a
  // device lock, so a child forked during a snapshot would otherwise wait for ever at its first event.
  static void lock_for_fork(void* s) { static_cast<DeviceSink*>(s)->mu_.lock(); }
  static void unlock_for_fork(void* s) { static_cast<DeviceSink*>(s)->mu_.unlock(); }
  // Which stacks an allocation (a free) on this device records: stacks::python | stacks::cpp, or 0.
  int stacks_for_alloc() const { return wanted_alloc_.load(std::memory_order_relaxed); }
  int stacks_for_free() const { return wanted_free_.load(std::memory_order_relaxed); }
  // The memory fraction last set through the C ABI (set_memory_fraction_fn), or -1: the configuration's.
  std::atomic<double> fraction{-1.0};

 private:
  struct Rec {
    formats::HistoryEntry h;
    std::shared_ptr<const stacks::Stack> stack;
  };
  EventSink* tracer_;
  std::size_t max_entries_ = 0;  // these three under mu_
  int context_ = 0, stacks_ = 0;
  std::atomic<bool> on_{false};  // max_entries_ != 0, read without mu_ to skip events when there is no history
  std::atomic<int> wanted_alloc_{0}, wanted_free_{0};  // read without mu_ before a call takes any lock
  std::mutex mu_;
  std::deque<Rec> ring_;
  std::unordered_map<std::uint64_t, std::shared_ptr<const stacks::Stack>> block_stacks_;
  // Note [Segment frames]
  // The stack of the call whose segment_alloc or segment_map event made the memory at each address, kept until a
  // segment_free or segment_unmap covers that address: a snapshot gives it to the segment that starts there
  // (PyTorch's context_when_segment_allocated). A growable segment's range that starts where no growth began
  // (its first pages were unmapped since) has none. Bounded by the segments' pages: one entry per address.
  std::map<std::uint64_t, std::shared_ptr<const stacks::Stack>> segment_stacks_;
};

// Note [Histories across fork]
// record_history's calls are serialised (each sets the sinks' history, then which engines call them:
// Allocator::on_engine_created, whose calls must not overlap). That lock cannot be held across fork(): its
// holder waits for the allocator's creation lock and for device locks, which the fork takes first. So a child
// forked while another thread held it gets a new one (that thread is not in the child; the old lock is left
// locked, never destroyed). Each part that thread had set is whole in the child (the sinks' locks and the
// creation lock are held across the fork), and the child's own record_history sets them all again. No thread
// forks while it holds it: nothing it runs calls code that is not ours. Before 2026-12-04 such a child waited
// for ever in its own record_history (tests/capi/capi_fork.cpp).
struct Process {
  std::atomic<Allocator*> ready{nullptr};  // set once the allocator exists: the fast path is one load
  MakeOnce once;                           // the allocator is made once (Note [Making the allocator once])
  std::mutex* history_mu = new std::mutex;  // Note [Histories across fork]; replaced in a forked child
  std::unique_ptr<Allocator> alloc;         // set by the maker, read after once.begin() or ready
  std::vector<std::unique_ptr<DeviceSink>> sinks;  // one per device, chained into its engine when it is created
  std::string init_error;                          // why there is no allocator, when there is none
  std::atomic<bool> failed{false};                 // the making ended without an allocator (init_error says why)

  Process() {
    hold_across_fork_from_load([](void*) {}, [](void*) {}, [](void* p) {
      std::mutex*& mu = static_cast<Process*>(p)->history_mu;
      if (mu->try_lock()) mu->unlock();
      else mu = new std::mutex;  // its holder is not in this child
    }, this);
  }
};

// Never destroyed: CUDA programs free memory from static destructors and atexit handlers. Made when the
// library is loaded, before any thread of the program can call it (its fork handlers must be registered
// before anything they cover can be held).
Process& proc() {
  static Process* p = new Process();
  return *p;
}
__attribute__((constructor)) void make_process_at_load() { proc(); }

// At exit (Allocator::at_exit): the background workers stop first (no driver call of theirs while the CUDA
// driver tears down), then the trace writers (no thread of ours is left for the process's exit to race), and
// the traces are written, the workers' last records included; each later record is written as it comes
// (Note [Tracing at exit]). The engines stay: other threads and static destructors may still allocate and
// free. An exit on a thread that holds a device's lock leaves that device alone (Note [Exit while the lock
// is held]).
void flush_at_exit() {
  if (Allocator* a = proc().ready.load(std::memory_order_acquire)) a->at_exit();
}

// Chains each device's sink into its engine: now for the engines that exist, and as the others are created
// (under the allocator's creation lock, so no engine is missed).
void attach_sinks(Process& p, Allocator& a) {
  a.on_engine_created([&p](int d, DeviceEngine& e) {
    DeviceSink* s = p.sinks[static_cast<std::size_t>(d)].get();
    e.set_event_sink(s->needed() ? s : nullptr);
  });
}

// The allocator, created on first use for `devices` devices (-1: as many as the driver has). No device's
// engine (nor its CUDA context) exists until that device is first used.
Allocator* get(int devices = -1) {
  Process& p = proc();
  if (Allocator* a = p.ready.load(std::memory_order_acquire)) return a;
  if (MakeOnce::Turn turn = p.once.begin()) {  // made here, holding nothing of ours (a fork may take it away)
    std::unique_ptr<Allocator> made;
    std::vector<std::unique_ptr<DeviceSink>> sinks;
    std::string err;
    try {
      if (auto conf = config_from_environment(); !conf.ok) {
        err = conf.error;
      } else {
        if (turn.after_lost_making()) forked_child_traces_not(&conf.options);
        if ((made = Allocator::create(conf.options, devices, &err, /*eager=*/false))) {
          sinks.reserve(static_cast<std::size_t>(made->device_count()));
          for (int d = 0; d < made->device_count(); ++d) {
            sinks.push_back(std::make_unique<DeviceSink>(made->trace_sink(d)));
            hold_across_fork(&DeviceSink::lock_for_fork, &DeviceSink::unlock_for_fork, sinks.back().get());
          }
          // Registered once for the process (a child's making after a lost one does not add it again).
          hold_across_fork([](void*) { stacks::lock_tables(); }, [](void*) { stacks::unlock_tables(); }, nullptr);
          attach_sinks(p, *made);  // reads p.sinks when an engine is made: none is before the allocator is published
          std::atexit(flush_at_exit);
        }
      }
    } catch (const std::exception& e) {  // out of host memory: an error, never a maker that never ends
      made.reset();
      for (auto& s : sinks) (void)s.release();  // registered with fork: never destroyed
      sinks.clear();
      err = std::string("fragless: could not make the allocator: ") + e.what();
    }
    if (!made) std::fprintf(stderr, "%s\n", err.c_str());
    turn.made([&] {  // publication, all at once for a fork
      p.init_error = std::move(err);
      p.sinks = std::move(sinks);
      p.alloc = std::move(made);
      p.failed.store(!p.alloc, std::memory_order_release);
      p.ready.store(p.alloc.get(), std::memory_order_release);
    });
  } else if (!p.ready.load(std::memory_order_acquire) && p.init_error.empty()) {
    set_error("fragless: called from inside the making of its own allocator (on the same thread)");
    return nullptr;
  }
  if (Allocator* a = p.ready.load(std::memory_order_acquire)) return a;
  set_error(p.init_error);
  return nullptr;
}

// The engine of a device, created on its first use.
DeviceEngine* engine(int device) {
  Allocator* a = get();
  if (!a) return nullptr;
  std::string err;
  DeviceEngine* e = a->device(device, &err);
  if (!e) set_error(err);
  return e;
}

// The engine that owns ptr (PyTorch's base-allocation and record_stream hooks do not say which device).
DeviceEngine* owner(void* ptr) {
  Allocator* a = get();
  if (!a) return nullptr;
  for (int d = 0; d < a->device_count(); ++d)
    if (DeviceEngine* e = a->existing(d); e && e->owns(ptr)) return e;
  return nullptr;
}

// Note [Stacks before locks]
// A stack is captured when the C ABI call starts, before the engine's lock is taken, and handed to the
// events of that call through t_call_stack: capturing Python frames may take the GIL (stacks.h), and a
// thread that holds the GIL may be waiting for the engine's lock, so the order is GIL -> engine lock, as in
// PyTorch's allocator. Events a call causes that are not its own (frees completed while it runs) carry its
// stack too, as they did when the stack was read at the event.
class CallStack {
 public:
  CallStack(int device, bool alloc) : outer_(t_call_stack) {
    Allocator* a = proc().ready.load(std::memory_order_acquire);
    if (!a || device < 0 || device >= a->device_count()) return;
    const DeviceSink& s = *proc().sinks[static_cast<std::size_t>(device)];
    if (const int which = alloc ? s.stacks_for_alloc() : s.stacks_for_free()) {
      stack_ = stacks::capture(which, 1);
      t_call_stack = &stack_;  // Note [Per-thread state at exit]: the thread's variable points here
    }
  }
  ~CallStack() { t_call_stack = outer_; }
  CallStack(const CallStack&) = delete;
  CallStack& operator=(const CallStack&) = delete;

 private:
  std::shared_ptr<const stacks::Stack> stack_;
  const std::shared_ptr<const stacks::Stack>* outer_;  // a call made from inside another (an OOM observer's)
};

long copy_out(const std::string& s, char* buf, std::size_t len) {
  if (buf && len) {
    const std::size_t n = std::min(s.size(), len - 1);
    std::memcpy(buf, s.data(), n);
    buf[n] = '\0';
  }
  return static_cast<long>(s.size());
}

// Note [No exception leaves the C ABI]
// PyTorch calls most entry points from its deleters and hooks, which are noexcept, and ctypes and C have no
// handler: an exception that left one would end the process. So every entry point but fragless_malloc (which
// throws by PyTorch's contract) runs inside guarded, or guard for those that return nothing: what the engine
// or a caller's function throws (out of host memory, a graph pool's stream filter) becomes the call's error,
// with the result of a failure; one that returns nothing says it on stderr too. Each clears the thread's last
// error first, so that what is read after a call is that call's. Before 2026-12-05 an empty stream filter
// threw std::bad_function_call out of fragless_pool_malloc (tests/capi/capi_bad_input.cpp, "filters").
template <class R, class F>
R guarded(const char* fn, R failed, F&& f) {
  clear_error();
  try {
    return f();
  } catch (abi::__forced_unwind&) {
    throw;  // a thread's cancellation goes on unwinding
  } catch (const std::exception& e) {
    set_errorf("fragless: %s: %s", fn, e.what());
  } catch (...) {
    set_errorf("fragless: %s: an exception that is not a std::exception", fn);
  }
  return failed;
}

template <class F>
void guard(const char* fn, F&& f) {
  if (!guarded(fn, false, [&] {
        f();
        return true;
      }))
    report_error();
}

// Whether ptr is inside another process's block mapped here by fragless_open_shared. Walks the imports: for
// the error paths only.
bool imported(void* ptr) {
  Allocator* a = proc().ready.load(std::memory_order_acquire);
  if (!a) return false;
  const auto at = reinterpret_cast<std::uint64_t>(ptr);
  for (int d = 0; d < a->device_count(); ++d)
    if (DeviceEngine* e = a->existing(d))
      for (const ImportInfo& i : e->imports())
        if (at >= i.address && at - i.address < i.size) return true;
  return false;
}

// Note [Device counts]
// fragless_init(n) makes the allocator for n devices (PyTorch's init hook passes its device count), each with
// its slot, event sink and fork handler. A count above the driver's names devices that do not exist, and a
// huge one took seconds and gigabytes (100,000 devices 3 s; 50,000,000 ran out of memory). So a count above
// kMaxDevices (128, whatever the driver) is refused and nothing is made: the next call makes the allocator
// for the driver's count. Once the allocator is made the
// count changes nothing, as before.
// Not the driver's count: asking it would start CUDA (cuInit) in fragless_init, which started nothing before, and a
// C program that forks after it would have children that cannot use CUDA. A count past the driver's makes the
// devices past it fail at their first use, with the driver's error, as before.
bool device_count_allowed(int n) {
  if (proc().ready.load(std::memory_order_acquire) || n <= kMaxDevices) return true;
  set_errorf("fragless: fragless_init(%d): %d devices, more than the %d fragless takes (PyTorch's device index is an "
             "8-bit integer); nothing was made (the next call makes the allocator for the driver's devices, or 1 "
             "device where the driver reports none)", n, n, kMaxDevices);
  return false;
}

}  // namespace
}  // namespace fragless

using namespace fragless;

extern "C" {

namespace {
// One allocation; nullptr with the last error set on failure (*message: its whole text), *oom telling
// whether memory ran out and, if it did, *alloc_size what PyTorch's allocator would have asked the driver for.
void* allocate(size_t size, int device, cudaStream_t stream, bool* oom, std::string* message,
               std::size_t* alloc_size = nullptr) {
  *oom = false;
  DeviceEngine* e = engine(device);
  if (!e) {
    *message = t_last_error;
    return nullptr;
  }
  CallStack stack(device, /*alloc=*/true);
  AllocError err;
  void* p = e->allocate(size, reinterpret_cast<Stream>(stream), &err);
  if (!p) {
    set_error(err.message);
    *message = std::move(err.message);
    *oom = err.status == Status::out_of_memory;
    if (alloc_size) *alloc_size = err.alloc_size;
  }
  return p;
}
}  // namespace

namespace {
void notify_oom_observers(int device, size_t size);  // fragless_attach_oom_observer's, below
}  // namespace

// Note [No exception leaves the C ABI]: fragless_malloc is the exception, by PyTorch's contract; what a graph
// pool's stream filter throws goes through it too.
void* fragless_malloc(size_t size, int device, cudaStream_t stream) {
  clear_error();
  if (size == 0) return nullptr;  // legal: nothing to allocate
  bool oom = false;
  std::string message;
  std::size_t alloc_size = 0;
  if (void* p = allocate(size, device, stream, &oom, &message, &alloc_size)) return p;
  // Never NULL: PyTorch's normal path would wrap it in a tensor whose first kernel faults.
  if (oom) {
    // A request of 1 EiB or more is refused before any search, as PyTorch refuses it before its allocator's
    // malloc (and so before its observers): the engine names no allocation size for it. The observers get
    // the size the message names, as PyTorch's do (alloc_size, not the request).
    if (alloc_size) notify_oom_observers(device, alloc_size);
    if (auto thrower = g_oom_thrower.load(std::memory_order_acquire)) thrower(message.c_str());
    if (const std::string* note = g_oom_note.load(std::memory_order_acquire)) throw OutOfMemoryError(message + " " + *note);
    throw OutOfMemoryError(message);
  }
  throw std::runtime_error(message);
}

namespace {
// PyTorch's arguments (c10/cuda/CUDACachingAllocator.cpp, malloc): the device, the size, the fraction's limit or
// the device's total, the device's free memory. Asked with no fragless lock held; the observer may take the GIL.
void notify_oom_observers(int device, size_t size) {
  const int n = std::min(g_oom_observer_count.load(std::memory_order_acquire), kMaxOomObservers);
  if (n == 0) return;
  const std::string error = t_last_error;  // what the throw reports, whatever is called here
  std::size_t free_b = 0, total_b = 0;
  if (DeviceEngine* e = engine(device)) e->memory_info(&free_b, &total_b);
  const double fraction = fragless_get_memory_fraction(device);
  const std::size_t limit =
      fraction >= 0 && fraction < 1 ? static_cast<std::size_t>(fraction * static_cast<double>(total_b)) : total_b;
  for (int i = 0; i < n; ++i)
    if (OomObserver obs = g_oom_observers[i].load(std::memory_order_acquire)) obs(device, size, limit, free_b);
  set_error(error);
}
}  // namespace

int fragless_attach_oom_observer(void (*observer)(int device, size_t alloc, size_t limit, size_t device_free)) {
  return guarded("fragless_attach_oom_observer", -1, [&] {
    if (!observer) {
      set_error("fragless_attach_oom_observer: a null observer");
      return -1;
    }
    const int i = g_oom_observer_count.fetch_add(1, std::memory_order_acq_rel);
    if (i >= kMaxOomObservers) {
      g_oom_observer_count.fetch_sub(1, std::memory_order_acq_rel);
      set_errorf("fragless_attach_oom_observer: %d observers are already attached (they are never removed)",
                 kMaxOomObservers);
      return -1;
    }
    g_oom_observers[i].store(observer, std::memory_order_release);
    return 0;
  });
}

void fragless_set_oom_thrower(void (*thrower)(const char* message)) {
  g_oom_thrower.store(thrower, std::memory_order_release);
}

void fragless_set_oom_note(const char* note) {
  guard("fragless_set_oom_note", [&] {
    g_oom_note.store(note && *note ? new std::string(note) : nullptr, std::memory_order_release);
  });
}

long fragless_check_config(const char* conf, char* buf, size_t len) {
  return guarded("fragless_check_config", -1L, [&] {
    const ConfigResult r = parse_allocator_config(conf ? conf : "");
    return copy_out(r.ok ? std::string() : r.error, buf, len);
  });
}

long fragless_settings(char* buf, size_t len) {
  return guarded("fragless_settings", -2L, [&] {
    Process& p = proc();
    if (Allocator* a = p.ready.load(std::memory_order_acquire)) return copy_out(a->options().settings, buf, len);
    if (p.failed.load(std::memory_order_acquire)) {  // init_error was written before `failed`, and never after
      set_error(p.init_error);
      return -2L;
    }
    return -1L;  // not made yet (or being made by another thread right now): nothing is made here
  });
}

int fragless_same_config(const char* a, const char* b) {
  return guarded("fragless_same_config", -1, [&] {
    const ConfigResult x = parse_allocator_config(a ? a : ""), y = parse_allocator_config(b ? b : "");
    if (!x.ok || !y.ok) {
      set_error(std::string("fragless: same_config: the ") + (x.ok ? "second" : "first") +
                " configuration is not valid: " + (x.ok ? y.error : x.error));
      return -1;
    }
    return same_settings(x.options, y.options) ? 1 : 0;
  });
}

long fragless_check_driver(const char* conf, char* buf, size_t len) {
  return guarded("fragless_check_driver", -1L, [&] {
    const ConfigResult r = parse_allocator_config(conf ? conf : "");
    std::string err;
    if (!r.ok) return copy_out(r.error, buf, len);
    if (!driver_available(r.options, &err)) return copy_out(err, buf, len);
    // Each device's file when the path has %d: as many as the allocator made on first use has (a count
    // fragless_init gives is not known here).
    const int devices = default_device_count(r.options, nullptr);
    if (!r.options.trace.empty() && !trace_path_usable(r.options.trace, devices, &err)) return copy_out(err, buf, len);
    return copy_out("", buf, len);
  });
}

void* fragless_pool_malloc(size_t size, int device, cudaStream_t stream) {
  return guarded("fragless_pool_malloc", static_cast<void*>(nullptr), [&]() -> void* {
    bool oom = false;
    std::string message;
    return size == 0 ? nullptr : allocate(size, device, stream, &oom, &message);
  });
}

void fragless_free(void* ptr, size_t, int device, cudaStream_t) {
  guard("fragless_free", [&] {
    if (!ptr) return;
    Allocator* a = get();
    if (!a) return;  // no allocator (the last error says why), so nothing of it to free
    // PyTorch passes the allocation's device: one lookup. Only a refused free looks at the other devices, the
    // owner's engine answering; a device never used has no engine, and none is made here.
    DeviceEngine* e = a->existing(device);
    CallStack stack(device, /*alloc=*/false);
    AllocError err;
    if (e && e->free(ptr, &err) == Status::ok) return;
    if (DeviceEngine* o = owner(ptr); o && o != e && o->free(ptr, &err) == Status::ok) return;
    if (err.message.empty())
      set_errorf("fragless: free of pointer %p (device %d) that fragless did not allocate or already freed; nothing "
                 "was changed", ptr, device);
    else
      set_error(err.message);
    report_error();
  });
}

void fragless_init(int device_count) {
  guard("fragless_init", [&] {
    // After an earlier call made the allocator (for the driver's devices), a count that differs changes nothing:
    // said, so that a caller expecting other devices learns it here and not at its first call for one.
    if (Allocator* a = proc().ready.load(std::memory_order_acquire); a && device_count > 0) {
      if (device_count != a->device_count())
        set_errorf("fragless: fragless_init(%d) after an earlier fragless call made the allocator for %d device(s): "
                   "the count stays %d", device_count, a->device_count(), a->device_count());
      return;
    }
    if (device_count > 0 && !device_count_allowed(device_count)) return report_error();
    get(device_count > 0 ? device_count : -1);
  });
}

void fragless_empty_cache(void) {
  guard("fragless_empty_cache", [&] {
    if (Allocator* a = get())
      for (int d = 0; d < a->device_count(); ++d)
        if (DeviceEngine* e = a->existing(d)) {  // a device never used holds nothing
          AllocError err;
          if (e->empty_cache(&err) != Status::ok) set_error(err.message);  // Note [Failed waits]
        }
  });
}

void fragless_set_memory_fraction(double fraction, int device) {
  guard("fragless_set_memory_fraction", [&] {
    if (DeviceEngine* e = engine(device)) {
      if (e->set_memory_fraction(fraction) != Status::ok)
        set_errorf("fragless: memory fraction %.17g is not in [0, 1]", fraction);
      else
        proc().sinks[static_cast<std::size_t>(device)]->fraction.store(fraction, std::memory_order_relaxed);
    }
  });
}

double fragless_get_memory_fraction(int device) {
  return guarded("fragless_get_memory_fraction", -1.0, [&] {
    Allocator* a = get();
    if (!a) return -1.0;
    if (device < 0 || device >= a->device_count()) {
      set_errorf("fragless: invalid device %d (fragless manages %d devices)", device, a->device_count());
      return -1.0;
    }
    const double set = proc().sinks[static_cast<std::size_t>(device)]->fraction.load(std::memory_order_relaxed);
    return set >= 0 ? set : a->options().per_process_memory_fraction;
  });
}

void* fragless_get_base_allocation(void* ptr, size_t* size) {
  return guarded("fragless_get_base_allocation", ptr, [&] {
    DeviceEngine* e = owner(ptr);
    if (void* base = e ? e->base_allocation(ptr, size) : nullptr) return base;
    // PyTorch's own allocator refuses such a pointer ("invalid device pointer"); the pluggable path has no way to
    // throw, so the pointer itself comes back as before, with no size, and the last error says why.
    if (size) *size = 0;
    set_errorf("fragless: get_base_allocation of pointer %p, which is not an allocation fragless made and has not "
               "freed (an allocation's own pointer is needed, not one inside it); the pointer itself is returned, "
               "size 0", ptr);
    return ptr;
  });
}

void fragless_record_stream(void* ptr, cudaStream_t stream) {
  guard("fragless_record_stream", [&] {
    // NULL is what a 0-byte allocation returned (an empty tensor's storage): nothing to record, as free(NULL)
    // frees nothing and PyTorch's own allocator ignores it.
    if (!ptr) return;
    if (DeviceEngine* e = owner(ptr); e && e->record_stream(ptr, reinterpret_cast<Stream>(stream)) == Status::ok)
      return;
    if (!proc().ready.load(std::memory_order_acquire)) return;  // no allocator: the last error says why
    // Another process's block mapped here (fragless_open_shared): its owner's work is ordered when it is
    // closed (a device-wide synchronisation), so there is nothing to record.
    if (imported(ptr)) return;
    // PyTorch passes any tensor's pointer, those of memory another library made (DLPack, NCCL's) included, which
    // its own allocator skips without a word: the last error names it, stderr once per process.
    set_errorf("fragless: record_stream of pointer %p that fragless did not allocate or already freed; nothing was "
               "changed", ptr);
    static std::atomic<bool> said{false};
    if (!said.exchange(true, std::memory_order_relaxed)) {
      std::fprintf(stderr, "%s (said once: PyTorch also passes the tensors other libraries allocated; "
                           "fragless_last_error names each)\n", fragless_last_error());
    }
  });
}

void fragless_begin_allocate_to_pool(int device, fragless_pool_id pool, std::function<bool(cudaStream_t)> filter) {
  guard("fragless_begin_allocate_to_pool", [&] {
    if (pool.first == 0 && pool.second == 0) {  // what memory_snapshot(mempool_id) takes for every pool
      set_error("fragless_begin_allocate_to_pool: pool id (0, 0) names the default pools, not a private one "
                "(PyTorch's graph and MemPool ids are never (0, 0)); nothing was routed");
      report_error();
      return;
    }
    DeviceEngine* e = engine(device);
    if (!e) return;
    // An empty filter is every stream, as the engine takes it (DeviceEngine::State::pool_set_for); calling
    // it would throw std::bad_function_call. A filter that throws is named by the allocation it fails.
    StreamFilter routed;
    if (filter)
      routed = [f = std::move(filter), pool](Stream s) {
        try {
          return f(reinterpret_cast<cudaStream_t>(s));
        } catch (abi::__forced_unwind&) {
          throw;
        } catch (const std::exception& x) {
          throw std::runtime_error("the stream filter of graph pool (" + std::to_string(pool.first) + ", " +
                                   std::to_string(pool.second) + ") threw: " + x.what() + "; nothing was allocated");
        } catch (...) {
          throw std::runtime_error("the stream filter of graph pool (" + std::to_string(pool.first) + ", " +
                                   std::to_string(pool.second) + ") threw something that is not a std::exception; "
                                   "nothing was allocated");
        }
      };
    e->begin_allocate_to_pool({pool.first, pool.second}, std::move(routed));
  });
}

void fragless_end_allocate_to_pool(int device, fragless_pool_id pool) {
  guard("fragless_end_allocate_to_pool", [&] {
    DeviceEngine* e = engine(device);
    if (!e) return;
    if (e->end_allocate_to_pool({pool.first, pool.second}) == Status::ok) return;
    set_errorf("fragless: end_allocate_to_pool: pool (%llu, %llu) of device %d has no allocation routed to it (no "
               "begin_allocate_to_pool for it, or ended already); nothing changed", pool.first, pool.second, device);
    report_error();
  });
}

void fragless_begin_allocate_stream_to_pool(int device, cudaStream_t stream, fragless_pool_id pool) {
  guard("fragless_begin_allocate_stream_to_pool", [&] {
    if (DeviceEngine* e = engine(device))
      e->begin_allocate_stream_to_pool({pool.first, pool.second}, reinterpret_cast<Stream>(stream));
  });
}

void fragless_end_allocate_stream_to_pool(int device, cudaStream_t stream) {
  guard("fragless_end_allocate_stream_to_pool", [&] {
    DeviceEngine* e = engine(device);
    if (!e) return;
    if (e->end_allocate_stream_to_pool(reinterpret_cast<Stream>(stream)) == Status::ok) return;
    set_errorf("fragless: end_allocate_stream_to_pool: stream %p of device %d allocates to no pool (no "
               "begin_allocate_stream_to_pool for it, or ended already); nothing changed",
               static_cast<void*>(stream), device);
    report_error();
  });
}

void fragless_release_pool(int device, fragless_pool_id pool) {
  guard("fragless_release_pool", [&] {
    DeviceEngine* e = engine(device);
    if (!e) return;
    AllocError err;
    const Status st = e->release_pool({pool.first, pool.second}, &err);
    if (st == Status::ok) return;
    set_error(err.message);  // a failed wait (Note [Failed waits]), or a pool with no use to release
    if (st == Status::invalid_argument) report_error();
  });
}

namespace {
// The engine a statistics call answers from: the device's, if it exists. A device not used yet has none, and
// none is created (nor its CUDA context retained): its statistics are zeros, as PyTorch's own are. nullptr
// with *bad for a device that does not exist.
DeviceEngine* stats_engine(int device, bool* bad) {
  Allocator* a = get();
  *bad = !a || device < 0 || device >= a->device_count();
  if (*bad) {
    if (a) set_errorf("fragless: invalid device %d (fragless manages %d devices)", device, a->device_count());
    return nullptr;
  }
  return a->existing(device);
}
}  // namespace

long fragless_memory_stats(int device, char* buf, size_t len) {
  return guarded("fragless_memory_stats", -1L, [&] {
    bool bad = false;
    DeviceEngine* e = stats_engine(device, &bad);
    if (bad) return -1L;
    std::string json = "{";
    DeviceStats zeros;  // a device not used yet: what its engine would start with
    const std::size_t split = get()->options().max_split_size;
    zeros.max_split_size = split == SIZE_MAX ? -1 : static_cast<std::int64_t>(split);
    for (const auto& [k, v] : (e ? e->stats() : zeros).flatten()) {
      if (json.size() > 1) json += ",";
      json += "\"" + k + "\":" + std::to_string(v);
    }
    json += "}";
    return copy_out(json, buf, len);
  });
}

int fragless_reset_peak_stats(int device) {
  return guarded("fragless_reset_peak_stats", -1, [&] {
    bool bad = false;
    DeviceEngine* e = stats_engine(device, &bad);
    if (bad) return -1;
    if (e) e->reset_peak_stats();
    return 0;
  });
}

int fragless_mem_get_info(int device, size_t* free_bytes, size_t* total_bytes) {
  return guarded("fragless_mem_get_info", -1, [&] {
    if (!free_bytes || !total_bytes) {  // named before any engine is made for the device
      set_errorf("fragless: mem_get_info(device %d): %s NULL; nothing was asked", device,
                 !free_bytes && !total_bytes ? "free_bytes and total_bytes are"
                 : !free_bytes               ? "free_bytes is"
                                             : "total_bytes is");
      return -1;
    }
    DeviceEngine* e = engine(device);
    if (!e) return -1;
    e->memory_info(free_bytes, total_bytes);
    return 0;
  });
}

int fragless_reset_accumulated_stats(int device) {
  return guarded("fragless_reset_accumulated_stats", -1, [&] {
    bool bad = false;
    DeviceEngine* e = stats_engine(device, &bad);
    if (bad) return -1;
    if (e) e->reset_accumulated_stats();
    return 0;
  });
}

namespace {
// What a sizing call of the snapshot keeps for the calling thread's next call (Note [Per-thread state at exit]).
struct SizedSnapshot {
  std::string pickle;
  bool with_history = false;
};
thread_local SizedSnapshot* t_sized = nullptr;

// Frees a thread's kept snapshot when the thread ends (after its thread_local destructors).
pthread_key_t sized_key() {
  static const pthread_key_t key = [] {
    pthread_key_t k{};
    pthread_key_create(&k, [](void* kept) {
      if (t_sized == kept) t_sized = nullptr;
      delete static_cast<SizedSnapshot*>(kept);
    });
    return k;
  }();
  return key;
}

void keep_sized(SizedSnapshot* s) {
  delete t_sized;
  t_sized = s;
  pthread_setspecific(sized_key(), s);
}

long snapshot_out(char* buf, size_t len, bool with_history) {
  // The buffer protocol asks twice, first for the size (no buffer); a million-entry history's pickle takes
  // seconds to build. So a sizing call keeps what it built for this thread's next call, which, when its buffer
  // is exactly the size that call gave plus the NUL (the protocol's second step) and asks the same kind,
  // gets that snapshot (the state when it was sized) instead of building another; any other call builds anew
  // and drops it.
  if (buf && len && t_sized) {
    std::unique_ptr<SizedSnapshot> s(t_sized);
    t_sized = nullptr;
    pthread_setspecific(sized_key(), nullptr);
    if (len == s->pickle.size() + 1 && s->with_history == with_history) return copy_out(s->pickle, buf, len);
  }
  Allocator* a = get();
  if (!a) return -1;
  std::vector<formats::DeviceState> devices;
  for (int d = 0; d < a->device_count(); ++d) {
    formats::DeviceState s;
    s.device = d;
    if (DeviceEngine* e = a->existing(d)) {
      s.segments = e->snapshot();
      s.imports = e->imports();
    }
    proc().sinks[static_cast<std::size_t>(d)]->collect(&s, with_history);
    // PyTorch records a snapshot entry (the active bytes it showed) after copying the history: the next
    // snapshot shows it, this one does not.
    if (DeviceEngine* e = a->existing(d)) {
      std::size_t active = 0;
      for (const SegmentInfo& sg : s.segments) active += sg.active_size;
      e->mark_snapshot(active);
    }
    devices.push_back(std::move(s));
  }
  std::string s = formats::engine_snapshot_pickle(devices, a->options().settings);
  const long n = copy_out(s, buf, len);
  if (!buf || !len) keep_sized(new SizedSnapshot{std::move(s), with_history});
  return n;
}
}  // namespace

long fragless_snapshot(char* buf, size_t len) {
  return guarded("fragless_snapshot", -1L, [&] { return snapshot_out(buf, len, true); });
}

long fragless_snapshot_segments(char* buf, size_t len) {
  return guarded("fragless_snapshot_segments", -1L, [&] { return snapshot_out(buf, len, false); });
}

namespace {
void record_history(size_t max_entries, int context, int stacks, bool clear) {
  Allocator* a = get();
  if (!a) return;
  std::lock_guard lk(*proc().history_mu);
  for (auto& s : proc().sinks) s->set_history(max_entries, context, stacks, clear);
  attach_sinks(proc(), *a);
}

bool stacks_valid(int stacks) { return (stacks & ~(stacks::python | stacks::cpp)) == 0; }
// A context that asks for frames with stacks 0 would record none without a word: refused.
bool frames_without_stacks(int context, int stacks, const char* fn) {
  if (context == 0 || stacks != 0) return false;
  set_errorf("fragless: %s: context %d asks for stack frames, but stacks 0 gathers none (1 python, 2 cpp, 3 both); "
             "nothing was changed", fn, context);
  return true;
}
}  // namespace

void fragless_record_history(size_t max_entries) {
  guard("fragless_record_history", [&] { record_history(max_entries, kContextNever, 0, false); });
}

void fragless_record_history_ex(size_t max_entries, int context, int stacks) {
  guard("fragless_record_history_ex", [&] {
    if (context < 0 || context > 2 || !stacks_valid(stacks)) {
      set_errorf("fragless: record_history_ex: context %d is not 0-2 (none, alloc, all) or stacks %d is not a mask "
                 "of 1 (python) and 2 (cpp); nothing was changed", context, stacks);
      return;
    }
    if (frames_without_stacks(context, stacks, "record_history_ex")) return;
    // Its context 1 (frames of allocations) and 2 (of frees too) are RecordContext's ALLOC and ALL.
    record_history(max_entries, context == 0 ? kContextNever : context == 1 ? kContextAlloc : kContextAll, stacks,
                   false);
  });
}

void fragless_record_history_v2(size_t max_entries, int context, int stacks, int clear_history) {
  guard("fragless_record_history_v2", [&] {
    if (context < kContextNever || context > kContextAll || !stacks_valid(stacks)) {
      set_errorf("fragless: record_history: context %d is not 0-3 (never, state, alloc, all) or stacks %d is not a "
                 "mask of 1 (python) and 2 (cpp); nothing was changed", context, stacks);
      return;
    }
    if (frames_without_stacks(context, stacks, "record_history")) return;
    record_history(max_entries, context, stacks, clear_history != 0);
  });
}

const char* fragless_last_error(void) { return t_last_error; }

void fragless_trace_flush(void) {
  guard("fragless_trace_flush", [&] {
    if (Allocator* a = get())
      if (const std::string lost = a->flush_traces(); !lost.empty()) set_error(lost);
  });
}

int fragless_device_count(void) {
  return guarded("fragless_device_count", -1, [&] {
    Allocator* a = get();
    return a ? a->device_count() : -1;
  });
}

// ---- Sharing across processes (engine.h, Note [Sharing] in engine/share.cpp) ----

struct fragless_share {
  SharedBlock block;
};

fragless_share* fragless_share_export(void* ptr) {
  return guarded("fragless_share_export", static_cast<fragless_share*>(nullptr), [&]() -> fragless_share* {
    DeviceEngine* e = owner(ptr);
    if (!e) {
      if (proc().ready.load(std::memory_order_acquire))  // else the last error says why there is no allocator
        set_error("fragless: share of a pointer fragless did not allocate (or already freed); nothing was shared");
      return nullptr;
    }
    auto s = std::make_unique<fragless_share>();
    AllocError err;
    if (e->share(ptr, &s->block, &err) != Status::ok) {
      set_error(err.message);
      return nullptr;
    }
    return s.release();
  });
}

size_t fragless_share_description(const fragless_share* s, const char** bytes) {
  if (bytes) *bytes = s ? s->block.description.data() : nullptr;
  return s ? s->block.description.size() : 0;
}

size_t fragless_share_fds(const fragless_share* s, const int** fds) {
  if (fds) *fds = s ? s->block.fds.data() : nullptr;
  return s ? s->block.fds.size() : 0;
}

void fragless_share_free(fragless_share* s) { delete s; }

void* fragless_open_shared(int device, const char* bytes, size_t len, const int* fds, size_t nfds, size_t* size) {
  return guarded("fragless_open_shared", static_cast<void*>(nullptr), [&]() -> void* {
    DeviceEngine* e = engine(device);
    if (!e) return nullptr;
    if (!bytes && len) {
      set_error("fragless: open_shared: no description");
      return nullptr;
    }
    AllocError err;
    void* p = e->open_shared(std::string(bytes ? bytes : "", len), fds, nfds, size, &err);
    if (!p) set_error(err.message);
    return p;
  });
}

int fragless_close_shared(void* ptr) {
  return guarded("fragless_close_shared", -1, [&] {
    Allocator* a = get();
    if (!a) return -1;
    AllocError err;
    for (int d = 0; d < a->device_count(); ++d)
      if (DeviceEngine* e = a->existing(d)) {
        AllocError mine;
        if (e->close_shared(ptr, &mine) == Status::ok) return 0;
        if (err.message.empty() || mine.status != Status::invalid_argument) err = mine;
      }
    set_error(err.message.empty() ? "fragless: close_shared of a pointer open_shared did not return" : err.message);
    return -1;
  });
}

size_t fragless_reap_shared(void) {
  return guarded("fragless_reap_shared", size_t{0}, [&] {
    size_t n = 0;
    if (Allocator* a = get())
      for (int d = 0; d < a->device_count(); ++d)
        if (DeviceEngine* e = a->existing(d)) n += e->reap_shared();
    return n;
  });
}

extern "C++" {
namespace {
// The first existing engine for which f succeeds; else the error of the last (an interior pointer has no
// owner lookup).
template <class F>
int on_some_engine(F f, const char* none) {
  Allocator* a = get();
  if (!a) return -1;
  AllocError err;
  for (int d = 0; d < a->device_count(); ++d)
    if (DeviceEngine* e = a->existing(d); e && f(*e, &err) == Status::ok) return 0;
  set_error(err.message.empty() ? none : err.message);
  return -1;
}
}  // namespace
}  // extern "C++"

int fragless_register_range(void* ptr, size_t size) {
  return guarded("fragless_register_range", -1, [&] {
    return on_some_engine([&](DeviceEngine& e, AllocError* err) { return e.register_range(ptr, size, err); },
                          "fragless: register_range: no device has been used yet");
  });
}

int fragless_deregister_range(void* ptr) {
  return guarded("fragless_deregister_range", -1, [&] {
    return on_some_engine([&](DeviceEngine& e, AllocError* err) { return e.deregister_range(ptr, err); },
                          "fragless: deregister_range: no device has been used yet");
  });
}

}  // extern "C"
