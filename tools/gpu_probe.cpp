// fragless-gpu-probe: asks the real CUDA driver what fragless's design assumes, and what its calls cost.
//
//   fragless-gpu-probe [--out FILE.json] [--kernel FILE.cubin] [--device N] [--quick]
//
// Needs no PyTorch and no CUDA runtime: libcuda.so.1 (or FRAGLESS_LIBCUDA, e.g. the libcuda double) is
// opened with dlopen. Writes one JSON object (schema "fragless-gpu-probe/1", read by
// `fragless-replay --costs`) and prints a table. Exits 77 within seconds when there is no driver library
// (and no /dev/nvidiactl), when cuInit answers CUDA_ERROR_NO_DEVICE or the driver counts no device; 1, naming
// the CUresult, when cuInit fails otherwise (a driver whose kernel module and library differ, 803; a
// forward-compatibility package the GPU does not take, 804; 999) or a probe step fails; 0 otherwise. What it
// asks:
//  - the device: name, total memory, VMM attributes, granularity (minimum and recommended);
//  - median and p99 cost of cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap,
//    cuMemRelease and cuMemAddressFree at handle sizes of 2, 20, 64, 512 MiB and 2 GiB (those that fit), and
//    of one cuMemSetAccess over 1, 8 and 64 adjacent 2 MiB mappings;
//  - whether cuMemMap takes a non-zero offset into a handle, or part of a handle, and whether one cuMemUnmap
//    may cover several adjacent mappings (driver.h R5, R7);
//  - whether one handle mapped at two addresses shows the same bytes (R9), through cuMemcpy;
//  - with a kernel (tools/gpu_kernels.ptx, built in; --kernel: the bundle's cubin of it, tried first): whether
//    cuMemUnmap, cuMemRelease or cuMemSetAccess of an unrelated range waits for a kernel running on another
//    stream;
//  - cuEventRecord + cuEventQuery, and cuStreamSynchronize on an idle stream.
// Only a driver FRAGLESS_LIBCUDA names may lack the kernel calls (the libcuda double runs no kernels): its
// kernel questions are null with a note saying why, and the schema is the same everywhere. Where the driver
// has them, kernels that cannot be loaded or launched fail the probe, the CUresult and the JIT's log named.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <cuda.h>

