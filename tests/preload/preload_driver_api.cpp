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

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../fake_cuda/program.h"

#undef cuGetProcAddress
#undef cuStreamDestroy

// The ABI before CUDA 4.0, which libcuda still exports (cuda.h declares it under __CUDA_API_VERSION_INTERNAL).
extern "C" CUresult cuStreamDestroy(CUstream);

#if CUDA_VERSION < 12030  // cuda.h before 12.3 declares neither (the double defines the entry point all the same)
typedef void CUgraphEdgeData;
extern "C" CUresult cuStreamBeginCaptureToGraph(CUstream, CUgraph, const CUgraphNode*, const CUgraphEdgeData*, size_t,
                                                CUstreamCaptureMode);
#endif

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
  CUresult (*stream_destroy)(CUstream);
  CUresult (*stream_destroy_v1)(CUstream);  // the ABI before CUDA 4.0
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
  CUresult (*pool_get_attribute)(CUmemoryPool, CUmemPool_attribute, void*);
  CUresult (*device_get_pool)(CUmemoryPool*, CUdevice);
  CUresult (*device_set_pool)(CUdevice, CUmemoryPool);
  CUresult (*mem_get_pool)(CUmemoryPool*, CUmemLocation*, CUmemAllocationType);  // CUDA 13
  CUresult (*mem_set_pool)(CUmemLocation*, CUmemAllocationType, CUmemoryPool);  // CUDA 13
  CUresult (*pool_set_access)(CUmemoryPool, const CUmemAccessDesc*, size_t);
  CUresult (*can_access_peer)(int*, CUdevice, CUdevice);
  CUresult (*mem_get_info)(size_t*, size_t*);
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*pointer_attribute)(void*, CUpointer_attribute, CUdeviceptr);
  CUresult (*pointer_attributes)(unsigned, CUpointer_attribute*, void**, CUdeviceptr);
  CUresult (*begin_capture)(CUstream, CUstreamCaptureMode);
  CUresult (*begin_capture_to_graph)(CUstream, CUgraph, const CUgraphNode*, const CUgraphEdgeData*, size_t,
                                     CUstreamCaptureMode);  // CUDA 12.3, as XLA calls it
  CUresult (*end_capture)(CUstream, CUgraph*);
};

