// A value made at its first use under std::call_once, found afterwards with one atomic load, never destroyed.
// Not a function's static: a child forked while another thread was making one would wait for ever on the
// static's guard, where glibc's pthread_once (behind std::call_once) lets the child make it again (Note [Making
// the allocator once], allocator.cpp). `slot` and `once` must be constant-initialised (a function's statics of
// these types are, with no guard).
#pragma once

#include <atomic>
#include <mutex>

namespace fragless {

template <typename T, typename Make>
const T& made_once(std::atomic<const T*>& slot, std::once_flag& once, Make&& make) {
  if (const T* v = slot.load(std::memory_order_acquire)) return *v;
  std::call_once(once, [&] { slot.store(make(), std::memory_order_release); });
  return *slot.load(std::memory_order_acquire);
}

}  // namespace fragless
