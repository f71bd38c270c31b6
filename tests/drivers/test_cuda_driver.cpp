// The cuda driver against the libcuda test double (tests/fake_cuda): real memory, OOM retry, and a
// failure at every call site of map, set access, unmap and release with no leaked handle or range.
#include <catch2/catch.hpp>

#if defined(FRAGLESS_HAVE_CUDA)
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <type_traits>
#include <functional>
#include <vector>

#include <cuda.h>

#include "client.h"
#include "watchdog.h"
#include "fragless/cuda_driver.h"

using namespace fragless;
using namespace fragless::test;

namespace {

constexpr std::size_t MiB = 1u << 20;

}  // namespace

TEST_CASE("cuda driver: the libcuda double's memory is real, and everything goes back", "[cuda]") {
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless}) {
    std::string err;
    {
      auto a = make(p, &err);
      INFO(err);
      REQUIRE(a);
      REQUIRE(a->device_count() == 2);
      CHECK(a->device(0)->driver().granularity() == 2 * MiB);
      REQUIRE(workload(*a->device(0), &err));
      REQUIRE(workload(*a->device(1), &err));
      CHECK(a->device(0)->check_invariants().empty());
      auto* q = static_cast<unsigned char*>(a->device(1)->allocate(5 * MiB, 0, nullptr));
      REQUIRE(q);
      q[5 * MiB - 1] = 7;  // writable to the last byte
      CHECK(q[5 * MiB - 1] == 7);
      a->device(1)->free(q);
    }
    require_nothing_held();
  }
}

TEST_CASE("cuda driver: a device that does not exist gets a clear error", "[cuda][bad-input]") {
  // (A machine without libcuda: test_bad_input.cpp, in a process of its own.)
  fake();
  CudaDriverOptions o;
  o.device = 9;
  std::string err;
  CHECK_FALSE(make_cuda_driver(o, &err));
  CHECK(err.find("invalid device 9 (this machine has 2 CUDA devices)") != std::string::npos);
}

TEST_CASE("cuda driver: every entry point is looked up for the legacy default stream with its flag said", "[cuda]") {
  fake();
  std::string err;
  REQUIRE(cuda_device_count(&err) == 2);  // the driver loaded: every required entry point looked up
  CHECK(fake().calls("cuGetProcAddress:legacy") >= 30);
  CHECK(fake().calls("cuGetProcAddress:default") == 0);
  CHECK(fake().calls("cuGetProcAddress:per-thread") == 0);
}

TEST_CASE("cuda driver: OOM on create frees the cache, retries, then reports OOM cleanly", "[cuda]") {
  std::string err;
  fake().capacity(0, 64 * MiB);
  {
    auto a = make(PolicyKind::classic, &err);
    REQUIRE(a);
    DeviceEngine& e = *a->device(0);
    void* x = e.allocate(40 * MiB, 0x51, nullptr);
    REQUIRE(x);
    e.free(x);  // cached on stream 0x51
    // Another stream cannot use that cache; creating 40 MiB more fails, the engine releases its cache
    // and retries.
    void* y = e.allocate(40 * MiB, 0x52, nullptr);
    REQUIRE(y);
    CHECK(e.stats().num_alloc_retries >= 1);
    AllocError ae;
    CHECK(e.allocate(48 * MiB, 0x52, &ae) == nullptr);
    CHECK(ae.status == Status::out_of_memory);
    INFO(ae.message);
    CHECK(ae.message.find("out of memory") != std::string::npos);
    CHECK(e.check_invariants().empty());
    e.free(y);
    void* z = e.allocate(60 * MiB, 0x52, &ae);  // everything is usable again
    CHECK(z);
    e.free(z);
  }
  fake().capacity(0, 1024 * MiB);
  require_nothing_held();
}

