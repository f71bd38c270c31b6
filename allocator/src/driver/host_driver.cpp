// host driver: cuMemMap semantics over real host memory (see host_driver.h).
#include "fragless/host_driver.h"
#include "base/no_file_size_signal.h"
#include "driver/handle_ids.h"
#include "driver/host_fork.h"
#include "driver/registry.h"

#include <fcntl.h>
#include <pthread.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace fragless {

TestEvents* sim_test_events(Driver& d);  // sim_driver.cpp

namespace {

class HostDriver;

// Every live host driver, for the fork() handlers: a driver adds itself when made and removes itself when
// destroyed, holding only this mutex; the prepare handler takes it, then each driver's impl lock. Never
// destroyed: a driver that outlives static destruction (one a leaked allocator holds) still finds them.
struct HostRegistry {
  std::mutex mu;
  std::vector<HostDriver*> drivers;
};
HostRegistry& hosts() {
  static HostRegistry* r = new HostRegistry;
  return *r;
}

class HostDriver final : public Driver {
 public:
  HostDriver(const HostDriverOptions& o, int fd)
      : Driver(o.device, o.page_size), fd_(fd), shareable_(o.shareable), capacity_(round_down(o.capacity, o.page_size)) {
    free_ranges_.emplace(0, capacity_);
    install_host_fork_handlers();
    std::lock_guard lk(hosts().mu);
    hosts().drivers.push_back(this);
  }
  ~HostDriver() override {
    {
      std::lock_guard lk(hosts().mu);
      std::erase(hosts().drivers, this);
    }
    for (auto& [va, r] : reservations_) munmap(reinterpret_cast<void*>(va), r);
    for (auto& [h, hd] : handles_)
      if (hd.own_fd) close(hd.fd);
    if (fd_ >= 0) close(fd_);
    for (int fd : parents_fds_) close(fd);
  }

  // Note [Host memory across fork]: a handle's pages are a memfd's, mapped shared (R9: one handle at two
  // addresses is one memory), and a forked child inherits those mappings shared: without more, what the child
  // wrote into a block, even one it allocated after the fork from the cache it inherited, the parent would
  // see, and a handle the child released would punch a hole into the parent's live memory. Ordinary memory
  // is copy-on-write across fork(), and a program that forks (a DataLoader's workers, with fragless as the
  // CPU allocator) expects that. So the child handler, on the child's one thread, remaps every mapping of a
  // handle made before the fork copy-on-write (MAP_PRIVATE of the same pages, same protection, MAP_NORESERVE
  // as the shared mapping was not charged to commit either): the child's writes stay its own from then on.
  // In the child such a handle is the parent's memory as well, so R9 no longer holds for it: each mapping the
  // child makes of it is copy-on-write on its own (re-backing copies what the child wrote, as it copies any
  // block). It is never exported, and released without punching the parent's pages or giving their range to
  // new handles; new handles come from a memfd of the child's own, made at its first create (the same
  // capacity, counted with what it inherited, whose offsets in the budget it keeps). What this does not
  // give, as Linux keeps a private page the file's until the child writes it:
  // - a page the child has not written shows what the parent writes there later, including what a new
  //   handle of the parent's writes once the parent released the old one and reused its range; a child sees
  //   the memory as it was at the fork only in the pages it wrote, or for as long as the parent leaves them;
  // - a page the child faults in after the parent released it (punched its range) is a new page of the
  //   parent's memfd, in a range the parent counts free: it stays until the parent's range is used and
  //   released again. Only a child that keeps using the parent's released memory makes this.
  // Imported handles (another process's memory, shared on purpose) stay shared.
  // The prepare handler takes every host driver's impl lock and its tables' lock, so no host driver is inside
  // an mmap, its books or its counters at the fork. It runs after the background workers' (host_fork.h),
  // which holds every device lock and has paused the workers, so no engine's call is between the two either
  // (done here, not yet in the contract's tables): an engine calls its driver under its device lock, its
  // worker between a take and a finish (Note [Device locks across fork]). Where the workers' handler did not
  // run before it (installed during the fork), the load handler lets these locks go, takes the device locks and
  // takes these again (Note [Handlers installed during a fork]). The child handler allocates nothing.
  void lock_for_fork() {
    fork_lock_ = impl_lock();
    fork_tables_lock_ = std::unique_lock(tables_mutex());
    parents_fds_.reserve(parents_fds_.size() + 1);  // the child handler's push_back must not allocate
  }
  void unlock_after_fork() {
    fork_tables_lock_.unlock();
    fork_lock_.unlock();
  }
  void child_after_fork() {
    tables_mutex().forget_waiters();  // threads of the parent's that slept on it are not here
    // A handle inherited at an earlier fork is mapped copy-on-write already, which this fork copies as it
    // copies ordinary memory: only the shared ones are remapped.
    for (const auto& [va, m] : mappings_) {
      const Handle& hd = handles_.find(m.handle)->second;
      if (hd.imported || hd.inherited) continue;
      void* at = reinterpret_cast<void*>(va);
      if (mmap(at, m.size, m.accessible ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE,
               hd.fd, static_cast<off_t>(hd.own_fd ? 0 : hd.offset)) != MAP_FAILED)
        continue;
      // The child must not write the parent's memory: failing the copy-on-write mapping, the range becomes
      // inaccessible (a fault when the child touches it), and failing that too the child cannot go on.
      if (mmap(at, m.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) != MAP_FAILED) {
        static const char msg[] = "fragless: host driver: a forked child could not map its memory copy-on-write "
                                  "(mmap failed); that memory is inaccessible in the child\n";
        (void)!write(2, msg, sizeof msg - 1);
        continue;
      }
      static const char msg[] = "fragless: host driver: a forked child could neither map its memory copy-on-write "
                                "nor unmap it; the child ends rather than write the parent's memory\n";
      (void)!write(2, msg, sizeof msg - 1);
      _exit(127);
    }
    for (auto& [h, hd] : handles_) hd.inherited = !hd.imported;
    // The parent's memfd stays open for the inherited handles that are in it; the child's first create
    // that needs one makes its own. The free ranges stay as they are: the budget's offsets, which the
    // inherited handles keep until the child releases them (in the child's memfd nothing is there).
    if (fd_ >= 0) parents_fds_.push_back(fd_);
    fd_ = -1;
  }
  const char* name() const override { return "host"; }
  TestEvents& events() { return events_; }

