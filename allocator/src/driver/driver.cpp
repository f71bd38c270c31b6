#include "fragless/driver.h"

#include <algorithm>
#include <atomic>
#include <mutex>

namespace fragless {

Stream per_thread_stream() {
  static std::atomic<Stream> next{1};
  thread_local const Stream key = (Stream{0xF} << 60) | next.fetch_add(1, std::memory_order_relaxed);
  return key;
}

const char* status_name(Status s) {
  switch (s) {
    case Status::ok: return "ok";
    case Status::out_of_memory: return "out_of_memory";
    case Status::invalid_argument: return "invalid_argument";
    case Status::not_ready: return "not_ready";
    case Status::not_supported: return "not_supported";
    case Status::driver_error: return "driver_error";
  }
  return "?";
}

const char* driver_call_name(DriverCall c) {
  static constexpr const char* kNames[kDriverCallCount] = {
      "reserve", "free_reservation", "create", "release", "map", "unmap", "set_access",
      "record_event", "query_event", "synchronize_event", "synchronize_stream", "release_event",
      "stream_wait_event", "synchronize_device", "export_handle", "import_handle", "memory_info"};
  const int i = static_cast<int>(c);
  return i >= 0 && i < kDriverCallCount ? kNames[i] : "?";
}

CostModel CostModel::a100() {
  // kvcached benchmarks/bench_vmm (A100, 2 MiB pages): create 193.32, map 1.45, set access 35.99,
  // unmap 25.63, reserve 19 µs. Release and free_reservation are not published; we charge release like
  // unmap and free_reservation like reserve.
  // Event record/query are cheap host calls (~1 µs); a synchronisation is charged nothing here because its
  // real cost is the GPU work it waits for, which the engine counts separately as a forced sync.
  // A memory query (cuMemGetInfo) is a host call into the driver: 4.85 µs through
  // torch.cuda.memory.mem_get_info as measured by a PyTorch maintainer (pytorch/pytorch issue 174625), 7 to 12 µs
  // median on B200, B300 and H20 systems (sgl-project/sglang issue 25225, which also saw 8 ms on one machine).
  // We charge 10 µs, the upper end of the typical figures: fragless asks it on growths, the peers never.
  CostModel m;
  auto set = [&](DriverCall c, double cost_us) { m.us[static_cast<int>(c)] = cost_us; };
  set(DriverCall::reserve, 19.0);
  set(DriverCall::free_reservation, 19.0);
  set(DriverCall::create, 193.32);
  set(DriverCall::release, 25.63);
  set(DriverCall::map, 1.45);
  set(DriverCall::unmap, 25.63);
  set(DriverCall::set_access, 35.99);
  set(DriverCall::record_event, 1.0);
  set(DriverCall::query_event, 0.5);
  set(DriverCall::release_event, 0.5);
  set(DriverCall::stream_wait_event, 1.0);
  set(DriverCall::memory_info, 10.0);
  return m;
}

}  // namespace fragless

namespace fragless {

// ---- The contract (driver.h, R1-R9) ----

// Walked from va, one exact lookup per mapping: the next must start where the last ended (Note [The
// contract's tables]).
bool DriverContract::whole_mappings(DevicePtr va, std::size_t size) const {
  DevicePtr at = va;
  while (at < va + size) {
    const MappingState* m = mappings_.find(at);
    if (!m) return false;
    at += m->size;
  }
  return at == va + size;
}

bool DriverContract::any_mapped(DevicePtr va, std::size_t size) const {
  const std::uint64_t first = va / g_, last = (va + size) / g_ - 1;  // pages; [va, va+size) is aligned, non-empty
  auto bits = [&](std::uint64_t w) {  // word w's bits inside [first, last]
    const std::uint64_t lo = std::max(first, w * 64) - w * 64, hi = std::min(last, w * 64 + 63) - w * 64;
    return (~std::uint64_t{0} >> (63 - hi)) & (~std::uint64_t{0} << lo);
  };
  // Whichever is fewer: the range's words, or the table's slots, which for_each walks (a whole reservation of a
  // large device spans many words, of which few may be in use). Compared with the words in use instead, a
  // table grown at a peak made every later check walk all its slots: a reservation per stream's segment, each
  // freed with this check at teardown, cost streams x slots (a replay on 32,000 streams: 4.8 s, now 3.1 s).
  if (last / 64 - first / 64 >= mapped_pages_.capacity()) {
    bool any = false;
    mapped_pages_.for_each([&](std::uint64_t w, std::uint64_t word) {
      any = any || (w >= first / 64 && w <= last / 64 && (word & bits(w)));
    });
    return any;
  }
  for (std::uint64_t w = first / 64; w <= last / 64; ++w)
    if (const std::uint64_t* word = mapped_pages_.find(w); word && (*word & bits(w))) return true;
  return false;
}

void DriverContract::mark(DevicePtr va, std::size_t size, bool on) {
  const std::uint64_t first = va / g_, last = (va + size) / g_ - 1;
  for (std::uint64_t w = first / 64; w <= last / 64; ++w) {
    const std::uint64_t lo = std::max(first, w * 64) - w * 64, hi = std::min(last, w * 64 + 63) - w * 64;
    const std::uint64_t bits = (~std::uint64_t{0} >> (63 - hi)) & (~std::uint64_t{0} << lo);
    if (on) {
      mapped_pages_[w] |= bits;
    } else if (std::uint64_t* word = mapped_pages_.find(w); word && !(*word &= ~bits)) {
      mapped_pages_.erase(w);  // a word is kept only while a page of it is mapped
    }
  }
}

const char* DriverContract::check_reserve(std::size_t size) const {
  if (size == 0 || !aligned(size)) return "reserve: size must be a non-zero multiple of the granularity (R1)";
  return nullptr;
}

const char* DriverContract::check_free_reservation(DevicePtr va, std::size_t size) const {
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second != size)
    return "free_reservation: (address, size) must be exactly one reservation (R3)";
  if (any_mapped(va, size)) return "free_reservation: the range still has mappings (R3)";
  return nullptr;
}

