// The device lock. Critical sections on the fast path are ~100 ns, so a waiter first spins (bursts of pause
// instructions, yielding the CPU between bursts, for at most kSpinFor): a handover within that time costs no
// system call, and a holder that was descheduled gets to run. Only then does it block in the kernel (futex,
// through C++20 atomic wait): a thread queued behind a slow path that holds the lock across a driver call
// (a stream synchronisation, a cuMemCreate of GiBs) sleeps instead of burning a core. Sleepers are counted
// apart from the lock word, so an unlock makes a system call only while somebody sleeps (a three-state
// word would stay "contended" under steady contention and make every unlock a wake-up call).
#pragma once
#include <atomic>
#include <chrono>
#include <thread>

namespace fragless {

class SpinMutex {
 public:
  void lock() {
    if (try_lock()) return;
    const auto give_up = std::chrono::steady_clock::now() + kSpinFor;
    for (unsigned round = 1;; ++round) {
      for (int k = 0; k < 32; ++k) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        asm volatile("yield");
#endif
        if (state_.load(std::memory_order_relaxed) == 0 && try_lock()) return;
      }
      if (round % 8 == 0) {
        if (std::chrono::steady_clock::now() > give_up) break;
        std::this_thread::yield();
      }
    }
    // Sleep until the lock is free. The sleeper count and the lock word are both sequentially consistent: an
    // unlocker either sees this sleeper and wakes it, or this thread's next try sees the lock free.
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (!try_lock()) state_.wait(1, std::memory_order_relaxed);  // returns at once unless still held
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }
  bool try_lock() {
    int c = 0;
    return state_.compare_exchange_strong(c, 1, std::memory_order_seq_cst);
  }
  void unlock() {
    state_.store(0, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) state_.notify_one();
  }

 private:
  static constexpr std::chrono::microseconds kSpinFor{50};
  std::atomic<int> state_{0};     // 0 free, 1 held
  std::atomic<int> sleepers_{0};  // threads in (or entering) the futex wait
};

}  // namespace fragless