#include "gpu_kernels.h"
#include "trace_model.h"

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// The driver calls the probe makes, by their exported (versioned) names.
struct Cu {
  void* lib = nullptr;
  CUresult (*init)(unsigned);
  CUresult (*driverGetVersion)(int*);
  CUresult (*deviceGetCount)(int*);
  CUresult (*deviceGet)(CUdevice*, int);
  CUresult (*deviceGetName)(char*, int, CUdevice);
  CUresult (*deviceTotalMem)(size_t*, CUdevice);
  CUresult (*deviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*primaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*primaryCtxRelease)(CUdevice);
  CUresult (*ctxPushCurrent)(CUcontext);
  CUresult (*ctxPopCurrent)(CUcontext*);
  CUresult (*memGetInfo)(size_t*, size_t*);
  CUresult (*memGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  CUresult (*memAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*memAddressFree)(CUdeviceptr, size_t);
  CUresult (*memCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
  CUresult (*memRelease)(CUmemGenericAllocationHandle);
  CUresult (*memMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*memUnmap)(CUdeviceptr, size_t);
  CUresult (*memSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*memcpyHtoD)(CUdeviceptr, const void*, size_t);
  CUresult (*memcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*streamCreate)(CUstream*, unsigned);
  CUresult (*streamDestroy)(CUstream);
  CUresult (*streamSynchronize)(CUstream);
  CUresult (*eventCreate)(CUevent*, unsigned);
  CUresult (*eventRecord)(CUevent, CUstream);
  CUresult (*eventQuery)(CUevent);
  CUresult (*eventDestroy)(CUevent);
  CUresult (*ctxSynchronize)();
  // Optional: error names; kernels (the libcuda double has none).
  CUresult (*getErrorName)(CUresult, const char**) = nullptr;
  CUresult (*moduleLoadDataEx)(CUmodule*, const void*, unsigned, CUjit_option*, void**) = nullptr;
  CUresult (*moduleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*moduleUnload)(CUmodule) = nullptr;
  CUresult (*launchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                           void**, void**) = nullptr;
  std::string missing;

  template <typename F>
  void get(F* fn, const char* name, bool required = true) {
    *fn = reinterpret_cast<F>(dlsym(lib, name));
    if (!*fn && required) missing += std::string(missing.empty() ? "" : ", ") + name;
  }
  bool load(const char* path, std::string* why) {
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      *why = e ? e : "dlopen failed";
      return false;
    }
    get(&init, "cuInit");
    get(&driverGetVersion, "cuDriverGetVersion");
    get(&deviceGetCount, "cuDeviceGetCount");
    get(&deviceGet, "cuDeviceGet");
    get(&deviceGetName, "cuDeviceGetName");
    get(&deviceTotalMem, "cuDeviceTotalMem_v2");
    get(&deviceGetAttribute, "cuDeviceGetAttribute");
    get(&primaryCtxRetain, "cuDevicePrimaryCtxRetain");
    get(&primaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    get(&ctxPushCurrent, "cuCtxPushCurrent_v2");
    get(&ctxPopCurrent, "cuCtxPopCurrent_v2");
    get(&memGetInfo, "cuMemGetInfo_v2");
    get(&memGetAllocationGranularity, "cuMemGetAllocationGranularity");
    get(&memAddressReserve, "cuMemAddressReserve");
    get(&memAddressFree, "cuMemAddressFree");
    get(&memCreate, "cuMemCreate");
    get(&memRelease, "cuMemRelease");
    get(&memMap, "cuMemMap");
    get(&memUnmap, "cuMemUnmap");
    get(&memSetAccess, "cuMemSetAccess");
    get(&memcpyHtoD, "cuMemcpyHtoD_v2");
    get(&memcpyDtoH, "cuMemcpyDtoH_v2");
    get(&streamCreate, "cuStreamCreate");
    get(&streamDestroy, "cuStreamDestroy_v2");
    get(&streamSynchronize, "cuStreamSynchronize");
    get(&eventCreate, "cuEventCreate");
    get(&eventRecord, "cuEventRecord");
    get(&eventQuery, "cuEventQuery");
    get(&eventDestroy, "cuEventDestroy_v2");
    get(&ctxSynchronize, "cuCtxSynchronize");
    get(&getErrorName, "cuGetErrorName", false);
    get(&moduleLoadDataEx, "cuModuleLoadDataEx", false);
    get(&moduleGetFunction, "cuModuleGetFunction", false);
    get(&moduleUnload, "cuModuleUnload", false);
    get(&launchKernel, "cuLaunchKernel", false);
    return true;
  }
  // A CUresult by its name and number: "CUDA_ERROR_NO_DEVICE (100)".
  std::string name(CUresult r) const { return fragless_gpu::result_name(getErrorName, r); }
};

// Whether FRAGLESS_LIBCUDA names the driver (the libcuda double in the tests): only such a driver may lack
// the kernel calls.
bool driver_named() {
  const char* env = std::getenv("FRAGLESS_LIBCUDA");
  return env && *env;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Stat {
  double median = 0, p99 = 0;
  std::size_t n = 0;
};
Stat stat_of(std::vector<double> v) {
  Stat s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.median = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, static_cast<std::size_t>(0.99 * static_cast<double>(v.size())))];
  return s;
}
std::string json_stat(const Stat& s) {
  char b[128];
  std::snprintf(b, sizeof b, "{\"median\":%.3f,\"p99\":%.3f,\"n\":%zu}", s.median, s.p99, s.n);
  return b;
}
std::string json_bool(int v) { return v < 0 ? "null" : v ? "true" : "false"; }
std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) o += c;
  }
  return o + "\"";
}

class Probe {
 public:
  Probe(Cu& cu, CUdevice dev) : cu_(cu), dev_(dev) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = dev;
    desc_.location = prop_.location;
    desc_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  std::vector<std::string> notes;
  std::string failure;  // the first failed step, if any

