// The CUDA path of LD_PRELOAD on the libcuda double, as a CUDA program drives it through the runtime
// double (fake_cudart.cpp, which goes to the libcuda double for contexts, streams, captures and device
// synchronisation). Run only under the interposer, with FRAGLESS_LIBCUDA naming the double; each check
// says what it proves; exits non-zero on any failure.
#include <cuda.h>  // the pool properties and attributes (the runtime's are the driver's)
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <chrono>
#include <thread>

#include "../fake_cuda/program.h"

extern "C" {
typedef int cudaError_t;
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
cudaError_t cudaMalloc(void**, size_t);
cudaError_t cudaFree(void*);
cudaError_t cudaMallocAsync(void**, size_t, cudaStream_t);
cudaError_t cudaFreeAsync(void*, cudaStream_t);
cudaError_t cudaMallocAsync_ptsz(void**, size_t, cudaStream_t);
cudaError_t cudaFreeAsync_ptsz(void*, cudaStream_t);
cudaError_t cudaSetDevice(int);
cudaError_t cudaStreamCreate(cudaStream_t*);
cudaError_t cudaStreamDestroy(cudaStream_t);
cudaError_t cudaPeekAtLastError();
cudaError_t cudaStreamBeginCapture(cudaStream_t, int);
cudaError_t cudaStreamEndCapture(cudaStream_t, void**);
cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t, int);
cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t, void**);
cudaError_t cudaStreamBeginCaptureToGraph(cudaStream_t, void*, const void*, const void*, size_t, int);
cudaError_t cudaStreamBeginCaptureToGraph_ptsz(cudaStream_t, void*, const void*, const void*, size_t, int);
void fakecudart_on_capture_begun(void (*)());
cudaError_t cudaMemGetInfo(size_t*, size_t*);
cudaError_t cudaMallocPitch(void**, size_t*, size_t, size_t);
struct PointerAttributes {  // cudaPointerAttributes
  int type;
  int device;
  void* device_pointer;
  void* host_pointer;
};
cudaError_t cudaPointerGetAttributes(PointerAttributes*, const void*);
void* fakecudart_foreign_alloc(size_t);
unsigned long fakecudart_calls(const char*);
typedef void* cudaMemPool_t;
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t*, int);
cudaError_t cudaDeviceSetMemPool(int, cudaMemPool_t);
cudaError_t cudaDeviceGetMemPool(cudaMemPool_t*, int);
cudaError_t cudaMemPoolCreate(cudaMemPool_t*, const CUmemPoolProps*);
cudaError_t cudaMemPoolDestroy(cudaMemPool_t);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t, int, void*);
}

using namespace fakecuda_program;

