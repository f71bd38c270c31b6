// The CUDA path on the libcuda double, driven as PyTorch drives an allocator: memory moved between streams
// and addresses, graphs, failed waits, statistics, per-thread streams, stream handles reused, unmaps over
// several mappings. The double judges work by the physical memory it touches (tests/fake_cuda).
#include <catch2/catch.hpp>
#include <thread>

#if defined(FRAGLESS_HAVE_CUDA)
#include "client.h"
#include "fragless/config.h"
#include "fragless/cuda_driver.h"

using namespace fragless;
using namespace fragless::test;

namespace {
constexpr std::size_t MiB = 1u << 20;
constexpr PolicyKind kPolicies[] = {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless};

// A block of `size` bytes on `stream`; the test cannot go on without it.
// The double gives a destroyed stream's value to the next stream at once while one lives (RMM's issue 649).
struct ReuseStreamsAtOnce {
  ReuseStreamsAtOnce() { fake().reuse_streams_at_once(1); }
  ~ReuseStreamsAtOnce() { fake().reuse_streams_at_once(0); }
  ReuseStreamsAtOnce(const ReuseStreamsAtOnce&) = delete;
  ReuseStreamsAtOnce& operator=(const ReuseStreamsAtOnce&) = delete;
};

void* must_allocate(DeviceEngine& e, std::size_t size, Stream stream) {
  void* p = e.allocate(size, stream, nullptr);
  REQUIRE(p);
  return p;
}
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
        void* x = must_allocate(e, 16 * MiB, A);
        REQUIRE(fake().work(A, x, 16 * MiB, 1000) == CUDA_SUCCESS);
        REQUIRE(e.free(x) == Status::ok);
        // B misses. fragless may lend the hole's handles to B at a new address (the old mapping stays until
        // A's work is done); with no room to create, every policy must take that memory for B.
        if (tight) fake().capacity(0, e.usage().reserved + 8 * MiB);
        void* y = must_allocate(e, 16 * MiB, B);
        REQUIRE(fake().work(B, y, 16 * MiB, 10) == CUDA_SUCCESS);
        CHECK(fake().now().faults == 0);
        REQUIRE(e.free(y) == Status::ok);
        e.empty_cache();
        fake().capacity(0, 1024 * MiB);
      }
      require_nothing_held();
    }
}

namespace {
void* as_ptr(Stream s) { return reinterpret_cast<void*>(s); }
}  // namespace

TEST_CASE("cuda driver: a graph's memory is not unmapped under its replay on another stream", "[cuda][graphs]") {
  // PyTorch: blocks allocated to a private pool on the capture stream; g.replay() runs on the caller's
  // current stream, which the allocator never sees; the graph is reset (release_pool) and the cache emptied.
  const Stream capture = kFaultStreamA, replay = kFaultStreamB;
  const PoolId pool{7, 1};
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    {
      auto a = make_lazy(p);
      DeviceEngine& e = *a->device(0);
      e.begin_allocate_to_pool(pool, [capture](Stream s) { return s == capture; });
      void* x = must_allocate(e, 6 * MiB, capture);
      void* y = must_allocate(e, 4096, capture);
      e.end_allocate_to_pool(pool);
      REQUIRE(fake().work(replay, x, 6 * MiB, 1000) == CUDA_SUCCESS);  // the replay
      REQUIRE(fake().work(replay, y, 4096, 1000) == CUDA_SUCCESS);
      REQUIRE(e.free(x) == Status::ok);
      REQUIRE(e.free(y) == Status::ok);
      AllocError err;
      CHECK(e.release_pool(pool, &err) == Status::ok);
      CHECK(e.empty_cache(&err) == Status::ok);
      INFO(fake().first_fault());
      CHECK(fake().now().faults == 0);
      CHECK(e.usage().reserved == 0);  // it did go, after the device-wide wait
      CHECK(fake().clock() >= 1000);
    }
    require_nothing_held();
  }
}

// A split queued while its handle was free in the default pool must not follow the handle into a private pool:
// there a graph replays into it on the caller's stream, which the split's event (on the block's own stream)
// does not cover. The handle gets there as PyTorch's calls allow: a growth that was lent it failed (its
// set_access), which made it idle, and a capture's growth then took it.
TEST_CASE("cuda driver: a split queued in the default pool never touches a private pool's memory", "[cuda][graphs]") {
  const Stream S = kFaultStreamA, capture = kFaultStreamB, replay = kFaultStreamUse;
  const PoolId pool{3, 3};
  {
    auto parsed = parse_config("handles:ends,handle_max_mb:1024");
    REQUIRE(parsed.ok);
    Options o = parsed.options;
    o.background = BackgroundMode::manual;
    auto a = make_lazy(PolicyKind::fragless, o);
    DeviceEngine& e = *a->device(0);
    void* x = must_allocate(e, 21 * MiB, S);  // a 10-page handle and a last page
    void* z = must_allocate(e, 2 * MiB, S);   // keeps x's hole apart from the segment's end
    REQUIRE(e.free(x) == Status::ok);         // the 10-page handle is free whole: its split is queued
    fake().fail("cuMemSetAccess", 1, 1);
    AllocError err;
    void* f = e.allocate(40 * MiB, S, &err);  // is lent the handle, fails: the handle is idle
    REQUIRE(f == nullptr);
    fake().reset();
    e.begin_allocate_to_pool(pool, [capture](Stream s) { return s == capture; });
    void* g = must_allocate(e, 20 * MiB, capture);  // takes the idle handle into the private pool
    REQUIRE(e.free(g) == Status::ok);               // freed during the capture: the graph still uses it
    e.end_allocate_to_pool(pool);
    REQUIRE(fake().work(replay, g, 20 * MiB, 100000) == CUDA_SUCCESS);  // g.replay() on the caller's stream
    const auto unmaps = fake().calls("cuMemUnmap");
    e.run_background(1e18);
    INFO(fake().first_fault());
    CHECK(fake().calls("cuMemUnmap") == unmaps);
    CHECK(fake().now().faults == 0);
    fake().clear_faults();
    fake().advance(1000000);
    REQUIRE(e.release_pool(pool) == Status::ok);
    REQUIRE(e.free(z) == Status::ok);
  }
  require_nothing_held();
}

