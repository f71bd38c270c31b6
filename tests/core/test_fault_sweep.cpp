// Fault injection on the host driver: every driver call site, at every occurrence in a scripted
// multi-stream workload, fails once with out_of_memory and once with a driver error. Each injected failure
// fires (the driver counts them) and has its effect: on the allocation path a driver error reaches the
// caller as a failed allocation whose message names the call, and out of memory runs the retry chain; a
// failure on the way back (unmap, release, events) is absorbed (deferred and retried, or waited out) and
// never fails an allocation. Afterwards the engine is consistent, empty_cache gives every handle, mapping
// and reservation back, and allocations succeed once the fault has cleared. (The cuda driver's sweep on
// the libcuda double is in test_cuda_driver.cpp.)
#include <chrono>
#include <cstdio>

#include "census_checks.h"
#include "fault_workload.h"
#include "helpers.h"

using namespace fragless;
using namespace fragless::test;

namespace {

// The calls an allocation makes to get memory; a failure of any other call is absorbed.
bool on_allocation_path(DriverCall c) {
  return c == DriverCall::reserve || c == DriverCall::create || c == DriverCall::map || c == DriverCall::set_access;
}

bool workload(DeviceEngine& e, std::string* error) {
  TestEvents* ev = test_events_of(e.driver());
  return fault_workload(e, error, [ev](bool on) { on ? ev->hold(kFaultStreamUse) : ev->complete(kFaultStreamUse); });
}

// One policy's sweep; a line on stdout after each call site, so a long run shows progress.
void sweep(PolicyKind policy) {
  CAPTURE(name(policy));
  const auto start = std::chrono::steady_clock::now();
  EngineSpec spec;
  spec.policy = policy;
  spec.driver = DriverKind::host;
  spec.capacity = 512 * MiB;
  // Background work off, so every call is the caller's; the worker's calls are swept in
  // test_background.cpp (stepped by hand) and test_background_cuda.cpp (the thread, on the libcuda double).
  spec.base.background = BackgroundMode::off;
  DriverCounters total;
  {
    auto e = make_engine(spec);
    std::string err;
    REQUIRE(workload(*e, &err));
    total = e->driver_counters();
  }
  std::size_t runs = 0;
  for (int c = 0; c < kDriverCallCount; ++c) {
    const auto call = static_cast<DriverCall>(c);
    if (call == DriverCall::memory_info) continue;  // a memory query has no failure to inject (it answers)
    for (std::uint64_t nth = 1; nth <= total.calls[static_cast<std::size_t>(c)]; ++nth)
      for (Status failure : {Status::out_of_memory, Status::driver_error}) {
        INFO(driver_call_name(call) << " call " << nth << " fails with " << status_name(failure));
        auto e = make_engine(spec);
        host_driver_inject_failure(e->driver(), call, nth, failure);
        std::string err;
        const bool ok = workload(*e, &err);
        host_driver_inject_failure(e->driver(), call, 0, Status::ok);
        INFO("workload " << (ok ? "succeeded" : "failed: " + err));
        REQUIRE(host_driver_injected_failures(e->driver()) == 1);  // the failure fired, once
        if (!on_allocation_path(call)) {
          CHECK(ok);  // absorbed
        } else if (failure == Status::driver_error) {
          CHECK_FALSE(ok);  // reached the caller, named
          CHECK_THAT(err, Catch::Contains(std::string(driver_call_name(call)) + ": injected failure (driver_error)"));
        } else if (policy == PolicyKind::fragless && call == DriverCall::create) {
          // A multi-page handle refused is created page by page first (policy/fragless/policy.cpp, create): the
          // retry chain runs only when a page is refused too.
          CHECK((ok || e->stats().num_alloc_retries >= 1));
          if (!ok) CHECK_THAT(err, Catch::Contains("out of memory"));
        } else {
          CHECK(e->stats().num_alloc_retries >= 1);  // the retry chain ran
          if (!ok) CHECK_THAT(err, Catch::Contains("out of memory"));
        }
        require_consistent(*e);
        check_all_given_back(*e, true);
        std::string again;
        REQUIRE(workload(*e, &again));
        require_consistent(*e);
        ++runs;
      }
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start);
    std::printf("fault sweep (%s): %s done, %zu runs, %llds\n", name(policy), driver_call_name(call), runs,
                static_cast<long long>(secs.count()));
    std::fflush(stdout);
  }
  CHECK(runs > 40);
}

}  // namespace

TEST_CASE("fault sweep: every host driver call site fails at every occurrence, nothing leaks (classic)", "[faults]") {
  sweep(PolicyKind::classic);
}
TEST_CASE("fault sweep: every host driver call site fails at every occurrence, nothing leaks (expandable)", "[faults]") {
  sweep(PolicyKind::expandable);
}
TEST_CASE("fault sweep: every host driver call site fails at every occurrence, nothing leaks (fragless)", "[faults]") {
  sweep(PolicyKind::fragless);
}
