// A CUDA program in miniature, linked against the runtime double. Run plainly, every call reaches the
// runtime; run with LD_PRELOAD=libfragless_preload.so, every allocation call is fragless's, foreign
// pointers are forwarded, and memory is real. Prints what it saw; exits non-zero on a broken promise.
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
void* fakecudart_foreign_alloc(size_t);
unsigned long fakecudart_calls(const char*);
}

int main() {
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
  return failures ? 1 : 0;
}