const char* DriverContract::check_create(std::size_t size) const {
  if (size == 0 || !aligned(size)) return "create: size must be a non-zero multiple of the granularity (R1)";
  return nullptr;
}

const char* DriverContract::check_release(PhysHandle h) const {
  const HandleState* s = handles_.find(h);
  if (!s || s->released) return "release: unknown or already released handle (R8)";
  return nullptr;
}

const char* DriverContract::check_map(DevicePtr va, std::size_t size, PhysHandle h, std::size_t offset) const {
  if (size == 0 || !aligned(va) || !aligned(size) || !aligned(offset))
    return "map: address, size and offset must be multiples of the granularity (R1)";
  const HandleState* s = handles_.find(h);
  if (!s || s->released) return "map: unknown or released handle (R5)";
  if (offset != 0) return "map: offset into the handle must be 0 (R5; cuda.h: 'currently must be zero')";
  if (size != s->size) return "map: a mapping must be the whole handle (R5)";
  auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin() || va + size > std::prev(r)->first + std::prev(r)->second)
    return "map: range must lie inside one reservation (R5)";
  if (any_mapped(va, size)) return "map: range overlaps a mapping (R5)";
  return nullptr;
}

const char* DriverContract::check_set_access(DevicePtr va, std::size_t size) const {
  if (size == 0 || !whole_mappings(va, size)) return "set_access: range must be whole, adjacent mappings (R6)";
  return nullptr;
}

const char* DriverContract::check_unmap(DevicePtr va, std::size_t size) const {
  if (size == 0 || !whole_mappings(va, size))
    return "unmap: range must be whole, adjacent mappings, never part of one (R7)";
  return nullptr;
}

const char* DriverContract::check_export(PhysHandle h) const {
  const HandleState* s = handles_.find(h);
  if (!s || s->released) return "export_handle: unknown or released handle (R18)";
  return nullptr;
}

bool DriverContract::released(PhysHandle h, std::uint64_t serial) {
  HandleState* s = handles_.find(h);
  if (!s || s->serial != serial) return false;  // its value is another handle's now (created)
  if (s->map_count == 0) {
    if (!s->imported) drop_live(s->size);
    handles_.erase(h);
    return true;
  }
  s->released = true;
  return false;
}

void DriverContract::mapped(DevicePtr va, std::size_t size, PhysHandle h) {
  HandleState& s = handles_[h];
  mappings_[va] = MappingState{size, h, s.serial};
  mark(va, size, true);
  ++s.map_count;
}

void DriverContract::unmapped(DevicePtr va, std::size_t size, std::vector<PhysHandle>* gone) {
  for (DevicePtr at = va; at < va + size;) {  // whole, adjacent mappings (check_unmap), in address order
    const MappingState* found = mappings_.find(at);
    if (!found) break;
    const MappingState m = *found;  // copied: the erases below move the table's entries
    mappings_.erase(at);
    HandleState* h = handles_.find(m.handle);
    if (!h || h->serial != m.serial) {  // its memory went with this unmap, and its value is another's now
      at += m.size;
      continue;
    }
    if (--h->map_count == 0 && h->released) {
      gone->push_back(m.handle);
      if (!h->imported) drop_live(h->size);
      handles_.erase(m.handle);
    }
    at += m.size;
  }
  mark(va, size, false);
}

// ---- Counting, and errors per thread ----

