// The cached unwinder (torch_plugin/unwind.h) against glibc's backtrace(): the same return addresses,
// frame for frame, at every depth, from several threads at once, through a library loaded with dlopen, and
// again after that library was unloaded and loaded anew (the rule cache is dropped on an unload).
#include <catch2/catch.hpp>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "unwind.h"

using fragless::stacks::unwind;
using fragless::stacks::unwind_with_backtrace;

namespace {

struct Both {
  std::vector<void*> cached, glibc;
};

// Both captures from the same function: the first frame of each is its own call site; all the others must
// match.
[[gnu::noinline]] Both capture_both() {
  Both b;
  void* x[256];
  void* y[256];
  const int n = unwind(x, 256, 0);
  const int m = unwind_with_backtrace(y, 256, 0);
  b.cached.assign(x, x + n);
  b.glibc.assign(y, y + m);
  return b;
}

[[gnu::noinline]] Both at_depth(int d) {
  if (d == 0) return capture_both();
  Both b = at_depth(d - 1);
  asm volatile("" ::: "memory");  // not a tail call: every level stays on the stack
  return b;
}

bool callers_match(const Both& b) {
  return b.cached.size() > 2 && b.cached.size() == b.glibc.size() &&
         std::equal(b.cached.begin() + 1, b.cached.end(), b.glibc.begin() + 1);
}

void same(const Both& b) {
  REQUIRE(b.cached.size() > 2);
  CHECK(b.cached.size() == b.glibc.size());
  CHECK(callers_match(b));
}

}  // namespace

TEST_CASE("unwind: the cached unwinder gives glibc's backtrace frame for frame", "[unwind]") {
  for (int depth : {0, 1, 7, 30, 90}) {
    INFO("depth " << depth);
    unsigned long long misses = 0;
    volatile int rounds = 2;  // not unrolled: the second capture has the first one's call sites, all cached
    for (int round = 0; round < rounds; ++round) {
      const Both b = at_depth(depth);
      same(b);
      CHECK(b.cached.size() >= static_cast<std::size_t>(depth));
      if (round == 1) CHECK(fragless::stacks::unwind_counters().misses == misses);
      misses = fragless::stacks::unwind_counters().misses;
    }
  }
  CHECK(fragless::stacks::unwind_counters().fallbacks == 0);  // x86-64 Linux: never glibc's walk
}

TEST_CASE("unwind: max and skip", "[unwind]") {
  const Both b = at_depth(10);
  void* out[4];
  const int n = unwind(out, 4, 0);
  CHECK(n == 4);
  void* skipped[256];
  void* full[256];
  const int all = unwind(full, 256, 0);
  const int k = unwind(skipped, 256, 3);
  REQUIRE(k == all - 3);
  CHECK(skipped[1] == full[4]);  // same caller frames above this function's own
}

TEST_CASE("unwind: several threads at once keep every frame", "[unwind][concurrency]") {
  std::atomic<int> mismatches{0}, captures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const Both b = at_depth((i + t) % 20);
        mismatches += !callers_match(b);
        ++captures;
      }
    });
  for (auto& th : threads) th.join();
  CHECK(captures == 800);
  CHECK(mismatches == 0);
}

#if defined(FRAGLESS_FRAMES_HELPER_PATH)
namespace {
std::atomic<int> g_checked{0}, g_bad{0};
// Called by the helper library on its own thread: the stack goes through that library and std::thread.
void* check_here(unsigned long, int, void*) {
  const Both b = capture_both();
  g_bad += !callers_match(b);
  ++g_checked;
  return &g_checked;
}
void ignore(void*, unsigned long, int, void*) {}
}  // namespace

TEST_CASE("unwind: through a library loaded with dlopen, and after it is unloaded and loaded again", "[unwind]") {
  for (int round = 0; round < 3; ++round) {
    void* h = dlopen(FRAGLESS_FRAMES_HELPER_PATH, RTLD_NOW | RTLD_LOCAL);
    REQUIRE(h);
    auto run = reinterpret_cast<int (*)(void*, void*, unsigned long)>(dlsym(h, "helper_alloc_on_cpp_thread"));
    REQUIRE(run);
    CHECK(run(reinterpret_cast<void*>(&check_here), reinterpret_cast<void*>(&ignore), 1) == 1);
    dlclose(h);
  }
  CHECK(g_checked == 3);
  CHECK(g_bad == 0);
}
#endif
