#include "fragless/stats.h"

namespace fragless {

double DeviceStats::fragmentation_at_peak() const {
  const auto reserved = reserved_bytes.all().peak;
  if (reserved <= 0) return 0.0;
  return 1.0 - static_cast<double>(allocated_bytes.all().peak) / static_cast<double>(reserved);
}

double DeviceStats::overhead_over_live() const {
  if (live_bytes.peak <= 0) return 0.0;
  return static_cast<double>(reserved_bytes.all().peak) / static_cast<double>(live_bytes.peak) - 1.0;
}

namespace {

void put(std::map<std::string, std::int64_t>& m, const std::string& key, const Stat& s) {
  m[key + ".current"] = s.current;
  m[key + ".peak"] = s.peak;
  m[key + ".allocated"] = s.allocated;
  m[key + ".freed"] = s.freed;
}

void put(std::map<std::string, std::int64_t>& m, const std::string& key, const StatArray& a) {
  put(m, key + ".all", a.by_pool[kAllPools]);
  put(m, key + ".small_pool", a.by_pool[kSmallPool]);
  put(m, key + ".large_pool", a.by_pool[kLargePool]);
}

template <class F>
void each_array(DeviceStats& s, F f) {
  for (StatArray* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                       &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes,
                       &s.exported_bytes, &s.imported_bytes})
    for (Stat& st : a->by_pool) f(st);
  for (Stat* st : {&s.oversize_allocations, &s.oversize_segments, &s.live_bytes})
    f(*st);
}

}  // namespace

std::map<std::string, std::int64_t> DeviceStats::flatten() const {
  std::map<std::string, std::int64_t> m;
  put(m, "allocation", allocation);
  put(m, "segment", segment);
  put(m, "active", active);
  put(m, "inactive_split", inactive_split);
  put(m, "allocated_bytes", allocated_bytes);
  put(m, "reserved_bytes", reserved_bytes);
  put(m, "active_bytes", active_bytes);
  put(m, "inactive_split_bytes", inactive_split_bytes);
  put(m, "requested_bytes", requested_bytes);
  put(m, "exported_bytes", exported_bytes);  // fragless's own: sharing across processes
  put(m, "imported_bytes", imported_bytes);
  put(m, "oversize_allocations", oversize_allocations);
  put(m, "oversize_segments", oversize_segments);
  m["num_alloc_retries"] = num_alloc_retries;
  m["num_ooms"] = num_ooms;
  m["num_sync_all_streams"] = num_sync_all_streams;
  m["num_device_alloc"] = num_device_alloc;
  m["num_device_free"] = num_device_free;
  m["max_split_size"] = max_split_size;
  put(m, "fragless.live_bytes", live_bytes);
  m["fragless.num_forced_syncs"] = num_forced_syncs;
  m["fragless.num_failed_waits"] = num_failed_waits;
  return m;
}

void DeviceStats::reset_peaks() {
  each_array(*this, [](Stat& s) { s.reset_peak(); });
}

void DeviceStats::reset_accumulated() {
  each_array(*this, [](Stat& s) { s.reset_accumulated(); });
  num_alloc_retries = num_ooms = num_sync_all_streams = num_device_alloc = num_device_free = 0;
  num_forced_syncs = 0;
  num_failed_waits = 0;
}

}  // namespace fragless
