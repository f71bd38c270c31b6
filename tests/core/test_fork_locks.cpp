// fork() while a device's lock is held (Note [Device locks across fork], background.cpp): the prepare
// handler waits for the lock and holds it across the fork, so a child forked while another thread was inside
// the allocator finds the lock free and the books whole; a fork from a thread that holds the lock itself
// (from an event sink) neither deadlocks nor loses the lock.
#include <catch2/catch.hpp>
#include <gnu/libc-version.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fragless/allocator.h"
#include "base/quiet_thread.h"
#include "fragless/trace.h"
#include "helpers.h"
#include "watchdog.h"

using namespace fragless;

namespace {

using test::MiB;
constexpr std::size_t kHeldSize = 3 * MiB + 4321;  // the allocation whose event holds the lock, or forks

// Holds the device lock from inside the allocation of kHeldSize until `release` is set.
class HoldingSink final : public EventSink {
 public:
  std::atomic<bool> inside{false}, release{false};
  void on_event(const TraceEvent& e) override {
    if (e.action != TraceAction::alloc || e.requested_size != kHeldSize) return;
    inside = true;
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void flush() override {}
};

// Forks from inside the allocation of kHeldSize, on the thread that holds the device lock.
class ForkingSink final : public EventSink {
 public:
  pid_t forked = -1;
  void on_event(const TraceEvent& e) override {
    if (e.action != TraceAction::alloc || e.requested_size != kHeldSize || forked >= 0) return;
    std::fflush(stdout);
    std::fflush(stderr);
    forked = fork();
  }
  void flush() override {}
};

// In a child: the engine takes requests, and its books are whole; the exit code names what failed.
[[noreturn]] void child_uses(DeviceEngine* e) {
  AllocError err;
  void* p = e->allocate(5 * MiB, 0, &err);
  if (!p) _exit(10);
  std::memset(p, 0x5c, 5 * MiB);
  if (e->free(p) != Status::ok) _exit(11);
  std::size_t free_b = 0, total_b = 0;
  e->memory_info(&free_b, &total_b);  // waits for no job of the parent's worker
  if (e->empty_cache(&err) != Status::ok) _exit(13);
  if (!e->check_invariants().empty()) _exit(12);
  _exit(0);
}

// Forks a child that runs child_uses(e) under its own watchdog; the parent gets its pid.
pid_t fork_a_child_that_uses(DeviceEngine* e) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(test::child_alarm_s());
    child_uses(e);
  }
  return pid;
}

}  // namespace

TEST_CASE("fork while another thread holds the device lock: the child's first allocation does not wait for ever",
          "[fork]") {
  const char* conf = GENERATE("driver:host,capacity_mb:256", "driver:host,capacity_mb:256,policy:classic",
                              "driver:host,capacity_mb:256,policy:expandable,background:False");
  INFO(conf);
  auto a = test::allocator_from(conf);
  DeviceEngine* e = a->device(0);
  REQUIRE(e);
  HoldingSink sink;
  e->set_event_sink(&sink);
  void* held = nullptr;
  std::thread holder([&] { held = e->allocate(kHeldSize, 0, nullptr); });
  for (int i = 0; i < 10000 && !sink.inside; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(sink.inside);
  // The fork waits in its prepare handler for the lock, which the holder lets go in 200 ms.
  const auto forked_at = std::chrono::steady_clock::now();  // before the releaser starts its 200 ms
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    sink.release = true;
  });
  const pid_t pid = fork_a_child_that_uses(e);
  REQUIRE(pid >= 0);
  const auto waited = std::chrono::steady_clock::now() - forked_at;
  releaser.join();
  holder.join();
  const int status = test::wait_for_child(pid, "a child forked while another thread held the device lock");
  INFO("the child " << test::describe_status(status)
                    << " (exit 10 to 12: allocate, free, the books; SIGALRM: it waited for the lock)");
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK(waited >= std::chrono::milliseconds(150));  // the fork did wait for the lock
  e->set_event_sink(nullptr);
  REQUIRE(held);
  CHECK(e->free(held) == Status::ok);
  CHECK(e->check_invariants().empty());
}

