// Format names, detection from content, loading from files, atomic writes.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "fragless/trace_format.h"
#include "trace_model.h"

namespace fragless::formats {

const char* op_name(Op op) {
  switch (op) {
    case Op::alloc: return "alloc";
    case Op::free: return "free";
    case Op::free_requested: return "free_requested";
    case Op::segment_alloc: return "segment_alloc";
    case Op::segment_free: return "segment_free";
    case Op::segment_map: return "segment_map";
    case Op::segment_unmap: return "segment_unmap";
    case Op::phys_create: return "phys_create";
    case Op::phys_release: return "phys_release";
    case Op::oom: return "oom";
    case Op::snapshot: return "snapshot";
    case Op::empty_cache: return "empty_cache";
  }
  return "?";
}

bool is_segment_op(Op op) {
  return op == Op::segment_alloc || op == Op::segment_free || op == Op::segment_map || op == Op::segment_unmap;
}

std::string address_text(std::uint64_t address) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(address));
  return b;
}

std::string seconds_text(std::int64_t us) {
  char b[48];
  std::snprintf(b, sizeof b, "%.6f", static_cast<double>(us) / 1e6);
  return b;
}

std::string event_out_of_bounds(const Event& e) {
  constexpr std::uint64_t kSizeLimit = std::uint64_t{1} << 63;
  if (e.device < 0 || e.device >= kMaxDevices)
    return "device " + std::to_string(e.device) + " is outside [0, " + std::to_string(kMaxDevices) + ")";
  if (e.time_us != -1 && (e.time_us < 0 || e.time_us > kMaxTimeUs))
    return "time " + std::to_string(e.time_us) + " µs is outside [0, " + std::to_string(kMaxTimeUs) + "] (2^64 ns)";
  // A request that failed is a record of what was asked and is never placed: any size (an absurd one, from an
  // underflow, is what fails), and its address says nothing about memory (a snapshot's holds the free bytes).
  if (e.op == Op::oom) return {};
  if (e.size >= kSizeLimit) return "size " + std::to_string(e.size) + " is outside [0, 2^63)";
  if (e.block_size >= kSizeLimit) return "block size " + std::to_string(e.block_size) + " is outside [0, 2^63)";
  if (e.address + e.size < e.address)
    return "address " + address_text(e.address) + " + size " + std::to_string(e.size) + " is past 2^64";
  return {};
}

const char* format_name(Format f) {
  switch (f) {
    case Format::native: return "native";
    case Format::rmm_csv: return "rmm";
    case Format::snapshot: return "snapshot";
  }
  return "?";
}

bool parse_format(const std::string& s, Format* f) {
  if (s == "native" || s == "fragless") *f = Format::native;
  else if (s == "rmm" || s == "csv") *f = Format::rmm_csv;
  else if (s == "snapshot" || s == "pickle" || s == "pytorch") *f = Format::snapshot;
  else return false;
  return true;
}

bool format_from_extension(const std::string& path, Format* f) {
  auto ends = [&](const char* e) {
    const std::size_t n = std::strlen(e);
    return path.size() >= n && path.compare(path.size() - n, n, e) == 0;
  };
  if (ends(".fgt") || ends(".trace") || ends(".bin")) *f = Format::native;
  else if (ends(".csv")) *f = Format::rmm_csv;
  else if (ends(".pickle") || ends(".pkl")) *f = Format::snapshot;
  else return false;
  return true;
}

// A file torch.save wrote (`torch.save(torch.cuda.memory._snapshot(), "x.pt")` is a common way to keep a
// snapshot): a zip archive holding data.pkl, or the legacy format, a pickle of torch.save's magic number
// (0x1950a86a20f9469cfc6c) followed by more pickles. Neither is the snapshot pickle itself, which the reader
// takes; "" for anything else.
static std::string torch_save_container(const std::string& bytes) {
  static const char kLegacy[] = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";
  const bool zip = bytes.rfind("PK\x03\x04", 0) == 0 && bytes.find("data.pkl") != std::string::npos;
  const bool legacy = bytes.size() >= sizeof kLegacy - 1 && std::memcmp(bytes.data(), kLegacy, sizeof kLegacy - 1) == 0;
  if (!zip && !legacy) return {};
  return std::string("a file torch.save wrote (") + (zip ? "a zip archive" : "its legacy format") +
         "), not a snapshot pickle: write the snapshot with torch.cuda.memory._dump_snapshot(PATH), or "
         "pickle.dump(torch.load(FILE), open(PATH, 'wb')), and give that";
}

