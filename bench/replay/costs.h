// The driver cost model from a probe of a real driver (tools/gpu_probe.cpp's JSON), for
// `fragless-replay --costs FILE`.
#pragma once
#include <string>

#include "fragless/driver.h"

namespace fragless::replay {

// Starts from the A100 model and replaces every call the probe measured: for calls with a size, a least-
// squares line through the medians at each handle size (us + per_mib × MiB); for event calls, the median.
// false with *error naming the file and what is wrong (unreadable, not JSON, not a probe, no measurement).
// *unmeasured (when given) lists the calls the probe did not measure, whose A100 figures stand.
bool load_costs(const std::string& path, CostModel* out, std::string* error, std::string* unmeasured = nullptr);

}  // namespace fragless::replay
