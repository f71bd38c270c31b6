// The driver contract (driver.h, R1-R9), rule by rule, on the host and sim drivers: every broken rule is
// refused with invalid_argument and a message naming it, and changes nothing. The libcuda double keeps
// the same rules at the C ABI (test_cuda_driver.cpp, "libcuda double: the driver contract").
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <vector>
#include <string>

#include "helpers.h"
#include "seed.h"

using namespace fragless;
using namespace fragless::test;

namespace {

std::unique_ptr<Driver> driver_of(DriverKind k, std::size_t capacity = 64 * MiB) {
  if (k == DriverKind::host) {
    HostDriverOptions o;
    o.capacity = capacity;
    std::string err;
    auto d = make_host_driver(o, &err);
    REQUIRE(d);
    return d;
  }
  SimDriverOptions o;
  o.capacity = capacity;
  return make_sim_driver(o);
}

// Refused, and the message names the rule.
void refused(Driver& d, Status st, const char* rule) {
  CHECK(st == Status::invalid_argument);
  INFO(d.last_error());
  CHECK(d.last_error().find(rule) != std::string::npos);
}

std::size_t free_bytes(Driver& d) {
  std::size_t f = 0, t = 0;
  d.memory_info(&f, &t);
  return f;
}

// The protection of the host mapping that holds va, from /proc/self/maps ("---p" when inaccessible); empty
// when no mapping of this process holds it.
std::string host_protection(DevicePtr va) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long lo = 0, hi = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %7s", &lo, &hi, perms) == 3 && lo <= va && va < hi) return perms;
  }
  return "";
}

}  // namespace

