// A test double of libcuda: the driver-API functions fragless uses, with their C ABI, over host memory.
// Physical allocations are memfds; reservations are PROT_NONE mappings; cuMemMap maps the memfd over the
// reservation (still inaccessible, as CUDA leaves it) and cuMemSetAccess makes it readable and writable,
// so programs really read and write what they allocate. Checks the pre-conditions CUDA documents, in
// their strictest reading (the rules R1-R9 of allocator/include/fragless/driver.h), and returns
// CUDA_ERROR_INVALID_VALUE when one is broken: a mapping is a whole handle at offset 0; unmap and set
// access cover whole, adjacent mappings; a released handle keeps its memory until its last mapping goes
// and can no longer be mapped. The double is never more permissive than CUDA. Failure injection: fakecuda_fail("cuMemMap", n, e).
// Environment: FAKECUDA_DEVICES (default 2), FAKECUDA_CAPACITY_MB (per device, default 1024).
#include <cuda.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "fake_cuda.h"

#define FAKE_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr std::size_t kGranularity = 2u << 20;

struct Handle { int fd; std::size_t size; int device; int map_count; bool released; };
struct Mapping { std::size_t size; CUmemGenericAllocationHandle handle; };
struct Fault { int countdown; CUresult error; };
struct FakeEvent { CUstream stream; bool done; std::vector<CUevent> after; };

struct State {
  std::mutex mu;
  int devices = 2;
  std::map<int, std::size_t> capacity, used;
  std::unordered_map<CUmemGenericAllocationHandle, Handle> handles;
  CUmemGenericAllocationHandle next_handle = 1;
  std::map<CUdeviceptr, std::size_t> reservations;
  std::map<CUdeviceptr, Mapping> mappings;
  std::unordered_map<std::string, Fault> faults;
  std::unordered_map<std::string, unsigned long> calls;
  std::unordered_map<CUevent, FakeEvent> events;
  std::set<CUstream> held;
  std::unordered_map<CUstream, std::vector<CUevent>> waits;  // cuStreamWaitEvent: later work waits for these
  std::uintptr_t next_event = 0x1000;
  bool initialised = false;
  int driver_version = 13000;  // cuDriverGetVersion; FAKECUDA_DRIVER_VERSION or fakecuda_set_driver_version
  unsigned last_handle_types = 0;  // requestedHandleTypes of the last cuMemCreate
  State() {
    if (const char* v = std::getenv("FAKECUDA_DRIVER_VERSION")) driver_version = std::max(1, std::atoi(v));
    if (const char* d = std::getenv("FAKECUDA_DEVICES")) devices = std::max(1, std::atoi(d));
    std::size_t cap = 1024;
    if (const char* c = std::getenv("FAKECUDA_CAPACITY_MB")) cap = static_cast<std::size_t>(std::max(1, std::atoi(c)));
    for (int i = 0; i < devices; ++i) capacity[i] = cap << 20, used[i] = 0;
  }
};

State& st() {
  static State* s = new State();
  return *s;
}

thread_local CUcontext current_ctx = nullptr;
CUcontext primary_ctx(int dev) { return reinterpret_cast<CUcontext>(static_cast<std::uintptr_t>(0xC0 + dev)); }
int ctx_device(CUcontext c) { return c ? static_cast<int>(reinterpret_cast<std::uintptr_t>(c) - 0xC0) : 0; }

// Counts the call and returns the injected error, or CUDA_SUCCESS. Caller holds st().mu.
CUresult enter(const char* fn) {
  State& s = st();
  ++s.calls[fn];
  auto it = s.faults.find(fn);
  if (it != s.faults.end() && it->second.countdown > 0 && --it->second.countdown == 0) {
    const CUresult e = it->second.error;
    s.faults.erase(it);
    return e;
  }
  return CUDA_SUCCESS;
}

bool overlaps_mapping(State& s, CUdeviceptr va, std::size_t size) {
  auto it = s.mappings.lower_bound(va);
  if (it != s.mappings.end() && it->first < va + size) return true;
  if (it != s.mappings.begin() && std::prev(it)->first + std::prev(it)->second.size > va) return true;
  return false;
}

// Whether [va, va+size) consists of whole, adjacent mappings (R6, R7).
bool whole_mappings(State& s, CUdeviceptr va, std::size_t size) {
  if (size == 0) return false;
  std::size_t covered = 0;
  for (auto it = s.mappings.find(va); it != s.mappings.end() && it->first < va + size; ++it) {
    if (it->first != va + covered) return false;
    covered += it->second.size;
  }
  return covered == size;
}