namespace {

constexpr std::size_t MiB = 1u << 20;
constexpr int kCaptureGlobal = 0;  // cudaStreamCaptureModeGlobal
void* const kPerThread = reinterpret_cast<void*>(std::uintptr_t{0x2});  // CU_STREAM_PER_THREAD

// Run by the runtime double once a capture has begun, before the runtime's begin returns: 320 MiB freed, so
// that the fence of deferred frees is due. The fence may run only if fragless was not told of the capture.
void free_while_the_capture_begins() {
  for (int i = 0; i < 2; ++i) {
    void* x = nullptr;
    expect(cudaMalloc(&x, 160 * MiB) == 0 && x, "an allocation as the capture begins");
    expect(cudaFree(x) == 0, "its cudaFree (the fence is due)");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf("usage: LD_PRELOAD=libfragless_preload.so FRAGLESS_LIBCUDA=libfragless_fakecuda.so %s\n"
                "  the CUDA path of LD_PRELOAD through the runtime double on the libcuda double; exits\n"
                "  non-zero on any failed check\n", argv[0]);
    return 0;
  }
  if (argc != 1) return std::fprintf(stderr, "usage: %s (takes no arguments; --help)\n", argv[0]), 2;
  const Interposed d;
  // 1. A pointer's owner is looked up among the engines that exist: a free of memory fragless never saw
  //    creates no engine and no context.
  expect(cudaFree(fakecudart_foreign_alloc(4096)) == 0, "a foreign pointer's free, the process's first call");
  expect(d.census().context_retains == 0, "retained no context (owner lookups create no engine)");

  // 2. No context on device 0 before the program uses it: a program that only uses device 1.
  expect(cudaSetDevice(1) == 0, "cudaSetDevice(1)");
  void* on1 = nullptr;
  expect(cudaMalloc(&on1, MiB) == 0 && on1 && d.device_of(on1) == 1, "cudaMalloc on device 1");
  expect(!d.active(0), "device 0's primary context is not active (nothing created at start-up)");

  //    And a device whose engine cannot be created does not crash a free.
  d.fail("cuDevicePrimaryCtxRetain", 1, 2);  // the next retain fails (CUDA_ERROR_OUT_OF_MEMORY)
  expect(cudaFree(fakecudart_foreign_alloc(4096)) == 0, "a foreign free while device 0's engine cannot be made");
  d.fail("cuDevicePrimaryCtxRetain", 0, 0);

  //    A thread whose first CUDA call is a cudaMalloc fragless serves finds the device's primary context current
  //    afterwards, as the runtime makes it ("made current to the calling thread"), for the driver API calls
  //    that follow.
  std::thread([&] {
    using GetCurrent = int (*)(void**);
    const auto get_current = reinterpret_cast<GetCurrent>(dlsym(d.lib, "cuCtxGetCurrent"));
    void* before = reinterpret_cast<void*>(1);
    void* after = nullptr;
    void* first = nullptr;
    expect(get_current && get_current(&before) == 0 && before == nullptr, "a new thread: no current context");
    expect(cudaMalloc(&first, MiB) == 0 && d.device_of(first) == 0, "its first call, cudaMalloc: fragless's");
    expect(get_current && get_current(&after) == 0 && after != nullptr, "and a context is current after it");
    expect(cudaFree(first) == 0, "freed");
  }).join();

  // 3. cudaMallocAsync allocates on the stream's device, with or without cudaStreamGetDevice (12.8+).
  cudaStream_t s1 = nullptr;
  expect(cudaStreamCreate(&s1) == 0 && s1, "a stream on device 1");
  expect(cudaSetDevice(0) == 0, "cudaSetDevice(0)");
  void* a1 = nullptr;
  expect(cudaMallocAsync(&a1, MiB, s1) == 0 && a1 && d.device_of(a1) == 1,
         std::string("cudaMallocAsync on a device-1 stream from device 0 allocates on device 1 (") +
             (dlsym(RTLD_DEFAULT, "cudaStreamGetDevice") ? "cudaStreamGetDevice" : "no cudaStreamGetDevice: the stream's context") +
             ")");
  expect(cudaFreeAsync(a1, s1) == 0 && cudaFree(on1) == 0, "frees on device 1");

  // 4. The fence of deferred frees never runs during a capture (it would invalidate it), and the engine
  //    records no event into a capture: a capture on stream c while fragless's slow paths run.
  cudaStream_t a = nullptr, c = nullptr;
  expect(cudaStreamCreate(&a) == 0 && cudaStreamCreate(&c) == 0, "two streams on device 0");
  for (int i = 0; i < 8; ++i) {  // holes on c, whose memory fragless may want to take for a
    void* x = nullptr;
    expect(cudaMallocAsync(&x, 3 * MiB, c) == 0 && x, "an allocation on c");
    d.launch(c, x, 3 * MiB, 100);
    expect(cudaFreeAsync(x, c) == 0, "its free on c");
  }
  void* before_capture = nullptr;
  expect(cudaMalloc(&before_capture, 2 * MiB) == 0 && d.device_of(before_capture) == 0, "a fragless block before the capture");
  expect(cudaStreamBeginCapture(c, kCaptureGlobal) == 0, "a global-mode capture begins on c");
  //    During a capture cudaFreeAsync "must be passed the address of a graph allocation": fragless's is none.
  expect(cudaFreeAsync(before_capture, c) == 1, "cudaFreeAsync on c of the fragless block: cudaErrorInvalidValue");
  void* big = nullptr;
  expect(cudaMallocAsync(&big, 20 * MiB, a) == 0 && big, "a growth on a during the capture");
  const unsigned long fences = d.fences();
  for (int i = 0; i < 2; ++i) {
    void* x = nullptr;
    expect(cudaMalloc(&x, 160 * MiB) == 0 && x, "an allocation during the capture");
    expect(cudaFree(x) == 0, "a cudaFree during the capture (256 MiB pending: the fence is due)");
  }
  expect(d.fences() == fences, "no fence ran during the capture");
  void* graph = nullptr;
  expect(cudaStreamEndCapture(c, &graph) == 0 && graph, "the capture ends valid");
  expect(d.census().invalidated_captures == 0, std::string("no capture was invalidated (") + d.first_fault() + ")");
  expect(cudaFreeAsync(big, a) == 0, "free on a");
  expect(cudaFreeAsync(before_capture, a) == 0, "the block refused during the capture was still live: freed on a");

  //    Every form of the begin tells fragless before the runtime begins the capture (Note [Quiet before a
  //    capture]), the ToGraph forms (CUDA 12.3) too: work fragless does while the runtime's begin has not yet
  //    returned (here a cudaFree with the fence due) runs no fence inside the capture.
  struct Begin {
    const char* name;
    bool ptsz;
    cudaError_t (*begin)(cudaStream_t);
  };
  const Begin begins[] = {
      {"cudaStreamBeginCapture", false, [](cudaStream_t s) { return cudaStreamBeginCapture(s, kCaptureGlobal); }},
      {"cudaStreamBeginCapture_ptsz", true, [](cudaStream_t s) { return cudaStreamBeginCapture_ptsz(s, kCaptureGlobal); }},
      {"cudaStreamBeginCaptureToGraph", false,
       [](cudaStream_t s) { return cudaStreamBeginCaptureToGraph(s, nullptr, nullptr, nullptr, 0, kCaptureGlobal); }},
      {"cudaStreamBeginCaptureToGraph_ptsz", true,
       [](cudaStream_t s) { return cudaStreamBeginCaptureToGraph_ptsz(s, nullptr, nullptr, nullptr, 0, kCaptureGlobal); }},
  };
  fakecudart_on_capture_begun(&free_while_the_capture_begins);
  for (const Begin& b : begins) {
    const unsigned long before = d.fences(), syncs = fakecudart_calls("cudaDeviceSynchronize");
    expect(b.begin(c) == 0, std::string(b.name) + ": a global-mode capture begins on c");
    expect(d.fences() == before && fakecudart_calls("cudaDeviceSynchronize") == syncs,
           std::string(b.name) + ": no fence was tried while the capture began");
    void* g = nullptr;
    expect((b.ptsz ? cudaStreamEndCapture_ptsz(c, &g) : cudaStreamEndCapture(c, &g)) == 0 && g,
           std::string(b.name) + ": the capture ends valid");
    expect(d.census().invalidated_captures == 0, std::string(b.name) + ": no capture was invalidated (" +
                                                     d.first_fault() + ")");
    void* settle = nullptr;  // the frees deferred during the capture go back at the next fence
    expect(cudaMalloc(&settle, MiB) == 0 && cudaFree(settle) == 0 && d.fences() > before,
           std::string(b.name) + ": the next cudaFree after the capture runs the fence");
  }
  fakecudart_on_capture_begun(nullptr);

  // 5. A fence that fails keeps the frees deferred: their memory is not handed out again.
  void* y = nullptr;
  expect(cudaMalloc(&y, 300 * MiB) == 0 && y, "300 MiB on device 0");
  d.launch(a, y, 300 * MiB, 1000);  // still in use on the device
  d.fail("cuCtxSynchronize", 1, 999);
  expect(cudaFree(y) == 0, "its cudaFree (the fence is due, and fails)");
  expect(d.allocated(0) >= 300 * MiB, "the block stays allocated behind the failed fence");
  d.fail("cuCtxSynchronize", 0, 0);
  void* z = nullptr;
  expect(cudaMalloc(&z, 300 * MiB) == 0 && z && z != y, "a new allocation does not get the unfenced memory");
  d.launch(a, z, 300 * MiB, 10);
  expect(cudaFree(z) == 0, "and its free fences both");
  expect(d.allocated(0) == 0, "after a fence that worked, both went back");
  //    A pointer cudaFree'd already is refused by a second cudaFree and by cudaFreeAsync ("If cudaFree(devPtr)
  //    has already been called before, an error is returned": cudaErrorInvalidValue), while it waits behind
  //    the fence, and the fence frees it once.
  //    The fence is due at 256 MiB of blocks pending, counted by the blocks' own sizes (not their segments'):
  //    here 8 MiB, in a segment of 300 MiB or more, and then 200 small blocks in a few segments.
  void* twice = nullptr;
  const unsigned long fences_before = d.fences();
  expect(cudaMalloc(&twice, 8 * MiB) == 0 && twice && cudaFree(twice) == 0, "8 MiB, freed (behind the fence)");
  expect(d.fences() == fences_before, "no fence: 8 MiB pending");
  if (d.fences() == fences_before) {  // else the fence freed it at once, and the runtime answers for the pointer
    expect(cudaFree(twice) == 1, "a second cudaFree of it: cudaErrorInvalidValue");
    expect(cudaFreeAsync(twice, a) == 1, "a cudaFreeAsync of it: cudaErrorInvalidValue");
    void* fresh = nullptr;
    expect(cudaMalloc(&fresh, 8 * MiB) == 0 && fresh != twice, "8 MiB again: not the block behind the fence");
    expect(cudaFree(fresh) == 0, "freed");
  }
  void* small[200] = {};
  bool small_ok = true;
  for (void*& q : small) small_ok = small_ok && cudaMalloc(&q, 64 << 10) == 0 && q;
  for (void* q : small) small_ok = small_ok && cudaFree(q) == 0;
  expect(small_ok && d.fences() == fences_before,
         "200 blocks of 64 KiB freed: no fence (" + std::to_string(d.fences() - fences_before) + " ran)");

  // 6. Per-thread default streams are a different stream on each thread: a block freed on thread A's is
  //    not handed to thread B without ordering.
  void* pa = nullptr;
  std::thread([&] {
    cudaSetDevice(0);
    expect(cudaMallocAsync_ptsz(&pa, 8 * MiB, nullptr) == 0 && pa, "thread A: cudaMallocAsync_ptsz on stream 0");
    expect(d.launch(kPerThread, pa, 8 * MiB, 1000) == 0, "thread A: a kernel on its per-thread stream");
    expect(cudaFreeAsync_ptsz(pa, nullptr) == 0, "thread A: cudaFreeAsync_ptsz");
  }).join();
  std::thread([&] {
    cudaSetDevice(0);
    void* pb = nullptr;
    expect(cudaMallocAsync_ptsz(&pb, 8 * MiB, nullptr) == 0 && pb, "thread B: cudaMallocAsync_ptsz on stream 0");
    expect(d.launch(kPerThread, pb, 8 * MiB, 10) == 0, "thread B: a kernel on its per-thread stream");
    expect(cudaFreeAsync_ptsz(pb, nullptr) == 0, "thread B: cudaFreeAsync_ptsz");
    std::printf("thread A's block %p, thread B's block %p\n", pa, pb);
  }).join();
  expect(d.census().faults == 0, std::string("no memory shared between the threads' streams unordered (") +
                                     d.first_fault() + ")");

  // 7. cudaStreamDestroy retires the stream without waiting for its work (Note [Destroyed streams]): an
  //    event recorded on it stands in for it, later releases wait for that event and never name the
  //    destroyed handle, and a new stream that gets the same handle value is a new stream.
  cudaStream_t t = nullptr;
  expect(cudaStreamCreate(&t) == 0, "a stream t");
  void* w = nullptr;
  expect(cudaMallocAsync(&w, 64 * MiB, t) == 0 && w, "64 MiB on t");
  d.launch(t, w, 64 * MiB, 5000);
  expect(cudaFreeAsync(w, t) == 0, "freed on t while its kernel runs");
  //    The runtime's cudaStreamDestroy goes on to the driver's cuStreamDestroy, which the interposer retires
  //    too: the second retirement of the same stream is a no-op (one event, not two).
  const unsigned long syncs = d.calls("cuStreamSynchronize") + d.calls("cuEventSynchronize") + d.calls("cuCtxSynchronize");
  expect(cudaStreamDestroy(t) == 0, "t destroyed");
  expect(d.calls("cuStreamSynchronize") + d.calls("cuEventSynchronize") + d.calls("cuCtxSynchronize") == syncs,
         "the destroy waited for nothing, though both cudaStreamDestroy and cuStreamDestroy retire t (" +
             std::to_string(d.calls("cuStreamSynchronize") + d.calls("cuEventSynchronize") + d.calls("cuCtxSynchronize") - syncs) +
             " waits)");
  //    The double gives the value to the next stream at once, t's kernel still queued (RMM's issue 649 saw
  //    CUDA do so): the new stream's kernel faults on t's memory unless fragless orders it after t's work.
  cudaStream_t t2 = nullptr;
  d.reuse_streams_at_once(1);
  expect(cudaStreamCreate(&t2) == 0 && t2 == t, "a new stream, with t's handle value");
  d.reuse_streams_at_once(0);
  void* huge = nullptr;  // more than the device has free unless t's cached memory goes back
  expect(cudaMallocAsync(&huge, 900 * MiB, t2) == 0 && huge, "a large allocation on the new stream succeeds");
  expect(d.launch(t2, huge, 900 * MiB, 10) == 0, "a kernel on it");
  expect(cudaFreeAsync(huge, t2) == 0, "its free");
  expect(d.census().faults == 0, std::string("the new stream's kernel came after t's (") + d.first_fault() + ")");
  expect(cudaStreamDestroy(t2) == 0 && cudaStreamDestroy(a) == 0 && cudaStreamDestroy(c) == 0 &&
             cudaStreamDestroy(s1) == 0,
         "streams destroyed");

  // 8. What the runtime does through the driver (it takes its driver entry points through cuGetProcAddress,
  //    which hands out the interposer's): cudaMallocPitch is the driver's cuMemAllocPitch, so fragless's;
  //    cudaPointerGetAttributes answers for it; cudaMemGetInfo counts fragless's cached memory once, though
  //    both the runtime call and the driver call it makes are interposed.
  expect(cudaSetDevice(1) == 0, "cudaSetDevice(1)");
  void* pitched = nullptr;
  size_t pitch = 0;
  const bool pitched_ok = cudaMallocPitch(&pitched, &pitch, 1000, 64) == 0;
  expect(pitched_ok && pitched && d.device_of(pitched) == 1 && pitch >= 1000,
         "cudaMallocPitch through the driver: fragless's, on device 1 (pitch " + std::to_string(pitch) + ")");
  PointerAttributes pa_attr{};
  expect(cudaPointerGetAttributes(&pa_attr, static_cast<char*>(pitched) + 64) == 0 && pa_attr.type == 2 &&
             pa_attr.device == 1 && pa_attr.device_pointer == static_cast<char*>(pitched) + 64,
         "cudaPointerGetAttributes: device memory of device 1");
  expect(cudaFree(pitched) == 0, "cudaFree of the pitched block");
  void* cached = nullptr;
  expect(cudaMallocAsync(&cached, 40 * MiB, nullptr) == 0 && cudaFreeAsync(cached, nullptr) == 0, "40 MiB cached on device 1");
  // fragless's background worker may split device 1's free handles meanwhile (a release, then creates: the
  // driver's free memory moves for a moment while fragless's books do not), so the readings are taken again
  // until one set agrees with itself; a sum that is wrong every time (the cached bytes counted twice, or not
  // at all) fails.
  size_t free_b = 0, total_b = 0, al = 0, re = 0, driver_free = 0;
  bool read_ok = d.preload_memory != nullptr, agrees = false;
  for (int attempt = 0; read_ok && !agrees && attempt < 200; ++attempt) {
    if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    size_t al0 = 0, re0 = 0;
    const size_t driver_free0 = d.free_bytes(1);
    read_ok = d.preload_memory(1, &al0, &re0) == 0 && cudaMemGetInfo(&free_b, &total_b) == 0 &&
              d.preload_memory(1, &al, &re) == 0;
    driver_free = d.free_bytes(1);
    agrees = al == al0 && re == re0 && driver_free == driver_free0 && free_b == driver_free + (re - al);
  }
  expect(read_ok, "cudaMemGetInfo");
  expect(agrees, "free = the driver's free + fragless's cached bytes, counted once (" + std::to_string(free_b / MiB) +
                     " MiB, the driver's " + std::to_string(driver_free / MiB) + " MiB, cached " +
                     std::to_string((re - al) / MiB) + " MiB)");
  // Every reading agrees with that one while the background worker splits what a new free gave it (a release,
  // then creates, each slowed to 2 ms here so that the readings fall inside): the interposer reads the driver
  // and fragless's books at one moment (Note [Free memory at one moment]), and nothing allocated in between.
  // Both halves: the runtime's call and the driver's.
  const size_t settled = free_b;
  using MemGetInfo = CUresult (*)(size_t*, size_t*);
  const auto cu_mem_get_info = reinterpret_cast<MemGetInfo>(dlsym(RTLD_DEFAULT, "cuMemGetInfo_v2"));  // the interposer's
  expect(cu_mem_get_info != nullptr, "cuMemGetInfo_v2 is found");
  const unsigned long creates_before = d.calls("cuMemCreate");
  expect(cudaMallocAsync(&cached, 60 * MiB, nullptr) == 0, "60 MiB more");
  d.set_delay("cuMemCreate", 2000);
  expect(cudaFreeAsync(cached, nullptr) == 0, "the 60 MiB freed: cached");
  int readings = 0, differ = 0;
  size_t odd = settled;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(150);
  while (std::chrono::steady_clock::now() < until) {
    size_t f = 0, t = 0;
    const bool ok = (readings++ % 2 && cu_mem_get_info ? cu_mem_get_info(&f, &t) : cudaMemGetInfo(&f, &t)) == 0;
    if (!ok || f != settled) ++differ, odd = f;
  }
  d.set_delay("cuMemCreate", 0);
  const unsigned long creates_after = d.calls("cuMemCreate");
  std::printf("while the worker split: %d readings, %lu creates\n", readings, creates_after - creates_before);
  expect(differ == 0, std::to_string(differ) + " of " + std::to_string(readings) +
                          " readings while the worker split differ from the settled " + std::to_string(settled) +
                          " bytes free (one: " + std::to_string(odd) + ")");
  expect(cudaSetDevice(0) == 0, "cudaSetDevice(0)");

  // 9. cudaMallocAsync allocates from the device's current pool (cudaDeviceSetMemPool), as cuMemAllocAsync
  //    does (driver.h R24; the driver half's code): fragless's while fragless can serve that pool, counted in
  //    the pool's statistics (cudaMemPoolGetAttribute, which the runtime takes from the driver); the
  //    runtime's when the pool has a maximum size.
  cudaStream_t q = nullptr;
  expect(cudaStreamCreate(&q) == 0, "a stream on device 0");
  auto used = [](cudaMemPool_t pool) {
    cuuint64_t v = ~0ull;
    return cudaMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &v) == 0 ? v : ~0ull;
  };
  cudaMemPool_t def = nullptr, plain = nullptr, lim = nullptr, current = nullptr;
  expect(cudaDeviceGetDefaultMemPool(&def, 0) == 0 && def, "cudaDeviceGetDefaultMemPool(0)");
  const cuuint64_t used0 = used(def);
  void* x = nullptr;
  expect(cudaMallocAsync(&x, 3 * MiB, q) == 0 && d.device_of(x) == 0, "cudaMallocAsync on the default pool: fragless's");
  expect(used(def) == used0 + 3 * MiB,
         "the default pool counts its 3 MiB (" + std::to_string(used(def)) + " bytes, " + std::to_string(used0) + " before)");
  expect(cudaFreeAsync(x, q) == 0 && used(def) == used0, "freed: counted no more");
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
  CUmemPoolProps limited = props;
  limited.maxSize = 64 * MiB;
  expect(cudaMemPoolCreate(&plain, &props) == 0 && cudaMemPoolCreate(&lim, &limited) == 0,
         "two pools on device 0: one plain, one with a maximum size");
  const unsigned long runtime_allocs = fakecudart_calls("cudaMallocAsync");
  expect(cudaDeviceSetMemPool(0, lim) == 0 && cudaDeviceGetMemPool(&current, 0) == 0 && current == lim,
         "cudaDeviceSetMemPool(0, the limited pool)");
  // (Two calls reach the runtime when the first ran out of memory for fragless's cache and was tried again:
  // Note [Forwarded allocations out of memory].)
  expect(cudaMallocAsync(&x, 2 * MiB, q) == 0 && d.device_of(x) < 0 && fakecudart_calls("cudaMallocAsync") > runtime_allocs,
         "cudaMallocAsync: the runtime's (fragless cannot serve a pool with a maximum size)");
  expect(cudaFreeAsync(x, q) == 0, "its free reached the runtime");
  expect(cudaMallocAsync_ptsz(&x, 2 * MiB, q) == 0 && d.device_of(x) < 0 && cudaFreeAsync_ptsz(x, q) == 0,
         "cudaMallocAsync_ptsz too: the runtime's, freed there");
  //    Note [Forwarded allocations out of memory]: with fragless's cache filling the device, the runtime's
  //    allocation succeeds once fragless has given that cache back.
  {
    // Allocations of what the driver has left, less 24 MiB, held until the driver has less than 40 MiB: one
    // may create less than it asks (fragless's cache serves part of it), so it may take more than one. The
    // driver's free memory is read with no split in flight (a split releases its handle before it creates the
    // pieces).
    std::vector<void*> bigs;
    for (int i = 0; i < 8 && d.drain(0) == 0 && d.free_bytes(0) >= 40 * MiB; ++i) {
      void* big = nullptr;
      expect(cudaMalloc(&big, d.free_bytes(0) - 24 * MiB) == 0 && d.device_of(big) == 0, "fragless's cache fills device 0");
      bigs.push_back(big);
    }
    for (void* big : bigs) expect(cudaFree(big) == 0, "freed to fragless's cache");
    expect(d.drain(0) == 0, "fragless_preload_drain(0)");
    size_t fa = 0, fr = 0;
    const std::size_t room = d.free_bytes(0);
    const bool read = d.preload_memory(0, &fa, &fr) == 0;
    expect(read && fr - fa >= 48 * MiB && room < 48 * MiB,
           "fragless holds " + std::to_string((fr - fa) >> 20) + " MiB cached or behind its fence, the driver " +
               std::to_string(room >> 20) + " MiB free");
    expect(cudaMallocAsync(&x, 48 * MiB, q) == 0 && d.device_of(x) < 0,
           "48 MiB from the limited pool: the runtime's, once fragless gave its cache back");
    expect(cudaPeekAtLastError() == 0, "the first try's error taken back: the program's next check sees none");
    expect(d.preload_memory(0, &fa, &fr) == 0 && fr - fa < 48 * MiB, "fragless's cache went back");
    expect(cudaFreeAsync(x, q) == 0, "freed to the runtime");
  }
  // The runtime implements cudaMallocAsync with cuMemAllocAsync (the runtime double too), so what the runtime
  // half forwarded came back through the driver half: forwarded on to the driver, and not a recursion (Note [No
  // recursion]).
  if (d.driver_counters) {
    unsigned long dc[3] = {};
    d.driver_counters(dc);
    expect(dc[2] == 0, "no call counted as a recursion (" + std::to_string(dc[2]) + ")");
  }
  expect(cudaDeviceSetMemPool(0, plain) == 0 && cudaMallocAsync(&x, 6 * MiB, q) == 0 && d.device_of(x) == 0 &&
             used(plain) == 6 * MiB && used(def) == used0,
         "the plain pool current: cudaMallocAsync fragless's, counted there, not in the default pool");
  expect(cudaFreeAsync(x, q) == 0 && used(plain) == 0, "freed: the plain pool counts 0");
  expect(cudaDeviceSetMemPool(0, def) == 0 && cudaMemPoolDestroy(plain) == 0 && cudaMemPoolDestroy(lim) == 0 &&
             cudaStreamDestroy(q) == 0,
         "the default pool current again, the pools and the stream destroyed");

