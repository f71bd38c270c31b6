// fragless-gpu-tests: the engine on the cuda driver against the real libcuda (or FRAGLESS_LIBCUDA), with no
// test framework, so it runs on a GPU machine that has none. Device memory is not host memory: every
// pattern is written and read back through cuMemcpyHtoD / cuMemcpyDtoH.
//
//   fragless-gpu-tests [--kernel FILE.fatbin] [--json FILE]
//
// conformance (distinct, aligned, usable blocks; reuse; empty_cache gives everything back), OOM under a
// memory fraction (PyTorch's first sentence, then recovery), integrity (random operations with a pattern per
// live block, every policy), record_stream with a real kernel on a second stream, and a graph capture on a
// real stream with pool routing (never invalidated). A test that cannot run here (no kernel on the libcuda
// double) is reported SKIPPED, loudly. Exit 0 all passed, 1 a failure, 77 no GPU driver or device.
#include <dlfcn.h>

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

using namespace fragless;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

struct Cu {
  void* lib = nullptr;
  CUresult (*primaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
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
  CUresult (*moduleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*moduleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*launchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                           void**, void**) = nullptr;
  CUresult (*eventQuery)(CUevent) = nullptr;
  template <typename F>
  void get(F* f, const char* n) { *f = reinterpret_cast<F>(dlsym(lib, n)); }
};

struct Report {
  int passed = 0, failed = 0, skipped = 0;
  std::string json = "[";
  void add(const std::string& name, const char* result, const std::string& detail) {
    std::printf("%-8s %s%s%s\n", result, name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
    json += std::string(json.size() > 1 ? "," : "") + "{\"test\":\"" + name + "\",\"result\":\"" + result + "\"}";
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

}  // namespace

int main(int argc, char** argv) {
  std::string kernel_file, json_file;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--kernel" && i + 1 < argc) kernel_file = argv[++i];
    else if (a == "--json" && i + 1 < argc) json_file = argv[++i];
    else if (a == "-h" || a == "--help") {
      std::printf("usage: fragless-gpu-tests [--kernel FILE.fatbin] [--json FILE]\n");
      return 0;
    } else {
      std::fprintf(stderr, "fragless-gpu-tests: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  std::string err;
  const int devices = cuda_device_count(&err);
  if (devices <= 0) {
    std::printf("SKIPPED: no GPU here (%s): the real-driver tests did not run\n", devices < 0 ? err.c_str() : "no device");
    return 77;
  }
  Cu cu;
  const char* env = std::getenv("FRAGLESS_LIBCUDA");
  cu.lib = dlopen(env && *env ? env : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
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
  cu.get(&cu.moduleLoadData, "cuModuleLoadData");
  cu.get(&cu.moduleGetFunction, "cuModuleGetFunction");
  cu.get(&cu.launchKernel, "cuLaunchKernel");
  cu.get(&cu.eventQuery, "cuEventQuery");
  if (!cu.lib || !cu.primaryCtxRetain || !cu.htod || !cu.dtoh || !cu.streamCreate || !cu.beginCapture) {
    std::fprintf(stderr, "fragless-gpu-tests: the driver lacks the calls these tests need\n");
    return 1;
  }
  // This thread acts as a CUDA program's: device 0's primary context current, streams of its own.
  CUcontext ctx = nullptr;
  cu.primaryCtxRetain(&ctx, 0);
  cu.ctxPush(ctx);
  CUstream sa = nullptr, sb = nullptr;
  cu.streamCreate(&sa, CU_STREAM_NON_BLOCKING);
  cu.streamCreate(&sb, CU_STREAM_NON_BLOCKING);
  const auto A = reinterpret_cast<Stream>(sa), B = reinterpret_cast<Stream>(sb);
  CUfunction spin = nullptr;
  std::string no_kernel;
  if (!cu.moduleLoadData || !cu.launchKernel) {
    no_kernel = "the driver runs no kernels (the libcuda double)";
  } else if (kernel_file.empty()) {
    no_kernel = "no --kernel file";
  } else {
    std::ifstream f(kernel_file, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    std::string image = ss.str() + std::string(1, '\0');
    CUmodule mod = nullptr;
    if (!f || cu.moduleLoadData(&mod, image.data()) != CUDA_SUCCESS ||
        cu.moduleGetFunction(&spin, mod, "fragless_spin") != CUDA_SUCCESS)
      no_kernel = "cannot load fragless_spin from " + kernel_file;
  }
  Report report;
  Run t(cu, report);
  const PolicyKind policies[] = {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless};

  for (PolicyKind p : policies) {
    const std::string pn = policy_name(p);
    {  // conformance
      auto a = make(p, &err);
      t.expect(a != nullptr, "cannot create the allocator: " + err);
      if (a) {
        DeviceEngine& e = *a->device(0);
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
        for (auto& [x, n] : live) e.free(x);
        const auto calls = e.driver_counters()[DriverCall::create];
        for (int i = 0; i < 10; ++i) e.free(e.allocate(3 * MiB, A, nullptr));
        t.expect(e.driver_counters()[DriverCall::create] == calls, "a freed block was not reused on its stream");
        e.empty_cache();
        t.expect(e.stats().reserved_bytes.all().current == 0, "empty_cache left memory reserved");
        t.expect(e.check_invariants().empty(), e.check_invariants());
      }
      t.finish("conformance (" + pn + ")");
    }
    {  // OOM under a memory fraction, then recovery
      auto a = make(p, &err);
      if (a) {
        DeviceEngine& e = *a->device(0);
        std::size_t free_b = 0, total_b = 0;
        e.memory_info(&free_b, &total_b);
        t.expect(e.set_memory_fraction(0.02) == Status::ok, "set_memory_fraction");
        AllocError ae;
        void* big = e.allocate(total_b / 20, A, &ae);
        t.expect(big == nullptr && ae.status == Status::out_of_memory, "no OOM beyond the memory fraction");
        t.expect(ae.message.rfind("CUDA out of memory. Tried to allocate", 0) == 0, "OOM message: " + ae.message);
        e.set_memory_fraction(1.0);
        void* ok = e.allocate(total_b / 20, A, &ae);
        t.expect(ok != nullptr, "no recovery after the fraction was lifted: " + ae.message);
        if (ok) t.expect(t.write(ok, total_b / 20, 3) && t.check(ok, total_b / 20, 3), "the recovered block");
        e.free(ok);
      }
      t.finish("OOM under a memory fraction, then recovery (" + pn + ")");
    }
    {  // integrity: random operations, a pattern per live block
      auto a = make(p, &err);
      if (a) {
        DeviceEngine& e = *a->device(0);
        std::mt19937_64 rng(42);
        std::unordered_map<void*, std::pair<std::size_t, std::uint64_t>> live;
        std::vector<void*> order;
        for (int op = 0; op < 3000; ++op) {
          if (!order.empty() && rng() % 3 == 0) {
            const std::size_t k = rng() % order.size();
            void* x = order[k];
            t.expect(t.check(x, live[x].first, live[x].second), "a live block's bytes changed before its free");
            e.free(x);
            live.erase(x);
            order[k] = order.back();
            order.pop_back();
          } else {
            const std::size_t n = rng() % 4 == 0 ? (1 + rng() % 64) * MiB : 512 * (1 + rng() % 4096);
            void* x = e.allocate(n, rng() % 2 ? A : B, nullptr);
            if (!x) continue;
            const std::uint64_t seed = rng();
            t.expect(t.write(x, n, seed), "cuMemcpyHtoD");
            live[x] = {n, seed};
            order.push_back(x);
          }
          if (op % 500 == 499) e.empty_cache();
        }
        for (void* x : order) {
          t.expect(t.check(x, live[x].first, live[x].second), "a live block's bytes changed");
          e.free(x);
        }
        t.expect(e.check_invariants().empty(), e.check_invariants());
      }
      t.finish("integrity: 3,000 random operations with patterns (" + pn + ")");
    }
    if (!no_kernel.empty()) {
      t.skip("record_stream with a kernel on a second stream (" + pn + ")", no_kernel);
    } else {  // record_stream with a real kernel on B
      auto a = make(p, &err);
      if (a) {
        DeviceEngine& e = *a->device(0);
        void* x = e.allocate(8 * MiB, A, nullptr);
        unsigned long long cycles = 100ull * 1000 * 1000 * 2;  // ~100 ms
        void* args[] = {&x, &cycles};
        t.expect(cu.launchKernel(spin, 1, 1, 1, 32, 1, 1, 0, sb, args, nullptr) == CUDA_SUCCESS, "cuLaunchKernel");
        e.record_stream(x, B);
        e.free(x);
        void* y = e.allocate(8 * MiB, A, nullptr);  // the kernel still writes x
        t.expect(y != x, "a block used by a running kernel on another stream was handed out again");
        cu.streamSynchronize(sb);
        e.free(y);
        e.empty_cache();
      }
      t.finish("record_stream with a kernel on a second stream (" + pn + ")");
    }
    {  // graph capture on a real stream
      auto a = make(p, &err);
      if (a) {
        DeviceEngine& e = *a->device(0);
        e.free(e.allocate(4 * MiB, B, nullptr));  // cached memory, and a stream that is not captured
        t.expect(cu.beginCapture(sa, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS, "cuStreamBeginCapture");
        e.begin_allocate_to_pool({9, 9}, [A](Stream s) { return s == A; });
        std::vector<void*> keep;
        for (int i = 0; i < 6; ++i) {
          void* g = e.allocate((1 + i) * 3 * MiB, A, nullptr);
          t.expect(g != nullptr, "an allocation during the capture");
          if (i % 2) {
            e.record_stream(g, B);
            e.free(g);
          } else {
            keep.push_back(g);
          }
        }
        CUgraph graph = nullptr;
        t.expect(cu.endCapture(sa, &graph) == CUDA_SUCCESS, "the capture was invalidated");
        e.end_allocate_to_pool({9, 9});
        if (graph && cu.graphDestroy) cu.graphDestroy(graph);
        for (void* g : keep) e.free(g);
        e.release_pool({9, 9});
        e.empty_cache();
        t.expect(e.stats().reserved_bytes.all().current == 0, "the pool's memory was not released");
      }
      t.finish("graph capture on a real stream, pool routed and released (" + pn + ")");
    }
  }
  cu.streamDestroy(sa);
  cu.streamDestroy(sb);
  CUcontext popped = nullptr;
  cu.ctxPop(&popped);
  cu.primaryCtxRelease(0);
  std::printf("real-driver tests: %d passed, %d failed, %d skipped\n", report.passed, report.failed, report.skipped);
  if (!json_file.empty()) {
    std::ofstream f(json_file);
    f << "{\"passed\":" << report.passed << ",\"failed\":" << report.failed << ",\"skipped\":" << report.skipped
      << ",\"tests\":" << report.json << "]}\n";
  }
  return report.failed ? 1 : 0;
}