TEST_CASE("driver contract: every rule is enforced by the host and sim drivers", "[driver][contract]") {
  const DriverKind kind = GENERATE(DriverKind::host, DriverKind::sim);
  INFO(driver_kind_name(kind));
  auto d = driver_of(kind);
  DevicePtr va = 0, other = 0;
  PhysHandle h4 = 0, h2 = 0;
  REQUIRE(d->reserve(16 * MiB, &va) == Status::ok);
  REQUIRE(d->reserve(4 * MiB, &other) == Status::ok);
  REQUIRE(d->create(4 * MiB, &h4) == Status::ok);
  REQUIRE(d->create(2 * MiB, &h2) == Status::ok);

  SECTION("R1: sizes and addresses are non-zero multiples of the granularity") {
    DevicePtr x = 0;
    PhysHandle hx = 0;
    refused(*d, d->reserve(0, &x), "R1");
    refused(*d, d->reserve(3 * MiB, &x), "R1");
    refused(*d, d->create(1 * MiB, &hx), "R1");
    refused(*d, d->map(va + 4096, 4 * MiB, h4, 0), "R1");
  }
  SECTION("R2: a reservation is aligned address space of its own, inaccessible, holding no memory") {
    const std::size_t before = free_bytes(*d);
    DevicePtr x = 0, y = 0;
    REQUIRE(d->reserve(6 * MiB, &x) == Status::ok);
    REQUIRE(d->reserve(2 * MiB, &y) == Status::ok);
    const std::pair<DevicePtr, std::size_t> ranges[] = {{va, 16 * MiB}, {other, 4 * MiB}, {x, 6 * MiB}, {y, 2 * MiB}};
    for (auto [a, n] : ranges) {
      CHECK(a != 0);
      CHECK(a % d->granularity() == 0);
      for (auto [b, m] : ranges)
        if (a != b) CHECK((a + n <= b || b + m <= a));  // disjoint
      if (kind == DriverKind::host) {
        INFO("reservation at " << a);
        CHECK(host_protection(a) == "---p");
        CHECK(host_protection(a + n - 1) == "---p");
      }
    }
    CHECK(free_bytes(*d) == before);  // address space only
    CHECK(d->free_reservation(x, 6 * MiB) == Status::ok);
    CHECK(d->free_reservation(y, 2 * MiB) == Status::ok);
  }
  SECTION("R4: create names size bytes of memory; out of memory when they are not there, holding nothing") {
    const std::size_t before = free_bytes(*d);  // 64 MiB less h4 and h2
    REQUIRE(before == 58 * MiB);
    PhysHandle h = 0;
    REQUIRE(d->create(8 * MiB, &h) == Status::ok);
    CHECK(h != h4);
    CHECK(h != h2);
    CHECK(free_bytes(*d) == before - 8 * MiB);
    refused(*d, d->map(va, 4 * MiB, h, 0), "whole handle");  // it names 8 MiB, no less
    REQUIRE(d->map(va, 8 * MiB, h, 0) == Status::ok);
    const std::size_t handles = d->contract().handle_count();
    PhysHandle big = 0;
    CHECK(d->create(before - 8 * MiB + 2 * MiB, &big) == Status::out_of_memory);  // 2 MiB more than is left
    CHECK(free_bytes(*d) == before - 8 * MiB);
    CHECK(d->contract().handle_count() == handles);
    REQUIRE(d->create(before - 8 * MiB, &big) == Status::ok);  // exactly what is left
    CHECK(free_bytes(*d) == 0);
    PhysHandle none = 0;
    CHECK(d->create(2 * MiB, &none) == Status::out_of_memory);
    CHECK(d->contract().handle_count() == handles + 1);
    if (kind == DriverKind::host) CHECK(host_driver_census(*d).physical_bytes == 64 * MiB);
    REQUIRE(d->release(big) == Status::ok);
    REQUIRE(d->unmap(va, 8 * MiB) == Status::ok);
    REQUIRE(d->release(h) == Status::ok);
    CHECK(free_bytes(*d) == before);
  }
  SECTION("R5: a mapping is one whole handle at offset 0") {
    refused(*d, d->map(va, 2 * MiB, h4, 2 * MiB), "offset");  // an interior slice
    refused(*d, d->map(va, 2 * MiB, h4, 0), "whole handle");   // half a handle
    refused(*d, d->map(va, 6 * MiB, h4, 0), "whole handle");   // more than the handle
    REQUIRE(d->map(va, 4 * MiB, h4, 0) == Status::ok);
    refused(*d, d->map(va + 2 * MiB, 2 * MiB, h2, 0), "overlaps");
    refused(*d, d->map(va + 14 * MiB, 4 * MiB, h4, 0), "one reservation");  // runs past the reservation
    refused(*d, d->map(va, 4 * MiB, 999, 0), "unknown");
    CHECK(d->contract().mapping_count() == 1);
  }
  SECTION("R6: set_access covers whole, adjacent mappings only") {
    refused(*d, d->set_access(va, 4 * MiB), "R6");  // nothing mapped
    REQUIRE(d->map(va, 4 * MiB, h4, 0) == Status::ok);
    REQUIRE(d->map(va + 4 * MiB, 2 * MiB, h2, 0) == Status::ok);
    refused(*d, d->set_access(va, 2 * MiB), "R6");           // part of a mapping
    refused(*d, d->set_access(va, 8 * MiB), "R6");           // past the last mapping
    CHECK(d->set_access(va, 6 * MiB) == Status::ok);         // two adjacent whole mappings
  }
  SECTION("R7: unmap covers whole, adjacent mappings, never part of one") {
    REQUIRE(d->map(va, 4 * MiB, h4, 0) == Status::ok);
    REQUIRE(d->map(va + 4 * MiB, 2 * MiB, h2, 0) == Status::ok);
    refused(*d, d->unmap(va, 2 * MiB), "R7");
    refused(*d, d->unmap(va + 2 * MiB, 4 * MiB), "R7");
    refused(*d, d->unmap(va, 8 * MiB), "R7");
    CHECK(d->contract().mapping_count() == 2);
    CHECK(d->unmap(va, 6 * MiB) == Status::ok);  // several adjacent mappings in one call
    CHECK(d->contract().mapping_count() == 0);
  }
  SECTION("R5, R3: overlaps are found across the contract's 64-page words (Note [The contract's tables])") {
    // A reservation of 200 pages: a mapping that ends in one word and starts the next, met from either side.
    DevicePtr big = 0;
    const std::size_t g = d->granularity();
    REQUIRE(d->reserve(200 * g, &big) == Status::ok);
    REQUIRE(g == 2 * MiB);
    const DevicePtr word = (big / g / 64 + 1) * 64 * g;  // the first 64-page boundary after its first page
    REQUIRE(d->map(word - 2 * MiB, 4 * MiB, h4, 0) == Status::ok);  // its last page and the next word's first
    refused(*d, d->map(word, 2 * MiB, h2, 0), "overlaps");
    refused(*d, d->map(word - 2 * MiB, 2 * MiB, h2, 0), "overlaps");
    refused(*d, d->free_reservation(big, 200 * g), "mappings");
    CHECK(d->map(word + 2 * MiB, 2 * MiB, h2, 0) == Status::ok);  // just after it
    refused(*d, d->unmap(word, 4 * MiB), "R7");                    // half of one, all of the other
    CHECK(d->unmap(word - 2 * MiB, 6 * MiB) == Status::ok);
    CHECK(d->free_reservation(big, 200 * g) == Status::ok);
  }
  SECTION("R3: a reservation is freed whole, and only with nothing mapped inside") {
    REQUIRE(d->map(va, 4 * MiB, h4, 0) == Status::ok);
    refused(*d, d->free_reservation(va, 16 * MiB), "mappings");
    refused(*d, d->free_reservation(va, 8 * MiB), "exactly one reservation");
    REQUIRE(d->unmap(va, 4 * MiB) == Status::ok);
    CHECK(d->free_reservation(va, 16 * MiB) == Status::ok);
    refused(*d, d->free_reservation(va, 16 * MiB), "exactly one reservation");
  }
  SECTION("R8: a released handle keeps its memory until its last mapping goes, and cannot be mapped") {
    const std::size_t before = free_bytes(*d);
    REQUIRE(d->map(va, 4 * MiB, h4, 0) == Status::ok);
    REQUIRE(d->map(other, 4 * MiB, h4, 0) == Status::ok);  // R9: a second address
    REQUIRE(d->release(h4) == Status::ok);
    CHECK(free_bytes(*d) == before);  // still mapped twice
    refused(*d, d->map(va + 8 * MiB, 4 * MiB, h4, 0), "released");
    refused(*d, d->release(h4), "R8");
    REQUIRE(d->unmap(va, 4 * MiB) == Status::ok);
    CHECK(free_bytes(*d) == before);  // one mapping left
    REQUIRE(d->unmap(other, 4 * MiB) == Status::ok);
    CHECK(free_bytes(*d) == before + 4 * MiB);  // the last mapping went: so did the memory
    refused(*d, d->release(12345), "R8");
  }
}

