// host driver: cuMemMap semantics over real host memory (see host_driver.h).
#include "fragless/host_driver.h"
#include "driver/registry.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <vector>

namespace fragless {

TestEvents* sim_test_events(Driver& d);  // sim_driver.cpp

namespace {

class HostDriver final : public Driver {
 public:
  HostDriver(const HostDriverOptions& o, int fd)
      : Driver(o.device, o.page_size), fd_(fd), shareable_(o.shareable), capacity_(round_down(o.capacity, o.page_size)) {
    free_ranges_.emplace(0, capacity_);
  }
  ~HostDriver() override {
    for (auto& [va, r] : reservations_) munmap(reinterpret_cast<void*>(va), r);
    for (auto& [h, hd] : handles_)
      if (hd.fd != fd_) close(hd.fd);
    close(fd_);
  }
  const char* name() const override { return "host"; }
  TestEvents& events() { return events_; }

  void do_memory_info(std::size_t* free_bytes, std::size_t* total_bytes) override {
    auto lk = impl_lock();
    *free_bytes = capacity_ - used_;
    *total_bytes = capacity_;
  }
  std::string do_last_error() const override { return last_error_; }

  void inject(DriverCall c, std::uint64_t nth, Status st) {
    auto lk = impl_lock();
    auto& r = faults_[static_cast<int>(c)];
    r.countdown = nth;
    r.status = st;
  }

  std::uint64_t injected_failures() const { return injected_failures_; }

  HostDriverCensus census() const {
    auto lk = impl_lock();
    HostDriverCensus c;
    c.handles = handles_.size();
    c.mappings = mappings_.size();
    c.reservations = reservations_.size();
    c.physical_bytes = used_;
    for (auto& [h, hd] : handles_) c.imported_handles += hd.imported;
    return c;
  }

 private:
  // fd: the device's memfd (offset: where the handle's pages are), or the handle's own memfd (offset 0) when
  // it was created exportable or imported.
  struct Handle { int fd; std::size_t offset, size; bool imported = false; };
  struct Mapping { std::size_t size; PhysHandle handle; bool accessible; };
  struct Fault { std::uint64_t countdown = 0; Status status = Status::ok; };

  static std::size_t round_down(std::size_t v, std::size_t to) { return v / to * to; }

  // Failure injection: true (and the status to return) when this call is the one to fail.
  bool injected(DriverCall c, Status* st) {
    Fault& f = faults_[static_cast<int>(c)];
    if (f.countdown == 0 || --f.countdown != 0) return false;
    *st = f.status;
    last_error_ = std::string(driver_call_name(c)) + ": injected failure (" + status_name(f.status) + ")";
    ++injected_failures_;
    return true;
  }
  Status fail(const std::string& what, Status st = Status::invalid_argument) {
    last_error_ = what;
    return st;
  }
  bool aligned(std::size_t v) const { return v % granularity() == 0; }

  bool overlaps_mapping(DevicePtr va, std::size_t size) const {
    auto it = mappings_.lower_bound(va);
    if (it != mappings_.end() && it->first < va + size) return true;
    if (it != mappings_.begin()) {
      --it;
      if (it->first + it->second.size > va) return true;
    }
    return false;
  }

