// Threads of ours start with every signal blocked: a program's handlers (a SIGTERM handler that calls exit(),
// a SIGPIPE) then run on the program's own threads, never on a trace writer or a background worker, which
// could not join itself at exit (Note [Exit while the lock is held], allocator.cpp).
#pragma once
#include <pthread.h>
#include <signal.h>

#include <thread>
#include <utility>

namespace fragless {

template <class F>
std::thread start_quiet_thread(F&& body) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  std::thread t(std::forward<F>(body));
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return t;
}

}  // namespace fragless