TEST_CASE("cuda driver: a failure at every call site of map, set access, unmap and release leaks nothing", "[cuda]") {
  const char* calls[] = {"cuMemMap",       "cuMemSetAccess", "cuMemUnmap",    "cuMemRelease",       "cuMemCreate",
                         "cuMemAddressReserve", "cuMemAddressFree", "cuEventCreate", "cuEventRecord", "cuEventQuery",
                         "cuEventSynchronize", "cuStreamSynchronize", "cuStreamWaitEvent"};
  // The calls an allocation makes to get memory: a failure there reaches the caller (a driver error, named)
  // or runs the retry chain (out of memory); a failure of any other call is absorbed. Background work is
  // off, so every call is the allocation path's (the worker's are swept in test_background_cuda.cpp).
  Options quiet;
  quiet.background = BackgroundMode::off;
  auto on_allocation_path = [](const std::string& c) {
    return c == "cuMemMap" || c == "cuMemSetAccess" || c == "cuMemCreate" || c == "cuMemAddressReserve";
  };
  std::size_t runs = 0;
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless}) {
    // How many times the workload calls each function.
    const std::vector<unsigned long> total = calls_made(calls, [&] {
      std::string err;
      auto a = make(p, &err, quiet);
      REQUIRE(a);
      REQUIRE(workload(*a->device(0), &err));
    });
    for (std::size_t c = 0; c < std::size(calls); ++c)
      for (unsigned long nth = 1; nth <= total[c]; ++nth)
        for (int error : {kOom, kIllegalAddress}) {
          INFO(policy_name(p) << ": " << calls[c] << " call " << nth << " fails with " << error);
          std::string err;
          {
            auto a = make(p, &err, quiet);
            REQUIRE(a);
            DeviceEngine& e = *a->device(0);
            const unsigned long fired = fake().injected();
            fake().fail(calls[c], static_cast<int>(nth), error);
            std::string werr;
            const bool ok = workload(e, &werr);
            fake().reset();
            INFO("workload " << (ok ? "succeeded" : "failed: " + werr));
            REQUIRE(fake().injected() == fired + 1);  // the failure fired, once
            if (!on_allocation_path(calls[c])) {
              CHECK(ok);  // absorbed
            } else if (error == kIllegalAddress) {
              CHECK_FALSE(ok);  // reached the caller, named
              CHECK_THAT(werr, Catch::Contains(std::string(calls[c]) + ": CUDA_ERROR_ILLEGAL_ADDRESS"));
            } else if (p == PolicyKind::fragless && std::string(calls[c]) == "cuMemCreate") {
              // A multi-page handle refused is created page by page first (policy/fragless/create.cpp, create): the
              // retry chain runs only when a page is refused too.
              CHECK((ok || e.stats().num_alloc_retries >= 1));
              if (!ok) CHECK_THAT(werr, Catch::Contains("out of memory"));
            } else {
              CHECK(e.stats().num_alloc_retries >= 1);  // the retry chain ran
              if (!ok) CHECK_THAT(werr, Catch::Contains("out of memory"));
            }
            INFO(e.check_invariants());
            REQUIRE(e.check_invariants().empty());
            e.empty_cache();
            // Once the fault clears, allocations succeed again.
            std::string again;
            REQUIRE(workload(e, &again));
          }
          require_nothing_held();
          ++runs;
        }
  }
  CHECK(runs > 50);
}