namespace {
thread_local int t_background_depth = 0;
// What the calling thread's last failed call on `driver` said (Note [Driver calls from two threads]): the rule
// it broke, or the driver's own text (set_error), or neither (the driver's do_last_error then answers).
struct LastError {
  const Driver* driver = nullptr;
  const char* rule = nullptr;
  bool has_text = false;
  std::string text;
};
thread_local LastError t_last_error;
}  // namespace

BackgroundCalls::BackgroundCalls() { ++t_background_depth; }
BackgroundCalls::~BackgroundCalls() { --t_background_depth; }
bool BackgroundCalls::active() { return t_background_depth > 0; }

std::string Driver::last_error() const {
  if (t_last_error.driver == this && t_last_error.rule) return t_last_error.rule;
  if (t_last_error.driver == this && t_last_error.has_text) return t_last_error.text;
  auto lk = impl_lock();
  return do_last_error();
}

void Driver::set_error(std::string text) const {
  t_last_error.driver = this;
  t_last_error.rule = nullptr;
  t_last_error.has_text = true;
  t_last_error.text = std::move(text);
}

Status Driver::refuse(const char* rule) {
  t_last_error.driver = this;
  t_last_error.rule = rule;
  t_last_error.has_text = false;
  return Status::invalid_argument;
}

Status Driver::unsupported(const char* what) {
  refuse(what);
  return Status::not_supported;
}

// A failure the implementation reported. Its text is the one it gave this thread in the call (set_error);
// where it gave none (a driver that keeps its text itself), do_last_error answers.
Status Driver::fail_through(Status st) {
  if (st != Status::ok && st != Status::not_ready && !(t_last_error.driver == this && t_last_error.has_text)) {
    t_last_error.driver = this;
    t_last_error.rule = nullptr;
    t_last_error.has_text = false;
  }
  return st;
}

void Driver::charge(DriverCall c, std::size_t bytes) {
  std::lock_guard lk(mu_);
  charge_locked(c, bytes);
}

void Driver::charge_locked(DriverCall c, std::size_t bytes) {
  const int i = static_cast<int>(c);
  const double us = costs_.us[i] + costs_.per_mib[i] * (static_cast<double>(bytes) / (1 << 20));
  ++counters_.calls[i];
  counters_.modelled_us += us;
  if (BackgroundCalls::active()) {
    ++counters_.background_calls[i];
    counters_.background_us += us;
  }
}

DriverCounters Driver::counters() const {
  std::lock_guard lk(mu_);
  return counters_;
}

double Driver::background_us() const {
  std::lock_guard lk(mu_);
  return counters_.background_us;
}

void Driver::reset_counters() {
  std::lock_guard lk(mu_);
  counters_ = DriverCounters{};
}

void Driver::set_cost_model(const CostModel& m) {
  std::lock_guard lk(mu_);
  costs_ = m;
}

// ---- The checked entry points ----
//
// Each one counts the call, checks it against the contract and runs it; the contract's tables are read and
// written under mu_, the call itself runs outside it (Note [Driver calls from two threads]).

namespace {

// A checked call that passed: `call` runs under `impl` (the driver's impl_lock()), then, where it succeeded,
// `record` tells the contract's tables, under `tables` (mu_).
template <class Call, class Record>
Status run_and_record(std::unique_lock<std::mutex> impl, SpinMutex& tables, Call call, Record record) {
  const Status st = call();
  if (impl.owns_lock()) impl.unlock();
  std::lock_guard lk(tables);
  if (st == Status::ok) record();
  return st;
}

}  // namespace

Status Driver::reserve(std::size_t size, DevicePtr* va) {
  charge(DriverCall::reserve, size);
  if (const char* r = contract_.check_reserve(size)) return refuse(r);
  return run_and_record(impl_lock(), mu_, [&] { return fail_through(do_reserve(size, va)); },
                        [&] { contract_.reserved(*va, size); });
}

Status Driver::free_reservation(DevicePtr va, std::size_t size) {
  {
    std::lock_guard lk(mu_);
    charge_locked(DriverCall::free_reservation, size);
    if (const char* r = contract_.check_free_reservation(va, size)) return refuse(r);
  }
  return run_and_record(impl_lock(), mu_, [&] { return fail_through(do_free_reservation(va, size)); },
                        [&] { contract_.freed_reservation(va); });
}

Status Driver::create(std::size_t size, PhysHandle* h) {
  memory_changes_.fetch_add(1, std::memory_order_acq_rel);
  charge(DriverCall::create, size);
  if (const char* r = contract_.check_create(size)) return refuse(r);
  return run_and_record(impl_lock(), mu_, [&] { return fail_through(do_create(size, h)); },
                        [&] { contract_.created(*h, size); });
}

