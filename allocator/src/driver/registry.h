// The drivers fragless can run on, in one table (registry.cpp): a driver is its own file (its class, and a
// make_*_for function that reads what it needs of the Options) plus one line there. To add one: write the
// file under driver/, add its DriverKind (config.h) and its line, list the file in allocator/CMakeLists.txt.
#pragma once
#include <memory>
#include <span>
#include <string>

#include "fragless/config.h"
#include "fragless/driver.h"

namespace fragless {

struct DriverEntry {
  DriverKind kind;
  const char* name;  // as FRAGLESS_CONF's `driver` key takes it
  // The driver of `device`, configured from the options; null with *error set when it cannot be had.
  std::unique_ptr<Driver> (*make)(const Options& o, int device, std::string* error);
  // How many devices the driver has (-1 with *error set when it cannot tell); null: one device.
  int (*device_count)(std::string* error);
  // Whether the driver takes the options on any machine (false with *error set); null: it takes every valid
  // set. make refuses with the same message, so driver_available (check_driver) says it before the first use.
  bool (*accepts)(const Options& o, std::string* error);
  const char* missing;  // when this build lacks the driver (make is null): why, and what to use instead
};

// Every driver kind, built into this binary or not, in DriverKind order.
std::span<const DriverEntry> driver_registry();
const DriverEntry& driver_entry(DriverKind kind);

bool host_driver_accepts(const Options& o, std::string* error);
std::unique_ptr<Driver> make_host_driver_for(const Options& o, int device, std::string* error);
std::unique_ptr<Driver> make_sim_driver_for(const Options& o, int device, std::string* error);
std::unique_ptr<Driver> make_cuda_driver_for(const Options& o, int device, std::string* error);

}  // namespace fragless