// The double at its C ABI, as a program linked against libcuda calls it: it keeps the driver contract
// (driver.h, R5-R8) and is never more permissive than CUDA.
TEST_CASE("libcuda double: the driver contract (whole handles, whole unmaps, release while mapped)", "[cuda][contract]") {
  Fake& f = fake();
  auto sym = [&](const char* n) { void* p = dlsym(f.lib, n); REQUIRE(p); return p; };
  auto init = reinterpret_cast<CUresult (*)(unsigned)>(sym("cuInit"));
  auto create = reinterpret_cast<CUresult (*)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                                              unsigned long long)>(sym("cuMemCreate"));
  auto release = reinterpret_cast<CUresult (*)(CUmemGenericAllocationHandle)>(sym("cuMemRelease"));
  auto reserve = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long)>(
      sym("cuMemAddressReserve"));
  auto addr_free = reinterpret_cast<CUresult (*)(CUdeviceptr, size_t)>(sym("cuMemAddressFree"));
  auto map = reinterpret_cast<CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                                           unsigned long long)>(sym("cuMemMap"));
  auto unmap = reinterpret_cast<CUresult (*)(CUdeviceptr, size_t)>(sym("cuMemUnmap"));
  auto access = reinterpret_cast<CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t)>(sym("cuMemSetAccess"));
  auto retain = reinterpret_cast<CUresult (*)(CUcontext*, CUdevice)>(sym("cuDevicePrimaryCtxRetain"));
  auto ctx_release = reinterpret_cast<CUresult (*)(CUdevice)>(sym("cuDevicePrimaryCtxRelease_v2"));
  auto push = reinterpret_cast<CUresult (*)(CUcontext)>(sym("cuCtxPushCurrent_v2"));
  auto pop = reinterpret_cast<CUresult (*)(CUcontext*)>(sym("cuCtxPopCurrent_v2"));
  REQUIRE(init(0) == CUDA_SUCCESS);
  f.reset();
  CUmemGenericAllocationHandle none = 0;
  {
    CUmemAllocationProp p0{};
    p0.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p0.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CHECK(create(&none, 2 * MiB, &p0, 0) == CUDA_ERROR_INVALID_CONTEXT);  // no current context on this thread
  }
  CUcontext ctx = nullptr;
  REQUIRE(retain(&ctx, 0) == CUDA_SUCCESS);
  REQUIRE(push(ctx) == CUDA_SUCCESS);
  const long bytes_before = static_cast<long>(f.now().used_bytes);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc desc{};
  desc.location = prop.location;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUmemGenericAllocationHandle h4 = 0, h2 = 0;
  CUdeviceptr va = 0, other = 0;
  REQUIRE(create(&h4, 4 * MiB, &prop, 0) == CUDA_SUCCESS);
  REQUIRE(create(&h2, 2 * MiB, &prop, 0) == CUDA_SUCCESS);
  REQUIRE(reserve(&va, 16 * MiB, 0, 0, 0) == CUDA_SUCCESS);
  REQUIRE(reserve(&other, 4 * MiB, 0, 0, 0) == CUDA_SUCCESS);
  // R5: whole handle, offset 0.
  CHECK(map(va, 2 * MiB, 2 * MiB, h4, 0) == CUDA_ERROR_INVALID_VALUE);  // an interior slice
  CHECK(map(va, 2 * MiB, 0, h4, 0) == CUDA_ERROR_INVALID_VALUE);        // half a handle
  CHECK(map(va, 8 * MiB, 0, h4, 0) == CUDA_ERROR_INVALID_VALUE);        // more than the handle
  REQUIRE(map(va, 4 * MiB, 0, h4, 0) == CUDA_SUCCESS);
  REQUIRE(map(va + 4 * MiB, 2 * MiB, 0, h2, 0) == CUDA_SUCCESS);
  // R6 and R7: whole, adjacent mappings only.
  CHECK(access(va, 2 * MiB, &desc, 1) == CUDA_ERROR_INVALID_VALUE);
  CHECK(access(va, 8 * MiB, &desc, 1) == CUDA_ERROR_INVALID_VALUE);
  REQUIRE(access(va, 6 * MiB, &desc, 1) == CUDA_SUCCESS);
  CHECK(unmap(va, 2 * MiB) == CUDA_ERROR_INVALID_VALUE);
  CHECK(unmap(va + 2 * MiB, 4 * MiB) == CUDA_ERROR_INVALID_VALUE);
  CHECK(f.now().mappings == 2);
  // R9 and R8: a second mapping; released while mapped, the memory stays until the last mapping goes.
  REQUIRE(map(other, 4 * MiB, 0, h4, 0) == CUDA_SUCCESS);
  REQUIRE(access(other, 4 * MiB, &desc, 1) == CUDA_SUCCESS);
  std::memset(reinterpret_cast<void*>(va + MiB), 0x77, 64);
  CHECK(*reinterpret_cast<unsigned char*>(other + MiB + 3) == 0x77);
  REQUIRE(release(h4) == CUDA_SUCCESS);
  CHECK(release(h4) == CUDA_ERROR_INVALID_VALUE);
  CHECK(map(va + 8 * MiB, 4 * MiB, 0, h4, 0) == CUDA_ERROR_INVALID_VALUE);  // released: cannot be mapped again
  CHECK(static_cast<long>(f.now().used_bytes) == bytes_before + static_cast<long>(6 * MiB));
  REQUIRE(unmap(va, 6 * MiB) == CUDA_SUCCESS);  // two adjacent mappings in one call
  CHECK(static_cast<long>(f.now().used_bytes) == bytes_before + static_cast<long>(6 * MiB));  // h4 still at `other`
  REQUIRE(unmap(other, 4 * MiB) == CUDA_SUCCESS);
  CHECK(static_cast<long>(f.now().used_bytes) == bytes_before + static_cast<long>(2 * MiB));
  REQUIRE(release(h2) == CUDA_SUCCESS);
  REQUIRE(addr_free(va, 16 * MiB) == CUDA_SUCCESS);
  REQUIRE(addr_free(other, 4 * MiB) == CUDA_SUCCESS);
  CHECK(static_cast<long>(f.now().used_bytes) == bytes_before);
  CUcontext popped = nullptr;
  REQUIRE(pop(&popped) == CUDA_SUCCESS);
  CHECK(popped == ctx);
  CHECK(pop(&popped) == CUDA_ERROR_INVALID_CONTEXT);  // the stack is empty again
  REQUIRE(ctx_release(0) == CUDA_SUCCESS);
}


