// The device lock. Critical sections on the fast path are ~100 ns, so a test-and-test-and-set lock that
// spins briefly and then yields hands over far faster than a futex-based std::mutex under contention.
// Slow paths may hold it for a driver call; waiters then yield the CPU instead of burning it.
#pragma once
#include <atomic>
#include <thread>

namespace fragless {

class SpinMutex {
 public:
  void lock() {
    for (int spins = 0;; ++spins) {
      if (!locked_.exchange(true, std::memory_order_acquire)) return;
      while (locked_.load(std::memory_order_relaxed)) {
        if (spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
          ++spins;
        } else {
          std::this_thread::yield();
        }
      }
    }
  }
  bool try_lock() { return !locked_.load(std::memory_order_relaxed) && !locked_.exchange(true, std::memory_order_acquire); }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace fragless
