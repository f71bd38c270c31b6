// Process exit for an allocator that is never destroyed (the C ABI, the CPU allocator, the interposer):
// Allocator::at_exit leaves no thread of ours and a trace that ends with every event (Note [Tracing at
// exit]), and an exit on a thread that holds a device's lock ends instead of hanging (Note [Exit while the
// lock is held]). The exits run in forked children, watched by the parent, so a hang fails the test.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <atomic>
#include <thread>

#include "fragless/allocator.h"
#include "os_probes.h"
#include "trace_model.h"
#include "helpers.h"
#include "watchdog.h"

using namespace fragless;

namespace {

constexpr std::size_t MiB = 1u << 20;

std::string temp_dir(const char* what) {
  auto d = std::filesystem::temp_directory_path() /
           ("fragless-exit-" + std::string(what) + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

using os_probes::slurp;
using os_probes::thread_count;

// The count once it is down to `want`, or after 2 s: a thread just joined may still be listed for a moment
// (the kernel wakes the joiner before it has removed the thread).
int settled_thread_count(int want) {
  int n = thread_count();
  for (int i = 0; i < 2000 && n > want; ++i, n = thread_count()) usleep(1000);
  return n;
}

struct Counts {
  std::size_t allocs = 0, frees = 0;
  std::uint64_t last_free = 0;
};
Counts counts(const formats::Trace& t, int device) {
  Counts c;
  for (const auto& e : t.events) {
    if (e.device != device) continue;
    c.allocs += e.op == formats::Op::alloc;
    if (e.op == formats::Op::free) ++c.frees, c.last_free = e.address;
  }
  return c;
}

// In a child: its stderr goes to DIR/stderr, which the parent reads once the child has ended.
void stderr_to(const std::string& dir) {
  const int fd = ::open((dir + "/stderr").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0 || dup2(fd, 2) < 0) _exit(101);
}

// Runs `child` in a forked process and returns its wait status; a child that has not ended after the
// watchdog's time (wait_for_child) is killed and fails the test.
template <typename F>
int run_child(const char* what, F child) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    child();
    _exit(100);  // the child ends by exit(); reaching here is a failure of its own
  }
  return fragless::test::wait_for_child(pid, std::string(what) + ": the exit hangs");
}

// ---- exit on a thread that holds a device's lock ----

// The child's allocator and what its exit handlers need; the child is a copy of this process, so globals
// are its own.
Allocator* g_alloc = nullptr;
constexpr std::size_t kExitSize = 7 * MiB + 12345;  // the allocation whose event ends the child
constexpr int kExitStatus = 3;
bool g_by_signal = false;
int g_threads_at_exit = 0;

// Chained in front of device 0's tracer: forwards every event, then ends the process from inside on_event,
// under the device lock, when it sees kExitSize allocated: directly, or from a signal handler that
// interrupted the thread there.
class ExitingSink final : public EventSink {
 public:
  explicit ExitingSink(EventSink* tracer) : tracer_(tracer) {}
  void on_event(const TraceEvent& e) override {
    if (tracer_) tracer_->on_event(e);
    if (e.action != TraceAction::alloc || e.requested_size != kExitSize) return;
    if (g_by_signal) raise(SIGUSR1);
    std::exit(kExitStatus);
  }
  void flush() override {
    if (tracer_) tracer_->flush();
  }

