#include "driver/registry.h"

#include "fragless/cuda_driver.h"

namespace fragless {

namespace {

constexpr const char* kNoCuda =
    "fragless: this build has no cuda driver (the CUDA headers were not found); use driver:host or driver:sim";

// One line per driver (registry.h).
constexpr DriverEntry kDrivers[] = {
#if defined(FRAGLESS_HAVE_CUDA)
    {DriverKind::cuda, "cuda", &make_cuda_driver_for, &cuda_device_count, nullptr, nullptr},
#else
    {DriverKind::cuda, "cuda", nullptr, nullptr, nullptr, kNoCuda},
#endif
    {DriverKind::host, "host", &make_host_driver_for, nullptr, &host_driver_accepts, nullptr},
    {DriverKind::sim, "sim", &make_sim_driver_for, nullptr, nullptr, nullptr},
};

}  // namespace

std::span<const DriverEntry> driver_registry() { return kDrivers; }

const DriverEntry& driver_entry(DriverKind kind) {
  for (const DriverEntry& e : kDrivers)
    if (e.kind == kind) return e;
  return kDrivers[0];  // every DriverKind has its line (a test checks it)
}

const char* driver_kind_name(DriverKind d) { return driver_entry(d).name; }

std::optional<DriverKind> driver_kind_from_name(std::string_view name) {
  for (const DriverEntry& e : kDrivers)
    if (name == e.name) return e.kind;
  return std::nullopt;
}

}  // namespace fragless
