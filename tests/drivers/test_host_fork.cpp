// A forked child of a process whose allocator runs on the host driver (the CPU allocator, driver:host) has
// its memory apart from the parent's, as fork() gives ordinary memory (Note [Host memory across fork]):
// neither side's writes, allocations or releases reach the other's blocks.
#include <catch2/catch.hpp>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <string>
#include <thread>

#include "fragless/allocator.h"
#include "fragless/host_driver.h"
#include "helpers.h"
#include "watchdog.h"

using namespace fragless;

namespace {

using test::MiB;
constexpr std::size_t kSize = 6 * MiB;  // three pages: one handle per request below a cell is not assumed

bool all_bytes(const void* p, std::size_t n, unsigned char v) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; i += 4096 / 4)
    if (b[i] != v) return false;
  return b[n - 1] == v;
}

// The two pipes between a test and its forked child: each side keeps only its own ends, so a side that
// ends makes the other's read return at once instead of waiting for ever.
struct Pipes {
  int to_child[2], to_parent[2];
  Pipes() {
    REQUIRE(pipe(to_child) == 0);
    REQUIRE(pipe(to_parent) == 0);
  }
  // In the child: its ends only, and an alarm so that a child the test forgot ends anyway.
  void child_side() {
    close_end(to_child[1]);
    close_end(to_parent[0]);
    alarm(test::child_alarm_s());
  }
  void parent_side() {
    close_end(to_child[0]);
    close_end(to_parent[1]);
  }
  // fork(), each side keeping its own ends: 0 in the child.
  pid_t fork_child() {
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) child_side();
    else parent_side();
    return pid;
  }
  static void close_end(int& fd) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
  void child_send(char c) {
    if (write(to_parent[1], &c, 1) != 1) _exit(90);
  }
  char child_receive() {
    char c = 0;
    return read(to_child[0], &c, 1) == 1 ? c : '\0';
  }
  void parent_send(char c) { REQUIRE(write(to_child[1], &c, 1) == 1); }
  ~Pipes() {
    for (int* fd : {&to_child[0], &to_child[1], &to_parent[0], &to_parent[1]}) close_end(*fd);
  }
};

int wait_child(pid_t pid) { return test::wait_for_child(pid, "the forked child"); }

// The parent waits for the child's `c`; anything else (the child ended first) fails with how the child ended.
// A child silent for child_watchdog_s() has its stacks, and its own children's, printed before it is killed
// (its own alarm comes later).
void parent_expect(Pipes& p, pid_t pid, char c) {
  pollfd pfd{p.to_parent[0], POLLIN, 0};
  int ready = 0;
  do ready = poll(&pfd, 1, test::child_watchdog_s() * 1000);
  while (ready < 0 && errno == EINTR);
  if (ready == 0) {
    const int status = test::end_hung_child(pid, std::string("the forked child, silent since '") + c + "' was due,",
                                            test::child_watchdog_s());
    FAIL("the forked child did not say '" << c << "' in " << test::child_watchdog_s() << " s (stacks on stderr): it "
                                          << test::describe_status(status));
  }
  char got = 0;
  if (read(p.to_parent[0], &got, 1) == 1 && got == c) return;
  const int status = wait_child(pid);
  FAIL("the forked child did not say '" << c << "': it " << test::describe_status(status));
}

}  // namespace

