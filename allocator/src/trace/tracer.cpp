#include "fragless/tracer.h"

#include "fragless/allocator.h"

#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "base/quiet_thread.h"
#include "base/no_file_size_signal.h"
#include "trace/trace_clock.h"
#include "fragless/trace_format.h"

namespace fragless {

const char* trace_action_name(TraceAction a) {
  switch (a) {
    case TraceAction::alloc: return "alloc";
    case TraceAction::free_requested: return "free_requested";
    case TraceAction::free_completed: return "free_completed";
    case TraceAction::segment_alloc: return "segment_alloc";
    case TraceAction::segment_free: return "segment_free";
    case TraceAction::segment_map: return "segment_map";
    case TraceAction::segment_unmap: return "segment_unmap";
    case TraceAction::phys_create: return "phys_create";
    case TraceAction::phys_release: return "phys_release";
    case TraceAction::oom: return "oom";
    case TraceAction::snapshot: return "snapshot";
    case TraceAction::empty_cache: return "empty_cache";
    case TraceAction::free: return "free";
    case TraceAction::block_present: return "block_present";
    case TraceAction::segment_present: return "segment_present";
  }
  return "unknown";
}

// One output file and its writer thread. Sinks hand it full buffers; it writes them in order. At process
// exit the writer stops and the file goes synchronous: a buffer handed to it then is written at once, on the
// caller's thread (Note [Tracing at exit]).
class TraceFile {
 public:
  static constexpr std::size_t kBuffers = 2;
  // How long a record may wait in a buffer being filled before it is written (Note [Writing a buffer being
  // filled]): what a process killed by a signal or abort() can lose.
  static constexpr std::chrono::milliseconds kWriteEvery{100};

  TraceFile(int fd, std::string path)
      : fd_(fd), path_(std::move(path)), clock_(&trace_clock()), thread_(start_quiet_thread([this] { run(); })) {}
  // Whether the calling process is the one that opened the file (Note [Tracing in a forked child]).
  bool in_owner() const { return ::getpid() == owner_; }
  ~TraceFile() {
    if (in_owner()) {
      stop_writer();
    } else {
      // A forked child (Note [Tracing in a forked child]): the writer is not in this process, so it can be
      // neither joined nor detached; its handle is left, as the thread's memory is.
      (void)new std::thread(std::move(thread_));
    }
    if (fd_ >= 0) ::close(fd_);
  }
  // In a forked child (Note [Tracing in a forked child]): its copy of the descriptor would keep the file's lock
  // after the parent ended (an orphaned data-loader worker), and the next run given the path would find it
  // busy. Each of the child's sinks calls it; the first closes.
  void close_in_child() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  const std::string& path() const { return path_; }
  std::uint64_t dropped() const {
    std::lock_guard lk(mu_);
    return dropped_;
  }
  // Asks now whether the file was removed (Note [A trace file removed while written]), for a flush's answer.
  void check_removed_now() {
    std::lock_guard lk(mu_);
    if (in_owner()) check_removed();
  }
  // Why the file stopped taking records ("" while it takes them).
  std::string failure() const {
    std::lock_guard lk(mu_);
    return failure_;
  }

  // A sink's buffer being filled, for the writer's periodic writes (Note [Writing a buffer being filled]):
  // the buffer, the count of records the sink has stored in it (published with release after each), and how
  // many of them the file already has. Owned by the sink; registered with the file while the sink lives.
  struct Filling {
    NativeTraceRecord* buf = nullptr;
    std::atomic<std::size_t> stored{0};
    std::size_t written = 0;  // under mu_
    int queued = 0;           // under mu_: this sink's jobs not yet written (its records before buf's)
  };
  void add_filling(Filling* f) {
    std::lock_guard lk(mu_);
    filling_.push_back(f);
  }
  void remove_filling(Filling* f) {
    std::lock_guard lk(mu_);
    filling_.erase(std::remove(filling_.begin(), filling_.end(), f), filling_.end());
  }

