// fork() while another thread is inside libfragless.so's C ABI where no device lock covers it (Note [Making
// the allocator once], allocator.cpp; Note [Histories across fork], capi.cpp), on the libcuda double:
//   1. while another thread makes the allocator itself (the process's first call: the configuration, loading
//      libcuda, cuInit): the fork does not wait for it, and the child makes its own at its first call;
//   2. while another thread is inside fragless_record_history_ex: the child's own call returns.
// Before 2026-12-04 each child waited for ever, for a lock whose holder was not in it. Each child runs under
// an alarm and exits 0 when every call returned what it should.
// With --random N: N draws, each in a fresh process that loads the library, starts three threads making their
// first calls (allocations on two devices, history calls), with the double's cuInit and context creation
// slowed by a random 0-3 ms, and forks at a random moment; the child must record a history and allocate on
// every device, and no child may hang (draws alternate the libcuda double and the host driver, some traced,
// half with C++ frames recorded). In a traced draw whose child made its own allocator the parent's or the
// child's is refused the one trace file, and says so (Note [Opening a trace file]): that process went on.
// Usage: fragless-capi-fork LIBFRAGLESS LIBFAKECUDA [--random N [SEED]]
#include <dlfcn.h>
#include <link.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "program.h"

using namespace fakecuda_program;

