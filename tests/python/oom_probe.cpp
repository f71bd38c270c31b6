// A CPU allocator for PyTorch that allocates from libfragless.so (host driver), so a test on a CPU-only
// PyTorch sends an out-of-memory through the same path a CUDA one takes under CUDAPluggableAllocator: a
// tensor factory in PyTorch's bindings calls the allocator, fragless_malloc throws, PyTorch translates.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/api/include/torch/version.h>

#include <cstddef>

namespace {
using Malloc = void* (*)(size_t, int, void*);
using Free = void (*)(void*, size_t, int, void*);
Malloc g_malloc = nullptr;
Free g_free = nullptr;

void release(void* p) { g_free(p, 0, 0, nullptr); }

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define PROBE_CONST
#else
#define PROBE_CONST const
#endif

struct FraglessCpu final : c10::Allocator {
  c10::DataPtr allocate(size_t n) PROBE_CONST override {
    void* p = n ? g_malloc(n, 0, nullptr) : nullptr;
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#endif
};
FraglessCpu g_alloc;
}  // namespace

extern "C" __attribute__((visibility("default"))) void probe_install(void* malloc_fn, void* free_fn) {
  g_malloc = reinterpret_cast<Malloc>(malloc_fn);
  g_free = reinterpret_cast<Free>(free_fn);
  c10::SetCPUAllocator(&g_alloc, /*priority=*/100);
}