// A growth lent a hole's handles (on its own stream, no wait) fails when its set_access fails: the handles
// become idle, which any stream may take, so the hole's queued work must be done first. They had all been
// mapped when it failed, so the request held no taken handle any more, and nothing waited. When that wait
// fails too (Note [Failed waits]), the handles go back to the driver instead: they are never idle.
TEST_CASE("cuda driver: handles lent to a growth that fails are handed to no other stream before the lender's work",
          "[cuda][lend]") {
  const Stream A = kFaultStreamA, B = kFaultStreamB;
  for (bool wait_fails : {false, true}) {
    INFO("the lender's wait fails: " << wait_fails);
    auto a = make_lazy(PolicyKind::fragless);
    DeviceEngine& e = *a->device(0);
    void* x = must_allocate(e, 16 * MiB, A);
    void* z = must_allocate(e, 2 * MiB, A);  // keeps the hole apart from the segment's end
    REQUIRE(fake().work(A, x, 16 * MiB, 100000) == CUDA_SUCCESS);  // a long kernel over x
    REQUIRE(e.free(x) == Status::ok);
    const auto used = fake().now().used_bytes;
    const auto held = e.stats().reserved_bytes.all().current;
    fake().fail("cuMemSetAccess", 1, 1);
    if (wait_fails) fake().fail("cuEventSynchronize", 1, 1);
    AllocError err;
    void* y = e.allocate(20 * MiB, A, &err);  // lends x's handles (same stream: no wait); set_access fails
    REQUIRE(y == nullptr);
    fake().reset();
    // Released handles the lent range still maps keep their memory on the device, and in reserved, until the
    // range goes (R8).
    CHECK(static_cast<std::int64_t>(fake().now().used_bytes) - static_cast<std::int64_t>(used) ==
          e.stats().reserved_bytes.all().current - held);
    CHECK(e.check_invariants().empty());
    void* w = must_allocate(e, 16 * MiB, B);
    REQUIRE(fake().work(B, w, 16 * MiB, 10) == CUDA_SUCCESS);
    INFO(fake().first_fault());
    CHECK(fake().now().faults == 0);
    fake().clear_faults();
    fake().advance(1000000);
    REQUIRE(e.free(w) == Status::ok);
    REQUIRE(e.free(z) == Status::ok);
  }
  require_nothing_held();
}

// An engine destroyed while a freed block's events on another stream (record_stream) are pending, or while a
// live block has such a use, gives its memory back only after that stream's work; that stream may be another
// device's, which the engine's device-wide wait (its own context) does not cover.
TEST_CASE("cuda driver: an engine destroyed with other streams' work pending waits for it before unmapping",
          "[cuda][streams]") {
  for (PolicyKind p : kPolicies)
    for (bool other_device : {false, true})
      for (bool freed : {true, false}) {
        INFO(policy_name(p) << (freed ? ", block freed" : ", block live")
                            << (other_device ? ", used on device 0's stream" : ", used on its own device"));
        {
          auto a = make_lazy(p);
          REQUIRE(a->device(0));
          DeviceEngine& e = *a->device(1);
          const Stream A = Fake::stream_base(1) + kFaultStreamA;
          const Stream U = Fake::stream_base(other_device ? 0 : 1) + kFaultStreamUse;
          void* x = must_allocate(e, 6 * MiB, A);
          REQUIRE(fake().work(U, x, 6 * MiB, 100000) == CUDA_SUCCESS);  // another stream reads x
          REQUIRE(e.record_stream(x, U) == Status::ok);
          if (freed) REQUIRE(e.free(x) == Status::ok);  // its event on U is pending
        }
        INFO(fake().first_fault());
        CHECK(fake().now().faults == 0);
        fake().clear_faults();
        fake().advance(1000000);
        require_nothing_held();
      }
}

// record_stream onto a stream of another device (a peer copy, a pipeline stage): the free records its event
// in that stream's context (an event of the engine's own context cannot be recorded there, R12), as PyTorch
// records under the stream's device, instead of waiting on the host for the other device's work; the memory
// is reused only after that work.
TEST_CASE("cuda driver: record_stream onto another device's stream records an event there, no host wait",
          "[cuda][streams]") {
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    {
      auto a = make_lazy(p);
      REQUIRE(a->device(0));  // device 0 in use too: its primary context is active, as under PyTorch
      DeviceEngine* e1 = a->device(1);
      REQUIRE(e1);
      const Stream s1 = Fake::stream_base(1) + kFaultStreamA;
      const Stream u0 = Fake::stream_base(0) + kFaultStreamUse;  // a stream of device 0
      void* x = must_allocate(*e1, 8 * MiB, s1);
      REQUIRE(fake().work(u0, x, 8 * MiB, 100000) == CUDA_SUCCESS);  // device 0 reads x (peer access)
      REQUIRE(e1->record_stream(x, u0) == Status::ok);
      const auto syncs = fake().calls("cuStreamSynchronize") + fake().calls("cuEventSynchronize");
      REQUIRE(e1->free(x) == Status::ok);
      CHECK(fake().calls("cuStreamSynchronize") + fake().calls("cuEventSynchronize") == syncs);
      CHECK(e1->stats().num_forced_syncs == 0);
      void* y = must_allocate(*e1, 8 * MiB, s1);  // not x's memory while device 0's work runs
      REQUIRE(fake().work(s1, y, 8 * MiB, 10) == CUDA_SUCCESS);
      INFO(fake().first_fault());
      CHECK(fake().now().faults == 0);
      fake().clear_faults();
      fake().advance(1000000);
      REQUIRE(e1->free(y) == Status::ok);
    }
    require_nothing_held();
  }
}

