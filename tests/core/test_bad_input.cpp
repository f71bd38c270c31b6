// Bad input has a defined, documented result: a clear error, state unchanged, no crash.
#include <unistd.h>

#include <cstdio>

#include "fragless/allocator.h"
#include "helpers.h"

using namespace fragless;
using namespace fragless::test;

TEST_CASE("bad input: unknown pointers, double frees, size 0, absurd sizes", "[bad-input]") {
  EngineSpec spec;
  spec.policy = GENERATE(PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless);
  spec.driver = GENERATE(DriverKind::sim, DriverKind::host);
  CAPTURE(name(spec.policy), driver_kind_name(spec.driver));
  auto e = make_engine(spec);
  void* a = e->allocate(4096, 0, nullptr);
  REQUIRE(a);
  const auto before = e->stats().flatten();

  AllocError err;
  int local = 0;
  CHECK(e->free(&local, &err) == Status::invalid_argument);
  CHECK(err.message.find("did not allocate or already freed") != std::string::npos);
  CHECK(e->free(static_cast<char*>(a) + 512, &err) == Status::invalid_argument);  // interior pointer
  CHECK(e->stats().flatten() == before);
  CHECK(e->record_stream(&local, 3) == Status::invalid_argument);

  REQUIRE(e->free(a) == Status::ok);
  CHECK(e->free(a, &err) == Status::invalid_argument);  // double free
  CHECK(e->free(nullptr) == Status::ok);                 // like cudaFree(nullptr)

  err = {};
  CHECK(e->allocate(0, 0, &err) == nullptr);  // size 0 is legal: nothing allocated, no error
  CHECK(err.status == Status::ok);

  for (std::size_t huge : {SIZE_MAX, std::size_t{1} << 60, std::size_t{1} << 45}) {
    err = {};
    CHECK(e->allocate(huge, 0, &err) == nullptr);
    CHECK(err.status == Status::out_of_memory);
    CHECK(err.message.find("out of memory") != std::string::npos);
  }
  // 2^64 - 1 and 2^60 are 1 EiB or more: refused before any search, as PyTorch's check, and not counted as
  // out-of-memory errors; 32 TiB is one.
  CHECK(e->stats().num_ooms == 1);
  require_consistent(*e);
  CHECK(e->allocate(4096, 0, nullptr) != nullptr);  // still works
}

TEST_CASE("bad input: invalid devices and driver choices are refused clearly", "[bad-input]") {
  Options o;
  o.driver = DriverKind::sim;
  std::string err;
  auto a = Allocator::create(o, 2, &err);
  REQUIRE(a);
  CHECK(a->device_count() == 2);
  CHECK(a->device(0) != nullptr);
  CHECK(a->device(1) != nullptr);
  CHECK(a->device(2) == nullptr);
  CHECK(a->device(-1) == nullptr);
#if defined(FRAGLESS_HAVE_CUDA)
  // The cuda driver works where libcuda is there: in this binary, the libcuda double (test_cuda_driver.cpp
  // points FRAGLESS_LIBCUDA at it for every test). A machine without libcuda: the next test.
  o.driver = DriverKind::cuda;
  err.clear();
  auto c = Allocator::create(o, 1, &err);
  INFO(err);
  REQUIRE(c);
  CHECK(c->device_count() == 1);
  REQUIRE(c->device(0) != nullptr);
  void* p = c->device(0)->allocate(4096, 0, nullptr);
  CHECK(p != nullptr);
  CHECK(c->device(0)->free(p) == Status::ok);
#endif
}

// The cuda driver loads libcuda once per process, and this binary loads the double: a machine without libcuda
// is this binary again, in a child process told to load a library that does not exist, running the hidden
// test below, which prints the error it got.
TEST_CASE("bad input: a machine without libcuda gets a clear error (a process of its own)", "[bad-input][cuda]") {
  const std::string missing = "/nonexistent/libcuda.so.1";
  std::string cmd, out;
  const int status = run_hidden_case("FRAGLESS_TEST_LIBCUDA=" + missing + " FRAGLESS_LIBCUDA=" + missing,
                                     "[.without-libcuda]", &cmd, &out);
  INFO(cmd << "\n" << out);
  CHECK(status == 0);  // the child's own checks passed, and it did not crash
#if defined(FRAGLESS_HAVE_CUDA)
  CHECK_THAT(out, Catch::Contains("cuda driver: fragless: cannot load " + missing + " ("));
  CHECK_THAT(out, Catch::Contains("no NVIDIA driver on this machine; use driver:host or driver:sim"));
#else
  CHECK_THAT(out, Catch::Contains("cuda driver: fragless: this build has no cuda driver"));
#endif
}

TEST_CASE("bad input: (child process) the cuda driver without libcuda", "[.without-libcuda]") {
  Options o;
  o.driver = DriverKind::cuda;
  std::string err;
  CHECK_FALSE(Allocator::create(o, 1, &err));
  CHECK_FALSE(Allocator::create(o, -1, &err));  // every device
  CHECK_FALSE(err.empty());
  std::printf("cuda driver: %s\n", err.c_str());
}
