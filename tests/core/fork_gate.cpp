// The gate of Note [Forking while a thread starts] (allocator/src/base/quiet_thread.h), with real forks, in a
// process of its own: the order of fork handlers is the order of their registration, process-wide, so the
// program's handler here is registered before fragless's, as a program's or an earlier library's would be, and
// runs while fragless's gate is closed.
//   fragless-fork-gate starts  threads begin threads of fragless's while the main thread forks: no body begins
//                              while the gate is closed, every child counts none starting, the gate reopens
//   fragless-fork-gate lock    a thread holding a lock the program's prepare handler takes begins a thread of
//                              fragless's during a fork: the fork stalls (the gate's limit) but ends
// Exit 0 on success, 1 with a line on stderr naming what failed.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "base/quiet_thread.h"
#include "fragless/allocator.h"

namespace {

using fragless::g_thread_starts_closed;
using fragless::g_threads_starting;

std::atomic<bool> g_in_prepare{false};
std::atomic<int> g_bodies{0}, g_bodies_in_prepare{0};

int starts() {
  // Registered before fragless's handlers: its prepare handler runs after fragless's has closed the gate, its
  // parent handler before fragless's opens it.
  // A thread that began before the gate closed may read the flag a moment late (its count ended, so the
  // fork's wait ended, before its body's first read): the flag is raised 2 ms into the handler, and up to
  // kLate such late reads are allowed. Without the gate about 11,000 of 400 forks' bodies begin in the window.
  pthread_atfork([] {
    usleep(2000);
    g_in_prepare = true;
    usleep(1000);  // the window: a thread created now passed no gate
  }, [] { g_in_prepare = false; }, [] {});
  fragless::hold_across_fork([](void*) {}, [](void*) {}, nullptr);  // fragless's handlers, from here on
  std::atomic<bool> stop{false};
  std::vector<std::thread> starters;
  for (int k = 0; k < 3; ++k)
    starters.emplace_back([&] {
      while (!stop)
        fragless::start_quiet_thread([] {
          if (g_in_prepare.load()) ++g_bodies_in_prepare;
          ++g_bodies;
        }).join();
    });
  int bad_children = 0, closed_after = 0;
  constexpr int kForks = 400;
  for (int i = 0; i < kForks; ++i) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork-gate: fork");
      return 1;
    }
    if (pid == 0) _exit(g_threads_starting.load() == 0 && g_thread_starts_closed.load() == 0 ? 0 : 1);
    if (g_thread_starts_closed.load() != 0) ++closed_after;
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++bad_children;
  }
  stop = true;
  for (auto& t : starters) t.join();
  std::printf("fork-gate starts: %d forks, %d bodies, %d begun while a fork's handlers ran, %d children counting a "
              "start, %d forks leaving the gate closed\n",
              kForks, g_bodies.load(), g_bodies_in_prepare.load(), bad_children, closed_after);
  if (g_bodies.load() < kForks) {  // the starters must have raced the forks for the check to mean anything
    std::fprintf(stderr, "fork-gate starts: FAILED: only %d threads began during %d forks\n", g_bodies.load(), kForks);
    return 1;
  }
  constexpr int kLate = 2;
  if (g_bodies_in_prepare.load() > kLate || bad_children || closed_after || g_threads_starting.load() ||
      g_thread_starts_closed.load()) {
    std::fprintf(stderr, "fork-gate starts: FAILED (see the line above)\n");
    return 1;
  }
  return 0;
}

std::mutex g_program_lock;

int lock() {
  pthread_atfork([] { g_program_lock.lock(); }, [] { g_program_lock.unlock(); }, [] { g_program_lock.unlock(); });
  fragless::hold_across_fork([](void*) {}, [](void*) {}, nullptr);
  std::atomic<bool> holding{false}, started{false};
  std::thread t([&] {
    std::lock_guard lk(g_program_lock);
    holding = true;
    usleep(200'000);  // the fork closes the gate meanwhile, then its program handler waits for the lock
    fragless::start_quiet_thread([&] { started = true; }).join();
  });
  while (!holding) usleep(1000);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid < 0) {
    std::perror("fork-gate: fork");
    return 1;
  }
  if (pid == 0) _exit(0);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int status = 0;
  waitpid(pid, &status, 0);
  t.join();
  std::printf("fork-gate lock: the fork took %.2f s; the thread %s\n", s, started ? "began" : "did not begin");
  // The stall happened and ended: the starter waited at the gate (while the fork's program handler waited for
  // its lock) for kStartWait, then began anyway.
  const double wait = static_cast<double>(fragless::kStartWait.count());
  if (s < 0.9 * wait || s > wait + 30.0)
    std::fprintf(stderr, "fork-gate lock: the fork took %.2f s, not about the %.0f s a starter waits at the gate\n", s,
                 wait);
  if (!started || !WIFEXITED(status) || WEXITSTATUS(status) != 0 || g_thread_starts_closed.load() != 0 ||
      s < 0.9 * wait || s > wait + 30.0) {
    std::fprintf(stderr, "fork-gate lock: FAILED\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf("usage: %s starts|lock (the scenarios are described at the top of tests/core/fork_gate.cpp)\n", argv[0]);
    return 0;
  }
  alarm(120);  // a hang ends the test (SIGALRM) instead of CTest's limit
  if (argc == 2 && std::strcmp(argv[1], "starts") == 0) return starts();
  if (argc == 2 && std::strcmp(argv[1], "lock") == 0) return lock();
  std::fprintf(stderr, "usage: %s starts|lock\n", argv[0]);
  return 2;
}
