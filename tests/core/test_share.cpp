// Sharing blocks between engines (Note [Sharing], engine/share.cpp), in one process: two engines, each with
// its own host driver (its own memfds), stand for two processes; the descriptors are real. The two-process
// tests through libfragless.so are tests/share/share_processes.cpp.
#include <dirent.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>

#include "fragless/host_driver.h"
#include "fragless/rounding.h"
#include "helpers.h"

using namespace fragless;
using namespace fragless::test;

namespace {

EngineSpec shareable(PolicyKind p, std::size_t capacity = 256 * MiB) {
  EngineSpec s;
  s.policy = p;
  s.driver = DriverKind::host;
  s.capacity = capacity;
  s.base.shareable_handles = true;
  return s;
}

std::size_t open_fds() {
  std::size_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

void fill(void* p, std::size_t n, unsigned char v) { std::memset(p, v, n); }
bool all(const void* p, std::size_t n, unsigned char v) {
  const auto* c = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (c[i] != v) return false;
  return true;
}

void* open_in(DeviceEngine& e, const SharedBlock& s, std::size_t* size, AllocError* err) {
  return e.open_shared(s.description, s.fds.data(), s.fds.size(), size, err);
}

}  // namespace

TEST_CASE("sharing: a block opened by another engine sees its bytes both ways, at exactly its size", "[share]") {
  const PolicyKind policy = GENERATE(PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless);
  CAPTURE(name(policy));
  auto a = make_engine(shareable(policy));
  auto b = make_engine(shareable(policy));
  void* neighbour = a->allocate(512 * 1024, 0, nullptr);
  const std::size_t n = 3 * MiB + 4096;  // over two pages, not page-aligned
  void* p = a->allocate(n, 0, nullptr);
  REQUIRE(p);
  fill(p, n, 0x5A);
  SharedBlock s;
  AllocError err;
  REQUIRE(a->share(p, &s, &err) == Status::ok);
  CHECK(s.fds.size() >= 2);
  std::size_t size = 0;
  void* q = open_in(*b, s, &size, &err);
  INFO(err.message);
  REQUIRE(q);
  CHECK(size == round_size(n, a->options()));  // the block, not the segment
  CHECK(all(q, n, 0x5A));
  fill(q, n, 0xC3);  // and back
  CHECK(all(p, n, 0xC3));
  CHECK(a->stats().exported_bytes.all().current >= static_cast<std::int64_t>(n));
  CHECK(b->stats().imported_bytes.all().current >= static_cast<std::int64_t>(n));
  CHECK(b->stats().reserved_bytes.all().current == 0);  // another process's memory is not reserved here
  require_consistent(*a);
  require_consistent(*b);
  REQUIRE(b->close_shared(q, &err) == Status::ok);
  CHECK(b->stats().imported_bytes.all().current == 0);
  CHECK(host_driver_census(b->driver()).mappings == 0);
  CHECK(host_driver_census(b->driver()).reservations == 0);
  s.close_fds();
  REQUIRE(a->free(p) == Status::ok);
  CHECK(a->stats().allocated_bytes.all().current == static_cast<std::int64_t>(round_size(512 * 1024, a->options())));
  CHECK(a->stats().exported_bytes.all().current == 0);
  a->free(neighbour);
  require_consistent(*a);
}

TEST_CASE("sharing: memory not created exportable is refused, naming the key, and so are bad pointers", "[share]") {
  EngineSpec spec = shareable(PolicyKind::fragless);
  spec.base.shareable_handles = false;
  auto a = make_engine(spec);
  void* p = a->allocate(MiB, 0, nullptr);
  SharedBlock s;
  AllocError err;
  CHECK(a->share(p, &s, &err) == Status::not_supported);
  CHECK_THAT(err.message, Catch::Contains("shareable_handles:True"));
  CHECK(s.fds.empty());
  auto b = make_engine(shareable(PolicyKind::fragless));
  void* q = b->allocate(MiB, 0, nullptr);
  CHECK(b->share(static_cast<char*>(q) + 512, &s, &err) == Status::invalid_argument);
  CHECK_THAT(err.message, Catch::Contains("not the start of a live fragless allocation"));
  CHECK(b->close_shared(q, &err) == Status::invalid_argument);
  CHECK_THAT(err.message, Catch::Contains("open_shared did not return"));
  require_consistent(*a);
  require_consistent(*b);
}

TEST_CASE("sharing: the owner's free waits for every lease, and nothing is re-backed, lent or reused under it",
          "[share]") {
  // A small device under pressure: fragless would re-back the freed block's pages at once if it could.
  auto a = make_engine(shareable(PolicyKind::fragless, 32 * MiB));
  auto b = make_engine(shareable(PolicyKind::fragless, 32 * MiB));
  const std::size_t n = 8 * MiB;
  void* p = a->allocate(n, 0, nullptr);
  fill(p, n, 0x11);
  SharedBlock s;
  REQUIRE(a->share(p, &s) == Status::ok);
  std::size_t size = 0;
  AllocError err;
  void* q = open_in(*b, s, &size, &err);
  REQUIRE(q);
  s.close_fds();  // only the importer's copy of the lease is left
  REQUIRE(a->free(p) == Status::ok);
  CHECK(a->free(p, &err) == Status::invalid_argument);  // a second free is refused, with the reason
  CHECK_THAT(err.message, Catch::Contains("held for the processes that opened it"));
  // Fill the rest of the device, and more: the allocations that fit never land on the shared pages.
  std::vector<void*> others;
  for (int i = 0; i < 8; ++i)
    if (void* o = a->allocate(4 * MiB, 0, nullptr)) {
      fill(o, 4 * MiB, 0xEE);
      others.push_back(o);
    }
  CHECK(others.size() == 6);  // 32 MiB: 8 held for the importer, 24 for the rest
  a->empty_cache();
  CHECK(all(q, n, 0x11));
  require_consistent(*a);
  CHECK(a->stats().exported_bytes.all().current == static_cast<std::int64_t>(n));
  // The importer closes: the block goes back to the cache, and its memory serves the next request.
  REQUIRE(b->close_shared(q) == Status::ok);
  CHECK(a->reap_shared() == 1);
  CHECK(a->stats().exported_bytes.all().current == 0);
  CHECK(a->allocate(4 * MiB, 0, nullptr) != nullptr);
  require_consistent(*a);
}

TEST_CASE("sharing: a lease in flight or held by a copy keeps the block, and the last close frees it", "[share]") {
  auto a = make_engine(shareable(PolicyKind::fragless));
  void* p = a->allocate(2 * MiB, 0, nullptr);
  SharedBlock s;
  REQUIRE(a->share(p, &s) == Status::ok);
  const int copy = dup(s.fds[0]);  // as a message on its way holds one
  s.close_fds();
  REQUIRE(a->free(p) == Status::ok);
  CHECK(a->reap_shared() == 0);
  CHECK(a->stats().allocated_bytes.all().current == static_cast<std::int64_t>(2 * MiB));
  close(copy);
  CHECK(a->reap_shared(1000000) == 1);
  CHECK(a->stats().allocated_bytes.all().current == 0);
  require_consistent(*a);
}

TEST_CASE("sharing: forged, mismatched and stale descriptions are refused and map nothing", "[share]") {
  auto a = make_engine(shareable(PolicyKind::fragless));
  auto b = make_engine(shareable(PolicyKind::fragless));
  void* p = a->allocate(3 * MiB, 0, nullptr);
  void* p2 = a->allocate(2 * MiB, 0, nullptr);
  SharedBlock s, s2;
  REQUIRE(a->share(p, &s) == Status::ok);
  REQUIRE(a->share(p2, &s2) == Status::ok);
  auto refused = [&](const std::string& desc, std::vector<int> fds, const char* why) {
    AllocError err;
    std::size_t size = 0;
    CHECK(b->open_shared(desc, fds.data(), fds.size(), &size, &err) == nullptr);
    CHECK_THAT(err.message, Catch::Contains(why));
    CHECK_THAT(err.message, Catch::Contains("nothing was mapped"));
    const auto c = host_driver_census(b->driver());
    CHECK(c.mappings == 0);
    CHECK(c.reservations == 0);
    CHECK(c.handles == 0);
  };
  refused(s.description.substr(0, 10), s.fds, "too short");
  std::string bad = s.description;
  bad[0] = 'X';
  refused(bad, s.fds, "not a fragless share's");
  refused(s.description, {s.fds[0]}, "descriptors came with a description");
  // A handle's entry: size, device and inode of its descriptor (8 bytes each), then 64 of fabric handle.
  const std::size_t last = s.description.size() - 88;
  bad = s.description;
  bad[last + 2] ^= 0x40;  // the last handle's size, 4 MiB more
  refused(bad, s.fds, "do not add up");
  // Sizes that add up, in a description its lease did not carry.
  bad = s.description;
  bad[last + 23] ^= 0x01;  // the last handle's inode
  refused(bad, s.fds, "not the one its lease carries");
  // The lease of another share.
  std::vector<int> swapped = s.fds;
  swapped[0] = s2.fds[0];
  refused(s.description, swapped, "not the one its lease carries");
  // A handle's descriptor where the lease should be; another socket's.
  swapped = s.fds;
  swapped[0] = s.fds[1];
  refused(s.description, swapped, "not a share's lease socket");
  int pair[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, pair) == 0);
  swapped[0] = pair[0];
  refused(s.description, swapped, "not the one its lease carries");
  close(pair[0]);
  close(pair[1]);
  // A handle descriptor of other memory (another share's, of the same size).
  swapped = s.fds;
  swapped[1] = s2.fds[1];
  refused(s.description, swapped, "not the memory the share describes");
  // Stale: the exporting engine is gone (its process exited).
  std::string desc = s.description;
  std::vector<int> fds = s.fds;
  s.fds.clear();  // kept open here, past the engine
  a.reset();
  refused(desc, fds, "stale");
  for (int fd : fds) close(fd);
}