namespace {
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}
}  // namespace

TEST_CASE("cuda driver: every call runs on the owning device's context and leaves the thread as it was", "[cuda][contexts]") {
  Ctx c;
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless}) {
    {
      fake().capacity(1, 512 * MiB);  // devices differ in size
      auto a = make_lazy(p);
      // A thread whose current context is device 0's (a PyTorch thread on cuda:0) uses device 1's engine.
      CUcontext c0 = nullptr;
      REQUIRE(c.retain(&c0, 0) == CUDA_SUCCESS);
      REQUIRE(c.push(c0) == CUDA_SUCCESS);
      DeviceEngine* e1 = a->device(1);
      REQUIRE(e1);
      const Stream s1 = Fake::stream_base(1) + fragless::test::kFaultStreamA;
      const Stream u1 = Fake::stream_base(1) + fragless::test::kFaultStreamUse;
      AllocError err;
      void* x = e1->allocate(8 * MiB, s1, &err);
      INFO(err.message);
      REQUIRE(x);
      REQUIRE(e1->record_stream(x, u1) == Status::ok);
      REQUIRE(e1->free(x) == Status::ok);  // an event recorded on device 1's stream, under device 1's context
      std::size_t free_b = 0, total_b = 0;
      e1->memory_info(&free_b, &total_b);
      CHECK(total_b == 512 * MiB);  // device 1's own total, not the current device's
      CHECK(c.current() == c0);     // the caller's context is untouched
      // A fresh thread (no context at all) frees and empties the cache, as PyTorch's threads do.
      void* y = e1->allocate(3 * MiB, s1, &err);
      REQUIRE(y);
      std::thread([&] {
        CHECK(e1->free(y) == Status::ok);
        e1->empty_cache();
        CUcontext none = reinterpret_cast<CUcontext>(1);
        c.get(&none);
        CHECK(none == nullptr);  // still none afterwards
      }).join();
      CUcontext popped = nullptr;
      REQUIRE(c.pop(&popped) == CUDA_SUCCESS);
      REQUIRE(c.release(0) == CUDA_SUCCESS);
    }
    fake().capacity(1, 1024 * MiB);
    require_nothing_held();
  }
}

TEST_CASE("cuda driver: a device's context is retained on its first use only", "[cuda][contexts]") {
  {
    auto a = make_lazy(PolicyKind::fragless);
    CHECK(fake().now().context_retains == 0);  // nothing at start-up
    REQUIRE(a->device(1));
    CHECK(fake().now().context_retains == 1);  // device 1 only
    CHECK(a->existing(0) == nullptr);
    REQUIRE(a->device(1) == a->existing(1));
    CHECK(fake().now().context_retains == 1);
  }
  require_nothing_held();  // released with the engine
}

