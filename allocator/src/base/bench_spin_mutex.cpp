// BM_DeviceLock, a benchmark of fragless-bench (bench/micro.cpp holds the others): it lives beside the lock
// it measures, the one private header a benchmark needs, so that nothing outside allocator/ and tests/
// includes allocator/src.
#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdint>
#include <thread>

#include "fragless/spin_mutex.h"

namespace fragless {
namespace {

// The device lock around a critical section of the fast path's length, on 1 and 2 threads: fragless's lock
// (spin, then sleep on a futex) against the spin-then-yield lock it replaced (kept here as the reference), in
// one run so the ratio is what counts. Arg 0: SpinMutex, arg 1: the yielding lock.
class YieldingSpinLock {  // the device lock before: spins 64 pauses, then sched_yield in a loop
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
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

template <typename Lock>
void lock_pairs(benchmark::State& state, Lock& lock, std::uint64_t& shared) {
  for (auto _ : state) {
    lock.lock();
    for (int i = 0; i < 40; ++i) benchmark::DoNotOptimize(shared += static_cast<std::uint64_t>(i));  // 12-22 ns
    lock.unlock();
  }
}

void BM_DeviceLock(benchmark::State& state) {
  static SpinMutex futex_lock;
  static YieldingSpinLock yield_lock;
  static std::uint64_t shared = 0;
  if (state.range(0) == 0) lock_pairs(state, futex_lock, shared);
  else lock_pairs(state, yield_lock, shared);
  state.SetLabel(state.range(0) == 0 ? "spin, then futex (fragless)" : "spin, then yield (before)");
}
BENCHMARK(BM_DeviceLock)->Arg(0)->Arg(1)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace
}  // namespace fragless
