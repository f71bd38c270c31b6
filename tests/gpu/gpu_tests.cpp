// fragless-gpu-tests: the engine on the cuda driver against the real libcuda (or FRAGLESS_LIBCUDA), with no
// test framework, so it runs on a GPU machine that has none. Device memory is not host memory: every
// pattern is written and read back through cuMemcpyHtoD / cuMemcpyDtoH.
//
//   fragless-gpu-tests [--kernel FILE.cubin] [--json FILE]
//
// conformance (distinct, aligned, usable blocks; reuse; empty_cache gives everything back), OOM under a
// memory fraction (PyTorch's first sentence, then recovery), integrity (random operations with a pattern per
// live block, every policy), record_stream proved physically (a kernel on a second stream writes the whole
// freed block at its end: a new block must neither see that value nor lose its own bytes to it), a graph of
// real kernels captured into a private pool, replayed on another stream and released while the replay runs
// (the stream must end without a fault), and a capture on a real stream with pool routing (never
// invalidated). A test fails when its allocator cannot be created or any driver call it makes fails, each
// CUresult by its name. The kernels are tools/gpu_kernels.ptx, built in (any driver from CUDA 11.0 on compiles
// that PTX); --kernel names the bundle's cubin of them, tried first. The kernel tests are SKIPPED, loudly, only
// where the driver FRAGLESS_LIBCUDA names lacks the kernel calls (the libcuda double runs no kernels); on a
// driver that has them, kernels that do not load fail those tests, the CUresult and the JIT's log named.
// Exit 0 all passed, 1 a failure (or the setup failed, or cuInit failed with anything but
// CUDA_ERROR_NO_DEVICE), 77 no driver library (and no /dev/nvidiactl) or no device.
#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <cuda.h>

#include "fragless/allocator.h"
#include "fragless/cuda_driver.h"
#include "gpu_kernels.h"

using namespace fragless;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

struct Cu {
  void* lib = nullptr;
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*deviceGetCount)(int*) = nullptr;
  CUresult (*getErrorName)(CUresult, const char**) = nullptr;  CUresult (*primaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*primaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*ctxPush)(CUcontext) = nullptr;
  CUresult (*ctxPop)(CUcontext*) = nullptr;
  CUresult (*htod)(CUdeviceptr, const void*, size_t) = nullptr;
  CUresult (*dtoh)(void*, CUdeviceptr, size_t) = nullptr;
  CUresult (*streamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*streamDestroy)(CUstream) = nullptr;
  CUresult (*streamSynchronize)(CUstream) = nullptr;
  CUresult (*beginCapture)(CUstream, CUstreamCaptureMode) = nullptr;
  CUresult (*endCapture)(CUstream, CUgraph*) = nullptr;
  CUresult (*graphDestroy)(CUgraph) = nullptr;
  CUresult (*moduleLoadDataEx)(CUmodule*, const void*, unsigned, CUjit_option*, void**) = nullptr;
  CUresult (*moduleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*launchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                           void**, void**) = nullptr;
  CUresult (*eventQuery)(CUevent) = nullptr;
  CUresult (*eventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*eventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*eventDestroy)(CUevent) = nullptr;
  CUresult (*graphInstantiate)(CUgraphExec*, CUgraph, unsigned long long) = nullptr;
  CUresult (*graphLaunch)(CUgraphExec, CUstream) = nullptr;
  CUresult (*graphExecDestroy)(CUgraphExec) = nullptr;
  template <typename F>
  void get(F* f, const char* n) { *f = reinterpret_cast<F>(dlsym(lib, n)); }
  // A CUresult by its name and number: "CUDA_ERROR_NO_DEVICE (100)".
  std::string name(CUresult r) const { return fragless_gpu::result_name(getErrorName, r); }
};

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) o += c;
  }
  return o + "\"";
}

