// The background worker on the cuda driver, against the libcuda double: the fault-sweep workload with the
// worker thread on (it splits the handles the workload frees, on its own thread, in its own context
// scope), with each call the worker makes failing at every occurrence. What the worker does when is a
// matter of timing, so the sweep asserts what must hold whatever it did: the engine stays consistent,
// nothing hangs, and the double holds nothing once the allocator is gone.
#include <catch2/catch.hpp>

#if defined(FRAGLESS_HAVE_CUDA)
#include <thread>

#include "client.h"
#include "watchdog.h"

using namespace fragless;
using namespace fragless::test;

namespace {

constexpr std::size_t MiB = 1u << 20;

Options with_worker() {
  Options o;  // the defaults: handles:cells, background:True
  o.background = BackgroundMode::thread;
  return o;
}

}  // namespace

TEST_CASE("background: the worker on the libcuda double splits what the workload frees and holds nothing after", "[background][cuda][concurrency]") {
  Watchdog dog("background on the double", 300);
  std::string err;
  {
    auto a = make(PolicyKind::fragless, &err, with_worker());
    REQUIRE(a);
    DeviceEngine& e = *a->device(0);
    for (int round = 0; round < 2; ++round) REQUIRE(workload(e, &err));
    // Large blocks freed with no empty_cache after them: their bodies wait for the worker.
    void* big[] = {e.allocate(40 * MiB, 0, nullptr), e.allocate(24 * MiB + 4096, 0, nullptr)};
    for (void* p : big) REQUIRE(p);
    for (void* p : big) e.free(p);
    e.drain_background();
    INFO(e.check_invariants());
    REQUIRE(e.check_invariants().empty());
    CHECK(e.driver_counters().background(DriverCall::create) > 0);
  }
  require_nothing_held();
}

// A memory reading (cuMemGetInfo and fragless's books at one moment: what the interposer's cudaMemGetInfo
// adds the cache from) waits for the job in flight, and no new job starts until it is done, so a queue of
// splits does not make it wait for them all; the worker goes on after it.
TEST_CASE("background: a memory reading waits for the job in flight only, and the worker goes on after it",
          "[background][cuda][concurrency]") {
  Watchdog dog("a memory reading while splits are queued", 300);
  std::string err;
  {
    auto a = make(PolicyKind::fragless, &err, with_worker());
    REQUIRE(a);
    DeviceEngine& e = *a->device(0);
    void* big[4];
    for (void*& p : big) REQUIRE((p = e.allocate(40 * MiB, 0, nullptr)));
    fake().delay("cuMemCreate", 20000);  // 20 ms a create: each split takes about six
    const unsigned long before = fake().calls("cuMemCreate");
    for (void* p : big) REQUIRE(e.free(p) == Status::ok);  // four multi-page handles free: four splits
    while (fake().calls("cuMemCreate:started") == fake().calls("cuMemCreate")) std::this_thread::yield();
    const unsigned long c0 = fake().calls("cuMemCreate");
    std::size_t free_b = 0, total_b = 0;
    DeviceEngine::Usage u;
    REQUIRE(e.memory_info_and_usage(&free_b, &total_b, &u));
    const unsigned long during = fake().calls("cuMemCreate") - c0;
    e.drain_background();
    fake().delay("cuMemCreate", 0);
    const unsigned long all = fake().calls("cuMemCreate") - before;
    INFO(during << " creates while the reading waited, " << all << " for the four splits");
    CHECK(total_b > 0);
    CHECK(during <= all / 2);  // one job's creates at most, of four jobs'
    CHECK(all >= 16);          // the worker went on to split all four after the reading
    REQUIRE(e.check_invariants().empty());
  }
  require_nothing_held();
}

TEST_CASE("fault sweep: the worker thread on the libcuda double, each of its calls failing at every occurrence", "[background][cuda][faults]") {
  Watchdog dog("background fault sweep on the double", 1200);
  const char* calls[] = {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease", "cuEventRecord",
                         "cuEventQuery"};
  const std::vector<unsigned long> total = calls_made(calls, [] {
    std::string err;
    auto a = make(PolicyKind::fragless, &err, with_worker());
    REQUIRE(a);
    REQUIRE(workload(*a->device(0), &err));
    a->device(0)->drain_background();
  });
  require_nothing_held();
  std::size_t runs = 0;
  for (std::size_t c = 0; c < std::size(calls); ++c)
    for (unsigned long nth = 1; nth <= total[c]; ++nth)
      for (int error : {kOom, kIllegalAddress}) {
        INFO(calls[c] << " call " << nth << " fails with " << error);
        {
          std::string err;
          auto a = make(PolicyKind::fragless, &err, with_worker());
          REQUIRE(a);
          DeviceEngine& e = *a->device(0);
          fake().fail(calls[c], static_cast<int>(nth), error);
          std::string werr;
          workload(e, &werr);  // a failure on the path may fail an allocation: that is the path's business
          e.drain_background();
          fake().reset();
          INFO(e.check_invariants());
          REQUIRE(e.check_invariants().empty());
          e.empty_cache();
          REQUIRE(workload(e, &werr));  // the fault has cleared: everything works again
          e.drain_background();
          REQUIRE(e.check_invariants().empty());
        }
        require_nothing_held();
        ++runs;
      }
  CHECK(runs > 50);
}

#else
TEST_CASE("background: the worker on the libcuda double: not built (no CUDA headers)", "[background][cuda]") {
  WARN("SKIPPED: the cuda driver was not built because the CUDA headers were not found");
}
#endif
