// The trace writer's periodic writes (Note [Writing a buffer being filled], tracer.cpp) against slow and busy
// files, in a program of its own: it defines write(2), which the tracer linked into it then calls, to make a
// periodic write slow at a chosen moment (as a network file system can be), and counts on nothing else
// writing through it while armed.
//   order   two devices share a file; while the writer's periodic write of device 0 is slow, device 1 fills a
//           buffer and stores more: each device's records must stay in their order in the file (device 1's
//           newer records were written before its older buffer's rest)
//   nolock  a file system without flock (ENOLCK, as some NFS and Lustre mounts give): the file is traced,
//           unlocked, where it was taken for one another process writes and left untraced
//   quiet   a device that stores a few records while another sharing its file hands off a full buffer every
//           50 ms: the quiet one's records must reach the file within the interval (they waited for the
//           writer to have 100 ms without a full buffer, that is for ever here)
// Exits 0 when every check holds, 1 otherwise, naming what failed.
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "fragless/trace_format.h"
#include "fragless/tracer.h"

using namespace fragless;
using namespace std::chrono_literals;

namespace {

std::atomic<std::size_t> g_slow_size{0};  // a write of exactly this many bytes sleeps 300 ms, once
std::atomic<int> g_slow_state{0};         // 1 while sleeping, 2 after
std::atomic<bool> g_no_flock{false};      // flock(2) fails with ENOLCK

}  // namespace

extern "C" ssize_t write(int fd, const void* buf, size_t n) {
  std::size_t want = g_slow_size.load();
  if (want != 0 && n == want && g_slow_size.compare_exchange_strong(want, 0)) {
    g_slow_state = 1;
    std::this_thread::sleep_for(300ms);
    g_slow_state = 2;
  }
  return syscall(SYS_write, fd, buf, n);
}

extern "C" int flock(int fd, int op) {
  if (g_no_flock.load()) {
    errno = ENOLCK;
    return -1;
  }
  return static_cast<int>(syscall(SYS_flock, fd, op));
}

namespace {

int failures = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++failures;
  }
}

struct Read {
  long count[2] = {0, 0};
  long out_of_order = 0;
};
Read read_back(const std::string& path) {
  Read r;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return r;
  NativeTraceHeader h;
  if (std::fread(&h, sizeof h, 1, f) != 1) return r;
  NativeTraceRecord rec;
  long last[2] = {-1, -1};
  while (std::fread(&rec, sizeof rec, 1, f) == 1) {
    if (rec.device > 1) continue;
    if (static_cast<long>(rec.sequence) != last[rec.device] + 1) ++r.out_of_order;
    last[rec.device] = rec.sequence;
    ++r.count[rec.device];
  }
  std::fclose(f);
  return r;
}

void store(EventSink* s, int device, int n) {
  TraceEvent e{};
  e.action = TraceAction::empty_cache;
  e.device = device;
  for (int i = 0; i < n; ++i) s->on_event(e);
}

void order(const std::string& dir) {
  const std::string path = dir + "/order.fgt";
  std::string err;
  auto t = Tracing::open(path, 2, "classic", &err);
  if (!t) return check(false, "order: " + err);
  g_slow_size = 100 * sizeof(NativeTraceRecord);  // device 0's 100 records, written periodically
  store(t->sink(0), 0, 100);
  store(t->sink(1), 1, 8190);
  while (g_slow_state.load() != 1) std::this_thread::sleep_for(1ms);
  store(t->sink(1), 1, 10);  // the 2nd fills device 1's buffer (handed off), 8 more in the next
  std::this_thread::sleep_for(600ms);  // past the slow write, and a periodic write after it
  t.reset();
  const Read r = read_back(path);
  check(r.count[0] == 100 && r.count[1] == 8200, "order: every record written (" + std::to_string(r.count[0]) +
                                                     " and " + std::to_string(r.count[1]) + ")");
  check(r.out_of_order == 0, "order: " + std::to_string(r.out_of_order) + " records out of their device's order");
}

void nolock(const std::string& dir) {
  const std::string path = dir + "/nolock.fgt";
  std::string err;
  bool busy = true;
  g_no_flock = true;
  auto t = Tracing::open(path, 1, "classic", &err, &busy);
  g_no_flock = false;
  check(t != nullptr && !busy, "nolock: a file that cannot be locked was refused: " + err);
  if (!t) return;
  store(t->sink(0), 0, 10);
  t.reset();
  check(read_back(path).count[0] == 10, "nolock: the records were not written");
}

void quiet(const std::string& dir) {
  const std::string path = dir + "/quiet.fgt";
  std::string err;
  auto t = Tracing::open(path, 2, "classic", &err);
  if (!t) return check(false, "quiet: " + err);
  store(t->sink(1), 1, 100);
  for (int k = 0; k < 10; ++k) {  // a full buffer every 50 ms for half a second
    store(t->sink(0), 0, 8192);
    std::this_thread::sleep_for(50ms);
  }
  const Read r = read_back(path);  // while the process runs: what a kill would leave
  check(r.count[1] == 100, "quiet: " + std::to_string(r.count[1]) + " of the quiet device's 100 records in the file "
                               "after 0.5 s");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string arg = argc > 1 ? argv[1] : "";
  if (arg == "--help" || arg == "-h" || argc > 2 || (!arg.empty() && arg[0] == '-')) {
    std::fprintf(arg == "--help" || arg == "-h" ? stdout : stderr,
                 "usage: fragless-trace-writes [DIR]   the tracer's periodic writes against slow and busy files; its "
                 "trace files go in DIR (default /tmp)\n");
    return arg == "--help" || arg == "-h" ? 0 : 2;
  }
  const std::string dir = arg.empty() ? "/tmp" : arg;
  order(dir);
  nolock(dir);
  quiet(dir);
  std::printf("%s\n", failures ? "trace writes: FAILED" : "trace writes: every check holds");
  return failures ? 1 : 0;
}