// The event recorded in the other device's context is destroyed when its block goes back: on a thread with no
// current context (a thread that never touched CUDA, as a data-loader thread freeing a tensor) too. cuEventDestroy
// may fail with CUDA_ERROR_INVALID_CONTEXT (cuda.h), so the driver makes the event's own context current for
// it (R12), as the double requires; a failed destroy would leak the event.
TEST_CASE("cuda driver: an event recorded in another device's context is destroyed from a thread with no context",
          "[cuda][streams]") {
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    {
      auto a = make_lazy(p);
      REQUIRE(a->device(0));
      DeviceEngine* e1 = a->device(1);
      REQUIRE(e1);
      const Stream s1 = Fake::stream_base(1) + kFaultStreamA;
      const Stream u0 = Fake::stream_base(0) + kFaultStreamUse;
      void* x = must_allocate(*e1, 8 * MiB, s1);
      REQUIRE(fake().work(u0, x, 8 * MiB, 100000) == CUDA_SUCCESS);
      REQUIRE(e1->record_stream(x, u0) == Status::ok);
      REQUIRE(e1->free(x) == Status::ok);  // its event, in device 0's context, is pending
      const long events = fake().now().events;
      fake().advance(1000000);  // device 0's work is done
      Status freed = Status::driver_error;
      std::thread([&] {
        void* y = e1->allocate(8 * MiB, s1, nullptr);  // the engine finds x's event done and releases it
        freed = y ? e1->free(y) : Status::out_of_memory;
      }).join();
      CHECK(freed == Status::ok);
      CHECK(fake().now().events < events);  // destroyed there, not left for the driver's teardown
    }
    require_nothing_held();
  }
}

TEST_CASE("cuda driver: a release waits for no graph while a capture is under way, then frees the pool",
          "[cuda][graphs]") {
  const Stream capture = kFaultStreamA, replay = kFaultStreamB, other = kFaultStreamUse;
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    {
      auto a = make_lazy(p);
      DeviceEngine& e = *a->device(0);
      const PoolId g1{1, 1}, g2{2, 1};
      e.begin_allocate_to_pool(g1, [capture](Stream s) { return s == capture; });
      void* x = must_allocate(e, 6 * MiB, capture);
      e.end_allocate_to_pool(g1);
      REQUIRE(fake().work(replay, x, 6 * MiB, 1000) == CUDA_SUCCESS);
      REQUIRE(e.free(x) == Status::ok);
      e.begin_allocate_to_pool(g2, [other](Stream s) { return s == other; });  // a second graph is being captured
      const auto syncs = fake().calls("cuCtxSynchronize");
      REQUIRE(e.release_pool(g1) == Status::ok);
      CHECK(fake().calls("cuCtxSynchronize") == syncs);  // no device-wide wait during the capture
      CHECK(e.usage().reserved > 0);                     // the pool's memory stays for now
      e.end_allocate_to_pool(g2);                        // the capture is over: g1 goes now
      CHECK(fake().calls("cuCtxSynchronize") > syncs);
      CHECK(e.stats().reserved_bytes.all().current == 0);
      REQUIRE(e.release_pool(g2) == Status::ok);
      CHECK(fake().now().faults == 0);
    }
    require_nothing_held();
  }
}

TEST_CASE("cuda driver: memory under work that could not be waited for is never unmapped: it stays cached",
          "[cuda][failed-waits]") {
  const Stream A = kFaultStreamA, B = kFaultStreamB;
  for (PolicyKind p : kPolicies)
    for (const char* failing : {"cuStreamSynchronize", "cuEventSynchronize"}) {
      INFO(policy_name(p) << ", " << failing << " fails");
      {
        auto a = make_lazy(p);
        DeviceEngine& e = *a->device(0);
        void* x = must_allocate(e, 8 * MiB, A);
        void* y = must_allocate(e, 8 * MiB, A);
        REQUIRE(fake().work(A, x, 8 * MiB, 1000) == CUDA_SUCCESS);  // on its own stream
        REQUIRE(fake().stream_wait(as_ptr(B), as_ptr(A)) == CUDA_SUCCESS);
        REQUIRE(fake().work(B, y, 8 * MiB, 1000) == CUDA_SUCCESS);  // and on another (record_stream)
        REQUIRE(e.record_stream(y, B) == Status::ok);
        REQUIRE(e.free(x) == Status::ok);
        REQUIRE(e.free(y) == Status::ok);
        const auto reserved = e.usage().reserved;
        fake().fail(failing, 1, kIllegalAddress);
        AllocError err;
        const Status st = e.empty_cache(&err);
        fake().reset();
        INFO(fake().first_fault());
        CHECK(fake().now().faults == 0);
        CHECK(st == Status::driver_error);
        CHECK(err.message.find("failed") != std::string::npos);
        CHECK(err.message.find(failing) != std::string::npos);
        CHECK(e.stats().num_failed_waits >= 1);
        CHECK(e.usage().reserved > 0);  // still cached (and counted)
        CHECK(e.usage().reserved <= reserved);
        CHECK(e.check_invariants().empty());
        // Nothing is handed out from under the work either: new blocks do not meet it.
        void* z = must_allocate(e, 8 * MiB, B);
        REQUIRE(fake().work(B, z, 8 * MiB, 10) == CUDA_SUCCESS);
        CHECK(fake().now().faults == 0);
        REQUIRE(e.free(z) == Status::ok);
        // The next release tries again, and succeeds.
        CHECK(e.empty_cache(&err) == Status::ok);
        CHECK(e.usage().reserved == 0);
        CHECK(fake().now().faults == 0);
      }
      require_nothing_held();
    }
}

