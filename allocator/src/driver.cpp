#include "fragless/driver.h"

namespace fragless {

const char* status_name(Status s) {
  switch (s) {
    case Status::ok: return "ok";
    case Status::out_of_memory: return "out_of_memory";
    case Status::invalid_argument: return "invalid_argument";
    case Status::not_ready: return "not_ready";
    case Status::not_supported: return "not_supported";
    case Status::driver_error: return "driver_error";
  }
  return "?";
}

const char* driver_call_name(DriverCall c) {
  static constexpr const char* kNames[kDriverCallCount] = {
      "reserve", "free_reservation", "create", "release", "map", "unmap", "set_access",
      "record_event", "query_event", "synchronize_event", "synchronize_stream", "release_event"};
  const int i = static_cast<int>(c);
  return i >= 0 && i < kDriverCallCount ? kNames[i] : "?";
}

CostModel CostModel::a100() {
  // kvcached benchmarks/bench_vmm (A100, 2 MiB pages): create 193.32, map 1.45, set access 35.99,
  // unmap 25.63, reserve 19 µs. Release and free_reservation are not published; we charge them like unmap.
  // Event record/query are cheap host calls (~1 µs); a synchronisation is charged nothing here because its
  // real cost is the GPU work it waits for, which the engine counts separately as a forced sync.
  CostModel m;
  auto set = [&](DriverCall c, double cost_us) { m.us[static_cast<int>(c)] = cost_us; };
  set(DriverCall::reserve, 19.0);
  set(DriverCall::free_reservation, 19.0);
  set(DriverCall::create, 193.32);
  set(DriverCall::release, 25.63);
  set(DriverCall::map, 1.45);
  set(DriverCall::unmap, 25.63);
  set(DriverCall::set_access, 35.99);
  set(DriverCall::record_event, 1.0);
  set(DriverCall::query_event, 0.5);
  set(DriverCall::release_event, 0.5);
  return m;
}

}  // namespace fragless