 private:
  EventSink* tracer_;
};

// Runs in the child: device 1 works as usual, device 0 starts its worker (a free multi-page handle to split),
// then an allocation on device 0 exits from under its lock. The handlers, registered in this order, run in
// the reverse one: the allocator's at_exit, then a last one that says the handlers ended and ends the
// process with _exit, so that nothing after them (LeakSanitizer's check, with device 0's worker left alive)
// decides the status.
void exit_under_lock(const std::string& dir, bool by_signal) {
  stderr_to(dir);
  g_by_signal = by_signal;
  if (by_signal) signal(SIGUSR1, [](int) { std::exit(kExitStatus); });
  auto parsed = parse_config("driver:host,capacity_mb:512,handles:ends,handle_max_mb:1024,trace:" + dir + "/exit-%d.fgt");
  if (!parsed.ok) _exit(102);
  std::string err;
  g_alloc = Allocator::create(parsed.options, 2, &err).release();  // never destroyed, as the C ABI's
  if (!g_alloc) _exit(103);
  std::atexit([] {
    std::fprintf(stderr, "exit handlers done; threads left: %d\n", settled_thread_count(g_threads_at_exit - 3));
    _exit(kExitStatus);
  });
  std::atexit([] { g_alloc->at_exit(); });
  static ExitingSink* sink = new ExitingSink(g_alloc->trace_sink(0));  // never destroyed, as the allocator
  g_alloc->on_engine_created([](int d, DeviceEngine& e) {
    if (d == 0) e.set_event_sink(sink);
  });
  // Each device's worker starts, to split a free multi-page handle (waited for: up to 10 s each).
  auto start_worker = [](DeviceEngine* e) {
    void* body = e->allocate(30 * MiB, 0, nullptr);  // a multi-page handle
    void* keep = e->allocate(2 * MiB, 0, nullptr);
    const int before = thread_count();
    e->free(body);
    for (int i = 0; i < 10000 && thread_count() == before; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return keep;
  };
  DeviceEngine* d1 = g_alloc->device(1);
  d1->free(start_worker(d1));
  for (int i = 0; i < 8; ++i) d1->free(d1->allocate((1 + i) * MiB + 512, 0, nullptr));
  DeviceEngine* d0 = g_alloc->device(0);
  start_worker(d0);
  g_threads_at_exit = thread_count();
  std::fprintf(stderr, "threads at the exit: %d\n", g_threads_at_exit);
  d0->allocate(kExitSize, 0, nullptr);  // exits in the sink
}

void check_exit_under_lock(bool by_signal) {
  const std::string dir = temp_dir(by_signal ? "signal" : "sink");
  const int status = run_child("exit under the device lock", [&] { exit_under_lock(dir, by_signal); });
  const std::string err = slurp(dir + "/stderr");
  INFO("the child's stderr:\n" << err);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == kExitStatus);
  // Device 1's worker was joined and the two writers too; device 0's worker is left. (Counted from what
  // was there at the exit, as a sanitizer's runtime may have a thread of its own.)
  int at_exit = 0, left = 0;
  const auto n1 = err.find("threads at the exit: "), n2 = err.find("exit handlers done; threads left: ");
  REQUIRE(n1 != std::string::npos);
  REQUIRE(n2 != std::string::npos);
  REQUIRE(std::sscanf(err.c_str() + n1, "threads at the exit: %d", &at_exit) == 1);
  REQUIRE(std::sscanf(err.c_str() + n2, "exit handlers done; threads left: %d", &left) == 1);
  CHECK(at_exit >= 5);  // this one, two writers, two workers
  CHECK(left == at_exit - 3);
  // One line for device 0, whose lock the exit held; none for device 1.
  const std::string line = "fragless: exit while this thread holds device 0's allocator lock";
  CHECK(err.find(line) != std::string::npos);
  CHECK(err.find(line, err.find(line) + 1) == std::string::npos);
  CHECK(err.find("holds device 1's") == std::string::npos);
  // Device 1 was handled as usual: its trace holds all its events.
  const auto t1 = formats::load_trace(dir + "/exit-1.fgt");
  INFO(t1.error);
  REQUIRE(t1.ok);
  CHECK(t1.warning.empty());
  const Counts c1 = counts(t1.trace, 1);
  CHECK(c1.allocs == 10);
  CHECK(c1.frees == 10);
  CHECK(counts(t1.trace, 0).allocs == 0);
  // Device 0's file is a trace still, without its last records.
  const auto t0 = formats::load_trace(dir + "/exit-0.fgt");
  INFO(t0.error);
  CHECK(t0.ok);
  std::filesystem::remove_all(dir);
}

}  // namespace

