// LD_PRELOAD's driver half on the libcuda double, driven as the frameworks drive the driver API:
//  - XLA's and TensorFlow's StreamExecutor: the primary context made current, then cuMemAlloc / cuMemFree per
//    buffer (GpuDriver::DeviceAllocate / DeviceDeallocate);
//  - their cuda_malloc_async allocator (GpuCudaMallocAsyncAllocator): cuDeviceGetDefaultMemPool, the release
//    threshold set, cuMemPoolSetAccess for each peer that can access the device, then cuMemAllocFromPoolAsync
//    and cuMemFreeAsync on its stream; and a pool of its own made with cuMemPoolCreate.
// The entry points are obtained the way the first argument says:
//   direct       the program links the driver (here the double) and calls its exported symbols;
//   dlsym        as XLA's and TensorFlow's stubs: dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL), then dlsym on
//                that handle for each symbol (an exported symbol of the interposer is never reached that way);
//   procaddress  as the CUDA runtime: cuGetProcAddress_v2 from that handle, then every entry point through it
//                (CUDA 12.0 semantics, legacy and per-thread default-stream flags);
//   procaddress1 the same through the CUDA 11 ABI, cuGetProcAddress with CUDA 11.3 semantics.
// Run only under the interposer, FRAGLESS_LIBCUDA naming the double; each check says what it proves; exits
// non-zero on any failure.
#include <dlfcn.h>

#include <cuda.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "../fake_cuda/program.h"

#undef cuGetProcAddress

// The per-thread default-stream entry points (cuda.h declares them only for code built for per-thread streams).
extern "C" CUresult cuMemAllocAsync_ptsz(CUdeviceptr*, size_t, CUstream);
extern "C" CUresult cuMemFreeAsync_ptsz(CUdeviceptr, CUstream);

using namespace fakecuda_program;

namespace {

// The driver API as the program under test sees it.
struct Api {
  CUresult (*init)(unsigned);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*retain)(CUcontext*, CUdevice);
  CUresult (*set_current)(CUcontext);
  CUresult (*stream_create)(CUstream*, unsigned);
  CUresult (*alloc)(CUdeviceptr*, size_t);
  CUresult (*alloc_pitch)(CUdeviceptr*, size_t*, size_t, size_t, unsigned);
  CUresult (*free)(CUdeviceptr);
  CUresult (*alloc_async)(CUdeviceptr*, size_t, CUstream);
  CUresult (*alloc_async_ptsz)(CUdeviceptr*, size_t, CUstream);
  CUresult (*free_async)(CUdeviceptr, CUstream);
  CUresult (*free_async_ptsz)(CUdeviceptr, CUstream);
  CUresult (*alloc_pool)(CUdeviceptr*, size_t, CUmemoryPool, CUstream);
  CUresult (*default_pool)(CUmemoryPool*, CUdevice);
  CUresult (*pool_create)(CUmemoryPool*, const CUmemPoolProps*);
  CUresult (*pool_destroy)(CUmemoryPool);
  CUresult (*pool_set_attribute)(CUmemoryPool, CUmemPool_attribute, void*);
  CUresult (*pool_set_access)(CUmemoryPool, const CUmemAccessDesc*, size_t);
  CUresult (*can_access_peer)(int*, CUdevice, CUdevice);
  CUresult (*mem_get_info)(size_t*, size_t*);
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*pointer_attribute)(void*, CUpointer_attribute, CUdeviceptr);
  CUresult (*pointer_attributes)(unsigned, CUpointer_attribute*, void**, CUdeviceptr);
  CUresult (*begin_capture)(CUstream, CUstreamCaptureMode);
  CUresult (*end_capture)(CUstream, CUgraph*);
};

Api direct() {
  return {&cuInit, &cuDeviceGet, &cuDevicePrimaryCtxRetain, &cuCtxSetCurrent, &cuStreamCreate, &cuMemAlloc_v2,
          &cuMemAllocPitch_v2, &cuMemFree_v2, &cuMemAllocAsync, &cuMemAllocAsync_ptsz, &cuMemFreeAsync,
          &cuMemFreeAsync_ptsz, &cuMemAllocFromPoolAsync, &cuDeviceGetDefaultMemPool, &cuMemPoolCreate,
          &cuMemPoolDestroy, &cuMemPoolSetAttribute, &cuMemPoolSetAccess, &cuDeviceCanAccessPeer, &cuMemGetInfo_v2,
          &cuMemGetAddressRange_v2, &cuPointerGetAttribute, &cuPointerGetAttributes, &cuStreamBeginCapture_v2,
          &cuStreamEndCapture};
}