namespace {

// An event sink with a lock of its own, which another thread also takes without any device lock (as a
// snapshot reads a history ring); registered with hold_across_fork once for the process (the registration
// stays, so the sink does too).
struct RingSink final : public EventSink {
  std::mutex mu;
  unsigned long events = 0;
  void on_event(const TraceEvent&) override {
    std::lock_guard lk(mu);
    ++events;
  }
  void flush() override {}
};
RingSink& ring_sink() {
  static RingSink* s = [] {
    auto* r = new RingSink;
    hold_across_fork([](void* a) { static_cast<RingSink*>(a)->mu.lock(); },
                     [](void* a) { static_cast<RingSink*>(a)->mu.unlock(); }, r);
    return r;
  }();
  return *s;
}

}  // namespace

TEST_CASE("fork while another thread holds a sink's own lock: held across the fork, the child's events go on",
          "[fork]") {
  auto a = test::allocator_from("driver:host,capacity_mb:256");
  DeviceEngine* e = a->device(0);
  REQUIRE(e);
  RingSink& sink = ring_sink();
  e->set_event_sink(&sink);
  std::atomic<bool> holding{false};
  // Another thread holds the sink's lock, no device lock with it, for 200 ms from now: the fork's prepare
  // handler waits for it after taking the device locks.
  const auto forked_at = std::chrono::steady_clock::now();
  std::thread reader([&] {
    std::lock_guard lk(sink.mu);
    holding = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  });
  while (!holding) std::this_thread::yield();
  const pid_t pid = fork_a_child_that_uses(e);  // its allocation's event takes the sink's lock
  REQUIRE(pid >= 0);
  const auto waited = std::chrono::steady_clock::now() - forked_at;
  reader.join();
  const int status = test::wait_for_child(pid, "a child forked while another thread held a sink's lock");
  INFO("the child " << test::describe_status(status) << " (SIGALRM: it waited for the sink's lock)");
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK(waited >= std::chrono::milliseconds(150));  // the fork did wait for the lock
  e->set_event_sink(nullptr);
  CHECK(e->check_invariants().empty());
}

TEST_CASE("fork from an event sink, on the thread that holds the device lock: no deadlock, and both sides go on",
          "[fork]") {
  const char* conf = GENERATE("driver:host,capacity_mb:256,handles:ends,handle_max_mb:1024",
                              "driver:host,capacity_mb:256,policy:classic");
  INFO(conf);
  auto a = test::allocator_from(conf);
  DeviceEngine* e = a->device(0);
  REQUIRE(e);
  test::Watchdog watchdog("fork from an event sink", 60);  // a prepare handler that waits for its own lock hangs
  // Several rounds, each forking just after a free multi-page handle gave the worker a split (fragless
  // policy): some forks land while that job is in flight, which the child then never waits for.
  for (int round = 0; round < 4; ++round) {
    INFO("round " << round);
    void* body = e->allocate(30 * MiB, 0, nullptr);
    REQUIRE(body);
    REQUIRE(e->free(body) == Status::ok);
    ForkingSink sink;
    e->set_event_sink(&sink);
    void* p = e->allocate(kHeldSize, 0, nullptr);  // forks inside; both processes return here
    if (sink.forked == 0) {
      alarm(test::child_alarm_s());
      if (!p) _exit(20);
      e->set_event_sink(nullptr);
      if (e->free(p) != Status::ok) _exit(21);
      child_uses(e);
    }
    REQUIRE(sink.forked > 0);
    e->set_event_sink(nullptr);
    REQUIRE(p);
    CHECK(e->free(p) == Status::ok);
    const int status = test::wait_for_child(sink.forked, "a child forked from an event sink");
    INFO("the child " << test::describe_status(status)
                      << " (exit 10 to 13: allocate, free, the books, empty_cache; SIGALRM: it waited)");
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
    CHECK(e->check_invariants().empty());
  }
}

// Forks from inside the allocation of kHeldSize once `go` is set, on the thread that holds the device lock.
class GatedForkingSink final : public EventSink {
 public:
  std::atomic<bool> inside{false}, go{false};
  pid_t forked = -1;
  void on_event(const TraceEvent& e) override {
    if (e.action != TraceAction::alloc || e.requested_size != kHeldSize || forked >= 0) return;
    inside = true;
    while (!go) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::fflush(stdout);
    std::fflush(stderr);
    forked = fork();
  }
  void flush() override {}
};

