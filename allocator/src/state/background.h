// The background worker: driver work that no caller waits for, done by one thread per device (or, in the
// replay and in tests, by whoever calls step()). The policy says what the work is (BackgroundWork, which
// policy/policy.h implements); this file says how it runs and what it may not do.
//
// Note [Background work]
// A job goes through three steps, and passes its values from one to the next:
//   take   (device lock held)  the policy picks the work and takes what it needs out of the engine's
//                              hands (a busy block: no pool holds it, no request can use it), and records
//                              the event the split will wait for (Note [Destroyed streams]);
//   run    (no lock)           the memory calls, and nothing else: the job touches no engine state;
//   finish (device lock held)  the policy puts the results into the engine's books.
// The rules:
//  - no memory call (create, map, set-access, unmap, release) is made while the device lock is held by
//    background work, so a request never waits behind a background cuMemCreate: it waits at most for a
//    take or a finish, which are bookkeeping and event calls (a take records an event on the block's stream,
//    or queries a destroyed stream's; a lent range's finish releases its event);
//  - no job is taken while a pool routing is active (Note [Capture rules]): a capture may be under way, and
//    a job records and queries events. begin_allocate_to_pool first waits for the job in flight, asking it
//    to stop at its next driver call;
//  - empty_cache, the OOM retry and teardown do the same (quiesce), so what they give back includes what a
//    job held, and nothing runs behind the engine's back while it releases or dies; the worker never
//    outlives the engine (stop() joins it), and at process exit the C ABI, the CPU allocator and the
//    interposer, whose engines live on, stop it (DeviceEngine::stop_background); an exit on a thread that
//    holds the device lock detaches it instead (Note [Exit while the lock is held]);
//  - across fork(): the prepare handler takes every device lock, waits for the job in flight and pauses
//    every worker, so the child inherits no half-done job and no lock held (Note [Device locks across
//    fork], background.cpp); the worker does not exist in the child, which does no background work;
//  - a job that fails (a create refused, an event that cannot be recorded) leaves the engine consistent:
//    the range is given back or left as it was. The memory is then simply not there, and the request that
//    needs it grows or runs out of memory on its own path, with its own retry chain.
// Driver calls made by background work are counted apart (driver.h, BackgroundCalls), so a replay can tell
// what a caller waited for from what it did not.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <thread>

#include <utility>
#include <vector>

#include "fragless/config.h"
#include "fragless/driver.h"

namespace fragless {

class SpinMutex;
struct Segment;
struct Block;

// One unit of background work (Note [Background work]), passed by value from its take to
// its run and its finish.
struct BackgroundJob {
  enum class Kind : std::uint8_t { none, split, unmap_lent, memory_info, reserve } kind = Kind::none;
  Segment* segment = nullptr;
  Block* busy = nullptr;             // the range, held out of every pool while the job runs
  std::size_t first = 0, pages = 0;  // the range, in segment pages (reserve: pages to create)
  DevicePtr va = 0;                  // its address
  PhysHandle handle = 0;             // split: the multi-page handle mapped there (the driver's value)
  PhysHandle alias = 0;              // split: the engine's name for it while the job runs (Note [Handle aliases])
  Stream stream = 0;                 // whose queued work used the range
  std::vector<PhysHandle> created;   // split: the new handles, in address order; reserve: the new pages
  std::vector<std::size_t> sizes;    // split: their pages (Note [Split in the background])
  // split, given back: what its undo could not give the driver (a new handle's release, the unmap of the
  // new pieces' range), for the engine's deferred releases and unmaps (finish)
  std::vector<PhysHandle> unreleased;
  std::vector<std::pair<DevicePtr, std::size_t>> still_mapped;  // mapping by mapping
  bool to_pages = false;             // split: the handle is a piece of an earlier split: make pages
  Event event = 0;                   // unmap_lent: the event the range's old mapping waits for; split: the
                                     // event recorded on `stream` at the take (when `waits`)
  bool waits = false;                // split: `event` was recorded (and run releases it)
  std::uint64_t id = 0;              // unmap_lent: the range; memory_info: the policy's answers so far
  std::atomic<int>* claim = nullptr; // unmap_lent: the range's state, which the run sets when it lets go
  std::size_t free_bytes = 0, total_bytes = 0;  // memory_info: the driver's answer
  std::uint64_t changes = 0;                    // memory_info: the driver's memory_changes() when taken
  // How it ended: done; cancelled (nothing changed, the range as it was); gave back (the range is unmapped
  // and its old handle released, or handed to the deferred releases when release_failed).
  enum class Outcome : std::uint8_t { cancelled, done, gave_back } outcome = Outcome::cancelled;
  bool release_failed = false;      // split: the old handle's release
  bool create_refused = false;      // reserve: the driver refused a page

