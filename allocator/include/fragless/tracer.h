// The runtime tracer: one EventSink per device that appends fixed-size records (trace_format.h) to an
// in-memory buffer and hands full buffers to a writer thread, so the hot path never calls the kernel (until
// process exit, when each record is written as it comes: Note [Tracing at exit], tracer.cpp). The writer
// also writes what a buffer being filled holds every 100 ms, so a process killed by a signal loses at most
// the last 100 ms of records (Note [Writing a buffer being filled]).
// Enabled by FRAGLESS_CONF's `trace` key; the path may contain %p (pid), %d (device), %r (rank from RANK)
// and %% (a percent sign). Without %d, every device of the process writes to the same file.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fragless/trace.h"

namespace fragless {

constexpr int kRankUnset = -1, kRankInvalid = -2, kMaxRank = 1'000'000;
// RANK from the environment: kRankUnset when unset or empty, kRankInvalid when it is not a whole number in
// [0, kMaxRank].
int rank_from_environment();
// Expands %p, %d, %r and %%; an unknown %x, and %r with an invalid RANK, are errors (empty result, *error set).
// %r without RANK is 0.
std::string expand_trace_path(std::string_view pattern, int device, int pid, int rank, std::string* error);
// Whether an existing `path` can take a trace: a regular file or a character device (/dev/null), or nothing
// there yet; false with *error (when given) naming a FIFO, a directory or anything else.
bool trace_target_kind_ok(const std::string& path, std::string* error);
// Whether this process could write the trace of `pattern` for `devices` devices (each file %d names), creating
// nothing: the path's kind, and the file, or its folder, writable. What Tracing::open would refuse at the first
// allocation, said before it (fragless_check_driver).
bool trace_path_usable(std::string_view pattern, int devices, std::string* error);

struct NativeTraceHeader;
// Opens (creates, locks, empties) the trace file at `path` and writes `h`: its descriptor, or -1 with *error
// (and *busy when another process writes it). A file already there with records is kept as PATH.prev, said on
// stderr (Note [An earlier trace at the path], trace_open.cpp).
int open_trace_file(const std::string& path, const NativeTraceHeader& h, std::string* error, bool* busy);

class TraceFile;

// Owns the trace files and the per-device sinks of one process (or one Allocator).
class Tracing {
 public:
  // Opens (truncates) the files for `devices` devices. nullptr with *error naming the path on failure.
  // *busy (when given) is set when the failure is a file another process is writing (Note [Opening a trace
  // file], tracer.cpp).
  static std::unique_ptr<Tracing> open(std::string_view pattern, int devices, const char* policy,
                                       std::string* error, bool* busy = nullptr);
  ~Tracing();  // writes everything still buffered and closes the files

  // At process exit (Note [Tracing at exit], tracer.cpp): writes what the writer threads were given and joins
  // them; from then on each sink writes each record to its file as it comes (the caller then flushes each
  // sink, under its device's lock, for what it still holds). Not in a forked child: its writers are not
  // there to join.
  void go_synchronous();

  EventSink* sink(int device);
  std::vector<std::string> paths() const;
  // Records lost because a write failed (disk full, ...) or the file was removed; 0 normally.
  std::uint64_t dropped_records() const;
  // One line naming each file that stopped taking records, how many it lost and why; "" when none did. Asks
  // each file first whether it was removed.
  std::string losses();
  // losses() on stderr, when records were lost since the last time it said so.
  void report_losses();

 private:
  Tracing() = default;
  std::vector<std::unique_ptr<TraceFile>> files_;
  std::vector<std::unique_ptr<EventSink>> sinks_;
  std::uint64_t reported_ = 0;  // records lost when report_losses last said so
};

}  // namespace fragless
