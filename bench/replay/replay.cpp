#include "replay.h"

#include <algorithm>
#include <chrono>
#include <unordered_set>

#include "fragless/engine.h"
#include "fragless/flat_table.h"
#include "fragless/rounding.h"
#include "fragless/sim_driver.h"

namespace fragless::replay {

namespace {

// The time of event i on the trace's clock: recorded, else modelled (generated workloads), else none (-1).
std::int64_t event_time(const formats::Trace& t, std::size_t i) {
  if (t.has_time) return t.events[i].time_us;
  return i < t.model_time_us.size() ? t.model_time_us[i] : -1;
}

// Note [Background work in the replay]
// One background worker per device, as in the allocator, on the trace's clock. Work becomes possible when
// the event that queued it happened, and the worker does one thing at a time: before each event at time t
// it runs jobs from max(its own clock, the previous event's time) until t, each job taking its modelled
// driver time (a job started before t may end after it, and the worker is then busy into the next gap).
// Time the worker spends idle is not saved up. A trace without a clock gives it no time at all: its work
// is then never done, and nothing is charged to it.
class BackgroundClock {
 public:
  void advance(DeviceEngine& e, std::int64_t now) {
    if (now < 0) return;
    const double t = static_cast<double>(now);
    if (last_ >= 0) {
      worker_ = std::max(worker_, last_);
      if (worker_ < t) worker_ += e.run_background(t - worker_);
    }
    last_ = t;
  }

 private:
  double last_ = -1, worker_ = 0;  // the previous event's time; the worker's clock (µs)
};

// Note [The page floor]
// Whole-page re-backing (the fragless policy's) can move a page only when no allocated block lies on it, so
// at any moment a policy that backs whole pages holds at least the pages that hold an allocated byte. Their
// most at one moment, with blocks placed where this replay's policy put them, is a floor for any such policy
// that places blocks as this one did: a re-backer that moved every free page at once and at no cost would
// hold exactly it. What a policy holds above its floor is the price of its own choices (cells, idle
// handles, the worker's pace); the floor less what is allocated is the price of the placement (free bytes
// sharing pages with allocated ones). Counted per page of the driver's granularity from each allocated
// block's address and size (a block handed out whole is counted whole: it occupies its pages), the blocks
// seeded before the window included. A block's interior pages are its own (blocks do not overlap), so only
// its first and last page are counted in a table; the interior ones are added and taken away as a number.
class PageFloor {
 public:
  explicit PageFloor(std::uint64_t page) : page_(page) {}
  void add(DevicePtr at, std::uint64_t size) {
    if (!size) return;
    blocks_[at] = size;
    touch(at, size, true);
  }
  void remove(DevicePtr at) {
    const std::uint64_t* size = blocks_.find(at);
    if (!size) return;
    touch(at, *size, false);
    blocks_.erase(at);
  }
  std::int64_t floor() const { return static_cast<std::int64_t>(most_ * page_); }

