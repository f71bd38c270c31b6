// A watchdog for tests that could deadlock: if the guarded scope does not finish in time, print every
// thread's stack (gdb, when installed) and abort, so a hang becomes a failing test with evidence instead
// of a CI job that times out silently. FRAGLESS_WATCHDOG_S overrides the limit (sanitizer builds are slower).
// wait_for_child does the same for a forked child: one that has not ended in time is killed, and the test fails.
#pragma once
#include <catch2/catch.hpp>
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace fragless::test {

// Every thread's stack of process `pid` on stderr, through gdb when installed; false when none was printed.
inline bool print_gdb_stacks(pid_t pid) {
  const std::string cmd = "command -v gdb >/dev/null && timeout -k 5 60 gdb -p " + std::to_string(pid) +
                          " -batch -ex 'thread apply all bt' 1>&2 2>/dev/null";
  return std::system(cmd.c_str()) == 0;
}

class Watchdog {
 public:
  Watchdog(const char* what, int seconds) : what_(what) {
    if (const char* env = std::getenv("FRAGLESS_WATCHDOG_S")) seconds = std::atoi(env);
    thread_ = std::thread([this, seconds] {
      std::unique_lock lk(mu_);
      if (cv_.wait_for(lk, std::chrono::seconds(seconds), [this] { return done_; })) return;
      std::fprintf(stderr, "WATCHDOG: '%s' did not finish in %d s: probable deadlock; thread stacks follow\n", what_,
                   seconds);
      if (!print_gdb_stacks(::getpid())) std::fprintf(stderr, "WATCHDOG: (gdb not available for stacks)\n");
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

// A forked child's own alarm: later than the parent's limit, so that a parent waiting for a hung child sees
// the hang first and can print the child's stacks (print_tree_stacks) before it ends it; the alarm only ends
// a child whose parent is gone.
inline unsigned child_alarm_s() { return static_cast<unsigned>(child_watchdog_s() + 60); }

// `root` and every process below it, parents before children (from /proc/<pid>/stat's parent field).
inline std::vector<pid_t> process_tree(pid_t root) {
  std::vector<std::pair<pid_t, pid_t>> all;  // pid, parent
  if (DIR* d = opendir("/proc")) {
    while (const dirent* e = readdir(d)) {
      const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
      if (pid <= 0) continue;
      std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
      std::string line;
      if (!std::getline(f, line)) continue;
      const auto close_paren = line.rfind(')');  // the name may hold spaces and parentheses
      if (close_paren == std::string::npos) continue;
      char state = 0;
      int parent = 0;
      if (std::sscanf(line.c_str() + close_paren + 1, " %c %d", &state, &parent) == 2) all.emplace_back(pid, parent);
    }
    closedir(d);
  }
  std::vector<pid_t> tree{root};
  for (std::size_t i = 0; i < tree.size(); ++i)
    for (const auto& [pid, parent] : all)
      if (parent == tree[i]) tree.push_back(pid);
  return tree;
}

// What each process of `root`'s tree is doing, on stderr: its state, the system call it waits in, its kernel
// stack where this process may read it, and every thread's stack through gdb when gdb is installed. For a
// hung forked child, before it is killed: without this a hang seen once (a loaded machine, a sanitizer) leaves
// nothing to read.
inline void print_tree_stacks(pid_t root) {
  for (const pid_t pid : process_tree(root)) {
    const std::string dir = "/proc/" + std::to_string(pid);
    std::fprintf(stderr, "STACKS: process %d\n", static_cast<int>(pid));
    for (const char* file : {"stat", "wchan", "syscall", "stack"}) {
      std::ifstream f(dir + "/" + file);
      std::stringstream text;
      text << f.rdbuf();
      std::fprintf(stderr, "STACKS: %d %s: %s\n", static_cast<int>(pid), file,
                   f ? text.str().c_str() : "(not readable)");
    }
    if (!print_gdb_stacks(pid)) std::fprintf(stderr, "STACKS: (no gdb stacks for %d)\n", static_cast<int>(pid));
  }
}

// Kills `root` and every process below it (children first found, so none is missed by being reparented).
inline void kill_tree(pid_t root) {
  const std::vector<pid_t> tree = process_tree(root);
  for (auto it = tree.rbegin(); it != tree.rend(); ++it) kill(*it, SIGKILL);
}

// A forked child found hung after `waited_s`: says so, prints its tree's stacks, kills the tree and reaps the
// child; its wait status.
inline int end_hung_child(pid_t pid, const std::string& what, int waited_s) {
  std::fprintf(stderr, "WATCHDOG: %s is still running after %d s: its stacks follow\n", what.c_str(), waited_s);
  print_tree_stacks(pid);
  kill_tree(pid);
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

// The forked child's wait status; a child that has not ended after `limit_s` is killed, and the test fails
// saying `what` hung.
inline int wait_for_child(pid_t pid, const std::string& what, int limit_s = child_watchdog_s()) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(limit_s);
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    REQUIRE(r >= 0);
    if (r == pid) return status;
    if (std::chrono::steady_clock::now() > give_up) {
      end_hung_child(pid, what, limit_s);
      FAIL(what << ": the child has not ended after " << limit_s << " s (stacks on stderr)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace fragless::test
