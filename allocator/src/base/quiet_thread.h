// Threads of ours start with every signal blocked: a program's handlers (a SIGTERM handler that calls exit(),
// a SIGPIPE) then run on the program's own threads, never on a trace writer or a background worker, which
// could not join itself at exit (Note [Exit while the lock is held], allocator.cpp).
#pragma once
#include <pthread.h>
#include <sched.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <utility>

namespace fragless {

// Note [Forking while a thread starts]
// A thread between pthread_create and its body runs only the C library's and the runtime's start code, which
// glibc's fork() is safe against, but a sanitizer's runtime need not be: GCC 12's AddressSanitizer (libasan 8)
// allocates in a new thread's start (glibc's pthread_getattr_np, called for the thread's stack bounds) and
// registers no fork handler, so a fork() at that moment can copy its allocator's size-class lock held, and
// the child waits for ever at its first allocation of that class (fragless begins a device's worker at its
// first free, and a program may fork right after it). So
// every thread of ours counts as starting from before its creation to the first statement of its body, and
// the fork handlers (state/background.cpp) wait, holding every device lock, so that no worker can be begun
// meanwhile, until none is starting; a child starts with none. Between the count and the creation nothing
// waits for a lock a fork holds, and a runtime that locks its own state for a fork (ThreadSanitizer) does it
// in a prepare handler registered at its start, which runs after ours: the wait ends. It gives up after
// kStartWait all the same, saying so, and the fork goes on as it would have without it. Not covered: a trace
// writer is begun while the allocator is made, under no lock a fork holds (Note [Making the allocator once],
// allocator.cpp), so one can begin after a fork's wait ended and be copied mid-start; the tracer's own child
// handler, installed before its first writer begins, still makes such a child count none. Reproduced under
// GCC 12's ASan with the test "fork right after the first free begins the worker" (test_fork_locks.cpp,
// 60 forks a run): without the wait a child hung in the runtime's size-class refill in 9 runs of 11, with it
// in none of 11.
inline std::atomic<int> g_threads_starting{0};
inline constexpr std::chrono::seconds kStartWait{2};

template <class F>
std::thread start_quiet_thread(F&& body) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  g_threads_starting.fetch_add(1);
  try {
    std::thread t([body = std::forward<F>(body)]() mutable {
      g_threads_starting.fetch_sub(1);
      body();
    });
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    return t;
  } catch (...) {
    g_threads_starting.fetch_sub(1);
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    throw;
  }
}

// In a fork()'s prepare handler: until no thread of ours is starting (Note [Forking while a thread starts]).
inline void wait_for_starting_threads() {
  if (g_threads_starting.load() <= 0) return;
  const auto give_up = std::chrono::steady_clock::now() + kStartWait;
  while (g_threads_starting.load() > 0) {
    if (std::chrono::steady_clock::now() > give_up) {
      std::fprintf(stderr, "fragless: fork: a thread of fragless's has not begun in %lld s; forking anyway\n",
                   static_cast<long long>(kStartWait.count()));
      return;
    }
    sched_yield();
  }
}

// In a forked child: the threads that were starting are not here.
inline void forget_starting_threads() { g_threads_starting.store(0); }

}  // namespace fragless