  bool ok(const char* what, CUresult r) {
    if (r == CUDA_SUCCESS) return true;
    if (failure.empty()) failure = std::string(what) + " returned " + cu_.name(r);
    return false;
  }
  void fail(const std::string& what) {
    if (failure.empty()) failure = what;
  }

  // One full reserve/create/map/set access/unmap/release/free cycle at `size`, timed per call.
  bool cycle(std::size_t size, std::map<std::string, std::vector<double>>* t) {
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h = 0;
    double t0 = now_us();
    if (!ok("cuMemAddressReserve", cu_.memAddressReserve(&va, size, 0, 0, 0))) return false;
    double t1 = now_us();
    (*t)["cuMemAddressReserve"].push_back(t1 - t0);
    if (!ok("cuMemCreate", cu_.memCreate(&h, size, &prop_, 0))) return cu_.memAddressFree(va, size), false;
    double t2 = now_us();
    (*t)["cuMemCreate"].push_back(t2 - t1);
    bool good = ok("cuMemMap", cu_.memMap(va, size, 0, h, 0));
    double t3 = now_us();
    if (good) {
      (*t)["cuMemMap"].push_back(t3 - t2);
      good = ok("cuMemSetAccess", cu_.memSetAccess(va, size, &desc_, 1));
      double t4 = now_us();
      if (good) (*t)["cuMemSetAccess"].push_back(t4 - t3);
      double t5 = now_us();
      good = ok("cuMemUnmap", cu_.memUnmap(va, size)) && good;
      (*t)["cuMemUnmap"].push_back(now_us() - t5);
    }
    double t6 = now_us();
    good = ok("cuMemRelease", cu_.memRelease(h)) && good;
    double t7 = now_us();
    (*t)["cuMemRelease"].push_back(t7 - t6);
    good = ok("cuMemAddressFree", cu_.memAddressFree(va, size)) && good;
    (*t)["cuMemAddressFree"].push_back(now_us() - t7);
    return good;
  }

  // n adjacent handles of `each` bytes mapped into one reservation: one cuMemSetAccess over all, timed.
  bool adjacent_set_access(int n, std::size_t each, std::vector<double>* t) {
    const std::size_t size = each * static_cast<std::size_t>(n);
    CUdeviceptr va = 0;
    if (!ok("cuMemAddressReserve", cu_.memAddressReserve(&va, size, 0, 0, 0))) return false;
    std::vector<CUmemGenericAllocationHandle> hs;
    bool good = true;
    for (int i = 0; i < n && good; ++i) {
      CUmemGenericAllocationHandle h = 0;
      good = ok("cuMemCreate", cu_.memCreate(&h, each, &prop_, 0));
      if (good) {
        hs.push_back(h);
        good = ok("cuMemMap", cu_.memMap(va + static_cast<std::size_t>(i) * each, each, 0, h, 0));
      }
    }
    if (good) {
      const double t0 = now_us();
      good = ok("cuMemSetAccess", cu_.memSetAccess(va, size, &desc_, 1));
      t->push_back(now_us() - t0);
    }
    for (std::size_t i = 0; i < hs.size(); ++i) cu_.memUnmap(va + i * each, each);
    for (auto h : hs) cu_.memRelease(h);
    cu_.memAddressFree(va, size);
    return good;
  }