// Whether the bytes begin as a protocol 0 or 1 pickle whose first opcode is GLOBAL ('c' module '\n' name
// '\n', as `cos\nsystem\n` begins a hostile one): detected as a pickle, so that the snapshot reader refuses it
// naming the opcode, rather than as a file of no known format.
static bool protocol0_global(const std::string& bytes) {
  if (bytes.empty() || bytes[0] != 'c') return false;
  std::size_t at = 1;
  for (int line = 0; line < 2; ++line) {
    const std::size_t end = bytes.find('\n', at);
    if (end == std::string::npos || end == at || end - at > 256) return false;
    for (std::size_t i = at; i < end; ++i) {
      const char ch = bytes[i];
      if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '.')) return false;
    }
    at = end + 1;
  }
  return true;
}

bool detect_format(const std::string& bytes, Format* f) {
  if (bytes.size() >= sizeof kTraceMagic && std::memcmp(bytes.data(), kTraceMagic, sizeof kTraceMagic) == 0)
    *f = Format::native;
  else if (bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x80 && bytes[1] >= 2 && bytes[1] <= 5)
    *f = Format::snapshot;
  // Protocols 0 and 1 have no PROTO opcode: a snapshot (a dict, or the oldest, a list of segments) then
  // begins MARK DICT/LIST (protocol 0: "(d", "(l") or EMPTY_DICT/EMPTY_LIST (protocol 1: '}', ']').
  else if (bytes.rfind("(", 0) == 0 || bytes.rfind("}", 0) == 0 || bytes.rfind("]", 0) == 0 || protocol0_global(bytes))
    *f = Format::snapshot;
  else if (bytes.rfind("Thread,", 0) == 0 || bytes.substr(0, bytes.find('\n')).find("Action") != std::string::npos)
    *f = Format::rmm_csv;
  else
    return false;
  return true;
}

// detect_format, or false with *why naming what the bytes are instead (a torch.save file) or that they are none.
static bool format_of(const std::string& bytes, Format* f, std::string* why) {
  if (std::string saved = torch_save_container(bytes); !saved.empty()) {
    *why = std::move(saved);
    return false;
  }
  if (detect_format(bytes, f)) return true;
  *why = "unknown trace format (expected a fragless native trace, a PyTorch memory snapshot pickle or an RMM log CSV; "
         "its first bytes are none of them)";
  // A CSV that is not an RMM log: say what its header needs.
  const std::string first = bytes.substr(0, std::min(bytes.find('\n'), std::size_t{4096}));
  const bool text = std::all_of(first.begin(), first.end(), [](char c) {
    return std::isprint(static_cast<unsigned char>(c)) || c == '\r' || c == '\t';
  });
  if (text && first.find(',') != std::string::npos)
    *why += "; a CSV is read as an RMM log when its header names an Action column, as RMM's does "
            "(Thread,Time,Action,Pointer,Size,Stream)";
  return false;
}

LoadResult trace_from_bytes(const std::string& bytes, const std::string& name) {
  Format f;
  LoadResult r;
  if (std::string why; !format_of(bytes, &f, &why)) {
    r.error = name + ": " + why;
    return r;
  }
  switch (f) {
    case Format::native: r = trace_from_native_bytes(bytes, name); break;
    case Format::snapshot: r = trace_from_snapshot_bytes(bytes, name); break;
    case Format::rmm_csv: r = trace_from_rmm_csv(bytes, name); break;
  }
  r.format = f;
  return r;
}

