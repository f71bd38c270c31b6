// The driver seam: the handful of operations the engine needs from CUDA's virtual memory and stream API.
//
// Three implementations: `cuda` (the real driver, loaded at run time), `host` (real host memory with the
// same semantics, for tests and the LibTorch CPU adapter) and `sim` (no memory, counted and costed calls,
// for the replay benchmark). The engine only ever talks to this interface.
//
// Every public operation is non-virtual: it counts the call, charges its modelled cost and forwards to the
// private `do_*` hook (the RMM pattern), so call accounting is identical for every driver.
//
// Pre/post-conditions (the same ones CUDA states for cuMemMap and friends):
//  - every size, address and offset is a multiple of granularity();
//  - reserve: on ok, [*va, *va+size) is reserved address space, aligned to granularity(), inaccessible;
//  - create: on ok, *handle names `size` bytes of physical memory; out_of_memory when the budget is exceeded
//    (nothing is held then);
//  - map: [va, va+size) lies in one reservation and is not mapped; [offset, offset+size) lies in the handle;
//    the range is mapped but not yet accessible;
//  - set_access: [va, va+size) is fully mapped; afterwards it is readable and writable by the device;
//  - unmap: [va, va+size) covers whole mappings only; afterwards it is plain reservation again;
//  - release: the handle is no longer mapped anywhere; its memory goes back;
//  - free_reservation: nothing inside is mapped;
//  - events: record_event marks the current end of a stream's queue; query_event says ok once the work
//    before it is done, else not_ready; synchronize_* wait (each one is a forced sync the engine counts).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace fragless {

using DevicePtr = std::uintptr_t;
using PhysHandle = std::uint64_t;
using Stream = std::uintptr_t;  // a cudaStream_t as an integer; 0 is the default stream
using Event = std::uint64_t;

enum class Status : int {
  ok = 0,
  out_of_memory,     // physical memory (or address space) exhausted: the engine may free its cache and retry
  invalid_argument,  // a pre-condition was broken: a bug in the caller
  not_ready,         // query_event: the work is not done yet
  not_supported,     // the device or driver cannot do this (no VMM support, no GPU)
  driver_error,      // anything else the driver reported
};

const char* status_name(Status s);

enum class DriverCall : int {
  reserve, free_reservation, create, release, map, unmap, set_access,
  record_event, query_event, synchronize_event, synchronize_stream, release_event, count_
};
inline constexpr int kDriverCallCount = static_cast<int>(DriverCall::count_);
const char* driver_call_name(DriverCall c);

// Modelled cost of one call, in microseconds (defaults: published A100 figures, kvcached bench_vmm).
struct CostModel {
  std::array<double, kDriverCallCount> us{};
  static CostModel a100();
};

struct DriverCounters {
  std::array<std::uint64_t, kDriverCallCount> calls{};
  double modelled_us = 0;
  std::uint64_t operator[](DriverCall c) const { return calls[static_cast<int>(c)]; }
};

class Driver {
 public:
  virtual ~Driver() = default;
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  virtual const char* name() const = 0;
  std::size_t granularity() const { return granularity_; }
  int device() const { return device_; }

  Status reserve(std::size_t size, DevicePtr* va) { charge(DriverCall::reserve); return do_reserve(size, va); }
  Status free_reservation(DevicePtr va, std::size_t size) {
    charge(DriverCall::free_reservation);
    return do_free_reservation(va, size);
  }
  Status create(std::size_t size, PhysHandle* h) { charge(DriverCall::create); return do_create(size, h); }
  Status release(PhysHandle h) { charge(DriverCall::release); return do_release(h); }
  Status map(DevicePtr va, std::size_t size, PhysHandle h, std::size_t offset) {
    charge(DriverCall::map);
    return do_map(va, size, h, offset);
  }
  Status unmap(DevicePtr va, std::size_t size) { charge(DriverCall::unmap); return do_unmap(va, size); }
  Status set_access(DevicePtr va, std::size_t size) {
    charge(DriverCall::set_access);
    return do_set_access(va, size);
  }
  Status record_event(Stream s, Event* e) { charge(DriverCall::record_event); return do_record_event(s, e); }
  Status query_event(Event e) { charge(DriverCall::query_event); return do_query_event(e); }
  Status synchronize_event(Event e) { charge(DriverCall::synchronize_event); return do_synchronize_event(e); }
  Status release_event(Event e) { charge(DriverCall::release_event); return do_release_event(e); }
  Status synchronize_stream(Stream s) { charge(DriverCall::synchronize_stream); return do_synchronize_stream(s); }

  // Free and total physical memory as the device sees it (cudaMemGetInfo).
  virtual void memory_info(std::size_t* free_bytes, std::size_t* total_bytes) = 0;
  // Text of the last failure, for error messages ("cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (out of memory)").
  virtual std::string last_error() const = 0;

  const DriverCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = DriverCounters{}; }
  void set_cost_model(const CostModel& m) { costs_ = m; }

 protected:
  Driver(int device, std::size_t granularity) : device_(device), granularity_(granularity) {}

 private:
  void charge(DriverCall c) {
    ++counters_.calls[static_cast<int>(c)];
    counters_.modelled_us += costs_.us[static_cast<int>(c)];
  }

  virtual Status do_reserve(std::size_t size, DevicePtr* va) = 0;
  virtual Status do_free_reservation(DevicePtr va, std::size_t size) = 0;
  virtual Status do_create(std::size_t size, PhysHandle* h) = 0;
  virtual Status do_release(PhysHandle h) = 0;
  virtual Status do_map(DevicePtr va, std::size_t size, PhysHandle h, std::size_t offset) = 0;
  virtual Status do_unmap(DevicePtr va, std::size_t size) = 0;
  virtual Status do_set_access(DevicePtr va, std::size_t size) = 0;
  virtual Status do_record_event(Stream s, Event* e) = 0;
  virtual Status do_query_event(Event e) = 0;
  virtual Status do_synchronize_event(Event e) = 0;
  virtual Status do_release_event(Event e) = 0;
  virtual Status do_synchronize_stream(Stream s) = 0;

  int device_;
  std::size_t granularity_;
  DriverCounters counters_;
  CostModel costs_ = CostModel::a100();
};

}  // namespace fragless