  // R5 and R7 as the driver sees them: 1 accepted, 0 refused, -1 could not ask.
  void semantics(std::size_t g, int* nonzero_offset, int* partial, int* unmap_several, int* coherent) {
    *nonzero_offset = *partial = *unmap_several = *coherent = -1;
    CUdeviceptr va = 0, other = 0;
    CUmemGenericAllocationHandle h2 = 0, h1 = 0;
    if (!ok("cuMemAddressReserve", cu_.memAddressReserve(&va, 8 * g, 0, 0, 0))) return;
    if (!ok("cuMemAddressReserve", cu_.memAddressReserve(&other, 2 * g, 0, 0, 0))) return;
    if (ok("cuMemCreate", cu_.memCreate(&h2, 2 * g, &prop_, 0)) && ok("cuMemCreate", cu_.memCreate(&h1, g, &prop_, 0))) {
      CUresult r = cu_.memMap(va, g, g, h2, 0);  // the second half of a two-granule handle
      *nonzero_offset = r == CUDA_SUCCESS;
      if (r == CUDA_SUCCESS) cu_.memUnmap(va, g);
      r = cu_.memMap(va, g, 0, h2, 0);  // the first half only
      *partial = r == CUDA_SUCCESS;
      if (r == CUDA_SUCCESS) cu_.memUnmap(va, g);
      if (cu_.memMap(va, 2 * g, 0, h2, 0) == CUDA_SUCCESS && cu_.memMap(va + 2 * g, g, 0, h1, 0) == CUDA_SUCCESS) {
        // R9: the same handle at a second address shows the same bytes.
        if (cu_.memMap(other, 2 * g, 0, h2, 0) == CUDA_SUCCESS) {
          if (cu_.memSetAccess(va, 3 * g, &desc_, 1) == CUDA_SUCCESS && cu_.memSetAccess(other, 2 * g, &desc_, 1) == CUDA_SUCCESS) {
            std::vector<unsigned char> out(4096, 0xA5), in(4096, 0);
            for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<unsigned char>(i * 7 + 3);
            if (cu_.memcpyHtoD(va + g + 12345, out.data(), out.size()) == CUDA_SUCCESS &&
                cu_.memcpyDtoH(in.data(), other + g + 12345, in.size()) == CUDA_SUCCESS)
              *coherent = in == out;
          }
          cu_.memUnmap(other, 2 * g);
        }
        const CUresult u = cu_.memUnmap(va, 3 * g);  // two adjacent mappings at once
        *unmap_several = u == CUDA_SUCCESS;
        if (u != CUDA_SUCCESS) {
          cu_.memUnmap(va, 2 * g);
          cu_.memUnmap(va + 2 * g, g);
        }
      }
    }
    if (h2) cu_.memRelease(h2);
    if (h1) cu_.memRelease(h1);
    cu_.memAddressFree(va, 8 * g);
    cu_.memAddressFree(other, 2 * g);
  }