  // Queues the `n` records at `p`, the buffer `f` was filling, less what the writer already wrote of it, and
  // makes `next` the buffer `f` fills; *busy stays true until they are written. Once the writer is stopped,
  // writes them now, after whatever it still had, and *busy stays false.
  void submit(Filling* f, NativeTraceRecord* p, std::size_t n, bool* busy, NativeTraceRecord* next) {
    {
      std::unique_lock lk(mu_);
      const std::size_t from = std::min(f->written, n);
      f->buf = next;
      f->written = 0;
      f->stored.store(0, std::memory_order_relaxed);
      p += from;
      n -= from;
      if (dead_) return written(false, n, 0);
      if (stop_) {
        // The writer's last buffers go first, and a periodic write it may be in the middle of.
        done_.wait(lk, [&] { return jobs_.empty() && !filling_in_flight_; });
        std::size_t kept = 0;
        NoFileSizeSignal no_signal;  // Note [A file size limit]
        written(failure_.empty() && write_records(p, n, &kept), n, kept);
        return;
      }
      *busy = true;
      ++f->queued;
      jobs_.push_back({p, n, busy, f});
    }
    cv_.notify_all();
  }
  // Note [A slow trace disk]
  // A sink waits only when the writer has not yet written its other buffer (8192 records behind). On a disk
  // that stalls (a hung network file system) that wait is inside a program's allocation and lasts as long as
  // the disk's write, since the trace keeps every record. The first wait past kSlowWait is said on stderr,
  // naming the file, so a stalled job points at its trace; a disk that never answers hangs the allocation
  // (and the exit, which writes what was given), as it hangs the program's own writes there.
  static constexpr std::chrono::seconds kSlowWait{1};
  void wait_until_written(const bool* busy) {
    std::unique_lock lk(mu_);
    if (done_.wait_for(lk, kSlowWait, [&] { return !*busy; })) return;
    if (!slow_said_) {
      slow_said_ = true;
      std::fprintf(stderr, "fragless: an allocation has waited %lld s for the trace to be written to %s (its disk is "
                   "slow or stalled); allocations wait for it while the writer is a whole buffer behind\n",
                   static_cast<long long>(kSlowWait.count()), path_.c_str());
    }
    done_.wait(lk, [&] { return !*busy; });
  }
  // Writes what was queued, then ends and joins the writer. Idempotent. Not in a forked child, where the
  // writer is not (joining it would never return).
  void stop_writer() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (!thread_.joinable()) return;
    if (thread_.get_id() == std::this_thread::get_id()) {
      // exit() on the writer itself (a signal handler that ran on it): it cannot join itself, and what it
      // was writing when interrupted may stay unwritten; the file is written no more (a later record is
      // counted as dropped).
      thread_.detach();
      std::lock_guard lk(mu_);
      dead_ = true;
      return;
    }
    thread_.join();
    std::lock_guard lk(mu_);
    check_removed();
  }

 private:
  struct Job {
    NativeTraceRecord* p;
    std::size_t n;
    bool* busy;
    Filling* from;
  };

  // A job stays queued until it is written, so that a synchronous write (submit, once stopped) waits for it.
  // Every kWriteEvery the buffers being filled are written so far (Note [Writing a buffer being filled]).
  void run() {
    std::unique_lock lk(mu_);
    auto due = std::chrono::steady_clock::now() + kWriteEvery;
    for (;;) {
      cv_.wait_until(lk, due, [&] { return stop_ || !jobs_.empty(); });
      // Due whether or not full buffers came meanwhile: a quiet device sharing the file with a busy one is
      // written too (not only when the queue has stayed empty for the interval).
      if (!stop_ && std::chrono::steady_clock::now() >= due) {
        check_removed();
        clock_->refine();  // Note [The trace clock]: refits at most once an interval, whichever writer asks
        write_filling(lk);
        due = std::chrono::steady_clock::now() + kWriteEvery;
        continue;
      }
      if (jobs_.empty()) {
        if (stop_) return;  // nothing left
        continue;
      }
      const Job j = jobs_.front();
      const bool failed = !failure_.empty();
      lk.unlock();
      std::size_t kept = 0;
      const bool ok = !failed && write_records(j.p, j.n, &kept);
      lk.lock();
      jobs_.pop_front();
      --j.from->queued;
      written(ok, j.n, kept);
      *j.busy = false;
      done_.notify_all();
    }
  }

