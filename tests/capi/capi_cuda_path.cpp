// libfragless.so's C ABI on the libcuda double, driven as PyTorch drives it, for what issue-level defects of
// the CUDA path showed there: statistics of a device never used create nothing; a graph's memory survives
// its replay on another stream through release_pool and empty_cache; a failed wait reaches
// fragless_last_error(). Usage: fragless-capi-cuda-path LIBFRAGLESS LIBFAKECUDA
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <string>

#include "program.h"

using namespace fakecuda_program;

namespace {

struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct PoolId { unsigned long long first, second; };
constexpr std::size_t MiB = 1u << 20;

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf("usage: fragless-capi-cuda-path LIBFRAGLESS LIBFAKECUDA\n"
                "  drives libfragless.so's C ABI on driver cuda over the libcuda double, as PyTorch drives a\n"
                "  pluggable allocator; exits non-zero on any failed check\n");
    return 0;
  }
  if (argc != 3) return std::fprintf(stderr, "usage: fragless-capi-cuda-path LIBFRAGLESS LIBFAKECUDA\n"), 2;
  setenv("FRAGLESS_LIBCUDA", argv[2], 1);
  void* fake = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!fake || !lib) return std::fprintf(stderr, "FAIL: dlopen: %s\n", dlerror()), 1;
  const Double d(fake);
  auto malloc_fn = sym<void* (*)(size_t, int, cudaStream_t)>(lib, "fragless_malloc");
  auto free_fn = sym<void (*)(void*, size_t, int, cudaStream_t)>(lib, "fragless_free");
  auto empty_cache = sym<void (*)()>(lib, "fragless_empty_cache");
  auto record_stream = sym<void (*)(void*, cudaStream_t)>(lib, "fragless_record_stream");
  auto begin_pool = sym<void (*)(int, PoolId, std::function<bool(cudaStream_t)>)>(lib, "fragless_begin_allocate_to_pool");
  auto end_pool = sym<void (*)(int, PoolId)>(lib, "fragless_end_allocate_to_pool");
  auto release_pool = sym<void (*)(int, PoolId)>(lib, "fragless_release_pool");
  auto memory_stats = sym<long (*)(int, char*, size_t)>(lib, "fragless_memory_stats");
  auto reset_peak = sym<int (*)(int)>(lib, "fragless_reset_peak_stats");
  auto reset_accumulated = sym<int (*)(int)>(lib, "fragless_reset_accumulated_stats");
  auto mem_get_info = sym<int (*)(int, size_t*, size_t*)>(lib, "fragless_mem_get_info");
  auto last_error = sym<const char* (*)()>(lib, "fragless_last_error");
  const auto capture = reinterpret_cast<cudaStream_t>(0x61), replay = reinterpret_cast<cudaStream_t>(0x62);
  expect(d.adopt(capture, 0) && d.adopt(replay, 0), "two streams of device 0 (the runtime's)");

  // 1. Statistics of a device that was never used: zeros, as PyTorch's, and no engine nor context for it.
  void* x = malloc_fn(MiB, 0, nullptr);
  expect(x != nullptr, "an allocation on device 0");
  char used[8192], unused[8192];
  expect(memory_stats(0, used, sizeof used) > 0, "device 0's statistics");
  const long n = memory_stats(1, unused, sizeof unused);
  expect(n > 0 && std::string(unused).find("\"allocated_bytes.all.current\":0") != std::string::npos,
         "device 1's statistics are zeros");
  expect(reset_peak(1) == 0 && reset_accumulated(1) == 0, "device 1's resets");
  expect(!d.active(1), "and device 1's primary context was not created for them");
  expect(memory_stats(9, unused, sizeof unused) == -1 && std::string(last_error()).find("invalid device 9") != std::string::npos,
         "an invalid device is refused, and named");
  // A free naming a device never used (PyTorch names the allocation's own; a caller may not) frees the block
  // through its owner, leaves no error, and makes no engine nor context for that device.
  void* z = malloc_fn(MiB, 0, nullptr);
  free_fn(z, MiB, 1, nullptr);
  expect(std::string(last_error()).empty() && !d.active(1),
         std::string("a free of device 0's block naming device 1: no error, no context for device 1 (\"") +
             last_error() + "\")");
  size_t free_b = 0, total_b = 0;
  expect(mem_get_info(1, &free_b, &total_b) == 0 && total_b > 0 && d.active(1),
         "mem_get_info gives the driver's figures, creating the context as PyTorch's does");
  free_fn(x, MiB, 0, nullptr);

  // 2. A graph: blocks allocated to a private pool on the capture stream, replayed on another stream; the
  //    graph reset while the replay runs (release_pool), then empty_cache. Nothing is unmapped under it.
  const PoolId pool{3, 1};
  begin_pool(0, pool, [capture](cudaStream_t s) { return s == capture; });
  void* g = malloc_fn(6 * MiB, 0, capture);
  end_pool(0, pool);
  expect(g && d.launch(replay, g, 6 * MiB, 1000) == 0, "the graph's block, used by a replay on another stream");
  free_fn(g, 6 * MiB, 0, capture);
  release_pool(0, pool);
  empty_cache();
  expect(d.census().faults == 0, std::string("nothing was unmapped under the replay (") + d.first_fault() + ")");

  // 3. A wait that fails keeps the memory and says so in fragless_last_error().
  void* y = malloc_fn(8 * MiB, 0, replay);
  expect(y && d.launch(replay, y, 8 * MiB, 1000) == 0, "a block in use on its stream");
  record_stream(y, capture);
  free_fn(y, 8 * MiB, 0, replay);
  d.fail("cuEventSynchronize", 1, 700);
  empty_cache();
  d.fail("cuEventSynchronize", 0, 0);
  expect(std::string(last_error()).find("cuEventSynchronize") != std::string::npos,
         std::string("fragless_last_error() names the failed wait (\"") + last_error() + "\")");
  expect(d.census().faults == 0, "and nothing was unmapped under the work");
  empty_cache();
  expect(std::string(last_error()).empty(), "the next empty_cache succeeds and clears it");
  expect(d.census().faults == 0, "no fault at all");
  const fakecuda_census c = d.census();
  expect(c.invalidated_captures == 0 && c.context_retains == 2,
         "no invalidated capture; context retains: fragless's engines of devices 0 and 1 only (" +
             std::to_string(c.context_retains) + ")");
  std::printf("%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
