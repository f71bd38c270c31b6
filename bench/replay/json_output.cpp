// The --json documents of fragless-replay (output.h), built with nlohmann_json.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "output.h"

namespace fragless::replay {
namespace {

using Json = nlohmann::ordered_json;  // the keys in the order written, as readers of the output see them

// Note [The precision of --json numbers]
// A fractional number in --json has a fixed number of decimals: 6 for ratios and the replay's seconds, 2 for
// modelled microseconds, 3 for the searches' seconds, none for trace durations and events per second (an
// integer then). The value is what printf's "%.Nf" writes, read back, so a document and its readers see the
// same values whatever writes the digits; a value that is not finite is null.
Json fixed(double v, int decimals) {
  if (!std::isfinite(v)) return nullptr;
  const int n = std::snprintf(nullptr, 0, "%.*f", decimals, v);
  std::string text(static_cast<std::size_t>(n), '\0');
  std::snprintf(text.data(), text.size() + 1, "%.*f", decimals, v);
  if (decimals == 0) return std::strtoll(text.c_str(), nullptr, 10);
  return std::strtod(text.c_str(), nullptr);
}

template <class T>
Json or_null(const std::optional<T>& v, auto&& write) {
  return v ? Json(write(*v)) : Json(nullptr);
}

// The fields of one result, in the order of the --json schema.
Json result_json(const ReplayResult& r) {
  const auto& d = r.driver;
  Json o;
  o["input"] = r.input;
  o["device"] = r.device;
  o["policy"] = policy_name(r.policy);
  o["capacity_bytes"] = r.capacity ? r.capacity : kUnlimitedCapacity;
  o["events"] = r.events;
  o["peak_live_bytes"] = r.peak_live;
  o["peak_allocated_bytes"] = r.peak_allocated;
  o["peak_reserved_bytes"] = r.peak_reserved;
  o["fragmentation_at_peak"] = fixed(r.fragmentation_at_peak, 6);
  o["overhead_over_live"] = fixed(r.overhead_over_live, 6);
  o["time_weighted_fragmentation"] = fixed(r.time_weighted_fragmentation, 6);
  o["ooms"] = r.ooms;
  if (r.ooms) {
    o["external_fragmentation_at_oom"] = {{"mean", fixed(r.external_fragmentation_at_oom_mean, 6)},
                                          {"max", fixed(r.external_fragmentation_at_oom_max, 6)}};
  } else {
    o["external_fragmentation_at_oom"] = nullptr;
  }
  o["driver_calls"] = {{"reserve", d[DriverCall::reserve]}, {"create", d[DriverCall::create]},
                       {"map", d[DriverCall::map]},         {"set_access", d[DriverCall::set_access]},
                       {"unmap", d[DriverCall::unmap]},     {"release", d[DriverCall::release]},
                       {"memory_info", d[DriverCall::memory_info]}};
  o["forced_syncs"] = r.forced_syncs;
  o["modelled_driver_us"] = fixed(d.modelled_us, 2);
  o["alloc_path_driver_us"] = fixed(r.alloc_path_driver_us(), 2);
  o["background_driver_us"] = fixed(r.background_driver_us(), 2);
  o["background_calls"] = {{"create", d.background(DriverCall::create)},
                           {"map", d.background(DriverCall::map)},
                           {"set_access", d.background(DriverCall::set_access)},
                           {"unmap", d.background(DriverCall::unmap)},
                           {"release", d.background(DriverCall::release)},
                           {"memory_info", d.background(DriverCall::memory_info)}};
  o["trace_duration_us"] = or_null(r.trace_duration_us, [](double us) { return fixed(us, 0); });
  o["model_duration_us"] = or_null(r.model_duration_us, [](double us) { return fixed(us, 0); });
  o["background_clock"] = r.background_clock;
  o["replay_seconds"] = fixed(r.replay_seconds, 6);
  o["events_per_second"] = fixed(r.events_per_second, 0);
  o["pytorch_recorded_peak_reserved_bytes"] = or_null(r.pytorch_recorded_peak_reserved, [](std::uint64_t b) { return b; });
  if (const auto& p = r.at_peak)  // --peak-detail only
    o["at_peak"] = {{"event", p->event},
                    {"reserved_bytes", p->reserved},
                    {"live_bytes", p->live},
                    {"allocated_bytes", p->allocated},
                    {"free_bytes", p->free},
                    {"free_blocks", p->free_blocks},
                    {"free_in_whole_pages_bytes", p->free_in_whole_pages},
                    {"free_in_partial_pages_bytes", p->free_in_partial_pages},
                    {"idle_bytes", p->idle},
                    {"small_pool_reserved_bytes", p->small_reserved},
                    {"small_pool_free_bytes", p->small_free}};
  if (r.page_floor) o["page_floor_bytes"] = *r.page_floor;  // --peak-detail only
  return o;
}

// Prints doc with each element of its "results" (its last key) on a line of its own, so that a result is a
// line to grep; the rest is compact. A name that is not UTF-8 (a file's path) has its bad bytes replaced
// by U+FFFD, so the document stays JSON.
void print_document(Json doc) {
  const Json results = std::move(doc["results"]);
  doc.erase("results");
  std::string out = doc.dump(-1, ' ', false, Json::error_handler_t::replace);
  out.pop_back();  // the closing brace
  out += std::string(doc.empty() ? "" : ",") + "\"results\":[";
  for (std::size_t k = 0; k < results.size(); ++k)
    out += std::string(k ? "," : "") + "\n" + results[k].dump(-1, ' ', false, Json::error_handler_t::replace);
  out += "\n]}\n";
  std::fputs(out.c_str(), stdout);
}

// The answer of one search: its replay's fields and the answer, or the task and why there is none.
template <class Answer>
Json search_results(const std::vector<Answer>& found, auto&& answered, auto&& unanswered, auto&& about) {
  Json results = Json::array();
  for (std::size_t k = 0; k < found.size(); ++k) {
    Json o;
    if (found[k].error.empty()) {
      o = result_json(found[k].at);
      answered(k, o);
    } else {
      unanswered(k, o);
      o["error"] = found[k].error;
    }
    about(k, o);
    results.push_back(std::move(o));
  }
  return results;
}

}  // namespace

void print_replay_json(const std::vector<ReplayResult>& results) {
  Json doc;
  doc["results"] = Json::array();
  for (const auto& r : results) doc["results"].push_back(result_json(r));
  print_document(std::move(doc));
}

void print_fit_json(const std::vector<formats::Trace>& traces, const std::vector<Task>& tasks,
                    const Searches<FitResult>& fits, std::uint64_t step) {
  const auto& found = fits.answers;
  Json doc;
  doc["mode"] = "fit";
  doc["fit_step_bytes"] = step;
  doc["seconds"] = fixed(fits.seconds, 3);
  doc["replays"] = fits.replays;
  doc["results"] = search_results(
      found,
      [&](std::size_t k, Json& o) {
        o["min_capacity_bytes"] = found[k].min_capacity;
        o["replayed_up_to_bytes"] = found[k].top;  // every step from the answer to this fits (fit.h)
      },
      [&](std::size_t k, Json& o) {
        o["input"] = traces[tasks[k].input].source;
        o["device"] = tasks[k].device;
        o["policy"] = policy_name(tasks[k].policy);
        o["min_capacity_bytes"] = nullptr;
      },
      [&](std::size_t k, Json& o) {
        o["fit_replays"] = found[k].replays;
        o["fit_seconds"] = fixed(found[k].seconds, 3);
        o["recorded_ooms"] = found[k].recorded_ooms;
      });
  print_document(std::move(doc));
}

void print_max_json(const std::vector<std::string>& inputs, const std::vector<MaxTask>& tasks,
                    const Searches<MaxResult>& search, const std::string& key, std::uint64_t capacity) {
  const auto& found = search.answers;
  Json doc;
  doc["mode"] = "max";
  doc["key"] = key;
  doc["capacity_bytes"] = capacity;
  doc["seconds"] = fixed(search.seconds, 3);
  doc["replays"] = search.replays;
  doc["results"] = search_results(
      found,
      [&](std::size_t k, Json& o) {
        o["key"] = key;
        o["max_value"] = found[k].max_value;
        o["at_limit"] = found[k].at_limit;  // the largest value the workload accepts (nothing above it to fail)
      },
      [&](std::size_t k, Json& o) {
        o["input"] = inputs[tasks[k].input];
        o["policy"] = policy_name(tasks[k].policy);
        o["capacity_bytes"] = capacity;
        o["key"] = key;
        o["max_value"] = nullptr;
      },
      [&](std::size_t k, Json& o) {
        o["search_replays"] = found[k].replays;
        o["search_seconds"] = fixed(found[k].seconds, 3);
      });
  print_document(std::move(doc));
}

}  // namespace fragless::replay
