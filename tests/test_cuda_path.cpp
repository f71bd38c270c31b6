// The CUDA path on the libcuda double, driven as PyTorch drives an allocator: memory moved between streams
// and addresses, graphs, failed waits, statistics, per-thread streams, stream handles reused, unmaps over
// several mappings. The double judges work by the physical memory it touches (tests/fake_cuda).
#include <catch2/catch.hpp>

#if defined(FRAGLESS_HAVE_CUDA)
#include "client.h"
#include "fragless/cuda_driver.h"

using namespace fragless;
using namespace fragless::test;

namespace {
constexpr std::size_t MiB = 1u << 20;
constexpr PolicyKind kPolicies[] = {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless};
}  // namespace

namespace {
// A cuda driver of device 0 used directly (no engine), under device 0's primary context made current.
struct RawDriver {
  Ctx c;
  std::unique_ptr<Driver> d;
  RawDriver() {
    fake().clear_faults();
    CUcontext c0 = nullptr;
    REQUIRE(c.retain(&c0, 0) == CUDA_SUCCESS);
    REQUIRE(c.push(c0) == CUDA_SUCCESS);
    std::string err;
    d = make_cuda_driver(CudaDriverOptions{}, &err);
    INFO(err);
    REQUIRE(d);
  }
  ~RawDriver() {
    d.reset();
    CUcontext popped = nullptr;
    c.pop(&popped);
    c.release(0);
  }
  // One handle of `size` bytes mapped at two addresses (R9), accessible at both.
  void map_twice(std::size_t size, PhysHandle* h, DevicePtr* va1, DevicePtr* va2) {
    REQUIRE(d->create(size, h) == Status::ok);
    for (DevicePtr* va : {va1, va2}) {
      REQUIRE(d->reserve(size, va) == Status::ok);
      REQUIRE(d->map(*va, size, *h, 0) == Status::ok);
      REQUIRE(d->set_access(*va, size) == Status::ok);
    }
  }
};
void* at(DevicePtr va) { return reinterpret_cast<void*>(va); }
}  // namespace