TEST_CASE("host driver across fork: the child's writes, allocations and releases never reach the parent's memory",
          "[driver][fork]") {
  const char* conf = GENERATE("driver:host,capacity_mb:256", "driver:host,capacity_mb:256,shareable_handles:True",
                              "driver:host,capacity_mb:256,policy:classic",
                              "driver:host,capacity_mb:256,policy:expandable");
  INFO(conf);
  auto a = test::allocator_from(conf);
  DeviceEngine* e = a->device(0);
  REQUIRE(e);
  AllocError err;
  void* kept = e->allocate(kSize, 0, &err);  // live at the fork, in both
  REQUIRE(kept);
  std::memset(kept, 0x22, kSize);
  void* cached = e->allocate(kSize, 0, &err);  // free at the fork: the next allocation of each side gets it
  REQUIRE(cached);
  REQUIRE(e->free(cached) == Status::ok);

  Pipes pipes;
  const pid_t pid = pipes.fork_child();
  if (pid == 0) {
    // Exit codes name the check that failed: 10s before the parent wrote, 20s after, 30s after releasing.
    AllocError cerr;
    if (!all_bytes(kept, kSize, 0x22)) _exit(10);  // what the parent wrote before the fork
    std::memset(kept, 0x33, kSize);                // the child's own copy from here on
    void* mine = e->allocate(kSize, 0, &cerr);
    if (mine != cached) _exit(11);  // the same cached block the parent will take
    std::memset(mine, 0x44, kSize);
    pipes.child_send('1');
    if (pipes.child_receive() != '2') _exit(12);
    if (!all_bytes(kept, kSize, 0x33)) _exit(20);
    if (!all_bytes(mine, kSize, 0x44)) _exit(21);  // not the parent's 0x55
    // A fork of the child: its copy is the child's memory as the child wrote it, and stays apart from it.
    const pid_t grandchild = fork();
    if (grandchild < 0) _exit(25);
    if (grandchild == 0) {
      alarm(test::child_alarm_s());  // alarms are not inherited across fork
      if (!all_bytes(mine, kSize, 0x44) || !all_bytes(kept, kSize, 0x33)) _exit(1);
      std::memset(mine, 0x99, kSize);
      void* its = e->allocate(kSize, 0, &cerr);  // from the child's own memfd, or what it inherited
      if (!its) _exit(2);
      std::memset(its, 0x98, kSize);
      _exit(0);
    }
    int gs = 0;
    if (waitpid(grandchild, &gs, 0) != grandchild || !WIFEXITED(gs) || WEXITSTATUS(gs) != 0) _exit(26);
    if (!all_bytes(mine, kSize, 0x44) || !all_bytes(kept, kSize, 0x33)) _exit(27);
    // Give everything back: the memory is the child's, whatever the parent does with its own.
    if (e->free(mine) != Status::ok || e->free(kept) != Status::ok) _exit(22);
    if (e->empty_cache(&cerr) != Status::ok) _exit(23);
    void* again = e->allocate(kSize, 0, &cerr);  // created anew in the child
    if (!again) _exit(24);
    std::memset(again, 0x66, kSize);
    pipes.child_send('3');
    if (pipes.child_receive() != '4') _exit(30);
    if (!all_bytes(again, kSize, 0x66)) _exit(31);
    _exit(0);
  }
  parent_expect(pipes, pid, '1');
  CHECK(all_bytes(kept, kSize, 0x22));  // the child's 0x33 stayed in the child
  void* ours = e->allocate(kSize, 0, &err);
  REQUIRE(ours == cached);
  CHECK(all_bytes(ours, kSize, 0x44) == false);  // not the child's block: its bytes are the parent's own
  std::memset(ours, 0x55, kSize);
  pipes.parent_send('2');
  parent_expect(pipes, pid, '3');  // the child freed, emptied its cache, and created anew
  CHECK(all_bytes(kept, kSize, 0x22));
  CHECK(all_bytes(ours, kSize, 0x55));
  void* more = e->allocate(kSize, 0, &err);  // created in the parent after the child's release
  REQUIRE(more);
  std::memset(more, 0x77, kSize);
  pipes.parent_send('4');
  const int status = wait_child(pid);
  INFO("the child " << test::describe_status(status));
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK(all_bytes(kept, kSize, 0x22));
  CHECK(all_bytes(ours, kSize, 0x55));
  CHECK(all_bytes(more, kSize, 0x77));
  REQUIRE(e->free(ours) == Status::ok);
  REQUIRE(e->free(more) == Status::ok);
  REQUIRE(e->free(kept) == Status::ok);
  CHECK(e->empty_cache(&err) == Status::ok);
}