// As XLA's stub: each symbol by its exported name from an RTLD_LOCAL handle of the driver.
Api by_dlsym(void* lib) {
  Api a{};
  auto get = [&](auto* out, const char* name) { need(out, dlsym(lib, name), name); };
  get(&a.init, "cuInit");
  get(&a.device_get, "cuDeviceGet");
  get(&a.retain, "cuDevicePrimaryCtxRetain");
  get(&a.set_current, "cuCtxSetCurrent");
  get(&a.stream_create, "cuStreamCreate");
  get(&a.alloc, "cuMemAlloc_v2");
  get(&a.alloc_pitch, "cuMemAllocPitch_v2");
  get(&a.free, "cuMemFree_v2");
  get(&a.alloc_async, "cuMemAllocAsync");
  get(&a.alloc_async_ptsz, "cuMemAllocAsync_ptsz");
  get(&a.free_async, "cuMemFreeAsync");
  get(&a.free_async_ptsz, "cuMemFreeAsync_ptsz");
  get(&a.alloc_pool, "cuMemAllocFromPoolAsync");
  get(&a.default_pool, "cuDeviceGetDefaultMemPool");
  get(&a.pool_create, "cuMemPoolCreate");
  get(&a.pool_destroy, "cuMemPoolDestroy");
  get(&a.pool_set_attribute, "cuMemPoolSetAttribute");
  get(&a.pool_set_access, "cuMemPoolSetAccess");
  get(&a.can_access_peer, "cuDeviceCanAccessPeer");
  get(&a.mem_get_info, "cuMemGetInfo_v2");
  get(&a.address_range, "cuMemGetAddressRange_v2");
  get(&a.pointer_attribute, "cuPointerGetAttribute");
  get(&a.pointer_attributes, "cuPointerGetAttributes");
  get(&a.begin_capture, "cuStreamBeginCapture_v2");
  get(&a.end_capture, "cuStreamEndCapture");
  return a;
}

