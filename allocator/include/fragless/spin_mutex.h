// The device lock. Critical sections on the fast path are ~100 ns, so a waiter first spins (bursts of pause
// instructions, yielding the CPU between bursts, for at most kSpinFor): a handover within that time costs no
// system call, and a holder that was descheduled gets to run. Only then does it block in the kernel (a
// futex): a thread queued behind a slow path that holds the lock across a driver call (a stream
// synchronisation, a cuMemCreate of GiBs) sleeps instead of burning a core.
//
// Note [Unlock without a fence]: unlock is a plain release store followed by a relaxed read of the sleeper
// count, as cheap as a spin lock's. Without a full fence that read may miss a thread that is just going to
// sleep (store-load reordering), so no sleep is unbounded: a sleeper wakes at the latest after a timeout
// (100 µs, doubling to 10 ms) and tries again. A missed wake-up costs at most that much latency, never a
// hang; a sleeper behind a long call wakes a few hundred times a second at most, which is no CPU to speak of.
//
// Note [Lock owner]: the lock records which thread holds it, so that process exit can tell when the exiting
// thread holds a device's lock itself (exit() from a signal handler that interrupted the allocator, or from
// an event sink, which runs under the lock) and must not take it again (Allocator::at_exit, Note [Exit
// while the lock is held]). The owner is the thread pointer (one instruction; any unique per-thread address
// would do), stored relaxed right after the acquiring exchange and cleared right before the release store,
// in the cache line the lock word already owns: nothing is added to a fence or a wait. Only the holder
// writes it, so a thread reads its own address back exactly while it holds the lock, and never otherwise (it
// cleared the field itself before it let go); what it reads for another thread's lock is only "not me". A
// signal that lands between the exchange and the store, or between the two stores of unlock (an instruction
// each), finds the lock held and not marked: the exit then waits for it as it did before.
#pragma once
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <thread>

#if defined(__has_builtin)
#if __has_builtin(__builtin_thread_pointer)
#define FRAGLESS_HAVE_THREAD_POINTER 1
#endif
#endif

namespace fragless {

class SpinMutex {
 public:
  void lock() {
    if (try_lock()) return;  // the uncontended case, inlined where the lock is taken
    lock_contended();
  }
  bool try_lock() {
    int c = 0;
    if (state_.load(std::memory_order_relaxed) != 0 ||
        !state_.compare_exchange_strong(c, 1, std::memory_order_acquire, std::memory_order_relaxed))
      return false;
    owner_.store(self(), std::memory_order_relaxed);  // Note [Lock owner]
    return true;
  }
  void unlock() {
    owner_.store(nullptr, std::memory_order_relaxed);
    state_.store(0, std::memory_order_release);
    if (sleepers_.load(std::memory_order_relaxed) > 0)  // Note [Unlock without a fence]
      syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }
  // In a forked child, on its one thread: the threads that slept on the lock are not there (unlock then
  // makes no futex call for them).
  void forget_waiters() { sleepers_.store(0, std::memory_order_relaxed); }
  // Whether the calling thread holds the lock (Note [Lock owner]). Exact for the calling thread; says
  // nothing about which other thread, if any, holds it.
  bool held_by_this_thread() const { return owner_.load(std::memory_order_relaxed) == self(); }

 private:
  // The rest of lock(): spin, then sleep.
  __attribute__((noinline)) void lock_contended() {
    if (spin(kSpinFor)) return;
    long timeout_ns = 100'000;
    sleepers_.fetch_add(1, std::memory_order_relaxed);
    for (;;) {
      timespec ts{0, timeout_ns};
      // Sleeps only while the word still says "held" (the kernel checks it atomically).
      syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAIT_PRIVATE, 1, &ts, nullptr, 0);
      if (spin(std::chrono::microseconds(2))) break;  // a short spin after each wake: the holder may be done
      timeout_ns = std::min(timeout_ns * 2, 10'000'000L);
    }
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }
  // The calling thread's identity: its thread pointer where the compiler offers it (%fs:0 on x86-64), else
  // the address of a thread_local.
  static const void* self() {
#if defined(FRAGLESS_HAVE_THREAD_POINTER)
    return __builtin_thread_pointer();
#else
    static thread_local char tag;
    return &tag;
#endif
  }

  // Spins (pausing, and yielding between bursts) until the lock is taken or `budget` has passed.
  bool spin(std::chrono::microseconds budget) {
    const auto give_up = std::chrono::steady_clock::now() + budget;
    for (unsigned round = 1;; ++round) {
      for (int k = 0; k < 32; ++k) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        asm volatile("yield");
#endif
        if (try_lock()) return true;
      }
      if (round % 8 == 0) {
        if (std::chrono::steady_clock::now() > give_up) return false;
        std::this_thread::yield();
      }
    }
  }
  static constexpr std::chrono::microseconds kSpinFor{50};
  std::atomic<int> state_{0};     // 0 free, 1 held
  std::atomic<int> sleepers_{0};  // threads in (or entering) the futex wait
  std::atomic<const void*> owner_{nullptr};  // the holder's self(), nullptr when free (Note [Lock owner])
};

}  // namespace fragless
