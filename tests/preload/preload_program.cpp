// A CUDA program in miniature, linked against the runtime double. Run plainly, every call reaches the
// runtime; run with LD_PRELOAD=libfragless_preload.so, every allocation call is fragless's, foreign
// pointers are forwarded, and memory is real. Prints what it saw; exits non-zero on a broken promise.
// Usage: fragless-preload-program plain|interposed (the mode the test expects: a broken LD_PRELOAD, which
// would leave the program in plain mode, fails the interposed test).
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

extern "C" {
typedef int cudaError_t;
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
cudaError_t cudaMalloc(void**, size_t);
cudaError_t cudaFree(void*);
cudaError_t cudaMallocAsync(void**, size_t, cudaStream_t);
cudaError_t cudaFreeAsync(void*, cudaStream_t);
cudaError_t cudaMemGetInfo(size_t*, size_t*);
cudaError_t cudaMallocAsync_ptsz(void**, size_t, cudaStream_t);
cudaError_t cudaFreeAsync_ptsz(void*, cudaStream_t);
cudaError_t cudaSetDevice(int);
cudaError_t cudaIpcGetMemHandle(void*, void*);
void* fakecudart_foreign_alloc(size_t);
unsigned long fakecudart_calls(const char*);
void fakecudart_set_stream(cudaStream_t, int, int);
}

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf("usage: fragless-preload-program plain|interposed\n"
                "  a program linked against a CUDA runtime double: plain, every call must reach the runtime;\n"
                "  interposed (run with LD_PRELOAD=libfragless_preload.so), every allocation must be fragless's\n"
                "  and foreign pointers forwarded\n");
    return 0;
  }
  // off: the interposer is loaded but fragless could not start (no driver): every call goes to the runtime.
  const bool off = argc == 2 && std::strcmp(argv[1], "off") == 0;
  const bool want_interposed = argc == 2 && (off || std::strcmp(argv[1], "interposed") == 0);
  if (argc != 2 || (!want_interposed && std::strcmp(argv[1], "plain") != 0)) {
    std::fprintf(stderr, "usage: fragless-preload-program plain|interposed|off\n");
    return 2;
  }
  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::fprintf(stderr, "FAIL: %s\n", what);
      ++failures;
    }
  };
  auto counters = reinterpret_cast<void (*)(unsigned long*)>(dlsym(RTLD_DEFAULT, "fragless_preload_counters"));
  const bool preloaded = counters != nullptr;
  std::printf("interposed: %s\n", preloaded ? "yes" : "no");
  if (preloaded != want_interposed) {
    std::fprintf(stderr, "FAIL: expected to run %s, but the interposer is %s\n", argv[1],
                 preloaded ? "loaded" : "not loaded (is LD_PRELOAD right?)");
    return 1;
  }

  const auto s1 = reinterpret_cast<cudaStream_t>(0x10), s2 = reinterpret_cast<cudaStream_t>(0x20);
  // On the libcuda double these stand for streams the runtime created on device 0 (the double refuses others).
  if (const char* f = std::getenv("FRAGLESS_LIBCUDA"))
    if (void* l = dlopen(f, RTLD_NOW | RTLD_LOCAL))
      if (auto adopt = reinterpret_cast<int (*)(void*, int)>(dlsym(l, "fakecuda_adopt_stream")))
        expect(adopt(s1, 0) == 1 && adopt(s2, 0) == 1, "streams adopted by the libcuda double");
  std::vector<void*> ptrs;
  for (int i = 0; i < 300; ++i) {
    void* p = nullptr;
    const size_t size = (i % 4 == 0) ? (size_t{1} + i % 5) << 20 : 4096 * (1 + i % 97);
    expect((i % 2 ? cudaMallocAsync(&p, size, s1) : cudaMalloc(&p, size)) == 0 && p, "allocation");
    std::memset(p, i & 0xff, size);
    ptrs.push_back(p);
    if (i % 3 == 2) {
      void* q = ptrs.front();
      ptrs.erase(ptrs.begin());
      expect((i % 2 ? cudaFreeAsync(q, s2) : cudaFree(q)) == 0, "free");
    }
  }
  for (void* p : ptrs) expect(cudaFree(p) == 0, "free at the end");
  void* foreign = fakecudart_foreign_alloc(1 << 20);
  expect(cudaFree(foreign) == 0, "free of a foreign pointer");
  size_t free_b = 0, total = 0;
  expect(cudaMemGetInfo(&free_b, &total) == 0 && total == (size_t{1} << 30), "cudaMemGetInfo");

  const unsigned long rt_malloc = fakecudart_calls("cudaMalloc") + fakecudart_calls("cudaMallocAsync");
  const unsigned long rt_free = fakecudart_calls("cudaFree") + fakecudart_calls("cudaFreeAsync");
  std::printf("runtime saw: %lu mallocs, %lu frees, %lu cudaMemGetInfo, %lu device syncs\n", rt_malloc, rt_free,
              fakecudart_calls("cudaMemGetInfo"), fakecudart_calls("cudaDeviceSynchronize"));
  if (off) {
    unsigned long c[5];
    counters(c);
    expect(rt_malloc == 300 && rt_free == 301 && c[0] == 0, "with fragless off every call reaches the runtime");
    std::printf("%s\n", failures ? "FAILED" : "all checks passed");
    return failures ? 1 : 0;
  }
  if (preloaded) {
    unsigned long c[5];
    counters(c);
    std::printf("fragless: %lu mallocs, %lu frees, %lu forwarded frees, %lu fences, %lu fallbacks\n", c[0], c[1], c[2],
                c[3], c[4]);
    expect(rt_malloc == 0, "every allocation intercepted");
    expect(c[0] == 300 && c[1] == 300, "every allocation and free of ours handled by fragless");
    expect(c[2] == 1 && rt_free == 1, "the foreign pointer forwarded to the runtime");
    expect(c[4] == 0, "no fallback to the runtime");
    expect(free_b >= (size_t{1} << 29), "cudaMemGetInfo counts cached memory as free");
  } else {
    expect(rt_malloc == 300 && rt_free == 301, "without the interposer every call reaches the runtime");
  }
  if (preloaded) {
    auto device_of = reinterpret_cast<int (*)(void*)>(dlsym(RTLD_DEFAULT, "fragless_preload_device_of"));
    expect(device_of != nullptr, "fragless_preload_device_of exported");
    // The fence of deferred frees synchronises the device that owns them, not the caller's current one.
    const unsigned long sync0 = fakecudart_calls("cudaDeviceSynchronize@0");
    expect(cudaSetDevice(1) == 0, "cudaSetDevice(1)");
    void* big[2] = {nullptr, nullptr};
    for (void*& b : big) expect(cudaMalloc(&b, 200u << 20) == 0 && b, "allocation on device 1");
    expect(device_of && device_of(big[0]) == 1, "cudaMalloc allocates on the current device");
    expect(cudaSetDevice(0) == 0, "cudaSetDevice(0)");
    for (void* b : big) expect(cudaFree(b) == 0, "free of device 1 memory from device 0");  // 400 MiB: a fence
    expect(fakecudart_calls("cudaDeviceSynchronize@1") >= 1, "the fence synchronised device 1");
    expect(fakecudart_calls("cudaDeviceSynchronize@0") == sync0, "and not the caller's device 0");
    // cudaMallocAsync allocates on the stream's device.
    const auto s4 = reinterpret_cast<cudaStream_t>(0x40);
    fakecudart_set_stream(s4, 1, 0);
    if (const char* f = std::getenv("FRAGLESS_LIBCUDA"))
      if (void* l = dlopen(f, RTLD_NOW | RTLD_LOCAL))
        if (auto adopt = reinterpret_cast<int (*)(void*, int)>(dlsym(l, "fakecuda_adopt_stream"))) adopt(s4, 1);
    void* on1 = nullptr;
    expect(cudaMallocAsync(&on1, 1 << 20, s4) == 0 && on1, "cudaMallocAsync on a device 1 stream");
    expect(device_of && device_of(on1) == 1, "cudaMallocAsync allocates on the stream's device");
    expect(cudaFreeAsync(on1, s4) == 0, "cudaFreeAsync on device 1");
    // The per-thread default stream variants are interposed.
    void* pt = nullptr;
    expect(cudaMallocAsync_ptsz(&pt, 1 << 20, s1) == 0 && pt && device_of && device_of(pt) == 0, "cudaMallocAsync_ptsz");
    expect(cudaFreeAsync_ptsz(pt, s1) == 0, "cudaFreeAsync_ptsz");
    expect(fakecudart_calls("cudaMallocAsync_ptsz") == 0, "the _ptsz calls never reached the runtime");
    // On a capturing stream the memory is the graph's: the runtime serves it.
    const auto cap = reinterpret_cast<cudaStream_t>(0x50);
    fakecudart_set_stream(cap, 0, 1);
    const unsigned long rt_async = fakecudart_calls("cudaMallocAsync");
    void* g = nullptr;
    expect(cudaMallocAsync(&g, 1 << 20, cap) == 0 && g, "cudaMallocAsync on a capturing stream");
    expect(fakecudart_calls("cudaMallocAsync") == rt_async + 1, "went to the runtime");
    expect(device_of && device_of(g) == -1, "is not fragless's");
    expect(cudaFreeAsync(g, cap) == 0 && fakecudart_calls("cudaFreeAsync") >= 1, "and its free too");
    // IPC of fragless memory needs shareable_handles:True (not set here): refused by fragless, said so on
    // stderr, with the runtime's error for memory it cannot export; a foreign pointer goes to the runtime.
    void* ours = nullptr;
    expect(cudaMalloc(&ours, 1 << 20) == 0, "allocation");
    unsigned char handle[64];
    expect(cudaIpcGetMemHandle(handle, ours) == 1, "cudaIpcGetMemHandle of unshareable fragless memory: cudaErrorInvalidValue");
    expect(fakecudart_calls("cudaIpcGetMemHandle") == 0, "without reaching the runtime");
    void* theirs = fakecudart_foreign_alloc(64);
    cudaIpcGetMemHandle(handle, theirs);
    expect(fakecudart_calls("cudaIpcGetMemHandle") == 1, "a foreign pointer's handle is the runtime's");
    std::free(theirs);
    expect(cudaFree(ours) == 0, "free");
    // fragless's own peaks (gpu_train.py reads them under LD_PRELOAD, where PyTorch's allocator is bypassed):
    // a block allocated and freed in between is in them until a reset starts them again from the current bytes.
    auto memory = reinterpret_cast<int (*)(int, size_t*, size_t*)>(dlsym(RTLD_DEFAULT, "fragless_preload_memory"));
    auto peak = reinterpret_cast<int (*)(int, size_t*, size_t*)>(dlsym(RTLD_DEFAULT, "fragless_preload_peak_memory"));
    auto reset = reinterpret_cast<int (*)(int)>(dlsym(RTLD_DEFAULT, "fragless_preload_reset_peak_memory"));
    expect(memory && peak && reset, "fragless_preload_peak_memory and fragless_preload_reset_peak_memory exported");
    if (memory && peak && reset) {
      size_t a0 = 0, r0 = 0, pa = 0, pr = 0, a1 = 0, r1 = 0;
      expect(reset(0) == 0 && memory(0, &a0, &r0) == 0 && peak(0, &pa, &pr) == 0, "the peaks read after a reset");
      expect(pa == a0 && pr == r0, "a reset starts the peaks from the current bytes");
      void* big = nullptr;
      expect(cudaMallocAsync(&big, 96u << 20, s1) == 0 && big, "a 96 MiB allocation");
      expect(cudaFreeAsync(big, s1) == 0, "its free (stream-ordered: not deferred)");
      expect(peak(0, &pa, &pr) == 0 && memory(0, &a1, &r1) == 0, "the peaks read after the free");
      std::printf("peaks: allocated %zu -> %zu (now %zu), reserved %zu -> %zu\n", a0, pa, a1, r0, pr);
      expect(pa >= a0 + (96u << 20) && pr >= (96u << 20) && pr >= r1 && a1 < pa, "the freed block is in the peaks");
      expect(reset(0) == 0 && peak(0, &pa, &pr) == 0 && memory(0, &a1, &r1) == 0 && pa == a1 && pr == r1,
             "a second reset forgets it");
      size_t z1 = 1, z2 = 1;
      // The interposer's last device (the double's count varies with its settings), which this program never
      // uses: 0 and 0.
      for (int d = 63; d >= 2; --d)
        if (peak(d, &z1, &z2) == 0) {
          expect(z1 == 0 && z2 == 0, "a device fragless has not used: 0 and 0");
          break;
        }
      expect(peak(0, nullptr, &z2) == -1, "a null out-parameter: -1");
      expect(peak(-5, &z1, &z2) == -1 && peak(1000, &z1, &z2) == -1 && reset(-1) == -1 && reset(1000) == -1,
             "a device that is not the interposer's: -1, never a plain 0");
    }
  }
  return failures ? 1 : 0;
}