// The driver's own promises in the child, one call at a time: a handle made before the fork is mapped
// copy-on-write wherever the child maps it (also one not mapped at the fork, or mapped without access), is
// never exported, and its release gives back the child's budget without touching the parent's pages; the
// child's first create makes memory of its own.
TEST_CASE("host driver across fork: inherited handles in the child, call by call", "[driver][fork]") {
  const bool shareable = GENERATE(false, true);
  INFO("shareable " << shareable);
  HostDriverOptions o;
  o.capacity = 16 * MiB;
  o.shareable = shareable;
  std::string err;
  auto d = make_host_driver(o, &err);
  INFO(err);
  REQUIRE(d);
  constexpr std::size_t P = 2 * MiB;
  DevicePtr va = 0;
  REQUIRE(d->reserve(8 * P, &va) == Status::ok);
  PhysHandle open_h = 0, closed_h = 0, unmapped_h = 0;
  REQUIRE(d->create(P, &open_h) == Status::ok);      // mapped with access at the fork
  REQUIRE(d->create(P, &closed_h) == Status::ok);    // mapped without access at the fork
  REQUIRE(d->create(P, &unmapped_h) == Status::ok);  // not mapped at the fork
  REQUIRE(d->map(va, P, open_h, 0) == Status::ok);
  REQUIRE(d->set_access(va, P) == Status::ok);
  std::memset(reinterpret_cast<void*>(va), 0x11, P);
  REQUIRE(d->map(va + P, P, closed_h, 0) == Status::ok);
  {  // fill the other two through a second mapping, then leave them as described
    DevicePtr tmp = 0;
    REQUIRE(d->reserve(2 * P, &tmp) == Status::ok);
    REQUIRE(d->map(tmp, P, closed_h, 0) == Status::ok);
    REQUIRE(d->map(tmp + P, P, unmapped_h, 0) == Status::ok);
    REQUIRE(d->set_access(tmp, 2 * P) == Status::ok);
    std::memset(reinterpret_cast<void*>(tmp), 0x12, P);
    std::memset(reinterpret_cast<void*>(tmp + P), 0x13, P);
    REQUIRE(d->unmap(tmp, 2 * P) == Status::ok);
    REQUIRE(d->free_reservation(tmp, 2 * P) == Status::ok);
  }
  std::size_t parent_free = 0, total = 0;
  d->memory_info(&parent_free, &total);
  REQUIRE(parent_free == total - 3 * P);

  Pipes pipes;
  const pid_t pid = pipes.fork_child();
  if (pid == 0) {
    auto at = [&](std::size_t i) { return reinterpret_cast<void*>(va + i * P); };
    std::size_t free_now = 0, tot = 0;
    d->memory_info(&free_now, &tot);
    if (free_now != parent_free) _exit(10);  // what it inherited is counted in its budget
    if (host_driver_census(*d).handles != 3) _exit(11);
    int fd = -1;
    if (d->export_handle(open_h, &fd) != Status::not_supported) _exit(12);  // never exported
    if (!all_bytes(at(0), P, 0x11)) _exit(13);
    std::memset(at(0), 0x21, P);
    if (d->set_access(va + P, P) != Status::ok) _exit(14);  // no access at the fork: copy-on-write too
    if (!all_bytes(at(1), P, 0x12)) _exit(15);
    std::memset(at(1), 0x22, P);
    if (d->map(va + 2 * P, P, unmapped_h, 0) != Status::ok || d->set_access(va + 2 * P, P) != Status::ok) _exit(16);
    if (!all_bytes(at(2), P, 0x13)) _exit(17);
    std::memset(at(2), 0x23, P);
    // The same inherited handle at a second address: copy-on-write on its own (R9 does not hold here).
    if (d->map(va + 3 * P, P, open_h, 0) != Status::ok || d->set_access(va + 3 * P, P) != Status::ok) _exit(18);
    if (!all_bytes(at(3), P, 0x11)) _exit(19);  // the parent's bytes, not the child's 0x21
    // New memory of the child's own, exported where it was created exportable.
    PhysHandle mine = 0;
    if (d->create(P, &mine) != Status::ok) _exit(20);
    if (d->map(va + 4 * P, P, mine, 0) != Status::ok || d->set_access(va + 4 * P, P) != Status::ok) _exit(21);
    std::memset(at(4), 0x24, P);
    if (shareable) {
      if (d->export_handle(mine, &fd) != Status::ok) _exit(22);
      close(fd);
    }
    pipes.child_send('1');
    if (pipes.child_receive() != '2') _exit(30);
    // The parent wrote 0x31 into all three after the child wrote its own: the child's pages are its own.
    if (!all_bytes(at(0), P, 0x21) || !all_bytes(at(1), P, 0x22) || !all_bytes(at(2), P, 0x23)) _exit(31);
    if (!all_bytes(at(4), P, 0x24)) _exit(32);
    // Releasing everything gives the child its whole budget back and leaves the parent's pages alone.
    if (d->unmap(va, 5 * P) != Status::ok) _exit(33);
    for (PhysHandle h : {open_h, closed_h, unmapped_h, mine})
      if (d->release(h) != Status::ok) _exit(34);
    d->memory_info(&free_now, &tot);
    if (free_now != tot || host_driver_census(*d).handles != 0) _exit(35);
    PhysHandle all = 0;  // the whole budget in one handle: the inherited handles' ranges are free again
    if (d->create(tot, &all) != Status::ok || d->release(all) != Status::ok) _exit(36);
    pipes.child_send('3');
    _exit(0);
  }
  parent_expect(pipes, pid, '1');
  auto at = [&](std::size_t i) { return reinterpret_cast<void*>(va + i * P); };
  CHECK(all_bytes(at(0), P, 0x11));  // the child's 0x21 stayed in the child
  REQUIRE(d->set_access(va + P, P) == Status::ok);
  CHECK(all_bytes(at(1), P, 0x12));
  REQUIRE(d->map(va + 2 * P, P, unmapped_h, 0) == Status::ok);
  REQUIRE(d->set_access(va + 2 * P, P) == Status::ok);
  CHECK(all_bytes(at(2), P, 0x13));
  for (std::size_t i = 0; i < 3; ++i) std::memset(at(i), 0x31, P);
  pipes.parent_send('2');
  parent_expect(pipes, pid, '3');
  const int status = wait_child(pid);
  INFO("the child " << test::describe_status(status));
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  for (std::size_t i = 0; i < 3; ++i) CHECK(all_bytes(at(i), P, 0x31));  // the child's releases punched nothing
  std::size_t free_now = 0;
  d->memory_info(&free_now, &total);
  CHECK(free_now == parent_free);
  if (shareable) {  // the parent's own handle stays exportable
    int fd = -1;
    CHECK(d->export_handle(open_h, &fd) == Status::ok);
    if (fd >= 0) close(fd);
  }
  REQUIRE(d->unmap(va, 3 * P) == Status::ok);
  for (PhysHandle h : {open_h, closed_h, unmapped_h}) REQUIRE(d->release(h) == Status::ok);
  REQUIRE(d->free_reservation(va, 8 * P) == Status::ok);
  CHECK(host_driver_census(*d).handles == 0);
}