TEST_CASE("libcuda double: work is judged by the physical memory it touches, unmaps by their addresses", "[cuda][async]") {
  const Stream S = kFaultStreamA, T = kFaultStreamB;
  constexpr std::size_t kSize = 4 * MiB;
  auto faults = [] { return fake().now().faults; };
  RawDriver r;
  Driver& d = *r.d;
  PhysHandle h = 0;
  DevicePtr va1 = 0, va2 = 0;
  r.map_twice(kSize, &h, &va1, &va2);
  SECTION("unordered work on two streams over one handle at two addresses faults") {
    REQUIRE(fake().work(S, at(va1), kSize, 100) == CUDA_SUCCESS);
    CHECK(fake().work(T, at(va2 + kSize - 4096), 4096, 10) == CUDA_SUCCESS);  // the last page only
    CHECK(faults() == 1);
    CHECK(std::string(fake().first_fault()).find("handed out again too early") != std::string::npos);
  }
  SECTION("work that merely starts later is not ordered: it still faults") {
    REQUIRE(fake().work(T, at(va2 + kSize), 0, 500) == CUDA_SUCCESS);  // T is busy until 500 (no memory)
    REQUIRE(fake().work(S, at(va1), kSize, 100) == CUDA_SUCCESS);      // S's work ends at 100
    CHECK(fake().work(T, at(va2), kSize, 10) == CUDA_SUCCESS);         // starts at 500, but unordered
    CHECK(faults() == 1);
  }
  SECTION("ordered through an event (cuStreamWaitEvent), or by waiting on the host, it is legal") {
    const auto start = fake().clock();
    REQUIRE(fake().work(S, at(va1), kSize, 100) == CUDA_SUCCESS);
    Event e = 0;
    REQUIRE(d.record_event(S, &e) == Status::ok);
    REQUIRE(d.stream_wait_event(T, e) == Status::ok);
    REQUIRE(fake().work(T, at(va2), kSize, 10) == CUDA_SUCCESS);
    CHECK(fake().clock() == start);  // nobody waited on the host
    REQUIRE(fake().work(S, at(va1), kSize, 100) == CUDA_SUCCESS);  // after T's work? No: unordered again
    CHECK(faults() == 1);
    fake().clear_faults();
    REQUIRE(d.synchronize_stream(S) == Status::ok);
    REQUIRE(d.synchronize_stream(T) == Status::ok);
    REQUIRE(fake().work(T, at(va2), kSize, 10) == CUDA_SUCCESS);  // S's work is done: nothing to order after
    CHECK(faults() == 0);
    REQUIRE(d.release_event(e) == Status::ok);
  }
  SECTION("work on other bytes of the same handle does not conflict") {
    REQUIRE(fake().work(S, at(va1), kSize / 2, 100) == CUDA_SUCCESS);
    REQUIRE(fake().work(T, at(va2 + kSize / 2), kSize / 2, 100) == CUDA_SUCCESS);
    CHECK(faults() == 0);
    CHECK(fake().work(T, at(va2 + kSize / 2 - 1), 1, 1) == CUDA_SUCCESS);  // one byte of S's half
    CHECK(faults() == 1);
  }
  SECTION("unmapping one address while work uses the handle through the other is legal") {
    REQUIRE(fake().work(S, at(va2), kSize, 100) == CUDA_SUCCESS);
    REQUIRE(d.unmap(va1, kSize) == Status::ok);
    CHECK(faults() == 0);
    REQUIRE(d.release(h) == Status::ok);  // still mapped at va2: the memory stays
    CHECK(faults() == 0);
    // ...but the address that work was launched on may not go under it, and the memory with it.
    CHECK(d.unmap(va2, kSize) == Status::ok);
    CHECK(faults() == 2);  // the unmap (by address) and the memory going (by handle)
    CHECK(std::string(fake().first_fault()).find("cuMemUnmap") != std::string::npos);
    fake().clear_faults();
    fake().advance(1000);
    REQUIRE(d.free_reservation(va1, kSize) == Status::ok);
    REQUIRE(d.free_reservation(va2, kSize) == Status::ok);
    h = 0;
  }
  SECTION("work through an address that is no longer mapped faults, though the handle lives on") {
    REQUIRE(d.unmap(va1, kSize) == Status::ok);
    CHECK(fake().work(S, at(va1), kSize, 10) == kIllegalAddress);
    CHECK(faults() == 1);
    fake().clear_faults();
    REQUIRE(fake().work(S, at(va2), kSize, 10) == CUDA_SUCCESS);
    CHECK(faults() == 0);
    REQUIRE(d.map(va1, kSize, h, 0) == Status::ok);  // mapped again for the teardown below
    REQUIRE(d.set_access(va1, kSize) == Status::ok);
  }
  fake().clear_faults();
  fake().advance(1000);
  if (h) {
    for (DevicePtr va : {va1, va2}) REQUIRE(d.unmap(va, kSize) == Status::ok);
    REQUIRE(d.release(h) == Status::ok);
    for (DevicePtr va : {va1, va2}) REQUIRE(d.free_reservation(va, kSize) == Status::ok);
  }
  CHECK(faults() == 0);
}

TEST_CASE("cuda driver: memory moved to another stream is used only after the work that used it", "[cuda][async][lend]") {
  const Stream A = kFaultStreamA, B = kFaultStreamB;
  for (PolicyKind p : kPolicies)
    for (bool tight : {false, true}) {
      INFO(policy_name(p) << (tight ? ", no room to create" : ", room to create"));
      {
        auto a = make_lazy(p);
        DeviceEngine& e = *a->device(0);
        // A block on A, used by a long kernel, freed: A's own later work may reuse it at once.
        void* x = e.allocate(16 * MiB, A, nullptr);
        REQUIRE(x);
        REQUIRE(fake().work(A, x, 16 * MiB, 1000) == CUDA_SUCCESS);
        REQUIRE(e.free(x) == Status::ok);
        // B misses. fragless may lend the hole's handles to B at a new address (the old mapping stays until
        // A's work is done); with no room to create, every policy must take that memory for B.
        if (tight) fake().capacity(0, e.usage().reserved + 8 * MiB);
        void* y = e.allocate(16 * MiB, B, nullptr);
        REQUIRE(y);
        REQUIRE(fake().work(B, y, 16 * MiB, 10) == CUDA_SUCCESS);
        CHECK(fake().now().faults == 0);
        REQUIRE(e.free(y) == Status::ok);
        e.empty_cache();
        fake().capacity(0, 1024 * MiB);
      }
      require_nothing_held();
    }
}

#endif  // without the CUDA headers test_cuda_driver.cpp says SKIPPED