  // mu_ held, on the writer (Note [Writing a buffer being filled]): writes what each filling buffer holds beyond
  // what the file has. The sink goes on storing after the count read here, into slots this write does not
  // read; it reuses the buffer only once the buffer's job, which the writer makes after this, is done, and a
  // sink is destroyed only after its last job. A sink whose earlier buffer's job is still queued is passed over
  // (its records in the file stay in their order). The list may change while a write runs without mu_: by
  // index, an entry that moved is looked at again (nothing new then) or next time. filling_in_flight_ keeps a
  // write made once the writer is stopping (submit) from overtaking this one.
  void write_filling(std::unique_lock<std::mutex>& lk) {
    for (std::size_t i = 0; i < filling_.size(); ++i) {
      Filling* const f = filling_[i];
      const std::size_t stored = f->stored.load(std::memory_order_acquire);
      if (stored <= f->written || !failure_.empty() || f->queued > 0) continue;
      NativeTraceRecord* p = f->buf + f->written;
      const std::size_t n = stored - f->written;
      f->written = stored;
      filling_in_flight_ = true;
      lk.unlock();
      std::size_t kept = 0;
      const bool ok = write_records(p, n, &kept);
      lk.lock();
      filling_in_flight_ = false;
      done_.notify_all();
      written(ok, n, kept);
    }
  }

  // mu_ held: counts `n` records lost when their write failed or an earlier one did (a file that failed
  // once is written no more); one line on stderr, at the first.
  void written(bool ok, std::size_t n, std::size_t kept) {
    if (ok) return;
    if (failure_.empty()) {
      const char* why = std::strerror(errno);  // before anything that may set errno
      failure_ = std::string("writing it failed: ") + why;
      std::fprintf(stderr, "fragless: writing the trace to %s failed (%s); later records are dropped\n", path_.c_str(), why);
    }
    dropped_ += n - std::min(n, kept);
  }

  // Note [A trace file removed while written]
  // A file removed (or its folder) while written takes every record with it when the process closes it, and
  // nothing said so. mu_ held: every kWriteEvery, and when the writer stops, the writer asks whether the file
  // still has a name (st_nlink); once it has none, one line on stderr says so, the file is written no more, and
  // what it held and every later record count as lost. A file renamed or linked elsewhere is written on.
  void check_removed() {
    struct stat st {};
    if (removed_ || fd_ < 0 || ::fstat(fd_, &st) != 0 || st.st_nlink != 0) return;
    removed_ = true;
    failure_ += failure_.empty() ? "it was removed while it was written, with the records written to it"
                                 : "; then it was removed, with the records written to it";
    const auto body = st.st_size > static_cast<off_t>(sizeof(NativeTraceHeader)) ? st.st_size - sizeof(NativeTraceHeader) : 0;
    dropped_ += static_cast<std::uint64_t>(body) / sizeof(NativeTraceRecord);
    std::fprintf(stderr, "fragless: the trace file %s was removed while it was written: the %lld bytes written to it "
                 "are lost, and later records are dropped\n", path_.c_str(), static_cast<long long>(st.st_size));
  }

  // The records' raw ticks become nanoseconds (Note [The trace clock]), then they are written: each record
  // once, by whoever writes it (a filling buffer's part, or the job of the rest), on a buffer the sink no longer
  // touches there.
  bool write_records(NativeTraceRecord* p, std::size_t n, std::size_t* kept) {
    clock_->to_ns(p, n);
    return write_all(reinterpret_cast<const char*>(p), n * sizeof(NativeTraceRecord), kept);
  }

  // Without mu_ on the writer thread (a job's buffer is the writer's alone), with mu_ once stopped. A write
  // that fails part way (a full disk) leaves the whole records before it in the file: they are not lost.
  // *kept: the whole records written before a failure.
  bool write_all(const char* p, std::size_t n, std::size_t* kept) {
    const char* const start = p;
    while (n) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        *kept = static_cast<std::size_t>(p - start) / sizeof(NativeTraceRecord);
        return false;
      }
      p += w;
      n -= static_cast<std::size_t>(w);
    }
    return true;
  }

  int fd_;
  std::string path_;
  const pid_t owner_ = ::getpid();
  mutable std::mutex mu_;
  std::condition_variable cv_, done_;
  std::deque<Job> jobs_;
  std::vector<Filling*> filling_;
  bool filling_in_flight_ = false;  // a periodic write runs without mu_
  bool stop_ = false;
  bool dead_ = false;  // stopped on the writer thread itself: nothing more is written
  bool slow_said_ = false;  // Note [A slow trace disk]
  bool removed_ = false;    // Note [A trace file removed while written]
  std::uint64_t dropped_ = 0;
  std::string failure_;  // why the file takes no more records; "" while it takes them
  TraceClock* clock_;    // refitted by the writer (Note [The trace clock])
  std::thread thread_;  // last: starts after everything above exists
};