namespace {

struct CUstream_st;
using cudaStream_t = CUstream_st*;
constexpr std::size_t MiB = 1u << 20;

int child_limit_s() {
  int s = 20;
  if (const char* env = std::getenv("FRAGLESS_WATCHDOG_S")) s = std::max(s, std::atoi(env));
  return s;
}

// The child's end, described; a child still running after the limit is killed and described as hung.
// A child that has not ended by then gets its threads' stacks printed (when gdb is there) before it is killed:
// where it waits is what to fix. (The child's own alarm, set later than this, is for a parent that died.)
std::string wait_for(pid_t pid) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(child_limit_s());
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return std::string("waitpid failed: ") + std::strerror(errno);
    if (std::chrono::steady_clock::now() > give_up) {
      const std::string gdb = "command -v gdb >/dev/null && gdb -p " + std::to_string(pid) +
                              " -batch -ex 'thread apply all bt' 2>/dev/null | grep -E '^(#|Thread)' >&2";
      std::fprintf(stderr, "the child %d has not ended after %d s; its stacks:\n", static_cast<int>(pid), child_limit_s());
      if (std::system(gdb.c_str()) != 0) std::fprintf(stderr, "(no gdb to show them)\n");
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return "hung (killed)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return std::string("killed by ") + (WTERMSIG(status) == SIGALRM ? "its alarm (it waited for ever)" : strsignal(WTERMSIG(status)));
  return "status " + std::to_string(status);
}

void wait_until(const std::function<bool()>& done, int seconds) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (!done() && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// One draw of --random, in a fresh process (the caller's fork): 0 when its child went on, else what failed.
int one_draw(const char* lib_path, const char* fake_path, unsigned seed) {
  std::mt19937 rng(seed);
  const bool host = seed % 2;
  std::string conf = host ? "driver:host,capacity_mb:512" : "";
  if (seed % 3 == 0) {  // traced, one file for every process
    const char* tmp = std::getenv("TMPDIR");
    conf += std::string(conf.empty() ? "" : ",") + "trace:" + (tmp && *tmp ? tmp : "/tmp") + "/fragless-capi-fork-" +
            std::to_string(getppid()) + ".fgt";
  }
  setenv("FRAGLESS_CONF", conf.c_str(), 1);
  void* fake = dlopen(fake_path, RTLD_NOW | RTLD_LOCAL);
  void* lib = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
  if (!fake || !lib) return std::fprintf(stderr, "draw %u: dlopen: %s\n", seed, dlerror()), 1;
  const Double d(fake);
  auto free_fn = sym<void (*)(void*, size_t, int, cudaStream_t)>(lib, "fragless_free");
  auto history_fn = sym<void (*)(size_t, int, int)>(lib, "fragless_record_history_ex");
  auto pool_malloc_fn = sym<void* (*)(size_t, int, cudaStream_t)>(lib, "fragless_pool_malloc");
  auto last_error = sym<const char* (*)()>(lib, "fragless_last_error");
  const int devices = host ? 1 : 2;
  // Every other draw records C++ frames (stacks::cpp): the unwinder's first lookups and its rule table then
  // run on the three threads while the fork comes.
  const int frames = (seed / 2) % 2 ? 2 : 0;
  d.set_delay("cuInit", static_cast<unsigned>(rng() % 3000));
  d.set_delay("cuDevicePrimaryCtxRetain", static_cast<unsigned>(rng() % 3000));
  const unsigned fork_after_us = static_cast<unsigned>(rng() % (host ? 300 : 4000));
  // A traced draw's child may make its allocator before this process does (a fork before any making), and
  // take the trace file: this process's allocator is then refused, and says so (Note [Opening a trace file]).
  auto refused_trace = [&] { return std::strstr(last_error(), "another process is writing the trace file") != nullptr; };
  std::atomic<bool> failed{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t)
    threads.emplace_back([&, t] {
      for (int k = 0; k < 20; ++k) {
        if ((k + t) % 7 == 0) history_fn(100, 1, frames);
        const std::size_t size = static_cast<std::size_t>(1 + k % 5) * MiB;
        if (void* p = pool_malloc_fn(size, t % devices, nullptr)) free_fn(p, size, t % devices, nullptr);
        else if (!refused_trace() && !failed.exchange(true))
          std::fprintf(stderr, "draw %u: an allocation failed: %s\n", seed, last_error());
      }
    });
  usleep(fork_after_us);
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(static_cast<unsigned>(child_limit_s() + 30));
    history_fn(100, 1, frames);
    for (int dev = 0; dev < devices; ++dev) {
      void* p = pool_malloc_fn(3 * MiB, dev, nullptr);
      // A child forked before any thread began making the allocator makes its own, and is another process
      // given the parent's trace path: refused, and said so (Note [Opening a trace file]). It went on.
      if (!p && refused_trace()) _exit(0);
      if (!p) _exit(10);
      free_fn(p, 3 * MiB, dev, nullptr);
    }
    _exit(0);
  }
  for (auto& t : threads) t.join();
  if (pid < 0) return std::fprintf(stderr, "draw %u: fork failed\n", seed), 1;
  const std::string end = wait_for(pid);
  if (end == "exit 0") return failed ? 1 : 0;
  std::fprintf(stderr, "FAIL: draw %u (%s, fork after %u us): the child %s\n", seed, host ? "host" : "libcuda double",
               fork_after_us, end.c_str());
  return 1;
}

int random_draws(const char* lib_path, const char* fake_path, int n, unsigned first_seed) {
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    std::fflush(stdout);
    const pid_t w = fork();  // a fresh process per draw: the library is loaded after the fork
    if (w == 0) _exit(one_draw(lib_path, fake_path, first_seed + static_cast<unsigned>(i)));
    int status = 0;
    waitpid(w, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++bad;
  }
  const char* tmp = std::getenv("TMPDIR");
  unlink((std::string(tmp && *tmp ? tmp : "/tmp") + "/fragless-capi-fork-" + std::to_string(getpid()) + ".fgt").c_str());
  std::printf("%d of %d draws (seeds %u to %u) left a child that did not go on\n", bad, n, first_seed,
              first_seed + static_cast<unsigned>(n) - 1);
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf("usage: fragless-capi-fork LIBFRAGLESS LIBFAKECUDA [--random N [SEED]]\n"
                "  forks while another thread makes libfragless.so's allocator, and while another thread is in\n"
                "  fragless_record_history_ex, on the libcuda double; exits non-zero when a child hangs or fails.\n"
                "  --random N: N draws of forks at random moments of three threads' first calls (seeds from SEED,\n"
                "  default 1), each in a fresh process\n");
    return 0;
  }
  if (argc == 5 || argc == 6) {
    if (std::strcmp(argv[3], "--random") != 0 || std::atoi(argv[4]) <= 0)
      return std::fprintf(stderr, "usage: fragless-capi-fork LIBFRAGLESS LIBFAKECUDA [--random N [SEED]]\n"), 2;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    // The sanitizers' own allocator is not safe across fork() (glibc's malloc is): a child forked while another
    // thread was inside it waits for ever at its first allocation, which random forks hit every few draws.
    std::printf("SKIPPED: random forks under a sanitizer (its allocator is not safe across fork); they run in "
                "the plain build\n");
    return 77;
#endif
    setenv("FRAGLESS_LIBCUDA", argv[2], 1);
    const unsigned seed = argc == 6 ? static_cast<unsigned>(std::strtoul(argv[5], nullptr, 10)) : 1;
    return random_draws(argv[1], argv[2], std::atoi(argv[4]), seed);
  }
  if (argc != 3) return std::fprintf(stderr, "usage: fragless-capi-fork LIBFRAGLESS LIBFAKECUDA [--random N [SEED]]\n"), 2;
  setenv("FRAGLESS_LIBCUDA", argv[2], 1);
  // Traced, with one file for every process (no %p): a child's own allocator must not write the parent's.
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/fragless-capi-fork-XXXXXX";
  if (!mkdtemp(dir.data())) return std::fprintf(stderr, "FAIL: mkdtemp: %s\n", std::strerror(errno)), 1;
  const std::string trace = dir + "/capi.fgt";
  setenv("FRAGLESS_CONF", ("trace:" + trace).c_str(), 1);
  void* fake = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!fake || !lib) return std::fprintf(stderr, "FAIL: dlopen: %s\n", dlerror()), 1;
  const Double d(fake);
  auto malloc_fn = sym<void* (*)(size_t, int, cudaStream_t)>(lib, "fragless_malloc");
  auto free_fn = sym<void (*)(void*, size_t, int, cudaStream_t)>(lib, "fragless_free");
  auto history_fn = sym<void (*)(size_t, int, int)>(lib, "fragless_record_history_ex");
  auto count_fn = sym<int (*)()>(lib, "fragless_device_count");
  auto snapshot_fn = sym<long (*)(char*, size_t)>(lib, "fragless_snapshot");
  auto flush_fn = sym<void (*)()>(lib, "fragless_trace_flush");
  auto empty_cache_fn = sym<void (*)()>(lib, "fragless_empty_cache");

  // 1. The allocator is made by the first call; cuInit (loading the driver) is held here until the child has
  // ended (the parent's trace file is opened after it).
  {
    d.set_delay("cuInit", 600000000);
    std::atomic<bool> made{false};
    int count = -1;
    std::thread maker([&] {
      count = count_fn();
      made = true;
    });
    wait_until([&] { return d.calls("cuInit:started") > 0; }, 10);
    expect(d.calls("cuInit:started") > 0, "the first call is making the allocator (inside cuInit)");
    std::fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(static_cast<unsigned>(child_limit_s() + 30));
      d.set_delay("cuInit", 0);
      void* p = malloc_fn(MiB, 0, nullptr);  // throws on failure: the child then ends by abort
      if (!p) _exit(10);
      std::memset(p, 0x3c, MiB);
      free_fn(p, MiB, 0, nullptr);
      if (count_fn() != 2) _exit(11);
      flush_fn();
      if (access(trace.c_str(), F_OK) == 0) _exit(12);  // the child traced into the parent's file
      _exit(0);
    }
    const bool fork_waited = made;
    const std::string end = pid > 0 ? wait_for(pid) : "not forked";
    d.set_delay("cuInit", 0);  // the parent's making goes on
    maker.join();
    expect(pid > 0, "fork");
    expect(!fork_waited, "the fork did not wait for the allocator to be made");
    expect(end == "exit 0", "a child forked while another thread made the allocator makes its own and allocates (" +
                                end + "; exit 10, 11: malloc, device count; 12: it wrote the parent's trace file)");
    expect(count == 2, "the parent's allocator was made (2 devices)");
  }

  // 2. Another thread is inside fragless_record_history_ex at the fork. A growth of device 0 holds its lock
  // for 2 s (cuMemCreate takes that long); the fork's prepare handler, started meanwhile, holds the
  // allocator's creation lock while it waits for that device lock; the history call, started after it,
  // holds its own lock while it waits for the creation lock (to call back the engines). So at the fork
  // another thread holds the history lock: the child checks, in its copy of the parent's memory, that the
  // history call was under way at the fork (else it exits 30), and the parent tries again (three times at
  // most, each growth of a size not cached yet) when the threads did not line up so.
  // Not under a sanitizer: its allocator is not safe across fork(), and here other threads (the device's
  // worker, the trace writers) may be inside it at the fork (a child hung in operator new under ASan).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  constexpr bool kSanitized = true;
  std::printf("SKIPPED: the fork during record_history under a sanitizer (its allocator is not safe across fork); "
              "it runs in the plain build\n");
