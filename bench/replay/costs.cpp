#include "costs.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace fragless::replay {

namespace {
// The probe's name of each call with a size, and the model's.
constexpr std::pair<const char*, DriverCall> kSized[] = {
    {"cuMemAddressReserve", DriverCall::reserve}, {"cuMemAddressFree", DriverCall::free_reservation},
    {"cuMemCreate", DriverCall::create},          {"cuMemRelease", DriverCall::release},
    {"cuMemMap", DriverCall::map},                {"cuMemUnmap", DriverCall::unmap},
    {"cuMemSetAccess", DriverCall::set_access},
};
}  // namespace

bool load_costs(const std::string& path, CostModel* out, std::string* error, std::string* unmeasured) {
  auto fail = [&](const std::string& why) {
    *error = "--costs " + path + ": " + why;
    return false;
  };
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return fail("is a directory (expected the output of fragless-gpu-probe)");
  std::ifstream f(path);
  if (!f) return fail("cannot open the file");
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return fail("not JSON (expected the output of fragless-gpu-probe)");
  if (!j.is_object()) return fail("JSON, but not an object (expected the output of fragless-gpu-probe)");
  // The GPU check's report (gpu_check.json) carries the probe's output whole.
  if (j.value("schema", "") == "fragless-gpu-check/2") {
    if (!j.contains("probe") || !j["probe"].is_object()) return fail("a GPU check report without the probe's results");
    j = nlohmann::json(j["probe"]);
  }
  if (j.value("schema", "") != "fragless-gpu-probe/1")
    return fail("not a driver probe (schema is not \"fragless-gpu-probe/1\")");
  const auto costs = j.find("costs_us");
  if (costs == j.end() || !costs->is_object()) return fail("no costs_us object");
  // Every call named must be one the model has: a misspelt name would otherwise leave the model's figure
  // in place without a word.
  for (const auto& [name, value] : costs->items()) {
    bool known = false;
    for (const auto& [k, call] : kSized) known |= name == k;
    if (!known) {
      std::string names;
      for (const auto& [k, call] : kSized) names += (names.empty() ? "" : ", ") + std::string(k);
      return fail("costs_us: unknown call '" + name + "' (the calls: " + names + ")");
    }
  }
  // A median or handle size beyond these is no measurement (a probe times calls of microseconds to
  // milliseconds on handles up to a device's memory), and would overflow the model's arithmetic.
  constexpr double kMaxMedianUs = 1e7, kMaxHandleBytes = 1e15;
  CostModel m = CostModel::a100();
  int measured = 0;
  std::string missing;  // the calls whose A100 figures stand
  auto not_measured = [&](const std::string& what) { missing += (missing.empty() ? "" : ", ") + what; };
  for (const auto& [name, call] : kSized) {
    const auto c = costs->find(name);
    if (c == costs->end() || !c->is_object() || c->empty()) {
      not_measured(name);
      continue;
    }
    std::vector<std::pair<double, double>> pts;  // (MiB, median µs)
    for (const auto& [size, stat] : c->items()) {
      double mib = 0;
      std::size_t used = 0;
      try {
        mib = std::stod(size, &used) / (1 << 20);
      } catch (...) {
        used = 0;
      }
      if (size.empty() || used != size.size() || !std::isfinite(mib) || mib * (1 << 20) > kMaxHandleBytes)
        return fail(std::string(name) + ": handle size '" + size + "' is not a number of bytes up to 10^15");
      if (!stat.is_object() || !stat.contains("median") || !stat["median"].is_number())
        return fail(std::string(name) + " at " + size + " bytes: no numeric median");
      const double med = stat["median"].get<double>();
      if (!(mib > 0) || !(med >= 0)) return fail(std::string(name) + " at " + size + " bytes: a negative or zero value");
      if (!(med <= kMaxMedianUs))
        return fail(std::string(name) + " at " + size + " bytes: median " + stat["median"].dump() +
                    " µs is not a measurement (at most 10^7 µs)");
      pts.emplace_back(mib, med);
    }
    if (pts.empty()) continue;
    double a = pts[0].second, b = 0;
    if (pts.size() > 1) {  // least squares: median = a + b × MiB
      double sx = 0, sy = 0, sxx = 0, sxy = 0;
      for (auto [x, y] : pts) sx += x, sy += y, sxx += x * x, sxy += x * y;
      const double n = static_cast<double>(pts.size()), den = n * sxx - sx * sx;
      if (den > 0) {
        b = (n * sxy - sx * sy) / den;
        a = (sy - b * sx) / n;
      }
      if (a < 0) a = 0;  // a line through large handles can cross below zero at 0 MiB
      if (b < 0) b = 0;
    }
    m.us[static_cast<int>(call)] = a;
    m.per_mib[static_cast<int>(call)] = b;
    ++measured;
  }
  // A top-level timing's median: false when absent; *bad when present but not a measurement.
  std::string bad;
  auto median_of = [&](const char* key, double* v) {
    const auto it = j.find(key);
    if (it == j.end() || !it->is_object() || !it->contains("median") || !(*it)["median"].is_number()) return false;
    *v = (*it)["median"].get<double>();
    if (!(*v >= 0 && *v <= kMaxMedianUs)) {
      if (bad.empty()) bad = std::string(key) + ": median " + (*it)["median"].dump() + " is not a measurement (0 to 10^7 µs)";
      return false;
    }
    return true;
  };
  double rq = 0, sync = 0;
  if (median_of("event_record_query_us", &rq)) {  // one record and one query
    m.us[static_cast<int>(DriverCall::record_event)] = rq / 2;
    m.us[static_cast<int>(DriverCall::query_event)] = rq / 2;
    ++measured;
  } else {
    not_measured("event record and query");
  }
  if (median_of("stream_synchronize_idle_us", &sync)) {
    m.us[static_cast<int>(DriverCall::synchronize_stream)] = sync;
    m.us[static_cast<int>(DriverCall::synchronize_event)] = sync;
    ++measured;
  } else {
    not_measured("synchronisations");
  }
  double info = 0;
  if (median_of("mem_get_info_us", &info)) {  // probes before 2026-12-03 did not time it: the A100 model's stays
    m.us[static_cast<int>(DriverCall::memory_info)] = info;
    ++measured;
  } else {
    not_measured("cuMemGetInfo");
  }
  if (!bad.empty()) return fail(bad);
  if (measured == 0) return fail("the probe measured no call (costs_us is empty)");
  *out = m;
  if (unmeasured) *unmeasured = missing;
  return true;
}

}  // namespace fragless::replay
