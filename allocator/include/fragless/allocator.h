// The process-wide allocator: one DeviceEngine per device, built from Options (FRAGLESS_CONF).
//
// A device's engine (and with the cuda driver, its retained primary context) is created on that device's
// first use, as PyTorch creates its per-device allocator state: a process that only ever touches GPU 3 holds
// no context on GPUs 0-2 (a context costs hundreds of MiB of device memory).
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fragless/config.h"
#include "fragless/engine.h"
#include "fragless/tracer.h"

namespace fragless {

// Builds the driver `opts.driver` for one device; nullptr with *error set when it cannot.
std::unique_ptr<Driver> make_driver(const Options& opts, int device, std::string* error);

// Whether opts.driver can start on this machine, creating nothing (no engine, no context): the cuda driver
// needs libcuda and at least one device; host and sim always can, with options they take (the host driver
// refuses shareable_handles:fabric). False with *error saying why, as make_driver would.
bool driver_available(const Options& opts, std::string* error);

// The most devices an Allocator for `opts` has a use for: as many as the driver reports (the cuda driver), or
// kMaxDevices with a driver that reports none (host and sim, whose devices are all alike; PyTorch's device
// index, c10::DeviceIndex, is an int8_t). -1 with *error set when the driver cannot tell. The C ABI refuses a
// larger count (Note [Device counts], torch_plugin/capi.cpp).
constexpr int kMaxDevices = 128;
int device_limit(const Options& opts, std::string* error);
// The devices an allocator made for "as many as the driver has" gets: the driver's count, or 1 for a driver
// without one (host, sim); negative with *error when the driver cannot say.
int default_device_count(const Options& opts, std::string* error);

// A lock of code built on fragless (an event sink's own, a table a stack capture fills) that a forked child
// must find free (Note [Device locks across fork], state/background.cpp): fork() takes each, in the order
// added, after every device's lock, and releases them, in the reverse order, in the parent and in the child
// (on its one thread, the one that took them). Add a lock that is taken under a device lock (an event
// sink's) or with none held; never one held while a device lock is taken, nor one held while waiting for
// something the forking thread may hold (the GIL while Python forks: a lock taken with the GIL held is
// fine), and never one a thread may fork while holding (unlike a device lock, which a fork from its own
// event sink skips, such a lock would be waited for by the thread that holds it). For the life of the
// process: there is no removal, so `arg` must outlive every fork. The same lock added again is not added twice.
void hold_across_fork(void (*lock)(void*), void (*unlock)(void*), void* arg);
// A lock that fork() takes after the fork registry's mutex and before every device's lock, and releases after
// them: one whose holder never waits for anything another thread may hold while it waits for this lock (no
// device lock but one no other thread can reach yet, no registry mutex, no driver call, no pthread_atfork;
// the allocator's creation lock, Note [Creating an engine]), so that every fork may wait for it, one from an
// event sink too. In the child, `child` runs in place of `unlock`. stop_holding_across_fork(arg) removes
// every entry for arg; call it before arg goes away, from a thread that holds none of these locks.
void hold_across_fork_first(void (*lock)(void*), void (*unlock)(void*), void (*child)(void*), void* arg);
void stop_holding_across_fork(void* arg);

// A lock that fork() holds whose holder never waits for anything (takes no other lock, calls no driver, no
// pthread_atfork), so that it may be taken in any order with every other fork handler, the CUDA driver's
// included: registered with a pthread_atfork handler of its own, which may be installed when a library loads,
// before the driver is (the allocator's own handlers, above, are installed once the driver is loaded, so that
// their prepare handler runs before any the driver registers, which may take the driver's locks while ours
// wait for a device lock whose holder is inside a driver call). In the child, `child` runs in place of
// `unlock`. For the life of the process.
void hold_across_fork_from_load(void (*lock)(void*), void (*unlock)(void*), void (*child)(void*), void* arg);

// Something a process makes once, at its first use, with no lock held while it is made (the C ABI's and the
// interposer's allocator: reading the configuration, opening the trace files, loading libcuda and cuInit),
// so that fork() never waits for it, and a child forked while another thread was making it makes its own
// (Note [Making the allocator once], allocator.cpp). Construct it where no other thread can reach it yet (a
// library's constructor) and never destroy it.
class MakeOnce {
 public:
  // The right to make it: true for the one caller that makes it now, holding nothing of ours. That caller
  // ends with made(publish); if it leaves otherwise (an exception, a thread's cancellation), the next caller
  // makes it. False when it was made already (a caller that found another thread making it waited for it),
  // or when the caller is that thread (a call from inside the making, which must not wait for itself).
  class Turn {
   public:
    explicit operator bool() const { return once_ != nullptr; }
    // What was made put where callers find it (moves and stores only, no waiting), under the lock, so a
    // fork sees all of it or none.
    template <typename Publish>
    void made(Publish&& publish) {
      std::lock_guard lk(once_->mu_);
      publish();
      once_->state_ = State::made;
      once_->cv_->notify_all();
      once_ = nullptr;
    }
    // Whether this making follows one that a fork took from the child (this process is that child).
    bool after_lost_making() const { return once_ && once_->lost_; }
    Turn(Turn&& o) noexcept : once_(o.once_) { o.once_ = nullptr; }
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    Turn& operator=(Turn&&) = delete;
    ~Turn() {
      if (once_) once_->abandon();
    }