TEST_CASE("sharing: 1,000 share, open and close cycles leak no descriptor, mapping or byte", "[share]") {
  auto a = make_engine(shareable(PolicyKind::fragless));
  auto b = make_engine(shareable(PolicyKind::fragless));
  void* keep = a->allocate(MiB, 0, nullptr);
  const std::size_t fds0 = open_fds();
  const auto ca = host_driver_census(a->driver());
  for (int i = 0; i < 1000; ++i) {
    const std::size_t n = (1 + i % 5) * MiB + (i % 3) * 4096;
    void* p = a->allocate(n, 0, nullptr);
    REQUIRE(p);
    static_cast<unsigned char*>(p)[n - 1] = static_cast<unsigned char>(i);
    SharedBlock s;
    REQUIRE(a->share(p, &s) == Status::ok);
    std::size_t size = 0;
    AllocError err;
    void* q = open_in(*b, s, &size, &err);
    REQUIRE(q);
    REQUIRE(static_cast<unsigned char*>(q)[n - 1] == static_cast<unsigned char>(i));
    s.close_fds();
    if (i % 2) REQUIRE(a->free(p) == Status::ok);  // freed before the importer closes, half the time
    REQUIRE(b->close_shared(q) == Status::ok);
    if (i % 2 == 0) REQUIRE(a->free(p) == Status::ok);
    a->reap_shared();
  }
  CHECK(a->stats().allocated_bytes.all().current == static_cast<std::int64_t>(round_size(MiB, a->options())));
  CHECK(a->stats().exported_bytes.all().current == 0);
  CHECK(b->stats().imported_bytes.all().current == 0);
  a->empty_cache();  // the cached handles' descriptors go too (the host driver holds one per handle)
  CHECK(open_fds() == fds0);
  const auto c = host_driver_census(b->driver());
  CHECK(c.mappings == 0);
  CHECK(c.reservations == 0);
  CHECK(c.handles == 0);
  CHECK(host_driver_census(a->driver()).physical_bytes <= ca.physical_bytes);
  require_consistent(*a);
  require_consistent(*b);
  a->free(keep);
}