TEST_CASE("cuda driver: a driver that refuses one unmap over several mappings gets one per mapping, remembered",
          "[cuda][unmap]") {
  // Two runs of the fragless workload (whose unmaps span adjacent handles): a driver that takes them, then
  // one that refuses them. The second run must fall back, leak nothing, and ask only once.
  for (bool refuse : {false, true}) {
    INFO((refuse ? "multi-mapping unmaps refused" : "multi-mapping unmaps allowed"));
    fake().refuse_multi_unmap(refuse ? 1 : 0);
    const auto refused = fake().calls("cuMemUnmap:refused"), unmaps = fake().calls("cuMemUnmap");
    {
      auto a = make_lazy(PolicyKind::fragless);
      DeviceEngine& e = *a->device(0);
      std::string err;
      for (int i = 0; i < 3; ++i) {
        std::vector<void*> held;
        for (std::size_t size : {13 * MiB, 5 * MiB, 24 * MiB, 9 * MiB}) held.push_back(e.allocate(size, 0, nullptr));
        for (void* x : held) {
          REQUIRE(x);
          REQUIRE(e.free(x) == Status::ok);
        }
        REQUIRE(e.empty_cache() == Status::ok);
        CHECK(e.usage().reserved == 0);
      }
      CHECK(e.check_invariants().empty());
    }
    CHECK(fake().calls("cuMemUnmap:refused") - refused == (refuse ? 1u : 0u));
    CHECK(fake().calls("cuMemUnmap") > unmaps);
    require_nothing_held();
  }
  fake().refuse_multi_unmap(0);
}

TEST_CASE("cuda driver: a destroyed stream's handle value, reused, never makes fragless skip a wait",
          "[cuda][streams]") {
  // PyTorch's path has no hook for stream destruction: its pool streams live for the process, and an
  // external stream must outlive its blocks (docs/PYTORCH.md, "Known limits"). Here one does not: the double gives its
  // handle value to a later stream only once its work is done, as cuda.h says.
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    {
      auto a = make_lazy(p);
      DeviceEngine& e = *a->device(0);
      void* s = fake().stream_create(0);
      REQUIRE(s);
      const auto S = reinterpret_cast<Stream>(s);
      void* x = must_allocate(e, 8 * MiB, S);
      REQUIRE(fake().work(S, x, 8 * MiB, 1000) == CUDA_SUCCESS);
      REQUIRE(e.free(x) == Status::ok);
      REQUIRE(fake().stream_destroy(s) == CUDA_SUCCESS);  // its kernel still runs
      void* s2 = fake().stream_create(0);
      CHECK(s2 != s);  // not reused while the work runs
      // A release must not unmap under the destroyed stream's work: its synchronisation fails, so the memory
      // stays (Note [Failed waits]) and the failure is reported.
      AllocError err;
      CHECK(e.empty_cache(&err) == Status::driver_error);
      CHECK(err.message.find("cuStreamSynchronize") != std::string::npos);
      CHECK(e.usage().reserved > 0);
      CHECK(fake().now().faults == 0);
      fake().advance(1000);  // the work is done: the value may now be reused
      void* s3 = fake().stream_create(0);
      CHECK(s3 == s);
      void* y = must_allocate(e, 8 * MiB, reinterpret_cast<Stream>(s3));  // from the old stream's cache
      REQUIRE(fake().work(reinterpret_cast<Stream>(s3), y, 8 * MiB, 10) == CUDA_SUCCESS);
      CHECK(fake().now().faults == 0);
      REQUIRE(e.free(y) == Status::ok);
      CHECK(e.empty_cache() == Status::ok);
      fake().stream_destroy(s2);
      fake().stream_destroy(s3);
    }
    require_nothing_held();
  }
}

TEST_CASE("cuda driver: a retired stream is not waited for at its destroy and its value given again at once "
          "comes after its work (virtual clock)",
          "[cuda][streams]") {
  // Note [Destroyed streams]: what LD_PRELOAD's cudaStreamDestroy does (retire_stream, then the destroy),
  // with the double giving the value to the next stream at once, work or not (RMM's issue 649).
  auto waits = [] {
    return fake().calls("cuStreamSynchronize") + fake().calls("cuEventSynchronize") + fake().calls("cuCtxSynchronize");
  };
  ReuseStreamsAtOnce at_once;
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    for (bool by_record_stream : {false, true}) {
      INFO("the value named again by " << (by_record_stream ? "a record_stream" : "an allocation"));
      {
        Options o;
        o.background = BackgroundMode::off;  // no split takes x's range out of the pool before y is allocated
        auto a = make_lazy(p, o);
        DeviceEngine& e = *a->device(0);
        void* s = fake().stream_create(0);
        REQUIRE(s);
        const auto S = reinterpret_cast<Stream>(s);
        void* x = must_allocate(e, 8 * MiB, S);
        REQUIRE(fake().work(S, x, 8 * MiB, 1000) == CUDA_SUCCESS);
        REQUIRE(e.free(x) == Status::ok);
        const auto t0 = fake().clock();
        const auto w0 = waits();
        REQUIRE(e.retire_stream(S) == Status::ok);
        REQUIRE(e.retire_stream(S) == Status::ok);  // the runtime's destroy goes on to the driver's: nothing more
        REQUIRE(fake().stream_destroy(s) == CUDA_SUCCESS);
        CHECK(fake().clock() == t0);  // the host did not wait for the kernel
        CHECK(waits() == w0);
        void* s2 = fake().stream_create(0);
        REQUIRE(s2 == s);  // the same value, the old kernel still queued
        void* y = nullptr;
        if (by_record_stream) {
          // A block of the default stream used on the new stream, then freed: its reuse waits for the new
          // stream's work, which the new stream queued after the old kernel.
          void* z = must_allocate(e, 8 * MiB, 0);
          REQUIRE(e.record_stream(z, S) == Status::ok);
          REQUIRE(fake().work(S, z, 8 * MiB, 10) == CUDA_SUCCESS);
          REQUIRE(e.free(z) == Status::ok);
          y = must_allocate(e, 8 * MiB, S);  // the old stream's cached block
        } else {
          y = must_allocate(e, 8 * MiB, S);
        }
        CHECK(y == x);
        REQUIRE(fake().work(S, y, 8 * MiB, 10) == CUDA_SUCCESS);
        fake().advance(5000);
        CHECK(fake().now().faults == 0);  // the new stream's work came after the old one's
        CHECK(fake().first_fault() == std::string());
        REQUIRE(e.free(y) == Status::ok);
        CHECK(e.empty_cache() == Status::ok);
        CHECK(e.usage().reserved == 0);
        fake().stream_destroy(s2);
      }
      require_nothing_held();
    }
  }
}