namespace {

class TraceSink;
// Every sink made, for the fork handler (Note [Tracing in a forked child]): a list only ever pushed to, with a
// compare-exchange (a fork during a push leaves it whole), each node naming its sink until the sink dies. The
// nodes are never freed (one per device per Tracing).
struct SinkNode { std::atomic<TraceSink*> sink; SinkNode* next; };
std::atomic<SinkNode*> g_sinks{nullptr};
SinkNode* register_sink(TraceSink* s) {
  auto* n = new SinkNode{{s}, g_sinks.load(std::memory_order_relaxed)};
  while (!g_sinks.compare_exchange_weak(n->next, n, std::memory_order_release, std::memory_order_relaxed)) {
  }
  return n;
}

// Per-device sink: double-buffered; the engine's device lock serialises on_event and flush.
class TraceSink final : public EventSink {
 public:
  static constexpr std::size_t kCapacity = 8192;  // records per buffer (384 KiB)

  TraceSink(TraceFile* f, int device) : file_(f), clock_(&trace_clock()), device_(static_cast<std::uint16_t>(device)) {
    for (auto& b : bufs_) b.reset(new NativeTraceRecord[kCapacity]);
    cur_ = bufs_[0].get();
    filling_.buf = cur_;
    node_ = register_sink(this);
    f->add_filling(&filling_);
  }
  ~TraceSink() override {
    node_->sink.store(nullptr, std::memory_order_relaxed);
    flush();
    if (!forked_) file_->remove_filling(&filling_);
  }

  void on_event(const TraceEvent& e) override {
    if (n_ == kCapacity) hand_off();
    NativeTraceRecord& r = cur_[n_++];
    r.time_ns = clock_->ticks();  // nanoseconds once written (Note [The trace clock])
    r.address = e.address;
    r.requested = e.requested_size;
    r.block = e.block_size;
    r.stream = e.stream;
    r.device = device_;
    r.action = static_cast<std::uint8_t>(e.action);
    r.marker = kTraceRecordMarker;
    r.sequence = seq_++;
    filling_.stored.store(n_, std::memory_order_release);  // Note [Writing a buffer being filled]
    if (synchronous_.load(std::memory_order_relaxed)) hand_off();  // Note [Tracing at exit]
  }

  void flush() override {
    if (forked_) return drop_in_child();
    if (n_) hand_off();
    for (auto& busy : busy_) file_->wait_until_written(&busy);
  }

  // From now on each record is handed to the file as it is made (its writer has stopped: written at once).
  void go_synchronous() { synchronous_.store(true, std::memory_order_relaxed); }
  // In the child of a fork, on its one thread (Note [Tracing in a forked child]): what the sink holds is the
  // parent's to write.
  void after_fork_child() {
    file_->close_in_child();
    forked_ = true;
    n_ = 0;
    synchronous_.store(true, std::memory_order_relaxed);  // each record is handed off, that is dropped, at once
  }

 private:
  void hand_off() {
    if (forked_) return drop_in_child();
    file_->submit(&filling_, cur_, n_, &busy_[active_], bufs_[active_ ^ 1].get());
    active_ ^= 1;
    file_->wait_until_written(&busy_[active_]);  // normally long done
    cur_ = bufs_[active_].get();
    n_ = 0;
  }

  // In a forked child (Note [Tracing in a forked child]): the child's records are not written; one line on
  // stderr the first time there are any.
  void drop_in_child() {
    if (n_ && !forked_said_) {
      std::fprintf(stderr,
                   "fragless: process %d is a fork of the process tracing to %s; the child's allocator events "
                   "are not traced (that file is the parent's)\n",
                   static_cast<int>(::getpid()), file_->path().c_str());
      forked_said_ = true;
    }
    n_ = 0;
  }

