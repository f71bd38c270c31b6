#include "fragless/allocator.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <thread>

#include "driver/registry.h"

namespace fragless {

std::unique_ptr<Driver> make_driver(const Options& opts, int device, std::string* error) {
  const DriverEntry& e = driver_entry(opts.driver);
  if (e.make) return e.make(opts, device, error);
  if (error) *error = e.missing;
  return nullptr;
}

bool driver_available(const Options& opts, std::string* error) {
  const DriverEntry& e = driver_entry(opts.driver);
  if (!e.make) {
    if (error) *error = e.missing;
    return false;
  }
  if (e.accepts && !e.accepts(opts, error)) return false;
  if (!e.device_count) return true;
  const int n = e.device_count(error);
  if (n == 0 && error) *error = std::string("fragless: the ") + e.name + " driver reports no device";
  return n > 0;
}

int device_limit(const Options& opts, std::string* error) {
  const DriverEntry& e = driver_entry(opts.driver);
  return e.make && e.device_count ? e.device_count(error) : kMaxDevices;
}

int default_device_count(const Options& opts, std::string* error) {
  const DriverEntry& e = driver_entry(opts.driver);
  return e.device_count ? e.device_count(error) : 1;
}

std::unique_ptr<Allocator> Allocator::create(const Options& opts, int devices, std::string* error, bool eager) {
  auto a = std::unique_ptr<Allocator>(new Allocator());
  a->opts_ = opts;
  a->creator_pid_ = static_cast<long>(getpid());
  if (devices < 0) {  // as many as the driver has
    devices = default_device_count(opts, error);
    if (devices < 0) return nullptr;
  }
  if (!opts.trace.empty()) {
    // A file another process is writing (two processes given one path, e.g. a process and a child forked
    // before either made its allocator) leaves this process untraced, said on stderr: its trace is a
    // diagnosis, not worth the process, and the other's file is not touched (Note [Opening a trace file]).
    // So does any file that cannot be opened when the allocator is made inside a program's first allocation
    // (eager false: the C ABI, the interposer), after the checks made when the configuration was given
    // (fragless_check_driver) had passed: a folder removed since, a disk full at that moment, a device whose
    // file the check could not foresee. Failing there would fail that allocation and every later one.
    bool busy = false;
    std::string why;
    a->tracing_ = Tracing::open(opts.trace, devices, policy_name(opts.policy), &why, &busy);
    if (!a->tracing_ && (busy || !eager)) {
      std::fprintf(stderr, "%s; process %d is not traced\n", why.c_str(), static_cast<int>(getpid()));
    } else if (!a->tracing_) {
      if (error) *error = why;
      return nullptr;
    }
  }
  a->slots_ = std::vector<std::atomic<DeviceEngine*>>(static_cast<std::size_t>(devices));
  a->failed_.resize(static_cast<std::size_t>(devices));
  a->creating_.resize(static_cast<std::size_t>(devices));
  a->owned_.reserve(static_cast<std::size_t>(devices));  // publishing an engine never reallocates
  hold_across_fork_first(&lock_for_fork, &unlock_for_fork, &forked_child_for_fork, a.get());
  if (eager && devices > 0 && !a->device(0, error)) return nullptr;
  return a;
}

Allocator::~Allocator() {
  stop_holding_across_fork(this);
  // Newest first; the tracer (a member declared before) outlives them all.
  while (!owned_.empty()) owned_.pop_back();
}

// Note [Creating an engine]
// A device's driver and engine are made with no lock held: loading libcuda, cuInit and retaining the primary
// context take from milliseconds to seconds, and may run code of the driver's own that we do not control (it
// may even register fork handlers, which must not happen while a lock the fork handlers take is held). The
// creation lock guards only the bookkeeping around it: whether the device has an engine, a reason it cannot
// have one, or a thread making one (creating_; the others wait on created_cv_, so a device is made once),
// and the publication of the engine, its event sinks included. No thread waits for another's lock while
// it holds it: publishing takes only the new engine's lock, which no other thread can reach yet,
// on_engine_created calls back the engines that exist after letting it go, and the exit handler and
// flush_traces walk the published engines without it. So fork() holds that lock (after the registry's
// mutex and before the device locks, hold_across_fork_first), and every fork may wait for it, one from an
// event sink (holding a device lock) too, so a child finds it free and the books whole; a creation another thread
// had under way is lost to the child (that thread is not there): the child forgets it was under way and
// makes the device's engine itself on first use, and what the lost one had made so far is leaked. Devices
// are made in parallel when several threads first use different devices at once. An engine made while the
// exit handler ran (at_exit, which stops the workers) gets no worker.
DeviceEngine* Allocator::device(int d, std::string* error) {
  if (DeviceEngine* e = existing(d)) return e;
  if (d < 0 || d >= device_count()) {
    if (error)
      *error = "fragless: invalid device " + std::to_string(d) + " (fragless manages " +
               std::to_string(device_count()) + " devices)";
    return nullptr;
  }
  const auto i = static_cast<std::size_t>(d);
  std::unique_lock lk(create_mu_);
  for (;;) {
    if (DeviceEngine* e = slots_[i].load(std::memory_order_acquire)) return e;
    if (!failed_[i].empty()) {
      if (error) *error = failed_[i];
      return nullptr;
    }
    if (!creating_[i]) break;
    created_cv_->wait(lk);
  }
  creating_[i] = 1;
  Options o = opts_;
  lk.unlock();
  if (exiting_.load(std::memory_order_relaxed)) o.background = BackgroundMode::off;  // Note [Exit while the lock is held]
  std::string err;
  std::unique_ptr<DeviceEngine> made;
  const auto made_or_not = [&] {  // the lock again, and the waiters told, whatever happened
    lk.lock();
    creating_[i] = 0;
    created_cv_->notify_all();
  };
  try {
    if (auto drv = make_driver(o, d, &err)) made = std::make_unique<DeviceEngine>(o, std::move(drv));
  } catch (...) {
    made_or_not();
    throw;
  }
  made_or_not();
  if (!made) {
    failed_[i] = err.empty() ? "fragless: cannot create the driver of device " + std::to_string(d) : err;
    if (error) *error = failed_[i];
    return nullptr;
  }
  // The exit handler walks slots_ without this lock (at_exit). It sets exiting_ and then waits for
  // publishing_ to be 0; this counts itself in publishing_ and then reads exiting_ (all sequentially
  // consistent): either it waits for this engine to be in slots_, or this sees the exit and stops the
  // engine's worker before anyone can reach it (it never starts).
  publishing_.fetch_add(1, std::memory_order_seq_cst);
  if (exiting_.load(std::memory_order_seq_cst)) made->stop_background();
  DeviceEngine* e = made.get();
  owned_.push_back(std::move(made));  // capacity for every device, reserved at creation: does not throw
  // Under the creation lock only the new engine's own lock is taken: no other thread can reach it yet (a fork
  // takes the device locks after this lock).
  if (tracing_) e->set_event_sink(tracing_->sink(d));
  if (created_) [&]() noexcept { created_(d, *e); }();
  slots_[i].store(e, std::memory_order_release);
  publishing_.fetch_sub(1, std::memory_order_seq_cst);  // after the slot: an exit that sees 0 sees the slot
  return e;
}

void Allocator::lock_for_fork(void* a) { static_cast<Allocator*>(a)->create_mu_.lock(); }
void Allocator::unlock_for_fork(void* a) { static_cast<Allocator*>(a)->create_mu_.unlock(); }
void Allocator::forked_child_for_fork(void* p) {
  auto* a = static_cast<Allocator*>(p);
  // The threads that were making engines are not here. A waiter of the parent's may still count in the
  // condition variable (glibc's destroy would wait for it): a new one, and the old one kept, never destroyed.
  std::fill(a->creating_.begin(), a->creating_.end(), 0);
  static std::vector<std::unique_ptr<std::condition_variable>>* kept = new std::vector<std::unique_ptr<std::condition_variable>>;
  kept->push_back(std::move(a->created_cv_));
  a->created_cv_ = std::make_unique<std::condition_variable>();
  a->create_mu_.unlock();
}

// Note [Making the allocator once]
// The C ABI and the interposer make their allocator at the process's first call. Making it reads the
// configuration, opens the trace files, loads libcuda and calls cuInit (from milliseconds to seconds), and
// registers fork handlers; so, as for a device's engine (Note [Creating an engine]), nothing is held while it
// is made: MakeOnce's lock guards only whether it is made, being made (by which thread) or not, and a caller
// that finds another thread making it waits on the condition variable, which lets the lock go. fork() holds
// that lock (hold_across_fork_from_load, registered when the library loads) and its holder never waits for
// anything, so a fork never waits for the making. A child forked while another thread was making it finds it
// "not made" and makes its own at its first call; what the lost making had made is leaked. That child's
// allocator writes no trace unless the trace's path has a %p: the lost making may have opened the parent's
// file already, and the parent's writes to it go on (Note [Tracing in a forked child]). Lazy initialisations
// the making reaches use std::call_once (glibc's pthread_once lets a child run again one that a fork
// interrupted, where a function's static would leave the child waiting for ever on its guard): loading
// libcuda, the tracer's clock. With a real driver a child cannot use CUDA anyway, and one forked while
// libcuda was being loaded or initialised may find the driver itself half made. A making that ends by an
// exception (or a thread's cancellation) is abandoned (MakeOnce::Turn), so the next caller makes it instead
// of every caller waiting for ever. A call from inside the making, on its thread, gets no allocator rather
// than waiting for itself. Before 2026-12-04 a lock was held while making, and a child forked meanwhile
// waited for ever at its first call (tests/capi/capi_fork.cpp, tests/preload/preload_fork.cpp).
MakeOnce::MakeOnce() : cv_(std::make_unique<std::condition_variable>()) {
  hold_across_fork_from_load(&lock_for_fork, &unlock_for_fork, &child_after_fork, this);
}

MakeOnce::Turn MakeOnce::begin() {
  std::unique_lock lk(mu_);
  if (state_ == State::making && maker_ == std::this_thread::get_id()) return Turn(nullptr);
  while (state_ == State::making) cv_->wait(lk);
  if (state_ == State::made) return Turn(nullptr);
  state_ = State::making;
  maker_ = std::this_thread::get_id();
  return Turn(this);
}

void MakeOnce::abandon() {
  std::lock_guard lk(mu_);
  state_ = State::not_made;
  cv_->notify_all();
}

void MakeOnce::lock_for_fork(void* self) { static_cast<MakeOnce*>(self)->mu_.lock(); }
void MakeOnce::unlock_for_fork(void* self) { static_cast<MakeOnce*>(self)->mu_.unlock(); }
void MakeOnce::child_after_fork(void* self) {
  auto* m = static_cast<MakeOnce*>(self);
  if (m->state_ == State::making && m->maker_ != std::this_thread::get_id()) {  // the maker is not in this child
    m->state_ = State::not_made;
    m->lost_ = true;
  }
  // A waiter of the parent's (one woken just before the fork, too) may still count in the condition variable:
  // a new one, the old one never destroyed.
  static auto* kept = new std::vector<std::unique_ptr<std::condition_variable>>;
  kept->push_back(std::move(m->cv_));
  m->cv_ = std::make_unique<std::condition_variable>();
  m->mu_.unlock();
}

void forked_child_traces_not(Options* opts) {
  if (opts->trace.empty() || opts->trace.find("%p") != std::string::npos) return;
  std::fprintf(stderr,
               "fragless: process %d was forked while another thread made the allocator, which traces to %s; the "
               "child's allocator is not traced (that file is the parent's; a %%p in the path gives each process "
               "its own)\n",
               static_cast<int>(getpid()), opts->trace.c_str());
  opts->trace.clear();
}

void Allocator::on_engine_created(std::function<void(int, DeviceEngine&)> f) {
  // The engines that exist get f outside the creation lock: f takes their locks (Note [Creating an engine]).
  // One published after this section got f from device(), under the lock.
  std::vector<std::pair<int, DeviceEngine*>> now;
  {
    std::lock_guard lk(create_mu_);
    created_ = f;
    for (int d = 0; d < device_count(); ++d)
      if (DeviceEngine* e = existing(d)) now.emplace_back(d, e);
  }
  for (auto [d, e] : now) f(d, *e);
}

std::string Allocator::flush_traces() {
  // Without the creation lock (Note [Creating an engine]): at exit the thread may hold a device lock (exit()
  // from an event sink) that a fork in progress, holding the creation lock, waits for.
  for (int d = 0; d < device_count(); ++d)
    if (DeviceEngine* e = existing(d)) e->flush_trace();
  return tracing_ && !forked_child() ? tracing_->losses() : std::string();
}

bool Allocator::forked_child() const { return static_cast<long>(getpid()) != creator_pid_; }

// Note [Exit while the lock is held]
// exit() may run on a thread that holds a device's lock: a signal handler that calls exit() interrupted the
// thread inside the allocator, or an event sink, which runs under the lock, called it. The lock is not
// recursive, and that thread will never release it, so the exit must not take it: for that engine the
// worker is told to stop and detached instead of joined (it may be waiting for the lock itself;
// Background::stop), its trace is not flushed (the sink, or the engine's state, may be halfway through an
// update), and one line on stderr names the device and why (DeviceEngine::stop_background). Every other
// engine is stopped and flushed as usual; the tracer's writers are joined as usual (they never take a device
// lock). The lock knows its owner (Note [Lock owner], spin_mutex.h), which costs a relaxed store in lock and
// in unlock. What this does not cover: static destructors that later free on that device wait for the lock
// for ever (nothing short of not taking it could help them), and a signal that lands while the sink hands a
// full buffer to its file (the file's mutex held, once in 8192 records) still hangs the exit in
// Tracing::go_synchronous. The exit takes no creation lock (Note [Creating an engine]): the workers and the
// sinks are found through the published engines. An engine first used after the exit handler (a static destructor's
// allocation on another device) starts no background worker: no thread of ours begins during teardown.
void Allocator::at_exit() {
  // A forked child has no writer thread or worker of ours, and its trace records are dropped (Note [Tracing in
  // a forked child]): nothing to do, and a lock a thread of the parent held at the fork is never released.
  if (forked_child()) return;
  exiting_.store(true, std::memory_order_seq_cst);  // an engine created from now on starts no worker
  while (publishing_.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();  // see device()
  stop_background();
  if (tracing_) tracing_->go_synchronous();
  flush_traces();  // what the sinks still hold, written now (Note [Tracing at exit])
  // A file whose writes failed (a full disk) said so once, at the first; the loss is counted here.
  if (tracing_) tracing_->report_losses();
}

void Allocator::stop_background() {
  if (forked_child()) return;
  for (int d = 0; d < device_count(); ++d)  // without the creation lock, as flush_traces
    if (DeviceEngine* e = existing(d)) e->stop_background();
}
std::vector<std::string> Allocator::trace_paths() const {
  return tracing_ ? tracing_->paths() : std::vector<std::string>{};
}

}  // namespace fragless