  const auto census = d.census();
  expect(census.faults == 0, std::string("the double saw no fault (") + d.first_fault() + ")");
  expect(census.invalidated_captures == 0, "and no invalidated capture");
  // The runtime double holds devices 0 and 1 (used by the program); fragless one engine each, no other.
  expect(census.context_retains == 4, "context retains: the runtime's two and fragless's two (" +
                                          std::to_string(census.context_retains) + ")");

  // 10. A device whose engine cannot be made (its context retain fails for fragless; the double holds a third
  //     device for this, FAKECUDA_DEVICES=3): cudaMalloc there is the runtime's, which CUDA's runtime (and the
  //     runtime double) implements with cuMemAlloc, so the call comes back through the driver half; it is
  //     forwarded to the driver, not served and not counted as a recursion (Note [No recursion]); the pointer
  //     is the driver's, and its cudaFree reaches the runtime and the driver.
  expect(cudaSetDevice(2) == 0, "cudaSetDevice(2): the runtime retains device 2's primary context");
  unsigned long rc0[5] = {}, dc0[3] = {};
  d.counters(rc0);
  if (d.driver_counters) d.driver_counters(dc0);
  const long own0 = d.census().own_allocations;
  const unsigned long rt_mallocs = fakecudart_calls("cudaMalloc"), rt_frees = fakecudart_calls("cudaFree");
  const unsigned long drv_allocs = d.calls("cuMemAlloc"), drv_frees = d.calls("cuMemFree");
  expect(d.driver_counters != nullptr, "the interposer has its driver half's counters");
  using HandedOn = unsigned long (*)();
  const auto handed_on = reinterpret_cast<HandedOn>(dlsym(RTLD_DEFAULT, "fragless_preload_handed_on"));
  expect(handed_on != nullptr, "the interposer exports fragless_preload_handed_on");
  const unsigned long handed0 = handed_on ? handed_on() : 0;
  d.fail("cuDevicePrimaryCtxRetain", 1, 2);  // fragless's retain for device 2 fails (CUDA_ERROR_OUT_OF_MEMORY)
  void* forwarded = nullptr;
  expect(cudaMalloc(&forwarded, 3 * MiB) == 0 && forwarded, "cudaMalloc on device 2, whose engine cannot be made");
  d.fail("cuDevicePrimaryCtxRetain", 0, 0);
  expect(d.device_of(forwarded) < 0, "the pointer is not fragless's");
  expect(fakecudart_calls("cudaMalloc") == rt_mallocs + 1 && d.calls("cuMemAlloc") == drv_allocs + 1 &&
             d.census().own_allocations == own0 + 1,
         "the runtime's cudaMalloc made it, with the driver's cuMemAlloc (one each)");
  unsigned long rc1[5] = {}, dc1[3] = {};
  d.counters(rc1);
  if (d.driver_counters) d.driver_counters(dc1);
  expect(rc1[4] == rc0[4] + 1 && rc1[0] == rc0[0], "counted as a fallback, not as an allocation fragless served");
  expect(dc1[0] == dc0[0] && dc1[2] == dc0[2],
         "the driver half served nothing and counted no recursion (" + std::to_string(dc1[2] - dc0[2]) + ")");
  expect(handed_on && handed_on() == handed0 + 1,
         "the runtime's cuMemAlloc came back through the driver half once, and was handed on to the driver");
  expect(cudaFree(forwarded) == 0 && fakecudart_calls("cudaFree") == rt_frees + 1 &&
             d.calls("cuMemFree") == drv_frees + 1 && d.census().own_allocations == own0,
         "its cudaFree went to the runtime and the driver's cuMemFree");
  d.counters(rc1);
  expect(rc1[2] == rc0[2] + 1, "counted as a forwarded free");
  if (d.driver_counters) d.driver_counters(dc1);
  expect(dc1[2] == dc0[2], "and still no recursion");
  void* again = nullptr;
  expect(cudaMalloc(&again, MiB) == 0 && d.device_of(again) < 0 && cudaFree(again) == 0,
         "device 2 stays the runtime's (its engine's failure is kept, not retried on every call)");
  const auto after = d.census();
  expect(after.faults == 0 && after.own_allocations == own0, "no fault, and nothing of the driver's left live");
  std::printf("%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
