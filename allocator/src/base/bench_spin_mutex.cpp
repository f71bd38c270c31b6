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

// The same with work outside the lock as long as the critical section (a caller between two allocations), so
// that two threads do hand the lock over; handoffs_per_1000 counts the acquisitions whose previous owner was
// the other thread (with nothing between their calls BM_DeviceLock's two threads hand it over a few times in a
// thousand at most, and its 2-thread row measures one thread running while the other waits).
template <typename Lock>
void lock_pairs_with_work(benchmark::State& state, Lock& lock, std::uint64_t& shared, int& owner) {
  const int me = state.thread_index();
  std::uint64_t mine = 0, handoffs = 0, n = 0;
  for (auto _ : state) {
    lock.lock();
    handoffs += owner != me;
    owner = me;
    for (int i = 0; i < 40; ++i) benchmark::DoNotOptimize(shared += static_cast<std::uint64_t>(i));
    lock.unlock();
    for (int i = 0; i < 40; ++i) benchmark::DoNotOptimize(mine += static_cast<std::uint64_t>(i));
    ++n;
  }
  state.counters["handoffs_per_1000"] =
      benchmark::Counter(n ? 1000.0 * static_cast<double>(handoffs) / static_cast<double>(n) : 0.0,
                         benchmark::Counter::kAvgThreads);
}

void BM_DeviceLockWithWork(benchmark::State& state) {
  static SpinMutex futex_lock;
  static YieldingSpinLock yield_lock;
  static std::uint64_t shared = 0;
  static int owner = -1;
  if (state.range(0) == 0) lock_pairs_with_work(state, futex_lock, shared, owner);
  else lock_pairs_with_work(state, yield_lock, shared, owner);
  state.SetLabel(state.range(0) == 0 ? "spin, then futex (fragless)" : "spin, then yield (before)");
}
BENCHMARK(BM_DeviceLockWithWork)->Arg(0)->Arg(1)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace
}  // namespace fragless
