// fragless-trace: inspect, convert and summarise allocation traces in any supported format
// (fragless native, RAPIDS RMM log CSV, PyTorch memory snapshot pickle).
//
//   fragless-trace info FILE...
//   fragless-trace convert IN OUT [--to native|rmm|snapshot] [--device N]
//   fragless-trace summary FILE [--json] [--points N]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "trace_model.h"

using namespace fragless::formats;
using json = nlohmann::ordered_json;

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "fragless-trace: %s\n", msg.c_str());
  return 2;
}

bool load(const std::string& path, Trace* t, std::string* error, Format* format = nullptr,
          std::string* dropped_note = nullptr) {
  auto r = load_trace(path);
  if (!r.ok) {
    *error = r.error;
    return false;
  }
  if (!r.warning.empty()) std::fprintf(stderr, "fragless-trace: warning: %s\n", r.warning.c_str());
  if (!r.dropped.empty() && dropped_note) *dropped_note = r.dropped;
  *t = std::move(r.trace);
  if (format) *format = r.format;
  return true;
}

std::string size_bucket(std::uint64_t s) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  std::uint64_t b = 512;
  while (b < s) b <<= 1;
  int u = 0;
  std::uint64_t v = b;
  while (v >= 1024 && u < 4) v >>= 10, ++u;
  return "<=" + std::to_string(v) + " " + units[u];
}

std::string hex(std::uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%" PRIx64, v);
  return b;
}

json summarise(const Trace& t, int points) {
  json out;
  out["source"] = t.source;
  out["devices"] = json::array();
  for (int d = 0; d < t.devices(); ++d) {
    std::map<std::uint64_t, std::pair<std::string, std::uint64_t>> hist;  // bucket upper bound -> (label, count)
    struct PerStream { std::uint64_t allocs = 0, frees = 0, bytes = 0; };
    std::map<std::uint64_t, PerStream> streams;
    std::unordered_map<std::uint64_t, std::uint64_t> live;
    std::int64_t live_bytes = 0, peak = 0, peak_time = -1;
    std::uint64_t peak_index = 0, n = 0, allocs = 0, frees = 0, segment_events = 0, ooms = 0, empty_caches = 0;
    std::int64_t first_time = -1, last_time = -1;
    for (auto& s : t.seed)
      if (s.device == d) live[s.address] = s.size, live_bytes += static_cast<std::int64_t>(s.size);
    const std::int64_t seed_bytes = live_bytes;
    peak = live_bytes;
    std::vector<const Event*> evs;
    for (auto& e : t.events)
      if (e.device == d) evs.push_back(&e);
    // The curve: events in stretches of `step`, at most `points` of them, each drawn at its largest live bytes
    // (the event and time where it was), so that no peak among the events falls between two points. (What was
    // live before the first event is live_before_window_bytes, not a point: a peak there is the curve's start.)
    json curve = json::array();
    const auto wanted = static_cast<std::size_t>(std::max(points, 1));
    const std::size_t step = std::max<std::size_t>(1, (evs.size() + wanted - 1) / wanted);
    std::int64_t stretch_max = -1, stretch_time = -1;
    std::uint64_t stretch_at = 0;
    for (const Event* e : evs) {
      if (e->time_us >= 0) {
        if (first_time < 0) first_time = e->time_us;
        last_time = e->time_us;
      }
      switch (e->op) {
        case Op::alloc: {
          ++allocs;
          live[e->address] = e->size;
          live_bytes += static_cast<std::int64_t>(e->size);
          auto& st = streams[e->stream];
          ++st.allocs;
          st.bytes += e->size;
          std::uint64_t b = 512;
          while (b < e->size) b <<= 1;
          auto& h = hist[b];
          if (h.first.empty()) h.first = size_bucket(e->size);
          ++h.second;
          if (live_bytes > peak) peak = live_bytes, peak_index = n, peak_time = e->time_us;
          break;
        }
        case Op::free: {
          ++frees;
          ++streams[e->stream].frees;
          auto it = live.find(e->address);
          if (it != live.end()) live_bytes -= static_cast<std::int64_t>(it->second), live.erase(it);
          break;
        }
        case Op::oom: ++ooms; break;
        case Op::empty_cache: ++empty_caches; break;
        default: segment_events += is_segment_op(e->op); break;
      }
      if (live_bytes > stretch_max) stretch_max = live_bytes, stretch_at = n, stretch_time = e->time_us;
      ++n;
      if (n % step == 0 || n == evs.size()) {
        curve.push_back({{"event", stretch_at}, {"time_us", stretch_time}, {"live_bytes", stretch_max}});
        stretch_max = -1;
      }
    }
    json dj;
    dj["device"] = d;
    dj["events"] = n;
    dj["allocs"] = allocs;
    dj["frees"] = frees;
    dj["segment_events"] = segment_events;
    dj["ooms"] = ooms;
    dj["empty_cache_calls"] = empty_caches;
    dj["live_before_window_bytes"] = seed_bytes;
    dj["peak_live_bytes"] = peak;
    dj["peak_live_event"] = peak_index;
    dj["peak_live_time_us"] = peak_time >= 0 ? json(peak_time) : json(nullptr);
    dj["live_at_end_bytes"] = live_bytes;
    dj["duration_us"] = first_time >= 0 ? json(last_time - first_time) : json(nullptr);
    if (static_cast<std::size_t>(d) < t.recorded_peak_reserved.size() && t.recorded_peak_reserved[static_cast<std::size_t>(d)])
      dj["pytorch_recorded_peak_reserved_bytes"] = *t.recorded_peak_reserved[static_cast<std::size_t>(d)];
    else
      dj["pytorch_recorded_peak_reserved_bytes"] = nullptr;
    json hj = json::array();
    for (auto& [b, h] : hist) hj.push_back({{"bucket", h.first}, {"upper_bytes", b}, {"allocs", h.second}});
    dj["size_histogram"] = hj;
    json sj = json::array();
    for (auto& [s, st] : streams)
      sj.push_back({{"stream", hex(s)}, {"allocs", st.allocs}, {"frees", st.frees}, {"bytes_allocated", st.bytes}});
    dj["streams"] = sj;
    dj["live_bytes_curve"] = curve;
    out["devices"].push_back(dj);
  }
  return out;
}

