// The cuda driver: every VMM and event call through function pointers obtained from libcuda at run time.
#include "fragless/cuda_driver.h"
#include "driver/registry.h"

#include <dlfcn.h>

#include "fragless/spin_mutex.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include <cuda.h>

namespace fragless {

namespace {

// The oldest driver fragless runs on (cuGetProcAddress arrived in CUDA 11.3) and the semantics it asks for.
constexpr int kMinDriverVersion = 11030, kWantedDriverVersion = 12000;

// Every entry point fragless calls, listed once: its Api member, its base name (looked up with
// cuGetProcAddress, so "cuMemGetInfo" is the _v2 entry point). The member's type is cuda.h's own prototype.
// Required: loading fails without one.
#define FRAGLESS_CUDA_REQUIRED(X) \
  X(init, cuInit) \
  X(getErrorName, cuGetErrorName) \
  X(getErrorString, cuGetErrorString) \
  X(deviceGetCount, cuDeviceGetCount) \
  X(deviceGet, cuDeviceGet) \
  X(deviceGetAttribute, cuDeviceGetAttribute) \
  X(deviceCanAccessPeer, cuDeviceCanAccessPeer) \
  X(primaryCtxRetain, cuDevicePrimaryCtxRetain) \
  X(primaryCtxRelease, cuDevicePrimaryCtxRelease) \
  X(ctxGetCurrent, cuCtxGetCurrent) \
  X(ctxPushCurrent, cuCtxPushCurrent) \
  X(ctxPopCurrent, cuCtxPopCurrent) \
  X(threadExchangeStreamCaptureMode, cuThreadExchangeStreamCaptureMode) \
  X(memGetInfo, cuMemGetInfo) \
  X(memGetAllocationGranularity, cuMemGetAllocationGranularity) \
  X(memAddressReserve, cuMemAddressReserve) \
  X(memAddressFree, cuMemAddressFree) \
  X(memCreate, cuMemCreate) \
  X(memRelease, cuMemRelease) \
  X(memMap, cuMemMap) \
  X(memUnmap, cuMemUnmap) \
  X(memSetAccess, cuMemSetAccess) \
  X(eventCreate, cuEventCreate) \
  X(eventRecord, cuEventRecord) \
  X(eventQuery, cuEventQuery) \
  X(eventSynchronize, cuEventSynchronize) \
  X(eventDestroy, cuEventDestroy) \
  X(streamSynchronize, cuStreamSynchronize) \
  X(streamWaitEvent, cuStreamWaitEvent) \
  X(ctxSynchronize, cuCtxSynchronize) \
  X(streamGetCtx, cuStreamGetCtx) \
  X(ctxGetDevice, cuCtxGetDevice)
// Sharing (R18, R19): optional; without them export and import are not supported.
#define FRAGLESS_CUDA_OPTIONAL(X) \
  X(memExportToShareableHandle, cuMemExportToShareableHandle) \
  X(memImportFromShareableHandle, cuMemImportFromShareableHandle)

// Function pointers, looked up by base name with cuGetProcAddress for CUDA 12.0 semantics (so that, for
// example, "cuMemGetInfo" is the _v2 entry point), or the driver's own version where it is older.
struct Api {
  void* lib = nullptr;
  int version = kWantedDriverVersion;  // what cuGetProcAddress is asked for
  std::string error;  // why loading failed
  CUresult (*getProcAddress)(const char*, void**, int, cuuint64_t) = nullptr;
#define FRAGLESS_CUDA_MEMBER(member, symbol) decltype(&symbol) member = nullptr;
  FRAGLESS_CUDA_REQUIRED(FRAGLESS_CUDA_MEMBER)
  FRAGLESS_CUDA_OPTIONAL(FRAGLESS_CUDA_MEMBER)
#undef FRAGLESS_CUDA_MEMBER