// As the CUDA runtime: every entry point through cuGetProcAddress (the _v2 ABI at CUDA 12.0, or the CUDA 11
// ABI at 11.3), the per-thread forms asked for with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM.
Api by_proc_address(void* lib, bool v1) {
  using V2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
  using V1 = CUresult (*)(const char*, void**, int, cuuint64_t);
  V2 gp2 = nullptr;
  V1 gp1 = nullptr;
  if (v1) need(&gp1, dlsym(lib, "cuGetProcAddress"), "cuGetProcAddress");
  else need(&gp2, dlsym(lib, "cuGetProcAddress_v2"), "cuGetProcAddress_v2");
  const int version = v1 ? 11030 : 12000;
  Api a{};
  auto get = [&](auto* out, const char* name, cuuint64_t flags = CU_GET_PROC_ADDRESS_DEFAULT) {
    void* p = nullptr;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    const CUresult r = v1 ? gp1(name, &p, version, flags) : gp2(name, &p, version, flags, &status);
    if (r != CUDA_SUCCESS || (!v1 && status != CU_GET_PROC_ADDRESS_SUCCESS)) p = nullptr;
    need(out, p, name);
  };
  get(&a.init, "cuInit");
  get(&a.device_get, "cuDeviceGet");
  get(&a.retain, "cuDevicePrimaryCtxRetain");
  get(&a.set_current, "cuCtxSetCurrent");
  get(&a.stream_create, "cuStreamCreate");
  get(&a.alloc, "cuMemAlloc");
  get(&a.alloc_pitch, "cuMemAllocPitch");
  get(&a.free, "cuMemFree");
  get(&a.alloc_async, "cuMemAllocAsync", CU_GET_PROC_ADDRESS_LEGACY_STREAM);
  get(&a.alloc_async_ptsz, "cuMemAllocAsync", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
  get(&a.free_async, "cuMemFreeAsync");
  get(&a.free_async_ptsz, "cuMemFreeAsync", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
  get(&a.alloc_pool, "cuMemAllocFromPoolAsync");
  get(&a.default_pool, "cuDeviceGetDefaultMemPool");
  get(&a.pool_create, "cuMemPoolCreate");
  get(&a.pool_destroy, "cuMemPoolDestroy");
  get(&a.pool_set_attribute, "cuMemPoolSetAttribute");
  get(&a.pool_set_access, "cuMemPoolSetAccess");
  get(&a.can_access_peer, "cuDeviceCanAccessPeer");
  get(&a.mem_get_info, "cuMemGetInfo");
  get(&a.address_range, "cuMemGetAddressRange");
  get(&a.pointer_attribute, "cuPointerGetAttribute");
  get(&a.pointer_attributes, "cuPointerGetAttributes");
  get(&a.begin_capture, "cuStreamBeginCapture");
  get(&a.end_capture, "cuStreamEndCapture");
  return a;
}

constexpr std::size_t MiB = 1u << 20;

void* as_ptr(CUdeviceptr p) { return reinterpret_cast<void*>(p); }

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--help" || mode == "-h") {
    std::printf("usage: LD_PRELOAD=libfragless_preload.so FRAGLESS_LIBCUDA=libfragless_fakecuda.so %s "
                "direct|dlsym|procaddress|procaddress1\n"
                "  LD_PRELOAD's driver half on the libcuda double, the entry points linked, looked up with dlsym\n"
                "  in the driver's handle, or taken through cuGetProcAddress (_v2 or the CUDA 11 ABI); exits\n"
                "  non-zero on any failed check\n",
                argv[0]);
    return 0;
  }
  if (mode != "direct" && mode != "dlsym" && mode != "procaddress" && mode != "procaddress1") {
    std::fprintf(stderr, "usage: %s direct|dlsym|procaddress|procaddress1 (--help)\n", argv[0]);
    return 2;
  }
  const Interposed d;
  void* driver = dlopen(std::getenv("FRAGLESS_LIBCUDA"), RTLD_NOW | RTLD_LOCAL);
  Api a{};
  if (mode == "direct") a = direct();
  else if (mode == "dlsym") a = by_dlsym(driver);
  else if (mode == "procaddress") a = by_proc_address(driver, false);
  else a = by_proc_address(driver, true);
  std::printf("entry points: %s\n", mode.c_str());

  // The program's context, as StreamExecutor's: device 0's primary context, current on this thread.
  CUdevice dev0 = 0, dev1 = 1;
  CUcontext ctx0 = nullptr, ctx1 = nullptr;
  expect(a.init(0) == CUDA_SUCCESS && a.device_get(&dev0, 0) == CUDA_SUCCESS && a.device_get(&dev1, 1) == CUDA_SUCCESS,
         "cuInit, cuDeviceGet");
  expect(a.retain(&ctx0, dev0) == CUDA_SUCCESS && a.retain(&ctx1, dev1) == CUDA_SUCCESS && a.set_current(ctx0) == CUDA_SUCCESS,
         "the primary contexts retained, device 0's current");
  const unsigned long own_calls = d.calls("cuMemAlloc");

  // 1. StreamExecutor: cuMemAlloc and cuMemFree per buffer land in fragless.
  CUdeviceptr bufs[16] = {};
  bool all = true;
  for (int i = 0; i < 16; ++i) all = all && a.alloc(&bufs[i], (1 + i % 5) * MiB + 512) == CUDA_SUCCESS && d.fragless(bufs[i], 0);
  expect(all, "16 cuMemAlloc: each one fragless's, on device 0");
  expect(d.census().own_allocations == 0 && d.calls("cuMemAlloc") == own_calls,
         "the driver made no allocation of its own (" + std::to_string(d.census().own_allocations) + ")");
  expect(d.calls("cuMemCreate") > 0 && d.calls("cuMemMap") > 0, "the driver saw fragless's cuMemCreate and cuMemMap");
  CUstream s = nullptr, t = nullptr;
  expect(a.stream_create(&s, 0) == CUDA_SUCCESS && a.stream_create(&t, 0) == CUDA_SUCCESS, "two streams");
  expect(d.launch(s, as_ptr(bufs[3]), (1 + 3 % 5) * MiB, 10) == 0, "a kernel on a buffer (the memory is the device's)");
  for (CUdeviceptr& b : bufs) expect(a.free(b) == CUDA_SUCCESS, "cuMemFree");
  CUdeviceptr zero = 1;
  expect(a.alloc(&zero, 0) == CUDA_ERROR_INVALID_VALUE, "cuMemAlloc of 0 bytes: the driver's CUDA_ERROR_INVALID_VALUE");

  // 2. cuMemFree keeps cudaFree's promise: memory is not handed out again while work queued before the free
  //    may still touch it (the double faults when work of another stream touches it unordered).
  CUdeviceptr big = 0, again = 0;
  expect(a.alloc(&big, 300 * MiB) == CUDA_SUCCESS && d.fragless(big, 0), "300 MiB");
  expect(d.launch(s, as_ptr(big), 300 * MiB, 5000) == 0, "a long kernel on it");
  expect(a.free(big) == CUDA_SUCCESS, "its cuMemFree while the kernel runs (the fence is due)");
  expect(a.alloc(&again, 300 * MiB) == CUDA_SUCCESS && d.launch(t, as_ptr(again), 300 * MiB, 10) == 0,
         "300 MiB again, used on another stream");
  expect(d.census().faults == 0, std::string("no unordered reuse (") + d.first_fault() + ")");
  expect(a.free(again) == CUDA_SUCCESS, "freed");

  // 3. cuMemAllocPitch: the pitch is the width rounded up to the texture pitch alignment (512 on the double).
  CUdeviceptr pitched = 0;
  size_t pitch = 0;
  expect(a.alloc_pitch(&pitched, &pitch, 1000, 300, 4) == CUDA_SUCCESS && pitch == 1024 && d.fragless(pitched, 0),
         "cuMemAllocPitch(1000 x 300): pitch " + std::to_string(pitch) + ", fragless's");
  expect(d.launch(s, as_ptr(pitched), pitch * 300, 1) == 0, "its pitch x height bytes are usable");
  expect(a.alloc_pitch(&zero, &pitch, 1000, 300, 3) == CUDA_ERROR_INVALID_VALUE, "element size 3: CUDA_ERROR_INVALID_VALUE");

  // 4. Queries answer for fragless memory as for any allocation, from any address inside it.
  CUdeviceptr base = 0;
  size_t size = 0;
  expect(a.address_range(&base, &size, pitched + 5000) == CUDA_SUCCESS && base == pitched && size >= pitch * 300,
         "cuMemGetAddressRange inside the block: its base and size (" + std::to_string(size) + ")");
  int ordinal = -1;
  unsigned type = 0;
  CUcontext ctx = nullptr;
  CUdeviceptr start = 0;
  size_t range = 0;
  expect(a.pointer_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, pitched + 8) == CUDA_SUCCESS && ordinal == 0,
         "cuPointerGetAttribute: device ordinal 0");
  expect(a.pointer_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, pitched) == CUDA_SUCCESS && type == CU_MEMORYTYPE_DEVICE,
         "memory type: device");
  expect(a.pointer_attribute(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, pitched) == CUDA_SUCCESS && ctx == ctx0,
         "context: device 0's primary context");
  CUpointer_attribute attrs[3] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* data[3] = {&start, &range, &ordinal};
  ordinal = -1;
  expect(a.pointer_attributes(3, attrs, data, pitched + 100) == CUDA_SUCCESS && start == pitched && range == size && ordinal == 0,
         "cuPointerGetAttributes: the block's range and device");
  expect(a.free(pitched) == CUDA_SUCCESS, "pitched memory freed");

  // 5. Foreign pointers (memory the driver allocated for another library) go to the driver.
  CUdeviceptr foreign = reinterpret_cast<CUdeviceptr>(d.foreign_alloc(0, 3 * MiB));
  expect(foreign && d.census().own_allocations == 1, "a foreign allocation");
  expect(a.address_range(&base, &size, foreign + 10) == CUDA_SUCCESS && base == foreign && size == 3 * MiB,
         "cuMemGetAddressRange of it: the driver's answer");
  expect(a.pointer_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, foreign) == CUDA_SUCCESS && ordinal == 0,
         "cuPointerGetAttribute of it: the driver's answer");
  expect(a.free(foreign) == CUDA_SUCCESS && d.census().own_allocations == 0, "its cuMemFree reached the driver");

  // 6. cuMemGetInfo counts memory fragless caches but does not use as free.
  size_t free_bytes = 0, total = 0, allocated = 0, reserved = 0;
  const auto c6 = d.census();
  expect(a.mem_get_info(&free_bytes, &total) == CUDA_SUCCESS && d.preload_memory &&
             d.preload_memory(0, &allocated, &reserved) == 0,
         "cuMemGetInfo");
  expect(free_bytes == total - c6.used_bytes + (reserved - allocated),
         "free = the driver's free + fragless's cached bytes (" + std::to_string((reserved - allocated) / MiB) + " MiB)");

  // 7. The async allocator on the default pool: release threshold, peer access, alloc from pool, free async.
  CUmemoryPool pool = nullptr;
  expect(a.default_pool(&pool, dev0) == CUDA_SUCCESS && pool, "cuDeviceGetDefaultMemPool(0)");
  cuuint64_t threshold = 1ull << 30;
  expect(a.pool_set_attribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold) == CUDA_SUCCESS, "release threshold set");
  int can = 0;
  expect(a.can_access_peer(&can, dev1, dev0) == CUDA_SUCCESS, "cuDeviceCanAccessPeer(1, 0)");
  if (can) {
    CUmemAccessDesc desc{};
    desc.location = {CU_MEM_LOCATION_TYPE_DEVICE, 1};
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    expect(a.pool_set_access(pool, &desc, 1) == CUDA_SUCCESS, "device 1 granted access to the pool");
  }
  all = true;
  for (int i = 0; i < 32; ++i) {
    CUdeviceptr p = 0;
    all = all && a.alloc_pool(&p, (i % 7 + 1) * MiB, pool, s) == CUDA_SUCCESS && d.fragless(p, 0) &&
          d.launch(s, as_ptr(p), (i % 7 + 1) * MiB, 50) == 0 && a.free_async(p, s) == CUDA_SUCCESS;
  }
  expect(all, "32 cuMemAllocFromPoolAsync / kernel / cuMemFreeAsync on one stream: fragless's");
  CUdeviceptr other = 0;
  expect(a.alloc_pool(&other, 4 * MiB, pool, t) == CUDA_SUCCESS && d.launch(t, as_ptr(other), 4 * MiB, 1) == 0 &&
             a.free_async(other, t) == CUDA_SUCCESS,
         "an allocation on another stream meanwhile");
  expect(d.census().faults == 0 && d.census().own_allocations == 0,
         std::string("stream-ordered reuse only (") + d.first_fault() + "), no allocation of the driver's own");

  // 8. A pool of its own (cuMemPoolCreate) on device 1, with a stream of device 1.
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location = {CU_MEM_LOCATION_TYPE_DEVICE, 1};
  CUmemoryPool pool1 = nullptr;
  CUstream s1 = nullptr;
  expect(a.pool_create(&pool1, &props) == CUDA_SUCCESS && a.set_current(ctx1) == CUDA_SUCCESS &&
             a.stream_create(&s1, 0) == CUDA_SUCCESS,
         "cuMemPoolCreate on device 1, a stream of device 1");
  CUdeviceptr p1 = 0;
  expect(a.alloc_pool(&p1, 5 * MiB, pool1, s1) == CUDA_SUCCESS && d.fragless(p1, 1), "cuMemAllocFromPoolAsync: fragless's, device 1");
  expect(a.free_async(p1, s1) == CUDA_SUCCESS && a.set_current(ctx0) == CUDA_SUCCESS, "freed");

  //    A pool fragless cannot serve as the driver would (a maximum size) stays the driver's.
  CUmemPoolProps limited = props;
  limited.location.id = 0;
  limited.maxSize = 64 * MiB;
  CUmemoryPool small = nullptr;
  CUdeviceptr q = 0;
  expect(a.pool_create(&small, &limited) == CUDA_SUCCESS && a.alloc_pool(&q, 2 * MiB, small, s) == CUDA_SUCCESS &&
             !d.fragless(q, 0) && d.census().own_allocations == 1,
         "a pool with a maximum size: served by the driver");
  expect(a.free_async(q, s) == CUDA_SUCCESS && d.census().own_allocations == 0 && a.pool_destroy(small) == CUDA_SUCCESS,
         "its cuMemFreeAsync reached the driver");

  // 9. cuMemAllocAsync and per-thread default streams: a block freed on thread A's is not handed to thread B
  //    unordered.
  CUdeviceptr pa = 0;
  std::thread([&] {
    a.set_current(ctx0);
    expect(a.alloc_async_ptsz(&pa, 8 * MiB, nullptr) == CUDA_SUCCESS && d.fragless(pa, 0), "thread A: cuMemAllocAsync_ptsz");
    expect(d.launch(CU_STREAM_PER_THREAD, as_ptr(pa), 8 * MiB, 1000) == 0, "thread A: a kernel on its per-thread stream");
    expect(a.free_async_ptsz(pa, nullptr) == CUDA_SUCCESS, "thread A: cuMemFreeAsync_ptsz");
  }).join();
  std::thread([&] {
    a.set_current(ctx0);
    CUdeviceptr pb = 0;
    expect(a.alloc_async_ptsz(&pb, 8 * MiB, nullptr) == CUDA_SUCCESS && d.fragless(pb, 0), "thread B: cuMemAllocAsync_ptsz");
    expect(d.launch(CU_STREAM_PER_THREAD, as_ptr(pb), 8 * MiB, 10) == 0, "thread B: a kernel on its per-thread stream");
    expect(a.free_async_ptsz(pb, nullptr) == CUDA_SUCCESS, "thread B: freed");
  }).join();
  CUdeviceptr on_s = 0;
  expect(a.alloc_async(&on_s, 6 * MiB, s) == CUDA_SUCCESS && d.fragless(on_s, 0) && a.free_async(on_s, s) == CUDA_SUCCESS,
         "cuMemAllocAsync / cuMemFreeAsync on a stream");
  expect(d.census().faults == 0, std::string("no memory shared between streams unordered (") + d.first_fault() + ")");

  // 10. Capture: allocations on a capturing stream are the graph's (the driver's); the fence does not run
  //     during the capture; the capture stays valid.
  CUstream c = nullptr;
  expect(a.stream_create(&c, 0) == CUDA_SUCCESS && a.begin_capture(c, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS,
         "a global-mode capture on c");
  CUdeviceptr g = 0;
  expect(a.alloc_async(&g, 2 * MiB, c) == CUDA_SUCCESS && !d.fragless(g, 0), "cuMemAllocAsync on c: the graph's, not fragless's");
  expect(a.free_async(g, c) == CUDA_SUCCESS, "its cuMemFreeAsync on c reaches the driver");
  const unsigned long fences = d.fences();
  for (int i = 0; i < 2; ++i) {
    CUdeviceptr x = 0;
    expect(a.alloc(&x, 160 * MiB) == CUDA_SUCCESS && d.fragless(x, 0) && a.free(x) == CUDA_SUCCESS,
           "cuMemAlloc / cuMemFree during the capture (256 MiB pending: the fence is due)");
  }
  expect(d.fences() == fences, "no fence ran during the capture");
  CUgraph graph = nullptr;
  expect(a.end_capture(c, &graph) == CUDA_SUCCESS && graph, "the capture ends valid");
  CUdeviceptr after = 0;
  expect(a.alloc(&after, 900 * MiB) == CUDA_SUCCESS && a.free(after) == CUDA_SUCCESS,
         "900 MiB after the capture (the deferred frees went back)");

  const auto census = d.census();
  expect(census.faults == 0, std::string("the double saw no fault (") + d.first_fault() + ")");
  expect(census.invalidated_captures == 0, "and no invalidated capture");
  expect(census.own_allocations == 0, "no allocation of the driver's own is left");
  expect(d.recursions() == 0, "no call came back into the interposer from inside fragless");
  std::printf("%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
