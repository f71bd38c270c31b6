// A watchdog for tests that could deadlock: if the guarded scope does not finish in time, print every
// thread's stack (gdb, when installed) and abort, so a hang becomes a failing test with evidence instead
// of a CI job that times out silently. FRAGLESS_WATCHDOG_S overrides the limit (sanitizer builds are slower).
// wait_for_child does the same for a forked child: one that has not ended in time is killed, and the test fails.
#pragma once
#include <catch2/catch.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

namespace fragless::test {

class Watchdog {
 public:
  Watchdog(const char* what, int seconds) : what_(what) {
    if (const char* env = std::getenv("FRAGLESS_WATCHDOG_S")) seconds = std::atoi(env);
    thread_ = std::thread([this, seconds] {
      std::unique_lock lk(mu_);
      if (cv_.wait_for(lk, std::chrono::seconds(seconds), [this] { return done_; })) return;
      std::fprintf(stderr, "WATCHDOG: '%s' did not finish in %d s: probable deadlock; thread stacks follow\n", what_,
                   seconds);
      const std::string cmd = "command -v gdb >/dev/null && gdb -p " + std::to_string(::getpid()) +
                              " -batch -ex 'thread apply all bt' 2>/dev/null 1>&2";
      if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "WATCHDOG: (gdb not available for stacks)\n");
      std::abort();
    });
  }
  ~Watchdog() {
    {
      std::lock_guard lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  const char* what_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// How a child ended, from its wait status, in words.
inline std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// A forked child's time: 20 s, or FRAGLESS_WATCHDOG_S when larger.
inline int child_watchdog_s() {
  int limit_s = 20;
  if (const char* env = std::getenv("FRAGLESS_WATCHDOG_S")) limit_s = std::max(limit_s, std::atoi(env));
  return limit_s;
}

// The forked child's wait status; a child that has not ended after child_watchdog_s() is killed, and the
// test fails saying `what` hung.
inline int wait_for_child(pid_t pid, const std::string& what) {
  const int limit_s = child_watchdog_s();
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(limit_s);
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    REQUIRE(r >= 0);
    if (r == pid) return status;
    if (std::chrono::steady_clock::now() > give_up) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      FAIL(what << ": the child has not ended after " << limit_s << " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace fragless::test