TEST_CASE("driver contract: a handle mapped at two addresses shows the same bytes (host, R9)", "[driver][contract]") {
  auto d = driver_of(DriverKind::host);
  DevicePtr a = 0, b = 0;
  PhysHandle h = 0;
  REQUIRE(d->reserve(4 * MiB, &a) == Status::ok);
  REQUIRE(d->reserve(4 * MiB, &b) == Status::ok);
  REQUIRE(d->create(4 * MiB, &h) == Status::ok);
  REQUIRE(d->map(a, 4 * MiB, h, 0) == Status::ok);
  REQUIRE(d->map(b, 4 * MiB, h, 0) == Status::ok);
  REQUIRE(d->set_access(a, 4 * MiB) == Status::ok);
  REQUIRE(d->set_access(b, 4 * MiB) == Status::ok);
  std::memset(reinterpret_cast<void*>(a + 3 * MiB), 0x3c, 4096);
  CHECK(*reinterpret_cast<unsigned char*>(b + 3 * MiB + 100) == 0x3c);
  REQUIRE(d->unmap(a, 4 * MiB) == Status::ok);
  REQUIRE(d->unmap(b, 4 * MiB) == Status::ok);
  REQUIRE(d->release(h) == Status::ok);
  CHECK(host_driver_census(*d).physical_bytes == 0);
}