TEST_CASE("exit: exit() from an event sink under the device lock ends instead of hanging", "[exit][tracer]") {
  check_exit_under_lock(/*by_signal=*/false);
}

// Not under ThreadSanitizer (not [tracer]): it rightly reports the exit handlers' frees inside a signal
// handler, which is what this test does on purpose.
TEST_CASE("exit: exit() from a signal handler on a thread that holds the device lock ends instead of hanging",
          "[exit]") {
  check_exit_under_lock(/*by_signal=*/true);
}

// ---- the trace after at_exit ----

TEST_CASE("exit: after at_exit every record is written as it comes and no writer thread is left", "[exit][tracer]") {
  // Two devices in one file (the writes of both go through the file's mutex) and two in their own.
  for (const char* pattern : {"/shared.fgt", "/own-%d.fgt"}) {
    INFO(pattern);
    const std::string dir = temp_dir("sync");
    const int before = thread_count();
    auto a = test::allocator_from("driver:sim,trace:" + dir + pattern, 2);
    const auto paths = a->trace_paths();
    void* last[2] = {nullptr, nullptr};
    std::size_t allocs = 0;
    for (int d = 0; d < 2; ++d) {
      DeviceEngine* e = a->device(d);
      for (int i = 0; i < 100; ++i, ++allocs) REQUIRE(e->free(e->allocate((1 + i % 9) * MiB, 0, nullptr)) == Status::ok);
      last[d] = e->allocate(3 * MiB, 0, nullptr);
      ++allocs;
      REQUIRE(last[d]);
    }
    CHECK(thread_count() > before);  // the writers (and workers) run
    a->at_exit();
    const int after_exit = settled_thread_count(before);  // compared below with the count once the allocator is gone
    // Freed after at_exit, as by a static destructor: on disk at once, with nothing flushed.
    for (int d = 0; d < 2; ++d) REQUIRE(a->device(d)->free(last[d]) == Status::ok);
    for (int d = 0; d < 2; ++d) {
      const auto r = formats::load_trace(paths[paths.size() == 1 ? 0 : static_cast<std::size_t>(d)]);
      INFO(r.error);
      REQUIRE(r.ok);
      CHECK(r.warning.empty());
      const Counts c = counts(r.trace, d);
      CHECK(c.allocs == allocs / 2);
      CHECK(c.frees == allocs / 2);
      CHECK(c.last_free == reinterpret_cast<std::uint64_t>(last[d]));
    }
    a.reset();  // the allocator's teardown after at_exit: flushes and closes as usual
    // None of its threads was left by at_exit. (Not compared with `before`: a sanitizer's runtime starts a
    // thread of its own with the first other thread.)
    CHECK(after_exit == settled_thread_count(before));
    std::filesystem::remove_all(dir);
  }
}

// ---- a forked child of a tracing process (Note [Tracing in a forked child]) ----