double mib(double b) { return b / (1 << 20); }

void print_summary(const json& s) {
  std::printf("%s\n", s["source"].get<std::string>().c_str());
  for (auto& d : s["devices"]) {
    // A device with neither events nor memory is left out; one whose snapshot holds blocks but no history is
    // shown with what is known of it.
    if (d["events"].get<std::uint64_t>() == 0 && d["live_before_window_bytes"].get<std::int64_t>() == 0 &&
        d["pytorch_recorded_peak_reserved_bytes"].is_null())
      continue;
    std::printf("device %d: %" PRIu64 " events (%" PRIu64 " allocs, %" PRIu64 " frees, %" PRIu64 " segment events, %" PRIu64
                " OOMs, %" PRIu64 " empty_cache)\n",
                d["device"].get<int>(), d["events"].get<std::uint64_t>(), d["allocs"].get<std::uint64_t>(),
                d["frees"].get<std::uint64_t>(), d["segment_events"].get<std::uint64_t>(), d["ooms"].get<std::uint64_t>(),
                d["empty_cache_calls"].get<std::uint64_t>());
    std::printf("  peak live %.1f MiB at event %" PRIu64 "; live before the window %.1f MiB, at the end %.1f MiB\n",
                mib(d["peak_live_bytes"].get<double>()), d["peak_live_event"].get<std::uint64_t>(),
                mib(d["live_before_window_bytes"].get<double>()), mib(d["live_at_end_bytes"].get<double>()));
    if (!d["duration_us"].is_null()) std::printf("  duration %.3f s\n", d["duration_us"].get<double>() / 1e6);
    if (!d["pytorch_recorded_peak_reserved_bytes"].is_null())
      std::printf("  PyTorch's recorded peak reserved %.1f MiB\n", mib(d["pytorch_recorded_peak_reserved_bytes"].get<double>()));
    std::printf("  sizes:\n");
    for (auto& h : d["size_histogram"])
      std::printf("    %-12s %10" PRIu64 "\n", h["bucket"].get<std::string>().c_str(), h["allocs"].get<std::uint64_t>());
    std::printf("  streams:\n");
    for (auto& st : d["streams"])
      std::printf("    %-18s %10" PRIu64 " allocs %10" PRIu64 " frees %12.1f MiB allocated\n",
                  st["stream"].get<std::string>().c_str(), st["allocs"].get<std::uint64_t>(), st["frees"].get<std::uint64_t>(),
                  mib(st["bytes_allocated"].get<double>()));
  }
}