  void do_memory_info(std::size_t* free_bytes, std::size_t* total_bytes) override {
    auto lk = impl_lock();
    *free_bytes = capacity_ - used_;
    *total_bytes = capacity_;
  }

  void inject(DriverCall c, std::uint64_t nth, Status st, std::uint64_t times) {
    auto lk = impl_lock();
    auto& r = faults_[static_cast<int>(c)];
    r.countdown = nth;
    r.status = st;
    r.more = nth == 0 || times == 0 ? 0 : times - 1;
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
  // own_fd: the handle's fd is its own (exportable or imported), closed with it. inherited: made before this
  // process was forked from the one that made it (Note [Host memory across fork]).
  struct Handle {
    int fd;
    std::size_t offset, size;
    bool own_fd = false, imported = false, inherited = false;
  };
  struct Mapping { std::size_t size; PhysHandle handle; bool accessible; };
  struct Fault {
    std::uint64_t countdown = 0;
    Status status = Status::ok;
    std::uint64_t more = 0;  // the calls after the nth that fail too
  };

  static std::size_t round_down(std::size_t v, std::size_t to) { return v / to * to; }

  // Failure injection: true (and the status to return) when this call is the one to fail.
  bool injected(DriverCall c, Status* st) {
    Fault& f = faults_[static_cast<int>(c)];
    if (f.countdown == 0 || --f.countdown != 0) return false;
    if (f.more > 0) {  // the next call is the next to fail
      --f.more;
      f.countdown = 1;
    }
    *st = f.status;
    set_error(std::string(driver_call_name(c)) + ": injected failure (" + status_name(f.status) + ")");
    ++injected_failures_;
    return true;
  }
  Status fail(const std::string& what, Status st = Status::invalid_argument) {
    set_error(what);
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
      if (fd_ < 0 && !make_memfd()) {
        give_range_back(offset, size);
        return fail("create: a forked child's first memory needs a memfd of its own: memfd_create: " + memfd_error_,
                    Status::driver_error);
      }
      used_ += size;
      *h = ids_.take();
      handles_.emplace(*h, Handle{fd_, offset, size});
      return Status::ok;
    }
    return fail("create: out of memory (" + std::to_string(capacity_ - used_) + " of " + std::to_string(capacity_) +
                    " bytes free)",
                Status::out_of_memory);
  }