  // A new job's values, keeping the lists' storage: the worker takes every job into the same object, so a
  // split's lists are not allocated and freed again for each one (the replay makes tens of thousands).
  void reset() {
    auto emptied = [](auto& v) {
      auto kept = std::move(v);
      kept.clear();
      return kept;
    };
    auto c = emptied(created);
    auto s = emptied(sizes);
    auto u = emptied(unreleased);
    auto m = emptied(still_mapped);
    *this = BackgroundJob{};
    created = std::move(c);
    sizes = std::move(s);
    unreleased = std::move(u);
    still_mapped = std::move(m);
  }
};

// What the worker runs: the three steps of Note [Background work]. The policy implements it
// (policy/policy.h), so this layer, below the policies, calls them without knowing them.
class BackgroundWork {
 public:
  virtual ~BackgroundWork() = default;
  // Under the device lock: the next job, false when there is none.
  virtual bool take_background_job(BackgroundJob*) = 0;
  // Without the lock: the job's driver calls; it stops early when `abort` is set. `manual`: the caller
  // steps the background by hand and must not be kept waiting for the GPU.
  virtual void run_background_job(BackgroundJob&, const std::atomic<bool>& abort, bool manual) = 0;
  // Under the device lock: the job's results into the engine's books.
  virtual void finish_background_job(BackgroundJob&) = 0;
};


class Background {
 public:
  // `mu` is the device lock; the work set by set_work() does the jobs. Nothing runs until wake().
  Background(SpinMutex& mu, BackgroundMode mode);
  ~Background();  // stops the worker
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;

  // `work` does the jobs; `driver` counts their driver time (step()).
  void set_work(BackgroundWork* work, Driver* driver) {
    work_source_ = work;
    driver_ = driver;
  }
  BackgroundMode mode() const { return mode_; }
  bool in_flight() const { return in_flight_; }  // device lock held
  // In a forked child: the job in flight at the fork ran on a thread the child does not have; its range
  // stays busy (Note [Device locks across fork]).
  bool job_lost() const { return job_lost_; }
  // Device lock held: jobs run now without starting anything (manual mode, or a worker thread that exists).
  bool running() const { return mode_ == BackgroundMode::manual || (mode_ == BackgroundMode::thread && thread_); }

  // Device lock held: there is work. Starts the worker on first use (thread mode) and wakes it.
  void wake();
  // Device lock held: returns once no job is in flight, asking the one in flight to stop early; the lock
  // is released while waiting.
  void quiesce();
  // Device lock held: routing (begin/end_allocate_to_pool) changed; while `routed` (a pool routing is active)
  // the worker takes no new job, and it resumes when routing is over.
  void routing_changed(bool routed);
  // Stops and joins the worker (device lock not held). Idempotent. When the calling thread holds the device
  // lock (an exit from a signal handler or an event sink: Note [Exit while the lock is held]), the worker is
  // told to stop and detached instead, left waiting for a lock that is never released.
  void stop();

  // Manual mode: runs jobs on the calling thread (device lock not held) until `budget_us` of modelled driver
  // time has gone into them or there is no work; returns the time spent (it may exceed the budget by the
  // last job's cost). In the other modes it does nothing and returns 0.
  double step(double budget_us);
  // Thread mode, for tests: waits (device lock not held) until there is no work left and no job in flight.
  void drain();
  // For a reading that must find the books and the driver agreeing (DeviceEngine::memory_info): begin_quiet
  // waits for the job in flight, if any, and no job starts until end_quiet, so a reader waits for one job at
  // most, never for a queue of them. Device lock held across both.
  void begin_quiet();
  void end_quiet();

  // Whether a job should stop at its next driver call.
  const std::atomic<bool>& abort_flag() const { return abort_; }

  // fork() handlers (pthread_atfork), over every live Background: they hold every device lock across the
  // fork (Note [Device locks across fork], background.cpp).
  static void before_fork();
  static void after_fork_parent();
  static void after_fork_child();

 private:
  void loop();
  bool run_one(bool manual);  // takes, runs and finishes one job; false when there was none
  BackgroundJob job_;         // the job in flight, or the last one (BackgroundJob::reset)
  bool may_take() const { return !stop_ && !routed_ && !fork_paused_ && quiet_ == 0; }

  SpinMutex& mu_;
  BackgroundWork* work_source_ = nullptr;
  Driver* driver_ = nullptr;
  BackgroundMode mode_;
  // Waited on with mu_. On the heap: a forked child keeps them, never destroyed (a thread of the parent's may
  // have been waiting on one, and glibc's destroy would wait for it for ever), and makes new ones.
  std::unique_ptr<std::condition_variable_any> work_cv_, idle_cv_;
  bool work_ = false;         // a wake() since the policy last ran out of jobs
  bool in_flight_ = false;    // a job is between take and finish
  bool job_lost_ = false;     // in a forked child: see job_lost()
  bool routed_ = false;       // a pool routing is active: no new job
  bool fork_paused_ = false;  // a fork() is under way: no new job
  int quiet_ = 0;             // readings between begin_quiet and end_quiet: no new job
  bool stop_ = false;
  std::atomic<bool> abort_{false};
  std::thread* thread_ = nullptr;  // kept, never joined, in a forked child (the thread is not there)
  std::uint64_t fork_generation_ = 0;  // of the process the thread was started in
  bool fork_locked_ = false;  // the fork's prepare handler took the device lock (Note [Device locks across fork])
  Background* next_ = nullptr;  // the registry of every live Background, for fork()
};

}  // namespace fragless