// The devices a trace has events or blocks on, ascending.
std::vector<int> devices_of(const Trace& t) {
  std::set<int> d;
  for (const auto& e : t.events) d.insert(e.device);
  for (const auto& e : t.seed) d.insert(e.device);
  for (const auto& e : t.pre_segments) d.insert(e.device);
  return {d.begin(), d.end()};
}

std::string list(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

// What converting `t` to format `f` loses besides what its reader dropped: events the target has no entry for
// (an RMM log keeps allocations and frees of one device; a snapshot has no empty_cache call nor physical
// handle), counted per kind; empty when nothing is lost.
std::string events_not_kept(const Trace& t, Format f, int device) {
  if (f == Format::native) return {};  // the native format holds every kind of event
  std::map<Op, std::uint64_t> lost;
  for (const auto& e : t.events) {
    if (f == Format::rmm_csv && e.device != device) continue;  // other devices: said on their own line
    const bool kept = f == Format::rmm_csv ? e.op == Op::alloc || e.op == Op::free || e.op == Op::oom
                                           : e.op != Op::empty_cache && e.op != Op::phys_create && e.op != Op::phys_release;
    if (!kept) ++lost[e.op];
  }
  if (lost.empty()) return {};
  std::string counts;
  for (const auto& [op, n] : lost) counts += (counts.empty() ? "" : ", ") + std::to_string(n) + " " + op_name(op);
  return counts + (f == Format::rmm_csv ? " events (an RMM log has allocate, allocate failure and free rows only)"
                                        : " events (a PyTorch snapshot has no such entries)");
}

// A validator for a whole number in [lo, hi], written in decimal digits only (CLI11 alone would take 0x10 as
// 16, as no option of fragless-replay does), said in those words.
CLI::Validator decimal_in(long lo, long hi, const std::string& what, const std::string& name) {
  return CLI::Validator(
      [=](std::string& v) -> std::string {
        std::size_t used = 0;
        long n = -1;
        try {
          n = v.find_first_not_of("0123456789") == std::string::npos ? std::stol(v, &used) : -1;
        } catch (const std::exception&) {
          used = 0;
        }
        if (v.empty() || used != v.size() || n < lo || n > hi)
          return "'" + v + "' is not " + what + " (an integer from " + std::to_string(lo) + " to " + std::to_string(hi) + ")";
        return {};
      },
      name);
}
// --device: one a trace can hold (kMaxDevices, Note [One set of bounds for every format]).
CLI::Validator device_index() { return decimal_in(0, kMaxDevices - 1, "a device index", "DEVICE"); }

}  // namespace

