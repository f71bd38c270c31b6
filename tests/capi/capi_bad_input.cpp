// libfragless.so's C ABI given bad input, and called where a program's exit calls it: each refusal is named in
// fragless_last_error() at the call that was given it (and on stderr, one line, by the hooks that return
// nothing), loses nothing and ends nothing. One scenario per run, on the host driver (FRAGLESS_CONF, set by
// the CTest); linked against the library as a C or C++ program links it.
//
//   exit               a thread_local destructor, an atexit handler and a static destructor call in after
//                      their thread's last error was long: each call works and reads back its own error
//   filters            an empty graph-pool stream filter is every stream; one that throws fails the
//                      allocation it was asked for (fragless_pool_malloc: NULL and the filter's message)
//   record_stream      a pointer fragless did not allocate, or freed, is named (on stderr once); NULL and an imported block
//                      are nothing to record (FRAGLESS_CONF with shareable_handles:True)
//   history_ex         fragless_record_history_ex refuses a context or stacks value it does not know
//   pools              an end or release of a graph pool that was never begun is named
//   mem_get_info       a NULL out-parameter is named
//   last_error         a successful call leaves no error, whatever an earlier one left; a free of device 0's
//                      block naming device 1 succeeds
//   no_allocator       with an allocator that could not be made, a free keeps the reason in the last error
//   init_count         fragless_init with more devices than the driver has is refused at once
//
// Usage: fragless-capi-bad-input SCENARIO. Exit 0 when every check held; 1 with the failed checks on stderr.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fragless/fragless.h"
#include "process_checks.h"