  // Whether unmap / release / set access of an unrelated range wait for a kernel spinning ~spin_ms on another
  // stream: a call taking more than half the spin waited. -1 each when no kernel could be run.
  void waits_for_kernel(const std::string& kernel_file, std::size_t g, int* unmap, int* release, int* access) {
    *unmap = *release = *access = -1;
    if (!cu_.moduleLoadDataEx || !cu_.launchKernel || !cu_.moduleGetFunction || !cu_.moduleUnload) {
      const std::string what = "the driver has no cuModuleLoadDataEx, cuModuleGetFunction, cuModuleUnload or cuLaunchKernel";
      if (driver_named())
        notes.push_back("kernel questions not asked: " + what + " (the libcuda double runs no kernels)");
      else
        fail("kernel questions not asked: " + what);
      return;
    }
    std::string source, why;
    CUmodule mod = fragless_gpu::load_kernels(cu_.moduleLoadDataEx, cu_.getErrorName, kernel_file, &source, &why);
    if (!mod) {
      fail(why);
      return;
    }
    notes.push_back("kernels: " + source);
    CUfunction spin = nullptr;
    if (!ok("cuModuleGetFunction(fragless_spin)", cu_.moduleGetFunction(&spin, mod, "fragless_spin"))) {
      cu_.moduleUnload(mod);
      return;
    }
    CUstream s = nullptr;
    cu_.streamCreate(&s, CU_STREAM_NON_BLOCKING);
    // The kernel's own buffer, and an unrelated mapped range to unmap / release / set access on.
    CUdeviceptr buf = 0, other = 0;
    CUmemGenericAllocationHandle hb = 0, ho = 0;
    cu_.memAddressReserve(&buf, g, 0, 0, 0);
    cu_.memAddressReserve(&other, g, 0, 0, 0);
    cu_.memCreate(&hb, g, &prop_, 0);
    cu_.memMap(buf, g, 0, hb, 0);
    cu_.memSetAccess(buf, g, &desc_, 1);
    // Times `call` (one driver call on the unrelated range) while the kernel spins for ~200 ms, then cleans
    // up the range with `after`.
    auto run = [&](auto call, auto after) {
      unsigned long long cycles = 200ull * 1000 * 1000 * 2;  // ~200 ms at 2 GHz
      void* args[] = {&buf, &cycles};
      cu_.memCreate(&ho, g, &prop_, 0);
      cu_.memMap(other, g, 0, ho, 0);
      cu_.memSetAccess(other, g, &desc_, 1);
      if (!ok("cuLaunchKernel(fragless_spin)", cu_.launchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args, nullptr))) {
        cu_.memUnmap(other, g);
        cu_.memRelease(ho);
        return -1.0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // it is running now
      const double t0 = now_us();
      call();
      const double dt = now_us() - t0;
      after();
      ok("cuStreamSynchronize after fragless_spin", cu_.streamSynchronize(s));
      return dt;
    };
    const double tu = run([&] { cu_.memUnmap(other, g); }, [&] { cu_.memRelease(ho); });
    const double tr = run([&] { cu_.memRelease(ho); }, [&] { cu_.memUnmap(other, g); });
    const double ta = run([&] { cu_.memSetAccess(other, g, &desc_, 1); }, [&] { cu_.memUnmap(other, g); cu_.memRelease(ho); });
    const double half = 90e3;  // µs: half of the spin after the 20 ms head start
    *unmap = tu < 0 ? -1 : tu > half;
    *release = tr < 0 ? -1 : tr > half;
    *access = ta < 0 ? -1 : ta > half;
    char b[160];
    std::snprintf(b, sizeof b, "under a kernel spinning ~200 ms on another stream: cuMemUnmap %.0f us, cuMemRelease %.0f us, "
                  "cuMemSetAccess %.0f us", tu, tr, ta);
    notes.push_back(b);
    cu_.memUnmap(buf, g);
    cu_.memRelease(hb);
    cu_.memAddressFree(buf, g);
    cu_.memAddressFree(other, g);
    cu_.streamDestroy(s);
    cu_.moduleUnload(mod);
  }

  Stat events(int reps) {
    CUstream s = nullptr;
    CUevent e = nullptr;
    std::vector<double> t;
    if (!ok("cuStreamCreate", cu_.streamCreate(&s, CU_STREAM_NON_BLOCKING)) ||
        !ok("cuEventCreate", cu_.eventCreate(&e, CU_EVENT_DISABLE_TIMING)))
      return {};
    for (int i = 0; i < reps; ++i) {
      const double t0 = now_us();
      cu_.eventRecord(e, s);
      cu_.eventQuery(e);
      t.push_back(now_us() - t0);
    }
    cu_.eventDestroy(e);
    cu_.streamDestroy(s);
    return stat_of(t);
  }

  // cuMemGetInfo, which fragless asks before some growths (Note [Asking for free memory]).
  Stat mem_get_info(int reps) {
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      std::size_t f = 0, total = 0;
      const double t0 = now_us();
      if (!ok("cuMemGetInfo", cu_.memGetInfo(&f, &total))) return {};
      t.push_back(now_us() - t0);
    }
    return stat_of(t);
  }

  Stat idle_sync(int reps) {
    CUstream s = nullptr;
    std::vector<double> t;
    if (!ok("cuStreamCreate", cu_.streamCreate(&s, CU_STREAM_NON_BLOCKING))) return {};
    for (int i = 0; i < reps; ++i) {
      const double t0 = now_us();
      cu_.streamSynchronize(s);
      t.push_back(now_us() - t0);
    }
    cu_.streamDestroy(s);
    return stat_of(t);
  }

  CUmemAllocationProp prop_{};
  CUmemAccessDesc desc_{};

 private:
  Cu& cu_;
  CUdevice dev_;
};

