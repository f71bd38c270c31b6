// `sim` driver: no memory at all. Addresses are numbers, handles are counters; every call is counted by
// kind and charged a modelled cost (CostModel, default A100 figures). A capacity makes create fail with
// out_of_memory. Used by the replay benchmark to run millions of events per second.
#pragma once
#include <functional>
#include <memory>

#include "fragless/driver.h"
#include "fragless/test_events.h"

namespace fragless {

struct SimDriverOptions {
  int device = 0;
  std::size_t page_size = 2u << 20;
  std::size_t capacity = 80ull << 30;
  // Hand out address space from the top down, as the CUDA driver's cudaMalloc mostly does: newer segments
  // sit at lower addresses, which decides best-fit ties between equal free blocks (the replay uses it).
  bool top_down = false;
  // Tests: called in every memory query, before the free memory is read (true) and after (false), without
  // the driver's locks, so a test can hold a query in flight while the engine works.
  std::function<void(bool before)> on_memory_info;
};

std::unique_ptr<Driver> make_sim_driver(const SimDriverOptions& opts);

}  // namespace fragless