  TraceFile* file_;
  SinkNode* node_ = nullptr;
  bool forked_ = false, forked_said_ = false;  // Note [Tracing in a forked child]
  const TraceClock* clock_;
  std::uint16_t device_;
  std::uint32_t seq_ = 0;
  std::unique_ptr<NativeTraceRecord[]> bufs_[2];
  TraceFile::Filling filling_;  // cur_ and how much of it is stored, for the writer's periodic writes
  bool busy_[2] = {false, false};
  int active_ = 0;
  NativeTraceRecord* cur_ = nullptr;
  std::size_t n_ = 0;
  // Set once, by go_synchronous on the exiting thread, while another thread may be in on_event (hence
  // atomic; relaxed: a record that misses it is written by the flush that follows, under the lock).
  std::atomic<bool> synchronous_{false};
};

void sinks_after_fork_child() {
  forget_starting_threads();  // the writers that were starting are not here
  for (SinkNode* n = g_sinks.load(std::memory_order_acquire); n; n = n->next)
    if (TraceSink* s = n->sink.load(std::memory_order_relaxed)) s->after_fork_child();
}
// The clock's mutex (Note [The trace clock]) is held across fork() with the engines' locks, after the device
// locks: a writer converting under it never waits for a device lock, and a sink at exit takes it under one.
// A prepare handler of its own, run before the device locks, deadlocked: the forking thread held it while it
// waited for a device lock, whose holder waited for the writer, which waited for it.
void lock_clock_for_fork(void* c) { static_cast<TraceClock*>(c)->prepare_fork(); }
void unlock_clock_after_fork(void* c) { static_cast<TraceClock*>(c)->after_fork(); }
// Installed before the first writer begins (Tracing::open): a child forked as one starts counts none (Note
// [Forking while a thread starts]).
void install_sink_fork_handler() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, &sinks_after_fork_child); });
}

}  // namespace

std::unique_ptr<Tracing> Tracing::open(std::string_view pattern, int devices, const char* policy,
                                       std::string* error, bool* busy) {
  if (busy) *busy = false;
  auto t = std::unique_ptr<Tracing>(new Tracing());
  const int pid = static_cast<int>(::getpid());
  const int rank = rank_from_environment();
  // A file per device when the pattern names the device ("%%d" is a percent sign and a 'd'): read from the
  // expansion itself, so that the path grammar is in one place.
  const bool per_device = expand_trace_path(pattern, 0, pid, rank, nullptr) != expand_trace_path(pattern, 1, pid, rank, nullptr);
  const int nfiles = per_device ? devices : 1;
  hold_across_fork(&lock_clock_for_fork, &unlock_clock_after_fork, &trace_clock());  // calibrated before the first event
  install_sink_fork_handler();  // before the first writer begins
  for (int f = 0; f < nfiles; ++f) {
    const std::string path = expand_trace_path(pattern, f, pid, rank, error);
    if (path.empty()) return nullptr;
    NativeTraceHeader h{};
    std::memcpy(h.magic, kTraceMagic, sizeof h.magic);
    h.version = kTraceVersion;
    h.header_size = sizeof(NativeTraceHeader);
    h.record_size = sizeof(NativeTraceRecord);
    h.pid = static_cast<std::uint32_t>(pid);
    h.rank = rank < 0 ? -1 : rank;  // -1: none (trace_format.h), also for a RANK that is not one
    h.device = per_device ? f : -1;
    h.origin_unix_ns = trace_clock().origin_unix_ns;
    std::strncpy(h.policy, policy ? policy : "", sizeof h.policy - 1);
    const int fd = open_trace_file(path, h, error, busy);
    if (fd < 0) return nullptr;
    t->files_.push_back(std::make_unique<TraceFile>(fd, path));
  }
  for (int d = 0; d < devices; ++d)
    t->sinks_.push_back(std::make_unique<TraceSink>(t->files_[per_device ? static_cast<std::size_t>(d) : 0].get(), d));
  return t;
}

// Note [Tracing in a forked child]
// A child made by fork() inherits the allocator, its sinks and their files, but not the writer threads: a
// buffer it handed to a file would wait for a writer that is not there, so a child that made 16,384 events
// (two buffers), or flushed at its exit, hung. Its records are not the parent's file's either (the header
// names the parent's pid, and the two processes would interleave). So in a child a sink writes nothing. A
// fork handler (pthread_atfork's child handler, on the child's one thread) drops what each sink held at the
// fork (the parent's records, which the parent writes), marks it forked and makes it hand off each record as
// it is made (as at exit, Note [Tracing at exit]); a forked sink drops what it hands off, and says so on
// stderr at the child's first event on that device, so a child that makes no event says nothing, and one
// that does is told at once. (Allocator::at_exit does nothing in a child.) A child that execs a program starts a new allocator with a trace
// of its own (a `%p` in the path keeps the files apart).