// The allocator's creation lock is held across fork() before the device locks (Note [Creating an engine]),
// so no thread may wait for a device lock while holding it: a fork from an event sink holds a device lock
// and waits for the creation lock. on_engine_created's callback takes the device locks of the engines that
// exist: it runs them outside the creation lock. Here the callback waits for the device lock the sink's
// thread holds, and the sink forks only once the callback has begun. Found by reviews: the first version
// called back under the creation lock and this fork waited for ever (watchdog); the second let such a fork
// go without the creation lock when it was taken, and its child then found it held for ever (the child's
// device(1) and on_engine_created below).
TEST_CASE("fork from an event sink while another thread calls back the engines and waits for that device lock: "
          "no deadlock, and the child makes a device", "[fork]") {
  auto a = test::allocator_from("driver:host,capacity_mb:256", 2);
  DeviceEngine* e = a->device(0);
  REQUIRE(e);
  test::Watchdog watchdog("fork from a sink against a callback of on_engine_created", 60);
  GatedForkingSink sink;
  e->set_event_sink(&sink);
  void* p = nullptr;
  std::atomic<bool> called_back{false};
  std::thread allocating([&] {
    p = e->allocate(kHeldSize, 0, nullptr);  // forks inside, holding the device lock
    if (sink.forked == 0) {  // the child, whose one thread is this one
      alarm(test::child_alarm_s());
      if (!p) _exit(20);
      e->set_event_sink(nullptr);
      if (e->free(p) != Status::ok) _exit(21);
      DeviceEngine* other = a->device(1);  // made now, under the creation lock
      if (!other) _exit(22);
      other->set_event_sink(nullptr);
      a->on_engine_created([](int, DeviceEngine&) {});
      child_uses(other);
    }
  });
  for (int i = 0; i < 10000 && !sink.inside; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(sink.inside);
  std::thread attaching([&] {
    a->on_engine_created([&](int, DeviceEngine& x) {
      called_back = true;
      x.set_event_sink(&sink);  // device 0: waits for the lock the sink's thread holds
    });
  });
  for (int i = 0; i < 10000 && !called_back; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(called_back);
  sink.go = true;
  allocating.join();
  attaching.join();
  REQUIRE(sink.forked > 0);
  const int status = test::wait_for_child(sink.forked, "a child forked from a sink against a callback");
  INFO("the child " << test::describe_status(status)
                    << " (exit 10 to 13, 20 to 22: its calls; SIGALRM: it waited for a lock)");
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  e->set_event_sink(nullptr);
  REQUIRE(p);
  CHECK(e->free(p) == Status::ok);
  CHECK(e->check_invariants().empty());
}

// Forks from the first event it is handed on a thread other than `main` (the worker's, finishing a split).
class WorkerForkingSink final : public EventSink {
 public:
  std::thread::id main = std::this_thread::get_id();
  std::atomic<pid_t> forked{-1};
  void on_event(const TraceEvent&) override {
    if (std::this_thread::get_id() == main || forked.load() != -1) return;
    const pid_t pid = fork();
    if (pid != 0) forked = pid;  // the child returns into the worker's loop, its one thread
  }
  void flush() override {}
};

TEST_CASE("fork from an event sink on the background worker: the child, whose one thread is that worker, ends",
          "[fork]") {
  auto a = test::allocator_from("driver:host,capacity_mb:256,handles:ends,handle_max_mb:1024");
  DeviceEngine* e = a->device(0);
  REQUIRE(e);
  WorkerForkingSink sink;
  e->set_event_sink(&sink);
  std::fflush(stdout);
  std::fflush(stderr);
  void* body = e->allocate(30 * MiB, 0, nullptr);  // a multi-page handle: once free, the worker splits it
  REQUIRE(body);
  REQUIRE(e->free(body) == Status::ok);
  for (int i = 0; i < 10000 && sink.forked.load() == -1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const pid_t pid = sink.forked.load();
  REQUIRE(pid > 0);  // the worker's finish reported the split's handles
  // Its signals are blocked (a worker's are), so only the watchdog's SIGKILL could end a child that waits.
  const int status = test::wait_for_child(pid, "a child forked on the worker thread");
  INFO("the child " << test::describe_status(status));
  CHECK(WIFEXITED(status));  // ended by itself (its exit status is the exit handlers', a sanitizer's included)
  e->set_event_sink(nullptr);
  CHECK(e->check_invariants().empty());
}

// Note [Forking while a thread starts]: the first free of a multi-page block begins the device's worker,
// and a fork at once races the worker's start, which under a runtime whose thread start is not fork-safe
// (GCC 12's AddressSanitizer) can leave the child waiting for ever at its first allocation of some size
// class. The fork waits for the start. Each fork here comes straight after the worker is begun, and each
// child allocates in every small size class and then uses the engine. In the ASan tier, without the wait,
// a child hung in the runtime's size-class refill in 9 runs of 11 (tools/sanitize.sh's tree, the wait taken
// out), and in none of 11 with it; in the plain build it checks the children of such forks.
TEST_CASE("fork right after the first free begins the worker: no child hangs in its first allocations",
          "[fork]") {
  constexpr int kForks = 60;
  int failed = 0;
  for (int i = 0; i < kForks; ++i) {
    auto a = test::allocator_from("driver:host,capacity_mb:64");
    DeviceEngine* e = a->device(0);
    REQUIRE(e);
    AllocError err;
    void* p = e->allocate(6 * MiB, 0, &err);  // three pages: its free leaves work for the worker
    REQUIRE(p);
    REQUIRE(e->free(p) == Status::ok);  // begins the worker (background.cpp, wake)
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      alarm(test::child_alarm_s());
      std::vector<std::string*> many;
      for (int k = 0; k < 20000; ++k) many.push_back(new std::string(static_cast<std::size_t>(16 + (k % 64) * 16), 'x'));
      for (std::string* s : many) delete s;
      child_uses(e);
    }
    // A hang fails the test at once (one is the finding), after at most a minute even in a sanitizer tree.
    const int status = test::wait_for_child(pid, "fork " + std::to_string(i) + "'s child",
                                            std::min(test::child_watchdog_s(), 60));
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      UNSCOPED_INFO("fork " << i << ": the child " << test::describe_status(status));
      ++failed;
    }
  }
  CHECK(failed == 0);
}

// The wait itself (Note [Forking while a thread starts]), with a thread that counts as starting: the fork
// returns only once it has begun, and the child counts none; one that never begins holds the fork up for
// kStartWait only, and the child counts none either.
TEST_CASE("a fork waits for a thread of fragless's that is starting and gives up on one that never begins",
          "[fork]") {
  auto a = test::allocator_from("driver:host,capacity_mb:64");  // the fork handlers are installed
  REQUIRE(a->device(0));
  const bool begins = GENERATE(true, false);
  INFO((begins ? "a thread that begins" : "a thread that never begins"));
  REQUIRE(g_threads_starting.load() == 0);
  // The stand-in for a starting thread, undone however this test ends (a failed REQUIRE included), so that
  // neither a joinable thread nor a count is left behind.
  struct Starting {
    bool begins;
    std::atomic<bool> begun{false};
    std::thread thread;
    explicit Starting(bool b) : begins(b) {
      g_threads_starting.fetch_add(1);  // as start_quiet_thread counts one before its creation
      if (begins)
        thread = std::thread([this] {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          begun = true;
          g_threads_starting.fetch_sub(1);  // as its body's first statement does
        });
    }
    ~Starting() {
      if (thread.joinable()) thread.join();
      if (!begins) g_threads_starting.fetch_sub(1);
    }
  } starting(begins);
  std::fflush(stdout);
  std::fflush(stderr);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) _exit(g_threads_starting.load() == 0 && g_thread_starts_closed.load() == 0 ? 0 : 1);
  const double fork_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // A thread that never begins is waited for kStartWait, then given up on: not for ever, not at once.
  INFO("the fork took " << fork_s << " s");
  if (!begins) CHECK((fork_s >= 0.9 * static_cast<double>(kStartWait.count()) &&
                      fork_s <= static_cast<double>(kStartWait.count()) + 10.0));
  const bool begun_at_fork = starting.begun.load();
  const int closed_after_fork = g_thread_starts_closed.load();
  const int status = test::wait_for_child(pid, "the forked child");
  CHECK(begun_at_fork == begins);
  CHECK(closed_after_fork == 0);  // the parent's handler opened the gate again
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));  // the child counts no thread starting, gate open
}