TEST_CASE("cuda driver: memory is never unmapped, freed or handed out under running work", "[cuda][async]") {
  const Stream A = fragless::test::kFaultStreamA, B = fragless::test::kFaultStreamB;
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless}) {
    INFO(policy_name(p));
    {
      auto a = make_lazy(p);
      DeviceEngine& e = *a->device(0);
      // A kernel still runs over a freed block when the cache is emptied: the release must wait for it.
      for (std::size_t size : {std::size_t{512}, 3 * MiB, 40 * MiB}) {
        void* x = e.allocate(size, A, nullptr);
        REQUIRE(x);
        REQUIRE(fake().launch(reinterpret_cast<void*>(A), x, size, 1000) == CUDA_SUCCESS);
        e.free(x);
        e.empty_cache();
      }
      // record_stream: a block used by a long kernel on B is not handed to A until that kernel is done.
      for (int round = 0; round < 4; ++round) {
        void* x = e.allocate(6 * MiB, A, nullptr);
        REQUIRE(x);
        // B uses A's block: the program orders B after A first (torch: side.wait_stream(current)).
        REQUIRE(fake().stream_wait(reinterpret_cast<void*>(B), reinterpret_cast<void*>(A)) == CUDA_SUCCESS);
        REQUIRE(fake().launch(reinterpret_cast<void*>(B), x, 6 * MiB, 500) == CUDA_SUCCESS);
        e.record_stream(x, B);
        e.free(x);
        void* y = e.allocate(6 * MiB, A, nullptr);
        REQUIRE(y);
        REQUIRE(fake().launch(reinterpret_cast<void*>(A), y, 6 * MiB, 10) == CUDA_SUCCESS);
        e.free(y);
        if (round == 2) fake().advance(1000);
      }
      // Growth under pressure (the OOM retry releases cached memory while work runs).
      fake().capacity(0, 96 * MiB);
      std::vector<void*> held;
      for (int i = 0; i < 6; ++i) {
        void* x = e.allocate(20 * MiB, i % 2 ? A : B, nullptr);
        if (!x) break;
        REQUIRE(fake().launch(reinterpret_cast<void*>(i % 2 ? A : B), x, 20 * MiB, 300) == CUDA_SUCCESS);
        if (i % 2) e.free(x); else held.push_back(x);
      }
      for (void* x : held) e.free(x);
      void* big = e.allocate(60 * MiB, A, nullptr);
      if (big) e.free(big);
      fake().capacity(0, 1024 * MiB);
      e.empty_cache();
      CHECK(fake().now().faults == 0);
    }
    INFO(fake().first_fault());
    require_nothing_held();
  }
}

TEST_CASE("cuda driver: classic's oversize release and garbage collection wait for the segment's stream", "[cuda][async]") {
  // Both give whole cached segments back in the middle of an allocation, not in empty_cache (which
  // synchronises every stream first): a kernel queued on the segment's stream before its free may still run
  // over it, so the release waits for that stream.
  const Stream A = fragless::test::kFaultStreamA;
  for (bool gc : {false, true}) {
    INFO((gc ? "garbage collection" : "oversize release"));
    {
      Options o;
      if (gc) o.garbage_collection_threshold = 0.5;
      else o.max_split_size = 40 * MiB;
      auto a = make_lazy(PolicyKind::classic, o);
      DeviceEngine& e = *a->device(0);
      std::vector<void*> cached;
      if (gc) {
        REQUIRE(e.set_memory_fraction(0.25) == Status::ok);  // 256 MiB, collected above 128 MiB reserved
        for (int i = 0; i < 6; ++i) cached.push_back(e.allocate(30 * MiB, A, nullptr));
      } else {
        fake().capacity(0, 200 * MiB);
        cached.push_back(e.allocate(160 * MiB, A, nullptr));  // oversize: never split, released before a retry
      }
      for (void* x : cached) {
        REQUIRE(x);
        REQUIRE(fake().launch(reinterpret_cast<void*>(A), x, MiB, 1000) == CUDA_SUCCESS);
        e.free(x);
      }
      const auto segments_before = e.stats().segment.all().current;
      AllocError err;
      void* y = e.allocate(gc ? 64 * MiB : 100 * MiB, A, &err);  // too small to take the 160 MiB whole
      INFO(err.message);
      REQUIRE(y);
      CHECK(e.stats().segment.all().current <= segments_before);  // cached segments went back for it
      CHECK(e.stats().num_alloc_retries == 0);                     // before the retry chain
      CHECK(fake().now().faults == 0);
      e.free(y);
      fake().capacity(0, 1024 * MiB);
      e.empty_cache();
    }
    INFO(fake().first_fault());
    require_nothing_held();
  }
}

