// The cuda driver against the libcuda test double (tests/fake_cuda): real memory, OOM retry, and a
// failure at every call site of map, set access, unmap and release with no leaked handle or range.
#include <catch2/catch.hpp>

#if defined(FRAGLESS_HAVE_CUDA)
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include <cuda.h>

#include "fake_cuda.h"
#include "fault_workload.h"
#include "fragless/allocator.h"
#include "fragless/cuda_driver.h"

using namespace fragless;

namespace {

constexpr std::size_t MiB = 1u << 20;
constexpr int kOom = 2, kIllegalAddress = 700;  // CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_ILLEGAL_ADDRESS

// Every test in this process uses the double: set before any test runs (the cuda driver reads it once).
const bool g_use_double = (setenv("FRAGLESS_LIBCUDA", FRAGLESS_FAKECUDA_PATH, 1), true);

// The double, loaded once per process (the cuda driver dlopens the same file: one instance).
struct Fake {
  void* lib = nullptr;
  decltype(&fakecuda_fail) fail = nullptr;
  decltype(&fakecuda_reset_failures) reset = nullptr;
  decltype(&fakecuda_calls) calls = nullptr;
  decltype(&fakecuda_get_census) census = nullptr;
  decltype(&fakecuda_hold_stream) hold = nullptr;
  decltype(&fakecuda_set_capacity) capacity = nullptr;
  Fake() {
    setenv("FRAGLESS_LIBCUDA", FRAGLESS_FAKECUDA_PATH, 1);
    lib = dlopen(FRAGLESS_FAKECUDA_PATH, RTLD_NOW | RTLD_LOCAL);
    REQUIRE(lib);
    fail = reinterpret_cast<decltype(fail)>(dlsym(lib, "fakecuda_fail"));
    reset = reinterpret_cast<decltype(reset)>(dlsym(lib, "fakecuda_reset_failures"));
    calls = reinterpret_cast<decltype(calls)>(dlsym(lib, "fakecuda_calls"));
    census = reinterpret_cast<decltype(census)>(dlsym(lib, "fakecuda_get_census"));
    hold = reinterpret_cast<decltype(hold)>(dlsym(lib, "fakecuda_hold_stream"));
    capacity = reinterpret_cast<decltype(capacity)>(dlsym(lib, "fakecuda_set_capacity"));
    REQUIRE((fail && reset && calls && census && hold && capacity));
  }
  fakecuda_census now() const {
    fakecuda_census c{};
    census(&c);
    return c;
  }
};

Fake& fake() {
  static Fake f;
  return f;
}

std::unique_ptr<Allocator> make(PolicyKind p, std::string* err) {
  fake();
  Options o;
  o.policy = p;
  o.driver = DriverKind::cuda;
  return Allocator::create(o, -1, err);
}

void require_nothing_held() {
  const auto c = fake().now();
  INFO("handles " << c.handles << " mappings " << c.mappings << " reservations " << c.reservations << " events "
                  << c.events << " bytes " << c.used_bytes);
  REQUIRE(c.handles == 0);
  REQUIRE(c.mappings == 0);
  REQUIRE(c.reservations == 0);
  REQUIRE(c.events == 0);
  REQUIRE(c.used_bytes == 0);
}

bool workload(DeviceEngine& e, std::string* error) {
  return fragless::test::fault_workload(e, error, [](bool on) {
    fake().hold(reinterpret_cast<void*>(fragless::test::kFaultStreamUse), on ? 1 : 0);
  });
}

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

TEST_CASE("cuda driver: a machine without libcuda gets a clear error", "[cuda][bad-input]") {
  // The double is already loaded in this process; the message for a missing library is checked by
  // asking for a device that does not exist instead, and by the loader's own wording in the docs.
  fake();
  CudaDriverOptions o;
  o.device = 9;
  std::string err;
  CHECK_FALSE(make_cuda_driver(o, &err));
  CHECK(err.find("invalid device 9 (this machine has 2 CUDA devices)") != std::string::npos);
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
                         "cuEventSynchronize", "cuStreamSynchronize"};
  std::size_t runs = 0;
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless}) {
    // How many times the workload calls each function.
    std::vector<unsigned long> total;
    {
      std::string err;
      std::vector<unsigned long> before;
      for (auto c : calls) before.push_back(fake().calls(c));
      auto a = make(p, &err);
      REQUIRE(a);
      REQUIRE(workload(*a->device(0), &err));
      a.reset();
      for (std::size_t i = 0; i < std::size(calls); ++i) total.push_back(fake().calls(calls[i]) - before[i]);
    }
    for (std::size_t c = 0; c < std::size(calls); ++c)
      for (unsigned long nth = 1; nth <= total[c]; ++nth)
        for (int error : {kOom, kIllegalAddress}) {
          INFO(policy_name(p) << ": " << calls[c] << " call " << nth << " fails with " << error);
          std::string err;
          {
            auto a = make(p, &err);
            REQUIRE(a);
            DeviceEngine& e = *a->device(0);
            fake().fail(calls[c], static_cast<int>(nth), error);
            std::string werr;
            const bool ok = workload(e, &werr);
            fake().reset();
            if (!ok) CHECK_FALSE(werr.empty());  // the error reached the caller with a message
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
  REQUIRE(init(0) == CUDA_SUCCESS);
  f.reset();
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
}

#else
TEST_CASE("cuda driver: not built (no CUDA headers)", "[cuda]") {
  WARN("SKIPPED: the cuda driver was not built because the CUDA headers were not found");
}
#endif