TEST_CASE("cuda driver: a block live when its stream is destroyed and freed on a stream given the same value is "
          "waited for on the new stream (virtual clock)",
          "[cuda][streams]") {
  // RMM's issue 649 with the block still live: allocated on S, S destroyed (retired), a new stream given S's
  // value at once uses the block and frees it there (the interposer's cudaFreeAsync: a record_stream onto the
  // new stream, which is the block's own value, then the free). What goes back after must wait for the new
  // stream's work, not only for the old stream's event.
  ReuseStreamsAtOnce at_once;
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    {
      auto a = make_lazy(p);
      DeviceEngine& e = *a->device(0);
      void* s = fake().stream_create(0);
      REQUIRE(s);
      const auto S = reinterpret_cast<Stream>(s);
      void* x = must_allocate(e, 8 * MiB, S);
      REQUIRE(fake().work(S, x, 8 * MiB, 10) == CUDA_SUCCESS);
      REQUIRE(e.retire_stream(S) == Status::ok);
      REQUIRE(fake().stream_destroy(s) == CUDA_SUCCESS);
      void* s2 = fake().stream_create(0);
      REQUIRE(s2 == s);
      fake().advance(100);  // the old stream's kernel is done (the program orders its own uses of the block)
      REQUIRE(fake().work(S, x, 8 * MiB, 5000) == CUDA_SUCCESS);  // the new stream's long kernel on the block
      REQUIRE(e.record_stream(x, S) == Status::ok);
      REQUIRE(e.free(x) == Status::ok);
      CHECK(e.empty_cache() == Status::ok);  // unmaps only after the new stream's kernel
      CHECK(fake().now().faults == 0);
      CHECK(fake().first_fault() == std::string());
      CHECK(e.usage().reserved == 0);
      fake().stream_destroy(s2);
    }
    require_nothing_held();
  }
}

TEST_CASE("cuda driver: a retired stream's blocks go back after its work and no driver call names it (virtual "
          "clock)",
          "[cuda][streams]") {
  // Blocks freed on a stream the program then destroyed, one still used there by record_stream when it is
  // destroyed: the block's free neither waits nor hands it out while the work runs, empty_cache waits for
  // the retired stream's event, never for the stream (the double refuses a destroyed handle), and releases
  // everything once the work is done.
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    {
      Options o;
      o.background = BackgroundMode::off;  // no split carves u's range: v != u below is the free's doing
      auto a = make_lazy(p, o);
      DeviceEngine& e = *a->device(0);
      void* s = fake().stream_create(0);
      REQUIRE(s);
      const auto S = reinterpret_cast<Stream>(s);
      void* x = must_allocate(e, 8 * MiB, S);
      void* u = must_allocate(e, 4 * MiB, 0);
      REQUIRE(e.record_stream(u, S) == Status::ok);
      REQUIRE(fake().work(S, x, 8 * MiB, 1000) == CUDA_SUCCESS);
      REQUIRE(fake().work(S, u, 4 * MiB, 1000) == CUDA_SUCCESS);
      REQUIRE(e.free(x) == Status::ok);
      const auto t0 = fake().clock();
      REQUIRE(e.retire_stream(S) == Status::ok);
      REQUIRE(fake().stream_destroy(s) == CUDA_SUCCESS);
      CHECK(fake().clock() == t0);  // the destroy did not wait
      const auto records = fake().calls("cuEventRecord");
      REQUIRE(e.free(u) == Status::ok);  // its use on the destroyed stream: the retired event stands in
      CHECK(fake().calls("cuEventRecord") == records);  // nothing recorded on the destroyed handle
      CHECK(fake().clock() == t0);                       // nor waited for on the host: u waits, listed
      void* v = must_allocate(e, 4 * MiB, 0);
      CHECK(v != u);  // not handed out while the destroyed stream's kernel may still use it
      REQUIRE(e.free(v) == Status::ok);
      AllocError err;
      CHECK(e.empty_cache(&err) == Status::ok);
      INFO(err.message);
      CHECK(e.usage().reserved == 0);
      CHECK(fake().now().faults == 0);
      CHECK(fake().clock() >= 1000);  // what went back waited for the kernels
    }
    require_nothing_held();
  }
}

