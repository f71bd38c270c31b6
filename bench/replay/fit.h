// What fits: searches over replays on the sim driver.
//
// fit_capacity finds the smallest device capacity (a multiple of a step) from which every larger multiple of the
// step runs a trace with zero OOMs under one policy; max_value finds a value of one numeric workload key (batch,
// max_seq, ...) that runs with zero OOMs on a given capacity and whose next value does not. The OOM path is the
// engine's own (release cached memory, retry), so a replay on a capacity is what the allocator would do with
// that much device memory. The capacity is all the memory the allocator may use: a real GPU reports somewhat
// less than its nominal size, and its CUDA context, and anything else on it, take their share first.
//
// Note [Search invariant]: every claim of a search is a replay. The answer was replayed and had zero OOMs;
// its neighbour (one step below the capacity, one above the value) was replayed and had at least one (a
// capacity of 0 bytes, below a one-step answer, is not replayed: nothing fits there). Nothing assumes OOMs are
// monotone in capacity or in a workload's size, and they are not: a policy's choices change with the room it
// has (classic caching's release-and-retry path, fragless's near-limit handles), so a larger device can do
// worse. On the mercuryb1 snapshot classic caching runs on 4.0625 GiB but not on any step from 4.078 to 5.25
// GiB; moe's tokens fit at 67584 and 67849 but not at 67585. What a search replays does not depend on --jobs,
// so neither does its answer.
//
// Note [Every step up]: fit_capacity replays every step from its answer up to the top (Note [Above the top]),
// downwards from the top in batches of four until one runs out of memory: the answer is the step above the
// highest one that does, so every device of a size that is a multiple of the step, at least the answer, fits.
// Capacities between the steps are not replayed (and can fail: classic caching on a random draw fits 2.5 and
// 2.75 GiB but not 2.515625). A smaller capacity may run the trace too (mercuryb1 under classic caching:
// 4.0625 GiB), but a device between it and the answer would not. It costs a replay per step between the
// answer and the top.
//
// Note [Above the top]: from its top a policy runs as without a limit, so no capacity above it needs a
// replay. Classic caching and expandable segments read the capacity only through a create the driver refuses
// (and the size of a segment's address range, which follows the device and never limits a growth): their top
// is their peak reserved without a limit (over the memory fraction, and for classic caching with garbage
// collection over its threshold too), rounded up to a step, where no create is refused. The fragless policy
// also reads the device's free memory: while it would hold more than half of what it may hold it makes no
// handle larger than chunk_size_mb (Note [Cells]), so its top is twice its peak reserved (over the memory
// fraction): with non-default settings it ran out of memory between its peak and twice it, where the defaults
// did not (chunk_size_mb:64, handle_max_mb:512; a second reader, 2026-12-06). One channel is left: near those
// thresholds it asks the driver for free memory (Note [Asking for free memory]), up to 8/3 of its peak, and a
// question on the path cancels one the background worker would have asked, moving the worker's time by the
// question's cost; capacities from twice to 8/3 of its peak are not replayed, and a test found none of them
// running out of memory ("fit: fragless fits every step from its answer to 8/3 of its peak reserved").
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
  std::uint64_t top = 0;            // bytes: every step from min_capacity up to this was replayed (Note [Above the top])
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
