// Two copies of this library (WHICH 1 and 2) stand for two interposers in a chain: each defines
// fragless_probe_which, and the first one looks the next definition up with dlsym(RTLD_NEXT), which is
// relative to its caller. Under LD_PRELOAD the interposer's dlsym must keep it so (preload_driver.cpp).
#include <dlfcn.h>

extern "C" __attribute__((visibility("default"))) int fragless_probe_which() { return WHICH; }

#if WHICH == 2
// Referenced by the program so that the linker keeps this second library (it would drop one it needs nothing from).
extern "C" __attribute__((visibility("default"))) int fragless_probe_second() { return 2; }
#endif

extern "C" __attribute__((visibility("default"))) int fragless_probe_next() {
  auto next = reinterpret_cast<int (*)()>(dlsym(RTLD_NEXT, "fragless_probe_which"));
  return next ? next() : -1;
}