// Note [Writing a buffer being filled]
// A trace is most wanted from the run that died: killed by the kernel's OOM killer or a scheduler's time
// limit, or ended by abort(). A sink's buffer was written only when full (8192 records) or at a normal exit,
// so such a run lost up to two buffers a device, the last events before its end: at a slow job's allocation
// rate minutes of them. So the writer, every kWriteEvery (100 ms) whatever else came, also writes what each
// buffer being filled holds beyond what the file has: the sink publishes its count
// after each record (a release store, on x86 a plain one), and the writer takes the slots up to that count,
// which the sink no longer touches. When the buffer is later handed off full, its job is what the periodic
// writes left. A process killed by a signal then loses at most the last 100 ms or so of records (and still
// ends on a record boundary, so its reader cannot tell). Storing straight into a shared mapping of the file
// would lose nothing, and was measured and dropped: a first store to each page of a file mapping is a page
// fault, about 18 µs each on the virtual machines here (1.2 to 1.8 ms per 384 KiB against 54 µs for a
// write(2) of it), so the writer fell far behind the saturating benchmark (docs/RESULTS.md, "The tracer's
// cost").

// Note [Tracing at exit]
// An allocator that is never destroyed (the C ABI, the CPU allocator, the interposer: frees come from static
// destructors that run after the exit handlers) never joins its writer threads, and a record made after the
// exit handler's flush would wait in a buffer that nobody writes. So the exit handler (Allocator::at_exit),
// after the workers have stopped, makes the tracing synchronous: each file's writer writes what it was given
// and is joined (no thread of ours is left for the exit to race), and from then on a sink writes each record
// as it comes, with one write(2) in on_event: under the device lock, which serialises the sink as before,
// and the file's mutex, which serialises the devices that share a file. Then it flushes every engine (under
// its lock), which writes what a sink still held, records made meanwhile included. A trace then ends with
// every event of the process, the last static destructor's frees too, at one write(2) per record (and four
// calls that keep SIGXFSZ off it, Note [A file size limit]), which only the exit pays. A failed write counts
// its records as dropped, as the writer does.
void Tracing::go_synchronous() {
  for (auto& f : files_) f->stop_writer();
  for (auto& s : sinks_) static_cast<TraceSink*>(s.get())->go_synchronous();
}

Tracing::~Tracing() {
  sinks_.clear();  // flushes
  if (!files_.empty() && files_[0]->in_owner()) {  // not in a forked child (Note [Tracing in a forked child])
    for (auto& f : files_) f->stop_writer();  // what was given is written (or counted as lost)
    report_losses();  // an allocator destroyed before the exit (the C++ API) says what the exit handler would
  }
  files_.clear();  // closes
}

EventSink* Tracing::sink(int device) {
  return device >= 0 && static_cast<std::size_t>(device) < sinks_.size() ? sinks_[static_cast<std::size_t>(device)].get()
                                                                          : nullptr;
}

std::vector<std::string> Tracing::paths() const {
  std::vector<std::string> p;
  for (auto& f : files_) p.push_back(f->path());
  return p;
}

std::uint64_t Tracing::dropped_records() const {
  std::uint64_t n = 0;
  for (auto& f : files_) n += f->dropped();
  return n;
}

std::string Tracing::losses() {
  for (auto& f : files_) f->check_removed_now();
  std::string out;
  for (auto& f : files_) {
    const std::string why = f->failure();
    if (why.empty()) continue;
    out += (out.empty() ? "fragless: " : "; ") + std::to_string(f->dropped()) + " trace records are missing from " +
           f->path() + ": " + why;
  }
  return out;
}

void Tracing::report_losses() {
  const std::string text = losses();  // asks each file whether it was removed first
  const std::uint64_t lost = dropped_records();
  if (lost == reported_ || text.empty()) return;
  reported_ = lost;
  std::fprintf(stderr, "%s\n", text.c_str());
}

}  // namespace fragless