#else
  constexpr bool kSanitized = false;
#endif
  void* warm = malloc_fn(MiB, 0, nullptr);  // device 0's engine exists
  expect(warm != nullptr, "device 0 allocates");
  bool arranged = kSanitized;
  for (int attempt = 0; attempt < 3 && !arranged; ++attempt) {
    d.set_delay("cuMemCreate", 2000000);
    const auto creates = d.calls("cuMemCreate:started");
    void* big = nullptr;
    const std::size_t big_size = static_cast<std::size_t>(64 + 32 * attempt) * MiB;
    std::thread grower([&] { big = malloc_fn(big_size, 0, nullptr); });
    wait_until([&] { return d.calls("cuMemCreate:started") > creates; }, 10);
    expect(d.calls("cuMemCreate:started") > creates, "a growth is inside cuMemCreate, holding device 0's lock");
    std::atomic<bool> history_started{false}, history_done{false};
    std::atomic<pid_t> pid{-2};
    std::thread forker([&] {
      std::fflush(stdout);
      const pid_t r = fork();
      if (r == 0) {
        if (!history_started || history_done) _exit(30);  // not under way at the fork: not this test
        alarm(static_cast<unsigned>(child_limit_s() + 30));
        d.set_delay("cuMemCreate", 0);
        history_fn(1000, 0, 0);  // waited for ever for the parent's history lock before
        void* p = malloc_fn(3 * MiB, 0, nullptr);
        if (!p) _exit(20);
        free_fn(p, 3 * MiB, 0, nullptr);
        char buf[1];
        if (snapshot_fn(buf, sizeof buf) <= 0) _exit(21);
        _exit(0);
      }
      pid = r;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the fork is in its prepare handler
    std::thread historian([&] {
      history_started = true;
      history_fn(1000, 0, 0);
      history_done = true;
    });
    forker.join();
    historian.join();
    grower.join();
    d.set_delay("cuMemCreate", 0);
    expect(pid > 0, "fork");
    const std::string end = pid > 0 ? wait_for(pid) : "not forked";
    arranged = end != "exit 30";
    if (arranged)
      expect(end == "exit 0", "a child forked while another thread was in fragless_record_history_ex records its own "
                              "history and allocates (" + end + "; exit 20, 21: malloc, snapshot)");
    else
      std::printf("note: the history call was not under way when the fork returned; trying again\n");
    expect(big != nullptr, "the parent's growth");
    free_fn(big, big_size, 0, nullptr);
    empty_cache_fn();
  }
  expect(arranged, "a fork while another thread was in fragless_record_history_ex (in one of three attempts)");

  // 3. Another thread is inside dl_iterate_phdr (glibc's loader write lock, which a forked child inherits held:
  // Note [The loader's lock across fork], unwind.cpp) at the fork, as one loading a library would be. The child
  // records C++ frames (the unwinder asks the loader how many libraries were unloaded) and allocates. Not under
  // a sanitizer, for the reason of step 2.
  if (!kSanitized) {
    history_fn(1000, 1, 2);  // C++ frames: the parent's unwinder is in use before the fork
    void* q = malloc_fn(MiB, 0, nullptr);
    expect(q != nullptr, "device 0 allocates with C++ frames recorded");
    free_fn(q, MiB, 0, nullptr);
    static std::atomic<int> phase{0};  // 1: inside the loader; 2: the fork is done
    phase = 0;
    std::thread loader([] {
      dl_iterate_phdr(
          [](dl_phdr_info*, std::size_t, void*) {
            phase = 1;
            while (phase.load() != 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            return 1;
          },
          nullptr);
    });
    wait_until([] { return phase.load() == 1; }, 10);
    expect(phase.load() == 1, "the loader thread is inside dl_iterate_phdr, holding the loader's lock");
    std::fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(static_cast<unsigned>(child_limit_s() + 30));
      void* p = malloc_fn(3 * MiB, 0, nullptr);  // its stack is captured (C++ frames)
      if (!p) _exit(40);
      free_fn(p, 3 * MiB, 0, nullptr);
      _exit(0);
    }
    phase = 2;
    loader.join();
    const std::string end = pid > 0 ? wait_for(pid) : "not forked";
    expect(end == "exit 0", "a child forked while another thread was inside dl_iterate_phdr records C++ frames and "
                            "allocates (" + end + "; exit 40: malloc)");
    history_fn(0, 0, 0);
  }
  free_fn(warm, MiB, 0, nullptr);
  flush_fn();
  expect(access(trace.c_str(), F_OK) == 0, "the parent traced");
  unlink(trace.c_str());
  rmdir(dir.c_str());
  std::printf("%s\n", failures ? "FAILED" : "all checks passed");
  return failures ? 1 : 0;
}