// The memory of a released handle goes once nothing maps it (R8).
void drop_if_unused(State& s, CUmemGenericAllocationHandle h) {
  auto it = s.handles.find(h);
  if (it == s.handles.end() || !it->second.released || it->second.map_count > 0) return;
  close(it->second.fd);
  s.used[it->second.device] -= it->second.size;
  s.handles.erase(it);
}

bool in_reservation(State& s, CUdeviceptr va, std::size_t size) {
  auto it = s.reservations.upper_bound(va);
  if (it == s.reservations.begin()) return false;
  --it;
  return va + size <= it->first + it->second;
}

// An event is done when its own stream's work is, and everything that work waited for.
bool event_done(const FakeEvent& ev) {
  if (!ev.done) return false;
  for (CUevent d : ev.after) {
    auto it = st().events.find(d);
    if (it != st().events.end() && !event_done(it->second)) return false;
  }
  return true;
}

void finish(CUevent e) {
  auto it = st().events.find(e);
  if (it == st().events.end()) return;
  it->second.done = true;
  for (CUevent d : it->second.after) finish(d);
}

#define ENTER(name)                              \
  std::lock_guard lk(st().mu);                   \
  if (CUresult e_ = enter(name); e_) return e_;

}  // namespace

FAKE_API CUresult cuInit(unsigned) {
  ENTER("cuInit");
  st().initialised = true;
  return CUDA_SUCCESS;
}

namespace {
// The errors the double can return (or be told to inject): code, name, description.
struct ErrorText { CUresult code; const char* name; const char* text; };
constexpr ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
};
const ErrorText* error_text(CUresult e) {
  for (const auto& t : kErrors)
    if (t.code == e) return &t;
  return nullptr;
}
}  // namespace

