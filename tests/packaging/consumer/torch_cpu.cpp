// fragless::torch from an installed package: fragless as LibTorch's CPU allocator.
#include <c10/core/CPUAllocator.h>

#include <cstdio>

#include "fragless/torch_cpu.h"

int main() {
  std::string err;
  if (!fragless::torch::install_cpu_allocator("policy:fragless,capacity_mb:64", &err))
    return std::printf("FAIL: %s\n", err.c_str()), 1;
  {
    c10::DataPtr d = c10::GetCPUAllocator()->allocate(2 << 20);
    if (fragless::torch::cpu_engine()->stats().flatten().at("allocated_bytes.all.current") < (2 << 20))
      return std::printf("FAIL: LibTorch's CPU allocation did not come from fragless\n"), 1;
  }
  std::printf("ok: fragless::torch (LibTorch's CPU allocator)\n");
  return 0;
}
