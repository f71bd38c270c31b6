// The trace path (tracer.h): its grammar, and what a path must be to take a trace (Note [Opening a trace
// file], tracer.cpp), for Tracing::open and for the checks made before any allocation (fragless_check_driver).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "fragless/tracer.h"

namespace fragless {

int rank_from_environment() {
  const char* r = std::getenv("RANK");
  if (!r || !*r) return kRankUnset;
  if (*r < '0' || *r > '9') return kRankInvalid;  // no sign, no space: what a launcher writes
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(r, &end, 10);
  return (*end || errno || v > kMaxRank) ? kRankInvalid : static_cast<int>(v);
}

std::string expand_trace_path(std::string_view pattern, int device, int pid, int rank, std::string* error) {
  std::string out;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%') {
      out.push_back(pattern[i]);
      continue;
    }
    const char c = i + 1 < pattern.size() ? pattern[++i] : '\0';
    switch (c) {
      case 'p': out += std::to_string(pid); break;
      case 'd': out += std::to_string(device); break;
      case 'r':
        if (rank == kRankInvalid) {  // two processes would share the file rank 0 stood for
          if (error) {
            const char* r = std::getenv("RANK");
            *error = "fragless: the trace path '" + std::string(pattern) + "' has %r, but RANK='" + (r ? r : "") +
                     "' in the environment is not a rank (a whole number from 0 to " + std::to_string(kMaxRank) + ")";
          }
          return {};
        }
        out += std::to_string(rank < 0 ? 0 : rank);
        break;
      case '%': out.push_back('%'); break;
      default:
        if (error)
          *error = "FRAGLESS_CONF: bad value '" + std::string(pattern) +
                   "' for key 'trace': '%' must be followed by p (pid), d (device), r (rank) or %";
        return {};
    }
  }
  if (out.empty() && error) *error = "FRAGLESS_CONF: the 'trace' path is empty";
  return out;
}

// A regular file, or the null device (to measure the tracer's cost). Another character device is refused: a
// terminal would take binary records, and one whose writes fail (/dev/full) would fail the trace's header, so
// the allocator itself, after the checks had passed.
bool trace_target_kind_ok(const std::string& path, std::string* error) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return true;
  struct stat null {};
  if (S_ISCHR(st.st_mode) && ::stat("/dev/null", &null) == 0 && S_ISCHR(null.st_mode) && st.st_rdev == null.st_rdev)
    return true;
  if (error)
    *error = "fragless: the trace path '" + path + "' is " +
             (S_ISFIFO(st.st_mode)  ? "a FIFO"
              : S_ISDIR(st.st_mode) ? "a directory"
              : S_ISCHR(st.st_mode) ? "a character device other than /dev/null"
                                    : "not a regular file") +
             " (a trace is written to a regular file, or to /dev/null)";
  return false;
}

namespace {

// trace_path_usable for one expanded path.
bool trace_file_usable(const std::string& path, std::string* error) {
  if (!trace_target_kind_ok(path, error)) return false;
  struct stat st {};
  int e = 0;
  if (::stat(path.c_str(), &st) == 0) {
    if (::access(path.c_str(), W_OK) == 0) return true;
    e = errno;
  } else {
    const auto slash = path.find_last_of('/');
    const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
    if (::stat(folder.c_str(), &st) != 0) e = errno;
    else if (!S_ISDIR(st.st_mode)) e = ENOTDIR;
    else if (::access(folder.c_str(), W_OK | X_OK) != 0) e = errno;
    else {
      // A name the file system cannot hold fails only when the file is made (ENAMETOOLONG): asked here too.
      const std::string name = path.substr(slash == std::string::npos ? 0 : slash + 1);
      const long name_max = ::pathconf(folder.c_str(), _PC_NAME_MAX);
      const bool long_name = name_max > 0 && name.size() > static_cast<std::size_t>(name_max);
      if (long_name || path.size() >= PATH_MAX) {
        if (error)
          *error = "fragless: cannot open trace file '" + path + "': " + std::strerror(ENAMETOOLONG) +
                   (long_name ? " (a name of " + std::to_string(name.size()) + " bytes; its folder takes " +
                                    std::to_string(name_max) + ")"
                              : " (a path of " + std::to_string(path.size()) + " bytes; at most " +
                                    std::to_string(PATH_MAX - 1) + ")");
        return false;
      }
      return true;
    }
    if (error)
      *error = "fragless: cannot open trace file '" + path + "': its folder '" + folder + "': " + std::strerror(e);
    return false;
  }
  if (error) *error = "fragless: cannot open trace file '" + path + "': " + std::strerror(e);
  return false;
}

}  // namespace

bool trace_path_usable(std::string_view pattern, int devices, std::string* error) {
  const int pid = static_cast<int>(::getpid()), rank = rank_from_environment();
  std::string last;
  for (int d = 0; d < std::max(devices, 1); ++d) {  // each file the pattern names (one per device with %d)
    std::string path = expand_trace_path(pattern, d, pid, rank, error);
    if (path.empty()) return false;
    if (path == last) break;  // no %d: every device shares the first file
    if (!trace_file_usable(path, error)) return false;
    last = std::move(path);
  }
  return true;
}

}  // namespace fragless
