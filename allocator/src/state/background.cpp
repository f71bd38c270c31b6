#include "state/background.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <vector>

#include "fragless/driver.h"
#include "base/quiet_thread.h"
#include "fragless/spin_mutex.h"
#include "driver/host_fork.h"

namespace fragless {

namespace {

// Every live Background (one per device engine, a worker or not), for the fork() handlers. One registers
// itself when made and unregisters when destroyed, holding only this mutex, never the device lock;
// before_fork takes this mutex, then each device lock, so the order is always registry, then device.
std::mutex g_registry_mu;
Background* g_registry = nullptr;
std::atomic<std::uint64_t> g_fork_generation{0};  // bumped in every forked child
std::once_flag g_atfork_once;

// Locks held across fork() after the device locks (hold_across_fork), under g_registry_mu.
struct ForkLock {
  void (*lock)(void*);
  void (*unlock)(void*);
  void* arg;
};
std::vector<ForkLock>& fork_locks() {
  static auto* v = new std::vector<ForkLock>;  // never destroyed: a fork may come during exit
  return *v;
}

// Locks held across fork() before the registry's and the device locks (hold_across_fork_first), under
// g_first_mu, which before_fork takes first of all.
struct FirstLock {
  void (*lock)(void*);
  void (*unlock)(void*);
  void (*child)(void*);
  void* arg;
};
std::mutex g_first_mu;
std::vector<FirstLock>& first_locks() {
  static auto* v = new std::vector<FirstLock>;  // never destroyed, as fork_locks()
  return *v;
}

// What a forked child replaced and cannot destroy (Note [Device locks across fork]): the parent's condition
// variables (a waiter of the parent's may still count in one, and glibc's destroy waits for it) and the
// worker's std::thread (not there to join). Kept reachable from here, so that a leak checker does not count
// them, for the child's life.
struct Leftover {
  std::unique_ptr<std::condition_variable_any> work_cv, idle_cv;
  std::thread* thread;
  Leftover* next;
};
Leftover* g_leftovers = nullptr;

std::atomic<bool> g_installed{false};  // install_fork_handlers has registered them (Note [Handlers installed during a fork])

void install_fork_handlers() {
  std::call_once(g_atfork_once, [] {
    install_host_fork_handlers();  // first: its prepare handler must run after this one (host_fork.h)
    pthread_atfork(&Background::before_fork, &Background::after_fork_parent, &Background::after_fork_child);
    g_installed.store(true);
  });
}

}  // namespace

void hold_across_fork(void (*lock)(void*), void (*unlock)(void*), void* arg) {
  install_fork_handlers();
  std::lock_guard lk(g_registry_mu);
  for (const ForkLock& l : fork_locks())
    if (l.lock == lock && l.unlock == unlock && l.arg == arg) return;  // one registration (a child may make again)
  fork_locks().push_back({lock, unlock, arg});
}

void hold_across_fork_first(void (*lock)(void*), void (*unlock)(void*), void (*child)(void*), void* arg) {
  install_fork_handlers();
  std::lock_guard lk(g_first_mu);
  first_locks().push_back({lock, unlock, child, arg});
}

namespace {
// Locks of hold_across_fork_from_load, with a pthread_atfork handler of their own.
struct LoadLock {
  void (*lock)(void*);
  void (*unlock)(void*);
  void (*child)(void*);
  void* arg;
};
std::mutex g_load_mu;  // held from the prepare handler to the parent or child handler
std::vector<LoadLock>& load_locks() {
  static auto* v = new std::vector<LoadLock>;  // never destroyed, as fork_locks()
  return *v;
}
// Note [Fork handlers registered twice]
// The handlers are registered under std::call_once, and a child forked after pthread_atfork returned but before
// the once was marked done (another thread was registering them) runs that once again: the child's handlers
// are then registered twice, run twice at each of its forks, and the second prepare handler would wait for
// the locks its own thread took in the first. A depth per thread (the forking thread runs every handler of its
// fork) makes every run but the outer one do nothing.
thread_local int t_load_fork_depth = 0, t_fork_depth = 0;

// Note [Handlers installed during a fork]
// glibc (2.36 and later) lets pthread_atfork register while a fork runs its prepare handlers, and a handler
// registered then is not run for that fork, neither its prepare handler nor its parent or child one. The
// allocator's handlers are registered as the first allocator is made (after the driver's, see allocator.h),
// and that allocator may then be published, and a device's engine begun, before the fork that was already
// under way reaches its own end: its child found a device "being made" by a thread it does not have, and
// waited for ever (about one fork in fifty at random moments of the first calls, tests/capi/capi_fork.cpp).
// The handlers registered at load run in every fork, and their prepare handler runs last: it takes its
// locks (the making's among them, so nothing is published from then on) and then, when the allocator's
// handlers are installed but did not run in this fork (t_bg_ran), runs them itself, the workers' then the
// host driver's, as their own order would; its parent and child handlers, which run first, end them.
// The host driver's handlers may also be installed before the fork and the workers' during it (a host driver
// is made, installing its handlers, before its engine is, installing the workers'). The host driver's prepare
// handler has then run, and holds every host driver's locks, when this one finds the workers' not run; taking
// the device locks under them deadlocked: a thread that held a device lock called its driver under it (an
// allocation creating a handle) and waited for the driver's lock, while the forking thread waited for that
// device lock (a draw of fragless-capi-fork --random hung so; a worker's job in flight, which quiesce waits
// for, would do the same). The rule, in every order of installation and fork: no device lock is waited for
// while a host driver's lock is held. So where the host driver's prepare handler ran (host_fork_locks_held),
// this one lets its locks go, takes the device locks and takes the host driver's again. The host driver's own
// parent and child handlers end them; this one's, which run before those, end only the workers' (t_host_ours
// false): releasing the device locks first makes no cycle. Where the handlers run twice (Note [Fork handlers
// registered twice]), the outer run holds the host driver's locks, and they are let go and taken again without
// its depth changing. This is decided here, in the last prepare handler, rather than in the host driver's:
// whether the workers' handlers are installed (g_installed) may change between the two while the fork runs.
// "fork: the host driver's handlers installed before the fork and the workers' during it ..."
// (test_fork_locks.cpp) hung in 60 runs of 60 without this.
thread_local bool t_bg_ran = false;     // Background::before_fork ran in the fork under way on this thread
thread_local bool t_bg_ours = false;    // ...because load_locks_before_fork ran it
thread_local bool t_host_ours = false;  // ...and host_before_fork as well (the host driver's did not run)

void load_locks_before_fork() {
  if (t_load_fork_depth++) return;
  g_load_mu.lock();
  for (const LoadLock& l : load_locks()) l.lock(l.arg);
  if (g_installed.load() && !t_bg_ran) {
    t_bg_ours = true;
    t_host_ours = !host_fork_locks_held();
    if (!t_host_ours) host_let_go_in_fork();  // the device locks first
    Background::before_fork();
    t_host_ours ? host_before_fork() : host_take_again_in_fork();
  }
  // A trace writer begun before any engine (Note [Forking while a thread starts]); where the workers' handler
  // ran in this fork it closed the gate and waited already, so a thread that never begins costs one wait.
  close_thread_starts();
}
// The parent's and the child's ends are one but for what ends each lock (unlock, or the child's handler).
void load_locks_after_fork(bool child) {
  if (--t_load_fork_depth) return;
  child ? forget_starting_threads() : open_thread_starts();
  if (t_bg_ours) {
    t_bg_ours = false;
    if (t_host_ours) child ? host_after_fork_child() : host_after_fork_parent();
    t_host_ours = false;
    child ? Background::after_fork_child() : Background::after_fork_parent();
  }
  for (auto l = load_locks().rbegin(); l != load_locks().rend(); ++l) (child ? l->child : l->unlock)(l->arg);
  g_load_mu.unlock();
}
void load_locks_after_fork_parent() { load_locks_after_fork(false); }
void load_locks_after_fork_child() { load_locks_after_fork(true); }
std::once_flag g_load_atfork_once;
}  // namespace

void hold_across_fork_from_load(void (*lock)(void*), void (*unlock)(void*), void (*child)(void*), void* arg) {
  std::call_once(g_load_atfork_once,
                 [] { pthread_atfork(&load_locks_before_fork, &load_locks_after_fork_parent, &load_locks_after_fork_child); });
  std::lock_guard lk(g_load_mu);
  load_locks().push_back({lock, unlock, child, arg});
}

void stop_holding_across_fork(void* arg) {
  std::lock_guard lk(g_first_mu);
  auto& v = first_locks();
  v.erase(std::remove_if(v.begin(), v.end(), [arg](const FirstLock& l) { return l.arg == arg; }), v.end());
}

Background::Background(SpinMutex& mu, BackgroundMode mode)
    : mu_(mu),
      mode_(mode),
      work_cv_(std::make_unique<std::condition_variable_any>()),
      idle_cv_(std::make_unique<std::condition_variable_any>()) {
  install_fork_handlers();
  std::lock_guard lk(g_registry_mu);
  next_ = g_registry;
  g_registry = this;
}

Background::~Background() {
  stop();
  std::lock_guard lk(g_registry_mu);
  for (Background** p = &g_registry; *p; p = &(*p)->next_)
    if (*p == this) {
      *p = next_;
      break;
    }
}

void Background::wake() {
  work_ = true;
  if (mode_ != BackgroundMode::thread) return;
  if (!thread_ && !stop_) {
    fork_generation_ = g_fork_generation.load();
    thread_ = new std::thread(start_quiet_thread([this] { loop(); }));
    return;
  }
  work_cv_->notify_one();
}

void Background::quiesce() {
  if (!in_flight_) return;
  abort_.store(true, std::memory_order_relaxed);
  while (in_flight_) idle_cv_->wait(mu_);
  abort_.store(false, std::memory_order_relaxed);
}

void Background::begin_quiet() {
  ++quiet_;
  while (in_flight_) idle_cv_->wait(mu_);  // the job in flight finishes: what the driver holds matches the books
}

void Background::end_quiet() {
  if (--quiet_ == 0 && work_ && mode_ == BackgroundMode::thread) work_cv_->notify_one();
}

void Background::routing_changed(bool routed) {
  if (routed) quiesce();
  routed_ = routed;
  if (!routed && work_) work_cv_->notify_one();
}

void Background::stop() {
  std::thread* t = nullptr;
  if (mu_.held_by_this_thread()) {
    // Note [Exit while the lock is held]: the exit is running on a thread that holds the device lock, so
    // the worker can never take it again, and taking it here would never return. The flags are written
    // under the lock (this thread holds it), and the job in flight, if any, sees abort_ at its next driver
    // call; the worker is not woken (notifying touches the condition variable's own mutex, which the
    // interrupted code may hold) and not joined: it stays parked, waiting for the lock, until the process
    // ends.
    stop_ = true;
    abort_.store(true, std::memory_order_relaxed);
    t = thread_;
    thread_ = nullptr;
    if (t && fork_generation_ == g_fork_generation.load()) {  // (a forked child leaks it, as below)
      t->detach();
      delete t;
    }
    return;
  }
  {
    std::lock_guard lk(mu_);
    if (stop_ && !thread_) return;
    stop_ = true;
    abort_.store(true, std::memory_order_relaxed);
    work_cv_->notify_all();
    t = thread_;
    thread_ = nullptr;
  }
  if (!t) return;
  if (fork_generation_ != g_fork_generation.load()) return;  // a forked child: that thread is not here
  if (t->get_id() == std::this_thread::get_id()) {  // the worker itself (exit() from a sink it called)
    t->detach();
    delete t;
    return;
  }
  t->join();
  delete t;
}

bool Background::run_one(bool manual) {
  if (!may_take() || !work_source_) return false;  // the work waits for the routing (or the fork) to end
  // One job at a time (job_ is the one in flight): a manual step while another runs, from another thread or
  // from inside the job's own driver calls, does nothing.
  if (in_flight_) return false;
  BackgroundJob& job = job_;
  job.reset();
  if (!work_source_->take_background_job(&job)) {
    work_ = false;
    return false;
  }
  in_flight_ = true;
  mu_.unlock();
  work_source_->run_background_job(job, abort_, manual);
  mu_.lock();
  work_source_->finish_background_job(job);
  in_flight_ = false;
  idle_cv_->notify_all();
  return true;
}

double Background::step(double budget_us) {
  if (mode_ != BackgroundMode::manual || budget_us <= 0 || !work_source_) return 0;
  BackgroundCalls counted;
  double spent = 0;
  std::lock_guard lk(mu_);
  while (work_ && spent < budget_us) {
    const double before = driver_->background_us();
    if (!run_one(/*manual=*/true)) break;
    spent += driver_->background_us() - before;
  }
  return spent;
}

void Background::drain() {
  std::lock_guard lk(mu_);
  while (mode_ == BackgroundMode::thread && thread_ && (work_ || in_flight_) && may_take()) idle_cv_->wait(mu_);
}

void Background::loop() {
  {
    BackgroundCalls counted;
    std::lock_guard lk(mu_);
    for (;;) {
      // A forked child whose one thread is this one (a sink forked during a finish): the loop ends, and the
      // child with it (Note [Device locks across fork]).
      if (fork_generation_ != g_fork_generation.load()) break;
      while (!stop_ && !(work_ && may_take())) {
        idle_cv_->notify_all();  // drain() waits for this
        work_cv_->wait(mu_);
      }
      if (stop_) break;
      run_one(/*manual=*/false);
    }
    idle_cv_->notify_all();
  }
}

// Note [Device locks across fork]: as glibc's malloc holds its arenas' locks across fork(), the prepare
// handler takes every device's lock and holds it until the parent or child handler: no other thread is
// inside a device's books at the fork, so the child finds every lock free and the books whole (a DataLoader
// worker forked while another thread of the parent allocated would otherwise wait for ever at its first
// allocation, or at its exit, freeing what it inherited). The order is the registry's; no code holds two
// device locks at once, so no cycle can form (an event sink that calls into another device would break
// that: sinks must not). The cost: a fork waits for a slow path in progress (a cuMemCreate of GiBs, the
// synchronisation of empty_cache), on every device, CUDA ones included, where a child cannot use CUDA but
// may still free what it inherited. Nothing may call pthread_atfork under a device lock (glibc holds its
// own handler lock from the prepare handlers to the parent and child ones): the handlers are installed when
// a Background is made, never under its lock. A lock the forking thread holds itself (fork() from an event
// sink) is not taken again, and its worker is paused but not waited for, since waiting would release that
// lock under the code that holds it. The child goes on holding it, as that thread did; the job that was in
// flight, if any, is lost to it: its range stays busy, out of every pool, for the child's life (job_lost_),
// and nothing in the child waits for it. A sink that forks on the worker thread itself (during a job's
// finish) leaves a child whose one thread is that worker: it returns from the sink into the loop, which ends,
// and with it the child (exit status 0). A fork from a signal handler that interrupted fragless is not
// covered (fork() is not async-signal-safe; the host driver's own locks would then deadlock the fork).
// After the device locks the prepare handler takes the locks added with hold_across_fork (allocator.h: an
// event sink's own, the stack tables'), in order, and the parent and child handlers release them first,
// in reverse; their rules (taken under a device lock or with none held, never held while taking one) keep
// the order acyclic. After the registry's mutex and before the device locks it takes the locks added with
// hold_across_fork_first (each allocator's creation lock, Note [Creating an engine]), which the parent and
// child handlers release last. Such a lock is never held while its holder waits for anything another thread
// may hold (a device lock, the registry's mutex): a fork from an event sink, which holds a device lock
// already, may wait for it too. The child makes every engine new condition variables and keeps the old ones in
// g_leftovers, reachable and never destroyed: the worker may have waited on one, and so may a thread of the
// parent's woken from begin_quiet just before the fork (glibc counts it until it leaves the wait; it may even
// hold the condition variable's own mutex).
void Background::before_fork() {
  if (t_fork_depth++) return;  // Note [Fork handlers registered twice]
  t_bg_ran = true;             // Note [Handlers installed during a fork]
  g_first_mu.lock();  // held until the parent or child handler, as are the locks it lists
  g_registry_mu.lock();  // held until the parent or child handler: no engine is made or destroyed meanwhile
  for (const FirstLock& l : first_locks()) l.lock(l.arg);
  for (Background* b = g_registry; b; b = b->next_) {
    if (b->mu_.held_by_this_thread()) {
      b->fork_paused_ = true;
      continue;
    }
    b->mu_.lock();
    b->fork_locked_ = true;
    b->quiesce();
    b->fork_paused_ = true;
  }
  for (const ForkLock& l : fork_locks()) l.lock(l.arg);
  close_thread_starts();  // Note [Forking while a thread starts]: no thread of ours begins from here on
}

void Background::after_fork_parent() {
  if (--t_fork_depth) return;
  t_bg_ran = false;
  open_thread_starts();
  for (auto l = fork_locks().rbegin(); l != fork_locks().rend(); ++l) l->unlock(l->arg);
  for (Background* b = g_registry; b; b = b->next_) {
    b->fork_paused_ = false;
    if (b->work_) b->work_cv_->notify_one();
    if (b->fork_locked_) {
      b->fork_locked_ = false;
      b->mu_.unlock();
    }
  }
  g_registry_mu.unlock();
  for (auto l = first_locks().rbegin(); l != first_locks().rend(); ++l) l->unlock(l->arg);
  g_first_mu.unlock();
}

void Background::after_fork_child() {
  if (--t_fork_depth) return;
  t_bg_ran = false;
  g_fork_generation.fetch_add(1);
  forget_starting_threads();
  for (auto l = fork_locks().rbegin(); l != fork_locks().rend(); ++l) l->unlock(l->arg);
  // Only the forking thread exists here: the workers are gone, and so is their work.
  for (Background* b = g_registry; b; b = b->next_) {
    b->mu_.forget_waiters();
    b->fork_paused_ = false;
    b->quiet_ = 0;  // a reader of the parent's waiting for a job is not here
    if (b->mode_ == BackgroundMode::thread) b->mode_ = BackgroundMode::off;  // none is started here either
    if (b->in_flight_) {  // only where the forking thread held the lock: the job's thread is not here
      b->in_flight_ = false;
      b->job_lost_ = true;
    }
    b->work_ = false;
    // New condition variables for every engine: the worker may have been waiting on one, and so may a
    // thread of the parent's that waited for a job (begin_quiet, quiesce), woken by its end but not yet out
    // of the wait at the fork (it may even hold the condition variable's own mutex).
    g_leftovers = new Leftover{std::move(b->work_cv_), std::move(b->idle_cv_), b->thread_, g_leftovers};
    b->thread_ = nullptr;  // there is no thread to join
    b->work_cv_ = std::make_unique<std::condition_variable_any>();
    b->idle_cv_ = std::make_unique<std::condition_variable_any>();
    if (b->fork_locked_) {
      b->fork_locked_ = false;
      b->mu_.unlock();
    }
  }
  g_registry_mu.unlock();
  for (auto l = first_locks().rbegin(); l != first_locks().rend(); ++l) l->child(l->arg);
  g_first_mu.unlock();
}

}  // namespace fragless