namespace {
// Each policy's engine without the background worker (no split moves a block's range between the test's
// steps), then a check that nothing is held.
template <typename F>
void each_policy_without_worker(F f) {
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    {
      Options o;
      o.background = BackgroundMode::off;
      auto a = make_lazy(p, o);
      f(*a->device(0));
    }
    require_nothing_held();
  }
}

// A block of a graph's private pool: allocated on the capture stream while allocations there go to the pool.
void* graph_block(DeviceEngine& e, PoolId pool, Stream capture, std::size_t bytes) {
  e.begin_allocate_to_pool(pool, [capture](Stream s) { return s == capture; });
  void* g = must_allocate(e, bytes, capture);
  e.end_allocate_to_pool(pool);
  return g;
}

// A new stream uses the blocks (record_stream) and queues a kernel of 1000 ticks on the first (`bytes` of
// it); the stream is then retired and destroyed with the kernel still queued, as LD_PRELOAD's
// cudaStreamDestroy does.
void destroy_while_using(DeviceEngine& e, const std::vector<void*>& blocks, std::size_t bytes) {
  void* s = fake().stream_create(0);
  REQUIRE(s);
  const auto S = reinterpret_cast<Stream>(s);
  for (void* u : blocks) REQUIRE(e.record_stream(u, S) == Status::ok);
  REQUIRE(fake().work(S, blocks.front(), bytes, 1000) == CUDA_SUCCESS);
  REQUIRE(e.retire_stream(S) == Status::ok);
  REQUIRE(fake().stream_destroy(s) == CUDA_SUCCESS);
}
}  // namespace

TEST_CASE("cuda driver: a block a destroyed stream still uses goes back at a later allocation once that work is "
          "done with no host wait (virtual clock)",
          "[cuda][streams]") {
  // Note [Destroyed streams]: a block of the default stream used on S (record_stream), S destroyed with its
  // kernel still running, then the block freed. The free neither records on the destroyed handle nor waits;
  // the block waits, listed, and an allocation after the kernel ends finds its retired event done and hands
  // the block out again, with no synchronisation on the way.
  each_policy_without_worker([&](DeviceEngine& e) {
    void* u = must_allocate(e, 4 * MiB, 0);
    destroy_while_using(e, {u}, 4 * MiB);
    const auto t0 = fake().clock();
    const auto syncs = e.stats().num_forced_syncs;
    REQUIRE(e.free(u) == Status::ok);
    CHECK(fake().clock() == t0);
    void* w = must_allocate(e, 4 * MiB, 0);
    CHECK(w != u);  // not while the kernel may still use it
    REQUIRE(e.free(w) == Status::ok);
    fake().advance(2000);  // the kernel is done
    void* y = must_allocate(e, 4 * MiB, 0);
    CHECK(y == u);
    CHECK(fake().clock() == t0 + 2000);  // no host wait on the way
    CHECK(e.stats().num_forced_syncs == syncs);
    REQUIRE(e.free(y) == Status::ok);
    CHECK(e.empty_cache() == Status::ok);
    CHECK(e.usage().reserved == 0);
    CHECK(fake().now().faults == 0);
    CHECK(fake().first_fault() == std::string());
  });
}

TEST_CASE("cuda driver: allocations while a block waits for a destroyed stream do not synchronise the device "
          "for a released graph pool still in use (virtual clock)",
          "[cuda][streams][graphs]") {
  // A graph's pool released while a tensor from it is still live stays until that tensor goes (a device-wide
  // wait before its memory does). Meanwhile a block a destroyed stream still uses waits, listed, and each
  // allocation tries it again: that retry frees no private pool, so no allocation synchronises the device.
  const Stream capture = kFaultStreamB;
  const PoolId pool{9, 1};
  each_policy_without_worker([&](DeviceEngine& e) {
    void* g = graph_block(e, pool, capture, 6 * MiB);
    REQUIRE(e.release_pool(pool) == Status::ok);  // g is still live: the pool stays
    void* u = must_allocate(e, 4 * MiB, 0);
    destroy_while_using(e, {u}, 4 * MiB);
    REQUIRE(e.free(u) == Status::ok);  // waits, listed, for the destroyed stream's kernel
    const auto device_syncs = fake().calls("cuCtxSynchronize");
    const auto t0 = fake().clock();
    std::vector<void*> xs;
    for (int i = 0; i < 8; ++i) xs.push_back(must_allocate(e, MiB, 0));
    CHECK(fake().calls("cuCtxSynchronize") == device_syncs);
    CHECK(fake().clock() == t0);
    for (void* x : xs) REQUIRE(e.free(x) == Status::ok);
    REQUIRE(e.free(g) == Status::ok);
    CHECK(e.empty_cache() == Status::ok);
    CHECK(e.usage().reserved == 0);
    CHECK(fake().now().faults == 0);
    CHECK(fake().first_fault() == std::string());
  });
}

TEST_CASE("cuda driver: blocks waiting for one destroyed stream cost one event query per allocation (virtual "
          "clock)",
          "[cuda][streams]") {
  // 32 blocks used on S (record_stream), S destroyed with its kernel queued, the blocks freed: each is listed,
  // and each later allocation tries them again. The retry queries S's event once, not once per block.
  each_policy_without_worker([&](DeviceEngine& e) {
    std::vector<void*> us;
    for (int i = 0; i < 32; ++i) us.push_back(must_allocate(e, MiB, 0));
    destroy_while_using(e, us, MiB);
    for (void* u : us) REQUIRE(e.free(u) == Status::ok);
    const auto queries = fake().calls("cuEventQuery");
    void* x = must_allocate(e, MiB, 0);
    CHECK(fake().calls("cuEventQuery") - queries <= 2);
    REQUIRE(e.free(x) == Status::ok);
    CHECK(e.stats().active.all().current == 32);  // the listed blocks
    fake().advance(2000);
    void* y = must_allocate(e, MiB, 0);
    CHECK(e.stats().active.all().current == 1);  // the listed blocks went back at this allocation
    REQUIRE(e.free(y) == Status::ok);
    CHECK(e.empty_cache() == Status::ok);
    CHECK(e.usage().reserved == 0);
    CHECK(fake().now().faults == 0);
  });
}

