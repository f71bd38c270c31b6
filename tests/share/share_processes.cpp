// Two real processes share fragless memory through libfragless.so's C ABI on the host driver (memfd-backed
// handles passed as file descriptors over a Unix socket, SCM_RIGHTS). The program runs itself as the second
// process (fork and exec: nothing is inherited but the socket), so what the other side sees came through
// the share alone. FRAGLESS_CONF must ask for driver:host and shareable_handles:True, or for the cuda driver
// on the libcuda double with shareable_handles:fabric (FAKECUDA_FABRIC=1: fabric handles, the lease alone
// travelling as a descriptor).
//
//   share_processes SCENARIO          bytes | free_while_held | killed | cycles | stale
// Exit 0 when every check held; 1 with the failed check on stderr.
#include <dirent.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fd_message.h"
#include "fragless/fragless.h"
#include "process_checks.h"

namespace {

constexpr std::size_t MiB = 1 << 20;
// ---- messages: a payload and descriptors (SCM_RIGHTS) ----

void send_msg(int sock, const std::string& payload, const int* fds = nullptr, std::size_t nfds = 0) {
  REQUIRE(fragless_fd::send_message(sock, payload.data(), payload.size(), fds, nfds) == static_cast<ssize_t>(payload.size()));
}

std::string recv_msg(int sock, std::vector<int>* fds = nullptr) {
  std::string buf(1 << 16, '\0');
  std::vector<int> got;
  const ssize_t n = fragless_fd::recv_message(sock, buf.data(), buf.size(), &got, 4096);
  if (!fds) for (int fd : got) close(fd);
  else fds->insert(fds->end(), got.begin(), got.end());
  REQUIRE(n >= 0);
  buf.resize(static_cast<std::size_t>(n));
  return buf;
}

// Shares ptr and sends it: the description and the descriptors; this process's copies are closed after.
void send_share(int sock, void* ptr) {
  fragless_share* s = fragless_share_export(ptr);
  REQUIRE(s != nullptr);
  const char* bytes = nullptr;
  const std::size_t len = fragless_share_description(s, &bytes);
  const int* fds = nullptr;
  const std::size_t n = fragless_share_fds(s, &fds);
  send_msg(sock, std::string(bytes, len), fds, n);
  fragless_share_free(s);
}

// Receives a share and opens it: the pointer (*size set); the received descriptors are closed after.
void* open_share(int sock, std::size_t* size, std::string* desc_out = nullptr, std::vector<int>* fds_out = nullptr) {
  std::vector<int> fds;
  const std::string desc = recv_msg(sock, &fds);
  void* p = fragless_open_shared(0, desc.data(), desc.size(), fds.data(), fds.size(), size);
  if (desc_out) *desc_out = desc;
  if (fds_out) *fds_out = fds;
  else for (int fd : fds) close(fd);
  return p;
}

long long stat_of(const char* key) {
  std::string buf(1 << 16, '\0');
  const long n = fragless_memory_stats(0, buf.data(), buf.size());
  REQUIRE(n > 0);
  const std::string k = std::string("\"") + key + "\":";
  const auto at = buf.find(k);
  REQUIRE(at != std::string::npos);
  return std::strtoll(buf.c_str() + at + k.size(), nullptr, 10);
}

std::size_t count_entries(const char* dir) {
  std::size_t n = 0;
  if (DIR* d = opendir(dir)) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

std::size_t count_lines(const char* path) {
  std::size_t n = 0;
  if (FILE* f = std::fopen(path, "r")) {
    for (int c; (c = std::fgetc(f)) != EOF;) n += c == '\n';
    std::fclose(f);
  }
  return n;
}

// The mappings a leak would leave: every line of /proc/self/maps, except under AddressSanitizer, whose own
// allocator maps and protects memory as it goes (the count moves with no leak); there, the lines of the host
// driver's memory (its memfds are named fragless-host-...), which every imported handle's mapping is.
std::size_t count_mappings() {
#if defined(__SANITIZE_ADDRESS__)
  std::size_t n = 0;
  if (FILE* f = std::fopen("/proc/self/maps", "r")) {
    char line[4096];
    while (std::fgets(line, sizeof line, f))
      if (std::strstr(line, "fragless-host")) ++n;
    std::fclose(f);
  }
  return n;
#else
  return count_lines("/proc/self/maps");
#endif
}

bool all(const void* p, std::size_t n, unsigned char v) {
  const auto* c = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (c[i] != v) return false;
  return true;
}

// Frees what the other process released, waiting up to 10 s for its close to be seen.
bool reaped() {
  for (int i = 0; i < 10000; ++i) {
    if (fragless_reap_shared() > 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

pid_t spawn(const char* self, const char* scenario, int* sock) {
  int sv[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int fd = dup(sv[1]);  // without close-on-exec
    execl(self, self, scenario, "child", std::to_string(fd).c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(sv[1]);
  *sock = sv[0];
  return pid;
}

int wait_child(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// ---- scenarios: each has an exporter (the first process) and a child ----

void bytes_exporter(int sock) {
  const std::size_t n = 3 * MiB + 4096;
  auto* p = static_cast<unsigned char*>(fragless_malloc(n, 0, nullptr));
  std::memset(p, 0x5A, n);
  send_share(sock, p);
  REQUIRE(recv_msg(sock) == "written");
  CHECK(all(p + n / 2, n - n / 2, 0xC3));  // the other process's bytes, here
  CHECK(stat_of("exported_bytes.all.current") >= static_cast<long long>(n));
  CHECK(stat_of("exported_bytes.large_pool.current") == stat_of("exported_bytes.all.current"));
  CHECK(stat_of("exported_bytes.small_pool.current") == 0);
  send_msg(sock, "close");
  REQUIRE(recv_msg(sock) == "closed");
  CHECK(fragless_register_range(p + 4096, MiB) == 0);  // NCCL's registration holds it too
  CHECK(fragless_register_range(p, 64 * MiB) == -1);
  CHECK(std::strstr(fragless_last_error(), "not inside one live fragless allocation") != nullptr);
  fragless_free(p, n, 0, nullptr);
  CHECK(fragless_reap_shared() == 0);
  CHECK(stat_of("allocated_bytes.all.current") > 0);
  CHECK(fragless_deregister_range(p + 4096) == 0);
  CHECK(stat_of("exported_bytes.all.current") == 0);
  CHECK(stat_of("exported_bytes.all.peak") >= static_cast<long long>(n));
  CHECK(stat_of("allocated_bytes.all.current") == 0);
}

void bytes_child(int sock) {
  std::size_t size = 0;
  auto* q = static_cast<unsigned char*>(open_share(sock, &size));
  REQUIRE(q != nullptr);
  const std::size_t n = 3 * MiB + 4096;
  CHECK(size >= n);
  CHECK(all(q, n, 0x5A));
  std::memset(q + n / 2, 0xC3, n - n / 2);
  CHECK(stat_of("imported_bytes.all.current") >= static_cast<long long>(n));
  CHECK(stat_of("imported_bytes.large_pool.current") == stat_of("imported_bytes.all.current"));
  CHECK(stat_of("reserved_bytes.all.current") == 0);
  send_msg(sock, "written");
  REQUIRE(recv_msg(sock) == "close");
  CHECK(fragless_close_shared(q) == 0);
  CHECK(stat_of("imported_bytes.all.current") == 0);
  send_msg(sock, "closed");
}

void free_while_held_exporter(int sock) {
  const std::size_t n = 8 * MiB;
  auto* p = static_cast<unsigned char*>(fragless_malloc(n, 0, nullptr));
  std::memset(p, 0x11, n);
  send_share(sock, p);
  REQUIRE(recv_msg(sock) == "opened");
  fragless_free(p, n, 0, nullptr);
  CHECK(stat_of("allocated_bytes.all.current") == static_cast<long long>(n));  // held for the other process
  std::vector<void*> others;
  for (int i = 0; i < 12; ++i) {
    void* o = fragless_pool_malloc(4 * MiB, 0, nullptr);  // NULL when the device is full
    if (!o) break;
    std::memset(o, 0xEE, 4 * MiB);
    others.push_back(o);
  }
  CHECK(others.size() == 6);  // capacity 32 MiB: 8 held, 24 for the rest
  fragless_empty_cache();
  send_msg(sock, "check");
  REQUIRE(recv_msg(sock) == "intact");
  REQUIRE(recv_msg(sock) == "closed");
  CHECK(reaped());
  CHECK(stat_of("allocated_bytes.all.current") == static_cast<long long>(others.size() * 4 * MiB));
  CHECK(fragless_pool_malloc(4 * MiB, 0, nullptr) != nullptr);  // its memory serves again
}

void free_while_held_child(int sock) {
  std::size_t size = 0;
  auto* q = static_cast<unsigned char*>(open_share(sock, &size));
  REQUIRE(q != nullptr);
  send_msg(sock, "opened");
  REQUIRE(recv_msg(sock) == "check");
  CHECK(all(q, 8 * MiB, 0x11));
  send_msg(sock, "intact");
  CHECK(fragless_close_shared(q) == 0);
  send_msg(sock, "closed");
}

void killed_exporter(int sock, pid_t child) {
  const std::size_t n = 4 * MiB;
  void* p = fragless_malloc(n, 0, nullptr);
  send_share(sock, p);
  REQUIRE(recv_msg(sock) == "opened");
  fragless_free(p, n, 0, nullptr);
  CHECK(fragless_reap_shared() == 0);  // still open over there
  kill(child, SIGKILL);
  CHECK(wait_child(child) == 128 + SIGKILL);
  CHECK(reaped());  // the kernel closed the dead process's lease
  CHECK(stat_of("allocated_bytes.all.current") == 0);
  CHECK(stat_of("exported_bytes.all.current") == 0);
}

void killed_child(int sock) {
  std::size_t size = 0;
  REQUIRE(open_share(sock, &size) != nullptr);
  send_msg(sock, "opened");
  pause();  // until killed
}

constexpr int kCycles = 1000;

void cycles_exporter(int sock) {
  void* warm = fragless_malloc(MiB, 0, nullptr);  // the allocator exists before the count
  fragless_free(warm, MiB, 0, nullptr);
  fragless_empty_cache();
  const std::size_t fds0 = count_entries("/proc/self/fd");
  for (int i = 0; i < kCycles; ++i) {
    const std::size_t n = (1 + i % 5) * MiB + (i % 3) * 4096;
    auto* p = static_cast<unsigned char*>(fragless_malloc(n, 0, nullptr));
    p[n - 1] = static_cast<unsigned char>(i);
    send_share(sock, p);
    if (i % 2) fragless_free(p, n, 0, nullptr);  // freed while the other process has it, half the time
    REQUIRE(recv_msg(sock) == "ok");
    if (i % 2 == 0) fragless_free(p, n, 0, nullptr);
    fragless_reap_shared();
  }
  reaped();
  REQUIRE(recv_msg(sock).rfind("leaks 0 0 0", 0) == 0);
  CHECK(stat_of("allocated_bytes.all.current") == 0);
  CHECK(stat_of("exported_bytes.all.current") == 0);
  fragless_empty_cache();
  CHECK(stat_of("reserved_bytes.all.current") == 0);
  CHECK(count_entries("/proc/self/fd") == fds0);
}

void cycles_child(int sock) {
  std::size_t fds0 = 0, maps0 = 0;
  for (int i = 0; i < kCycles; ++i) {
    std::size_t size = 0;
    auto* q = static_cast<unsigned char*>(open_share(sock, &size));
    REQUIRE(q != nullptr);
    const std::size_t n = (1 + i % 5) * MiB + (i % 3) * 4096;
    CHECK(q[n - 1] == static_cast<unsigned char>(i));
    CHECK(fragless_close_shared(q) == 0);
    if (i == 0) {  // counted after the first cycle: the allocator and its driver exist from then on
      fds0 = count_entries("/proc/self/fd");
      maps0 = count_mappings();
    }
    send_msg(sock, "ok");
  }
  const long long fd_leak = static_cast<long long>(count_entries("/proc/self/fd")) - static_cast<long long>(fds0);
  const long long map_leak = static_cast<long long>(count_mappings()) - static_cast<long long>(maps0);
  const long long imported = stat_of("imported_bytes.all.current");
  CHECK(fd_leak == 0);
  CHECK(map_leak == 0);
  CHECK(imported == 0);
  send_msg(sock, "leaks " + std::to_string(fd_leak) + " " + std::to_string(map_leak) + " " + std::to_string(imported));
}

// Roles turned round: the child exports and exits; what it sent is stale by then.
void stale_first(int sock, pid_t child) {
  std::vector<int> fds;
  const std::string desc = recv_msg(sock, &fds);
  std::string tampered = desc;
  tampered[tampered.size() - 1] ^= 0x01;
  std::size_t size = 0;
  CHECK(fragless_open_shared(0, tampered.data(), tampered.size(), fds.data(), fds.size(), &size) == nullptr);
  CHECK(std::strstr(fragless_last_error(), "forged") != nullptr);
  send_msg(sock, "exit");
  CHECK(wait_child(child) == 0);
  CHECK(fragless_open_shared(0, desc.data(), desc.size(), fds.data(), fds.size(), &size) == nullptr);
  CHECK(std::strstr(fragless_last_error(), "stale") != nullptr);
  CHECK(std::strstr(fragless_last_error(), "nothing was mapped") != nullptr);
  CHECK(stat_of("imported_bytes.all.current") == 0);
  for (int fd : fds) close(fd);
}

void stale_child(int sock) {
  void* p = fragless_malloc(2 * MiB, 0, nullptr);
  send_share(sock, p);
  REQUIRE(recv_msg(sock) == "exit");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help") {
    std::fprintf(argc < 2 ? stderr : stdout,
                 "usage: %s bytes|free_while_held|killed|cycles|stale\n"
                 "Two processes share fragless memory through libfragless.so (FRAGLESS_CONF with driver:host and\n"
                 "shareable_handles:True); exit 0 when every check held in both.\n",
                 argv[0]);
    return argc < 2 ? 2 : 0;
  }
  const std::string scenario = argv[1];
  process_checks::detail = fragless_last_error;
  if (argc == 4 && std::string(argv[2]) == "child") {
    process_checks::role = "child";
    const int sock = std::atoi(argv[3]);
    if (scenario == "bytes") bytes_child(sock);
    else if (scenario == "free_while_held") free_while_held_child(sock);
    else if (scenario == "killed") killed_child(sock);
    else if (scenario == "cycles") cycles_child(sock);
    else if (scenario == "stale") stale_child(sock);
    return process_checks::failures ? 1 : 0;
  }
  int sock = -1;
  const pid_t child = spawn("/proc/self/exe", scenario.c_str(), &sock);
  if (scenario == "bytes") bytes_exporter(sock);
  else if (scenario == "free_while_held") free_while_held_exporter(sock);
  else if (scenario == "killed") killed_exporter(sock, child);
  else if (scenario == "cycles") cycles_exporter(sock);
  else if (scenario == "stale") stale_first(sock, child);
  else {
    std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    return 2;
  }
  if (scenario != "killed" && scenario != "stale") CHECK(wait_child(child) == 0);
  if (!process_checks::failures) std::printf("%s: every check held in both processes\n", scenario.c_str());
  return process_checks::failures ? 1 : 0;
}
