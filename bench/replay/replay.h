// Replays a trace through one policy on the sim driver and measures it.
#pragma once
#include <atomic>
#include <optional>
#include <unordered_set>
#include <vector>
#include <string>

#include "fragless/config.h"
#include "fragless/driver.h"
#include "trace_model.h"

namespace fragless::replay {

struct ReplayResult {
  std::string input;
  int device = 0;
  PolicyKind policy = PolicyKind::fragless;
  std::uint64_t events = 0;
  std::int64_t peak_live = 0, peak_allocated = 0, peak_reserved = 0;
  double fragmentation_at_peak = 0, overhead_over_live = 0, time_weighted_fragmentation = 0;
  std::uint64_t ooms = 0;
  // External fragmentation (DESIGN.md: 1 - largest free range / total free, 0 with nothing free) at each OOM:
  // its mean and its largest over the OOMs (both 0 without one).
  double external_fragmentation_at_oom_mean = 0, external_fragmentation_at_oom_max = 0;
  DriverCounters driver;  // calls made during the window (seeding excluded); background ones counted apart
  // Modelled driver time the program waited for (inside its allocation, free and empty_cache calls), and
  // the time background work took on the trace's clock; their sum is driver.modelled_us.
  double alloc_path_driver_us() const { return driver.on_path_us(); }
  double background_driver_us() const { return driver.background_us; }
  bool background_clock = false;  // the trace has a clock for background work (recorded or modelled time)
  std::int64_t forced_syncs = 0;
  std::optional<double> trace_duration_us;
  std::optional<double> model_duration_us;  // generated workloads: the compute model's length of the run
  double replay_seconds = 0, events_per_second = 0;
  std::optional<std::uint64_t> pytorch_recorded_peak_reserved;
  std::uint64_t capacity = 0;  // the device capacity replayed on (0: unlimited)
  std::string error;  // non-empty: the trace could not be replayed (names the position)
  // One point per bucket of events: the bucket's last trace time (seconds from the first event; -1 without
  // time) and event index, and the largest live, allocated and reserved seen in it, so no peak is lost.
  struct Point { double seconds, index; std::int64_t live, allocated, reserved; };
  std::vector<Point> curve;  // filled when ReplayOptions::curve_points > 0
  bool curve_in_seconds = false;  // the trace has time
  // What was there when the window began: the allocations live before it (and, for classic, the segments
  // PyTorch held), present before the first event. A plot draws it as already there (--plot).
  bool pre_window = false;
  Point window_start{0, 0, 0, 0, 0};
  // With ReplayOptions::peak_detail: what reserved memory held at the moment it peaked (the first time it
  // reached its peak), from the engine's segments. reserved = allocated + free + idle, and free =
  // free_in_whole_pages + free_in_partial_pages: a whole page of a free block could be unmapped and moved,
  // a partial one shares its page with a live block.
  struct PeakDetail {
    std::uint64_t event = 0;                      // events replayed when it was reached (0: the window's start)
    std::int64_t reserved = 0, live = 0;
    std::int64_t allocated = 0;                   // blocks in use (live bytes rounded up, and pending frees)
    std::int64_t free = 0;                        // free blocks of mapped memory
    std::uint64_t free_blocks = 0;
    std::int64_t free_in_whole_pages = 0, free_in_partial_pages = 0;
    std::int64_t idle = 0;                        // held but mapped nowhere (the fragless policy's idle handles)
    std::int64_t small_reserved = 0, small_free = 0;  // the small pool's part of reserved and of free
  };
  std::optional<PeakDetail> at_peak;
  // With ReplayOptions::peak_detail: the page floor, the most pages of the driver's granularity that held
  // allocated bytes at one moment (Note [The page floor]). A policy that places blocks where this one did
  // and backs whole pages cannot hold less.
  std::optional<std::int64_t> page_floor;
};

// Device capacity of a replay without one: large enough that no trace recorded on a real GPU runs out.
inline constexpr std::uint64_t kUnlimitedCapacity = std::uint64_t{1} << 40;

struct ReplayOptions {
  std::uint64_t capacity = 0;                      // 0 = unlimited (kUnlimitedCapacity)
  std::size_t curve_points = 0;                    // sample usage about this many times (for --plot)
  std::atomic<std::uint64_t>* progress = nullptr;  // events replayed, added in batches
  Options base;                                    // allocator settings (--conf); policy and driver are set per run
  bool check = false;                              // check the engine's invariants at the end (tests)
  // Stop at the first allocation that runs out of memory (the memory live before the window included),
  // with ooms = 1 and no error: a search only needs to know whether a replay fits.
  bool stop_at_first_oom = false;
  // The driver cost model (fragless-replay --costs FILE: measured on a real driver); null = the A100 model.
  const CostModel* costs = nullptr;
  // Fill ReplayResult::at_peak (fragless-replay --peak-detail): a look at the segments each time reserved
  // memory reaches a new peak, so slower.
  bool peak_detail = false;
};

// capacity 0 = unlimited. An OOM is a result: counted, the allocation (and its free) skipped.
ReplayResult replay(const formats::Trace& t, int device, PolicyKind policy, std::uint64_t capacity);
// Note [Frees an empty_cache completes] (replay.cpp): the addresses whose `free` records directly follow the
// empty_cache at event `at` on `device`, each with a free_requested pending (in `requested`): the replay frees
// them at the empty_cache and skips their records.
std::vector<std::uint64_t> completed_by_empty_cache(const formats::Trace& t, std::size_t at, int device,
                                                    const std::unordered_set<std::uint64_t>& requested);
ReplayResult replay(const formats::Trace& t, int device, PolicyKind policy, const ReplayOptions& options);

}  // namespace fragless::replay