Api direct() {
  return {&cuInit, &cuDeviceGet, &cuDevicePrimaryCtxRetain, &cuCtxSetCurrent, &cuStreamCreate, &cuStreamDestroy_v2, &cuStreamDestroy, &cuMemAlloc_v2,
          &cuMemAllocPitch_v2, &cuMemFree_v2, &cuMemAllocAsync, &cuMemAllocAsync_ptsz, &cuMemFreeAsync,
          &cuMemFreeAsync_ptsz, &cuMemAllocFromPoolAsync, &cuDeviceGetDefaultMemPool, &cuMemPoolCreate,
          &cuMemPoolDestroy, &cuMemPoolSetAttribute, &cuMemPoolGetAttribute, &cuDeviceGetMemPool, &cuDeviceSetMemPool,
          &cuMemGetMemPool, &cuMemSetMemPool, &cuMemPoolSetAccess, &cuDeviceCanAccessPeer, &cuMemGetInfo_v2,
          &cuMemGetAddressRange_v2, &cuPointerGetAttribute, &cuPointerGetAttributes, &cuStreamBeginCapture_v2,
          &cuStreamBeginCaptureToGraph, &cuStreamEndCapture};
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
  get(&a.stream_destroy, "cuStreamDestroy_v2");
  get(&a.stream_destroy_v1, "cuStreamDestroy");
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
  get(&a.pool_get_attribute, "cuMemPoolGetAttribute");
  get(&a.device_get_pool, "cuDeviceGetMemPool");
  get(&a.device_set_pool, "cuDeviceSetMemPool");
  get(&a.mem_get_pool, "cuMemGetMemPool");
  get(&a.mem_set_pool, "cuMemSetMemPool");
  get(&a.pool_set_access, "cuMemPoolSetAccess");
  get(&a.can_access_peer, "cuDeviceCanAccessPeer");
  get(&a.mem_get_info, "cuMemGetInfo_v2");
  get(&a.address_range, "cuMemGetAddressRange_v2");
  get(&a.pointer_attribute, "cuPointerGetAttribute");
  get(&a.pointer_attributes, "cuPointerGetAttributes");
  get(&a.begin_capture, "cuStreamBeginCapture_v2");
  get(&a.begin_capture_to_graph, "cuStreamBeginCaptureToGraph");
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
  auto get = [&](auto* out, const char* name, cuuint64_t flags = CU_GET_PROC_ADDRESS_DEFAULT, int since = 0, int at = 0) {
    void* p = nullptr;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    const int v = at ? at : std::max(version, since);  // a CUDA 13 call is asked for at 13.0
    const CUresult r = v1 ? gp1(name, &p, v, flags) : gp2(name, &p, v, flags, &status);
    if (r != CUDA_SUCCESS || (!v1 && status != CU_GET_PROC_ADDRESS_SUCCESS)) p = nullptr;
    need(out, p, name);
  };
  get(&a.init, "cuInit");
  get(&a.device_get, "cuDeviceGet");
  get(&a.retain, "cuDevicePrimaryCtxRetain");
  get(&a.set_current, "cuCtxSetCurrent");
  get(&a.stream_create, "cuStreamCreate");
  get(&a.stream_destroy, "cuStreamDestroy");
  get(&a.stream_destroy_v1, "cuStreamDestroy", CU_GET_PROC_ADDRESS_DEFAULT, 0, 3020);  // asked at CUDA 3.2
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
  get(&a.pool_get_attribute, "cuMemPoolGetAttribute");
  get(&a.device_get_pool, "cuDeviceGetMemPool");
  get(&a.device_set_pool, "cuDeviceSetMemPool");
  get(&a.mem_get_pool, "cuMemGetMemPool", CU_GET_PROC_ADDRESS_DEFAULT, 13000);
  get(&a.mem_set_pool, "cuMemSetMemPool", CU_GET_PROC_ADDRESS_DEFAULT, 13000);
  get(&a.pool_set_access, "cuMemPoolSetAccess");
  get(&a.can_access_peer, "cuDeviceCanAccessPeer");
  get(&a.mem_get_info, "cuMemGetInfo");
  get(&a.address_range, "cuMemGetAddressRange");
  get(&a.pointer_attribute, "cuPointerGetAttribute");
  get(&a.pointer_attributes, "cuPointerGetAttributes");
  get(&a.begin_capture, "cuStreamBeginCapture");
  get(&a.begin_capture_to_graph, "cuStreamBeginCaptureToGraph", CU_GET_PROC_ADDRESS_DEFAULT, 12030);
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

  // 6. cuMemGetInfo counts memory fragless caches but does not use as free. The background worker may be
  // splitting a handle meanwhile (it releases the handle before it creates the pieces), so the driver's used
  // bytes are read before and after, and the answer is compared only when nothing changed them in between
  // (a split in flight at the first reading is waited for by cuMemGetInfo, and changes them).
  size_t free_bytes = 0, total = 0, allocated = 0, reserved = 0;
  bool info_ok = true, steady = false;
  std::size_t used = 0;
  for (int attempt = 0; attempt < 200 && info_ok && !steady; ++attempt) {
    if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto before = d.census();
    info_ok = a.mem_get_info(&free_bytes, &total) == CUDA_SUCCESS && d.preload_memory &&
              d.preload_memory(0, &allocated, &reserved) == 0;
    used = before.used_bytes;
    steady = d.census().used_bytes == used;
  }
  expect(info_ok, "cuMemGetInfo");
  expect(steady, "the driver's used bytes held still across one cuMemGetInfo (in 200 tries)");
  expect(free_bytes == total - used + (reserved - allocated),
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
  CUdeviceptr before_capture = 0;
  const CUdeviceptr driver_own = reinterpret_cast<CUdeviceptr>(d.foreign_alloc(0, MiB));
  expect(a.alloc_async(&before_capture, 2 * MiB, s) == CUDA_SUCCESS && d.fragless(before_capture, 0) && driver_own,
         "a fragless block and one of the driver's, before the capture");
  expect(a.stream_create(&c, 0) == CUDA_SUCCESS && a.begin_capture(c, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS,
         "a global-mode capture on c");
  CUdeviceptr g = 0;
  expect(a.alloc_async(&g, 2 * MiB, c) == CUDA_SUCCESS && !d.fragless(g, 0), "cuMemAllocAsync on c: the graph's, not fragless's");
  expect(a.free_async(g, c) == CUDA_SUCCESS, "its cuMemFreeAsync on c reaches the driver");
  //     cuMemFreeAsync during a capture "must be passed the address of a graph allocation" (R21): fragless's
  //     block is none, and is refused as the driver refuses one of its own.
  expect(a.free_async(before_capture, c) == CUDA_ERROR_INVALID_VALUE,
         "cuMemFreeAsync on c of the fragless block: CUDA_ERROR_INVALID_VALUE");
  expect(a.free_async(driver_own, c) == CUDA_ERROR_INVALID_VALUE,
         "cuMemFreeAsync on c of the driver's own block: CUDA_ERROR_INVALID_VALUE (the double refuses it too)");
  const unsigned long fences = d.fences();
  for (int i = 0; i < 2; ++i) {
    CUdeviceptr x = 0;
    expect(a.alloc(&x, 160 * MiB) == CUDA_SUCCESS && d.fragless(x, 0) && a.free(x) == CUDA_SUCCESS,
           "cuMemAlloc / cuMemFree during the capture (256 MiB pending: the fence is due)");
  }
  expect(d.fences() == fences, "no fence ran during the capture");
  CUgraph graph = nullptr;
  expect(a.end_capture(c, &graph) == CUDA_SUCCESS && graph, "the capture ends valid");
  expect(a.free_async(before_capture, s) == CUDA_SUCCESS && a.free(driver_own) == CUDA_SUCCESS,
         "both blocks freed after the capture: they were still live");
  //     The same with cuStreamBeginCaptureToGraph (CUDA 12.3; XLA's StreamBeginCaptureToGraph calls it): the
  //     fence does not run during it either, and it ends valid.
  expect(a.begin_capture_to_graph(c, graph, nullptr, nullptr, 0, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS,
         "a global-mode capture on c into the graph (cuStreamBeginCaptureToGraph)");
  const unsigned long fences_to_graph = d.fences();
  for (int i = 0; i < 2; ++i) {
    CUdeviceptr x = 0;
    expect(a.alloc(&x, 160 * MiB) == CUDA_SUCCESS && d.fragless(x, 0) && a.free(x) == CUDA_SUCCESS,
           "cuMemAlloc / cuMemFree during the capture into the graph (the fence is due)");
  }
  expect(d.fences() == fences_to_graph, "no fence ran during the capture into the graph");
  CUgraph graph2 = nullptr;
  expect(a.end_capture(c, &graph2) == CUDA_SUCCESS && graph2, "the capture into the graph ends valid");
  expect(d.census().invalidated_captures == 0, "no capture was invalidated");
  CUdeviceptr after = 0;
  expect(a.alloc(&after, 900 * MiB) == CUDA_SUCCESS && a.free(after) == CUDA_SUCCESS,
         "900 MiB after the capture (the deferred frees went back)");

  // 11. cuStreamDestroy retires the stream first without waiting, as cudaStreamDestroy does, and a new
  //     stream that gets the same handle value is a new stream to fragless. Through both ABIs: CUDA 4.0's
  //     cuStreamDestroy_v2 and the older cuStreamDestroy libcuda still exports. The double gives the value
  //     to the next stream at once (as RMM's issue 649 saw CUDA do), u's kernel still queued: the new
  //     stream's work is not ordered after it unless fragless orders it, and the double counts a fault if
  //     the new stream's kernel touches u's memory first.
  const auto waits = [&] {
    return d.calls("cuStreamSynchronize") + d.calls("cuEventSynchronize") + d.calls("cuCtxSynchronize");
  };
  d.reuse_streams_at_once(1);
  for (auto destroy : {a.stream_destroy, a.stream_destroy_v1}) {
    const std::string abi = destroy == a.stream_destroy ? "cuStreamDestroy_v2" : "cuStreamDestroy (before CUDA 4.0)";
    CUstream u = nullptr, u2 = nullptr;
    CUdeviceptr w = 0, huge = 0;
    expect(a.stream_create(&u, 0) == CUDA_SUCCESS && a.alloc_async(&w, 64 * MiB, u) == CUDA_SUCCESS && d.fragless(w, 0),
           "64 MiB on a stream u");
    expect(d.launch(u, as_ptr(w), 64 * MiB, 5000) == 0 && a.free_async(w, u) == CUDA_SUCCESS,
           "freed on u while its kernel runs");
    const unsigned long before = waits();
    expect(destroy(u) == CUDA_SUCCESS, "u destroyed with " + abi);
    expect(waits() == before, "the destroy waited for nothing (" + abi + ", " + std::to_string(waits() - before) +
                                  " waits)");
    expect(a.stream_create(&u2, 0) == CUDA_SUCCESS && u2 == u, "a new stream, with u's handle value");
    const unsigned long before_alloc = waits();
    expect(a.alloc_async(&huge, 1000 * MiB, u2) == CUDA_SUCCESS && d.fragless(huge, 0) &&
               d.launch(u2, as_ptr(huge), 1000 * MiB, 10) == 0 && a.free_async(huge, u2) == CUDA_SUCCESS,
           "1000 MiB on the new stream (u's cached 64 MiB among them), used");
    std::printf("%s: %lu host waits during the 1000 MiB allocation\n", abi.c_str(), waits() - before_alloc);
    expect(destroy(u2) == CUDA_SUCCESS, "the new stream destroyed");
    expect(d.census().faults == 0,
           "no block of u handed out before u's work was done (" + abi + "; " + d.first_fault() + ")");
  }
  d.reuse_streams_at_once(0);

  // 12. Pools as XLA's and TensorFlow's async allocator use them. The default pool's statistics (read by
  //     GpuCudaMallocAsyncAllocator::PrintAllocatorStatistics) count fragless's memory allocated from it,
  //     through cuMemAllocFromPoolAsync and cuMemAllocAsync (the default pool is the device's current pool);
  //     a high-water mark resets to zero only, and then follows the pool's use.
  auto attr = [&](CUmemoryPool p, CUmemPool_attribute at) {
    cuuint64_t v = ~0ull;
    return a.pool_get_attribute(p, at, &v) == CUDA_SUCCESS ? v : ~0ull;
  };
  auto stats = [&](CUmemoryPool p) {
    return std::to_string(attr(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)) + " used, " +
           std::to_string(attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)) + " reserved, highs " +
           std::to_string(attr(p, CU_MEMPOOL_ATTR_USED_MEM_HIGH)) + " and " +
           std::to_string(attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH));
  };
  const cuuint64_t used0 = attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
  const cuuint64_t reserved0 = attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
  expect(used0 != ~0ull && reserved0 != ~0ull, "the default pool's statistics: " + stats(pool));
  CUdeviceptr x1 = 0, x2 = 0;
  expect(a.alloc_pool(&x1, 3 * MiB, pool, s) == CUDA_SUCCESS && d.fragless(x1, 0) &&
             a.alloc_async(&x2, 5 * MiB, s) == CUDA_SUCCESS && d.fragless(x2, 0),
         "3 MiB from the default pool, 5 MiB with cuMemAllocAsync: fragless's");
  expect(attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == used0 + 8 * MiB &&
             attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == reserved0 + 8 * MiB &&
             attr(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH) >= used0 + 8 * MiB &&
             attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) >= reserved0 + 8 * MiB,
         "the pool counts the 8 MiB: " + stats(pool));
  CUmemoryPool of_x2 = nullptr;
  expect(a.pointer_attribute(&of_x2, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, x2 + 64) == CUDA_SUCCESS && of_x2 == pool,
         "cuPointerGetAttribute: the cuMemAllocAsync block's pool is the default pool");
  expect(a.free_async(x1, s) == CUDA_SUCCESS && attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == used0 + 5 * MiB,
         "3 MiB freed: the pool counts 5 MiB");
  cuuint64_t reset = 0, one = 1;
  expect(a.pool_set_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, &reset) == CUDA_SUCCESS &&
             a.pool_set_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &reset) == CUDA_SUCCESS,
         "both high-water marks reset");
  expect(attr(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH) == used0 + 5 * MiB &&
             attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) == reserved0 + 5 * MiB,
         "after the reset the marks are the pool's current use: " + stats(pool));
  expect(a.pool_set_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &one) == CUDA_ERROR_INVALID_VALUE &&
             attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) == reserved0 + 5 * MiB,
         "a high-water mark set to 1: CUDA_ERROR_INVALID_VALUE, the mark unchanged");
  expect(a.free_async(x2, s) == CUDA_SUCCESS && attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == used0 &&
             attr(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH) == used0 + 5 * MiB,
         "5 MiB freed: the pool counts none of it, its mark stays");

  //     The device's current pool (cuDeviceGetMemPool / cuDeviceSetMemPool, CUDA 13's cuMemGetMemPool /
  //     cuMemSetMemPool): cuMemAllocAsync allocates from it, fragless's when it can serve the pool as the
  //     driver would, else the driver's.
  CUmemoryPool current = nullptr, lim = nullptr, mine = nullptr;
  CUmemLocation loc0{CU_MEM_LOCATION_TYPE_DEVICE, 0};
  expect(a.device_get_pool(&current, dev0) == CUDA_SUCCESS && current == pool, "cuDeviceGetMemPool(0): the default pool");
  CUmemPoolProps lim_props = limited;
  CUmemPoolProps mine_props = props;
  mine_props.location.id = 0;
  expect(a.pool_create(&lim, &lim_props) == CUDA_SUCCESS && a.pool_create(&mine, &mine_props) == CUDA_SUCCESS,
         "two pools on device 0: one with a maximum size, one plain");
  CUdeviceptr y = 0;
  expect(a.device_set_pool(dev0, lim) == CUDA_SUCCESS && a.device_get_pool(&current, dev0) == CUDA_SUCCESS && current == lim,
         "cuDeviceSetMemPool(0, the limited pool)");
  expect(a.alloc_async(&y, 2 * MiB, s) == CUDA_SUCCESS && !d.fragless(y, 0) && d.census().own_allocations == 1 &&
             attr(lim, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == 2 * MiB,
         "cuMemAllocAsync: the driver's, from the limited pool");
  expect(a.free_async(y, s) == CUDA_SUCCESS && d.census().own_allocations == 0, "its free reached the driver");
  //     Note [Forwarded allocations out of memory]: with fragless's cache filling the device, a driver
  //     allocation forwarded there (from the current pool, and from the pool by name: one fragless refused at
  //     its creation) succeeds once fragless has given that cache back; one that fails for the pool's own
  //     maximum size leaves fragless's cache alone.
  {
    auto reserved = [&] {
      size_t fa = 0, fr = 0;
      return d.preload_memory(0, &fa, &fr) == 0 ? fr : 0;
    };
    auto fill = [&] {
      // Allocations of what the driver has left, less 24 MiB, held until the driver has less than 32 MiB:
      // one may create less than it asks (fragless's cache serves part of it), so it may take more than one.
      // The driver's free memory is read with no split in flight (a split releases its handle before it
      // creates the pieces).
      std::vector<CUdeviceptr> bigs;
      for (int i = 0; i < 8 && d.drain(0) == 0 && d.free_bytes(0) >= 32 * MiB; ++i) {
        CUdeviceptr big = 0;
        expect(a.alloc(&big, d.free_bytes(0) - 24 * MiB) == CUDA_SUCCESS && d.fragless(big, 0), "fragless's cache fills device 0");
        bigs.push_back(big);
      }
      for (CUdeviceptr big : bigs) expect(a.free(big) == CUDA_SUCCESS, "freed to fragless's cache");
      expect(d.drain(0) == 0, "fragless_preload_drain(0)");
      const std::size_t held = reserved(), room = d.free_bytes(0);
      expect(held >= 64 * MiB && room < 32 * MiB,
             "fragless reserves " + std::to_string(held >> 20) + " MiB, the driver has " + std::to_string(room >> 20) + " MiB free");
      return held;
    };
    CUdeviceptr z[2] = {0, 0};
    for (int by_name = 0; by_name < 2; ++by_name) {
      const std::string how = by_name ? "cuMemAllocFromPoolAsync(the limited pool)" : "cuMemAllocAsync (the limited pool current)";
      const std::size_t held = fill();
      const CUresult r = by_name ? a.alloc_pool(&z[by_name], 32 * MiB, lim, s) : a.alloc_async(&z[by_name], 32 * MiB, s);
      expect(r == CUDA_SUCCESS && !d.fragless(z[by_name], 0), how + ": 32 MiB, the driver's, once fragless gave its cache back");
      expect(reserved() + 32 * MiB <= held, "fragless's cache went back (" + std::to_string(reserved() >> 20) + " MiB reserved)");
    }
    const std::size_t held = fill();
    CUdeviceptr w = 0;
    expect(a.alloc_pool(&w, 2 * MiB, lim, s) == CUDA_ERROR_OUT_OF_MEMORY && reserved() == held,
           "the limited pool at its 64 MiB: out of memory for the pool's own limit, fragless's cache kept");
    expect(a.free_async(z[0], s) == CUDA_SUCCESS && a.free_async(z[1], s) == CUDA_SUCCESS && d.census().own_allocations == 0,
           "freed to the driver");
  }
  expect(a.mem_set_pool(&loc0, CU_MEM_ALLOCATION_TYPE_PINNED, mine) == CUDA_SUCCESS &&
             a.mem_get_pool(&current, &loc0, CU_MEM_ALLOCATION_TYPE_PINNED) == CUDA_SUCCESS && current == mine,
         "cuMemSetMemPool(device 0, the plain pool)");
  expect(a.alloc_async(&y, 6 * MiB, s) == CUDA_SUCCESS && d.fragless(y, 0) &&
             attr(mine, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == 6 * MiB &&
             attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == used0,
         "cuMemAllocAsync: fragless's, counted in the plain pool, not the default one");
  expect(a.free_async(y, s) == CUDA_SUCCESS && attr(mine, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == 0, "freed: the plain pool counts 0");
  expect(a.device_set_pool(dev0, pool) == CUDA_SUCCESS && a.alloc_async(&y, MiB, s) == CUDA_SUCCESS && d.fragless(y, 0) &&
             attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == used0 + MiB && a.free_async(y, s) == CUDA_SUCCESS,
         "the default pool current again: cuMemAllocAsync fragless's, counted there");
  expect(a.pool_destroy(lim) == CUDA_SUCCESS && a.pool_destroy(mine) == CUDA_SUCCESS, "the two pools destroyed");

  // 13. CU_POINTER_ATTRIBUTE_BUFFER_ID: one id per fragless allocation, the same from any address inside it,
  //     never another allocation's (the driver's ids of its own allocations included), a new one for a new
  //     allocation at the same address.
  CUdeviceptr b1 = 0, b2 = 0, b3 = 0;
  unsigned long long id1 = 0, id1_inside = 0, id2 = 0, id2_all = 0, id3 = 0, id_foreign = 0;
  expect(a.alloc_async(&b1, MiB, s) == CUDA_SUCCESS && a.alloc_async(&b2, MiB, s) == CUDA_SUCCESS && d.fragless(b1, 0) &&
             d.fragless(b2, 0),
         "two fragless blocks");
  expect(a.pointer_attribute(&id1, CU_POINTER_ATTRIBUTE_BUFFER_ID, b1) == CUDA_SUCCESS &&
             a.pointer_attribute(&id1_inside, CU_POINTER_ATTRIBUTE_BUFFER_ID, b1 + 4096) == CUDA_SUCCESS &&
             a.pointer_attribute(&id2, CU_POINTER_ATTRIBUTE_BUFFER_ID, b2) == CUDA_SUCCESS,
         "cuPointerGetAttribute(BUFFER_ID) of both");
  expect(id1 != 0 && id1 == id1_inside && id2 != 0 && id2 != id1,
         "one id per block, the same inside it (" + std::to_string(id1) + ", " + std::to_string(id2) + ")");
  CUpointer_attribute id_attr[1] = {CU_POINTER_ATTRIBUTE_BUFFER_ID};
  void* id_data[1] = {&id2_all};
  expect(a.pointer_attributes(1, id_attr, id_data, b2 + 100) == CUDA_SUCCESS && id2_all == id2,
         "cuPointerGetAttributes gives the same id");
  CUdeviceptr other_driver = reinterpret_cast<CUdeviceptr>(d.foreign_alloc(0, MiB));
  expect(a.pointer_attribute(&id_foreign, CU_POINTER_ATTRIBUTE_BUFFER_ID, other_driver) == CUDA_SUCCESS,
         "a foreign allocation's id");
  expect(id_foreign != id1 && id_foreign != id2 && a.free(other_driver) == CUDA_SUCCESS,
         "a foreign allocation: the driver's id (" + std::to_string(id_foreign) + "), another one");
  expect(a.free_async(b1, s) == CUDA_SUCCESS && a.alloc_async(&b3, MiB, s) == CUDA_SUCCESS &&
             a.pointer_attribute(&id3, CU_POINTER_ATTRIBUTE_BUFFER_ID, b3) == CUDA_SUCCESS,
         "b1 freed, a new block");
  std::printf("the new block %s b1's address\n", b3 == b1 ? "has" : "does not have");
  expect(id3 != 0 && id3 != id1 && id3 != id2, "the new block's id is a new one (" + std::to_string(id3) + ")");
  expect(a.free_async(b2, s) == CUDA_SUCCESS && a.free_async(b3, s) == CUDA_SUCCESS, "freed");

  // 14. A pointer freed already is no longer the program's (R21: cuMemFree takes what an allocation call
  //     returned): a second cuMemFree of a block waiting behind the fence, and a cuMemFreeAsync after its
  //     cuMemFree, are CUDA_ERROR_INVALID_VALUE, and the queries answer for it as for memory fragless does
  //     not own (the driver's answer). The fence then frees it once: a new block at a later allocation, in
  //     use, is not freed under the program.
  CUdeviceptr gone = 0, gone_base = 0;
  size_t gone_size = 0;
  expect(a.alloc(&gone, 4 * MiB) == CUDA_SUCCESS && d.fragless(gone, 0), "4 MiB with cuMemAlloc");
  expect(a.free(gone) == CUDA_SUCCESS, "its cuMemFree (behind the fence)");
  expect(a.address_range(&gone_base, &gone_size, gone + 64) != CUDA_SUCCESS,
         "cuMemGetAddressRange of the freed block: the driver's answer (not found)");
  expect(a.free(gone) == CUDA_ERROR_INVALID_VALUE, "a second cuMemFree of it: CUDA_ERROR_INVALID_VALUE");
  expect(a.free_async(gone, s) == CUDA_ERROR_INVALID_VALUE, "a cuMemFreeAsync of it: CUDA_ERROR_INVALID_VALUE");
  CUdeviceptr sa = 0, sb = 0, sc = 0;
  expect(a.alloc_async(&sa, 4 * MiB, s) == CUDA_SUCCESS && d.fragless(sa, 0) && a.free(sa) == CUDA_SUCCESS,
         "4 MiB with cuMemAllocAsync on s, freed with cuMemFree (behind the fence)");
  expect(a.free_async(sa, s) == CUDA_ERROR_INVALID_VALUE, "then its cuMemFreeAsync: CUDA_ERROR_INVALID_VALUE");
  expect(a.alloc_async(&sb, 4 * MiB, s) == CUDA_SUCCESS && d.fragless(sb, 0) && sb != sa,
         "4 MiB again on s: not the block behind the fence");
  expect(d.launch(s, as_ptr(sb), 4 * MiB, 100000) == 0, "a long kernel on the new block");
  const unsigned long fences_before = d.fences();
  for (int i = 0; i < 1100; ++i) {  // more frees than the fence waits for
    CUdeviceptr x = 0;
    if (a.alloc(&x, 4096) != CUDA_SUCCESS || a.free(x) != CUDA_SUCCESS) break;
  }
  expect(d.fences() > fences_before, "the fence ran");
  expect(a.alloc_async(&sc, 4 * MiB, s) == CUDA_SUCCESS && sc != sb, "4 MiB on s: the new block (live) is not handed out");
  expect(a.free_async(sb, s) == CUDA_SUCCESS && a.free_async(sc, s) == CUDA_SUCCESS, "both freed");
  expect(d.census().faults == 0, std::string("no fault (") + d.first_fault() + ")");

  const auto census = d.census();
  expect(census.faults == 0, std::string("the double saw no fault (") + d.first_fault() + ")");
  expect(census.invalidated_captures == 0, "and no invalidated capture");
  expect(census.own_allocations == 0, "no allocation of the driver's own is left");
  expect(d.recursions() == 0, "no call came back into the interposer from inside fragless");
  std::printf("%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
