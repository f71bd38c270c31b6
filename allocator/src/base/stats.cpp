#include "fragless/stats.h"

#include <utility>

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

// DeviceStats's members with their names in flatten(), each kind in one table: the stat arrays, the single
// stats, and the counters reset_accumulated() zeroes (max_split_size, a setting, is neither).
constexpr std::pair<const char*, StatArray DeviceStats::*> kArrays[] = {
    {"allocation", &DeviceStats::allocation}, {"segment", &DeviceStats::segment}, {"active", &DeviceStats::active},
    {"inactive_split", &DeviceStats::inactive_split}, {"allocated_bytes", &DeviceStats::allocated_bytes},
    {"reserved_bytes", &DeviceStats::reserved_bytes}, {"active_bytes", &DeviceStats::active_bytes},
    {"inactive_split_bytes", &DeviceStats::inactive_split_bytes}, {"requested_bytes", &DeviceStats::requested_bytes},
    {"exported_bytes", &DeviceStats::exported_bytes},  // fragless's own: sharing across processes
    {"imported_bytes", &DeviceStats::imported_bytes}};
constexpr std::pair<const char*, Stat DeviceStats::*> kStats[] = {
    {"oversize_allocations", &DeviceStats::oversize_allocations},
    {"oversize_segments", &DeviceStats::oversize_segments},
    {"fragless.live_bytes", &DeviceStats::live_bytes}};
constexpr std::pair<const char*, std::int64_t DeviceStats::*> kCounters[] = {
    {"num_alloc_retries", &DeviceStats::num_alloc_retries}, {"num_ooms", &DeviceStats::num_ooms},
    {"num_sync_all_streams", &DeviceStats::num_sync_all_streams}, {"num_device_alloc", &DeviceStats::num_device_alloc},
    {"num_device_free", &DeviceStats::num_device_free}, {"fragless.num_forced_syncs", &DeviceStats::num_forced_syncs},
    {"fragless.num_failed_waits", &DeviceStats::num_failed_waits}};

template <class F>
void each_stat(DeviceStats& s, F f) {
  for (const auto& [name, array] : kArrays)
    for (Stat& st : (s.*array).by_pool) f(st);
  for (const auto& [name, stat] : kStats) f(s.*stat);
}

}  // namespace

std::map<std::string, std::int64_t> DeviceStats::flatten() const {
  std::map<std::string, std::int64_t> m;
  for (const auto& [name, array] : kArrays) put(m, name, this->*array);
  for (const auto& [name, stat] : kStats) put(m, name, this->*stat);
  for (const auto& [name, counter] : kCounters) m[name] = this->*counter;
  m["max_split_size"] = max_split_size;
  return m;
}

void DeviceStats::reset_peaks() {
  each_stat(*this, [](Stat& s) { s.reset_peak(); });
}

void DeviceStats::reset_accumulated() {
  each_stat(*this, [](Stat& s) { s.reset_accumulated(); });
  for (const auto& [name, counter] : kCounters) this->*counter = 0;
}

}  // namespace fragless