TEST_CASE("sharing: a range registered for NCCL is never re-backed until its deregistration", "[share]") {
  // Capacity for the registered block and little more: fragless would re-back its pages once it is freed.
  auto a = make_engine(shareable(PolicyKind::fragless, 16 * MiB));
  auto* p = static_cast<unsigned char*>(a->allocate(8 * MiB, 0, nullptr));
  std::memset(p, 0x3C, 8 * MiB);
  AllocError err;
  CHECK(a->register_range(p + 4096, 9 * MiB, &err) == Status::invalid_argument);  // past the allocation
  CHECK_THAT(err.message, Catch::Contains("not inside one live fragless allocation"));
  REQUIRE(a->register_range(p + 4096, MiB, &err) == Status::ok);  // an interior range, as a tensor view's
  REQUIRE(a->free(p) == Status::ok);
  CHECK(a->stats().allocated_bytes.all().current == static_cast<std::int64_t>(8 * MiB));
  std::vector<void*> more;
  while (void* q = a->allocate(2 * MiB, 0, nullptr)) {
    std::memset(q, 0xEE, 2 * MiB);
    more.push_back(q);
  }
  CHECK(more.size() == 4);  // 16 MiB: 8 held for NCCL
  a->empty_cache();
  for (std::size_t i = 0; i < 8 * MiB; i += 4096) REQUIRE(p[i] == 0x3C);
  require_consistent(*a);
  CHECK(a->deregister_range(p + 5000, &err) == Status::ok);  // anywhere inside the block
  CHECK(a->stats().allocated_bytes.all().current == static_cast<std::int64_t>(4 * 2 * MiB));
  CHECK(a->deregister_range(p, &err) == Status::invalid_argument);
  CHECK_THAT(err.message, Catch::Contains("which no register_range holds"));
  CHECK(a->allocate(8 * MiB, 0, nullptr) != nullptr);  // the memory serves again
  require_consistent(*a);
}

