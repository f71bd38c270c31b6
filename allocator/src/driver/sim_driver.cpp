// sim driver: numbers instead of memory. Fast enough for millions of events per second in the replay.
#include "fragless/sim_driver.h"
#include "fragless/spin_mutex.h"
#include "driver/handle_ids.h"
#include "driver/registry.h"

#include <mutex>
#include <vector>

namespace fragless {
namespace {

class SimDriver final : public Driver {
 public:
  explicit SimDriver(const SimDriverOptions& o)
      : Driver(o.device, o.page_size), capacity_(o.capacity), top_down_(o.top_down), on_query_(o.on_memory_info) {}
  const char* name() const override { return "sim"; }
  TestEvents& events() { return events_; }
  // Its calls may run on two threads at once: its own state is under its own lock (a SpinMutex, which an
  // uncontended call takes for a compare-exchange where a std::mutex costs a call into the C library, each
  // replayed driver call otherwise paying for the base class's impl lock too), its events under theirs.
  bool concurrent_calls() const override { return true; }

  void do_memory_info(std::size_t* free_bytes, std::size_t* total_bytes) override {
    if (on_query_) on_query_(true);
    {
      std::lock_guard lk(mu_);
      *free_bytes = capacity_ - used_;
      *total_bytes = capacity_;
    }
    if (on_query_) on_query_(false);
  }

 private:
  // Note [The sim driver's address space]: reservations are handed out top down from a window of about 8 EiB,
  // without reuse, so that the same requests get the same addresses whatever was freed before them. A growable
  // segment reserves 9/8 of the device, 1.125 TiB on the replay's unlimited device: with the 112 TiB window
  // this had until 2026-12-06, a run that made a hundred segments (empty_cache in a loop, many streams) ran out
  // of address space, and an unlimited replay reported OOMs a small device does not have. Only addresses'
  // order decides anything (best-fit ties), so the larger window changed no decision. Once it is used up, a
  // freed reservation of the same size or larger is taken again (the highest first).
  Status do_reserve(std::size_t size, DevicePtr* va) override {
    std::lock_guard lk(mu_);
    const std::size_t g = granularity();
    if (top_down_) {
      const std::size_t span = (size + g - 1) / g * g + g;  // a guard page between reservations
      if (span > next_down_ - 0x100000000000ull) {
        auto best = freed_.end();
        for (auto it = freed_.begin(); it != freed_.end(); ++it)
          if (it->second >= span && (best == freed_.end() || it->first > best->first)) best = it;
        if (best == freed_.end()) {
          set_error("reserve: out of address space (sim, top down)");
          return Status::out_of_memory;
        }
        *va = best->first + (best->second - span);  // the top of the freed range, as the window grows down
        if ((best->second -= span) == 0) freed_.erase(best);
        return Status::ok;
      }
      next_down_ -= span;
      *va = next_down_;
      return Status::ok;
    }
    next_va_ = (next_va_ + g - 1) / g * g;
    *va = next_va_;
    next_va_ += size + g;  // a guard page between reservations catches overruns in the checker
    return Status::ok;
  }
  Status do_free_reservation(DevicePtr va, std::size_t size) override {
    if (!top_down_) return Status::ok;
    std::lock_guard lk(mu_);
    const std::size_t g = granularity();
    freed_.emplace_back(va, (size + g - 1) / g * g + g);  // with its guard page
    return Status::ok;
  }
  Status do_create(std::size_t size, PhysHandle* h) override {
    std::lock_guard lk(mu_);
    if (size > capacity_ - used_) {
      set_error("create: out of memory (sim capacity " + std::to_string(capacity_) + " bytes)");
      return Status::out_of_memory;
    }
    used_ += size;
    *h = ids_.take();
    if (*h >= sizes_.size()) sizes_.resize(*h + 1);
    sizes_[*h] = size;
    return Status::ok;
  }
  // The base class checked the handle (R8); its memory goes once nothing maps it.
  Status do_release(PhysHandle) override { return Status::ok; }
  void memory_gone(PhysHandle h) override {
    std::lock_guard lk(mu_);
    used_ -= sizes_[h];
    sizes_[h] = 0;
    ids_.gone(h);
  }
  Status do_map(DevicePtr, std::size_t, PhysHandle, std::size_t) override { return Status::ok; }
  Status do_unmap(DevicePtr, std::size_t) override { return Status::ok; }
  Status do_set_access(DevicePtr, std::size_t) override { return Status::ok; }
  Status do_record_event(Stream s, Event* e) override {
    *e = events_.record(s);
    return Status::ok;
  }
  Status do_query_event(Event e) override { return events_.query(e); }
  Status do_synchronize_event(Event e) override {
    events_.synchronize(e);
    return Status::ok;
  }
  Status do_release_event(Event e) override {
    events_.release(e);
    return Status::ok;
  }
  Status do_stream_wait_event(Stream s, Event e) override {
    events_.wait(s, e);
    return Status::ok;
  }
  Status do_synchronize_stream(Stream s) override {
    events_.synchronize_stream(s);
    return Status::ok;
  }
  Status do_synchronize_device() override {
    events_.synchronize_all();
    return Status::ok;
  }

  mutable SpinMutex mu_;  // everything below but the events
  std::size_t capacity_;
  std::size_t used_ = 0;
  DevicePtr next_va_ = 0x7f0000000000ull;
  DevicePtr next_down_ = 0x7ff0000000000000ull;  // Note [The sim driver's address space]
  bool top_down_ = false;
  std::vector<std::pair<DevicePtr, std::size_t>> freed_;  // top down: freed reservations with their guard page
  std::function<void(bool)> on_query_;  // SimDriverOptions::on_memory_info
  HandleIds ids_;
  // By handle value: the values are small, and come back as handles go (handle_ids.h), so the table is as long as
  // the most handles ever held at once.
  std::vector<std::size_t> sizes_;
  TestEvents events_;
};

}  // namespace

std::unique_ptr<Driver> make_sim_driver(const SimDriverOptions& opts) { return std::make_unique<SimDriver>(opts); }

TestEvents* sim_test_events(Driver& d) {
  auto* s = dynamic_cast<SimDriver*>(&d);
  return s ? &s->events() : nullptr;
}

// The registry's entry (driver/registry.h): the options the sim driver reads.
std::unique_ptr<Driver> make_sim_driver_for(const Options& o, int device, std::string*) {
  SimDriverOptions s;
  s.device = device;
  s.page_size = o.page_size;
  if (o.capacity) s.capacity = o.capacity;
  return make_sim_driver(s);
}

}  // namespace fragless
