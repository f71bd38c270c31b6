// Bad input has a defined, documented result: a clear error, state unchanged, no crash.
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
  CHECK(e->stats().num_ooms == 3);
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
  // The cuda driver on a machine without a GPU (or a build without the CUDA headers): a clear error that
  // says what is missing, no crash. (Where libcuda is there, or a test loaded the libcuda double, it works.)
  o.driver = DriverKind::cuda;
  err.clear();
  if (!Allocator::create(o, 1, &err)) {
    INFO(err);
    CHECK((err.find("libcuda") != std::string::npos || err.find("cuda driver") != std::string::npos));
  }
}