TEST_CASE("sharing: a driver call that fails while sharing or opening leaks nothing and says which", "[share]") {
  auto a = make_engine(shareable(PolicyKind::fragless));
  auto b = make_engine(shareable(PolicyKind::fragless));
  void* p = a->allocate(5 * MiB, 0, nullptr);
  const std::size_t fds0 = open_fds();
  SharedBlock s;
  AllocError err;
  host_driver_inject_failure(a->driver(), DriverCall::export_handle, 2, Status::driver_error);
  CHECK(a->share(p, &s, &err) == Status::driver_error);
  CHECK_THAT(err.message, Catch::Contains("export_handle: injected failure"));
  CHECK(s.fds.empty());
  CHECK(open_fds() == fds0);
  CHECK(a->stats().exported_bytes.all().current == 0);
  require_consistent(*a);
  REQUIRE(a->share(p, &s, &err) == Status::ok);
  for (DriverCall c : {DriverCall::reserve, DriverCall::import_handle, DriverCall::map, DriverCall::set_access}) {
    for (std::uint64_t nth : {1, 2}) {
      if (nth == 2 && (c == DriverCall::reserve || c == DriverCall::set_access)) continue;  // one call each
      INFO(driver_call_name(c) << " call " << nth);
      host_driver_inject_failure(b->driver(), c, nth, Status::driver_error);
      std::size_t size = 0;
      CHECK(b->open_shared(s.description, s.fds.data(), s.fds.size(), &size, &err) == nullptr);
      CHECK_THAT(err.message, Catch::Contains(std::string(driver_call_name(c)) + ": injected failure"));
      host_driver_inject_failure(b->driver(), c, 0, Status::ok);
      const auto census = host_driver_census(b->driver());
      CHECK(census.handles == 0);
      CHECK(census.mappings == 0);
      CHECK(census.reservations == 0);
      CHECK(b->stats().imported_bytes.all().current == 0);
      require_consistent(*b);
    }
  }
  std::size_t size = 0;
  void* q = b->open_shared(s.description, s.fds.data(), s.fds.size(), &size, &err);
  REQUIRE(q);  // the same share opens once nothing fails
  REQUIRE(b->close_shared(q) == Status::ok);
  s.close_fds();
  REQUIRE(a->free(p) == Status::ok);
  CHECK(a->stats().allocated_bytes.all().current == 0);
}

// Note [Memory the driver would not give back]: an opened block's handles are released as soon as they are
// mapped (the mapping keeps them). When those releases fail, the handles wait on the deferred list; they are the
// exporter's memory, which the importer's memory fraction does not count (PyTorch counts no import either).
TEST_CASE("sharing: an imported handle whose release fails counts nothing against the importer's fraction",
          "[share][faults]") {
  auto a = make_engine(shareable(PolicyKind::fragless));
  auto b = make_engine(shareable(PolicyKind::fragless));
  REQUIRE(b->set_memory_fraction(0.5) == Status::ok);  // 128 MiB
  void* p = a->allocate(100 * MiB, 0, nullptr);
  REQUIRE(p);
  SharedBlock s;
  AllocError err;
  REQUIRE(a->share(p, &s, &err) == Status::ok);
  host_driver_inject_failure(b->driver(), DriverCall::release, 1, Status::driver_error, 1u << 30);
  std::size_t size = 0;
  void* q = open_in(*b, s, &size, &err);
  REQUIRE(q);
  CHECK(host_driver_injected_failures(b->driver()) >= 1);
  void* own = b->allocate(100 * MiB, 0, &err);  // 100 of 128 MiB: the import is not b's
  INFO(err.message);
  CHECK(own);
  host_driver_inject_failure(b->driver(), DriverCall::release, 0, Status::ok);
  if (own) REQUIRE(b->free(own) == Status::ok);
  REQUIRE(b->close_shared(q) == Status::ok);
  b->empty_cache();
  CHECK(host_driver_census(b->driver()).handles == 0);
  s.close_fds();
  REQUIRE(a->free(p) == Status::ok);
  require_consistent(*a);
  require_consistent(*b);
}

