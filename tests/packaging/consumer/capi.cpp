// fragless::capi from an installed package: libfragless.so's C ABI (run with FRAGLESS_CONF=driver:host).
#include <cstdio>

#include "fragless/fragless.h"

int main() {
  void* p = fragless_malloc(1 << 20, 0, nullptr);
  if (!p) return std::printf("FAIL: %s\n", fragless_last_error()), 1;
  fragless_free(p, 1 << 20, 0, nullptr);
  char buf[16];
  if (fragless_memory_stats(0, buf, sizeof buf) <= 0) return std::printf("FAIL: %s\n", fragless_last_error()), 1;
  std::printf("ok: fragless::capi (libfragless.so)\n");
  return 0;
}
