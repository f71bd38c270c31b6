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
#include <vector>

#include "fragless/config.h"
#include "fragless/engine.h"
#include "fragless/tracer.h"

namespace fragless {

// Builds the driver `opts.driver` for one device; nullptr with *error set when it cannot.
std::unique_ptr<Driver> make_driver(const Options& opts, int device, std::string* error);

// Whether opts.driver can start on this machine, creating nothing (no engine, no context): the cuda driver
// needs libcuda and at least one device; host and sim always can. False with *error saying why.
bool driver_available(const Options& opts, std::string* error);

// A lock of code built on fragless (an event sink's own, a table a stack capture fills) that a forked child
// must find free (Note [Device locks across fork], state/background.cpp): fork() takes each, in the order
// added, after every device's lock, and releases them, in the reverse order, in the parent and in the child
// (on its one thread, the one that took them). Add a lock that is taken under a device lock (an event
// sink's) or with none held; never one held while a device lock is taken, nor one held while waiting for
// something the forking thread may hold (the GIL while Python forks: a lock taken with the GIL held is
// fine), and never one a thread may fork while holding (unlike a device lock, which a fork from its own
// event sink skips, such a lock would be waited for by the thread that holds it). For the life of the
// process: there is no removal, so `arg` must outlive every fork.
void hold_across_fork(void (*lock)(void*), void (*unlock)(void*), void* arg);
// A lock that fork() takes after the fork registry's mutex and before every device's lock, and releases after
// them: one whose holder never waits for anything another thread may hold while it waits for this lock (no
// device lock but one no other thread can reach yet, no registry mutex, no driver call, no pthread_atfork;
// the allocator's creation lock, Note [Creating an engine]), so that every fork may wait for it, one from an
// event sink too. In the child, `child` runs in place of `unlock`. stop_holding_across_fork(arg) removes
// every entry for arg; call it before arg goes away, from a thread that holds none of these locks.
void hold_across_fork_first(void (*lock)(void*), void (*unlock)(void*), void (*child)(void*), void* arg);
void stop_holding_across_fork(void* arg);

class Allocator {
 public:
  // An allocator for `devices` devices (-1: as many as the cuda driver reports; 1 for host and sim). No
  // engine exists yet; device 0's is created at once only when `eager` (tools and tests that want the
  // driver's errors up front).
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
  // Hands every buffered trace record to the writers and waits until they are written.
  void flush_traces();
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
