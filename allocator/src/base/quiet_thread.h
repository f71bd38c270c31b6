// Threads of ours start with every signal blocked: a program's handlers (a SIGTERM handler that calls exit(),
// a SIGPIPE) then run on the program's own threads, never on a trace writer or a background worker, which
// could not join itself at exit (Note [Exit while the lock is held], allocator.cpp).
#pragma once
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <time.h>

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
// meanwhile, until none is starting; a child starts with none. The wait closes a gate first, which a thread
// of ours passes just after it is counted, and the parent's and the child's handlers open it: a thread begun
// under no lock of ours (a trace writer, begun while the allocator is made, Note [Making the allocator once],
// allocator.cpp) then waits at the gate for the fork's end instead of being created after the wait ended and
// copied mid-start. The count and the gate are a Dekker pair (seq_cst): a starter counts itself and then looks
// at the gate, backing off while it is closed; the forking thread closes it and then reads the count, so one
// of the two always sees the other. Prepare handlers registered before ours (a program's, another library's)
// run while the gate is closed, and one may wait for a lock the starter holds: so a starter waits at the gate
// for kStartWait at most, and then starts all the same, saying so (a fork stalled, not a fork hung). The
// forking thread's own starts pass the gate. Between the count and the creation nothing waits for a lock a
// fork holds, and a runtime that locks its own state for a fork (ThreadSanitizer) does it in a prepare handler
// registered at its start, which runs after ours: the fork's wait ends. That wait too gives up after
// kStartWait, saying so, and the fork goes on as it would have without it. The new thread's first statement
// touches the library's thread-local storage before it stops counting: where the library was loaded by
// dlopen, that storage can be allocated there, by the C library's malloc, which a sanitizer's runtime
// replaces.
// Reproduced under GCC 12's ASan with the test "fork right after the first free begins the worker"
// (test_fork_locks.cpp, 60 forks a run): without the wait a child hung in the runtime's size-class refill in
// 9 runs of 11, with it in none of 11. tests/core/fork_gate.cpp forks while threads start, with a program's
// prepare handler registered before ours.
inline std::atomic<int> g_threads_starting{0};
inline constexpr std::chrono::seconds kStartWait{2};

inline std::atomic<int> g_thread_starts_closed{0};  // forks under way on a thread that closed the gate
inline thread_local bool t_closed_thread_starts = false;  // this thread's fork closed it (and may start one)
inline thread_local bool t_quiet_thread_began = false;    // touched first in each thread of ours

template <class F>
std::thread start_quiet_thread(F&& body) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  const auto give_up = std::chrono::steady_clock::now() + kStartWait;
  for (;;) {  // Note [Forking while a thread starts]: counted, then through the gate
    g_threads_starting.fetch_add(1);
    if (t_closed_thread_starts || g_thread_starts_closed.load() == 0) break;
    g_threads_starting.fetch_sub(1);
    while (g_thread_starts_closed.load() > 0 && std::chrono::steady_clock::now() < give_up) {
      const timespec pause{0, 50'000};
      nanosleep(&pause, nullptr);
    }
    if (g_thread_starts_closed.load() > 0) {  // a prepare handler after ours may be waiting for this thread
      std::fprintf(stderr, "fragless: a fork has been under way for %lld s; a thread of fragless's starts anyway\n",
                   static_cast<long long>(kStartWait.count()));
      g_threads_starting.fetch_add(1);
      break;
    }
  }
  try {
    std::thread t([body = std::forward<F>(body)]() mutable {
      t_quiet_thread_began = true;  // the library's thread-local storage exists from here on
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

// In a fork()'s prepare handler, after the locks that handler takes: closes the gate and waits until no thread of
// ours is starting (Note [Forking while a thread starts]). Once per fork: a second call on the same thread does
// nothing.
inline void close_thread_starts() {
  if (t_closed_thread_starts) return;
  t_closed_thread_starts = true;
  g_thread_starts_closed.fetch_add(1);
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

// In the fork's parent handler: opens the gate this thread closed, if it did.
inline void open_thread_starts() {
  if (!t_closed_thread_starts) return;
  t_closed_thread_starts = false;
  g_thread_starts_closed.fetch_sub(1);
}

// In a forked child: the threads that were starting, or waiting at the gate, are not here, and no fork is under
// way but the one that made this child.
inline void forget_starting_threads() {
  g_threads_starting.store(0);
  g_thread_starts_closed.store(0);
  t_closed_thread_starts = false;
}

}  // namespace fragless
