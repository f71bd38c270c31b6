// The libcuda double (libfragless_fakecuda.so) as the cuda-driver tests drive it: its controls loaded by name,
// the census check every test ends with, allocators on the cuda driver, the fault sweeps' workload and call
// counts, and the double's context calls. The test programs without Catch2 use program.h.
#pragma once
#include <catch2/catch.hpp>
#include <dlfcn.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cuda.h>

#include "fake_cuda.h"
#include "../support/fault_workload.h"
#include "fragless/allocator.h"

namespace fragless::test {

inline constexpr int kOom = 2, kIllegalAddress = 700;  // CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_ILLEGAL_ADDRESS

template <typename F>
void load_symbol(void* lib, F* fn, const char* name) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  INFO(name);
  REQUIRE(*fn);
}

// The double, loaded once per process (the cuda driver dlopens the same file: one instance).
struct Fake {
  void* lib = nullptr;
  decltype(&fakecuda_fail) fail = nullptr;
  decltype(&fakecuda_reset_failures) reset = nullptr;
  decltype(&fakecuda_calls) calls = nullptr;
  decltype(&fakecuda_get_census) census = nullptr;
  decltype(&fakecuda_hold_stream) hold = nullptr;
  decltype(&fakecuda_set_capacity) capacity = nullptr;
  decltype(&fakecuda_adopt_stream) adopt = nullptr;
  decltype(&fakecuda_launch) launch = nullptr;
  decltype(&fakecuda_advance) advance = nullptr;
  decltype(&fakecuda_set_delay) delay = nullptr;
  decltype(&fakecuda_first_fault) first_fault = nullptr;
  decltype(&fakecuda_clear_faults) clear_faults = nullptr;
  decltype(&fakecuda_stream_create) stream_create = nullptr;
  decltype(&fakecuda_stream_wait) stream_wait = nullptr;
  decltype(&fakecuda_now) clock = nullptr;
  decltype(&fakecuda_stream_done_at) done_at = nullptr;
  decltype(&fakecuda_injected_failures) injected = nullptr;
  decltype(&fakecuda_stream_destroy) stream_destroy = nullptr;
  decltype(&fakecuda_refuse_multi_mapping_unmap) refuse_multi_unmap = nullptr;
  decltype(&fakecuda_reuse_stream_values_at_once) reuse_streams_at_once = nullptr;
  Fake() {
    // Every test in this process uses the double (the cuda driver reads this once).
    setenv("FRAGLESS_LIBCUDA", FRAGLESS_FAKECUDA_PATH, 1);
    lib = dlopen(FRAGLESS_FAKECUDA_PATH, RTLD_NOW | RTLD_LOCAL);
    REQUIRE(lib);
    // Each control by name; a missing one fails here.
    auto load = [&](auto* fn, const char* name) { load_symbol(lib, fn, name); };
    load(&fail, "fakecuda_fail");
    load(&reset, "fakecuda_reset_failures");
    load(&calls, "fakecuda_calls");
    load(&census, "fakecuda_get_census");
    load(&hold, "fakecuda_hold_stream");
    load(&capacity, "fakecuda_set_capacity");
    load(&adopt, "fakecuda_adopt_stream");
    load(&launch, "fakecuda_launch");
    load(&advance, "fakecuda_advance");
    load(&delay, "fakecuda_set_delay");
    load(&first_fault, "fakecuda_first_fault");
    load(&clear_faults, "fakecuda_clear_faults");
    load(&stream_create, "fakecuda_stream_create");
    load(&stream_wait, "fakecuda_stream_wait");
    load(&clock, "fakecuda_now");
    load(&done_at, "fakecuda_stream_done_at");
    load(&injected, "fakecuda_injected_failures");
    load(&stream_destroy, "fakecuda_stream_destroy");
    load(&refuse_multi_unmap, "fakecuda_refuse_multi_mapping_unmap");
    load(&reuse_streams_at_once, "fakecuda_reuse_stream_values_at_once");
    // The fixed stream numbers of these tests, as streams of their device (the double refuses others).
    for (int d = 0; d < 2; ++d)
      for (Stream s : {kFaultStreamA, kFaultStreamB, kFaultStreamUse})
        REQUIRE(adopt(reinterpret_cast<void*>(s + stream_base(d)), d));
  }
  static Stream stream_base(int device) { return static_cast<Stream>(device) * 0x100; }
  fakecuda_census now() const {
    fakecuda_census c{};
    census(&c);
    return c;
  }
  // Work over a block, as a kernel on `stream` would do.
  int work(Stream stream, const void* p, std::size_t bytes, unsigned long long ticks) const {
    return launch(reinterpret_cast<void*>(stream), p, bytes, ticks);
  }
};