int usage(const char* msg) {
  std::fprintf(msg ? stderr : stdout,
               "%s%susage: fragless-gpu-probe [--out FILE.json] [--kernel FILE.cubin] [--device N] [--quick]\n"
               "  asks the CUDA driver (libcuda.so.1, or FRAGLESS_LIBCUDA) what fragless assumes and what its\n"
               "  VMM calls cost; writes JSON (schema fragless-gpu-probe/1, for fragless-replay --costs) and a\n"
               "  table. --kernel: a cubin of the kernels to try before the PTX built in. --quick: fewer\n"
               "  repetitions. Exit 77 without a driver or device, 1 when cuInit fails otherwise or a step fails.\n",
               msg ? "fragless-gpu-probe: " : "", msg ? (std::string(msg) + "\n").c_str() : "");
  return msg ? 2 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out, kernel;
  int device = 0;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return usage(nullptr);
    if (a == "--quick") quick = true;
    else if (a == "--out" && i + 1 < argc) out = argv[++i];
    else if (a == "--kernel" && i + 1 < argc) kernel = argv[++i];
    else if (a == "--device" && i + 1 < argc) device = std::atoi(argv[++i]);
    else return usage(("unknown or incomplete option " + a).c_str());
  }
  const char* env = std::getenv("FRAGLESS_LIBCUDA");
  const std::string path = env && *env ? env : "libcuda.so.1";
  Cu cu;
  std::string why;
  if (!cu.load(path.c_str(), &why)) {
    // A device node without the driver's library is a machine set up wrong (a container given the GPU but not
    // the driver's user-space libraries), not a machine without a GPU.
    if (!driver_named() && access("/dev/nvidiactl", F_OK) == 0) {
      std::fprintf(stderr, "fragless-gpu-probe: /dev/nvidiactl is here, but %s cannot be loaded: %s\n", path.c_str(),
                   why.c_str());
      return 1;
    }
    std::printf("SKIPPED: no GPU driver here (cannot load %s: %s)\n", path.c_str(), why.c_str());
    return 77;
  }
  if (!cu.missing.empty()) {
    std::fprintf(stderr, "fragless-gpu-probe: %s lacks %s\n", path.c_str(), cu.missing.c_str());
    return 1;
  }
  int count = 0, version = 0;
  cu.driverGetVersion(&version);
  if (const CUresult r = cu.init(0); r != CUDA_SUCCESS) {
    if (r == CUDA_ERROR_NO_DEVICE) {
      std::printf("SKIPPED: no CUDA device here (%s loads; cuInit: %s)\n", path.c_str(), cu.name(r).c_str());
      return 77;
    }
    const char* hint = r == CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
                           ? ": the driver's library and its kernel module are of different versions"
                       : r == CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
                           ? ": a CUDA forward-compatibility library is loaded that this GPU does not support"
                           : "";
    std::fprintf(stderr, "fragless-gpu-probe: cuInit failed: %s%s (%s, driver version %d)\n", cu.name(r).c_str(), hint,
                 path.c_str(), version);
    return 1;
  }
  if (const CUresult r = cu.deviceGetCount(&count); r != CUDA_SUCCESS) {
    std::fprintf(stderr, "fragless-gpu-probe: cuDeviceGetCount failed: %s\n", cu.name(r).c_str());
    return 1;
  }
  if (count == 0) {
    std::printf("SKIPPED: no CUDA device here (%s loads, cuInit succeeds, cuDeviceGetCount counts 0)\n", path.c_str());
    return 77;
  }
  if (device < 0 || device >= count) return usage(("--device " + std::to_string(device) + " is not one of the " +
                                                    std::to_string(count) + " devices").c_str());
  CUdevice dev = 0;
  cu.deviceGet(&dev, device);
  char name[256] = "";
  cu.deviceGetName(name, sizeof name, dev);
  std::size_t total = 0;
  cu.deviceTotalMem(&total, dev);
  int vmm = 0, posix_fd = 0, rdma = 0;
  cu.deviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  cu.deviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
  cu.deviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
  CUcontext ctx = nullptr;
  if (const CUresult r = cu.primaryCtxRetain(&ctx, dev); r != CUDA_SUCCESS) {
    std::fprintf(stderr, "fragless-gpu-probe: cuDevicePrimaryCtxRetain of device %d: %s\n", device, cu.name(r).c_str());
    return 1;
  }
  if (const CUresult r = cu.ctxPushCurrent(ctx); r != CUDA_SUCCESS) {
    std::fprintf(stderr, "fragless-gpu-probe: cuCtxPushCurrent of device %d's primary context: %s\n", device,
                 cu.name(r).c_str());
    return 1;
  }
  Probe p(cu, dev);
  std::size_t gmin = 0, grec = 0;
  cu.memGetAllocationGranularity(&gmin, &p.prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  cu.memGetAllocationGranularity(&grec, &p.prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (!vmm || gmin == 0) {
    std::fprintf(stderr, "fragless-gpu-probe: device %d has no virtual memory management (VMM %d, granularity %zu)\n",
                 device, vmm, gmin);
    return 1;
  }
  std::size_t free_b = 0, total_b = 0;
  cu.memGetInfo(&free_b, &total_b);

  // Costs per handle size; a size above half the free memory is left out (and said so).
  const std::size_t sizes[] = {2 * MiB, 20 * MiB, 64 * MiB, 512 * MiB, 2048 * MiB};
  std::map<std::string, std::map<std::size_t, Stat>> costs;
  for (std::size_t size : sizes) {
    const std::size_t sz = (size + gmin - 1) / gmin * gmin;
    if (sz > free_b / 2) {
      p.notes.push_back("handle size " + std::to_string(sz) + " left out: more than half the free memory");
      continue;
    }
    int reps = size <= 20 * MiB ? 40 : size <= 64 * MiB ? 20 : size <= 512 * MiB ? 8 : 4;
    if (quick) reps = std::max(2, reps / 4);
    std::map<std::string, std::vector<double>> t;
    for (int r = 0; r < reps; ++r)
      if (!p.cycle(sz, &t)) break;
    for (auto& [call, v] : t) costs[call][sz] = stat_of(v);
  }
  std::map<int, Stat> adjacent;
  for (int n : {1, 8, 64}) {
    if (static_cast<std::size_t>(n) * gmin > free_b / 2) continue;
    std::vector<double> t;
    for (int r = 0; r < (quick ? 3 : 15); ++r)
      if (!p.adjacent_set_access(n, gmin, &t)) break;
    adjacent[n] = stat_of(t);
  }
  int nonzero_offset, partial, unmap_several, coherent;
  p.semantics(gmin, &nonzero_offset, &partial, &unmap_several, &coherent);
  int w_unmap, w_release, w_access;
  p.waits_for_kernel(kernel, gmin, &w_unmap, &w_release, &w_access);
  const Stat ev = p.events(quick ? 200 : 2000), sync = p.idle_sync(quick ? 200 : 2000);
  const Stat info = p.mem_get_info(quick ? 200 : 2000);
  CUcontext popped = nullptr;
  cu.ctxPopCurrent(&popped);
  cu.primaryCtxRelease(dev);

  // JSON.
  std::string j = "{\"schema\":\"fragless-gpu-probe/1\"";
  char date[32];
  const std::time_t tt = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&tt));
  j += ",\"date\":" + json_str(date) + ",\"driver\":{\"library\":" + json_str(path) +
       ",\"version\":" + std::to_string(version) + "}";
  j += ",\"device\":{\"index\":" + std::to_string(device) + ",\"name\":" + json_str(name) +
       ",\"total_bytes\":" + std::to_string(total) + ",\"free_bytes\":" + std::to_string(free_b) +
       ",\"vmm\":" + json_bool(vmm) + ",\"posix_fd_handles\":" + json_bool(posix_fd) +
       ",\"gpudirect_rdma_with_vmm\":" + json_bool(rdma) + ",\"granularity_min\":" + std::to_string(gmin) +
       ",\"granularity_recommended\":" + std::to_string(grec) + "}";
  j += ",\"costs_us\":{";
  bool first = true;
  for (auto& [call, by] : costs) {
    j += std::string(first ? "" : ",") + json_str(call) + ":{";
    first = false;
    bool f2 = true;
    for (auto& [sz, s] : by) {
      j += std::string(f2 ? "" : ",") + "\"" + std::to_string(sz) + "\":" + json_stat(s);
      f2 = false;
    }
    j += "}";
  }
  j += "},\"set_access_adjacent_us\":{";
  first = true;
  for (auto& [n, s] : adjacent) {
    j += std::string(first ? "" : ",") + "\"" + std::to_string(n) + "\":" + json_stat(s);
    first = false;
  }
  j += "},\"event_record_query_us\":" + json_stat(ev) + ",\"stream_synchronize_idle_us\":" + json_stat(sync) +
       ",\"mem_get_info_us\":" + json_stat(info);
  j += ",\"semantics\":{\"map_nonzero_offset\":" + json_bool(nonzero_offset) +
       ",\"map_partial_handle\":" + json_bool(partial) + ",\"unmap_several_mappings\":" + json_bool(unmap_several) +
       ",\"coherent_two_addresses\":" + json_bool(coherent) + ",\"unmap_waits_for_kernel\":" + json_bool(w_unmap) +
       ",\"release_waits_for_kernel\":" + json_bool(w_release) +
       ",\"set_access_waits_for_kernel\":" + json_bool(w_access) + "}";
  j += ",\"notes\":[";
  for (std::size_t i = 0; i < p.notes.size(); ++i) j += (i ? "," : "") + json_str(p.notes[i]);
  j += "],\"failure\":" + (p.failure.empty() ? std::string("null") : json_str(p.failure)) + "}\n";
  if (!out.empty()) {  // atomically: a run killed part way leaves the last complete file (a --costs input)
    std::string err;
    if (!fragless::formats::write_file(out, j, &err))
      return std::fprintf(stderr, "fragless-gpu-probe: %s\n", err.c_str()), 1;
  } else {
    std::fputs(j.c_str(), stdout);
  }

  // The table.
  std::printf("device %d: %s, %.1f GiB, driver %d.%d, granularity %zu / %zu (min / recommended)\n", device, name,
              static_cast<double>(total) / (1ull << 30), version / 1000, version % 1000 / 10, gmin, grec);
  std::printf("%-20s", "median (p99) us");
  for (auto& [sz, s] : costs.begin() != costs.end() ? costs.begin()->second : std::map<std::size_t, Stat>{})
    std::printf(" %14s", (std::to_string(sz >> 20) + " MiB").c_str());
  std::printf("\n");
  for (auto& [call, by] : costs) {
    std::printf("%-20s", call.c_str());
    for (auto& [sz, s] : by) {
      char b[40];
      std::snprintf(b, sizeof b, "%.1f (%.1f)", s.median, s.p99);
      std::printf(" %14s", b);
    }
    std::printf("\n");
  }
  for (auto& [n, s] : adjacent) std::printf("cuMemSetAccess over %d adjacent mappings: %.1f us median\n", n, s.median);
  std::printf("cuEventRecord+cuEventQuery %.2f us, idle cuStreamSynchronize %.2f us, cuMemGetInfo %.2f us (medians)\n",
              ev.median, sync.median, info.median);
  std::printf("map at a non-zero offset: %s; part of a handle: %s; one unmap over adjacent mappings: %s; one handle "
              "at two addresses coherent: %s\n", json_bool(nonzero_offset).c_str(), json_bool(partial).c_str(),
              json_bool(unmap_several).c_str(), json_bool(coherent).c_str());
  std::printf("waits for a kernel on another stream: unmap %s, release %s, set access %s\n", json_bool(w_unmap).c_str(),
              json_bool(w_release).c_str(), json_bool(w_access).c_str());
  for (auto& n : p.notes) std::printf("note: %s\n", n.c_str());
  if (!p.failure.empty()) {
    std::fprintf(stderr, "fragless-gpu-probe: %s\n", p.failure.c_str());
    return 1;
  }
  return 0;
}