  std::string describe(const char* call, CUresult r) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (getErrorName) getErrorName(r, &name);
    if (getErrorString) getErrorString(r, &text);
    return std::string(call) + ": " + (name ? name : "CUDA error " + std::to_string(static_cast<int>(r))) + " (" +
           (text ? text : "no description") + ")";
  }
};

// The flags of every lookup: the legacy default stream's entry points, asked for by name. 0
// (CU_GET_PROC_ADDRESS_DEFAULT) reads the same at the ABI (driver.h R20: per-thread only for code built for
// per-thread streams, which cuda.h's inline wrapper turns into the flag before the call), but a driver or an
// interposer could read it as "whatever the caller was built for"; CU_GET_PROC_ADDRESS_LEGACY_STREAM cannot be.
constexpr cuuint64_t kProcFlags = CU_GET_PROC_ADDRESS_LEGACY_STREAM;

template <typename F>
bool resolve(Api& a, const char* name, F* fn) {
  void* p = nullptr;
  if (a.getProcAddress(name, &p, a.version, kProcFlags) != CUDA_SUCCESS || !p) {
    a.error = std::string("fragless: libcuda has no ") + name;
    return false;
  }
  *fn = reinterpret_cast<F>(p);
  return true;
}

}  // namespace

const char* cuda_library_name() {
  const char* path = std::getenv("FRAGLESS_LIBCUDA");
  return path && *path ? path : "libcuda.so.1";
}