// The gate: a thread of fragless's begun after a fork's prepare handler closed it (a trace writer begun under
// no lock the fork holds) is created only once the fork is over, and is not counted meanwhile, so that it is
// never copied mid-start; the forking thread itself may still begin one.
TEST_CASE("a thread of fragless's begun while a fork is under way is created only after it", "[fork]") {
  REQUIRE(g_threads_starting.load() == 0);
  REQUIRE(g_thread_starts_closed.load() == 0);
  struct Gate {  // opened however this test ends
    Gate() { close_thread_starts(); }
    ~Gate() { open_thread_starts(); }
  };
  std::atomic<bool> body_ran{false}, returned{false};
  std::thread starter;
  int counted_while_closed = -1;
  {
    Gate gate;
    starter = std::thread([&] {
      std::thread t = start_quiet_thread([&] { body_ran = true; });
      returned = true;
      t.join();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    counted_while_closed = g_threads_starting.load();
    CHECK_FALSE(body_ran.load());
    CHECK_FALSE(returned.load());
    // The thread that closed the gate is not held by it.
    std::atomic<bool> own{false};
    start_quiet_thread([&] { own = true; }).join();
    CHECK(own.load());
  }
  starter.join();
  CHECK(counted_while_closed == 0);  // it backed off: the fork's wait did not wait for it
  CHECK(body_ran.load());
  CHECK(returned.load());
  CHECK(g_threads_starting.load() == 0);
  CHECK(g_thread_starts_closed.load() == 0);
}

// The count itself: a thread of fragless's counts as starting until its body's first statement, and not
// while its body runs or after it (a count taken at the body's end would hold every fork up while a worker
// lives; one never taken would let a fork copy a thread mid-start).
TEST_CASE("start_quiet_thread counts a thread as starting only until its body begins", "[fork]") {
  REQUIRE(g_threads_starting.load() == 0);
  std::atomic<bool> in_body{false}, go{false};
  std::atomic<int> seen_in_body{-100};
  std::thread t = start_quiet_thread([&] {
    seen_in_body = g_threads_starting.load();
    in_body = true;
    while (!go) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  while (!in_body) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const int while_running = g_threads_starting.load();
  go = true;
  t.join();
  CHECK(seen_in_body.load() == 0);
  CHECK(while_running == 0);
  CHECK(g_threads_starting.load() == 0);
}

// Note [The trace clock]: the writer converts records under the clock's mutex, and fork() holds that mutex
// too. Taken by a prepare handler of its own, run before the engines' (registered after them, as when an
// untraced allocator came first), it deadlocked: the forking thread held the clock's mutex and waited for a
// device lock; that lock's holder, filling its trace buffers, waited for the writer; the writer waited for the
// clock's mutex. Here a slow first lock (half a second before the device locks) keeps the forking thread in
// that window while another thread allocates, traced, as fast as it can; the fork has to return.
TEST_CASE("fork with tracing on, the engines' fork handlers registered first: no deadlock with the trace writer",
          "[fork][tracer]") {
  static int tag;
  auto slow = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(500)); };
  auto nop = [](void*) {};
  hold_across_fork_first(slow, nop, nop, &tag);  // the engines' handlers registered before the tracer's
  const std::string dir = "/tmp/fragless-fork-trace-" + std::to_string(::getpid());
  REQUIRE(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()) == 0);
  auto a = test::allocator_from("driver:sim,capacity_mb:1024,background:False,trace:" + dir + "/t-%d.fgt");
  DeviceEngine* e = a->device(0);
  REQUIRE(e);
  std::atomic<bool> stop{false};
  std::atomic<long> pairs{0};
  std::thread busy([&] {
    while (!stop) {
      void* p = e->allocate(4096, 1, nullptr);
      e->free(p);
      ++pairs;
    }
  });
  while (pairs < 1000) std::this_thread::yield();
  {
    test::Watchdog dog("a fork while a traced thread allocates", 60);
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) _exit(0);
    REQUIRE(pid > 0);
    CHECK(test::wait_for_child(pid, "a child forked with tracing on") == 0);
  }
  const long before = pairs;
  while (pairs < before + 1000) std::this_thread::yield();  // the parent goes on allocating, traced
  stop = true;
  busy.join();
  stop_holding_across_fork(&tag);
  a.reset();
  std::system(("rm -rf " + dir).c_str());
}

