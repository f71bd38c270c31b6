// What a test reads back from the operating system: a file's bytes, and how many threads this process has.
// Header-only and without Catch2, for the test programs as well as the Catch2 tests.
#pragma once
#include <dirent.h>

#include <fstream>
#include <sstream>
#include <string>

namespace os_probes {

// The whole file at `path` (empty if it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The threads of this process now (/proc/self/task).
inline int thread_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

}  // namespace os_probes
