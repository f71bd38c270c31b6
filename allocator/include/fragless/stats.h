// Statistics with PyTorch's memory_stats() key names, plus fragless's own (live bytes, forced syncs,
// fragmentation figures). Kept exact: the invariant checker recounts them from the block lists.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace fragless {

struct Stat {
  std::int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void add(std::int64_t delta) {
    current += delta;
    if (delta > 0) allocated += delta; else freed -= delta;
    if (current > peak) peak = current;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = freed = 0; }
};

enum PoolKind : int { kAllPools = 0, kSmallPool = 1, kLargePool = 2 };

// One stat per pool kind: all, small_pool, large_pool.
struct StatArray {
  Stat by_pool[3];
  void add(bool small, std::int64_t delta) {
    by_pool[kAllPools].add(delta);
    by_pool[small ? kSmallPool : kLargePool].add(delta);
  }
  const Stat& all() const { return by_pool[kAllPools]; }
};

struct DeviceStats {
  StatArray allocation, segment, active, inactive_split;
  StatArray allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;
  Stat oversize_allocations, oversize_segments;
  std::int64_t num_alloc_retries = 0, num_ooms = 0, num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0, num_device_free = 0;
  std::int64_t max_split_size = -1;
  // fragless additions
  Stat live_bytes;                  // requested bytes of allocated (not pending) blocks
  std::int64_t num_forced_syncs = 0;  // every stream/event synchronisation the engine forced
  std::int64_t num_failed_waits = 0;  // synchronisations that failed: the memory under them stayed cached
  // Sharing across processes (engine/share.cpp), in PyTorch's key style (exported_bytes.all.current, ...):
  // bytes of this device's blocks that other processes may hold open (the whole handles under each exported
  // block, once per block; the pool is the block's), and bytes of other processes' memory mapped here by
  // open_shared (in neither allocated nor reserved; the pool is the exporter's block's).
  StatArray exported_bytes, imported_bytes;

  // 1 - peak allocated / peak reserved (0 when nothing was reserved).
  double fragmentation_at_peak() const;
  // peak reserved / peak live - 1 (0 when nothing was live).
  double overhead_over_live() const;

  // Flattened as torch.cuda.memory_stats() does ("allocated_bytes.all.current", ...), sorted by key.
  std::map<std::string, std::int64_t> flatten() const;
  void reset_peaks();
  void reset_accumulated();
};

}  // namespace fragless