struct Report {
  int passed = 0, failed = 0, skipped = 0;
  std::string json = "[";
  void add(const std::string& name, const char* result, const std::string& detail) {
    std::printf("%-8s %s%s%s\n", result, name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
    json += std::string(json.size() > 1 ? "," : "") + "{\"test\":" + json_str(name) + ",\"result\":\"" + result + "\"" +
            (detail.empty() ? "" : ",\"detail\":" + json_str(detail)) + "}";
  }
};

class Run {
 public:
  Run(Cu& cu, Report& r) : cu_(cu), r_(r) {}
  std::string why;  // the first failed expectation of the test under way
  bool expect(bool ok, const std::string& what) {
    if (!ok && why.empty()) why = what;
    return ok;
  }
  // A driver call the test makes: any error fails the test, named.
  bool ok(CUresult r, const char* call) { return expect(r == CUDA_SUCCESS, std::string(call) + " returned " + cu_.name(r)); }
  void finish(const std::string& name) {
    if (why.empty()) ++r_.passed, r_.add(name, "PASSED", "");
    else ++r_.failed, r_.add(name, "FAILED", why);
    why.clear();
  }
  void skip(const std::string& name, const std::string& reason) {
    ++r_.skipped;
    r_.add(name, "SKIPPED", reason);
  }
  // A pattern that depends on the address and a seed, written and read back through the driver.
  static std::vector<unsigned char> pattern(std::size_t n, std::uint64_t seed) {
    std::vector<unsigned char> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed * 7) >> 3);
    return v;
  }
  // The first 64 KiB get the pattern; a larger block gets its seed's byte at its very end as well.
  static constexpr std::size_t kHead = 64 * 1024;
  bool write(void* p, std::size_t n, std::uint64_t seed) {
    const auto v = pattern(std::min(n, kHead), seed);
    const auto d = reinterpret_cast<CUdeviceptr>(p);
    return cu_.htod(d, v.data(), v.size()) == CUDA_SUCCESS && (n <= kHead || cu_.htod(d + n - 1, &v[1], 1) == CUDA_SUCCESS);
  }
  bool check(void* p, std::size_t n, std::uint64_t seed) {
    const auto v = pattern(std::min(n, kHead), seed);
    const auto d = reinterpret_cast<CUdeviceptr>(p);
    std::vector<unsigned char> got(v.size());
    unsigned char last = 0;
    if (cu_.dtoh(got.data(), d, got.size()) != CUDA_SUCCESS || got != v) return false;
    return n <= kHead || (cu_.dtoh(&last, d + n - 1, 1) == CUDA_SUCCESS && last == v[1]);
  }
  // Every byte of the block: written whole, or read back whole and compared.
  bool write_all(void* p, std::size_t n, std::uint64_t seed) {
    const auto v = pattern(n, seed);
    return cu_.htod(reinterpret_cast<CUdeviceptr>(p), v.data(), n) == CUDA_SUCCESS;
  }
  bool check_all(void* p, std::size_t n, std::uint64_t seed) {
    std::vector<unsigned char> got(n);
    return cu_.dtoh(got.data(), reinterpret_cast<CUdeviceptr>(p), n) == CUDA_SUCCESS && got == pattern(n, seed);
  }

 private:
  Cu& cu_;
  Report& r_;
};

std::unique_ptr<Allocator> make(PolicyKind p, std::string* err) {
  Options o;
  o.policy = p;
  o.driver = DriverKind::cuda;
  return Allocator::create(o, 1, err);
}

// One test under one policy: an allocator that cannot be created fails it; then the body; then the verdict.
template <typename F>
void test(Run& t, PolicyKind p, const std::string& name, F&& body) {
  std::string err;
  auto a = make(p, &err);
  DeviceEngine* e = a ? a->device(0, &err) : nullptr;
  if (t.expect(e != nullptr, "cannot create the allocator: " + err)) body(*e);
  t.finish(name + " (" + policy_name(p) + ")");
}

