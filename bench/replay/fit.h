// What fits: searches over replays on the sim driver.
//
// fit_capacity finds the smallest device capacity (a multiple of a step) on which a trace replays with zero
// OOMs under one policy; max_value finds the largest value of one numeric workload key (batch, max_seq, ...)
// that replays with zero OOMs on a given capacity. The OOM path is the engine's own (release cached memory,
// retry), so a replay on a capacity is what the allocator would do on a device of that size.
//
// Note [Search invariant]: both are bisections whose every claim is a replay. The answer was replayed and
// had zero OOMs; its neighbour (one step below the capacity, one above the value) was replayed and had at
// least one. Nothing assumes OOMs are monotone in capacity or batch (a policy's choices change with the
// room it has, so a larger device can, rarely, do worse): the answer is a boundary the search found, found
// from the side of the smallest capacity (the largest value) it had evidence for. Where a replay is never
// needed (no allocator fits below peak live), it is still made, so the neighbour's OOM is measured.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "replay.h"

namespace fragless::replay {

struct SearchOptions {
  unsigned parallel = 1;  // replays run at once within one search (each probes one point)
  ReplayOptions replay;   // settings of every replay; the search sets capacity and stop_at_first_oom
};

struct FitResult {
  ReplayResult at;                  // the whole replay at min_capacity: zero OOMs
  std::uint64_t min_capacity = 0;   // bytes, a multiple of step
  std::uint64_t step = 0;
  std::int64_t peak_live = 0;       // the floor: no allocator runs this trace on less
  std::uint64_t recorded_ooms = 0;  // OOM events the trace itself recorded on this device
  int replays = 0;
  double seconds = 0;
  std::string error;                // non-empty: no answer (names why)
};

// step: the capacity resolution, at least 1 MiB.
FitResult fit_capacity(const formats::Trace& t, int device, PolicyKind policy, std::uint64_t step,
                       const SearchOptions& options);

struct MaxResult {
  ReplayResult at;  // the whole replay at max_value: zero OOMs
  std::string spec, key;
  long long max_value = 0;
  long long least = 0, greatest = 0;  // the key's range searched
  bool capped = false;                // greatest is where the search stops, below what the workload accepts
  bool at_limit = false;  // max_value is the largest value the workload accepts: it fits, no value above it to fail
  int replays = 0;
  double seconds = 0;
  std::string error;  // non-empty: no answer (names why)
};

// The workloads a search may generate are bounded by what any workload may have (kMaxWorkloadEvents,
// workload.h): a value past it stops the search (the key does not bound memory on this device).

MaxResult max_value(const std::string& spec, const std::string& key, PolicyKind policy, std::uint64_t capacity,
                    const SearchOptions& options, const std::vector<int>* lengths = nullptr);

}  // namespace fragless::replay