  // In a forked child (Note [Host memory across fork]): the device's memfd, made anew. The budget's
  // offsets carry over, so the file is sized as the parent's.
  bool make_memfd() {
    const int fd = memfd_create("fragless-host-device", MFD_CLOEXEC);
    NoFileSizeSignal no_signal;  // a file size limit fails the call (Note [A file size limit])
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(capacity_)) == 0) {
      fd_ = fd;
      return true;
    }
    memfd_error_ = std::strerror(errno);
    if (fd >= 0) close(fd);
    return false;
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
    NoFileSizeSignal no_signal;  // a file size limit fails the call (Note [A file size limit])
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
      const std::string why = std::strerror(errno);
      if (fd >= 0) close(fd);
      give_range_back(offset, size);
      return fail("create: memfd: " + why, Status::driver_error);
    }
    used_ += size;
    *h = ids_.take();
    // Its own memfd, at offset 0 (the device range's offset is kept only for memory_gone).
    handles_.emplace(*h, Handle{fd, offset, size, true});
    return Status::ok;
  }

  Status do_export_handle(PhysHandle h, int* out) override {
    if (Status st; injected(DriverCall::export_handle, &st)) return st;
    const Handle& hd = handles_.at(h);
    if (hd.inherited)
      return fail("export_handle: the handle was made before this process was forked: its pages are the parent's "
                  "too, and this process's writes to them its own (Note [Host memory across fork])",
                  Status::not_supported);
    if (!hd.own_fd)
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
    *h = ids_.take();
    handles_.emplace(*h, Handle{own, 0, size, true, true});
    return Status::ok;
  }

  void memory_gone(PhysHandle h) override {
    auto it = handles_.find(h);
    const Handle hd = it->second;
    handles_.erase(it);
    ids_.gone(h);
    if (hd.inherited) {  // the parent's pages as well: not punched; its budget range is free again
      close_inherited_fd(hd);
      used_ -= hd.size;
      give_range_back(hd.offset, hd.size);
      return;
    }
    if (hd.own_fd) {  // its own memfd: the memory goes with the last descriptor and mapping
      close(hd.fd);
      if (hd.imported) return;  // another process's memory: not this device's budget
      used_ -= hd.size;
      give_range_back(hd.offset, hd.size);
      return;
    }
    // Punch a hole so the memory really goes back, then coalesce the free range.
    fallocate(hd.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(hd.offset),
              static_cast<off_t>(hd.size));
    used_ -= hd.size;
    give_range_back(hd.offset, hd.size);
  }

  // An inherited handle is gone: its own memfd closes with it, and a parent's memfd once no handle is in it.
  void close_inherited_fd(const Handle& gone) {
    if (gone.own_fd) {
      close(gone.fd);
      return;
    }
    for (const auto& [h, hd] : handles_)
      if (hd.fd == gone.fd) return;
    auto it = std::find(parents_fds_.begin(), parents_fds_.end(), gone.fd);
    if (it == parents_fds_.end()) return;
    close(gone.fd);
    parents_fds_.erase(it);
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
    const Handle& hd = handles_.find(h)->second;
    // Note [Host memory across fork]: in a forked child, memory made before the fork is mapped copy-on-write.
    const int flags = hd.inherited ? MAP_PRIVATE | MAP_NORESERVE : MAP_SHARED;
    void* p = mmap(reinterpret_cast<void*>(va), size, PROT_NONE, flags | MAP_FIXED, hd.fd,
                   static_cast<off_t>(hd.own_fd ? 0 : hd.offset));
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

  int fd_;              // the device's memfd (-1: a forked child's, until its first create makes it)
  std::string memfd_error_;  // why the last make_memfd failed
  std::vector<int> parents_fds_;  // in a forked child: the parents' memfds, which inherited handles' pages are in
  // The impl lock and the tables' lock, held from the fork's prepare handler to its parent or child handler.
  std::unique_lock<std::mutex> fork_lock_;
  std::unique_lock<SpinMutex> fork_tables_lock_;
  bool shareable_;
  std::size_t capacity_;
  std::size_t used_ = 0;
  HandleIds ids_;
  std::map<std::size_t, std::size_t> free_ranges_;  // offset -> length, in the memfd
  std::map<PhysHandle, Handle> handles_;
  std::map<DevicePtr, std::size_t> reservations_;   // base -> size
  std::map<DevicePtr, Mapping> mappings_;
  Fault faults_[kDriverCallCount];
  std::uint64_t injected_failures_ = 0;  // injected failures returned so far
  TestEvents events_;
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
  NoFileSizeSignal no_signal;  // a file size limit (RLIMIT_FSIZE covers a memfd) fails the driver, said
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(opts.capacity)) != 0) {
    if (error)
      *error = std::string("host driver: memfd of ") + std::to_string(opts.capacity) + " bytes: " + std::strerror(errno) +
               (errno == EFBIG ? " (the process's file size limit, ulimit -f, is below the device's capacity)" : "");
    if (fd >= 0) close(fd);
    return nullptr;
  }
  return std::make_unique<HostDriver>(opts, fd);
}