TEST_CASE("driver contract: every policy keeps it on a randomized workload (sim)", "[driver][contract][seeded]") {
  // A driver that refused a call would fail an allocation or leave a mapping behind; the policies must
  // never break a rule, so no call may be refused at all.
  const PolicyKind policy = GENERATE(PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless);
  INFO(name(policy));
  EngineSpec spec;
  spec.policy = policy;
  spec.capacity = 4096 * MiB;
  auto e = make_engine(spec);
  std::vector<void*> live;
  const std::uint64_t seed = test_seed(88172645463325252ull);
  CAPTURE(seed);
  std::uint64_t x = seed ? seed : 1;  // xorshift: any state but 0
  auto rnd = [&] { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return x; };
  for (int i = 0; i < 4000; ++i) {
    if (live.empty() || (live.size() < 150 && rnd() % 3)) {
      const std::size_t decade = rnd() % 6;
      std::size_t size = 512;
      for (std::size_t k = 0; k < decade; ++k) size *= 8;
      size += rnd() % size;
      AllocError err;
      void* p = e->allocate(size, static_cast<Stream>(rnd() % 2), &err);
      INFO(err.message);
      REQUIRE(p != nullptr);
      live.push_back(p);
    } else {
      const std::size_t k = rnd() % live.size();
      e->free(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
    if (i % 500 == 0) {
      INFO(e->driver().last_error());
      require_consistent(*e);
    }
    if (i % 1000 == 999) e->empty_cache();
  }
  for (void* p : live) e->free(p);
  e->empty_cache();
  CHECK(e->driver().contract().mapping_count() == 0);
  CHECK(e->driver().contract().handle_count() == 0);
  CHECK(reserved(*e) == 0);
}

namespace {

// A driver whose calls run concurrently (as the cuda driver's do) and which gives a handle's value again as
// soon as its memory is gone (R8). `during` runs inside the next release or unmap after the value went: what
// another thread could do before the base class records that call.
class ConcurrentReuse final : public Driver {
 public:
  ConcurrentReuse() : Driver(0, 2 * MiB) {}
  const char* name() const override { return "concurrent-reuse"; }
  std::function<void()> during;
  std::vector<PhysHandle> released_unmapped;  // released handles whose memory an unmap would end

 private:
  bool concurrent_calls() const override { return true; }
  std::string do_last_error() const override { return {}; }
  void do_memory_info(std::size_t* f, std::size_t* t) override { *f = *t = 1024 * MiB; }
  void hand_out_again(PhysHandle h) {
    gone_.push_back(h);
    if (auto f = std::move(during)) f();
  }
  Status do_reserve(std::size_t size, DevicePtr* va) override {
    *va = next_va_;
    next_va_ += size + granularity();
    return Status::ok;
  }
  Status do_free_reservation(DevicePtr, std::size_t) override { return Status::ok; }
  Status do_create(std::size_t, PhysHandle* h) override {
    if (gone_.empty()) {
      *h = next_++;
    } else {
      *h = gone_.back();
      gone_.pop_back();
    }
    return Status::ok;
  }
  Status do_release(PhysHandle h) override {
    if (!mapped_.count(h)) hand_out_again(h);
    else released_unmapped.push_back(h);
    return Status::ok;
  }
  Status do_map(DevicePtr va, std::size_t, PhysHandle h, std::size_t) override {
    mapped_[h] = va;
    return Status::ok;
  }
  Status do_unmap(DevicePtr va, std::size_t) override {
    for (auto it = mapped_.begin(); it != mapped_.end(); ++it)
      if (it->second == va) {
        const PhysHandle h = it->first;
        mapped_.erase(it);
        if (std::erase(released_unmapped, h)) hand_out_again(h);
        break;
      }
    return Status::ok;
  }
  Status do_set_access(DevicePtr, std::size_t) override { return Status::ok; }
  Status do_record_event(Stream, Event* e) override {
    *e = 1;
    return Status::ok;
  }
  Status do_query_event(Event) override { return Status::ok; }
  Status do_synchronize_event(Event) override { return Status::ok; }
  Status do_release_event(Event) override { return Status::ok; }
  Status do_stream_wait_event(Stream, Event) override { return Status::ok; }
  Status do_synchronize_stream(Stream) override { return Status::ok; }
  Status do_synchronize_device() override { return Status::ok; }

  DevicePtr next_va_ = 0x7f0000000000ull;
  PhysHandle next_ = 1;
  std::vector<PhysHandle> gone_;
  std::map<PhysHandle, DevicePtr> mapped_;
};

}  // namespace

// R8 with concurrent calls: the driver may give a released handle's value to another thread's create before
// the release is recorded. The record must not take the new handle for the old: before the entries had
// serials, the release's record erased the new handle's entry (its map then refused: "unknown or released
// handle"), and an unmap's record decremented the new handle's mapping count below zero.
TEST_CASE("driver contract: a value given again before its release or unmap is recorded is a new handle",
          "[driver][contract]") {
  ConcurrentReuse d;
  DevicePtr va = 0;
  REQUIRE(d.reserve(16 * MiB, &va) == Status::ok);
  SECTION("release") {
    PhysHandle h = 0, again = 0;
    REQUIRE(d.create(2 * MiB, &h) == Status::ok);
    d.during = [&] { REQUIRE(d.create(2 * MiB, &again) == Status::ok); };
    REQUIRE(d.release(h) == Status::ok);
    REQUIRE(again == h);  // the driver gave the value again
    CHECK(d.map(va, 2 * MiB, again, 0) == Status::ok);
    CHECK(d.set_access(va, 2 * MiB) == Status::ok);
    CHECK(d.unmap(va, 2 * MiB) == Status::ok);
    CHECK(d.release(again) == Status::ok);
    CHECK(d.contract().handle_count() == 0);
  }
  SECTION("unmap") {
    PhysHandle h = 0, again = 0;
    REQUIRE(d.create(2 * MiB, &h) == Status::ok);
    REQUIRE(d.map(va, 2 * MiB, h, 0) == Status::ok);
    REQUIRE(d.release(h) == Status::ok);  // still mapped: its memory goes with the unmap
    d.during = [&] {
      REQUIRE(d.create(2 * MiB, &again) == Status::ok);
      REQUIRE(d.map(va + 4 * MiB, 2 * MiB, again, 0) == Status::ok);
    };
    REQUIRE(d.unmap(va, 2 * MiB) == Status::ok);
    REQUIRE(again == h);
    CHECK(d.contract().handle_count() == 1);  // the new handle, mapped once
    CHECK(d.release(again) == Status::ok);
    CHECK(d.contract().handle_count() == 1);  // still mapped: it stays until its unmap
    CHECK(d.unmap(va + 4 * MiB, 2 * MiB) == Status::ok);
    CHECK(d.contract().handle_count() == 0);
  }
  CHECK(d.free_reservation(va, 16 * MiB) == Status::ok);
}