  Status do_reserve(std::size_t size, DevicePtr* va) override {
    if (Status st; injected(DriverCall::reserve, &st)) return st;
    if (size == 0 || !aligned(size)) return fail("reserve: size not a multiple of the granularity");
    const std::size_t g = granularity();
    void* p = mmap(nullptr, size + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return fail(std::string("reserve: mmap: ") + std::strerror(errno), Status::out_of_memory);
    auto base = reinterpret_cast<DevicePtr>(p);
    const DevicePtr aligned_base = (base + g - 1) / g * g;
    if (aligned_base > base) munmap(p, aligned_base - base);
    const DevicePtr end = base + size + g;
    if (end > aligned_base + size) munmap(reinterpret_cast<void*>(aligned_base + size), end - aligned_base - size);
    reservations_.emplace(aligned_base, size);
    *va = aligned_base;
    return Status::ok;
  }

  Status do_free_reservation(DevicePtr va, std::size_t size) override {
    if (Status st; injected(DriverCall::free_reservation, &st)) return st;
    auto it = reservations_.find(va);
    if (it == reservations_.end() || it->second != size) return fail("free_reservation: not a reservation");
    if (overlaps_mapping(va, size)) return fail("free_reservation: range still has mappings");
    munmap(reinterpret_cast<void*>(va), size);
    reservations_.erase(it);
    return Status::ok;
  }

  Status do_create(std::size_t size, PhysHandle* h) override {
    if (Status st; injected(DriverCall::create, &st)) return st;
    if (size == 0 || !aligned(size)) return fail("create: size not a multiple of the granularity");
    for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {  // first fit
      if (it->second < size) continue;
      const std::size_t offset = it->first, len = it->second;
      free_ranges_.erase(it);
      if (len > size) free_ranges_.emplace(offset + size, len - size);
      if (shareable_) return create_exportable(offset, size, h);
      used_ += size;
      *h = next_handle_++;
      handles_.emplace(*h, Handle{fd_, offset, size});
      return Status::ok;
    }
    return fail("create: out of memory (" + std::to_string(capacity_ - used_) + " of " + std::to_string(capacity_) +
                    " bytes free)",
                Status::out_of_memory);
  }

  // The base class checked the handle (R8); the memory goes in memory_gone, once nothing maps it.
  Status do_release(PhysHandle) override {
    if (Status st; injected(DriverCall::release, &st)) return st;
    return Status::ok;
  }

  // Note [Exportable host handles]: a handle that may be exported is a memfd of its own (what another process
  // maps is then exactly that handle's memory, and it lives while any process holds it, as R18 says of
  // CUDA's); it takes its budget from the device's range all the same, so capacity is shared alike.
  Status create_exportable(std::size_t offset, std::size_t size, PhysHandle* h) {
    const int fd = memfd_create("fragless-host-handle", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
      const std::string why = std::strerror(errno);
      if (fd >= 0) close(fd);
      give_range_back(offset, size);
      return fail("create: memfd: " + why, Status::driver_error);
    }
    used_ += size;
    *h = next_handle_++;
    handles_.emplace(*h, Handle{fd, offset, size});
    return Status::ok;
  }

  Status do_export_handle(PhysHandle h, int* out) override {
    if (Status st; injected(DriverCall::export_handle, &st)) return st;
    const Handle& hd = handles_.at(h);
    if (hd.fd == fd_)
      return fail("export_handle: the handle was not created exportable (R18; shareable_handles:True creates "
                  "exportable memory)",
                  Status::not_supported);
    const int fd = fcntl(hd.fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return fail(std::string("export_handle: dup: ") + std::strerror(errno), Status::driver_error);
    *out = fd;
    return Status::ok;
  }

  // R19: fd must be a host handle's memfd of exactly `size` bytes; the descriptor stays the caller's.
  Status do_import_handle(int fd, std::size_t size, PhysHandle* h) override {
    if (Status st; injected(DriverCall::import_handle, &st)) return st;
    struct stat st{};
    if (fstat(fd, &st) != 0) return fail(std::string("import_handle: fd: ") + std::strerror(errno));
    if (fcntl(fd, F_GET_SEALS) < 0) return fail("import_handle: the descriptor is not exported memory (not a memfd)");
    if (static_cast<std::size_t>(st.st_size) != size)
      return fail("import_handle: the descriptor's memory is " + std::to_string(st.st_size) + " bytes, not " +
                  std::to_string(size));
    const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) return fail(std::string("import_handle: dup: ") + std::strerror(errno), Status::driver_error);
    *h = next_handle_++;
    handles_.emplace(*h, Handle{own, 0, size, true});
    return Status::ok;
  }

  void memory_gone(PhysHandle h) override {
    auto it = handles_.find(h);
    const Handle hd = it->second;
    handles_.erase(it);
    if (hd.fd != fd_) {  // its own memfd: the memory goes with the last descriptor and mapping
      close(hd.fd);
      if (hd.imported) return;  // another process's memory: not this device's budget
      used_ -= hd.size;
      give_range_back(hd.offset, hd.size);
      return;
    }
    // Punch a hole so the memory really goes back, then coalesce the free range.
    fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(hd.offset),
              static_cast<off_t>(hd.size));
    used_ -= hd.size;
    give_range_back(hd.offset, hd.size);
  }

  void give_range_back(std::size_t off, std::size_t len) {
    auto next = free_ranges_.lower_bound(off);
    if (next != free_ranges_.end() && next->first == off + len) {
      len += next->second;
      next = free_ranges_.erase(next);
    }
    if (next != free_ranges_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        off = prev->first;
        len += prev->second;
        free_ranges_.erase(prev);
      }
    }
    free_ranges_.emplace(off, len);
  }

  // The base class enforced R1 and R5: a whole handle at offset 0, inside one reservation, over nothing mapped.
  Status do_map(DevicePtr va, std::size_t size, PhysHandle h, std::size_t) override {
    if (Status st; injected(DriverCall::map, &st)) return st;
    auto hit = handles_.find(h);
    const bool own = hit->second.fd != fd_;
    void* p = mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED, hit->second.fd,
                   static_cast<off_t>(own ? 0 : hit->second.offset));
    if (p == MAP_FAILED) return fail(std::string("map: mmap: ") + std::strerror(errno), Status::driver_error);
    mappings_.emplace(va, Mapping{size, h, false});
    return Status::ok;
  }

  // The base class enforced R7: whole, adjacent mappings.
  Status do_unmap(DevicePtr va, std::size_t size) override {
    if (Status st; injected(DriverCall::unmap, &st)) return st;
    void* p = mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return fail(std::string("unmap: mmap: ") + std::strerror(errno), Status::driver_error);
    mappings_.erase(mappings_.find(va), mappings_.lower_bound(va + size));
    return Status::ok;
  }

