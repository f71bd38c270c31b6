// The libcuda double (libfragless_fakecuda.so) as the test programs without a test framework drive it
// (capi/capi_cuda_path.cpp, preload/preload_cuda_path.cpp, preload/preload_driver_api.cpp): checks that print
// "ok" or "FAIL" and are counted, entry points loaded by name (a missing one ends the program), the double's
// controls and census, and, under LD_PRELOAD, the interposer's own entry points. The Catch2 tests drive the
// double through client.h.
#pragma once
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fake_cuda.h"

namespace fakecuda_program {

// The failed checks so far: a program exits non-zero when there is any.
inline int failures = 0;

inline void expect(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

// `p` (an entry point found by name) into *out; a null one ends the program.
template <typename F>
void need(F* out, void* p, const char* name) {
  if (!p) {
    std::fprintf(stderr, "FAIL: %s not found\n", name);
    std::exit(1);
  }
  *out = reinterpret_cast<F>(p);
}

template <typename F>
F sym(void* lib, const char* name) {
  F f = nullptr;
  need(&f, dlsym(lib, name), name);
  return f;
}

// The double's controls and census, from its handle.
struct Double {
  void* lib = nullptr;
  decltype(&fakecuda_get_census) census_ = nullptr;
  decltype(&fakecuda_fail) fail = nullptr;
  decltype(&fakecuda_calls) calls = nullptr;
  decltype(&fakecuda_launch) launch = nullptr;
  decltype(&fakecuda_first_fault) first_fault = nullptr;
  decltype(&fakecuda_advance) advance = nullptr;
  decltype(&fakecuda_adopt_stream) adopt = nullptr;
  decltype(&fakecuda_foreign_alloc) foreign_alloc = nullptr;
  decltype(&fakecuda_free_bytes) free_bytes = nullptr;
  decltype(&fakecuda_set_delay) set_delay = nullptr;
  decltype(&fakecuda_reuse_stream_values_at_once) reuse_streams_at_once = nullptr;
  int (*primary_state)(int, unsigned*, int*) = nullptr;  // cuDevicePrimaryCtxGetState
  explicit Double(void* handle) : lib(handle) {
    need(&census_, dlsym(lib, "fakecuda_get_census"), "fakecuda_get_census");
    need(&fail, dlsym(lib, "fakecuda_fail"), "fakecuda_fail");
    need(&calls, dlsym(lib, "fakecuda_calls"), "fakecuda_calls");
    need(&launch, dlsym(lib, "fakecuda_launch"), "fakecuda_launch");
    need(&first_fault, dlsym(lib, "fakecuda_first_fault"), "fakecuda_first_fault");
    need(&advance, dlsym(lib, "fakecuda_advance"), "fakecuda_advance");
    need(&adopt, dlsym(lib, "fakecuda_adopt_stream"), "fakecuda_adopt_stream");
    need(&foreign_alloc, dlsym(lib, "fakecuda_foreign_alloc"), "fakecuda_foreign_alloc");
    need(&free_bytes, dlsym(lib, "fakecuda_free_bytes"), "fakecuda_free_bytes");
    need(&set_delay, dlsym(lib, "fakecuda_set_delay"), "fakecuda_set_delay");
    need(&reuse_streams_at_once, dlsym(lib, "fakecuda_reuse_stream_values_at_once"),
         "fakecuda_reuse_stream_values_at_once");
    need(&primary_state, dlsym(lib, "cuDevicePrimaryCtxGetState"), "cuDevicePrimaryCtxGetState");
  }
  fakecuda_census census() const {
    fakecuda_census c{};
    census_(&c);
    return c;
  }
  // Whether the device's primary context is active (created and retained).
  bool active(int device) const {
    unsigned flags = 0;
    int on = 0;
    return primary_state(device, &flags, &on) == 0 && on;
  }
};

// A program run under LD_PRELOAD=libfragless_preload.so with FRAGLESS_LIBCUDA naming the double: the double
// that names, and the interposer's entry points. Anything else ends the program at once.
struct Interposed : Double {
  int (*device_of)(void*) = nullptr;
  int (*preload_memory)(int, size_t*, size_t*) = nullptr;
  void (*counters)(unsigned long*) = nullptr;
  void (*driver_counters)(unsigned long*) = nullptr;  // only the driver half has them
  int (*drain)(int) = nullptr;                        // waits for the device's background worker
  Interposed() : Double(open()) {
    need(&device_of, dlsym(RTLD_DEFAULT, "fragless_preload_device_of"), "fragless_preload_device_of");
    preload_memory = reinterpret_cast<decltype(preload_memory)>(dlsym(RTLD_DEFAULT, "fragless_preload_memory"));
    expect(preload_memory != nullptr, "the interposer exports fragless_preload_memory");
    need(&counters, dlsym(RTLD_DEFAULT, "fragless_preload_counters"), "fragless_preload_counters");
    need(&drain, dlsym(RTLD_DEFAULT, "fragless_preload_drain"), "fragless_preload_drain");
    driver_counters =
        reinterpret_cast<decltype(driver_counters)>(dlsym(RTLD_DEFAULT, "fragless_preload_driver_counters"));
  }
  static void* open() {
    const char* path = std::getenv("FRAGLESS_LIBCUDA");
    void* lib = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
    if (!lib || !dlsym(RTLD_DEFAULT, "fragless_preload_counters")) {
      std::fprintf(stderr, "FAIL: run under LD_PRELOAD=libfragless_preload.so with FRAGLESS_LIBCUDA naming the double\n");
      std::exit(1);
    }
    return lib;
  }
  // Whether fragless on `device` owns the pointer.
  bool fragless(std::uintptr_t p, int device) const { return device_of(reinterpret_cast<void*>(p)) == device; }
  // The bytes the interposer has allocated on the device (SIZE_MAX when it cannot say).
  std::size_t allocated(int device) const {
    size_t a = 0, r = 0;
    if (!preload_memory || preload_memory(device, &a, &r) != 0) return SIZE_MAX;
    return a;
  }
  // The device fences the interposer has run.
  unsigned long fences() const {
    unsigned long c[5];
    counters(c);
    return c[3];
  }
  // The driver half's re-entries (~0 when the interposer has no driver counters).
  unsigned long recursions() const {
    unsigned long c[3] = {0, 0, 0};
    if (driver_counters) driver_counters(c);
    return driver_counters ? c[2] : ~0ul;
  }
};

}  // namespace fakecuda_program