FAKE_API CUresult cuGetErrorName(CUresult e, const char** s) {
  const ErrorText* t = error_text(e);
  *s = t ? t->name : "CUDA_ERROR_UNKNOWN";
  return t ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult cuGetErrorString(CUresult e, const char** s) {
  const ErrorText* t = error_text(e);
  *s = t ? t->text : "unknown error";
  return t ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult cuDeviceGetCount(int* n) {
  ENTER("cuDeviceGetCount");
  *n = st().devices;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  ENTER("cuDeviceGet");
  if (ordinal < 0 || ordinal >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  ENTER("cuDeviceGetAttribute");
  if (d < 0 || d >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  *v = a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ||
       a == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDeviceCanAccessPeer(int* can, CUdevice a, CUdevice b) {
  ENTER("cuDeviceCanAccessPeer");
  *can = a != b;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  ENTER("cuDevicePrimaryCtxRetain");
  if (d < 0 || d >= st().devices) return CUDA_ERROR_INVALID_DEVICE;
  *c = primary_ctx(d);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = current_ctx;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuCtxSetCurrent(CUcontext c) {
  current_ctx = c;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  ENTER("cuMemGetInfo");
  const int dev = ctx_device(current_ctx);
  *total = st().capacity[dev];
  *free_bytes = st().capacity[dev] - st().used[dev];
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* prop, CUmemAllocationGranularity_flags) {
  ENTER("cuMemGetAllocationGranularity");
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  *g = kGranularity;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemAddressReserve(CUdeviceptr* p, size_t size, size_t alignment, CUdeviceptr, unsigned long long) {
  ENTER("cuMemAddressReserve");
  if (size == 0 || size % kGranularity) return CUDA_ERROR_INVALID_VALUE;
  const std::size_t align = std::max(alignment, kGranularity);
  void* m = mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const auto base = reinterpret_cast<CUdeviceptr>(m);
  const CUdeviceptr aligned = (base + align - 1) / align * align;
  if (aligned > base) munmap(m, aligned - base);
  if (base + size + align > aligned + size)
    munmap(reinterpret_cast<void*>(aligned + size), base + size + align - aligned - size);
  st().reservations[aligned] = size;
  *p = aligned;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
  ENTER("cuMemAddressFree");
  auto it = st().reservations.find(p);
  if (it == st().reservations.end() || it->second != size || overlaps_mapping(st(), p, size)) return CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(p), size);
  st().reservations.erase(it);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemCreate(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* prop, unsigned long long) {
  ENTER("cuMemCreate");
  State& s = st();
  if (!prop || size == 0 || size % kGranularity || prop->location.id < 0 || prop->location.id >= s.devices)
    return CUDA_ERROR_INVALID_VALUE;
  const int dev = prop->location.id;
  if (s.used[dev] + size > s.capacity[dev]) return CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  s.used[dev] += size;
  s.last_handle_types = static_cast<unsigned>(prop->requestedHandleTypes);
  *h = s.next_handle++;
  s.handles[*h] = {fd, size, dev, 0, false};
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  ENTER("cuMemRelease");
  State& s = st();
  auto it = s.handles.find(h);
  if (it == s.handles.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  it->second.released = true;  // a mapping keeps the memory until it is unmapped, as in CUDA
  drop_if_unused(s, h);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long) {
  ENTER("cuMemMap");
  State& s = st();
  auto it = s.handles.find(h);
  // R5: one whole, unreleased handle at offset 0 ("currently must be zero"), inside one reservation,
  // over nothing mapped.
  if (it == s.handles.end() || it->second.released || size == 0 || va % kGranularity || offset != 0 ||
      size != it->second.size || !in_reservation(s, va, size) || overlaps_mapping(s, va, size))
    return CUDA_ERROR_INVALID_VALUE;
  void* m = mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED, it->second.fd, 0);
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  s.mappings[va] = {size, h};
  ++it->second.map_count;
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
  ENTER("cuMemUnmap");
  State& s = st();
  if (!whole_mappings(s, va, size)) return CUDA_ERROR_INVALID_VALUE;  // R7
  mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  std::vector<CUmemGenericAllocationHandle> touched;
  for (auto it = s.mappings.find(va); it != s.mappings.end() && it->first < va + size; ++it) {
    --s.handles[it->second.handle].map_count;
    touched.push_back(it->second.handle);
  }
  s.mappings.erase(s.mappings.find(va), s.mappings.lower_bound(va + size));
  for (auto h : touched) drop_if_unused(s, h);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc* desc, size_t count) {
  ENTER("cuMemSetAccess");
  State& s = st();
  if (!desc || count == 0 || !whole_mappings(s, va, size)) return CUDA_ERROR_INVALID_VALUE;  // R6
  mprotect(reinterpret_cast<void*>(va), size, PROT_READ | PROT_WRITE);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventCreate(CUevent* e, unsigned) {
  ENTER("cuEventCreate");
  *e = reinterpret_cast<CUevent>(st().next_event++);
  st().events[*e] = {nullptr, true, {}};
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventRecord(CUevent e, CUstream s) {
  ENTER("cuEventRecord");
  auto it = st().events.find(e);
  if (it == st().events.end()) return CUDA_ERROR_INVALID_VALUE;
  it->second = {s, st().held.count(s) == 0, st().waits[s]};
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventQuery(CUevent e) {
  ENTER("cuEventQuery");
  auto it = st().events.find(e);
  if (it == st().events.end()) return CUDA_ERROR_INVALID_VALUE;
  return event_done(it->second) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FAKE_API CUresult cuEventSynchronize(CUevent e) {
  ENTER("cuEventSynchronize");
  auto it = st().events.find(e);
  if (it == st().events.end()) return CUDA_ERROR_INVALID_VALUE;
  finish(e);  // waiting for it: the work finishes, and what it waited for
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuEventDestroy_v2(CUevent e) {
  ENTER("cuEventDestroy");
  return st().events.erase(e) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult cuStreamSynchronize(CUstream s) {
  ENTER("cuStreamSynchronize");
  // The stream's work is done, and what it waited for (events recorded before the waits were captured).
  for (CUevent w : st().waits[s]) finish(w);
  st().waits.erase(s);
  for (auto& [e, ev] : st().events)
    if (ev.stream == s) finish(e);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
  ENTER("cuStreamWaitEvent");
  auto it = st().events.find(e);
  if (it == st().events.end() || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!event_done(it->second)) st().waits[s].push_back(e);
  return CUDA_SUCCESS;
}

FAKE_API CUresult cuDriverGetVersion(int* v) {
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lk(st().mu);
  *v = st().driver_version;
  return CUDA_SUCCESS;
}

FAKE_API void fakecuda_set_driver_version(int v) {
  std::lock_guard lk(st().mu);
  st().driver_version = v;
}

FAKE_API unsigned fakecuda_last_handle_types() {
  std::lock_guard lk(st().mu);
  return st().last_handle_types;
}

#undef cuGetProcAddress  // cuda.h maps the name to the _v2 entry point; the double exports the original ABI
// R10: a version newer than the driver's own is refused.
FAKE_API CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version, cuuint64_t) {
  {
    std::lock_guard lk(st().mu);
    if (cuda_version > st().driver_version) {
      if (pfn) *pfn = nullptr;
      return CUDA_ERROR_NOT_FOUND;
    }
  }
  static const std::unordered_map<std::string, void*> table = {
      {"cuInit", reinterpret_cast<void*>(&cuInit)},
      {"cuGetErrorName", reinterpret_cast<void*>(&cuGetErrorName)},
      {"cuGetErrorString", reinterpret_cast<void*>(&cuGetErrorString)},
      {"cuDeviceGetCount", reinterpret_cast<void*>(&cuDeviceGetCount)},
      {"cuDeviceGet", reinterpret_cast<void*>(&cuDeviceGet)},
      {"cuDeviceGetAttribute", reinterpret_cast<void*>(&cuDeviceGetAttribute)},
      {"cuDeviceCanAccessPeer", reinterpret_cast<void*>(&cuDeviceCanAccessPeer)},
      {"cuDevicePrimaryCtxRetain", reinterpret_cast<void*>(&cuDevicePrimaryCtxRetain)},
      {"cuCtxGetCurrent", reinterpret_cast<void*>(&cuCtxGetCurrent)},
      {"cuCtxSetCurrent", reinterpret_cast<void*>(&cuCtxSetCurrent)},
      {"cuMemGetInfo", reinterpret_cast<void*>(&cuMemGetInfo_v2)},
      {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&cuMemGetAllocationGranularity)},
      {"cuMemAddressReserve", reinterpret_cast<void*>(&cuMemAddressReserve)},
      {"cuMemAddressFree", reinterpret_cast<void*>(&cuMemAddressFree)},
      {"cuMemCreate", reinterpret_cast<void*>(&cuMemCreate)},
      {"cuMemRelease", reinterpret_cast<void*>(&cuMemRelease)},
      {"cuMemMap", reinterpret_cast<void*>(&cuMemMap)},
      {"cuMemUnmap", reinterpret_cast<void*>(&cuMemUnmap)},
      {"cuMemSetAccess", reinterpret_cast<void*>(&cuMemSetAccess)},
      {"cuEventCreate", reinterpret_cast<void*>(&cuEventCreate)},
      {"cuEventRecord", reinterpret_cast<void*>(&cuEventRecord)},
      {"cuEventQuery", reinterpret_cast<void*>(&cuEventQuery)},
      {"cuEventSynchronize", reinterpret_cast<void*>(&cuEventSynchronize)},
      {"cuEventDestroy", reinterpret_cast<void*>(&cuEventDestroy_v2)},
      {"cuStreamSynchronize", reinterpret_cast<void*>(&cuStreamSynchronize)},
      {"cuStreamWaitEvent", reinterpret_cast<void*>(&cuStreamWaitEvent)},
  };
  auto it = table.find(symbol ? symbol : "");
  if (it == table.end()) {
    *pfn = nullptr;
    return CUDA_ERROR_NOT_FOUND;
  }
  *pfn = it->second;
  return CUDA_SUCCESS;
}

FAKE_API void fakecuda_fail(const char* fn, int nth, int error) {
  std::lock_guard lk(st().mu);
  if (nth <= 0) st().faults.erase(fn);
  else st().faults[fn] = {nth, static_cast<CUresult>(error)};
}

FAKE_API void fakecuda_reset_failures() {
  std::lock_guard lk(st().mu);
  st().faults.clear();
}

FAKE_API unsigned long fakecuda_calls(const char* fn) {
  std::lock_guard lk(st().mu);
  auto it = st().calls.find(fn);
  return it == st().calls.end() ? 0 : it->second;
}

FAKE_API void fakecuda_get_census(fakecuda_census* out) {
  std::lock_guard lk(st().mu);
  out->handles = static_cast<long>(st().handles.size());
  out->mappings = static_cast<long>(st().mappings.size());
  out->reservations = static_cast<long>(st().reservations.size());
  out->events = static_cast<long>(st().events.size());
  out->used_bytes = 0;
  for (auto& [d, u] : st().used) out->used_bytes += u;
}

FAKE_API void fakecuda_hold_stream(void* stream, int hold) {
  std::lock_guard lk(st().mu);
  auto s = reinterpret_cast<CUstream>(stream);
  if (hold) {
    st().held.insert(s);
  } else {
    st().held.erase(s);
    for (auto& [e, ev] : st().events)
      if (ev.stream == s) ev.done = true;
  }
}

FAKE_API void fakecuda_set_capacity(int device, std::size_t bytes) {
  std::lock_guard lk(st().mu);
  st().capacity[device] = bytes;
}