TEST_CASE("sharing: stats count shared bytes per pool, snapshots mark held blocks and list imported ones",
          "[share]") {
  const PolicyKind policy = GENERATE(PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless);
  CAPTURE(name(policy));
  auto a = make_engine(shareable(policy));
  auto b = make_engine(shareable(policy));
  void* small = a->allocate(4096, 0, nullptr);  // the small pool
  void* large = a->allocate(5 * MiB, 0, nullptr);
  REQUIRE((small && large));
  SharedBlock s1, s2;
  AllocError err;
  REQUIRE(a->share(small, &s1, &err) == Status::ok);
  REQUIRE(a->share(large, &s2, &err) == Status::ok);
  const DeviceStats sa = a->stats();
  CHECK(sa.exported_bytes.by_pool[kSmallPool].current > 0);
  CHECK(sa.exported_bytes.by_pool[kLargePool].current >= static_cast<std::int64_t>(5 * MiB));
  CHECK(sa.exported_bytes.all().current ==
        sa.exported_bytes.by_pool[kSmallPool].current + sa.exported_bytes.by_pool[kLargePool].current);
  CHECK(sa.flatten().at("exported_bytes.small_pool.current") == sa.exported_bytes.by_pool[kSmallPool].current);
  REQUIRE(a->register_range(large, MiB) == Status::ok);
  std::size_t held = 0, marked_bytes = 0;
  for (const SegmentInfo& seg : a->snapshot()) {
    std::size_t in_segment = 0;
    for (const BlockInfo& bi : seg.blocks) {
      in_segment += bi.exported_bytes;
      if (!bi.held) continue;
      ++held;
      CHECK(bi.leases == 1);
      CHECK(bi.registrations == (bi.address == reinterpret_cast<DevicePtr>(large) ? 1 : 0));
      CHECK(bi.state == BlockInfo::active_allocated);
      CHECK(bi.exported_bytes >= bi.size);
    }
    CHECK(seg.exported_bytes == in_segment);
    marked_bytes += in_segment;
  }
  CHECK(held == 2);
  CHECK(static_cast<std::int64_t>(marked_bytes) == sa.exported_bytes.all().current);
  std::size_t size = 0;
  void* q1 = open_in(*b, s1, &size, &err);
  void* q2 = open_in(*b, s2, &size, &err);
  REQUIRE((q1 && q2));
  const DeviceStats sb = b->stats();
  CHECK(sb.imported_bytes.by_pool[kSmallPool].current == sa.exported_bytes.by_pool[kSmallPool].current);
  CHECK(sb.imported_bytes.by_pool[kLargePool].current == sa.exported_bytes.by_pool[kLargePool].current);
  const std::vector<ImportInfo> ims = b->imports();
  REQUIRE(ims.size() == 2);
  for (const ImportInfo& im : ims) {
    CHECK((im.address == reinterpret_cast<DevicePtr>(q1) || im.address == reinterpret_cast<DevicePtr>(q2)));
    CHECK(im.small == (im.address == reinterpret_cast<DevicePtr>(q1)));
    CHECK(im.exporter_pid == getpid());
    CHECK((im.mapped_address <= im.address && im.address + im.size <= im.mapped_address + im.mapped_size));
  }
  CHECK(ims[0].mapped_size + ims[1].mapped_size == static_cast<std::size_t>(sb.imported_bytes.all().current));
  REQUIRE(b->close_shared(q1, &err) == Status::ok);
  REQUIRE(b->close_shared(q2, &err) == Status::ok);
  CHECK(b->imports().empty());
  CHECK(b->stats().imported_bytes.all().peak == sb.imported_bytes.all().current);
  s1.close_fds();
  s2.close_fds();
  REQUIRE(a->free(large) == Status::ok);
  for (const SegmentInfo& seg : a->snapshot())
    for (const BlockInfo& bi : seg.blocks)
      if (bi.address == reinterpret_cast<DevicePtr>(large)) CHECK((bi.held && bi.owner_freed && bi.leases == 0));
  REQUIRE(a->deregister_range(large) == Status::ok);
  a->reap_shared();
  CHECK(a->stats().exported_bytes.all().current == 0);
  CHECK(a->stats().exported_bytes.all().peak == sa.exported_bytes.all().current);
  a->free(small);
  require_consistent(*a);
  require_consistent(*b);
}
