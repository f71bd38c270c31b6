// fragless::core from an installed package: the engine on the host driver, as docs/USAGE.md, "Using the engine from C++", shows.
#include <cstdio>
#include <cstring>

#include "fragless/allocator.h"

int main() {
  auto parsed = fragless::parse_config("policy:fragless,driver:host,capacity_mb:64");
  if (!parsed.ok) return std::printf("FAIL: %s\n", parsed.error.c_str()), 1;
  std::string err;
  auto alloc = fragless::Allocator::create(parsed.options, 1, &err);
  if (!alloc) return std::printf("FAIL: %s\n", err.c_str()), 1;
  fragless::DeviceEngine* dev = alloc->device(0);
  fragless::AllocError e;
  void* p = dev->allocate(3 << 20, 0, &e);
  if (!p) return std::printf("FAIL: %s\n", e.message.c_str()), 1;
  std::memset(p, 0x5a, 3 << 20);  // the host driver's memory is real
  const auto stats = dev->stats().flatten();
  if (stats.at("allocated_bytes.all.current") < (3 << 20)) return std::printf("FAIL: stats\n"), 1;
  dev->free(p);
  dev->empty_cache();
  if (dev->stats().flatten().at("reserved_bytes.all.current") != 0) return std::printf("FAIL: empty_cache\n"), 1;
  std::printf("ok: fragless::core (engine, host driver)\n");
  return 0;
}