// Note [Handlers installed during a fork] (background.cpp): a fork whose host driver's handlers were installed
// before it began and whose workers' handlers were installed while it ran. The host driver's prepare handler
// runs (it holds the driver's locks), the workers' does not, and the load handler, which runs last, takes the
// device locks; a thread that holds a device lock and calls that driver waited for the forking thread, which
// waited for it (a draw of fragless-capi-fork --random hung so). That state needs a process in which nothing
// installed the workers' handlers before, so the visible case runs the hidden one below in a process of its
// own. There, in registration order: the load handler, with a slow lock of its own (200 ms, after the host
// driver's locks are held: the window in which the other thread's next driver call waits for them, under its
// device lock); a host driver, whose handlers come next; and the program's handler, which runs first: it has
// another thread make an engine on that driver (the workers' handlers installed during the fork) and allocate
// page after page, each allocation calling the driver under the device lock, and returns once it does. The
// fork must return (a watchdog fails it otherwise) and its child must use that engine. Registering during a
// fork needs glibc 2.36 or later (before, it waits for the fork's end, and the state cannot be made).
TEST_CASE("fork: the host driver's handlers installed before the fork and the workers' during it: the device locks "
          "are taken first, no deadlock (a process of its own)",
          "[fork][driver]") {
  const char* glibc = gnu_get_libc_version();
  int major = 0, minor = 0;
  REQUIRE(std::sscanf(glibc, "%d.%d", &major, &minor) == 2);
  if (major < 2 || (major == 2 && minor < 36)) {
    WARN("glibc " << glibc << " waits for a fork's end to register a handler: this test's state cannot be made");
    return;
  }
  std::string cmd, out;
  const int status = test::run_hidden_case("", "[.fork-host-first]", &cmd, &out);
  INFO(cmd << "\n" << out);
  CHECK(status == 0);  // the hidden case passed: no watchdog, no hung child
  CHECK_THAT(out, Catch::Contains("fork-host-first: the engine was made during the fork"));
}