int run(int argc, char** argv) {
  // An unknown command is named as such (CLI11 would report its arguments as unexpected).
  if (argc > 1 && argv[1][0] != '-' && std::strcmp(argv[1], "info") != 0 && std::strcmp(argv[1], "convert") != 0 &&
      std::strcmp(argv[1], "summary") != 0)
    return fail(std::string("unknown command '") + argv[1] + "' (commands: info, convert, summary; --help for more)");
  CLI::App app{"fragless-trace: inspect, convert and summarise allocation traces "
               "(fragless native, RMM log CSV, PyTorch memory snapshot pickle; detected from content)"};
  app.require_subcommand(1);

  std::vector<std::string> info_files;
  auto* info = app.add_subcommand("info", "Format, devices, event counts and time span of each trace");
  info->add_option("files", info_files, "trace files")->required();

  std::string in, out, to;
  int device = 0;
  auto* convert = app.add_subcommand("convert", "Convert a trace to another format (from OUT's extension or --to)");
  convert->add_option("input", in, "trace file")->required();
  convert->add_option("output", out,
                      "output file (.fgt native, .csv RMM, .pickle PyTorch snapshot), replaced atomically (written "
                      "beside it, then renamed over it); a symbolic link is followed to its target; an existing "
                      "FIFO, device or socket is refused")
      ->required();
  convert->add_option("--to", to, "native, rmm or snapshot")->check(CLI::IsMember({"native", "rmm", "csv", "snapshot", "pickle"}));
  auto* device_opt = convert->add_option("--device", device, "device to write to an RMM log (which holds one device; "
                                                            "default: the trace's first)")
                         ->check(device_index());

  std::string sum_file;
  bool as_json = false;
  int points = 200;
  auto* summary = app.add_subcommand("summary", "Size histogram, live-bytes curve, peaks, per-stream counts");
  summary->add_option("file", sum_file, "trace file")->required();
  summary->add_flag("--json", as_json, "one JSON document on stdout");
  auto* points_opt = summary->add_option("--points", points, "with --json: at most this many points of the live-bytes "
                                          "curve, each the largest value of its stretch of events")
                         ->check(decimal_in(1, 1000000, "a number of points", "N"));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // Said as every other error of the tool is: named, on one line, then where the usage is. CLI11's words for
    // a missing command or argument are put in the tool's own.
    std::string what = e.what();
    static const std::pair<const char*, const char*> kMissing[] = {
        {"A subcommand is required", "no command given: info, convert or summary"},
        {"files is required", "info needs one or more trace files"},
        {"input is required", "convert needs an input trace and an output file"},
        {"output is required", "convert needs an output file after the input trace"},
        {"file is required", "summary needs a trace file"}};
    for (const auto& [cli, ours] : kMissing)
      if (what == cli) what = ours;
    std::fprintf(stderr, "fragless-trace: %s\n(fragless-trace --help lists the commands; COMMAND --help its options)\n",
                 what.c_str());
    return 2;
  }

  std::string err;
  if (*info) {
    for (auto& f : info_files) {
      Trace t;
      Format fmt = Format::native;
      if (!load(f, &t, &err, &fmt)) return fail(err);
      std::uint64_t by_op[12] = {};
      for (auto& e : t.events) ++by_op[static_cast<int>(e.op)];
      std::int64_t t0 = -1, t1 = -1;
      for (auto& e : t.events)
        if (e.time_us >= 0) {
          // The earliest, not the first: devices sharing a native file interleave it in chunks of records.
          t0 = t0 < 0 ? e.time_us : std::min(t0, e.time_us);
          t1 = std::max(t1, e.time_us);
        }
      const std::uint64_t replayed = by_op[static_cast<int>(Op::alloc)] + by_op[static_cast<int>(Op::free)] +
                                     by_op[static_cast<int>(Op::empty_cache)];
      std::printf("%s\n  format %s, %d device(s), %zu events of every kind (%" PRIu64
                  " of them allocs, frees and empty_cache calls: what fragless-replay replays, its 'events' column), "
                  "%zu allocations live before the window\n",
                  f.c_str(), format_name(fmt), t.devices(), t.events.size(), replayed, t.seed.size());
      std::printf("  ");
      for (int op = 0; op < 12; ++op)
        if (by_op[op]) std::printf("%s %" PRIu64 "  ", op_name(static_cast<Op>(op)), by_op[op]);
      std::printf("\n");
      if (t0 >= 0) std::printf("  time span %.6f s\n", static_cast<double>(t1 - t0) / 1e6);
      else std::printf("  no timestamps\n");
    }
    return 0;
  }
  if (*convert) {
    Format f;
    if (!to.empty()) parse_format(to, &f);
    else if (!format_from_extension(out, &f))
      return fail("cannot tell the output format from '" + out + "'; use --to native|rmm|snapshot");
    if (device_opt->count() && f != Format::rmm_csv)
      return fail(std::string("--device chooses the device of an RMM log; a ") + format_name(f) +
                  " file holds every device of the trace");
    if (!output_spares_inputs(out, {in}, &err)) return fail(err);  // Note [An output never replaces an input]
    Trace t;
    std::string dropped;
    if (!load(in, &t, &err, nullptr, &dropped)) return fail(err);
    const std::vector<int> devices = devices_of(t);
    if (f == Format::rmm_csv) {
      if (device_opt->count() && std::find(devices.begin(), devices.end(), device) == devices.end())
        return fail(in + " has no device " + std::to_string(device) + " (its devices: " +
                    (devices.empty() ? std::string("none, it has no events") : list(devices)) + ")");
      // By default the first device with events (an RMM log is a list of events), else the first with blocks.
      if (!device_opt->count() && !devices.empty()) {
        int first_with_events = -1;
        for (const auto& e : t.events)
          if (first_with_events < 0 || e.device < first_with_events) first_with_events = e.device;
        device = first_with_events >= 0 ? first_with_events : devices.front();
      }
    }
    std::string bytes, times_lost;
    switch (f) {
      case Format::native: bytes = trace_to_native(t); break;
      case Format::rmm_csv: bytes = trace_to_rmm_csv(t, device, &times_lost); break;
      case Format::snapshot: bytes = trace_to_snapshot(t); break;
    }
    std::vector<std::string> lost;
    if (!times_lost.empty()) lost.push_back(times_lost);
    if (!dropped.empty())
      lost.push_back(dropped + " (the fragless trace model holds allocation events, segments and blocks, not their "
                               "context)");
    if (std::string events = events_not_kept(t, f, device); !events.empty()) lost.push_back(events);
    // The cache a classic replay starts from. A snapshot written here marks its segments as rebuilt from the
    // events (they are not what an allocator recorded), so its reader starts classic from an empty cache.
    if (f != Format::native && !t.pre_segments.empty()) {
      std::uint64_t bytes = 0;
      for (const auto& e : t.pre_segments) bytes += e.size;
      lost.push_back("the " + std::to_string(t.pre_segments.size()) +
                     (t.pre_segments.size() == 1 ? " segment (" : " segments (") +
                     std::to_string(bytes >> 20) + " MiB) the allocator held when the window began, which " +
                     "classic's replay starts from (" +
                     (f == Format::snapshot ? "the snapshot's segments are rebuilt from the events"
                                            : "an RMM log has no segments") +
                     ", so classic replays it from an empty cache)");
    }
    if (!lost.empty()) {
      std::string text;
      for (const auto& item : lost) text += (text.empty() ? "" : "; ") + item;
      std::fprintf(stderr, "fragless-trace: note: not kept in %s: %s\n", out.c_str(), text.c_str());
    }
    if (f == Format::rmm_csv && !t.has_time)
      std::fprintf(stderr,
                   "fragless-trace: note: %s has no timestamps; the RMM log's times count its events (one microsecond "
                   "each, in order), so a replay weighs them as it weighs the original's\n",
                   in.c_str());
    if (f == Format::rmm_csv) {
      std::size_t seeded = 0;
      for (const auto& e : t.seed) seeded += e.device == device;
      if (seeded)
        std::fprintf(stderr,
                     "fragless-trace: note: the %zu allocation%s live before %s's first event %s written to %s as "
                     "allocations at that event's time (an RMM log has no blocks that were already there), so it "
                     "holds %zu more allocate rows than the input has allocations\n",
                     seeded, seeded == 1 ? "" : "s", in.c_str(), seeded == 1 ? "is" : "are", out.c_str(), seeded);
    }
    if (f == Format::rmm_csv && devices.size() > 1)
      std::fprintf(stderr, "fragless-trace: %s has devices %s; an RMM log holds one: writing device %d (--device)\n",
                   in.c_str(), list(devices).c_str(), device);
    // What is written must read back (Note [One set of bounds for every format]): a trace the readers took
    // converts to a file they take, and a conversion that would break that says so instead of writing it.
    if (const LoadResult back = trace_from_bytes(bytes, out); !back.ok)
      return fail("converting " + in + " would write a file its reader refuses (" + back.error + "); nothing written");
    if (!write_file(out, bytes, &err)) return fail(err);
    std::fprintf(stderr, "fragless-trace: wrote %s (%s, %zu bytes)\n", out.c_str(), format_name(f), bytes.size());
    return 0;
  }
  if (*summary) {
    if (points_opt->count() && !as_json)
      return fail("summary --points shapes the live-bytes curve of --json's output (the text has none): add --json");
    Trace t;
    if (!load(sum_file, &t, &err)) return fail(err);
    const json s = summarise(t, points);
    if (as_json) std::printf("%s\n", s.dump().c_str());
    else print_summary(s);
    return 0;
  }
  return 2;
}

// Note [Output that could not be written]
// What a command prints on stdout is its answer: if any of it could not be written (a full disk, a file size
// limit, a closed pipe), the command fails, saying so on stderr, instead of leaving a cut answer with status 0.
int main(int argc, char** argv) {
  const int rc = run(argc, argv);
  if (std::fflush(stdout) != 0 || std::ferror(stdout))
    return fail(std::string("cannot write the output to stdout (") + std::strerror(errno) + ")");
  return rc;
}