TEST_CASE("exit: a forked child of a tracing process neither hangs nor writes into the parent's trace",
          "[exit][tracer]") {
  const std::string dir = temp_dir("fork");
  auto a = test::allocator_from("driver:sim,trace:" + dir + "/parent.fgt", 2);
  for (int d = 0; d < 2; ++d) {
    DeviceEngine* e = a->device(d);
    for (int i = 0; i < 10; ++i) REQUIRE(e->free(e->allocate((1 + i) * MiB, 0, nullptr)) == Status::ok);
  }
  Allocator* parent = a.get();
  const int status = run_child("a forked child that traces", [&] {
    stderr_to(dir);
    // More than two buffers' worth of events on device 0 (each buffer is 8192 records), a few on device 1,
    // then the exit handler's work (the flush of every device).
    DeviceEngine* e0 = parent->device(0);
    for (int i = 0; i < 12000; ++i)
      if (e0->free(e0->allocate(4096 + 512 * (i % 7), 0, nullptr)) != Status::ok) _exit(102);
    DeviceEngine* e1 = parent->device(1);
    if (e1->free(e1->allocate(MiB, 0, nullptr)) != Status::ok) _exit(103);
    parent->at_exit();
    // Then an end without the C++ runtime's exit path: under a sanitizer its leak check takes the sanitizer
    // allocator's lock, which a thread of the parent's may have held at the fork (a child of this test in a
    // parallel run under ASan once waited until its watchdog, the likely cause; the next test ends so too).
    std::fflush(stderr);
    _exit(0);
  });
  const std::string err = slurp(dir + "/stderr");
  INFO("the child's stderr:\n" << err);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // One line per device the child used.
  const std::string line = "is a fork of the process tracing to " + dir + "/parent.fgt";
  std::size_t lines = 0;
  for (auto at = err.find(line); at != std::string::npos; at = err.find(line, at + 1)) ++lines;
  CHECK(lines == 2);
  // The parent's trace holds its own events only, the ones after the fork included.
  DeviceEngine* e0 = a->device(0);
  REQUIRE(e0->free(e0->allocate(5 * MiB, 0, nullptr)) == Status::ok);
  const auto path = a->trace_paths().at(0);
  a.reset();
  const auto r = formats::load_trace(path);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.warning.empty());
  CHECK(counts(r.trace, 0).allocs == 11);
  CHECK(counts(r.trace, 0).frees == 11);
  CHECK(counts(r.trace, 1).allocs == 10);
  std::filesystem::remove_all(dir);
}

TEST_CASE("exit: a forked child exits at once while another thread of the parent allocates", "[exit][tracer]") {
  // The fork may come while that thread holds device 0's lock, which the child then never sees released: the
  // child's exit handler must not take it (it did, to flush, and hung in most forks). A child that makes no
  // event says nothing about its trace.
  const std::string dir = temp_dir("fork-busy");
  auto a = test::allocator_from("driver:sim,trace:" + dir + "/parent.fgt", 1);
  DeviceEngine* e = a->device(0);
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    while (!stop.load(std::memory_order_relaxed))
      if (e->free(e->allocate(3 * MiB + 512, 0, nullptr)) != Status::ok) break;
  });
  Allocator* parent = a.get();
  for (int i = 0; i < 10; ++i) {
    const int status = run_child("a forked child's exit", [&] {
      stderr_to(dir);
      // The exit handler's work, then an end without the C++ runtime's own exit path: under a sanitizer its
      // leak check takes the sanitizer allocator's lock, which the busy thread may have held at the fork.
      parent->at_exit();
      std::fflush(stderr);
      _exit(0);
    });
    INFO("fork " << i << ", the child's stderr:\n" << slurp(dir + "/stderr"));
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    CHECK(slurp(dir + "/stderr").find("is a fork of") == std::string::npos);
  }
  stop = true;
  busy.join();
  a.reset();
  std::filesystem::remove_all(dir);
}

// ---- a process that ends without its exit handlers (Note [Writing a buffer being filled]) ----

