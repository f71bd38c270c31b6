// The device lock. Critical sections on the fast path are ~100 ns, so the lock spins briefly (a handover
// within the spin costs no system call), then blocks in the kernel (futex, through C++20 atomic wait): a
// thread queued behind a slow path that holds the lock across a driver call (a stream synchronisation, a
// cuMemCreate of GiBs) sleeps instead of burning a core. Three states, as in Drepper's "Futexes Are
// Tricky": 0 free, 1 held, 2 held with sleepers (so an unlock without sleepers makes no system call).
#pragma once
#include <atomic>

namespace fragless {

class SpinMutex {
 public:
  void lock() {
    int c = 0;
    if (state_.compare_exchange_strong(c, 1, std::memory_order_acquire)) return;
    for (int spins = 0; spins < kSpins; ++spins) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#elif defined(__aarch64__)
      asm volatile("yield");
#endif
      c = 0;
      if (state_.load(std::memory_order_relaxed) == 0 &&
          state_.compare_exchange_weak(c, 1, std::memory_order_acquire))
        return;
    }
    // Mark the lock contended and sleep until it is free; whoever takes it here keeps it marked contended
    // (it cannot know whether others still sleep).
    c = state_.exchange(2, std::memory_order_acquire);
    while (c != 0) {
      state_.wait(2, std::memory_order_relaxed);
      c = state_.exchange(2, std::memory_order_acquire);
    }
  }
  bool try_lock() {
    int c = 0;
    return state_.compare_exchange_strong(c, 1, std::memory_order_acquire);
  }
  void unlock() {
    if (state_.exchange(0, std::memory_order_release) == 2) state_.notify_one();
  }

 private:
  static constexpr int kSpins = 200;
  std::atomic<int> state_{0};
};

}  // namespace fragless
