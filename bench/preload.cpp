// What LD_PRELOAD adds to a cache hit (Google Benchmark): cudaMallocAsync + cudaFreeAsync pairs through the
// interposer's runtime half, and cuMemAllocAsync + cuMemFreeAsync through its driver half, against the same
// pairs on a fragless engine called directly (the sim driver), in one run, one and two threads. The pairs
// through the interposer pay what the engine's pair does not: the stream's device, the device's current pool
// and the pool's book of live blocks (preload_driver_pools.cpp: a lock and a map entry per allocation).
//
// Run under the interposer with the libcuda double and the runtime double (the memory is the double's host
// pages), as bench/run_preload.sh does:
//   LD_PRELOAD=build/lib/libfragless_preload.so FRAGLESS_LIBCUDA=build/lib/libfragless_fakecuda.so \
//     build/bin/fragless-bench-preload
#include <benchmark/benchmark.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "fragless/engine.h"
#include "fragless/sim_driver.h"
#include "bench_common.h"

extern "C" {
typedef int cudaError_t;
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
cudaError_t cudaSetDevice(int);
cudaError_t cudaStreamCreate(cudaStream_t*);
cudaError_t cudaStreamDestroy(cudaStream_t);
cudaError_t cudaMallocAsync(void**, size_t, cudaStream_t);
cudaError_t cudaFreeAsync(void*, cudaStream_t);
cudaError_t cudaDeviceSynchronize();
}

using namespace fragless;

namespace {

using bench::size_mix;  // the same mix as fragless-bench's BM_CacheHitPair

std::size_t live_size(const std::vector<std::size_t>& sizes, std::size_t i, int thread) {
  return sizes[(i * 7 + static_cast<std::size_t>(thread) * 13) % sizes.size()];
}

bool interposed() { return dlsym(RTLD_DEFAULT, "fragless_preload_counters") != nullptr; }

// The driver half's entry points, as a program linked against libcuda calls them (the interposer's exports).
using AllocAsync = int (*)(unsigned long long*, size_t, void*);
using FreeAsync = int (*)(unsigned long long, void*);

// One pair on each path per iteration: free block k on the thread's stream, allocate its size again.
template <class Alloc, class Free>
void pairs(benchmark::State& state, Alloc alloc, Free free) {
  const auto sizes = size_mix();
  std::vector<void*> live(64);
  for (std::size_t i = 0; i < live.size(); ++i)
    if (!alloc(&live[i], live_size(sizes, i, state.thread_index()))) {
      state.SkipWithError("an allocation of the working set failed");
      return;
    }
  std::size_t i = 0;
  bool ok = true;
  for (auto _ : state) {
    const std::size_t k = i++ & 63;
    ok = free(live[k]) && alloc(&live[k], live_size(sizes, k, state.thread_index())) && ok;
    benchmark::DoNotOptimize(live[k]);
  }
  for (void* p : live) free(p);
  if (!ok) state.SkipWithError("a pair failed");
}

void BM_RuntimeHalfPair(benchmark::State& state) {
  if (!interposed()) {
    state.SkipWithError("SKIPPED: not under LD_PRELOAD=libfragless_preload.so (see bench/run_preload.sh)");
    return;
  }
  cudaSetDevice(0);
  cudaStream_t s = nullptr;
  if (cudaStreamCreate(&s) != 0) {
    state.SkipWithError("cudaStreamCreate failed: FRAGLESS_LIBCUDA must name the libcuda double");
    return;
  }
  pairs(
      state, [&](void** p, std::size_t n) { return cudaMallocAsync(p, n, s) == 0; },
      [&](void* p) { return cudaFreeAsync(p, s) == 0; });
  cudaDeviceSynchronize();
  cudaStreamDestroy(s);
  state.SetLabel("cudaMallocAsync + cudaFreeAsync, interposed");
}
BENCHMARK(BM_RuntimeHalfPair)->Threads(1)->Threads(2)->UseRealTime();

void BM_DriverHalfPair(benchmark::State& state) {
  const auto alloc = reinterpret_cast<AllocAsync>(dlsym(RTLD_DEFAULT, "cuMemAllocAsync"));
  const auto free = reinterpret_cast<FreeAsync>(dlsym(RTLD_DEFAULT, "cuMemFreeAsync"));
  if (!interposed() || !alloc || !free) {
    state.SkipWithError("SKIPPED: not under LD_PRELOAD=libfragless_preload.so (see bench/run_preload.sh)");
    return;
  }
  cudaSetDevice(0);  // the runtime double makes the device's primary context current, as CUDA's does
  cudaStream_t s = nullptr;
  if (cudaStreamCreate(&s) != 0) {
    state.SkipWithError("cudaStreamCreate failed: FRAGLESS_LIBCUDA must name the libcuda double");
    return;
  }
  pairs(
      state,
      [&](void** p, std::size_t n) {
        unsigned long long d = 0;
        const bool ok = alloc(&d, n, s) == 0;
        *p = reinterpret_cast<void*>(d);
        return ok;
      },
      [&](void* p) { return free(reinterpret_cast<unsigned long long>(p), s) == 0; });
  cudaDeviceSynchronize();
  cudaStreamDestroy(s);
  state.SetLabel("cuMemAllocAsync + cuMemFreeAsync, interposed");
}
BENCHMARK(BM_DriverHalfPair)->Threads(1)->Threads(2)->UseRealTime();

// The floor: the same pairs on a fragless engine of this process (the sim driver), one stream per thread.
void BM_EnginePair(benchmark::State& state) {
  static std::unique_ptr<DeviceEngine> e = bench::sim_engine(PolicyKind::fragless);
  const Stream stream = static_cast<Stream>(state.thread_index() + 1);
  pairs(
      state, [&](void** p, std::size_t n) { return (*p = e->allocate(n, stream, nullptr)) != nullptr; },
      [&](void* p) { return e->free(p) == Status::ok; });
  state.SetLabel("DeviceEngine::allocate + free, direct");
}
BENCHMARK(BM_EnginePair)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
