#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>

#include "fragless/torch_cpu.h"

namespace fragless::torch {

namespace {

// Never destroyed: LibTorch may free tensors from its own static destructors after ours would have run.
std::unique_ptr<Allocator>& instance() {
  static auto* a = new std::unique_ptr<Allocator>();
  return *a;
}

void delete_block(void* p) {
  if (!p) return;
  auto& a = instance();
  AllocError err;
  if (!a || a->device(0)->free(p, &err) != Status::ok)
    std::fprintf(stderr, "fragless: CPU tensor free failed: %s\n", err.message.c_str());
}

class CpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) const override {
    AllocError err;
    void* p = instance()->device(0)->allocate(n, 0, &err);
    // LibTorch's error type for OOM carries our diagnosis to the caller as an exception.
    TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr || n == 0, err.message);
    return {p, p, &delete_block, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }
};

CpuAllocator g_cpu_allocator;

void flush_at_exit() {  // as capi.cpp's
  if (auto& a = instance()) a->at_exit();
}

}  // namespace

bool install_cpu_allocator(const std::string& conf, std::string* error) {
  auto parsed = parse_config(conf);
  if (!parsed.ok) {
    *error = parsed.error;
    return false;
  }
  parsed.options.driver = DriverKind::host;
  auto a = Allocator::create(parsed.options, 1, error);
  if (!a) return false;
  instance() = std::move(a);
  c10::SetAllocator(c10::DeviceType::CPU, &g_cpu_allocator, /*priority=*/100);
  static bool registered = (std::atexit(flush_at_exit), true);
  (void)registered;
  return true;
}

DeviceEngine* cpu_engine() { return instance() ? instance()->device(0) : nullptr; }

std::string flush_cpu_trace() {
  auto& a = instance();
  return a ? a->flush_traces() : std::string();
}

}  // namespace fragless::torch
