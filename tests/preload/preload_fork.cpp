// Under LD_PRELOAD=libfragless_preload.so on the libcuda double: fork() while another thread's first cudaMalloc
// is making the interposer's allocator (cuInit held until the child has ended). The fork does not wait for it,
// and the child makes its own at its first call (Note [Making the allocator once]); before 2026-12-04 that
// child waited for ever. Usage: FRAGLESS_LIBCUDA=LIBFAKECUDA LD_PRELOAD=LIBFRAGLESS_PRELOAD fragless-preload-fork
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

extern "C" {
typedef int cudaError_t;
cudaError_t cudaMalloc(void**, size_t);
cudaError_t cudaFree(void*);
}

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf("usage: FRAGLESS_LIBCUDA=LIBFAKECUDA LD_PRELOAD=LIBFRAGLESS_PRELOAD fragless-preload-fork\n"
                "  forks while another thread's first cudaMalloc makes the interposer's allocator; exits 0 when\n"
                "  the child allocates and frees on its own\n");
    return 0;
  }
  if (!dlsym(RTLD_DEFAULT, "fragless_preload_counters"))
    return std::fprintf(stderr, "FAIL: the interposer is not loaded (is LD_PRELOAD right?)\n"), 1;
  const char* fake_path = std::getenv("FRAGLESS_LIBCUDA");
  void* fake = fake_path ? dlopen(fake_path, RTLD_NOW | RTLD_LOCAL) : nullptr;
  auto set_delay = fake ? reinterpret_cast<void (*)(const char*, unsigned)>(dlsym(fake, "fakecuda_set_delay")) : nullptr;
  auto calls = fake ? reinterpret_cast<unsigned long (*)(const char*)>(dlsym(fake, "fakecuda_calls")) : nullptr;
  if (!set_delay || !calls) return std::fprintf(stderr, "FAIL: FRAGLESS_LIBCUDA is not the libcuda double\n"), 1;
  int limit_s = 20;
  if (const char* env = std::getenv("FRAGLESS_WATCHDOG_S")) limit_s = std::max(limit_s, std::atoi(env));

  set_delay("cuInit", 600000000);  // held until the child has ended
  std::atomic<bool> made{false};
  void* first = nullptr;
  cudaError_t first_rc = -1;
  std::thread maker([&] {
    first_rc = cudaMalloc(&first, 1 << 20);
    made = true;
  });
  for (int i = 0; i < 10000 && calls("cuInit:started") == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (calls("cuInit:started") == 0) {
    set_delay("cuInit", 0);
    maker.join();
    return std::fprintf(stderr, "FAIL: the first cudaMalloc never reached cuInit\n"), 1;
  }
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(static_cast<unsigned>(limit_s));
    set_delay("cuInit", 0);
    void* p = nullptr;
    if (cudaMalloc(&p, 3 << 20) != 0 || !p) _exit(10);
    std::memset(p, 0x5a, 3 << 20);
    if (cudaFree(p) != 0) _exit(11);
    if (!dlsym(RTLD_DEFAULT, "fragless_preload_counters")) _exit(12);
    _exit(0);
  }
  const bool fork_waited = made;
  int failures = 0;
  if (pid < 0) {
    set_delay("cuInit", 0);
    maker.join();
    return std::fprintf(stderr, "FAIL: fork\n"), 1;
  }
  if (fork_waited) ++failures, std::fprintf(stderr, "FAIL: the fork waited for the allocator to be made\n");
  int status = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(limit_s + 5);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > give_up) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  set_delay("cuInit", 0);  // the parent's making goes on
  maker.join();
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    ++failures;
    if (WIFSIGNALED(status))
      std::fprintf(stderr, "FAIL: the child was killed by signal %d (%s)\n", WTERMSIG(status),
                   WTERMSIG(status) == SIGALRM ? "its alarm: it waited for ever" : "hung or crashed");
    else
      std::fprintf(stderr, "FAIL: the child exited %d (10, 11: cudaMalloc, cudaFree)\n", WEXITSTATUS(status));
  }
  if (first_rc != 0 || !first) ++failures, std::fprintf(stderr, "FAIL: the parent's first cudaMalloc (%d)\n", first_rc);
  else if (cudaFree(first) != 0) ++failures, std::fprintf(stderr, "FAIL: the parent's cudaFree\n");
  std::printf("%s\n", failures ? "FAILED" : "ok: a child forked while another thread made the allocator made its own");
  return failures ? 1 : 0;
}
