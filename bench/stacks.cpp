// The cost of capturing 30 C++ frames for a snapshot's stack: fragless's cached unwinder (unwind.h) and
// glibc's backtrace(), which interprets the DWARF call-frame information of every frame on every call, in
// one run (compare the two, not the absolute numbers).
//   ./build/bin/fragless-bench-stacks
#include <benchmark/benchmark.h>

#include <execinfo.h>

#include "unwind.h"

namespace {

constexpr int kFrames = 30;

int frames_below_here() {
  void* buf[256];
  return backtrace(buf, 256) - 1;  // the frames of this function's caller and above
}

// Recurses until the stack is kFrames deep, then captures `iterations` times.
[[gnu::noinline]] int at_depth(int depth, benchmark::State& state, bool cached, int* captured) {
  if (depth > 0) {
    const int r = at_depth(depth - 1, state, cached, captured);
    benchmark::DoNotOptimize(r);
    return r + 1;
  }
  void* out[256];
  for (auto _ : state) {
    *captured = cached ? fragless::stacks::unwind(out, 256, 0) : fragless::stacks::unwind_with_backtrace(out, 256, 0);
    benchmark::DoNotOptimize(out[0]);
  }
  return 0;
}

void capture(benchmark::State& state, bool cached) {
  const int depth = std::max(0, kFrames - frames_below_here() - 1);
  int captured = 0;
  at_depth(depth, state, cached, &captured);
  state.counters["frames"] = captured;
}

void BM_StackCached(benchmark::State& state) { capture(state, true); }
void BM_StackBacktrace(benchmark::State& state) { capture(state, false); }

}  // namespace

BENCHMARK(BM_StackCached);
BENCHMARK(BM_StackBacktrace);
BENCHMARK_MAIN();
