// What a fault sweep checks once a run is over: empty_cache gives every handle, mapping and physical byte
// back to the host driver (and every reservation, where the caller asks for that too).
#pragma once
#include <catch2/catch.hpp>

#include "fragless/engine.h"
#include "fragless/host_driver.h"

namespace fragless::test {

inline void check_all_given_back(DeviceEngine& e, bool reservations_too) {
  e.empty_cache();
  const auto census = host_driver_census(e.driver());
  CHECK(census.handles == 0);
  CHECK(census.mappings == 0);
  if (reservations_too) CHECK(census.reservations == 0);
  CHECK(census.physical_bytes == 0);
}

}  // namespace fragless::test
