// Sharing on the cuda driver, over the libcuda double: cuMemExportToShareableHandle and
// cuMemImportFromShareableHandle as driver.h's R18 and R19 read them (an unexportable handle refuses, the
// descriptor is the osHandle, the importer's device gets access), and the census clean at the end.
#include <catch2/catch.hpp>

#if defined(FRAGLESS_HAVE_CUDA)
#include <dlfcn.h>
#include <unistd.h>

#include <cstring>

#include <cuda.h>

#include "client.h"

using namespace fragless;
using namespace fragless::test;

namespace {
constexpr std::size_t MiB = 1u << 20;
}  // namespace

TEST_CASE("cuda driver: the double exports only handles created exportable, and imports only its own", "[cuda][share]") {
  fake();
  Ctx ctx;
  CUcontext c = nullptr;
  REQUIRE(ctx.retain(&c, 0) == CUDA_SUCCESS);
  REQUIRE(ctx.push(c) == CUDA_SUCCESS);
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemExportToShareableHandle) exp = nullptr;
  decltype(&cuMemImportFromShareableHandle) imp = nullptr;
  load_symbol(fake().lib, &create, "cuMemCreate");
  load_symbol(fake().lib, &release, "cuMemRelease");
  load_symbol(fake().lib, &exp, "cuMemExportToShareableHandle");
  load_symbol(fake().lib, &imp, "cuMemImportFromShareableHandle");
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
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
        CUDA_ERROR_INVALID_VALUE);
  REQUIRE(imp(&imported, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == CUDA_SUCCESS);
  close(fd);  // the descriptor stayed the caller's; the imported handle holds the memory
  close(pipefd[0]);
  close(pipefd[1]);
  CHECK(release(imported) == CUDA_SUCCESS);
  CHECK(release(shareable) == CUDA_SUCCESS);
  CHECK(release(plain) == CUDA_SUCCESS);
  CUcontext popped = nullptr;
  ctx.pop(&popped);
  ctx.release(0);
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
      auto* x = static_cast<unsigned char*>(d0.allocate(n, 0, nullptr));
      REQUIRE(x);
      std::memset(x, 0x42, n);
      SharedBlock s;
      AllocError err;
      REQUIRE(d0.share(x, &s, &err) == Status::ok);
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

#endif
