// Sharing on the cuda driver, over the libcuda double: cuMemExportToShareableHandle and
// cuMemImportFromShareableHandle as driver.h's R18 and R19 read them (an unexportable handle refuses, the
// descriptor is the osHandle, the importer's device gets access), and the census clean at the end.
#include <catch2/catch.hpp>

#if defined(FRAGLESS_HAVE_CUDA)
#include <dlfcn.h>
#include <unistd.h>

#include <cstring>
#include <tuple>

#include <cuda.h>

#include "client.h"
#include "fragless/config.h"
#include "fragless/cuda_driver.h"

using namespace fragless;
using namespace fragless::test;

namespace {
constexpr std::size_t MiB = 1u << 20;

// The double's sharing entry points, called directly in device 0's primary context (pushed for the scope),
// and allocation properties for device 0 with no handle type.
struct Direct {
  Ctx ctx;
  CUcontext c = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemExportToShareableHandle) exp = nullptr;
  decltype(&cuMemImportFromShareableHandle) imp = nullptr;
  decltype(&cuDeviceGetAttribute) attr = nullptr;
  CUmemAllocationProp prop{};
  Direct() {
    fake();
    REQUIRE(ctx.retain(&c, 0) == CUDA_SUCCESS);
    REQUIRE(ctx.push(c) == CUDA_SUCCESS);
    load_symbol(fake().lib, &create, "cuMemCreate");
    load_symbol(fake().lib, &release, "cuMemRelease");
    load_symbol(fake().lib, &exp, "cuMemExportToShareableHandle");
    load_symbol(fake().lib, &imp, "cuMemImportFromShareableHandle");
    load_symbol(fake().lib, &attr, "cuDeviceGetAttribute");
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
  }
  ~Direct() {
    CUcontext popped = nullptr;
    ctx.pop(&popped);
    ctx.release(0);
  }
};

// A block of n bytes of 0x42 on engine e, shared into *s.
unsigned char* shared_bytes(DeviceEngine& e, std::size_t n, SharedBlock* s) {
  auto* x = static_cast<unsigned char*>(e.allocate(n, 0, nullptr));
  REQUIRE(x);
  std::memset(x, 0x42, n);
  AllocError err;
  INFO(err.message);
  REQUIRE(e.share(x, s, &err) == Status::ok);
  return x;
}
}  // namespace

