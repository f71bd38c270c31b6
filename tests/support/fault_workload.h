// The scripted multi-stream workload of the fault sweeps (host driver and cuda driver): allocations of
// 512 B–40 MiB on two streams with data written, record_stream onto a third stream that is held for a
// while (so events stay pending, are queried and waited for), frees, empty_cache.
#pragma once
#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fragless/engine.h"

namespace fragless::test {

inline constexpr Stream kFaultStreamA = 0x51, kFaultStreamB = 0x52, kFaultStreamUse = 0x53;

// `hold(true)` makes work on kFaultStreamUse stay pending, `hold(false)` lets it complete. Returns false at
// the first failed allocation, with its message in *error. The streams are the k* values plus `base` (a
// stream belongs to one device: each device's run gets its own).
inline bool fault_workload(DeviceEngine& e, std::string* error, const std::function<void(bool)>& hold,
                           Stream base = 0) {
  constexpr std::size_t MiB = 1u << 20;
  std::vector<void*> live;
  const std::size_t sizes[] = {512, 3 * MiB, 24 * MiB, MiB + 4096, 40 * MiB, 700 * 1024, 6 * MiB};
  for (int round = 0; round < 3; ++round) {
    if (round == 1) hold(true);
    for (std::size_t i = 0; i < std::size(sizes); ++i) {
      AllocError err;
      void* p = e.allocate(sizes[i], base + ((i % 2) ? kFaultStreamA : kFaultStreamB), &err);
      if (!p) {
        *error = err.message;
        for (void* q : live) e.free(q);
        hold(false);
        return false;
      }
      std::memset(p, 0x5a, std::min<std::size_t>(sizes[i], 4096));
      if (i % 3 == 0) e.record_stream(p, base + kFaultStreamUse);
      live.push_back(p);
    }
    for (std::size_t i = 0; i < live.size(); i += 2) e.free(live[i]);
    std::vector<void*> keep;
    for (std::size_t i = 1; i < live.size(); i += 2) keep.push_back(live[i]);
    live = keep;
    if (round == 1) e.empty_cache();  // waits for the held stream: a forced synchronisation
    if (round == 2) hold(false);
  }
  for (void* p : live) e.free(p);
  e.empty_cache();
  return true;
}

}  // namespace fragless::test