bool emptied(Run& t, DeviceEngine& e) {
  AllocError ae;
  return t.expect(e.empty_cache(&ae) == Status::ok, "empty_cache: " + ae.message);
}

}  // namespace

int main(int argc, char** argv) {
  std::string kernel_file, json_file;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--kernel" && i + 1 < argc) kernel_file = argv[++i];
    else if (a == "--json" && i + 1 < argc) json_file = argv[++i];
    else if (a == "-h" || a == "--help") {
      std::printf("usage: fragless-gpu-tests [--kernel FILE.cubin] [--json FILE]\n");
      return 0;
    } else {
      std::fprintf(stderr, "fragless-gpu-tests: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  // Whether there is a GPU here: the driver's library, cuInit and a device. No library (and no device node),
  // CUDA_ERROR_NO_DEVICE and a count of 0 are "no GPU" (77); any other failure is a machine whose GPU cannot
  // be used (1), named.
  const char* env = std::getenv("FRAGLESS_LIBCUDA");
  const bool named = env && *env;  // only a driver named so (the libcuda double) may lack the kernel calls
  const std::string path = named ? env : "libcuda.so.1";
  Cu cu;
  cu.lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!cu.lib) {
    const char* e = dlerror();
    if (!named && access("/dev/nvidiactl", F_OK) == 0) {
      std::fprintf(stderr, "fragless-gpu-tests: /dev/nvidiactl is here, but %s cannot be loaded: %s\n", path.c_str(),
                   e ? e : "dlopen failed");
      return 1;
    }
    std::printf("SKIPPED: no GPU driver here (cannot load %s: %s): the real-driver tests did not run\n", path.c_str(),
                e ? e : "dlopen failed");
    return 77;
  }
  cu.get(&cu.init, "cuInit");
  cu.get(&cu.deviceGetCount, "cuDeviceGetCount");
  cu.get(&cu.getErrorName, "cuGetErrorName");
  if (!cu.init || !cu.deviceGetCount) {
    std::fprintf(stderr, "fragless-gpu-tests: %s has no cuInit or cuDeviceGetCount\n", path.c_str());
    return 1;
  }
  if (const CUresult r = cu.init(0); r != CUDA_SUCCESS) {
    if (r == CUDA_ERROR_NO_DEVICE) {
      std::printf("SKIPPED: no GPU here (cuInit: %s): the real-driver tests did not run\n", cu.name(r).c_str());
      return 77;
    }
    std::fprintf(stderr, "fragless-gpu-tests: cuInit failed: %s; the real-driver tests did not run\n", cu.name(r).c_str());
    return 1;
  }
  int count = 0;
  if (const CUresult r = cu.deviceGetCount(&count); r != CUDA_SUCCESS) {
    std::fprintf(stderr, "fragless-gpu-tests: cuDeviceGetCount failed: %s\n", cu.name(r).c_str());
    return 1;
  }
  if (count == 0) {
    std::printf("SKIPPED: no GPU here (cuDeviceGetCount counts 0): the real-driver tests did not run\n");
    return 77;
  }
  std::string err;
  if (cuda_device_count(&err) <= 0) {
    std::fprintf(stderr, "fragless-gpu-tests: fragless's cuda driver sees no device where cuDeviceGetCount counts %d: %s\n",
                 count, err.c_str());
    return 1;
  }
  cu.get(&cu.primaryCtxRetain, "cuDevicePrimaryCtxRetain");
  cu.get(&cu.primaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
  cu.get(&cu.ctxPush, "cuCtxPushCurrent_v2");
  cu.get(&cu.ctxPop, "cuCtxPopCurrent_v2");
  cu.get(&cu.htod, "cuMemcpyHtoD_v2");
  cu.get(&cu.dtoh, "cuMemcpyDtoH_v2");
  cu.get(&cu.streamCreate, "cuStreamCreate");
  cu.get(&cu.streamDestroy, "cuStreamDestroy_v2");
  cu.get(&cu.streamSynchronize, "cuStreamSynchronize");
  cu.get(&cu.beginCapture, "cuStreamBeginCapture_v2");
  cu.get(&cu.endCapture, "cuStreamEndCapture");
  cu.get(&cu.graphDestroy, "cuGraphDestroy");
  cu.get(&cu.moduleLoadDataEx, "cuModuleLoadDataEx");
  cu.get(&cu.moduleGetFunction, "cuModuleGetFunction");
  cu.get(&cu.launchKernel, "cuLaunchKernel");
  cu.get(&cu.eventQuery, "cuEventQuery");
  cu.get(&cu.eventCreate, "cuEventCreate");
  cu.get(&cu.eventRecord, "cuEventRecord");
  cu.get(&cu.eventDestroy, "cuEventDestroy_v2");
  cu.get(&cu.graphInstantiate, "cuGraphInstantiateWithFlags");
  cu.get(&cu.graphLaunch, "cuGraphLaunch");
  cu.get(&cu.graphExecDestroy, "cuGraphExecDestroy");
  if (!cu.lib || !cu.primaryCtxRetain || !cu.ctxPush || !cu.htod || !cu.dtoh || !cu.streamCreate || !cu.beginCapture ||
      !cu.endCapture || !cu.streamSynchronize) {
    std::fprintf(stderr, "fragless-gpu-tests: the driver lacks the calls these tests need\n");
    return 1;
  }
  // This thread acts as a CUDA program's: device 0's primary context current, streams of its own.
  CUcontext ctx = nullptr;
  CUstream sa = nullptr, sb = nullptr, sc = nullptr;
  if (cu.primaryCtxRetain(&ctx, 0) != CUDA_SUCCESS || cu.ctxPush(ctx) != CUDA_SUCCESS ||
      cu.streamCreate(&sa, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
      cu.streamCreate(&sb, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
      cu.streamCreate(&sc, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
    std::fprintf(stderr, "fragless-gpu-tests: cannot set up device 0's context and three streams\n");
    return 1;
  }
  const auto A = reinterpret_cast<Stream>(sa), B = reinterpret_cast<Stream>(sb);
  CUfunction spin_fill = nullptr;
  std::string no_kernel;     // why the kernel tests are skipped: the driver FRAGLESS_LIBCUDA names runs none
  std::string kernel_error;  // why they fail: a driver with the kernel calls did not load the kernels
  std::string kernels;       // where the kernels came from, or why they did not load (in --json)
  if (!cu.moduleLoadDataEx || !cu.moduleGetFunction || !cu.launchKernel || !cu.eventCreate || !cu.eventRecord ||
      !cu.eventQuery || !cu.eventDestroy || !cu.graphInstantiate || !cu.graphLaunch || !cu.graphExecDestroy) {
    const std::string what = "the driver has no cuModuleLoadDataEx, cuModuleGetFunction, cuLaunchKernel, the event "
                             "calls or cuGraphInstantiateWithFlags, cuGraphLaunch, cuGraphExecDestroy";
    if (named) no_kernel = what + " (the libcuda double runs no kernels)";
    else kernel_error = what;
  } else {
    CUmodule mod = fragless_gpu::load_kernels(cu.moduleLoadDataEx, cu.getErrorName, kernel_file, &kernels, &kernel_error);
    if (mod) {
      if (const CUresult r = cu.moduleGetFunction(&spin_fill, mod, "fragless_spin_fill"); r != CUDA_SUCCESS)
        kernel_error = "cuModuleGetFunction(fragless_spin_fill): " + cu.name(r);
    }
  }
  if (!kernel_error.empty()) kernels = kernel_error;
  else if (!no_kernel.empty()) kernels = "none: " + no_kernel;
  std::printf("kernels: %s\n", kernels.c_str());
  // A kernel on `s` that spins for about `ms` milliseconds, then writes `value` into every word of [p, p+n).
  auto launch_fill = [&](CUstream s, void* p, std::size_t n, double ms, unsigned value) {
    unsigned long long cycles = static_cast<unsigned long long>(ms * 2e6), words = n / 4;
    void* args[] = {&p, &cycles, &words, &value};
    return cu.launchKernel(spin_fill, 64, 1, 1, 256, 1, 1, 0, s, args, nullptr);
  };
  // Whether the work queued on s so far is still running.
  auto running = [&](Run& t, CUstream s) {
    CUevent ev = nullptr;
    if (!t.ok(cu.eventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate") || !t.ok(cu.eventRecord(ev, s), "cuEventRecord"))
      return false;
    const bool busy = cu.eventQuery(ev) == CUDA_ERROR_NOT_READY;
    cu.eventDestroy(ev);
    return busy;
  };
  Report report;
  Run t(cu, report);
  const PolicyKind policies[] = {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless};
  // A test that needs a kernel of its own: skipped, with the reason, where the driver runs none (the double);
  // failed where the kernels did not load.
  auto kernel_test = [&](PolicyKind p, const std::string& name, auto&& body) {
    if (!no_kernel.empty()) {
      t.skip(name + " (" + policy_name(p) + ")", no_kernel);
    } else if (!kernel_error.empty()) {
      t.expect(false, kernel_error);
      t.finish(name + " (" + policy_name(p) + ")");
    } else {
      test(t, p, name, body);
    }
  };

  for (PolicyKind p : policies) {
    test(t, p, "conformance", [&](DeviceEngine& e) {
      std::vector<std::pair<void*, std::size_t>> live;
      const std::size_t sizes[] = {1, 512, 4096, 1 * MiB + 7, 3 * MiB, 24 * MiB, 200 * MiB};
      for (int round = 0; round < 3; ++round)
        for (std::size_t i = 0; i < std::size(sizes); ++i) {
          AllocError ae;
          void* x = e.allocate(sizes[i], i % 2 ? A : B, &ae);
          t.expect(x != nullptr, "allocation of " + std::to_string(sizes[i]) + " failed: " + ae.message);
          if (!x) continue;
          t.expect(reinterpret_cast<std::uintptr_t>(x) % 512 == 0, "a block not aligned to 512 bytes");
          t.expect(t.write(x, sizes[i], i + 10 * round), "cuMemcpyHtoD into a block failed");
          live.emplace_back(x, sizes[i]);
        }
      for (std::size_t k = 0; k < live.size(); ++k)
        t.expect(t.check(live[k].first, live[k].second, k % std::size(sizes) + 10 * (k / std::size(sizes))),
                 "a block's bytes changed (overlap or a bad mapping)");
      for (auto& [x, n] : live) t.expect(e.free(x) == Status::ok, "free");
      const auto calls = e.driver_counters()[DriverCall::create];
      for (int i = 0; i < 10; ++i) t.expect(e.free(e.allocate(3 * MiB, A, nullptr)) == Status::ok, "alloc and free");
      t.expect(e.driver_counters()[DriverCall::create] == calls, "a freed block was not reused on its stream");
      emptied(t, e);
      t.expect(e.stats().reserved_bytes.all().current == 0, "empty_cache left memory reserved");
      t.expect(e.check_invariants().empty(), e.check_invariants());
    });
    test(t, p, "OOM under a memory fraction, then recovery", [&](DeviceEngine& e) {
      std::size_t free_b = 0, total_b = 0;
      e.memory_info(&free_b, &total_b);
      t.expect(total_b > 0, "cuMemGetInfo gave no total");
      t.expect(e.set_memory_fraction(0.02) == Status::ok, "set_memory_fraction");
      AllocError ae;
      void* big = e.allocate(total_b / 20, A, &ae);
      t.expect(big == nullptr && ae.status == Status::out_of_memory, "no OOM beyond the memory fraction");
      t.expect(ae.message.rfind("CUDA out of memory. Tried to allocate", 0) == 0, "OOM message: " + ae.message);
      t.expect(e.set_memory_fraction(1.0) == Status::ok, "set_memory_fraction(1)");
      void* ok = e.allocate(total_b / 20, A, &ae);
      t.expect(ok != nullptr, "no recovery after the fraction was lifted: " + ae.message);
      if (ok) {
        t.expect(t.write(ok, total_b / 20, 3) && t.check(ok, total_b / 20, 3), "the recovered block");
        t.expect(e.free(ok) == Status::ok, "free");
      }
      emptied(t, e);
    });
    test(t, p, "integrity: 3,000 random operations with patterns", [&](DeviceEngine& e) {
      std::mt19937_64 rng(42);
      std::unordered_map<void*, std::pair<std::size_t, std::uint64_t>> live;
      std::vector<void*> order;
      int allocated = 0;
      for (int op = 0; op < 3000; ++op) {
        if (!order.empty() && rng() % 3 == 0) {
          const std::size_t k = rng() % order.size();
          void* x = order[k];
          t.expect(t.check(x, live[x].first, live[x].second), "a live block's bytes changed before its free");
          t.expect(e.free(x) == Status::ok, "free");
          live.erase(x);
          order[k] = order.back();
          order.pop_back();
        } else {
          const std::size_t n = rng() % 4 == 0 ? (1 + rng() % 64) * MiB : 512 * (1 + rng() % 4096);
          AllocError ae;
          void* x = e.allocate(n, rng() % 2 ? A : B, &ae);
          if (!x) {
            t.expect(ae.status == Status::out_of_memory, "allocation failed: " + ae.message);
            continue;
          }
          ++allocated;
          const std::uint64_t seed = rng();
          t.expect(t.write(x, n, seed), "cuMemcpyHtoD");
          live[x] = {n, seed};
          order.push_back(x);
        }
        if (op % 500 == 499) emptied(t, e);
      }
      t.expect(allocated > 1000, "fewer than 1,000 allocations succeeded");
      for (void* x : order) {
        t.expect(t.check(x, live[x].first, live[x].second), "a live block's bytes changed");
        t.expect(e.free(x) == Status::ok, "free");
      }
      t.expect(e.check_invariants().empty(), e.check_invariants());
      emptied(t, e);
    });
    kernel_test(p, "record_stream: no physical reuse before a kernel on a second stream ends", [&](DeviceEngine& e) {
      constexpr std::size_t n = 8 * MiB;
      void* x = e.allocate(n, A, nullptr);
      if (!t.expect(x != nullptr, "allocation")) return;
      // The kernel writes 0xA5A5A5A5 over all of x at its end, ~200 ms from now.
      t.ok(launch_fill(sb, x, n, 200, 0xA5A5A5A5u), "cuLaunchKernel");
      t.expect(e.record_stream(x, B) == Status::ok, "record_stream");
      t.expect(e.free(x) == Status::ok, "free");
      void* y = e.allocate(n, A, nullptr);  // the kernel still runs
      if (!t.expect(y != nullptr, "allocation")) return;
      t.expect(t.write_all(y, n, 77), "cuMemcpyHtoD into the new block");
      t.expect(running(t, sb), "the kernel ended before the new block was written: the test proved nothing");
      t.ok(cu.streamSynchronize(sb), "cuStreamSynchronize");
      t.expect(t.check_all(y, n, 77), "the kernel's write at its end reached the new block: its memory was reused");
      t.expect(e.free(y) == Status::ok, "free");
      emptied(t, e);
    });
    kernel_test(p, "a graph of kernels replayed on another stream, released while it runs", [&](DeviceEngine& e) {
      const PoolId pool{9, 1};
      t.ok(cu.beginCapture(sa, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
      e.begin_allocate_to_pool(pool, [A](Stream s) { return s == A; });
      std::vector<std::pair<void*, std::size_t>> blocks;
      for (std::size_t n : {6 * MiB, 512 * std::size_t{1024}, 40 * MiB}) {
        void* g = e.allocate(n, A, nullptr);
        if (t.expect(g != nullptr, "an allocation during the capture")) {
          t.ok(launch_fill(sa, g, n, 100, 0x5A5A5A5Au), "cuLaunchKernel (captured)");
          blocks.emplace_back(g, n);
        }
      }
      CUgraph graph = nullptr;
      t.ok(cu.endCapture(sa, &graph), "cuStreamEndCapture (the capture was invalidated?)");
      e.end_allocate_to_pool(pool);
      CUgraphExec exec = nullptr;
      if (graph && t.ok(cu.graphInstantiate(&exec, graph, 0), "cuGraphInstantiateWithFlags")) {
        t.ok(cu.graphLaunch(exec, sc), "cuGraphLaunch on a third stream");  // PyTorch: the caller's stream
        for (auto& [g, n] : blocks) t.expect(e.free(g) == Status::ok, "free");
        t.expect(running(t, sc), "the replay ended before the release: the test proved nothing");
        AllocError ae;
        t.expect(e.release_pool(pool, &ae) == Status::ok, "release_pool: " + ae.message);
        emptied(t, e);
        t.ok(cu.streamSynchronize(sc), "cuStreamSynchronize of the replay (a fault: memory unmapped under it)");
        t.expect(e.stats().reserved_bytes.all().current == 0, "the pool's memory was not released");
        cu.graphExecDestroy(exec);
      }
      if (graph && cu.graphDestroy) cu.graphDestroy(graph);
    });
    test(t, p, "a capture on a real stream, pool routed and released", [&](DeviceEngine& e) {
      t.expect(e.free(e.allocate(4 * MiB, B, nullptr)) == Status::ok, "cached memory on a stream not captured");
      t.ok(cu.beginCapture(sa, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
      e.begin_allocate_to_pool({9, 9}, [A](Stream s) { return s == A; });
      std::vector<void*> keep;
      for (int i = 0; i < 6; ++i) {
        void* g = e.allocate((1 + i) * 3 * MiB, A, nullptr);
        if (!t.expect(g != nullptr, "an allocation during the capture")) continue;
        if (i % 2) {
          t.expect(e.record_stream(g, B) == Status::ok, "record_stream");
          t.expect(e.free(g) == Status::ok, "free");
        } else {
          keep.push_back(g);
        }
      }
      CUgraph graph = nullptr;
      t.ok(cu.endCapture(sa, &graph), "cuStreamEndCapture (the capture was invalidated?)");
      e.end_allocate_to_pool({9, 9});
      if (graph && cu.graphDestroy) cu.graphDestroy(graph);
      for (void* g : keep) t.expect(e.free(g) == Status::ok, "free");
      AllocError ae;
      t.expect(e.release_pool({9, 9}, &ae) == Status::ok, "release_pool: " + ae.message);
      emptied(t, e);
      t.expect(e.stats().reserved_bytes.all().current == 0, "the pool's memory was not released");
    });
  }
  for (CUstream s : {sa, sb, sc}) t.ok(cu.streamDestroy(s), "cuStreamDestroy");
  CUcontext popped = nullptr;
  t.ok(cu.ctxPop(&popped), "cuCtxPopCurrent");
  t.ok(cu.primaryCtxRelease(0), "cuDevicePrimaryCtxRelease");
  if (!t.why.empty()) t.finish("teardown");
  std::printf("real-driver tests: %d passed, %d failed, %d skipped\n", report.passed, report.failed, report.skipped);
  if (!json_file.empty()) {
    std::ofstream f(json_file);
    f << "{\"passed\":" << report.passed << ",\"failed\":" << report.failed << ",\"skipped\":" << report.skipped
      << ",\"kernels\":" << json_str(kernels) << ",\"tests\":" << report.json << "]}\n";
  }
  return report.failed ? 1 : 0;
}