TestEvents* test_events_of(Driver& d) {
  if (auto* h = dynamic_cast<HostDriver*>(&d)) return &h->events();
  return sim_test_events(d);
}

void host_driver_inject_failure(Driver& d, DriverCall call, std::uint64_t nth, Status status, std::uint64_t times) {
  if (auto* h = dynamic_cast<HostDriver*>(&d)) h->inject(call, nth, status, times);
}

std::uint64_t host_driver_injected_failures(Driver& d) {
  if (auto* h = dynamic_cast<HostDriver*>(&d)) return h->injected_failures();
  return 0;
}

HostDriverCensus host_driver_census(Driver& d) {
  if (auto* h = dynamic_cast<HostDriver*>(&d)) return h->census();
  return {};
}

// The registry's entries (driver/registry.h): the options the host driver refuses, and those it reads.
bool host_driver_accepts(const Options& o, std::string* error) {
  if (o.fabric_handles) {  // CUDA's handle type (R26): nothing here could carry it
    if (error) *error = "fragless: shareable_handles:fabric needs the cuda driver; the host driver shares memfds "
                        "(shareable_handles:True)";
    return false;
  }
  return true;
}

std::unique_ptr<Driver> make_host_driver_for(const Options& o, int device, std::string* error) {
  if (!host_driver_accepts(o, error)) return nullptr;
  HostDriverOptions h;
  h.device = device;
  h.page_size = o.page_size;
  if (o.capacity) h.capacity = o.capacity;
  h.shareable = o.shareable_handles;
  return make_host_driver(h, error);
}

// t_host_fork_depth: registered twice, the handlers run twice per fork; only the outer run acts (Note [Fork
// handlers registered twice], state/background.cpp).
thread_local int t_host_fork_depth = 0;

namespace {
void lock_hosts_for_fork() {
  hosts().mu.lock();  // held until the parent or child handler: no host driver is made or destroyed
  for (HostDriver* d : hosts().drivers) d->lock_for_fork();
}
void unlock_hosts_after_fork() {
  for (HostDriver* d : hosts().drivers) d->unlock_after_fork();
  hosts().mu.unlock();
}
}  // namespace

void host_before_fork() {
  if (t_host_fork_depth++) return;
  lock_hosts_for_fork();
}

void host_after_fork_parent() {
  if (--t_host_fork_depth) return;
  unlock_hosts_after_fork();
}

bool host_fork_locks_held() { return t_host_fork_depth > 0; }
void host_let_go_in_fork() { unlock_hosts_after_fork(); }
void host_take_again_in_fork() { lock_hosts_for_fork(); }

void host_after_fork_child() {
  if (--t_host_fork_depth) return;
  for (HostDriver* d : hosts().drivers) {
    d->child_after_fork();
    d->unlock_after_fork();
  }
  hosts().mu.unlock();
}

void install_host_fork_handlers() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(&host_before_fork, &host_after_fork_parent, &host_after_fork_child); });
}

}  // namespace fragless
