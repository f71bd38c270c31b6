// What the benchmark programs share (bench/micro.cpp, bench/preload.cpp): the size mix of the cache-hit pairs
// and the engine they run on.
#pragma once
#include <cstddef>
#include <memory>
#include <random>
#include <vector>

#include "fragless/engine.h"
#include "fragless/sim_driver.h"

namespace fragless::bench {

// Many small tensors (biases, norms), activations of 1–40 MiB, all multiples of 512 B; the same draws every run.
inline std::vector<std::size_t> size_mix() {
  std::mt19937_64 rng(42);
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 1024; ++i) {
    const int k = static_cast<int>(rng() % 10);
    std::size_t s;
    if (k < 4) s = 512 * (1 + rng() % 64);               // up to 32 KiB
    else if (k < 6) s = 4096 * (1 + rng() % 256);        // up to 1 MiB
    else if (k < 9) s = (1u << 20) * (1 + rng() % 16);   // 1–16 MiB
    else s = (1u << 20) * (16 + rng() % 24);             // 16–40 MiB
    sizes.push_back(s);
  }
  return sizes;
}

// A device engine of `policy` on the sim driver, 64 GiB.
inline std::unique_ptr<DeviceEngine> sim_engine(PolicyKind policy) {
  Options o;
  o.policy = policy;
  o.driver = DriverKind::sim;
  SimDriverOptions so;
  so.capacity = 64ull << 30;
  return std::make_unique<DeviceEngine>(o, make_sim_driver(so));
}

}  // namespace fragless::bench