  // The base class enforced R6: whole, adjacent mappings.
  Status do_set_access(DevicePtr va, std::size_t size) override {
    if (Status st; injected(DriverCall::set_access, &st)) return st;
    if (mprotect(reinterpret_cast<void*>(va), size, PROT_READ | PROT_WRITE) != 0)
      return fail(std::string("set_access: mprotect: ") + std::strerror(errno), Status::driver_error);
    // Fault the page tables in with one call, as a GPU mapping is ready once access is set (far cheaper than
    // a page fault per 4 KiB on first touch). Best effort: older kernels lack MADV_POPULATE_WRITE.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    madvise(reinterpret_cast<void*>(va), size, MADV_POPULATE_WRITE);
    for (auto it = mappings_.find(va); it != mappings_.end() && it->first < va + size; ++it) it->second.accessible = true;
    return Status::ok;
  }

  Status do_record_event(Stream s, Event* e) override {
    if (Status st; injected(DriverCall::record_event, &st)) return st;
    *e = events_.record(s);
    return Status::ok;
  }
  Status do_query_event(Event e) override {
    if (Status st; injected(DriverCall::query_event, &st)) return st;
    return events_.query(e);
  }
  Status do_synchronize_event(Event e) override {
    if (Status st; injected(DriverCall::synchronize_event, &st)) return st;
    events_.synchronize(e);
    return Status::ok;
  }
  Status do_release_event(Event e) override {
    if (Status st; injected(DriverCall::release_event, &st)) return st;
    events_.release(e);
    return Status::ok;
  }
  Status do_stream_wait_event(Stream s, Event e) override {
    if (Status st; injected(DriverCall::stream_wait_event, &st)) return st;
    events_.wait(s, e);
    return Status::ok;
  }
  Status do_synchronize_stream(Stream s) override {
    if (Status st; injected(DriverCall::synchronize_stream, &st)) return st;
    events_.synchronize_stream(s);
    return Status::ok;
  }
  Status do_synchronize_device() override {
    if (Status st; injected(DriverCall::synchronize_device, &st)) return st;
    events_.synchronize_all();
    return Status::ok;
  }

  int fd_;
  bool shareable_;
  std::size_t capacity_;
  std::size_t used_ = 0;
  PhysHandle next_handle_ = 1;
  std::map<std::size_t, std::size_t> free_ranges_;  // offset -> length, in the memfd
  std::map<PhysHandle, Handle> handles_;
  std::map<DevicePtr, std::size_t> reservations_;   // base -> size
  std::map<DevicePtr, Mapping> mappings_;
  Fault faults_[kDriverCallCount];
  std::uint64_t injected_failures_ = 0;  // injected failures returned so far
  TestEvents events_;
  std::string last_error_;
};

}  // namespace

std::unique_ptr<Driver> make_host_driver(const HostDriverOptions& opts, std::string* error) {
  if (opts.page_size == 0 || (opts.page_size & (opts.page_size - 1)) != 0 ||
      opts.page_size % static_cast<std::size_t>(sysconf(_SC_PAGESIZE)) != 0) {
    if (error) *error = "host driver: page size must be a power of two and a multiple of the OS page size";
    return nullptr;
  }
  if (opts.capacity < opts.page_size) {
    if (error) *error = "host driver: capacity smaller than one page";
    return nullptr;
  }
  const int fd = memfd_create("fragless-host-device", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(opts.capacity)) != 0) {
    if (error) *error = std::string("host driver: memfd: ") + std::strerror(errno);
    if (fd >= 0) close(fd);
    return nullptr;
  }
  return std::make_unique<HostDriver>(opts, fd);
}

TestEvents* test_events_of(Driver& d) {
  if (auto* h = dynamic_cast<HostDriver*>(&d)) return &h->events();
  return sim_test_events(d);
}

void host_driver_inject_failure(Driver& d, DriverCall call, std::uint64_t nth, Status status) {
  if (auto* h = dynamic_cast<HostDriver*>(&d)) h->inject(call, nth, status);
}

std::uint64_t host_driver_injected_failures(Driver& d) {
  if (auto* h = dynamic_cast<HostDriver*>(&d)) return h->injected_failures();
  return 0;
}

HostDriverCensus host_driver_census(Driver& d) {
  if (auto* h = dynamic_cast<HostDriver*>(&d)) return h->census();
  return {};
}

// The registry's entry (driver/registry.h): the options the host driver reads.
std::unique_ptr<Driver> make_host_driver_for(const Options& o, int device, std::string* error) {
  if (o.fabric_handles) {  // CUDA's handle type (R26): nothing here could carry it
    if (error) *error = "fragless: shareable_handles:fabric needs the cuda driver; the host driver shares memfds "
                        "(shareable_handles:True)";
    return nullptr;
  }
  HostDriverOptions h;
  h.device = device;
  h.page_size = o.page_size;
  if (o.capacity) h.capacity = o.capacity;
  h.shareable = o.shareable_handles;
  return make_host_driver(h, error);
}

}  // namespace fragless