TEST_CASE("cuda driver: a release whose wait for a destroyed stream fails tries it once for all the blocks "
          "waiting for it (virtual clock)",
          "[cuda][streams]") {
  // 8 blocks listed for S's work (S destroyed with its kernel queued), then empty_cache with S's event
  // synchronisation failing once: one failed wait, reported, and every block still listed (a failed wait
  // proves nothing, Note [Failed waits]); the next release waits and gives everything back.
  each_policy_without_worker([&](DeviceEngine& e) {
    std::vector<void*> us;
    for (int i = 0; i < 8; ++i) us.push_back(must_allocate(e, MiB, 0));
    destroy_while_using(e, us, MiB);
    for (void* u : us) REQUIRE(e.free(u) == Status::ok);
    const auto failed = e.stats().num_failed_waits;
    fake().fail("cuEventSynchronize", 1, 999);  // CUDA_ERROR_UNKNOWN
    AllocError err;
    CHECK(e.empty_cache(&err) == Status::driver_error);
    CHECK(e.stats().num_failed_waits == failed + 1);
    CHECK(e.stats().active.all().current == 8);
    CHECK(fake().now().faults == 0);
    fake().reset();
    CHECK(e.empty_cache() == Status::ok);
    CHECK(e.stats().active.all().current == 0);
    CHECK(e.usage().reserved == 0);
    CHECK(fake().now().faults == 0);
  });
}

TEST_CASE("cuda driver: a graph pool's block waiting for a destroyed stream goes with the pool when the pool is "
          "released (virtual clock)",
          "[cuda][streams][graphs]") {
  // A block of a graph's private pool, used on S (record_stream), S destroyed with its kernel queued, the block
  // freed (listed, waiting for S's event), then the pool released: the device-wide wait before graph memory
  // goes covers S's work, so the block goes back and the pool with it, without an empty_cache.
  const Stream capture = kFaultStreamB;
  const PoolId pool{9, 2};
  each_policy_without_worker([&](DeviceEngine& e) {
    void* g = graph_block(e, pool, capture, 6 * MiB);
    destroy_while_using(e, {g}, 6 * MiB);
    REQUIRE(e.free(g) == Status::ok);
    CHECK(e.usage().reserved > 0);
    AllocError err;
    CHECK(e.release_pool(pool, &err) == Status::ok);
    INFO(err.message);
    CHECK(e.usage().reserved == 0);
    CHECK(fake().clock() >= 1000);
    CHECK(fake().now().faults == 0);
    CHECK(fake().first_fault() == std::string());
  });
}

TEST_CASE("cuda driver: a value named again while its ordering fails then destroyed again is waited for and "
          "never named after (virtual clock)",
          "[cuda][streams]") {
  // Note [Destroyed streams], the named state: S destroyed with its kernel running, a new stream given S's
  // value at once, a record_stream onto it whose stream wait and synchronisation both fail (injected), then the
  // new stream destroyed too. Nothing may name the destroyed handle afterwards (the double refuses it: a wait
  // would fail and the memory stay), and nothing may be unmapped under either stream's work.
  ReuseStreamsAtOnce at_once;
  for (PolicyKind p : kPolicies) {
    INFO(policy_name(p));
    {
      auto a = make_lazy(p);
      DeviceEngine& e = *a->device(0);
      void* s = fake().stream_create(0);
      REQUIRE(s);
      const auto S = reinterpret_cast<Stream>(s);
      void* x = must_allocate(e, 8 * MiB, S);
      REQUIRE(fake().work(S, x, 8 * MiB, 1000) == CUDA_SUCCESS);
      REQUIRE(e.free(x) == Status::ok);
      REQUIRE(e.retire_stream(S) == Status::ok);
      REQUIRE(fake().stream_destroy(s) == CUDA_SUCCESS);
      void* s2 = fake().stream_create(0);
      REQUIRE(s2 == s);
      void* z = must_allocate(e, 4 * MiB, 0);
      const auto failed = e.stats().num_failed_waits;
      fake().fail("cuStreamWaitEvent", 1, 999);  // CUDA_ERROR_UNKNOWN
      fake().fail("cuEventSynchronize", 1, 999);
      REQUIRE(e.record_stream(z, S) == Status::ok);
      fake().reset();
      CHECK(e.stats().num_failed_waits > failed);  // the ordering failed: the value stays retired, named
      REQUIRE(fake().work(S, z, 4 * MiB, 10) == CUDA_SUCCESS);  // the new stream's work on z
      AllocError ignored;  // (it reports the earlier failed wait)
      e.retire_stream(S, &ignored);
      REQUIRE(fake().stream_destroy(s2) == CUDA_SUCCESS);
      REQUIRE(e.free(z) == Status::ok);
      AllocError err;
      CHECK(e.empty_cache(&err) == Status::ok);
      INFO(err.message);
      CHECK(e.usage().reserved == 0);
      CHECK(fake().now().faults == 0);
    }
    require_nothing_held();
  }
}

