// dlsym(RTLD_NEXT) through LD_PRELOAD's dlsym: linked against two libraries that each define
// fragless_probe_which (1, then 2), the first library's RTLD_NEXT lookup must find the second's (it is relative
// to the library that calls dlsym, never to the interposer that passes the call on). Exits non-zero if not.
#include <dlfcn.h>

#include <cstdio>
#include <cstring>

extern "C" int fragless_probe_which();
extern "C" int fragless_probe_next();
extern "C" int fragless_probe_second();

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf("usage: [LD_PRELOAD=libfragless_preload.so] %s\n"
                "  checks that dlsym(RTLD_NEXT) stays relative to its caller; exits non-zero if not\n", argv[0]);
    return 0;
  }
  const int first = fragless_probe_which(), next = fragless_probe_next();
  if (fragless_probe_second() != 2) return 1;
  const bool interposed = dlsym(RTLD_DEFAULT, "fragless_preload_counters") != nullptr;
  std::printf("%s: the first library's definition is %d, its RTLD_NEXT lookup finds %d (%s)\n",
              first == 1 && next == 2 ? "ok" : "FAIL", first, next, interposed ? "under the interposer" : "plain");
  return first == 1 && next == 2 ? 0 : 1;
}