TEST_CASE("libcuda double: asynchrony and faults are modelled (unmap under a running kernel faults)", "[cuda][async]") {
  // The double itself: without the engine's waits, an unmap under running work is a fault, and sticky.
  Ctx c;
  fake().clear_faults();
  CUcontext c0 = nullptr;
  REQUIRE(c.retain(&c0, 0) == CUDA_SUCCESS);
  REQUIRE(c.push(c0) == CUDA_SUCCESS);
  {
    Options o;
    o.driver = DriverKind::cuda;
    CudaDriverOptions co;
    std::string err;
    auto d = make_cuda_driver(co, &err);
    REQUIRE(d);
    DevicePtr va = 0;
    PhysHandle h = 0;
    REQUIRE(d->reserve(4 * MiB, &va) == Status::ok);
    REQUIRE(d->create(4 * MiB, &h) == Status::ok);
    REQUIRE(d->map(va, 4 * MiB, h, 0) == Status::ok);
    REQUIRE(d->set_access(va, 4 * MiB) == Status::ok);
    const auto A = reinterpret_cast<void*>(fragless::test::kFaultStreamA);
    REQUIRE(fake().launch(A, reinterpret_cast<void*>(va), 4 * MiB, 100) == CUDA_SUCCESS);
    Event ev = 0;
    REQUIRE(d->record_event(fragless::test::kFaultStreamA, &ev) == Status::ok);
    CHECK(d->query_event(ev) == Status::not_ready);
    fake().advance(99);
    CHECK(d->query_event(ev) == Status::not_ready);
    fake().advance(1);
    CHECK(d->query_event(ev) == Status::ok);
    REQUIRE(fake().launch(A, reinterpret_cast<void*>(va), 4 * MiB, 100) == CUDA_SUCCESS);
    CHECK(fake().now().faults == 0);
    CHECK(d->unmap(va, 4 * MiB) == Status::ok);  // no wait first
    CHECK(fake().now().faults == 1);
    CHECK(std::string(fake().first_fault()).find("cuMemUnmap") != std::string::npos);
    CHECK(d->release(h) == Status::driver_error);  // sticky: the context is broken now
    fake().clear_faults();
    fake().advance(1000);
    REQUIRE(d->release(h) == Status::ok);
    REQUIRE(d->release_event(ev) == Status::ok);
    REQUIRE(d->free_reservation(va, 4 * MiB) == Status::ok);
  }
  CUcontext popped = nullptr;
  REQUIRE(c.pop(&popped) == CUDA_SUCCESS);
  REQUIRE(c.release(0) == CUDA_SUCCESS);
  require_nothing_held();
}