   private:
    friend class MakeOnce;
    explicit Turn(MakeOnce* once) : once_(once) {}
    MakeOnce* once_;
  };

  MakeOnce();
  MakeOnce(const MakeOnce&) = delete;
  MakeOnce& operator=(const MakeOnce&) = delete;
  Turn begin();

 private:
  enum class State { not_made, making, made };
  void abandon();
  static void lock_for_fork(void* self);
  static void unlock_for_fork(void* self);
  static void child_after_fork(void* self);
  std::mutex mu_;
  State state_ = State::not_made;
  bool lost_ = false;  // a making was lost to a fork (in this child)
  std::thread::id maker_;
  std::unique_ptr<std::condition_variable> cv_;
};

// For a making that follows one lost to a fork (MakeOnce::Turn::after_lost_making, in that child): the trace
// is turned off, saying so on stderr, unless its path has a %p (the lost making may have opened the parent's
// file, Note [Making the allocator once]).
void forked_child_traces_not(Options* opts);

class Allocator {
 public:
  // An allocator for `devices` devices (-1: as many as the cuda driver reports; 1 for host and sim). No
  // engine exists yet; device 0's is created at once only when `eager` (tools and tests that want the
  // driver's errors up front). A trace file that cannot be opened is an error when `eager`; otherwise (made
  // inside a program's first allocation) the process goes on untraced, said on stderr.
  static std::unique_ptr<Allocator> create(const Options& opts, int devices, std::string* error, bool eager = true);

  int device_count() const { return static_cast<int>(slots_.size()); }
  // The engine of device d, created on first use (one atomic load once it exists). nullptr for an invalid
  // device or when the engine cannot be created; *error then says why (the reason is kept: a device whose
  // driver failed is not retried).
  DeviceEngine* device(int d, std::string* error = nullptr);
  // The engine of device d if it exists; never creates one (walks over every device: owner lookups,
  // empty_cache, snapshots).
  DeviceEngine* existing(int d) const {
    return d >= 0 && d < device_count() ? slots_[static_cast<std::size_t>(d)].load(std::memory_order_acquire) : nullptr;
  }
  // f(d, engine) for each engine, now for those that exist (on this thread, holding no lock of the allocator's)
  // and as the others are created (under the creation lock, before the engine is published); f must not
  // throw, nor take any lock but the engine's own. Each engine gets the newest f, provided that calls of
  // on_engine_created do not overlap (the caller's to serialise: the C ABI's history calls are).
  void on_engine_created(std::function<void(int, DeviceEngine&)> f);
  const Options& options() const { return opts_; }
  // Hands every buffered trace record to the writers and waits until they are written. Returns "" when every
  // record so far is in its file, else what Tracing::losses() says (records a failed write or a removed file
  // lost).
  std::string flush_traces();
  // Stops every engine's background worker for good (DeviceEngine::stop_background): at process exit. Does
  // nothing in a forked child, which has no worker of ours, and where a lock another thread of the parent
  // held at the fork is never released.
  void stop_background();
  // Whether this process is a fork of the one that created the allocator.
  bool forked_child() const;
  // What an exit handler does for an allocator that is never destroyed (C ABI, CPU allocator, interposer):
  // the workers stop (stop_background), the tracer's writer threads are joined and each later record is
  // written as it comes (Note [Tracing at exit], tracer.cpp), then the traces are written, the workers' last
  // records included. No thread of fragless is left, and the trace ends with every event, the frees made by
  // static destructors after this handler included. An engine whose lock the exiting thread holds is left
  // as it is (Note [Exit while the lock is held]). In a forked child it does nothing: its writer threads
  // and workers are not there, and its trace records are dropped (Note [Tracing in a forked child]).
  void at_exit();
  std::vector<std::string> trace_paths() const;
  // The tracer's sink for a device (nullptr when tracing is off), for callers that chain sinks.
  EventSink* trace_sink(int device) { return tracing_ ? tracing_->sink(device) : nullptr; }

  ~Allocator();

 private:
  Allocator() = default;
  Options opts_;
  std::unique_ptr<Tracing> tracing_;  // before the engines: outlives them (their teardown is traced too)
  std::vector<std::atomic<DeviceEngine*>> slots_;
  std::vector<std::unique_ptr<DeviceEngine>> owned_;  // in creation order
  std::vector<std::string> failed_;                   // per device: why its engine could not be created
  std::function<void(int, DeviceEngine&)> created_;
  // Note [Creating an engine]: guards the members above and creating_ for short sections only; held across
  // fork() (hold_across_fork_first).
  mutable std::mutex create_mu_;
  std::vector<char> creating_;  // per device: a thread is making its driver and engine, with no lock held
  std::unique_ptr<std::condition_variable> created_cv_ = std::make_unique<std::condition_variable>();
  static void lock_for_fork(void* a);
  static void unlock_for_fork(void* a);
  static void forked_child_for_fork(void* a);
  long creator_pid_ = 0;  // getpid() at creation
  std::atomic<bool> exiting_{false};  // at_exit has begun: engines created later get no background worker
  std::atomic<int> publishing_{0};    // device() between deciding an engine gets a worker and publishing it
};

}  // namespace fragless
