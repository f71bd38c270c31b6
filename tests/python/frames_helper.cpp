// For tests/python/test_frames.py: calls libfragless.so's malloc and free from a thread that Python never
// saw (a pure C++ thread, with no Python thread state), as a C++ framework's worker would.
#include <thread>

namespace {
using Malloc = void* (*)(unsigned long, int, void*);
using Free = void (*)(void*, unsigned long, int, void*);
}  // namespace

// Allocates `size` bytes on a new thread and frees it there; returns whether the allocation succeeded.
extern "C" __attribute__((visibility("default"))) int helper_alloc_on_cpp_thread(void* malloc_fn, void* free_fn,
                                                                                 unsigned long size) {
  int ok = 0;
  std::thread t([&] {
    void* p = reinterpret_cast<Malloc>(malloc_fn)(size, 0, nullptr);
    ok = p != nullptr;
    if (p) reinterpret_cast<Free>(free_fn)(p, size, 0, nullptr);
  });
  t.join();
  return ok;
}
