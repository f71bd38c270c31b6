#include "fit.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <thread>

#include "workload.h"

namespace fragless::replay {

namespace {

struct Probe {
  long long point = 0;
  bool fits = false;
  ReplayResult result;  // whole when it fits; stopped at the first OOM otherwise
};

using ProbeFn = std::function<Probe(long long)>;

// The steps below the top a capacity search replays together (Note [Every step up]).
constexpr std::size_t kScanBatch = 4;
// The most steps a search may have to replay between peak live and the top (each a replay of the whole
// trace): a step far finer than the trace's size (1 MiB steps over a 600 GiB peak: 600,000 replays, days) is
// refused before the first replay, naming the step and the range, rather than left to run.
constexpr long long kMaxScanSteps = 10000;

// Probes every point, up to `parallel` at once (the caller's thread among them).
std::vector<Probe> probe_all(const std::vector<long long>& points, const ProbeFn& f, unsigned parallel) {
  std::vector<Probe> out(points.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i; (i = next++) < points.size();) out[i] = f(points[i]);
  };
  std::vector<std::thread> threads;
  for (unsigned t = 1; t < std::min<std::size_t>(std::max(1u, parallel), points.size()); ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  return out;
}

// Narrows a known pair, `fail` (replayed or proved not to fit) and `pass` (replayed, fits, its probe kept in
// *best), by bisection until they are adjacent: both facts stay true whatever the OOMs do between them
// (Note [Search invariant]). One probe at a time, so the points probed do not depend on --jobs.
bool narrow(long long* fail, long long* pass, Probe* best, const ProbeFn& f, std::string* error) {
  while ((*pass > *fail ? *pass - *fail : *fail - *pass) > 1) {
    const Probe p = f(*fail + (*pass - *fail) / 2);
    if (!p.result.error.empty()) {
      *error = p.result.error;
      return false;
    }
    if (p.fits) {
      *pass = p.point;
      *best = p;
    } else {
      *fail = p.point;
    }
  }
  return true;
}

// The value search's next value: twice v (v + 1 from 0), at most greatest.
long long doubled(long long v, long long greatest) { return std::min(greatest, std::max(v + 1, v * 2)); }

std::string gib_text(std::uint64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4g GiB", static_cast<double>(bytes) / (1ull << 30));
  return b;
}

}  // namespace

FitResult fit_capacity(const formats::Trace& t, int device, PolicyKind policy, std::uint64_t step,
                       const SearchOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  FitResult out;
  out.step = step;
  for (const auto& e : t.events) out.recorded_ooms += e.device == device && e.op == formats::Op::oom;
  std::atomic<int> replays{0};
  auto done = [&](FitResult& r) -> FitResult& {
    r.replays = replays.load();
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  const std::string where = t.source + " (device " + std::to_string(device) + ", " + policy_name(policy) + ")";
  if (step < (1u << 20)) {
    out.error = "--fit-step must be at least 1 MiB";
    return done(out);
  }
  // The replay without a limit: peak live (the floor) and a capacity that holds what this policy reserves.
  ReplayOptions unlimited = o.replay;
  unlimited.capacity = 0;
  unlimited.stop_at_first_oom = false;
  unlimited.curve_points = 0;
  const ReplayResult base = replay(t, device, policy, unlimited);
  ++replays;
  if (!base.error.empty()) {
    out.error = base.error;
    return done(out);
  }
  if (base.events == 0) {
    out.error = where + ": no allocations to replay";
    return done(out);
  }
  if (base.ooms) {
    out.error = where + ": runs out of memory even on " + gib_text(kUnlimitedCapacity) +
                ", the largest device the replay models (--capacity-gib's most), so no capacity fits";
    return done(out);
  }
  out.peak_live = base.peak_live;
  const long long max_k = static_cast<long long>(kUnlimitedCapacity / step);
  auto probe = [&](long long k) {
    ReplayOptions ro = o.replay;
    ro.capacity = static_cast<std::uint64_t>(k) * step;
    ro.stop_at_first_oom = true;
    Probe p;
    p.point = k;
    p.result = replay(t, device, policy, ro);
    ++replays;
    p.fits = p.result.error.empty() && p.result.ooms == 0;
    return p;
  };
  const auto live = static_cast<std::uint64_t>(std::max<std::int64_t>(base.peak_live, 1));
  // fail: the largest k with k * step < peak live, which no allocator fits (not yet replayed);
  // top: the first step from which this policy runs as without a limit (Note [Above the top]).
  long long fail = static_cast<long long>((live + step - 1) / step) - 1;
  bool fail_replayed = fail == 0;  // capacity 0 holds nothing: no replay needed (nor possible: 0 = unlimited)
  double unlimited_from = static_cast<double>(base.peak_reserved);
  const Options& conf = o.replay.base;
  if (conf.per_process_memory_fraction < 1.0 && conf.per_process_memory_fraction > 0.0) {
    unlimited_from /= conf.per_process_memory_fraction;
    if (policy == PolicyKind::classic && conf.garbage_collection_threshold > 0.0)
      unlimited_from /= conf.garbage_collection_threshold;
  }
  if (policy == PolicyKind::fragless) unlimited_from *= 2;  // its near-limit rule (Note [Above the top])
  long long top = static_cast<long long>(
      std::min<double>(static_cast<double>(max_k), std::ceil(unlimited_from / static_cast<double>(step))));
  top = std::max(top, fail + 1);
  if (top - fail > kMaxScanSteps) {
    out.error = where + ": " + std::to_string(top - fail) + " steps of " + gib_text(step) + " between its peak live " +
                "bytes (" + gib_text(static_cast<std::uint64_t>(fail + 1) * step) + ") and where it runs as without a " +
                "limit (" + gib_text(static_cast<std::uint64_t>(top) * step) + ") could each need a replay, more than " +
                std::to_string(kMaxScanSteps) + ": give a larger --fit-step";
    return done(out);
  }
  Probe best = probe(top);
  while (!best.fits) {
    if (!best.result.error.empty()) {
      out.error = best.result.error;
      return done(out);
    }
    fail = top;
    fail_replayed = true;
    if (top >= max_k) {
      out.error = where + ": the search cannot converge: it still runs out of memory on " +
                  gib_text(static_cast<std::uint64_t>(top) * step);
      return done(out);
    }
    top = std::min(max_k, top * 2);
    best = probe(top);
  }
  out.top = static_cast<std::uint64_t>(top) * step;
  // Every step below the top, downwards in batches of kScanBatch taken in order, until one runs out of
  // memory: that is the neighbour, and the answer is the step above it (Note [Every step up]). A batch is
  // replayed whole, up to `parallel` at once, so neither the answer nor the replays made depend on --jobs.
  long long pass = top;
  for (long long k = top - 1; k > fail && pass == k + 1;) {
    std::vector<long long> points;
    for (; k > fail && points.size() < kScanBatch; --k) points.push_back(k);
    const auto probes = probe_all(points, probe, o.parallel);
    for (const auto& p : probes) {
      if (!p.result.error.empty()) {
        out.error = p.result.error;
        return done(out);
      }
      if (!p.fits) {
        fail = p.point;
        fail_replayed = true;
        break;
      }
      pass = p.point;
      best = p;
    }
  }
  if (!fail_replayed) {
    // The neighbour below is replayed too, so its OOM is measured, not inferred.
    Probe below = probe(fail);
    if (!below.result.error.empty()) {
      out.error = below.result.error;
      return done(out);
    }
    if (below.fits) {  // below peak live: cannot happen; kept so a broken bound never yields a wrong answer
      out.error = where + ": fits on " + gib_text(static_cast<std::uint64_t>(fail) * step) +
                  ", below its peak live bytes: the replay is inconsistent";
      return done(out);
    }
  }
  out.min_capacity = static_cast<std::uint64_t>(pass) * step;
  out.at = best.result;
  return done(out);
}

MaxResult max_value(const std::string& spec, const std::string& key, PolicyKind policy, std::uint64_t capacity,
                    const SearchOptions& o, const std::vector<int>* lengths) {
  const auto t0 = std::chrono::steady_clock::now();
  MaxResult out;
  out.spec = spec;
  out.key = key;
  std::atomic<int> replays{0};
  auto done = [&](MaxResult& r) -> MaxResult& {
    r.replays = replays.load();
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  if (capacity == 0) {
    out.error = "--max-of needs a device capacity (--capacity-gib N)";
    return done(out);
  }
  if (!workload_key_range(spec, key, &out.least, &out.greatest, &out.error, &out.capped)) return done(out);
  const std::string where = spec + " (" + policy_name(policy) + ", " + gib_text(capacity) + ")";
  auto probe = [&](long long v) {
    Probe p;
    p.point = v;
    formats::Trace t;
    std::string err;
    bool too_large = false;
    if (!make_workload(workload_with(spec, key, v), &t, &err, lengths, &too_large)) {
      p.result.error = too_large ? where + ": at " + key + "=" + std::to_string(v) + " " + err +
                                       ": the search cannot converge"
                                 : err;
      return p;
    }
    ReplayOptions ro = o.replay;
    ro.capacity = capacity;
    ro.stop_at_first_oom = true;
    p.result = replay(t, 0, policy, ro);
    ++replays;
    p.fits = p.result.error.empty() && p.result.ooms == 0;
    return p;
  };
  Probe best = probe(out.least);
  if (!best.result.error.empty()) {
    out.error = best.result.error;
    return done(out);
  }
  if (!best.fits) {
    // A key whose memory falls as it grows (fsdp's world, a checkpointing switch) is no question for this
    // search: say so rather than ask for a larger device.
    // Four doublings at most, so that a key whose workloads grow fast with it (steps, layers) costs little.
    for (long long v = out.least, n = 0; n < 4 && v < out.greatest; ++n) {
      v = doubled(v, out.greatest);
      const Probe larger = probe(v);
      if (!larger.result.error.empty()) break;
      if (larger.fits) {
        out.error = where + ": does not fit at its smallest " + key + "=" + std::to_string(out.least) +
                    " but fits at " + key + "=" + std::to_string(v) + ": its memory does not grow with " + key +
                    ", and --max-of searches for the largest value of a key whose memory does";
        return done(out);
      }
    }
    out.error = where + ": does not fit at its smallest " + key + "=" + std::to_string(out.least) +
                " (a larger device, or a smaller model, is needed)";
    return done(out);
  }
  // Grow by doubling until a value does not fit, one probe at a time (the values probed, and so the
  // boundary found, do not depend on --jobs).
  long long pass = out.least, fail = -1;
  while (fail < 0) {
    if (pass >= out.greatest) {
      if (!out.capped) {  // the largest value the workload accepts fits: that is the answer
        out.max_value = pass;
        out.at = best.result;
        out.at.input = spec;
        out.at_limit = true;
        return done(out);
      }
      out.error = where + ": the search cannot converge: it still fits at " + key + "=" + std::to_string(pass) +
                  ", where the search stops (the workload takes larger values; " + key +
                  " does not bound memory here)";
      return done(out);
    }
    const Probe p = probe(doubled(pass, out.greatest));
    if (!p.result.error.empty()) {
      out.error = p.result.error;
      return done(out);
    }
    if (p.fits) {
      pass = p.point;
      best = p;
    } else {
      fail = p.point;
    }
  }
  if (!narrow(&fail, &pass, &best, probe, &out.error)) return done(out);
  out.max_value = pass;
  out.at = best.result;
  out.at.input = spec;
  return done(out);
}

}  // namespace fragless::replay
