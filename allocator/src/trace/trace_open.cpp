// Opening one trace file (tracer.h's open_trace_file): the kinds of path taken, the lock that keeps two processes
// apart, what an earlier file at the path becomes, and the header.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fragless/trace_format.h"
#include "fragless/tracer.h"
#include "base/no_file_size_signal.h"

namespace fragless {

namespace {

// Note [An earlier trace at the path]
// Opening a trace file empties it. A path that already holds records is most often the last run's trace: the
// run a job scheduler restarted after a crash (under torchrun the restart keeps RANK, so %r names the same
// file), or the image before an exec() (the pid stays, so %p does too), which is the trace a user wants
// most; a file that is not a trace at all is the user's. So a regular file there that holds more than a
// trace's header (a run that made no event) is not emptied in place: it is renamed to PATH.prev (replacing an
// older .prev; where .prev is another name of the same file, PATH's name is removed instead), a new file is
// made at PATH, and one line on stderr says what was kept and where. A file whose header cannot be read (one
// its user may only write) counts as a trace, kept if it holds more than a header.
//
// Two processes given one path: each opens it, locks what it opened, and then checks that the path still
// names that file (and takes its size only then); if not, another process kept it as .prev meanwhile, and it
// opens the path again. The new file is made with O_EXCL and locked before the earlier one's descriptor is
// closed, so a process that opened the path before the rename ends up finding the new file locked, and goes
// on untraced, as for any file another process writes; no process empties a file another has written since it
// opened the path. A path that is a symbolic link is opened through the link (creating a missing target), and
// what is kept and made again is the target, resolved once the file is open and locked, never the link (nor
// /dev/stdout and the like). Messages name the path as given, and the target too where they differ.
//
// keep_earlier_trace: `fd` is open on the earlier file at `target` (PATH resolved) and holds its lock; `st` is
// that file's state under the lock. Returns the new file's descriptor, kNothingToKeep for a header alone, or
// -1 with *error (and *busy when another process made the new file first). A rename refused (a folder
// without write permission for it, a folder named PATH.prev) empties the file in place, said on stderr.
constexpr int kNothingToKeep = -2;
int keep_earlier_trace(int fd, const std::string& given, const std::string& target, const struct stat& st,
                       std::string* error, bool* busy) {
  const std::string prev = target + ".prev";
  const std::string named = given == target ? "'" + given + "'" : "'" + given + "' ('" + target + "')";
  NativeTraceHeader h{};
  bool readable = false, ours = false;
  if (const int reading = ::open(target.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK); reading >= 0) {  // fd is write-only
    readable = true;
    ours = ::pread(reading, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h) &&
           std::memcmp(h.magic, kTraceMagic, sizeof h.magic) == 0;
    ::close(reading);
  }
  if ((ours || !readable) && st.st_size <= static_cast<off_t>(sizeof h)) return kNothingToKeep;
  const std::string what = ours        ? "a trace of process " + std::to_string(h.pid)
                           : readable ? std::string("a file that is not a trace")
                                      : std::string("a file it cannot read");
  struct stat kept {};
  const bool same = ::stat(prev.c_str(), &kept) == 0 && kept.st_dev == st.st_dev && kept.st_ino == st.st_ino;
  if ((same ? ::unlink(target.c_str()) : ::rename(target.c_str(), prev.c_str())) != 0) {
    std::fprintf(stderr, "fragless: the trace file %s holds %s (%lld bytes), which could not be kept as '%s' (%s); "
                 "it is emptied\n", named.c_str(), what.c_str(), static_cast<long long>(st.st_size), prev.c_str(),
                 std::strerror(errno));
    const int again = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);  // the caller closes fd; the file stays locked through this one
    if (again < 0 && error) *error = "fragless: cannot open trace file " + named + ": " + std::strerror(errno);
    return again;
  }
  const int made = ::open(target.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NONBLOCK, 0644);
  if (made < 0) {
    const bool raced = errno == EEXIST;
    if (busy) *busy = raced;
    if (error)
      *error = raced ? "fragless: another process is writing the trace file " + named + " (it made it again after "
                           "this one kept the earlier trace as '" + prev + "')"
                     : "fragless: cannot open trace file " + named + ": " + std::strerror(errno);
    return -1;
  }
  if (::flock(made, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
    if (busy) *busy = true;
    if (error) *error = "fragless: another process is writing the trace file " + named;
    ::close(made);
    return -1;
  }
  std::fprintf(stderr, "fragless: the trace file %s held %s (%lld bytes); it is kept as '%s'\n", named.c_str(),
               what.c_str(), static_cast<long long>(st.st_size), prev.c_str());
  return made;
}

}  // namespace

int open_trace_file(const std::string& path, const NativeTraceHeader& h, std::string* error, bool* busy) {
  // Note [Opening a trace file]: a FIFO would block the open until a reader came (inside the first
  // allocation), so only a regular file or a character device (/dev/null) is taken; a regular file is locked
  // before it is emptied, so a second process given the same path (%r without RANK is rank 0) is refused
  // instead of truncating the first one's trace under it (its allocator then goes on untraced, saying so:
  // Allocator::create).
  if (!trace_target_kind_ok(path, error)) return -1;
  struct stat st {};
  int fd = -1, lock_error = 0;
  for (int attempt = 0;; ++attempt) {  // Note [An earlier trace at the path]: locked, and still at the path
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd < 0) {
      if (error) *error = "fragless: cannot open trace file '" + path + "': " + std::strerror(errno);
      return -1;
    }
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) break;
    lock_error = ::flock(fd, LOCK_EX | LOCK_NB) == 0 ? 0 : errno;
    if (lock_error != 0) break;  // busy, or a file system without flock: handled below
    struct stat now {};
    if (::stat(path.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) {
      st = now;  // its size now that no other process writes it
      break;
    }
    ::close(fd);
    if (attempt == 8) {
      if (busy) *busy = true;
      if (error) *error = "fragless: another process keeps replacing the trace file '" + path + "'";
      return -1;
    }
  }
  if (S_ISREG(st.st_mode)) {
    if (lock_error == EWOULDBLOCK) {
      if (busy) *busy = true;
      if (error)
        *error = "fragless: another process is writing the trace file '" + path +
                 "' (give each process its own: %p, or %r with RANK set)";
      ::close(fd);
      return -1;
    }
    if (lock_error != 0)  // a file system without flock (some NFS and Lustre mounts): written unlocked
      std::fprintf(stderr, "fragless: the trace file '%s' cannot be locked (%s); it is written unlocked, so give "
                   "each process its own path (%%p, or %%r with RANK set)\n", path.c_str(), std::strerror(lock_error));
    if (st.st_size > 0) {
      // The file the path names, through any links, now that it is open (a link's target exists now).
      std::string target = path;
      struct stat link {};
      bool resolved = true;
      if (::lstat(path.c_str(), &link) == 0 && S_ISLNK(link.st_mode)) {
        char* real = ::realpath(path.c_str(), nullptr);
        resolved = real != nullptr;
        if (real) target = real;
        std::free(real);
      }
      const int kept = resolved ? keep_earlier_trace(fd, path, target, st, error, busy) : kNothingToKeep;
      if (kept != kNothingToKeep) {
        ::close(fd);  // the earlier file's lock goes with it
        if (kept < 0) return -1;
        fd = kept;
      }
    }
    if (::ftruncate(fd, 0) != 0) {
      if (error) *error = "fragless: cannot empty trace file '" + path + "': " + std::strerror(errno);
      ::close(fd);
      return -1;
    }
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  NoFileSizeSignal no_signal;  // Note [A file size limit]
  if (::write(fd, &h, sizeof h) != static_cast<ssize_t>(sizeof h)) {
    if (error) *error = "fragless: cannot write trace file '" + path + "': " + std::strerror(errno);
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace fragless