namespace {

// In a child: an allocator of its own (never destroyed), `pairs` alloc+free pairs on device 0 and 100 on
// device 1, then the end `how` makes.
enum class End { kill, abort };
[[noreturn]] void trace_then_die(const std::string& conf, std::size_t pairs, End how) {
  const rlimit no_core{0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  auto parsed = parse_config(conf);
  if (!parsed.ok) _exit(102);
  std::string err;
  Allocator* a = Allocator::create(parsed.options, 2, &err).release();
  if (!a) _exit(103);
  for (int d = 0; d < 2; ++d) {
    DeviceEngine* e = a->device(d);
    for (std::size_t i = 0; i < (d == 0 ? pairs : 100); ++i)
      if (e->free(e->allocate(4096 + 512 * (i % 7), 0, nullptr)) != Status::ok) _exit(104);
  }
  // The writer's periodic write (Note [Writing a buffer being filled]) has run by then.
  ::usleep(400 * 1000);
  if (how == End::kill) ::kill(::getpid(), SIGKILL);
  ::signal(SIGABRT, SIG_DFL);  // the test framework's handler, inherited, would report the abort as a failure
  std::abort();
}

}  // namespace

TEST_CASE("exit: a process killed or aborted keeps every record it made", "[exit][tracer]") {
  // 20,000 pairs are 40,000 records on device 0: four full buffers of 8192 and part of a fifth, which a trace
  // written only a full buffer at a time lost with device 1's 200; in a shared file the devices interleave.
  const std::size_t pairs = 20000;
  for (const End how : {End::kill, End::abort})
    for (const char* pattern : {"/own-%d.fgt", "/shared.fgt"}) {
      INFO((how == End::kill ? "SIGKILL, " : "abort(), ") << pattern);
      const std::string dir = temp_dir("killed");
      const std::string conf = "driver:sim,trace:" + dir + pattern;
      const int status = run_child("a traced process that kills itself", [&] {
        stderr_to(dir);
        trace_then_die(conf, pairs, how);
      });
      INFO("the child's stderr:\n" << slurp(dir + "/stderr"));
      REQUIRE(WIFSIGNALED(status));
      CHECK(WTERMSIG(status) == (how == End::kill ? SIGKILL : SIGABRT));
      for (int d = 0; d < 2; ++d) {
        const std::string path = dir + (std::string(pattern) == "/shared.fgt" ? "/shared.fgt" : "/own-" + std::to_string(d) + ".fgt");
        const auto r = formats::load_trace(path);
        INFO(path << ": " << r.error);
        REQUIRE(r.ok);
        CHECK(r.warning.empty());
        const Counts c = counts(r.trace, d);
        CHECK(c.allocs == (d == 0 ? pairs : 100));
        CHECK(c.frees == (d == 0 ? pairs : 100));
      }
      std::filesystem::remove_all(dir);
    }
}

// In a child: a 1 MiB tmpfs mounted on `dir` in a mount namespace of its own (as root, or in a user namespace
// where those are allowed). False where neither can be had.
bool small_filesystem_at(const std::string& dir) {
  auto mount_it = [&] {
    return ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 &&
           ::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") == 0;
  };
  if (::unshare(CLONE_NEWNS) == 0 && mount_it()) return true;
  const uid_t uid = ::getuid();
  const gid_t gid = ::getgid();
  if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
  auto put = [](const char* file, const std::string& text) {
    const int fd = ::open(file, O_WRONLY);
    const bool ok = fd >= 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    if (fd >= 0) ::close(fd);
    return ok;
  };
  put("/proc/self/setgroups", "deny");
  return put("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") &&
         put("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1") && mount_it();
}

TEST_CASE("exit: a trace file on a full disk drops the later records and says how many", "[exit][tracer]") {
  // Where no small file system can be mounted, a file size limit stands in (EFBIG where ENOSPC would be).
  const std::string dir = temp_dir("full");
  const std::string disk = dir + "/disk";
  std::filesystem::create_directories(disk);
  const std::size_t pairs = 20000;  // 40,000 records, 1.9 MB
  const int status = run_child("a traced process whose file cannot grow", [&] {
    stderr_to(dir);
    if (!small_filesystem_at(disk)) {
      std::fprintf(stderr, "no small file system: a file size limit instead\n");
      ::signal(SIGXFSZ, SIG_IGN);
      const rlimit one_mib{1u << 20, 1u << 20};
      if (::setrlimit(RLIMIT_FSIZE, &one_mib) != 0) _exit(105);
    }
    auto parsed = parse_config("driver:sim,trace:" + disk + "/full.fgt");
    if (!parsed.ok) _exit(102);
    std::string err;
    Allocator* a = Allocator::create(parsed.options, 1, &err).release();
    if (!a) _exit(103);
    DeviceEngine* e = a->device(0);
    for (std::size_t i = 0; i < pairs; ++i)
      if (e->free(e->allocate(4096 + 512 * (i % 7), 0, nullptr)) != Status::ok) _exit(104);
    a->at_exit();
    std::fflush(stderr);
    // The parent cannot see the child's tmpfs: the file comes out through a copy on the disk outside it.
    const std::string bytes = slurp(disk + "/full.fgt");
    std::FILE* out = std::fopen((dir + "/copy.fgt").c_str(), "wb");
    if (!out || std::fwrite(bytes.data(), 1, bytes.size(), out) != bytes.size() || std::fclose(out) != 0) _exit(106);
    _exit(0);
  });
  const std::string err = slurp(dir + "/stderr");
  INFO("the child's stderr:\n" << err);
  if (err.find("no small file system") != std::string::npos)
    WARN("no small file system could be mounted here: a file size limit stood in for a full disk");
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  CHECK(err.find("fragless: writing the trace to " + disk + "/full.fgt failed") != std::string::npos);
  const auto r = formats::load_trace(dir + "/copy.fgt");
  INFO(r.error);
  REQUIRE(r.ok);
  const Counts c = counts(r.trace, 0);
  const std::size_t kept = c.allocs + c.frees;
  CHECK(kept > 0);
  CHECK(kept < 2 * pairs);
  // What the file holds and what was said to be lost add up to every record made.
  CHECK(err.find("fragless: " + std::to_string(2 * pairs - kept) + " trace records are missing from") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("exit: a process given the trace file another process writes goes on untraced and says so", "[exit][tracer]") {
  // A child forked before either made its allocator (as a launcher's workers may be) makes its own with the
  // same path: it allocates, untraced, and the parent's trace keeps every event of the parent's.
  const std::string dir = temp_dir("busy");
  const std::string conf = "driver:sim,trace:" + dir + "/one.fgt";
  auto a = test::allocator_from(conf, 1);
  const std::string path = a->trace_paths().at(0);
  DeviceEngine* e = a->device(0);
  for (int i = 0; i < 10; ++i) REQUIRE(e->free(e->allocate(MiB, 0, nullptr)) == Status::ok);
  const int status = run_child("a second process given the same trace path", [&] {
    stderr_to(dir);
    auto parsed = parse_config(conf);
    std::string err;
    auto own = Allocator::create(parsed.options, 1, &err);
    if (!own) _exit(102);
    if (!own->trace_paths().empty()) _exit(103);
    DeviceEngine* ce = own->device(0);
    for (int i = 0; i < 100; ++i)
      if (ce->free(ce->allocate(MiB, 0, nullptr)) != Status::ok) _exit(104);
    std::fflush(stderr);
    _exit(0);
  });
  const std::string err = slurp(dir + "/stderr");
  INFO("the child's stderr:\n" << err);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(err.find("another process is writing the trace file '" + path + "'") != std::string::npos);
  CHECK(err.find("is not traced") != std::string::npos);
  for (int i = 0; i < 5; ++i) REQUIRE(e->free(e->allocate(MiB, 0, nullptr)) == Status::ok);
  a.reset();
  const auto r = formats::load_trace(path);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(counts(r.trace, 0).allocs == 15);
  std::filesystem::remove_all(dir);
}

// Note [A file size limit] (tracer.cpp), from a review of the tracer: the header and the records written at exit
// are written on the program's thread, where SIGXFSZ's default action ended a process that had done its work.
TEST_CASE("exit: a file size limit reached by the trace's header or at exit does not kill the process", "[exit][tracer]") {
  const std::string dir = temp_dir("fsize");
  // The child's stderr goes to a pipe: a file would take the limit too.
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const int status = run_child("a traced process under a file size limit", [&] {
    ::dup2(out[1], 2);
    ::close(out[0]);
    ::signal(SIGXFSZ, SIG_DFL);  // the default: the process ends with a core dump
    rlimit was{};
    if (::getrlimit(RLIMIT_FSIZE, &was) != 0) _exit(100);
    const rlimit none{0, was.rlim_max};  // the soft limit: raised again below
    if (::setrlimit(RLIMIT_FSIZE, &none) != 0) _exit(101);
    auto parsed = parse_config("driver:sim,trace:" + dir + "/none.fgt");
    if (!parsed.ok) _exit(102);
    std::string err;
    // Made at once (a tool's or a test's allocator): the header's failure is the allocator's error.
    if (Allocator::create(parsed.options, 1, &err)) _exit(103);
    std::fprintf(stderr, "eager: %s\n", err.c_str());
    // Made inside a program's first allocation: the process goes on untraced.
    auto lazy = Allocator::create(parsed.options, 1, &err, /*eager=*/false);
    if (!lazy || !lazy->trace_paths().empty()) _exit(104);
    // A limit the records pass at exit, where each is written on the exiting thread.
    const rlimit small{1u << 16, was.rlim_max};
    if (::setrlimit(RLIMIT_FSIZE, &small) != 0) _exit(105);
    // The host driver's memory is a memfd, which the limit covers too: the driver is refused, said.
    auto host = parse_config("driver:host");
    if (Allocator::create(host.options, 1, &err)) _exit(109);
    std::fprintf(stderr, "host: %s\n", err.c_str());
    parsed = parse_config("driver:sim,trace:" + dir + "/small.fgt");
    Allocator* a = Allocator::create(parsed.options, 1, &err).release();
    if (!a) _exit(106);
    a->at_exit();
    DeviceEngine* e = a->device(0);
    for (int i = 0; i < 3000; ++i)  // 6,000 records, 288,000 bytes
      if (e->free(e->allocate(4096, 0, nullptr)) != Status::ok) _exit(107);
    const std::string lost = a->flush_traces();  // what was lost, said to the caller too
    if (lost.find("trace records are missing from " + dir + "/small.fgt: writing it failed: File too large") ==
        std::string::npos)
      _exit(108);
    // Removed after its writes failed: what it held is lost too, and said.
    ::unlink((dir + "/small.fgt").c_str());
    if (a->flush_traces().find("File too large; then it was removed, with the records written to it") == std::string::npos)
      _exit(110);
    std::fflush(stderr);
    _exit(0);
  });
  ::close(out[1]);
  std::string err;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<std::size_t>(n));
  ::close(out[0]);
  INFO("the child's stderr:\n" << err);
  REQUIRE(WIFEXITED(status));  // not signalled (SIGXFSZ)
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(err.find("eager: fragless: cannot write trace file '" + dir + "/none.fgt': File too large") != std::string::npos);
  CHECK(err.find("File too large; process") != std::string::npos);  // the lazy one, untraced
  CHECK(err.find("(the process's file size limit, ulimit -f, is below the device's capacity)") != std::string::npos);
  CHECK(err.find("is not traced") != std::string::npos);
  CHECK(err.find("fragless: writing the trace to " + dir + "/small.fgt failed (File too large)") != std::string::npos);
  std::filesystem::remove_all(dir);
}

// Note [Tracing in a forked child], from a review of the tracer: a child forked from a tracing process kept its
// copy of the file's descriptor, and with it the file's lock, after the parent closed it, so the next run given
// the path (here: the parent's next allocator) found it busy and went untraced.
TEST_CASE("exit: a forked child that does not trace keeps no lock on the parent's trace file", "[exit][tracer]") {
  const std::string dir = temp_dir("forklock");
  const std::string conf = "driver:sim,trace:" + dir + "/held.fgt";
  auto a = test::allocator_from(conf, 1);
  DeviceEngine* e = a->device(0);
  for (int i = 0; i < 10; ++i) REQUIRE(e->free(e->allocate(MiB, 0, nullptr)) == Status::ok);
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // an idle worker: it outlives its parent's allocator
    ::close(ready[0]);
    (void)!::write(ready[1], "x", 1);
    ::sleep(30);
    _exit(0);
  }
  ::close(ready[1]);
  char c;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);
  a.reset();  // the parent's descriptor closed
  auto parsed = parse_config(conf);
  std::string err;
  auto again = Allocator::create(parsed.options, 1, &err);
  const bool traced = again && again->trace_paths().size() == 1;
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  CHECK(traced);
  again.reset();
  std::filesystem::remove_all(dir);
}