// Note [Reading a trace from a stream]
// The format is told from the input's first bytes (detect_format), before the rest is read: a file that is
// none of the formats (/dev/zero, a binary) is refused at once instead of after reading all of it. A regular
// file is then read whole; anything else (a pipe, a FIFO, a device) may never end, so at most
// kMaxStreamBytes of it are read, and an input longer than that is refused with the limit named.
constexpr std::size_t kHeadBytes = 4096;
constexpr std::uint64_t kMaxStreamBytes = std::uint64_t{4} << 30;

LoadResult load_trace(const std::string& path) {
  LoadResult r;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    r.error = path + ": cannot open (" + std::strerror(errno) + ")";
    return r;
  }
  struct Closer { int fd; ~Closer() { ::close(fd); } } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    r.error = path + ": cannot read (" + std::strerror(errno) + ")";
    return r;
  }
  if (S_ISDIR(st.st_mode)) {
    r.error = path + ": is a directory (expected a trace file)";
    return r;
  }
  const bool regular = S_ISREG(st.st_mode);
  std::string bytes;
  // Reads until `bytes` holds `want` bytes or the input ends; false with r.error on a read error.
  auto fill = [&](std::uint64_t want) {
    while (bytes.size() < want) {
      const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(want - bytes.size(), 1 << 20));
      const std::size_t at = bytes.size();
      bytes.resize(at + chunk);
      const ssize_t n = ::read(fd, bytes.data() + at, chunk);
      if (n < 0 && errno == EINTR) {
        bytes.resize(at);
        continue;
      }
      if (n < 0) {
        r.error = path + ": cannot read (" + std::strerror(errno) + ")";
        return false;
      }
      bytes.resize(at + static_cast<std::size_t>(n));
      if (n == 0) break;
    }
    return true;
  };
  if (!fill(kHeadBytes)) return r;
  if (bytes.empty()) {
    r.error = path + ": is empty (expected a fragless native trace, a PyTorch memory snapshot pickle or an RMM log CSV)";
    return r;
  }
  Format f;
  if (std::string why; !format_of(bytes, &f, &why)) {
    r.error = path + ": " + why;
    return r;
  }
  // Note [Reading a native trace in blocks]: a native file is read a block at a time, never whole.
  if (f == Format::native && regular) {
    LoadResult n = trace_from_native_file(fd, static_cast<std::uint64_t>(st.st_size), path);
    n.format = f;
    return n;
  }
  if (bytes.size() == kHeadBytes) {
    if (regular) {
      bytes.reserve(static_cast<std::size_t>(st.st_size) + (1 << 20));  // room for fill's last chunk
      if (!fill(UINT64_MAX)) return r;
    } else {
      if (!fill(kMaxStreamBytes + 1)) return r;
      if (bytes.size() > kMaxStreamBytes) {
        r.error = path + ": not a regular file, and longer than " + std::to_string(kMaxStreamBytes >> 30) +
                  " GiB (the most read from a pipe or device; copy it to a file)";
        return r;
      }
    }
  }
  return trace_from_bytes(bytes, path);
}