TEST_CASE("cuda driver: the events of retired streams nobody asks about are released once done", "[cuda][streams]") {
  // A program that makes and destroys streams without end (a stream per request) holds an event only for those
  // whose work still runs (Note [Destroyed streams]: a sweep every 64 retirements).
  {
    auto a = make_lazy(PolicyKind::fragless);
    DeviceEngine& e = *a->device(0);
    void* x = must_allocate(e, MiB, 0);  // the engine and its context exist
    const long events = fake().now().events;
    for (int i = 0; i < 200; ++i) {
      void* s = fake().stream_create(0);
      REQUIRE(s);
      REQUIRE(e.retire_stream(reinterpret_cast<Stream>(s)) == Status::ok);
      REQUIRE(fake().stream_destroy(s) == CUDA_SUCCESS);
    }
    CHECK(fake().now().events - events <= 64);
    REQUIRE(e.free(x) == Status::ok);
  }
  require_nothing_held();
}

TEST_CASE("cuda driver: a hole of a destroyed stream is lent in device order without a host wait (virtual clock)",
          "[cuda][lend][streams]") {
  // Note [Destroyed streams]: the device is full and the only free memory is a hole freed on a stream the
  // program has since destroyed, its kernel still running. The growth on B lends it as it would a live
  // stream's: B waits for the destroyed stream's event on the device, and the host does not wait.
  constexpr unsigned long long kLong = 100000;
  const Stream B = kFaultStreamB;
  {
    // Without the worker: a split of x's handles taken between x's free and the stream's retirement (an
    // event on the live stream, waited for up to 50 ms of real time) would hold the hole while B grows, and
    // B would then reach the OOM retry's waits (about one run in 200 on a loaded machine).
    Options o;
    o.background = BackgroundMode::off;
    auto a = make_lazy(PolicyKind::fragless, o);
    DeviceEngine& e = *a->device(0);
    void* s = fake().stream_create(0);
    REQUIRE(s);
    const auto A = reinterpret_cast<Stream>(s);
    void* x = must_allocate(e, 16 * MiB, A);
    REQUIRE(fake().work(A, x, 16 * MiB, kLong) == CUDA_SUCCESS);
    REQUIRE(e.free(x) == Status::ok);
    REQUIRE(e.retire_stream(A) == Status::ok);
    REQUIRE(fake().stream_destroy(s) == CUDA_SUCCESS);
    fake().capacity(0, e.usage().reserved + 8 * MiB);
    const auto syncs = e.stats().num_forced_syncs;
    const auto start = fake().clock();
    void* y = must_allocate(e, 16 * MiB, B);
    CHECK(fake().clock() == start);  // the host did not wait for the destroyed stream's kernel
    CHECK(e.stats().num_forced_syncs == syncs);
    REQUIRE(fake().work(B, y, 16 * MiB, 10) == CUDA_SUCCESS);
    CHECK(fake().done_at(as_ptr(B)) >= start + kLong);  // B's kernel came after it on the device
    CHECK(fake().now().faults == 0);
    REQUIRE(e.free(y) == Status::ok);
    fake().advance(2 * kLong);
    CHECK(e.empty_cache() == Status::ok);
    fake().capacity(0, 1024 * MiB);
  }
  require_nothing_held();
}

TEST_CASE("cuda driver: lending across streams waits for what it must, not for newer work (virtual clock)",
          "[cuda][lend]") {
  // A block freed on A, then a long kernel queued on A that has nothing to do with it (a pending NCCL
  // receive, say); B misses. How long B's next kernel is delayed is its added wait.
  const Stream A = kFaultStreamA, B = kFaultStreamB;
  constexpr unsigned long long kLong = 100000, kShort = 10;
  for (PolicyKind p : kPolicies)
    for (bool tight : {false, true}) {
      if (tight && p == PolicyKind::expandable) continue;  // its 20 MiB page under both blocks stays: an OOM
      INFO(policy_name(p) << (tight ? ", device full" : ", room to create"));
      {
        auto a = make_lazy(p);
        DeviceEngine& e = *a->device(0);
        void* x = must_allocate(e, 16 * MiB, A);
        void* other = must_allocate(e, 4 * MiB, A);
        REQUIRE(fake().work(A, x, 16 * MiB, 100) == CUDA_SUCCESS);
        REQUIRE(e.free(x) == Status::ok);
        REQUIRE(fake().work(A, other, 4 * MiB, kLong) == CUDA_SUCCESS);  // newer work, another block
        if (tight) fake().capacity(0, e.usage().reserved + 8 * MiB);
        const auto start = fake().clock();
        void* y = must_allocate(e, 16 * MiB, B);
        const auto host_wait = fake().clock() - start;
        REQUIRE(fake().work(B, y, 16 * MiB, kShort) == CUDA_SUCCESS);
        const auto device_wait = fake().done_at(as_ptr(B)) - fake().clock() - kShort;
        const auto syncs = e.stats().num_forced_syncs;
        WARN(policy_name(p) << (tight ? ", device full" : ", room to create") << ": B's kernel waited "
                            << device_wait << " ticks on the device, the host " << host_wait << " (long kernel "
                            << kLong << ")");
        CHECK(fake().now().faults == 0);
        if (!tight) {
          CHECK(device_wait == 0);  // with room, nobody waits for A's newer work
          CHECK(host_wait == 0);
          CHECK(syncs == 0);
        } else if (p == PolicyKind::fragless) {
          CHECK(host_wait == 0);  // the last resort lends in device order: the host never waits
          CHECK(device_wait > 0);
        }
        REQUIRE(e.free(y) == Status::ok);
        REQUIRE(e.free(other) == Status::ok);
        fake().advance(2 * kLong);
        e.empty_cache();
        fake().capacity(0, 1024 * MiB);
      }
      require_nothing_held();
    }
}

#endif  // without the CUDA headers test_cuda_driver.cpp says SKIPPED