namespace {

// Loads libcuda into `a` (a.error says why it could not).
void load(Api& a) {
  const char* lib_name = cuda_library_name();
  a.lib = dlopen(lib_name, RTLD_NOW | RTLD_LOCAL);
  if (!a.lib) {
    const char* why = dlerror();
    a.error = std::string("fragless: cannot load ") + lib_name + " (" + (why ? why : "unknown") +
              "): no NVIDIA driver on this machine; use driver:host or driver:sim to run without a GPU";
    return;
  }
  // cuGetProcAddress is asked for the driver's own version at most (a driver refuses a newer one), and for
  // CUDA 12.0 semantics where the driver has them.
  using GetVersion = CUresult (*)(int*);
  auto get_version = reinterpret_cast<GetVersion>(dlsym(a.lib, "cuDriverGetVersion"));
  int driver_version = 0;
  if (!get_version || get_version(&driver_version) != CUDA_SUCCESS || driver_version <= 0) {
    a.error = std::string("fragless: ") + lib_name + " does not tell its version (cuDriverGetVersion)";
    return;
  }
  if (driver_version < kMinDriverVersion) {
    a.error = "fragless: this NVIDIA driver supports CUDA " + std::to_string(driver_version / 1000) + "." +
              std::to_string(driver_version % 1000 / 10) + "; fragless needs CUDA " +
              std::to_string(kMinDriverVersion / 1000) + "." + std::to_string(kMinDriverVersion % 1000 / 10) +
              " or newer (cuGetProcAddress and the virtual memory API)";
    return;
  }
  a.version = std::min(driver_version, kWantedDriverVersion);
  a.getProcAddress = reinterpret_cast<decltype(a.getProcAddress)>(dlsym(a.lib, "cuGetProcAddress"));
  if (!a.getProcAddress) {
    a.error = std::string("fragless: ") + lib_name + " has no cuGetProcAddress (a CUDA 11.3 or newer driver is needed)";
    return;
  }
#define FRAGLESS_CUDA_RESOLVE(member, symbol) &&resolve(a, #symbol, &a.member)
  const bool ok = true FRAGLESS_CUDA_REQUIRED(FRAGLESS_CUDA_RESOLVE);
#undef FRAGLESS_CUDA_RESOLVE
  if (!ok) return;
#define FRAGLESS_CUDA_RESOLVE_OPTIONAL(member, symbol) \
if (void* p = nullptr; a.getProcAddress(#symbol, &p, a.version, kProcFlags) == CUDA_SUCCESS && p) \
  a.member = reinterpret_cast<decltype(a.member)>(p);
  FRAGLESS_CUDA_OPTIONAL(FRAGLESS_CUDA_RESOLVE_OPTIONAL)
#undef FRAGLESS_CUDA_RESOLVE_OPTIONAL
  if (CUresult r = a.init(0); r != CUDA_SUCCESS) a.error = "fragless: " + a.describe("cuInit", r);
}

// Loaded once, under std::call_once rather than as a function's static: a child forked while another thread
// loaded it (making the allocator, Note [Making the allocator once]) loads it again instead of waiting for ever
// on the static's guard. Never destroyed: frees may come from static destructors.
std::atomic<const Api*> g_api{nullptr};
const Api& api() {
  if (const Api* a = g_api.load(std::memory_order_acquire)) return *a;
  static std::once_flag once;
  std::call_once(once, [] {
    auto* a = new Api;
    load(*a);
    g_api.store(a, std::memory_order_release);
  });
  return *g_api.load(std::memory_order_acquire);
}

Status status_of(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return Status::ok;
    case CUDA_ERROR_OUT_OF_MEMORY: return Status::out_of_memory;
    case CUDA_ERROR_NOT_READY: return Status::not_ready;
    case CUDA_ERROR_NOT_SUPPORTED: return Status::not_supported;
    case CUDA_ERROR_INVALID_VALUE: return Status::invalid_argument;
    default: return Status::driver_error;
  }
}

// Runs the rest of a scope under the device's primary context, leaving the calling thread as it was: pushes
// the context when it is not already the current one and pops it at the end (PyTorch frees from threads with
// no device guard; empty_cache walks every device from one thread). With `relaxed`, the calls run in relaxed
// stream-capture mode as well (cuThreadExchangeStreamCaptureMode), as PyTorch runs cudaMalloc: the VMM calls
// are "potentially unsafe" during a global-mode capture on any thread, and would invalidate it.
class OnDevice {
 public:
  OnDevice(CUcontext primary, bool relaxed) {
    CUcontext c = nullptr;
    if (api().ctxGetCurrent(&c) != CUDA_SUCCESS || c != primary) pushed_ = api().ctxPushCurrent(primary) == CUDA_SUCCESS;
    if (relaxed) {
      mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
      exchanged_ = api().threadExchangeStreamCaptureMode(&mode_) == CUDA_SUCCESS;
    }
  }
  ~OnDevice() {
    if (exchanged_) api().threadExchangeStreamCaptureMode(&mode_);
    if (pushed_) {
      CUcontext popped = nullptr;
      api().ctxPopCurrent(&popped);
    }
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  bool pushed_ = false, exchanged_ = false;
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
};

// R16: the CUstream for one of fragless's streams. A per-thread default stream is CU_STREAM_PER_THREAD, and only
// its own thread can name it (false otherwise).
bool to_cu(Stream s, CUstream* out) {
  if (!is_per_thread_stream(s)) {
    *out = reinterpret_cast<CUstream>(s);
    return true;
  }
  *out = CU_STREAM_PER_THREAD;
  return s == per_thread_stream();
}

class CudaDriver final : public Driver {
 public:
  CudaDriver(const CudaDriverOptions& o, CUdevice dev, CUcontext primary, std::size_t granularity,
             CUmemAllocationProp prop, std::vector<CUmemAccessDesc> access)
      : Driver(o.device, granularity), dev_(dev), primary_(primary), prop_(prop), access_(std::move(access)) {}
  ~CudaDriver() override {
    {
      OnDevice on(primary_, false);
      for (CUevent e : spare_events_) api().eventDestroy(e);
      for (const auto& [e, c] : foreign_events_) {
        OnDevice own(c, false);  // the event's context where it is still there (else the primary one stays current)
        api().eventDestroy(e);
      }
    }
    api().primaryCtxRelease(dev_);  // the retain taken at creation
  }
  const char* name() const override { return "cuda"; }
  bool concurrent_calls() const override { return true; }  // libcuda is thread-safe; so are the pools here

  void do_memory_info(std::size_t* free_bytes, std::size_t* total_bytes) override {
    OnDevice on(primary_, true);
    std::size_t f = 0, t = 0;
    if (api().memGetInfo(&f, &t) != CUDA_SUCCESS) f = t = 0;
    *free_bytes = f;
    *total_bytes = t;
  }

 private:
  Status foreign_per_thread_stream(const char* call) {
    set_error(std::string(call) + ": another thread's per-thread default stream cannot be named (R16)");
    return Status::invalid_argument;
  }
  Status check(const char* call, CUresult r) {
    if (r == CUDA_SUCCESS) return Status::ok;
    if (r != CUDA_ERROR_NOT_READY) set_error(api().describe(call, r));
    return status_of(r);
  }

  Status do_reserve(std::size_t size, DevicePtr* va) override {
    OnDevice on(primary_, true);
    CUdeviceptr p = 0;
    const Status st = check("cuMemAddressReserve", api().memAddressReserve(&p, size, granularity(), 0, 0));
    if (st == Status::ok) *va = static_cast<DevicePtr>(p);
    return st;
  }
  Status do_free_reservation(DevicePtr va, std::size_t size) override {
    OnDevice on(primary_, true);
    return check("cuMemAddressFree", api().memAddressFree(static_cast<CUdeviceptr>(va), size));
  }
  Status do_create(std::size_t size, PhysHandle* h) override {
    OnDevice on(primary_, true);
    CUmemGenericAllocationHandle handle = 0;
    const Status st = check("cuMemCreate", api().memCreate(&handle, size, &prop_, 0));
    return st == Status::ok ? adopt("cuMemCreate", handle, h) : st;
  }
  // R8: the engine takes 0 for no handle and values with the top bit for its own names of handles
  // (kEngineHandleBit); a driver that gave one of those would be misread, so it is given back, and the call fails.
  Status adopt(const char* call, CUmemGenericAllocationHandle handle, PhysHandle* h) {
    if (handle != 0 && (handle & kEngineHandleBit) == 0) {
      *h = static_cast<PhysHandle>(handle);
      return Status::ok;
    }
    if (handle != 0) api().memRelease(handle);
    set_error(std::string(call) + " returned handle value " + std::to_string(handle) +
              ", which fragless cannot tell from its own names (R8: values are nonzero and below 2^63)");
    return Status::driver_error;
  }
  Status do_release(PhysHandle h) override {
    OnDevice on(primary_, true);
    return check("cuMemRelease", api().memRelease(h));
  }
  Status do_map(DevicePtr va, std::size_t size, PhysHandle h, std::size_t offset) override {
    OnDevice on(primary_, true);
    return check("cuMemMap", api().memMap(static_cast<CUdeviceptr>(va), size, offset, h, 0));
  }
  Status do_unmap(DevicePtr va, std::size_t size) override {
    OnDevice on(primary_, true);
    return check("cuMemUnmap", api().memUnmap(static_cast<CUdeviceptr>(va), size));
  }
  // R18: only memory created with the POSIX file descriptor type (shareable_handles:True, R11) is exported.
  Status do_export_handle(PhysHandle h, int* fd) override {
    if (!(prop_.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
      return unshareable("export_handle: the handle was not created exportable (R18; shareable_handles:True "
                         "creates exportable memory where the device supports POSIX file descriptor handles)");
    if (!api().memExportToShareableHandle) return unshareable("export_handle: libcuda has no cuMemExportToShareableHandle");
    OnDevice on(primary_, true);
    return check("cuMemExportToShareableHandle",
                 api().memExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  }
  // R26: fabric handles, for memory created with the fabric type (shareable_handles:fabric).
  bool fabric_handles() const override { return (prop_.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) != 0; }
  Status do_export_fabric(PhysHandle h, FabricHandle* out) override {
    if (!fabric_handles())
      return unshareable("export_handle: the handle was not created with the fabric handle type (R26; "
                         "shareable_handles:fabric creates it)");
    if (!api().memExportToShareableHandle) return unshareable("export_handle: libcuda has no cuMemExportToShareableHandle");
    OnDevice on(primary_, true);
    CUmemFabricHandle f{};
    const Status st = check("cuMemExportToShareableHandle", api().memExportToShareableHandle(&f, h, CU_MEM_HANDLE_TYPE_FABRIC, 0));
    if (st == Status::ok) std::memcpy(out->data, f.data, sizeof out->data);
    return st;
  }
  Status do_import_fabric(const FabricHandle& f, std::size_t, PhysHandle* h) override {
    if (!api().memImportFromShareableHandle) return unshareable("import_handle: libcuda has no cuMemImportFromShareableHandle");
    OnDevice on(primary_, true);
    CUmemFabricHandle bytes{};
    static_assert(sizeof bytes.data == sizeof f.data);
    std::memcpy(bytes.data, f.data, sizeof bytes.data);
    CUmemGenericAllocationHandle handle = 0;
    const Status st = check("cuMemImportFromShareableHandle",
                            api().memImportFromShareableHandle(&handle, &bytes, CU_MEM_HANDLE_TYPE_FABRIC));
    return st == Status::ok ? adopt("cuMemImportFromShareableHandle", handle, h) : st;
  }
  // R19: the descriptor is passed as the pointer-sized osHandle and stays the caller's.
  Status do_import_handle(int fd, std::size_t, PhysHandle* h) override {
    if (!api().memImportFromShareableHandle) return unshareable("import_handle: libcuda has no cuMemImportFromShareableHandle");
    OnDevice on(primary_, true);
    CUmemGenericAllocationHandle handle = 0;
    const Status st = check("cuMemImportFromShareableHandle",
                            api().memImportFromShareableHandle(
                                &handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    return st == Status::ok ? adopt("cuMemImportFromShareableHandle", handle, h) : st;
  }
  Status unshareable(const char* why) {
    set_error(why);
    return Status::not_supported;
  }
  Status do_set_access(DevicePtr va, std::size_t size) override {
    OnDevice on(primary_, true);
    return check("cuMemSetAccess", api().memSetAccess(static_cast<CUdeviceptr>(va), size, access_.data(), access_.size()));
  }
  // Events come from a pool: created once, recorded many times (cuEventRecord re-arms a recorded event).
  Status do_record_event(Stream s, Event* e) override {
    OnDevice on(primary_, false);
    CUstream cs = nullptr;
    if (!to_cu(s, &cs)) return foreign_per_thread_stream("cuEventRecord");
    CUevent ev = nullptr;
    {
      std::lock_guard lk(events_mu_);
      if (!spare_events_.empty()) {
        ev = spare_events_.back();
        spare_events_.pop_back();
      }
    }
    if (!ev)
      if (Status st = check("cuEventCreate", api().eventCreate(&ev, CU_EVENT_DISABLE_TIMING)); st != Status::ok) return st;
    const CUresult r = api().eventRecord(ev, cs);
    if (r == CUDA_SUCCESS) {
      *e = reinterpret_cast<Event>(ev);
      return Status::ok;
    }
    // R12: a stream of another context (record_stream onto another device's stream) takes an event of its own
    // context, as PyTorch's insert_events records under the stream's device; otherwise the engine's only way
    // to follow that stream would be a host wait at every such free.
    CUcontext sc = nullptr;
    if (r == CUDA_ERROR_INVALID_HANDLE && api().streamGetCtx(cs, &sc) == CUDA_SUCCESS && sc && sc != primary_) {
      do_release_event(reinterpret_cast<Event>(ev));
      return record_in_context(sc, cs, e);
    }
    api().eventDestroy(ev);
    return check("cuEventRecord", r);
  }
  // An event made in context c and recorded on its stream cs; never pooled: released, it is destroyed.
  Status record_in_context(CUcontext c, CUstream cs, Event* e) {
    if (Status st = check("cuCtxPushCurrent", api().ctxPushCurrent(c)); st != Status::ok) return st;
    CUevent ev = nullptr;
    Status st = check("cuEventCreate", api().eventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    if (st == Status::ok && (st = check("cuEventRecord", api().eventRecord(ev, cs))) != Status::ok)
      api().eventDestroy(ev);
    CUcontext popped = nullptr;
    api().ctxPopCurrent(&popped);
    if (st != Status::ok) return st;
    {
      std::lock_guard lk(events_mu_);
      foreign_events_.emplace_back(ev, c);
    }
    *e = reinterpret_cast<Event>(ev);
    return Status::ok;
  }
  Status do_query_event(Event e) override {
    OnDevice on(primary_, true);  // see R14: a capture elsewhere must not forbid it
    return check("cuEventQuery", api().eventQuery(reinterpret_cast<CUevent>(e)));
  }
  Status do_synchronize_event(Event e) override {
    OnDevice on(primary_, true);  // see R14: a capture elsewhere must not forbid it
    return check("cuEventSynchronize", api().eventSynchronize(reinterpret_cast<CUevent>(e)));
  }
  Status do_release_event(Event e) override {
    const auto ev = reinterpret_cast<CUevent>(e);
    CUcontext owner = nullptr;
    {
      std::lock_guard lk(events_mu_);
      auto it = std::find_if(foreign_events_.begin(), foreign_events_.end(),
                             [&](const auto& f) { return f.first == ev; });
      if (it == foreign_events_.end()) {
        spare_events_.push_back(ev);
        return Status::ok;
      }
      owner = it->second;
      foreign_events_.erase(it);
    }
    // cuEventDestroy may fail with CUDA_ERROR_INVALID_CONTEXT (cuda.h): the event's own context is made current
    // for it (R12), whatever the calling thread has (a thread that never touched CUDA has none).
    OnDevice on(owner, false);
    return check("cuEventDestroy", api().eventDestroy(ev));
  }
  Status do_stream_wait_event(Stream s, Event e) override {
    OnDevice on(primary_, false);
    CUstream cs = nullptr;
    if (!to_cu(s, &cs)) return foreign_per_thread_stream("cuStreamWaitEvent");
    return check("cuStreamWaitEvent", api().streamWaitEvent(cs, reinterpret_cast<CUevent>(e), 0));
  }
  Status do_synchronize_stream(Stream s) override {
    OnDevice on(primary_, true);  // see R14: a capture elsewhere must not forbid it
    CUstream cs = nullptr;
    if (!to_cu(s, &cs)) return foreign_per_thread_stream("cuStreamSynchronize");
    return check("cuStreamSynchronize", api().streamSynchronize(cs));
  }
  Status do_synchronize_device() override {
    OnDevice on(primary_, true);  // R17; relaxed: a capture on another device must not forbid it
    return check("cuCtxSynchronize", api().ctxSynchronize());
  }

  CUdevice dev_;
  CUcontext primary_;
  CUmemAllocationProp prop_;
  std::vector<CUmemAccessDesc> access_;
  SpinMutex events_mu_;
  std::vector<CUevent> spare_events_;    // of the primary context
  // Of other contexts (each with its context), recorded and not yet released (record_in_context).
  std::vector<std::pair<CUevent, CUcontext>> foreign_events_;
};

}  // namespace

int cuda_device_count(std::string* error) {
  const Api& a = api();
  if (!a.error.empty()) {
    if (error) *error = a.error;
    return -1;
  }
  int n = 0;
  if (CUresult r = a.deviceGetCount(&n); r != CUDA_SUCCESS) {
    if (error) *error = "fragless: " + a.describe("cuDeviceGetCount", r);
    return -1;
  }
  return n;
}

int cuda_stream_device(Stream s) {
  const Api& a = api();
  if (!a.error.empty() || s == 0 || s == reinterpret_cast<Stream>(CU_STREAM_LEGACY) ||
      s == reinterpret_cast<Stream>(CU_STREAM_PER_THREAD) || is_per_thread_stream(s))
    return -1;  // the current context's stream: the caller's current device
  CUcontext c = nullptr;
  if (a.streamGetCtx(reinterpret_cast<CUstream>(s), &c) != CUDA_SUCCESS || !c) return -1;
  if (a.ctxPushCurrent(c) != CUDA_SUCCESS) return -1;
  CUdevice dev = -1;
  const bool ok = a.ctxGetDevice(&dev) == CUDA_SUCCESS;
  CUcontext popped = nullptr;
  a.ctxPopCurrent(&popped);
  int count = 0;
  if (!ok || a.deviceGetCount(&count) != CUDA_SUCCESS) return -1;
  for (int d = 0; d < count; ++d) {  // a CUdevice is a handle: its ordinal is the one cuDeviceGet maps to it
    CUdevice h = -1;
    if (a.deviceGet(&h, d) == CUDA_SUCCESS && h == dev) return d;
  }
  return -1;
}

std::unique_ptr<Driver> make_cuda_driver(const CudaDriverOptions& o, std::string* error) {
  const Api& a = api();
  auto fail = [&](const std::string& m) -> std::unique_ptr<Driver> {
    if (error) *error = m;
    return nullptr;
  };
  if (!a.error.empty()) return fail(a.error);
  const int count = cuda_device_count(error);
  if (count < 0) return nullptr;
  if (o.device < 0 || o.device >= count)
    return fail("fragless: invalid device " + std::to_string(o.device) + " (this machine has " + std::to_string(count) +
                " CUDA devices)");
  CUdevice dev = 0;
  if (CUresult r = a.deviceGet(&dev, o.device); r != CUDA_SUCCESS) return fail("fragless: " + a.describe("cuDeviceGet", r));
  int vmm = 0, posix_fd = 0, rdma = 0, fabric = 0;
  a.deviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (!vmm)
    return fail("fragless: device " + std::to_string(o.device) +
                " does not support CUDA virtual memory management (cuMemCreate/cuMemMap), which fragless needs");
  a.deviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
  a.deviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
  a.deviceGetAttribute(&fabric, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev);
  if (o.shareable_handles && o.fabric_handles && !fabric)  // R26: CUDA would refuse every cuMemCreate
    return fail("fragless: shareable_handles:fabric, but device " + std::to_string(o.device) +
                " does not support fabric handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0); use "
                "shareable_handles:True for POSIX file descriptor handles");
  // The device's primary context (the one the CUDA runtime and PyTorch use), retained for the driver's life.
  CUcontext primary = nullptr;
  if (CUresult r = a.primaryCtxRetain(&primary, dev); r != CUDA_SUCCESS)
    return fail("fragless: " + a.describe("cuDevicePrimaryCtxRetain", r));
  OnDevice on(primary, false);
  // The allocation properties used for every cuMemCreate; the granularity is queried with exactly these.
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  // A shareable handle type only when asked for (shareable_handles) and the device has it (R11, R26).
  prop.requestedHandleTypes =
      !o.shareable_handles ? CU_MEM_HANDLE_TYPE_NONE
      : o.fabric_handles   ? CU_MEM_HANDLE_TYPE_FABRIC
      : posix_fd           ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                           : CU_MEM_HANDLE_TYPE_NONE;
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  std::size_t gran = 0;
  if (CUresult r = a.memGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM); r != CUDA_SUCCESS || !gran) {
    a.primaryCtxRelease(dev);
    return fail("fragless: " + a.describe("cuMemGetAllocationGranularity", r));
  }
  std::vector<CUmemAccessDesc> access;
  CUmemAccessDesc self{};
  self.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  self.location.id = dev;
  self.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  access.push_back(self);
  if (o.peer_access)
    for (int d = 0; d < count; ++d) {
      CUdevice peer = 0;
      int can = 0;
      if (d == o.device || a.deviceGet(&peer, d) != CUDA_SUCCESS) continue;
      if (a.deviceCanAccessPeer(&can, peer, dev) == CUDA_SUCCESS && can) {
        CUmemAccessDesc p = self;
        p.location.id = peer;
        access.push_back(p);
      }
    }
  return std::make_unique<CudaDriver>(o, dev, primary, gran, prop, std::move(access));
}

// The registry's entry (driver/registry.h): the options the cuda driver reads.
std::unique_ptr<Driver> make_cuda_driver_for(const Options& o, int device, std::string* error) {
  CudaDriverOptions c;
  c.device = device;
  c.peer_access = o.peer_access;
  c.shareable_handles = o.shareable_handles;
  c.fabric_handles = o.fabric_handles;
  return make_cuda_driver(c, error);
}

}  // namespace fragless