Status Driver::release(PhysHandle h) {
  memory_changes_.fetch_add(1, std::memory_order_acq_rel);
  std::uint64_t serial = 0;
  {
    std::lock_guard lk(mu_);
    charge_locked(DriverCall::release, contract_.handle_size(h));
    if (const char* r = contract_.check_release(h)) return refuse(r);
    serial = contract_.serial_of(h);
  }
  auto lk = impl_lock();
  const Status st = fail_through(do_release(h));
  bool gone = false;
  {
    std::lock_guard tl(mu_);
    gone = st == Status::ok && contract_.released(h, serial);
  }
  if (gone) memory_gone(h);
  return st;
}

Status Driver::map(DevicePtr va, std::size_t size, PhysHandle h, std::size_t offset) {
  {
    std::lock_guard lk(mu_);
    charge_locked(DriverCall::map, size);
    if (const char* r = contract_.check_map(va, size, h, offset)) return refuse(r);
  }
  return run_and_record(impl_lock(), mu_, [&] { return fail_through(do_map(va, size, h, offset)); },
                        [&] { contract_.mapped(va, size, h); });
}

namespace {
// R15: set once a driver refused one unmap over several mappings; every later unmap goes mapping by mapping.
std::atomic<bool> g_unmap_each_mapping{false};
}  // namespace

Status Driver::unmap(DevicePtr va, std::size_t size) {
  memory_changes_.fetch_add(1, std::memory_order_acq_rel);
  const char* rule = nullptr;
  bool several = false;
  {
    std::lock_guard lk(mu_);
    rule = contract_.check_unmap(va, size);
    several = !rule && contract_.several_mappings(va, size);
  }
  if (several && g_unmap_each_mapping.load(std::memory_order_relaxed)) return unmap_each_mapping(va, size);
  charge(DriverCall::unmap, size);
  if (rule) return refuse(rule);
  Status st;
  {
    auto lk = impl_lock();
    st = fail_through(do_unmap(va, size));
    if (st == Status::ok) {
      std::vector<PhysHandle> gone;
      {
        std::lock_guard tl(mu_);
        contract_.unmapped(va, size, &gone);
      }
      for (PhysHandle h : gone) memory_gone(h);
      return st;
    }
  }
  if (st == Status::invalid_argument && several) {
    g_unmap_each_mapping.store(true, std::memory_order_relaxed);  // remembered for the process
    return unmap_each_mapping(va, size);
  }
  return st;
}

Status Driver::unmap_each_mapping(DevicePtr va, std::size_t size) {
  // Each mapping on its own; the first failure stops (what was unmapped is gone, the rest stays mapped).
  for (DevicePtr at = va; at < va + size;) {
    const std::size_t n = mapping_size(at);
    if (n == 0) return refuse("unmap: range must be whole, adjacent mappings, never part of one (R7)");
    if (Status st = unmap(at, n); st != Status::ok) return st;
    at += n;
  }
  return Status::ok;
}

Status Driver::set_access(DevicePtr va, std::size_t size) {
  {
    std::lock_guard lk(mu_);
    charge_locked(DriverCall::set_access, size);
    if (const char* r = contract_.check_set_access(va, size)) return refuse(r);
  }
  auto lk = impl_lock();
  return fail_through(do_set_access(va, size));
}

template <class Call>
Status Driver::exporting(PhysHandle h, Call call) {
  {
    std::lock_guard lk(mu_);
    charge_locked(DriverCall::export_handle);
    if (const char* r = contract_.check_export(h)) return refuse(r);
  }
  auto lk = impl_lock();
  return fail_through(call());
}

template <class Call>
Status Driver::importing(std::size_t size, PhysHandle* h, Call call) {
  charge(DriverCall::import_handle, size);
  if (const char* r = contract_.check_create(size)) return refuse(r);
  // Mapped whole and released like a created handle (R19).
  return run_and_record(impl_lock(), mu_, [&] { return fail_through(call()); },
                        [&] { contract_.created(*h, size, /*imported=*/true); });
}

Status Driver::export_handle(PhysHandle h, int* fd) {
  return exporting(h, [&] { return do_export_handle(h, fd); });
}

Status Driver::import_handle(int fd, std::size_t size, PhysHandle* h) {
  if (fd < 0) {
    charge(DriverCall::import_handle, size);
    return refuse("import_handle: not a file descriptor (R19)");
  }
  return importing(size, h, [&] { return do_import_handle(fd, size, h); });
}

Status Driver::export_handle(PhysHandle h, FabricHandle* out) {
  return exporting(h, [&] { return do_export_fabric(h, out); });
}

Status Driver::import_handle(const FabricHandle& f, std::size_t size, PhysHandle* h) {
  return importing(size, h, [&] { return do_import_fabric(f, size, h); });
}

}  // namespace fragless