namespace host_first {

constexpr std::size_t kPage = 2 * MiB;
std::atomic<bool> g_go{false}, g_stop{false};
std::atomic<DeviceEngine*> g_engine{nullptr};
std::atomic<long> g_allocations{0};
std::atomic<int> g_made_in_fork{-1};  // 1: made, and allocating, while the prepare handler below waited

// The program's prepare handler (the only fork of its process): the engine is made, and allocating, now.
void prepare() {
  g_go = true;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (g_allocations.load() < 3 && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  g_made_in_fork = g_allocations.load() >= 3 ? 1 : 0;
}

}  // namespace host_first

TEST_CASE("fork: (child process) the host driver's handlers installed before the fork, the workers' during it",
          "[.fork-host-first]") {
  using namespace host_first;
  hold_across_fork_from_load([](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); },
                             [](void*) {}, [](void*) {}, nullptr);
  HostDriverOptions h;
  h.capacity = 256 * MiB;
  h.page_size = kPage;
  std::string err;
  std::unique_ptr<Driver> driver = make_host_driver(h, &err);  // its fork handlers installed here
  REQUIRE(driver);
  REQUIRE(pthread_atfork(&prepare, nullptr, nullptr) == 0);
  struct Joined {  // stopped and joined however this case ends (a failed REQUIRE included)
    std::thread thread;
    ~Joined() {
      g_stop = true;
      if (thread.joinable()) thread.join();
    }
  } allocating;
  allocating.thread = std::thread([&] {
    while (!g_go) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    Options o;
    o.driver = DriverKind::host;
    auto engine = std::make_unique<DeviceEngine>(o, std::move(driver));  // the workers' handlers installed here
    g_engine = engine.get();
    std::vector<void*> live;
    while (!g_stop) {
      // A new page each time: the allocation calls the driver, under the device lock.
      void* p = engine->allocate(kPage, 0, nullptr);
      if (p) live.push_back(p);
      ++g_allocations;
      if (live.size() >= 64 || !p) {
        for (void* q : live) engine->free(q);
        live.clear();
        engine->empty_cache(nullptr);
      }
    }
    for (void* q : live) engine->free(q);
    g_engine = nullptr;
    engine.reset();
  });
  pid_t pid = -1;
  {
    test::Watchdog dog("a fork with the host driver's handlers installed before it, the workers' during it", 60);
    std::fflush(stdout);
    std::fflush(stderr);
    pid = fork();
    if (pid == 0) {
      alarm(test::child_alarm_s());
      if (DeviceEngine* e = g_engine.load()) child_uses(e);
      _exit(20);
    }
  }
  const long at_fork = g_allocations.load();
  int status = -1;
  if (pid > 0)
    status = test::wait_for_child(pid, "the child of a fork whose workers' handlers were installed during it");
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (g_allocations.load() < at_fork + 10 && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool went_on = g_allocations.load() >= at_fork + 10;  // the allocating thread goes on after the fork
  g_stop = true;
  allocating.thread.join();
  CHECK(went_on);
  REQUIRE(pid > 0);
  REQUIRE(g_made_in_fork.load() == 1);
  std::printf("fork-host-first: the engine was made during the fork; the child %s\n",
              test::describe_status(status).c_str());
  INFO("the child " << test::describe_status(status) << " (exit 10 to 13: allocate, free, the books; 20: no engine)");
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
}
