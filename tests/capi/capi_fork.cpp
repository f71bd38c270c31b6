// fork() while another thread is inside libfragless.so's C ABI where no device lock covers it (Note [Making
// the allocator once], allocator.cpp; Note [Histories across fork], capi.cpp), on the libcuda double:
//   1. while another thread makes the allocator itself (the process's first call: the configuration, loading
//      libcuda, cuInit): the fork does not wait for it, and the child makes its own at its first call;
//   2. while another thread is inside fragless_record_history_ex: the child's own call returns.
// Before 2026-12-05 each child waited for ever, for a lock whose holder was not in it. Each child runs under
// an alarm and exits 0 when every call returned what it should. Usage: fragless-capi-fork LIBFRAGLESS LIBFAKECUDA
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>

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
std::string wait_for(pid_t pid) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(child_limit_s() + 5);
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return std::string("waitpid failed: ") + std::strerror(errno);
    if (std::chrono::steady_clock::now() > give_up) {
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

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf("usage: fragless-capi-fork LIBFRAGLESS LIBFAKECUDA\n"
                "  forks while another thread makes libfragless.so's allocator, and while another thread is in\n"
                "  fragless_record_history_ex, on the libcuda double; exits non-zero when a child hangs or fails\n");
    return 0;
  }
  if (argc != 3) return std::fprintf(stderr, "usage: fragless-capi-fork LIBFRAGLESS LIBFAKECUDA\n"), 2;
  setenv("FRAGLESS_LIBCUDA", argv[2], 1);
  void* fake = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!fake || !lib) return std::fprintf(stderr, "FAIL: dlopen: %s\n", dlerror()), 1;
  const Double d(fake);
  auto malloc_fn = sym<void* (*)(size_t, int, cudaStream_t)>(lib, "fragless_malloc");
  auto free_fn = sym<void (*)(void*, size_t, int, cudaStream_t)>(lib, "fragless_free");
  auto history_fn = sym<void (*)(size_t, int, int)>(lib, "fragless_record_history_ex");
  auto count_fn = sym<int (*)()>(lib, "fragless_device_count");
  auto snapshot_fn = sym<long (*)(char*, size_t)>(lib, "fragless_snapshot");

  // 1. The allocator is made by the first call; cuInit (loading the driver) takes 1 s here.
  {
    d.set_delay("cuInit", 1000000);
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
      alarm(static_cast<unsigned>(child_limit_s()));
      d.set_delay("cuInit", 0);
      void* p = malloc_fn(MiB, 0, nullptr);  // throws on failure: the child then ends by abort
      if (!p) _exit(10);
      std::memset(p, 0x3c, MiB);
      free_fn(p, MiB, 0, nullptr);
      if (count_fn() != 2) _exit(11);
      _exit(0);
    }
    const bool fork_waited = made;
    maker.join();
    d.set_delay("cuInit", 0);
    expect(pid > 0, "fork");
    expect(!fork_waited, "the fork did not wait for the allocator to be made");
    const std::string end = pid > 0 ? wait_for(pid) : "not forked";
    expect(end == "exit 0", "a child forked while another thread made the allocator makes its own and allocates (" +
                                end + "; exit 10, 11: malloc, device count)");
    expect(count == 2, "the parent's allocator was made (2 devices)");
  }

  // 2. Another thread is inside fragless_record_history_ex at the fork. A growth of device 0 holds its lock
  // for 2 s (cuMemCreate takes that long); the fork's prepare handler, started meanwhile, holds the
  // allocator's creation lock while it waits for that device lock; the history call, started after it,
  // holds its own lock while it waits for the creation lock (to call back the engines). So at the fork
  // another thread holds the history lock.
  {
    void* warm = malloc_fn(MiB, 0, nullptr);  // device 0's engine exists
    expect(warm != nullptr, "device 0 allocates");
    d.set_delay("cuMemCreate", 2000000);
    const auto creates = d.calls("cuMemCreate:started");
    void* big = nullptr;
    std::thread grower([&] { big = malloc_fn(64 * MiB, 0, nullptr); });
    wait_until([&] { return d.calls("cuMemCreate:started") > creates; }, 10);
    expect(d.calls("cuMemCreate:started") > creates, "a growth is inside cuMemCreate, holding device 0's lock");
    std::atomic<pid_t> pid{-2};
    std::thread forker([&] {
      std::fflush(stdout);
      const pid_t r = fork();
      if (r == 0) {
        alarm(static_cast<unsigned>(child_limit_s()));
        d.set_delay("cuMemCreate", 0);
        history_fn(1000, 1, 0);  // waited for ever for the parent's history lock before
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
    std::thread historian([&] { history_fn(1000, 1, 0); });
    forker.join();
    historian.join();
    grower.join();
    d.set_delay("cuMemCreate", 0);
    expect(pid > 0, "fork");
    const std::string end = pid > 0 ? wait_for(pid) : "not forked";
    expect(end == "exit 0", "a child forked while another thread was in fragless_record_history_ex records its own "
                            "history and allocates (" + end + "; exit 20, 21: malloc, snapshot)");
    expect(big != nullptr, "the parent's growth");
    free_fn(big, 64 * MiB, 0, nullptr);
    free_fn(warm, MiB, 0, nullptr);
  }
  std::printf("%s\n", failures ? "FAILED" : "all checks passed");
  return failures ? 1 : 0;
}
