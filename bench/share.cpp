// What creating physical memory exportable costs (shareable_handles, R11/R18), per handle, on the drivers
// this machine has: the host driver (a memfd per handle against a range of the device's memfd) and the cuda
// driver on whatever libcuda FRAGLESS_LIBCUDA names (the tests' double where there is no GPU: its figures
// say nothing of CUDA's; on a GPU machine they are the real cuMemCreate with and without
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). Each iteration: create, map, set access, unmap, release of one
// handle; and a share + open + close of a block (Note [Sharing]). Ratios between rows of one run are the
// result (docs/PYTORCH.md, "Sharing across processes", says what they decided).
#include <benchmark/benchmark.h>

#include <memory>

#include "fragless/allocator.h"
#include "fragless/host_driver.h"
#if defined(FRAGLESS_HAVE_CUDA)
#include "fragless/cuda_driver.h"
#endif

using namespace fragless;

namespace {

std::unique_ptr<Driver> host(bool shareable) {
  HostDriverOptions o;
  o.capacity = 1ull << 30;
  o.shareable = shareable;
  std::string err;
  return make_host_driver(o, &err);
}

void handle_cycle(benchmark::State& state, Driver& d, std::size_t size) {
  DevicePtr va = 0;
  if (d.reserve(size, &va) != Status::ok) {
    state.SkipWithError(d.last_error().c_str());
    return;
  }
  for (auto _ : state) {
    PhysHandle h = 0;
    if (d.create(size, &h) != Status::ok || d.map(va, size, h, 0) != Status::ok || d.set_access(va, size) != Status::ok ||
        d.unmap(va, size) != Status::ok || d.release(h) != Status::ok) {
      state.SkipWithError(d.last_error().c_str());
      break;
    }
  }
  d.free_reservation(va, size);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * size));
}

void BM_HostHandle(benchmark::State& state) {
  auto d = host(state.range(0) != 0);
  handle_cycle(state, *d, static_cast<std::size_t>(state.range(1)) << 20);
}
BENCHMARK(BM_HostHandle)->ArgNames({"shareable", "MiB"})->ArgsProduct({{0, 1}, {2, 20}});

#if defined(FRAGLESS_HAVE_CUDA)
void BM_CudaHandle(benchmark::State& state) {
  CudaDriverOptions o;
  o.shareable_handles = state.range(0) != 0;
  std::string err;
  auto d = make_cuda_driver(o, &err);
  if (!d) {
    state.SkipWithError(err.c_str());
    return;
  }
  handle_cycle(state, *d, static_cast<std::size_t>(state.range(1)) << 20);
}
BENCHMARK(BM_CudaHandle)->ArgNames({"shareable", "MiB"})->ArgsProduct({{0, 1}, {2, 20}});
#endif

// One block shared and opened by a second engine, then closed and freed: the cost of the path itself.
void BM_ShareOpenClose(benchmark::State& state) {
  Options o;
  o.driver = DriverKind::host;
  o.shareable_handles = true;
  std::string err;
  auto a = Allocator::create(o, 1, &err);
  auto b = Allocator::create(o, 1, &err);
  DeviceEngine& ea = *a->device(0);
  DeviceEngine& eb = *b->device(0);
  const std::size_t n = static_cast<std::size_t>(state.range(0)) << 20;
  for (auto _ : state) {
    void* p = ea.allocate(n, 0, nullptr);
    SharedBlock s;
    std::size_t size = 0;
    if (ea.share(p, &s) != Status::ok) {
      state.SkipWithError("share failed");
      break;
    }
    void* q = eb.open_shared(s.description, s.fds.data(), s.fds.size(), &size);
    s.close_fds();
    eb.close_shared(q);
    ea.free(p);
  }
}
BENCHMARK(BM_ShareOpenClose)->ArgName("MiB")->Arg(2)->Arg(64);

}  // namespace

BENCHMARK_MAIN();