TEST_CASE("cuda driver: the double exports only handles created exportable, and imports only its own", "[cuda][share]") {
  {
    Direct d;
    auto [create, release, exp, imp, prop] = std::tie(d.create, d.release, d.exp, d.imp, d.prop);
    CUmemGenericAllocationHandle plain = 0, shareable = 0, imported = 0;
    REQUIRE(create(&plain, 2 * MiB, &prop, 0) == CUDA_SUCCESS);
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    REQUIRE(create(&shareable, 2 * MiB, &prop, 0) == CUDA_SUCCESS);
    int fd = -1;
    CHECK(exp(&fd, plain, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_ERROR_INVALID_VALUE);  // NONE: no export
    CHECK(exp(&fd, shareable, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_ERROR_NOT_SUPPORTED);
    CHECK(exp(&fd, shareable, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1) == CUDA_ERROR_INVALID_VALUE);  // flags: 0
    REQUIRE(exp(&fd, shareable, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_SUCCESS);
    int pipefd[2];
    REQUIRE(pipe(pipefd) == 0);
    CHECK(imp(&imported, reinterpret_cast<void*>(static_cast<std::uintptr_t>(pipefd[0])),
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == CUDA_ERROR_INVALID_VALUE);
    CHECK(imp(&imported, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)), CU_MEM_HANDLE_TYPE_FABRIC) ==
          CUDA_ERROR_NOT_PERMITTED);  // R26: no IMEX channel (the double's devices have no fabric by default)
    REQUIRE(imp(&imported, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == CUDA_SUCCESS);
    close(fd);  // the descriptor stayed the caller's; the imported handle holds the memory
    close(pipefd[0]);
    close(pipefd[1]);
    CHECK(release(imported) == CUDA_SUCCESS);
    CHECK(release(shareable) == CUDA_SUCCESS);
    CHECK(release(plain) == CUDA_SUCCESS);
  }
  require_nothing_held();
}

TEST_CASE("cuda driver: a block shared from device 0 and opened on device 1 through the double", "[cuda][share]") {
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless}) {
    CAPTURE(policy_name(p));
    {
      Options plain;
      auto a0 = make_lazy(p, plain);
      void* x = a0->device(0)->allocate(MiB, 0, nullptr);
      SharedBlock s;
      AllocError err;
      CHECK(a0->device(0)->share(x, &s, &err) == Status::not_supported);  // R11: not created exportable
      CHECK_THAT(err.message, Catch::Contains("shareable_handles:True"));
      a0->device(0)->free(x);
    }
    require_nothing_held();
    {
      Options o;
      o.shareable_handles = true;
      auto a = make_lazy(p, o);
      DeviceEngine& d0 = *a->device(0);
      DeviceEngine& d1 = *a->device(1);
      const std::size_t n = 3 * MiB;
      SharedBlock s;
      AllocError err;
      unsigned char* x = shared_bytes(d0, n, &s);
      std::size_t size = 0;
      auto* y = static_cast<unsigned char*>(d1.open_shared(s.description, s.fds.data(), s.fds.size(), &size, &err));
      INFO(err.message);
      REQUIRE(y);
      CHECK(y[0] == 0x42);
      CHECK(y[n - 1] == 0x42);
      y[7] = 0x99;
      CHECK(x[7] == 0x99);
      // Device 1 has access to what it opened: work of its stream over the block runs without a fault.
      CHECK(fake().work(Fake::stream_base(1) + kFaultStreamA, y, n, 10) == CUDA_SUCCESS);
      s.close_fds();
      REQUIRE(d0.free(x) == Status::ok);
      CHECK(d0.stats().allocated_bytes.all().current == static_cast<std::int64_t>(n));  // held for device 1
      REQUIRE(d1.close_shared(y, &err) == Status::ok);  // waits for device 1's work first (R13)
      CHECK(d0.reap_shared(1000000) == 1);
      CHECK(d0.stats().allocated_bytes.all().current == 0);
      CHECK(d0.check_invariants().empty());
      CHECK(d1.check_invariants().empty());
    }
    require_nothing_held();
  }
}

TEST_CASE("cuda driver: the double's fabric handles (R26): the attribute, the type, forged bytes", "[cuda][share]") {
  void (*set_fabric)(int) = nullptr;
  load_symbol(fake().lib, &set_fabric, "fakecuda_set_fabric");
  {
    Direct d;
    auto [create, release, exp, imp, prop] = std::tie(d.create, d.release, d.exp, d.imp, d.prop);
    auto& attr = d.attr;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
    CUmemGenericAllocationHandle posix = 0, fab = 0, imported = 0;
    int supported = -1;
    REQUIRE(attr(&supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, 0) == CUDA_SUCCESS);
    CHECK(supported == 0);
    CHECK(create(&fab, 2 * MiB, &prop, 0) == CUDA_ERROR_NOT_SUPPORTED);  // no attribute: no fabric type
    set_fabric(1);
    REQUIRE(attr(&supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, 0) == CUDA_SUCCESS);
    CHECK(supported == 1);
    REQUIRE(create(&fab, 2 * MiB, &prop, 0) == CUDA_SUCCESS);
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    REQUIRE(create(&posix, 2 * MiB, &prop, 0) == CUDA_SUCCESS);
    CUmemFabricHandle f{};
    int fd = -1;
    CHECK(exp(&f, posix, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_ERROR_INVALID_VALUE);  // not created with the type
    CHECK(exp(&fd, fab, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_ERROR_INVALID_VALUE);
    REQUIRE(exp(&f, fab, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_SUCCESS);
    CUmemFabricHandle forged = f;
    forged.data[20] ^= 1;  // another descriptor number
    CHECK(imp(&imported, &forged, CU_MEM_HANDLE_TYPE_FABRIC) == CUDA_ERROR_INVALID_VALUE);
    forged = f;
    forged.data[63] = 7;
    CHECK(imp(&imported, &forged, CU_MEM_HANDLE_TYPE_FABRIC) == CUDA_ERROR_INVALID_VALUE);
    REQUIRE(imp(&imported, &f, CU_MEM_HANDLE_TYPE_FABRIC) == CUDA_SUCCESS);
    set_fabric(0);
    CHECK(imp(&imported, &f, CU_MEM_HANDLE_TYPE_FABRIC) == CUDA_ERROR_NOT_PERMITTED);  // no IMEX channel
    CHECK(release(imported) == CUDA_SUCCESS);
    CHECK(release(fab) == CUDA_SUCCESS);
    CHECK(release(posix) == CUDA_SUCCESS);
  }
  require_nothing_held();
}

TEST_CASE("cuda driver: shareable_handles:fabric shares through fabric handles, and is refused without them",
          "[cuda][share]") {
  void (*set_fabric)(int) = nullptr;
  load_symbol(fake().lib, &set_fabric, "fakecuda_set_fabric");
  unsigned (*last_types)() = nullptr;
  load_symbol(fake().lib, &last_types, "fakecuda_last_handle_types");
  const ConfigResult parsed = parse_config("shareable_handles:fabric");
  REQUIRE(parsed.ok);
  CHECK((parsed.options.shareable_handles && parsed.options.fabric_handles));
  CHECK(parse_config("shareable_handles:True").options.fabric_handles == false);
  const ConfigResult bad = parse_config("shareable_handles:fabrik");
  CHECK(!bad.ok);
  CHECK_THAT(bad.error, Catch::Contains("True, False or fabric"));
  Options o = parsed.options;
  {
    Options host = o;
    host.driver = DriverKind::host;
    std::string error;
    CHECK(Allocator::create(host, -1, &error) == nullptr);  // fabric is CUDA's handle type: never ignored
    CHECK_THAT(error, Catch::Contains("shareable_handles:fabric needs the cuda driver"));
  }
  {
    std::string error;
    CudaDriverOptions c;
    c.shareable_handles = c.fabric_handles = true;
    CHECK(make_cuda_driver(c, &error) == nullptr);  // R26: the device lacks the attribute
    CHECK_THAT(error, Catch::Contains("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"));
  }
  set_fabric(1);
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::fragless}) {
    CAPTURE(policy_name(p));
    {
      SharedBlock s;
      auto a = make_lazy(p, o);
      DeviceEngine& d0 = *a->device(0);
      DeviceEngine& d1 = *a->device(1);
      const std::size_t n = 3 * MiB;
      unsigned char* x = shared_bytes(d0, n, &s);
      AllocError err;
      CHECK(s.fds.size() == 1);  // the lease alone: the handles are in the description
      CHECK(last_types() == CU_MEM_HANDLE_TYPE_FABRIC);
      std::size_t size = 0;
      // A fabric share offered with descriptors is refused before anything is mapped.
      const int extra[2] = {s.fds[0], s.fds[0]};
      CHECK(d1.open_shared(s.description, extra, 2, &size, &err) == nullptr);
      CHECK_THAT(err.message, Catch::Contains("fabric handles (the lease alone expected)"));
      auto* y = static_cast<unsigned char*>(d1.open_shared(s.description, s.fds.data(), s.fds.size(), &size, &err));
      INFO(err.message);
      REQUIRE(y);
      CHECK(y[0] == 0x42);
      y[7] = 0x99;
      CHECK(x[7] == 0x99);
      CHECK(d0.stats().exported_bytes.all().current >= static_cast<std::int64_t>(n));
      CHECK(d1.stats().imported_bytes.all().current >= static_cast<std::int64_t>(n));
      CHECK(fake().work(Fake::stream_base(1) + kFaultStreamA, y, n, 10) == CUDA_SUCCESS);
      s.close_fds();
      REQUIRE(d1.close_shared(y, &err) == Status::ok);
      REQUIRE(d0.free(x) == Status::ok);
      CHECK(d0.reap_shared(1000000) == 0);  // nothing held it at the free: it went back at once
      CHECK(d0.stats().allocated_bytes.all().current == 0);
      CHECK(d0.check_invariants().empty());
      CHECK(d1.check_invariants().empty());
    }
    require_nothing_held();
  }
  set_fabric(0);
}

#endif
