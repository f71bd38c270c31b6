// A watchdog for tests that could deadlock: if the guarded scope does not finish in time, print every
// thread's stack (gdb, when installed) and abort, so a hang becomes a failing test with evidence instead
// of a CI job that times out silently. FRAGLESS_WATCHDOG_S overrides the limit (sanitizer builds are slower).
#pragma once
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
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

}  // namespace fragless::test