// Note [Creating an engine]: a device's driver and engine are made with no lock held, and fork() holds the
// allocator's creation lock only around its bookkeeping, so a fork does not wait for a context to be made, and
// a child forked meanwhile makes the device's engine itself on first use. Before, the creation lock was held
// while the context was made, and the child waited for ever for it (its holder is not in the child).
TEST_CASE("cuda driver: fork while another thread makes a device's engine: the child makes its own", "[cuda][fork]") {
  auto a = make_lazy(PolicyKind::fragless);
  fake().delay("cuDevicePrimaryCtxRetain", 2000000);  // 2 s to make the context
  const auto started = fake().calls("cuDevicePrimaryCtxRetain:started");
  std::atomic<bool> made{false};
  DeviceEngine* engine = nullptr;
  std::thread maker([&] {
    engine = a->device(0);
    made = true;
  });
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (fake().calls("cuDevicePrimaryCtxRetain:started") == started && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool inside = fake().calls("cuDevicePrimaryCtxRetain:started") != started;
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = inside ? fork() : -1;
  if (pid == 0) {
    alarm(test::child_alarm_s());
    fake().delay("cuDevicePrimaryCtxRetain", 0);
    std::string err;
    DeviceEngine* e = a->device(0, &err);
    if (!e) _exit(10);
    void* p = e->allocate(5 * MiB, 0, nullptr);
    if (!p) _exit(11);
    if (e->free(p) != Status::ok) _exit(12);
    _exit(0);
  }
  const bool fork_waited = made;  // the fork returned after the engine was made: it waited for the context
  maker.join();
  fake().delay("cuDevicePrimaryCtxRetain", 0);
  REQUIRE(inside);
  REQUIRE(pid > 0);
  const int status = test::wait_for_child(pid, "a child forked while another thread made an engine");
  INFO("the child " << test::describe_status(status)
                    << " (exit 10 to 12: device, allocate, free; SIGALRM: it waited for the creation lock)");
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK_FALSE(fork_waited);
  REQUIRE(engine);
  CHECK(engine == a->device(0));
  a.reset();
  require_nothing_held();
}

TEST_CASE("cuda driver: a thread queued behind a slow driver call sleeps instead of spinning", "[cuda][lock]") {
  auto a = make_lazy(PolicyKind::classic);
  DeviceEngine& e = *a->device(0);
  e.free(e.allocate(4096, fragless::test::kFaultStreamB, nullptr));  // the waiter's request is a cache hit
  fake().delay("cuMemCreate", 400000);  // 0.4 s, as a large cuMemCreate can take
  const auto creates = fake().calls("cuMemCreate:started");
  std::thread slow([&] { e.free(e.allocate(64 * MiB, fragless::test::kFaultStreamA, nullptr)); });
  // Wait (at most 10 s) until it is inside cuMemCreate, holding the device lock.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (fake().calls("cuMemCreate:started") == creates && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (fake().calls("cuMemCreate:started") == creates) {
    slow.join();
    fake().delay("cuMemCreate", 0);
    FAIL("the slow allocation never reached cuMemCreate");
  }
  double cpu = 0, wall = 0;
  std::thread waiter([&] {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = thread_cpu_seconds();
    e.free(e.allocate(4096, fragless::test::kFaultStreamB, nullptr));  // needs the lock
    cpu = thread_cpu_seconds() - c0;
    wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  slow.join();
  waiter.join();
  fake().delay("cuMemCreate", 0);
  INFO("waited " << wall << " s on the lock, using " << cpu << " s of CPU");
  CHECK(cpu < 0.25 * wall);  // a spinning (or yielding) waiter uses nearly all of it
  e.empty_cache();
}


TEST_CASE("cuda driver: a graph capture with record_stream traffic, growth and OOM pressure is never invalidated",
          "[cuda][capture]") {
  Ctx c;
  const Stream C = fragless::test::kFaultStreamA, S = fragless::test::kFaultStreamB;
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless}) {
    INFO(policy_name(p));
    {
      auto a = make_lazy(p);
      DeviceEngine& e = *a->device(0);
      // The capturing thread has device 0's context current, as PyTorch's does.
      CUcontext c0 = nullptr;
      REQUIRE(c.retain(&c0, 0) == CUDA_SUCCESS);
      REQUIRE(c.push(c0) == CUDA_SUCCESS);
      // Before the capture: cached memory and pending record_stream events on both streams.
      std::vector<void*> before;
      for (int i = 0; i < 8; ++i) before.push_back(e.allocate((1 + i) * MiB, i % 2 ? C : S, nullptr));
      fake().hold(reinterpret_cast<void*>(S), 1);
      for (int i = 0; i < 8; i += 2) e.record_stream(before[i + 1], S);
      for (void* x : before) e.free(x);
      fake().capacity(0, 512 * MiB);

      REQUIRE(c.begin_capture(reinterpret_cast<CUstream>(C), CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
      const PoolId pool{7, 1};
      e.begin_allocate_to_pool(pool, [C](Stream s) { return s == C; });
      std::vector<void*> graph_blocks;
      for (int i = 0; i < 12; ++i) {
        AllocError err;
        void* x = e.allocate((i % 3 == 0 ? 24 : 1 + i) * MiB + 512, C, &err);  // growth in the private pool
        INFO(err.message);
        REQUIRE(x);
        if (i % 2) {
          e.record_stream(x, S);  // a use on another stream: its free is deferred to the end of the capture
          e.free(x);
        } else {
          graph_blocks.push_back(x);
        }
        void* y = e.allocate(2 * MiB, S, nullptr);  // another stream, default pool, meanwhile
        if (y) e.free(y);
      }
      AllocError oom;
      CHECK(e.allocate(600 * MiB, C, &oom) == nullptr);  // OOM pressure: no release, no sync, a clean OOM
      CHECK(oom.status == Status::out_of_memory);
      e.empty_cache();  // nothing is released while a capture may be under way
      CUgraph graph = nullptr;
      CHECK(c.end_capture(reinterpret_cast<CUstream>(C), &graph) == CUDA_SUCCESS);  // never invalidated
      CHECK(graph != nullptr);
      e.end_allocate_to_pool(pool);
      CHECK(fake().now().invalidated_captures == 0);

      fake().hold(reinterpret_cast<void*>(S), 0);
      for (void* x : graph_blocks) e.free(x);
      e.release_pool(pool);
      fake().capacity(0, 1024 * MiB);
      e.empty_cache();
      INFO(e.check_invariants());
      CHECK(e.check_invariants().empty());
      CHECK(e.stats().reserved_bytes.all().current == 0);  // the pool's memory went back after release_pool
      CUcontext popped = nullptr;
      REQUIRE(c.pop(&popped) == CUDA_SUCCESS);
      REQUIRE(c.release(0) == CUDA_SUCCESS);
    }
    require_nothing_held();
  }
}


TEST_CASE("cuda driver: peers reach fragless memory by default, one set-access per mapping", "[cuda][peers]") {
  const Stream on1 = Fake::stream_base(1) + fragless::test::kFaultStreamA;
  std::uint64_t set_access_calls[2] = {0, 0};
  for (bool peers : {true, false}) {
    INFO("peer_access " << peers);
    fake().clear_faults();
    {
      Options o;
      o.policy = PolicyKind::fragless;
      o.driver = DriverKind::cuda;
      o.peer_access = peers;
      std::string err;
      auto a = Allocator::create(o, -1, &err, false);
      REQUIRE(a);
      DeviceEngine& e = *a->device(0);
      void* x = e.allocate(12 * MiB, fragless::test::kFaultStreamA, nullptr);
      REQUIRE(x);
      // A kernel on device 1 reads device 0's memory (a peer copy, NCCL P2P).
      const int r = fake().launch(reinterpret_cast<void*>(on1), x, 12 * MiB, 10);
      CHECK((r == CUDA_SUCCESS) == peers);
      CHECK((fake().now().faults == 0) == peers);
      set_access_calls[peers ? 0 : 1] = e.driver_counters()[DriverCall::set_access];
      fake().clear_faults();
      fake().advance(100);
      e.free(x);
    }
    require_nothing_held();
  }
  CHECK(set_access_calls[0] == set_access_calls[1]);  // the peers ride in the same call
}


TEST_CASE("cuda driver: CUDA events come from a pool, not one cuEventCreate per record", "[cuda][events]") {
  {
    auto a = make_lazy(PolicyKind::fragless);
    DeviceEngine& e = *a->device(0);
    const auto creates = fake().calls("cuEventCreate"), records = fake().calls("cuEventRecord"),
               destroys = fake().calls("cuEventDestroy");
    for (int i = 0; i < 2000; ++i) {
      void* x = e.allocate(4096 * (1 + i % 9), fragless::test::kFaultStreamA, nullptr);
      REQUIRE(x);
      e.record_stream(x, fragless::test::kFaultStreamB);
      e.free(x);  // an event recorded on stream B
    }
    CHECK(fake().calls("cuEventRecord") - records >= 2000);
    CHECK(fake().calls("cuEventCreate") - creates <= 4);  // the outstanding few, re-recorded ever after
    CHECK(fake().calls("cuEventDestroy") == destroys);
  }
  require_nothing_held();  // the pool is destroyed with the driver
}

#else
TEST_CASE("cuda driver: not built (no CUDA headers)", "[cuda]") {
  WARN("SKIPPED: the cuda driver was not built because the CUDA headers were not found");
}
#endif