 private:
  void touch(DevicePtr at, std::uint64_t size, bool add) {
    const std::uint64_t first = at / page_, last = (at + size - 1) / page_;
    const std::uint64_t interior = last > first + 1 ? last - first - 1 : 0;
    if (add) now_ += interior;
    else now_ -= interior;
    edge(first, add);
    if (last != first) edge(last, add);
    most_ = std::max(most_, now_);
  }
  void edge(std::uint64_t pg, bool add) {
    std::uint64_t& n = blocks_on_[pg];
    if (add && n++ == 0) ++now_;
    if (!add && --n == 0) {
      --now_;
      blocks_on_.erase(pg);
    }
  }
  std::uint64_t page_;
  FlatTable<std::uint64_t> blocks_;     // allocated block -> its size (Note [Flat tables])
  FlatTable<std::uint64_t> blocks_on_;  // a block's first or last page -> blocks there
  std::uint64_t now_ = 0, most_ = 0;
};

}  // namespace

// Note [Frees an empty_cache completes]
// A block freed while record_stream'd uses were pending is `free_requested` at the free and `free` (back to
// the cache) when its events completed. An empty_cache waits for every pending event, so the blocks it
// completes go back to the cache inside it, before its release, and are released with everything else;
// but the recorder writes the empty_cache record when the call begins, so their `free` records follow it.
// Replayed in file order they would go back to the cache after the release and stay cached, and the
// replay would reserve less afterwards than the recorded run did. So at an empty_cache the replay first
// frees the blocks whose `free` records follow it directly (the device's next records, each a free of a
// block with a free_requested pending): the frees the call completed, in the order it completed them.
// Returns the addresses freed; their `free` records are then skipped.
std::vector<std::uint64_t> completed_by_empty_cache(const formats::Trace& t, std::size_t at, int device,
                                                    const std::unordered_set<std::uint64_t>& requested) {
  std::vector<std::uint64_t> out;
  for (std::size_t j = at + 1; j < t.events.size(); ++j) {
    const formats::Event& ev = t.events[j];
    if (ev.device != device) continue;
    if (ev.op != formats::Op::free || !requested.count(ev.address)) break;
    out.push_back(ev.address);
  }
  return out;
}

ReplayResult replay(const formats::Trace& t, int device, PolicyKind policy, std::uint64_t capacity) {
  ReplayOptions o;
  o.capacity = capacity;
  return replay(t, device, policy, o);
}

namespace {

// One replay. With opt.peak_detail, `look_at` null: the first moment of the peak is found (r.at_peak's event,
// reserved and live only); `look_at` given (a second replay): the segments are looked at in that moment.
ReplayResult replay_once(const formats::Trace& t, int device, PolicyKind policy, const ReplayOptions& opt,
                         const ReplayResult::PeakDetail* look_at) {
  const std::uint64_t capacity = opt.capacity;
  ReplayResult r;
  r.input = t.source;
  r.device = device;
  r.policy = policy;
  r.capacity = capacity;
  if (static_cast<std::size_t>(device) < t.recorded_peak_reserved.size())
    r.pytorch_recorded_peak_reserved = t.recorded_peak_reserved[static_cast<std::size_t>(device)];
  Options o = opt.base;
  o.policy = policy;
  o.driver = DriverKind::sim;
  // Background work runs on the trace's clock (BackgroundClock below), unless the settings turned it off.
  if (o.background != BackgroundMode::off) o.background = BackgroundMode::manual;
  SimDriverOptions so;
  so.device = device;
  so.capacity = capacity ? capacity : kUnlimitedCapacity;
  so.page_size = o.page_size;  // --conf page_size_mb
  so.top_down = true;
  auto drv = make_sim_driver(so);
  if (opt.costs) drv->set_cost_model(*opt.costs);
  const std::uint64_t page = drv->granularity();
  DeviceEngine e(o, std::move(drv));
  // Checked at the start too, which also has the policy audit each creation from here on (the fragless
  // policy's Note [Auditing creations]); the broken rule is reported at the end.
  if (opt.check) e.check_invariants();
  FlatTable<void*> ptrs;  // trace address -> replayed block (Note [Flat tables])
  std::unordered_set<std::uint64_t> failed;  // trace addresses whose allocation ran out of memory
  // Note [Frees an empty_cache completes]: blocks with a free_requested and no `free` yet; blocks freed at
  // an empty_cache whose `free` record is still to come.
  std::unordered_set<std::uint64_t> requested, completed_early;
  const auto t0 = std::chrono::steady_clock::now();
  // --peak-detail: the first moment of the peak of reserved memory is found by one replay and looked at in a
  // second, which stops there (a look at every new peak made a replay that keeps growing quadratic: 17 s for
  // 320,000 events).
  bool looked = false;
  auto detail_peak = [&](std::uint64_t event, const DeviceEngine::Usage& at) {
    if (!opt.peak_detail) return;
    if (!look_at) {
      if (r.at_peak && at.reserved <= r.at_peak->reserved) return;
      r.at_peak = ReplayResult::PeakDetail{};
      r.at_peak->event = event;
      r.at_peak->reserved = at.reserved;
      r.at_peak->live = at.live;
      return;
    }
    if (looked || event != look_at->event || at.reserved != look_at->reserved) return;
    looked = true;
    ReplayResult::PeakDetail d;
    d.event = event;
    d.reserved = at.reserved;
    d.live = at.live;
    for (const SegmentInfo& sg : e.snapshot())
      for (const BlockInfo& b : sg.blocks) {
        if (b.state == BlockInfo::unmapped) continue;
        const auto size = static_cast<std::int64_t>(b.size);
        if (b.state != BlockInfo::inactive) {
          d.allocated += size;
          continue;
        }
        const std::uint64_t lo = round_up(b.address, page), hi = (b.address + b.size) / page * page;
        const auto whole = static_cast<std::int64_t>(hi > lo ? hi - lo : 0);
        d.free += size;
        ++d.free_blocks;
        d.free_in_whole_pages += whole;
        d.free_in_partial_pages += size - whole;
        if (sg.small) d.small_free += size;
      }
    d.idle = d.reserved - d.allocated - d.free;
    d.small_reserved = e.stats().reserved_bytes.by_pool[kSmallPool].current;
    r.at_peak = d;
  };
  std::optional<PageFloor> floor;
  if (opt.peak_detail && !look_at) floor.emplace(page);
  auto allocated = [&](void* p) {
    if (!floor) return;
    // The block's own size: a growable segment's block is its own base; a classic segment's block is found
    // in its segment (base_allocation would give the whole segment).
    std::size_t size = 0;
    void* base = policy == PolicyKind::classic ? e.allocation_containing(p, &size) : e.base_allocation(p, &size);
    if (base == p) floor->add(reinterpret_cast<DevicePtr>(p), size);
  };
  auto freeing = [&](void* p) {
    if (floor) floor->remove(reinterpret_cast<DevicePtr>(p));
  };
  // The cache shape before the window is the recorded allocator's own state: for the classic policy (the
  // allocator that made these snapshots) each segment PyTorch held is created (a 2 MiB segment holds small
  // blocks) and freed, then the live blocks are allocated into that cache. The other policies start from
  // the live blocks alone: their own history before the window is unknown.
  if (policy == PolicyKind::classic) {
    std::vector<void*> pre;
    for (const auto& s : t.pre_segments)
      if (s.device == device && s.op == formats::Op::segment_alloc)  // classic segments, not mapped ranges
        if (void* p = e.allocate(s.size == (2u << 20) ? 512 : s.size, s.stream, nullptr)) pre.push_back(p);
    for (void* p : pre) e.free(p);
    e.reset_peak_stats();  // peaks count from the window's start
  }
  for (const auto& s : t.seed) {
    if (s.device != device) continue;
    void* p = e.allocate(s.size, s.stream, nullptr);
    if (!p && s.size) {  // an OOM like any other: counted, and the block's free skipped
      ++r.ooms;
      if (opt.stop_at_first_oom) return r;
      failed.insert(s.address);
      continue;
    }
    ptrs[s.address] = p;
    allocated(p);
  }
  {
    const DeviceEngine::Usage at = e.usage();
    r.window_start = {0, 0, at.live, at.allocated, at.reserved};
    r.pre_window = at.reserved > 0;
    detail_peak(0, at);
  }
  e.reset_driver_counters();  // the window's driver calls only
  const auto seed_syncs = e.stats().num_forced_syncs;
  double allocated_integral = 0, reserved_integral = 0;
  std::int64_t last_time = -1, first_time = -1;
  double external_sum = 0;  // external fragmentation summed over the OOMs
  DeviceEngine::Usage u = e.usage();
  std::size_t index = 0;
  const std::size_t stride = opt.curve_points ? std::max<std::size_t>(1, t.events.size() / opt.curve_points) : 0;
  r.curve_in_seconds = t.has_time;
  std::uint64_t unreported = 0;
  ReplayResult::Point bucket{-1, 0, 0, 0, 0};
  BackgroundClock clock;
  r.background_clock = t.has_time || !t.model_time_us.empty();
  for (const auto& ev : t.events) {
    if (looked) return r;  // the second replay of --peak-detail has looked at the peak
    ++index;
    if (ev.device == device) clock.advance(e, event_time(t, index - 1));
    if (stride) {
      bucket.live = std::max(bucket.live, u.live);
      bucket.allocated = std::max(bucket.allocated, u.allocated);
      bucket.reserved = std::max(bucket.reserved, u.reserved);
      if (ev.time_us >= 0 && first_time >= 0) bucket.seconds = static_cast<double>(ev.time_us - first_time) / 1e6;
      if (index % stride == 0) {
        bucket.index = static_cast<double>(index);
        r.curve.push_back(bucket);
        bucket = {bucket.seconds, 0, u.live, u.allocated, u.reserved};
      }
    }
    if (opt.progress && ++unreported == 65536) {
      opt.progress->fetch_add(unreported, std::memory_order_relaxed);
      unreported = 0;
    }
    if (ev.device != device) continue;
    if (ev.op == formats::Op::free_requested) requested.insert(ev.address);  // Note [Frees an empty_cache completes]
    if (ev.op != formats::Op::alloc && ev.op != formats::Op::free && ev.op != formats::Op::empty_cache) continue;
    ++r.events;
    // Time-weighted integrals: trace time where recorded, else one unit per event.
    double dt = 1;
    if (ev.time_us >= 0) {
      if (first_time < 0) first_time = ev.time_us;
      // Rows a little out of order (an RMM log's threads; Note [Times of day in an RMM log]) weigh nothing
      // and do not move the clock back.
      dt = last_time < 0 ? 0 : static_cast<double>(std::max<std::int64_t>(0, ev.time_us - last_time));
      last_time = std::max(last_time, ev.time_us);
    }
    allocated_integral += static_cast<double>(u.allocated) * dt;
    reserved_integral += static_cast<double>(u.reserved) * dt;
    switch (ev.op) {
      case formats::Op::alloc: {
        if (formats::holds_nothing(ev)) break;
        AllocError err;
        void* p = e.allocate(ev.size, ev.stream, &err);
        if (!p && ev.size) {
          if (err.status != Status::out_of_memory) {
            r.error = t.source + ": event " + std::to_string(index) + ": " + err.message;
            return r;
          }
          ++r.ooms;  // a result, not a failure: this allocation and its free are skipped
          {  // what the OOM met: the free cached ranges, the largest against them all
            std::uint64_t largest = 0, total = 0;
            for (const SegmentInfo& sg : e.snapshot())
              for (const BlockInfo& b : sg.blocks)
                if (b.state == BlockInfo::inactive) {
                  largest = std::max<std::uint64_t>(largest, b.size);
                  total += b.size;
                }
            const double x = total ? 1.0 - static_cast<double>(largest) / static_cast<double>(total) : 0.0;
            external_sum += x;
            r.external_fragmentation_at_oom_max = std::max(r.external_fragmentation_at_oom_max, x);
            r.external_fragmentation_at_oom_mean = external_sum / static_cast<double>(r.ooms);
          }
          if (opt.stop_at_first_oom) return r;
          failed.insert(ev.address);
          // The OOM retry may have given cached memory back: the usage the next interval is weighed by.
          u = e.usage();
          detail_peak(r.events, u);
          continue;
        }
        ptrs[ev.address] = p;
        allocated(p);
        break;
      }
      case formats::Op::free: {
        if (formats::holds_nothing(ev)) break;
        requested.erase(ev.address);
        if (completed_early.erase(ev.address)) break;  // freed at the empty_cache it follows
        void** it = ptrs.find(ev.address);
        if (!it) {
          if (failed.erase(ev.address)) continue;  // its allocation failed with OOM
          r.error = t.source + ": event " + std::to_string(index) + ": free of an address never allocated";
          return r;
        }
        freeing(*it);
        e.free(*it);
        ptrs.erase(ev.address);
        break;
      }
      case formats::Op::empty_cache:
        for (std::uint64_t a : completed_by_empty_cache(t, index - 1, device, requested))
          if (void** it = ptrs.find(a)) {
            freeing(*it);
            e.free(*it);
            ptrs.erase(a);
            completed_early.insert(a);
          }
        e.empty_cache();
        break;
      default: break;  // what the recorded allocator did (segments, pages, OOMs): not an instruction to us
    }
    u = e.usage();
    detail_peak(r.events, u);
  }
  if (opt.progress) opt.progress->fetch_add(unreported, std::memory_order_relaxed);
  const auto t1 = std::chrono::steady_clock::now();
  const DeviceStats st = e.stats();
  r.peak_live = st.live_bytes.peak;
  r.peak_allocated = st.allocated_bytes.all().peak;
  r.peak_reserved = st.reserved_bytes.all().peak;
  r.fragmentation_at_peak = st.fragmentation_at_peak();
  r.overhead_over_live = st.overhead_over_live();
  r.time_weighted_fragmentation = reserved_integral > 0 ? 1.0 - allocated_integral / reserved_integral : 0.0;
  r.driver = e.driver_counters();
  if (floor) r.page_floor = floor->floor();
  r.forced_syncs = st.num_forced_syncs - seed_syncs;
  if (t.has_time && last_time >= 0) r.trace_duration_us = static_cast<double>(last_time - first_time);
  if (!t.has_time && !t.model_time_us.empty())
    r.model_duration_us = static_cast<double>(t.model_time_us.back() - t.model_time_us.front());
  r.replay_seconds = std::chrono::duration<double>(t1 - t0).count();
  r.events_per_second = r.replay_seconds > 0 ? static_cast<double>(r.events) / r.replay_seconds : 0;
  if (opt.check)
    if (std::string bad = e.check_invariants(); !bad.empty()) r.error = t.source + ": invariant broken: " + bad;
  return r;
}

}  // namespace

ReplayResult replay(const formats::Trace& t, int device, PolicyKind policy, const ReplayOptions& opt) {
  ReplayResult r = replay_once(t, device, policy, opt, nullptr);
  if (!opt.peak_detail || !r.at_peak || !r.error.empty()) {
    r.at_peak.reset();  // only a moment found, not looked at
    return r;
  }
  // The replay is deterministic (the sim driver, the background on the trace's clock), so a second one with the
  // same settings meets the same moment (`check` included: the checker has the fragless policy audit its
  // creations, which may ask the driver for free memory).
  ReplayOptions again = opt;
  again.curve_points = 0;
  again.progress = nullptr;
  const ReplayResult::PeakDetail moment = *r.at_peak;
  r.at_peak = replay_once(t, device, policy, again, &moment).at_peak;
  if (!r.at_peak)
    r.error = t.source + ": --peak-detail: a second replay did not meet the peak's moment (event " +
              std::to_string(moment.event) + "): the replay is not deterministic";
  return r;
}

}  // namespace fragless::replay