// Note [Writing an output file]
// An output replaces its file atomically: the bytes go to a temporary file in the same folder, which is then
// renamed over it, so a reader never sees half a file and a failed write leaves the old one. A symbolic link
// is followed to its target (the link stays a link; the target is what is replaced, and a dangling link's
// target is created), as a shell's `>` would. An existing target that is not a regular file (a FIFO, a
// device, a socket, a folder) is refused: renaming over it would replace it with a regular file, and
// writing into it could not be atomic. The replaced file keeps its permission bits.
bool output_target(const std::string& path, std::string* target, std::string* error) {
  auto refuse = [&](const std::string& why) {
    if (error) *error = path + ": " + why;
    return false;
  };
  if (path.empty()) return refuse("an empty file name");
  std::string p = path;
  for (int hops = 0;; ++hops) {
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0) {
      if (errno == ENOENT) break;  // a new file: its folder is checked below
      return refuse(std::string("cannot write (") + std::strerror(errno) + ")");
    }
    if (S_ISLNK(st.st_mode)) {
      if (hops == 40) return refuse("too many levels of symbolic links");
      std::string link(static_cast<std::size_t>(st.st_size > 0 ? st.st_size : 4096) + 1, '\0');
      const ssize_t n = ::readlink(p.c_str(), link.data(), link.size());
      if (n < 0) return refuse(std::string("cannot read the symbolic link (") + std::strerror(errno) + ")");
      link.resize(static_cast<std::size_t>(n));
      const auto slash = p.rfind('/');
      p = link.empty() || link[0] == '/' || slash == std::string::npos ? link : p.substr(0, slash + 1) + link;
      continue;
    }
    if (S_ISDIR(st.st_mode)) return refuse(p == path ? "is a folder, not a file" : "links to a folder (" + p + "), not a file");
    if (!S_ISREG(st.st_mode)) {
      const char* kind = S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                         : S_ISSOCK(st.st_mode) ? "a socket" : "not a regular file";
      return refuse(std::string("is ") + kind + (p == path ? "" : " (through the link, " + p + ")") +
                    "; outputs are written to regular files only (a temporary file renamed over the old one)");
    }
    break;
  }
  // The folder the temporary file goes to, checked now: a command that reads its input first would
  // otherwise fail only at the end, naming the temporary file.
  const auto slash = p.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : p.substr(0, slash);
  const std::string folder = "the folder " + dir + (p == path ? "" : " of its target " + p);
  struct stat ds;
  if (::stat(dir.c_str(), &ds) != 0)
    return refuse(errno == ENOENT ? folder + " does not exist"
                                  : "cannot reach " + folder + " (" + std::strerror(errno) + ")");
  if (!S_ISDIR(ds.st_mode)) return refuse(dir + (p == path ? "" : " (the folder of its target " + p + ")") + " is not a folder");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    return refuse("cannot write in " + folder + " (" + std::strerror(errno) + ")");
  *target = p;
  return true;
}

// Note [An output never replaces an input]
// `fragless-trace convert x.pickle x.pickle` or `fragless-replay --plot t.gp t.gp` would replace the file being
// read, atomically and with its permission bits, so even a read-only input went: the input is lost and the
// command says it succeeded. So an output whose target (links followed, as write_file follows them) is the
// same file as an input (same device and inode, whatever the names) is refused before anything is read.
bool output_spares_inputs(const std::string& path, const std::vector<std::string>& inputs, std::string* error) {
  std::string target;
  if (!output_target(path, &target, error)) return false;
  struct stat out;
  if (::stat(target.c_str(), &out) != 0) return true;  // a new file is nobody's input
  for (const std::string& in : inputs) {
    struct stat st;
    if (::stat(in.c_str(), &st) == 0 && st.st_dev == out.st_dev && st.st_ino == out.st_ino) {
      if (error)
        *error = path + ": is the input " + in + (target == path || in == path ? "" : " (through a link)") +
                 "; writing it would replace what is being read (name another file)";
      return false;
    }
  }
  return true;
}

bool write_file(const std::string& path, const std::string& bytes, std::string* error) {
  std::string target;
  if (!output_target(path, &target, error)) return false;
  auto failed = [&](const std::string& what) {
    if (error) *error = path + ": " + what + " (" + std::strerror(errno) + ")";
    return false;
  };
  struct stat old;
  const bool existed = ::stat(target.c_str(), &old) == 0;
  // A fresh name beside the target (mkostemp: never one a crashed run left behind), given the mode the file
  // would have had: the old file's, else 0666 less the umask (read by setting it back at once: the tools
  // write from one thread).
  std::string name = target + ".tmpXXXXXX";
  const int fd = ::mkostemp(name.data(), O_CLOEXEC);
  const std::string tmp = name;
  if (fd < 0) return failed("cannot write " + tmp);
  const mode_t mask = ::umask(0);
  ::umask(mask);
  int err = ::fchmod(fd, existed ? (old.st_mode & 07777) : (0666 & ~mask)) != 0 ? errno : 0;
  for (std::size_t done = 0; !err && done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) err = n < 0 ? errno : EIO;
    else done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0 && !err) err = errno;
  if (!err && std::rename(tmp.c_str(), target.c_str()) != 0) err = errno;
  if (err) {
    std::remove(tmp.c_str());
    errno = err;
    return failed(target == path ? "cannot write" : "cannot write " + target);
  }
  return true;
}

}  // namespace fragless::formats