inline Fake& fake() {
  static Fake f;
  return f;
}

// Set before any test runs: the cuda driver may be created before the double is first asked for. A child
// process that needs another libcuda names it in FRAGLESS_TEST_LIBCUDA (test_bad_input.cpp). The double is
// loaded then too, before any engine exists: its fork handler (which holds its lock) must be registered
// before fragless's, so that fragless's prepare handler, which waits for calls in flight, runs first.
inline const bool g_use_double = (setenv("FRAGLESS_LIBCUDA",
                                         std::getenv("FRAGLESS_TEST_LIBCUDA") ? std::getenv("FRAGLESS_TEST_LIBCUDA")
                                                                              : FRAGLESS_FAKECUDA_PATH, 1),
                                  dlopen(FRAGLESS_FAKECUDA_PATH, RTLD_NOW | RTLD_LOCAL), true);

inline std::unique_ptr<Allocator> make(PolicyKind p, std::string* err, Options o = {}) {
  fake().clear_faults();  // a test that failed before leaves none behind
  o.policy = p;
  o.driver = DriverKind::cuda;
  return Allocator::create(o, -1, err);
}

// An allocator whose engines (and contexts) are created on each device's first use.
inline std::unique_ptr<Allocator> make_lazy(PolicyKind p, Options o = {}) {
  fake().clear_faults();
  o.policy = p;
  o.driver = DriverKind::cuda;
  std::string err;
  auto a = Allocator::create(o, -1, &err, /*eager=*/false);
  INFO(err);
  REQUIRE(a);
  return a;
}

// The census every cuda-driver test ends with: no fault, no invalidated capture, no context retained and
// nothing of the driver's left.
inline void require_nothing_held() {
  const auto c = fake().now();
  INFO("handles " << c.handles << " mappings " << c.mappings << " reservations " << c.reservations << " events "
                  << c.events << " bytes " << c.used_bytes << " faults " << c.faults << " (" << fake().first_fault()
                  << ") invalidated captures " << c.invalidated_captures << " context retains " << c.context_retains);
  REQUIRE(c.faults == 0);
  REQUIRE(c.invalidated_captures == 0);
  REQUIRE(c.context_retains == 0);
  REQUIRE(c.handles == 0);
  REQUIRE(c.mappings == 0);
  REQUIRE(c.reservations == 0);
  REQUIRE(c.events == 0);
  REQUIRE(c.used_bytes == 0);
}

// The fault sweeps' workload (fault_workload.h) on one device of the double: the streams are that device's,
// and the one the workload holds is held in the double (test_cuda_driver.cpp, test_background_cuda.cpp).
inline bool workload(DeviceEngine& e, std::string* error) {
  const Stream base = Fake::stream_base(e.device());
  return fault_workload(e, error, [base](bool on) {
    fake().hold(reinterpret_cast<void*>(base + kFaultStreamUse), on ? 1 : 0);
  }, base);
}

// How many times `run` calls each of `calls` in the double: the occurrences a fault sweep fails one by one.
template <std::size_t N>
std::vector<unsigned long> calls_made(const char* const (&calls)[N], const std::function<void()>& run) {
  std::vector<unsigned long> before;
  for (auto c : calls) before.push_back(fake().calls(c));
  run();
  std::vector<unsigned long> total;
  for (std::size_t i = 0; i < N; ++i) total.push_back(fake().calls(calls[i]) - before[i]);
  return total;
}

// The double's context calls, for tests that act as a CUDA program would.
struct Ctx {
  CUresult (*retain)(CUcontext*, CUdevice);
  CUresult (*release)(CUdevice);
  CUresult (*push)(CUcontext);
  CUresult (*pop)(CUcontext*);
  CUresult (*get)(CUcontext*);
  CUresult (*begin_capture)(CUstream, CUstreamCaptureMode);
  CUresult (*end_capture)(CUstream, CUgraph*);
  Ctx() {
    auto load = [](auto* fn, const char* name) { load_symbol(fake().lib, fn, name); };
    load(&retain, "cuDevicePrimaryCtxRetain");
    load(&release, "cuDevicePrimaryCtxRelease_v2");
    load(&push, "cuCtxPushCurrent_v2");
    load(&pop, "cuCtxPopCurrent_v2");
    load(&get, "cuCtxGetCurrent");
    load(&begin_capture, "cuStreamBeginCapture_v2");
    load(&end_capture, "cuStreamEndCapture");
  }
  CUcontext current() const {
    CUcontext c = nullptr;
    get(&c);
    return c;
  }
};

}  // namespace fragless::test