namespace {

constexpr std::size_t kHuge = std::size_t{1} << 45;  // more than the host driver has: a long OOM message
constexpr const char* kOom = "CUDA out of memory";

cudaStream_t stream(std::uintptr_t v) { return reinterpret_cast<cudaStream_t>(v); }
std::string last_error() { return fragless_last_error(); }
bool has(const std::string& text, const char* part) { return text.find(part) != std::string::npos; }

// What `f` writes to stderr, line by line.
template <class F>
std::vector<std::string> stderr_of(F f) {
  std::fflush(stderr);
  std::FILE* tmp = std::tmpfile();
  REQUIRE(tmp != nullptr);
  const int saved = dup(2);
  dup2(fileno(tmp), 2);
  f();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::rewind(tmp);
  std::vector<std::string> lines;
  char line[8192];
  while (std::fgets(line, sizeof line, tmp)) lines.emplace_back(line);
  std::fclose(tmp);
  return lines;
}

// ---- exit: calls after the calling thread's C++ destructors ran (Note [Per-thread state at exit], capi.cpp) ----

// Allocates and writes blocks of many sizes and frees them: memory freed earlier is handed out again and
// overwritten, so a message written into freed memory does not read back as it was written.
void churn_heap() {
  std::vector<void*> blocks;
  for (std::size_t size : {24, 40, 72, 136, 264, 520, 700, 1032, 2056, 4104})
    for (int i = 0; i < 32; ++i) {
      void* b = std::malloc(size);
      std::memset(b, 'x', size);
      blocks.push_back(b);
    }
  for (void* b : blocks) std::free(b);
}

// What a late caller does: a failed allocation, a bad free and a good pair, each error read back after the
// heap was churned. False, with the reason on stderr, when one did not hold.
bool late_calls(const char* where) {
  bool ok = true;
  auto fail = [&](const char* what) {
    std::fprintf(stderr, "FAILED in %s: %s (last error: %.200s)\n", where, what, fragless_last_error());
    ok = false;
  };
  if (fragless_pool_malloc(kHuge, 0, nullptr) != nullptr) fail("32 TiB were allocated");
  churn_heap();
  if (std::strncmp(fragless_last_error(), kOom, std::strlen(kOom)) != 0) fail("the out-of-memory error reads back otherwise");
  int local = 0;
  fragless_free(&local, 4, 0, nullptr);  // says so on stderr
  churn_heap();
  if (!has(last_error(), "did not allocate")) fail("the bad free's error reads back otherwise");
  void* p = fragless_pool_malloc(4096, 0, nullptr);
  if (!p || *fragless_last_error()) fail("an allocation failed");
  fragless_free(p, 4096, 0, nullptr);
  if (*fragless_last_error()) fail("its free left an error");
  return ok;
}

// A snapshot sized on a thread, taken later on that thread with the buffer the protocol's second step gives.
bool sized_snapshot_taken(long sized, const char* where) {
  std::vector<char> buf(static_cast<std::size_t>(sized) + 1);
  const long got = fragless_snapshot(buf.data(), buf.size());
  if (got == sized && static_cast<unsigned char>(buf[0]) == 0x80) return true;  // a pickle's first byte
  std::fprintf(stderr, "FAILED in %s: the snapshot sized at %ld bytes came back as %ld\n", where, sized, got);
  return false;
}

struct LateOnThread {
  long sized = 0;
  ~LateOnThread() {
    if (!sized_snapshot_taken(sized, "a thread_local destructor") || !late_calls("a thread_local destructor"))
      _exit(1);
  }
};
thread_local LateOnThread t_late;

struct LateAtExit {
  long sized = 0;  // 0: main did not get as far as the exit
  ~LateAtExit() {
    if (!sized) return;
    if (!sized_snapshot_taken(sized, "a static destructor") || !late_calls("a static destructor")) _exit(1);
    std::printf("exit: the calls from a thread_local destructor, an atexit handler and a static destructor held\n");
    std::fflush(stdout);
  }
} g_late;  // made before main: destroyed after the atexit handlers main registers, and fragless's

int exit_scenario() {
  fragless_record_history_v2(1000, 3, 2, 0);  // frames of allocations and frees: each late call captures one
  std::thread worker([] {
    LateOnThread& late = t_late;  // made before the thread's first fragless call: destroyed after its state
    fragless_pool_malloc(kHuge, 0, nullptr);  // the thread's last error: long
    late.sized = fragless_snapshot(nullptr, 0);  // kept for the thread's next snapshot call
    CHECK(late.sized > 0);
  });
  worker.join();
  if (process_checks::failures) return 1;
  fragless_pool_malloc(kHuge, 0, nullptr);  // the main thread's last error: long
  CHECK(has(last_error(), kOom));
  std::atexit([] {
    if (!late_calls("an atexit handler")) _exit(1);
  });
  g_late.sized = fragless_snapshot(nullptr, 0);
  CHECK(g_late.sized > 0);
  return process_checks::failures ? 1 : 0;  // the rest happens at exit
}

// ---- filters ----

int filters_scenario() {
  // The default pools' id is no private pool: refused, and nothing is routed (the next allocation is the
  // default pools', which memory_snapshot(mempool_id=(0, 0)) would not tell apart).
  fragless_begin_allocate_to_pool(0, {0, 0}, std::function<bool(cudaStream_t)>());
  CHECK(has(last_error(), "pool id (0, 0) names the default pools, not a private one"));
  void* z = fragless_pool_malloc(1000, 0, stream(0x10));
  CHECK(z != nullptr && last_error().empty());
  fragless_free(z, 1000, 0, stream(0x10));
  fragless_end_allocate_to_pool(0, {0, 0});  // nothing routed to end: said
  CHECK(!last_error().empty());
  // An empty filter: every stream allocates from the pool (the engine's meaning), and nothing throws.
  fragless_begin_allocate_to_pool(0, {1, 2}, std::function<bool(cudaStream_t)>());
  CHECK(last_error().empty());
  void* a = nullptr;
  try {
    a = fragless_malloc(1000, 0, stream(0x10));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fragless_malloc threw with an empty filter: %s\n", e.what());
  }
  CHECK(a != nullptr);
  void* b = fragless_pool_malloc(1000, 0, stream(0x20));
  CHECK(b != nullptr && last_error().empty());
  fragless_end_allocate_to_pool(0, {1, 2});
  CHECK(last_error().empty());
  fragless_free(a, 1000, 0, stream(0x10));
  fragless_free(b, 1000, 0, stream(0x20));
  fragless_release_pool(0, {1, 2});
  CHECK(last_error().empty());

  // A filter that throws: the allocation it was asked for fails, named, and changes nothing.
  fragless_begin_allocate_to_pool(0, {3, 3}, [](cudaStream_t) -> bool { throw std::runtime_error("filter boom"); });
  void* c = fragless_pool_malloc(1000, 0, nullptr);
  CHECK(c == nullptr);
  CHECK(has(last_error(), "the stream filter of graph pool (3, 3) threw: filter boom"));
  std::string thrown;
  try {
    fragless_malloc(1000, 0, nullptr);  // throws by its contract (PyTorch's)
  } catch (const std::runtime_error& e) {
    thrown = e.what();
  }
  CHECK(has(thrown, "filter boom"));
  fragless_begin_allocate_to_pool(0, {4, 4}, [](cudaStream_t) -> bool { throw 7; });  // not a std::exception
  CHECK(fragless_pool_malloc(1000, 0, nullptr) == nullptr);
  CHECK(has(last_error(), "the stream filter of graph pool (4, 4) threw something that is not a std::exception"));
  fragless_end_allocate_to_pool(0, {4, 4});
  fragless_end_allocate_to_pool(0, {3, 3});
  CHECK(last_error().empty());
  void* d = fragless_pool_malloc(1000, 0, nullptr);
  CHECK(d != nullptr && last_error().empty());
  fragless_free(d, 1000, 0, nullptr);
  fragless_release_pool(0, {4, 4});
  fragless_release_pool(0, {3, 3});
  CHECK(last_error().empty());
  char stats[16384];
  CHECK(fragless_memory_stats(0, stats, sizeof stats) > 0);
  CHECK(has(stats, "\"allocation.all.current\":0,"));  // nothing was lost or left allocated
  return process_checks::failures ? 1 : 0;
}

// ---- record_stream ----

int record_stream_scenario() {
  void* p = fragless_pool_malloc(4096, 0, stream(0x10));
  REQUIRE(p != nullptr);
  CHECK(stderr_of([&] { fragless_record_stream(p, stream(0x20)); }).empty() && last_error().empty());
  // Named in the last error each time, on stderr the first time only: PyTorch passes the pointers of tensors
  // other libraries allocated too, which its own allocator skips without a word.
  bool first = true;
  auto refused = [&first](void* q, const char* why) {
    const auto lines = stderr_of([&] { fragless_record_stream(q, stream(0x20)); });
    char want[64];
    std::snprintf(want, sizeof want, "record_stream of pointer %p that fragless did not allocate", q);
    const bool said = first ? lines.size() == 1 && has(lines[0], want) && has(lines[0], "said once") : lines.empty();
    first = false;
    if (!CHECK(said && has(last_error(), want)))
      std::fprintf(stderr, "  (%s: %zu stderr lines, last error '%s')\n", why, lines.size(), last_error().c_str());
  };
  refused(reinterpret_cast<void*>(0xdead0000), "a pointer fragless never saw");
  refused(static_cast<char*>(p) + 8, "an interior pointer");
  fragless_free(p, 4096, 0, stream(0x10));
  refused(p, "a freed pointer");
  // NULL is a 0-byte allocation's pointer (an empty tensor's): nothing to record, as free(NULL).
  CHECK(stderr_of([] { fragless_record_stream(nullptr, stream(0x20)); }).empty() && last_error().empty());
  // A block opened from a share (another process's, here this one's): its owner orders its work.
  void* exported = fragless_pool_malloc(1 << 20, 0, nullptr);
  fragless_share* s = fragless_share_export(exported);
  REQUIRE(s != nullptr);
  const char* bytes = nullptr;
  const std::size_t len = fragless_share_description(s, &bytes);
  const int* fds = nullptr;
  const std::size_t nfds = fragless_share_fds(s, &fds);
  std::size_t size = 0;
  void* opened = fragless_open_shared(0, bytes, len, fds, nfds, &size);
  REQUIRE(opened != nullptr);
  CHECK(stderr_of([&] { fragless_record_stream(opened, stream(0x20)); }).empty() && last_error().empty());
  CHECK(fragless_close_shared(opened) == 0);
  fragless_share_free(s);
  fragless_free(exported, 0, 0, nullptr);
  CHECK(last_error().empty());
  return process_checks::failures ? 1 : 0;
}

// ---- history_ex ----

int history_ex_scenario() {
  fragless_record_history_ex(100, 1, 2);
  CHECK(last_error().empty());
  for (auto [context, stacks] : {std::pair{7, -1}, {3, 1}, {-1, 1}, {1, 4}, {2, 8}}) {
    fragless_record_history_ex(100, context, stacks);
    const std::string want = "fragless: record_history_ex: context " + std::to_string(context) +
                             " is not 0-2 (none, alloc, all) or stacks " + std::to_string(stacks) +
                             " is not a mask of 1 (python) and 2 (cpp); nothing was changed";
    if (!CHECK(last_error() == want)) std::fprintf(stderr, "  last error: '%s'\n", last_error().c_str());
  }
  // A context that asks for frames with no stacks to gather them.
  fragless_record_history_ex(100, 1, 0);
  CHECK(has(last_error(), "record_history_ex: context 1 asks for stack frames, but stacks 0 gathers none"));
  fragless_record_history_v2(100, 2, 0, 0);
  CHECK(has(last_error(), "record_history: context 2 asks for stack frames, but stacks 0 gathers none"));
  // The history recorded as before: an allocation and its free are in the snapshot.
  void* p = fragless_pool_malloc(1000, 0, nullptr);
  fragless_free(p, 1000, 0, nullptr);
  const long n = fragless_snapshot(nullptr, 0);
  std::string snap(static_cast<std::size_t>(n > 0 ? n : 0) + 1, '\0');
  CHECK(n > 0 && fragless_snapshot(snap.data(), snap.size()) == n);
  CHECK(has(snap, "free_completed"));
  fragless_record_history_ex(0, 0, 0);
  CHECK(last_error().empty());
  return process_checks::failures ? 1 : 0;
}

// ---- pools ----

int pools_scenario() {
  auto named = [](const std::vector<std::string>& lines, const char* part) {
    if (!CHECK(lines.size() == 1 && has(lines[0], part) && has(last_error(), part)))
      std::fprintf(stderr, "  wanted '%s': %zu stderr lines, last error '%s'\n", part, lines.size(), last_error().c_str());
  };
  named(stderr_of([] { fragless_end_allocate_to_pool(0, {5, 5}); }),
        "end_allocate_to_pool: pool (5, 5) of device 0 has no allocation routed to it");
  named(stderr_of([] { fragless_release_pool(0, {5, 5}); }), "release_pool: pool (5, 5) of device 0 has no use to release");
  named(stderr_of([] { fragless_end_allocate_stream_to_pool(0, stream(0x30)); }), "allocates to no pool");
  // A pool begun, ended and released says nothing; a release too many is named.
  const auto quiet = stderr_of([] {
    fragless_begin_allocate_to_pool(0, {6, 6}, [](cudaStream_t) { return true; });
    void* p = fragless_pool_malloc(1000, 0, nullptr);
    fragless_end_allocate_to_pool(0, {6, 6});
    fragless_free(p, 1000, 0, nullptr);
    fragless_release_pool(0, {6, 6});
  });
  CHECK(quiet.empty() && last_error().empty());
  named(stderr_of([] { fragless_release_pool(0, {6, 6}); }), "release_pool: pool (6, 6) of device 0 has no use to release");
  named(stderr_of([] { fragless_end_allocate_to_pool(0, {6, 6}); }), "pool (6, 6) of device 0 has no allocation routed");
  void* q = fragless_pool_malloc(1000, 0, nullptr);  // the default pool, as before
  CHECK(q != nullptr && last_error().empty());
  fragless_free(q, 1000, 0, nullptr);
  return process_checks::failures ? 1 : 0;
}

// ---- mem_get_info ----

int mem_get_info_scenario() {
  std::size_t free_b = 0, total_b = 0;
  CHECK(fragless_mem_get_info(0, nullptr, nullptr) == -1);
  CHECK(has(last_error(), "mem_get_info(device 0): free_bytes and total_bytes are NULL"));
  CHECK(fragless_mem_get_info(0, &free_b, nullptr) == -1 && has(last_error(), "total_bytes is NULL"));
  CHECK(fragless_mem_get_info(0, nullptr, &total_b) == -1 && has(last_error(), "free_bytes is NULL"));
  CHECK(fragless_mem_get_info(0, &free_b, &total_b) == 0 && last_error().empty() && total_b > 0);
  CHECK(fragless_mem_get_info(7, &free_b, &total_b) == -1 && has(last_error(), "invalid device 7"));
  return process_checks::failures ? 1 : 0;
}

// ---- last_error ----

int last_error_scenario() {
  // A free of device 0's block that names device 1, which this process never used (fragless manages 1 device
  // here): freed by its owner, with no error.
  void* p = fragless_pool_malloc(1000, 0, nullptr);
  REQUIRE(p != nullptr);
  CHECK(fragless_pool_malloc(kHuge, 0, nullptr) == nullptr && has(last_error(), kOom));
  fragless_free(p, 1000, 1, nullptr);
  CHECK(last_error().empty());
  const auto again = stderr_of([&] { fragless_free(p, 1000, 0, nullptr); });  // it was freed: a double free now
  CHECK(again.size() == 1 && has(last_error(), "did not allocate"));
  // After a failed call, each call that succeeds leaves no error.
  void* q = fragless_pool_malloc(1000, 0, nullptr);
  size_t free_b = 0, total_b = 0, base_size = 0;
  char buf[64];
  const std::vector<std::pair<const char*, std::function<void()>>> good = {
      {"fragless_malloc", [&] { fragless_free(fragless_malloc(100, 0, nullptr), 0, 0, nullptr); }},
      {"fragless_pool_malloc of 0 bytes", [] { fragless_pool_malloc(0, 0, nullptr); }},
      {"fragless_free", [] { fragless_free(fragless_pool_malloc(100, 0, nullptr), 0, 0, nullptr); }},
      {"fragless_free(NULL)", [] { fragless_free(nullptr, 0, 0, nullptr); }},
      {"fragless_init", [] { fragless_init(1); }},
      {"fragless_empty_cache", [] { fragless_empty_cache(); }},
      {"fragless_set_memory_fraction", [] { fragless_set_memory_fraction(1.0, 0); }},
      {"fragless_get_memory_fraction", [] { fragless_get_memory_fraction(0); }},
      {"fragless_get_base_allocation", [&] { fragless_get_base_allocation(q, &base_size); }},
      {"fragless_record_stream", [&] { fragless_record_stream(q, stream(0x20)); }},
      {"fragless_begin_allocate_to_pool", [] { fragless_begin_allocate_to_pool(0, {8, 8}, {}); }},
      {"fragless_end_allocate_to_pool", [] { fragless_end_allocate_to_pool(0, {8, 8}); }},
      {"fragless_release_pool", [] { fragless_release_pool(0, {8, 8}); }},
      {"fragless_begin_allocate_stream_to_pool", [] { fragless_begin_allocate_stream_to_pool(0, stream(0x30), {9, 9}); }},
      {"fragless_end_allocate_stream_to_pool", [] { fragless_end_allocate_stream_to_pool(0, stream(0x30)); }},
      {"fragless_memory_stats", [&] { fragless_memory_stats(0, buf, sizeof buf); }},
      {"fragless_reset_peak_stats", [] { fragless_reset_peak_stats(0); }},
      {"fragless_reset_accumulated_stats", [] { fragless_reset_accumulated_stats(0); }},
      {"fragless_mem_get_info", [&] { fragless_mem_get_info(0, &free_b, &total_b); }},
      {"fragless_snapshot", [] { fragless_snapshot(nullptr, 0); }},
      {"fragless_snapshot_segments", [] { fragless_snapshot_segments(nullptr, 0); }},
      {"fragless_record_history", [] { fragless_record_history(10); }},
      {"fragless_record_history_ex", [] { fragless_record_history_ex(10, 1, 1); }},
      {"fragless_record_history_v2", [] { fragless_record_history_v2(0, 0, 0, 1); }},
      {"fragless_trace_flush", [] { fragless_trace_flush(); }},
      {"fragless_device_count", [] { fragless_device_count(); }},
      {"fragless_settings", [&] { fragless_settings(buf, sizeof buf); }},
      {"fragless_check_config", [&] { fragless_check_config("policy:fragless", buf, sizeof buf); }},
      {"fragless_check_driver", [&] { fragless_check_driver("driver:host", buf, sizeof buf); }},
      {"fragless_same_config", [] { fragless_same_config("policy:fragless", ""); }},
      {"fragless_reap_shared", [] { fragless_reap_shared(); }},
  };
  for (const auto& [name, call] : good) {
    int local = 0;
    fragless_free(&local, 4, 0, nullptr);  // an error first (one stderr line each)
    REQUIRE(!last_error().empty());
    call();
    if (!CHECK(last_error().empty())) std::fprintf(stderr, "  after %s: '%s'\n", name, last_error().c_str());
  }
  fragless_free(q, 1000, 0, nullptr);
  CHECK(fragless_same_config("policy:fragles", "") == -1 && has(last_error(), "same_config: the first configuration"));
  return process_checks::failures ? 1 : 0;
}

// ---- no_allocator: FRAGLESS_CONF names a policy that does not exist ----

int no_allocator_scenario() {
  CHECK(fragless_pool_malloc(1000, 0, nullptr) == nullptr);
  const std::string why = last_error();
  CHECK(has(why, "policy") && has(why, "fragles"));
  int local = 0;
  fragless_free(&local, 4, 0, nullptr);
  if (!CHECK(last_error() == why)) std::fprintf(stderr, "  the free's error: '%s'\n", last_error().c_str());
  fragless_record_stream(&local, stream(0x20));
  CHECK(last_error() == why);
  CHECK(fragless_share_export(&local) == nullptr && last_error() == why);
  CHECK(fragless_device_count() == -1 && last_error() == why);
  return process_checks::failures ? 1 : 0;
}

// ---- init_count ----

int init_count_scenario() {
  for (int n : {100000, 50000000, 2147483647, 129}) {
    const auto start = std::chrono::steady_clock::now();
    const auto lines = stderr_of([n] { fragless_init(n); });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string want = "fragless_init(" + std::to_string(n) + "): " + std::to_string(n) + " devices, more than the 128";
    if (!CHECK(lines.size() == 1 && has(lines[0], want.c_str()) && has(last_error(), want.c_str()) && s < 1.0))
      std::fprintf(stderr, "  init(%d): %zu stderr lines, %.2f s, last error '%s'\n", n, lines.size(), s,
                   last_error().c_str());
  }
  // Nothing was made: the allocator is made later for the driver's count (the host driver: 1), and works.
  CHECK(fragless_device_count() == 1 && last_error().empty());
  fragless_init(128);  // within the limit, after the allocator was made: changes nothing, and says so
  CHECK(has(last_error(), "fragless_init(128) after an earlier fragless call made the allocator for 1 device(s): the "
                          "count stays 1") && fragless_device_count() == 1);
  fragless_init(1);  // the count it has: nothing to say
  CHECK(last_error().empty());
  // A pointer that is no live allocation's own: itself back, size 0, and the last error (PyTorch's allocator
  // refuses it as an invalid device pointer).
  char* q = static_cast<char*>(fragless_pool_malloc(4096, 0, nullptr));
  REQUIRE(q != nullptr);
  std::size_t size = 12345;
  CHECK(fragless_get_base_allocation(q + 100, &size) == q + 100 && size == 0 &&
        has(last_error(), "which is not an allocation fragless made and has not freed"));
  size = 0;
  CHECK(fragless_get_base_allocation(q, &size) != nullptr && size >= 4096 && last_error().empty());
  fragless_free(q, 4096, 0, nullptr);
  size = 12345;
  CHECK(fragless_get_base_allocation(q, &size) == q && size == 0 && has(last_error(), "not an allocation"));
  void* p = fragless_pool_malloc(1000, 0, nullptr);
  CHECK(p != nullptr);
  fragless_free(p, 1000, 0, nullptr);
  return process_checks::failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc == 2 ? argv[1] : "";
  if (scenario == "--help" || scenario == "-h") {
    std::printf("usage: fragless-capi-bad-input SCENARIO\n"
                "  drives libfragless.so's C ABI with bad input, and from a thread's and the process's exit, on the\n"
                "  host driver (FRAGLESS_CONF); SCENARIO is exit, filters, record_stream, history_ex, pools,\n"
                "  mem_get_info, last_error, no_allocator or init_count; exit 0 when every check held\n");
    return 0;
  }
  process_checks::role = "capi";
  process_checks::detail = fragless_last_error;
  if (scenario == "no_allocator") setenv("FRAGLESS_CONF", "driver:host,policy:fragles", 1);  // before the first call
  if (scenario == "exit") return exit_scenario();
  if (scenario == "filters") return filters_scenario();
  if (scenario == "record_stream") return record_stream_scenario();
  if (scenario == "history_ex") return history_ex_scenario();
  if (scenario == "pools") return pools_scenario();
  if (scenario == "mem_get_info") return mem_get_info_scenario();
  if (scenario == "last_error") return last_error_scenario();
  if (scenario == "no_allocator") return no_allocator_scenario();
  if (scenario == "init_count") return init_count_scenario();
  std::fprintf(stderr, "usage: fragless-capi-bad-input exit|filters|record_stream|history_ex|pools|mem_get_info|"
                       "last_error|no_allocator|init_count\n");
  return 2;
}
