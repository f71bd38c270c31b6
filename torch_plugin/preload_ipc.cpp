// libfragless_preload.so, legacy CUDA IPC on fragless memory: cudaIpcGetMemHandle, cudaIpcOpenMemHandle,
// cudaIpcCloseMemHandle. Memory from cuMemCreate has no legacy IPC handle, so the runtime refuses fragless
// memory; when both processes run under the interposer, these calls share it through fragless's own sharing
// (DeviceEngine::share / open_shared, Note [Sharing] in engine/share.cpp), which needs shareable_handles:True.
//
// Note [Legacy IPC handles]
// cudaIpcGetMemHandle(&h, p) on fragless memory (p anywhere inside an allocation: the handle names the whole
// allocation, and cudaIpcOpenMemHandle returns its base, as CUDA's handle names the whole cudaMalloc
// allocation) exports a share of the allocation once and fills the 64 opaque bytes with: a magic and a
// version, the exporter's pid and a per-process random token (which together name its socket), the share's
// id and a random 128-bit nonce. Asked again for the same allocation it gives the same handle (CUDA's call may
// be repeated on an allocation harmlessly). Other pointers go to the runtime. As with CUDA's own handle, the
// 64 bytes are the capability: a process of the machine that has them may open the memory.
//
// The exporter serves its shares on a Unix socket in the abstract namespace, "fragless-ipc-<pid>-<token>",
// answered by a listener thread started with the first export (started before anything is committed: when it
// cannot start, the socket is closed and the call fails with cudaErrorMemoryAllocation). An abstract socket
// has no permissions, so the listener reads the peer's credentials (SO_PEERCRED) and answers its own user
// and root only. A request names a share id and its nonce; the answer is the share's description and
// descriptors (SCM_RIGHTS), or a refusal saying why. Each connection has one deadline (kAnswerDeadline, 3 s)
// for the whole exchange, and the wake pipe ends it at once at exit, so that a peer that stalls keeps the
// other importers that long at most and the exit not at all. It stops at exit (an atexit handler wakes and
// joins it). The descriptors kept for an export are close-on-exec (share() sets it on the driver's). A child
// made by fork does not inherit the listener nor the exports (their descriptors, copies of the leases, are
// closed in the child, so they do not hold the parent's blocks): the parent keeps serving its handles, and
// the child's first export starts a listener of its own, under its own pid.
//
// cudaIpcOpenMemHandle recognises fragless's handles by their magic (any other handle goes to the runtime),
// asks the exporter, and maps the share with open_shared on the current device. It asks only once the kernel
// has said who listens on the socket (SO_PEERCRED): the process the handle names, of this user or root (of
// any user when this process is root, which every exporter answers). An
// abstract name is free again when its process exits, so a process that took it (it may have read the name
// in /proc/net/unix) is refused before the request, and its nonce, is sent. The fetch has one deadline
// for the whole exchange (kFetchDeadline, 10 s: a peer that trickles cannot stretch it), every message of the
// answer must be exactly the size announced. The same handle opened again
// on the same device returns the same pointer and counts a reference (CUDA's rule for a handle the current
// context opened already); cudaIpcCloseMemHandle drops one, and the last unmaps (close_shared). The
// importer's records are not reset in a fork child (CUDA cannot be used there anyway).
//
// Locks. The importer's lock guards its records only: it is not held across a fetch, an open_shared or a
// close_shared (which synchronises the device). Two threads opening one handle at once both fetch and map;
// the first to record it wins and the other's mapping is dropped. The exporter's lock (x.mu) is not held
// across share() either: cudaIpcGetMemHandle shares first, then records the share unless another thread's
// won meanwhile or the allocation was freed (Note [Exports and frees]). Where both are held the order is the
// exports' lock, then an engine's lock (the allocation check), never the reverse; the listener and forget
// (every free while an export exists) take the exports' lock only, never across a blocking call.
//
// Note [Exports and frees]
// A free and an export of one allocation may race: cudaIpcGetMemHandle shares (share() marks the block
// exported, its lease open in the share) without x.mu, and only then records the share under x.mu. Every free
// first has the engine take it (DeviceEngine::free, or defer_free behind the fence: from then on the engine
// reports the block freed), and only then drops the allocation's export (forget_export, under x.mu). The
// recording checks, under x.mu, that the engine has not taken a free of the block; so either the free was
// taken first and the share is dropped (its lease closed, the block reaped: freed now if its owner freed it),
// or the share is recorded first and the free's forget_export, which comes after, finds it and drops it.
// Before, the free dropped the export first: a share recorded between the two (or a stream-ordered free,
// which left the block allocated and held) kept the block for the life of the process, its handle openable.
//
// Lifetime. cudaFree of an exported allocation drops the exporter's copy of the share at once (so its handle
// is refused from then on: stale), and the engine holds the block for every process that has it open, through
// the leases, until the last closes it: a free while another process holds the memory loses nothing (CUDA
// calls that case undefined). A handle whose exporter exited is refused (nobody answers, and open_shared
// refuses a lease whose engine end is gone).
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "fragless/allocator.h"
#include "fragless/share.h"
#include "fd_message.h"
#include "made_once.h"
#include "preload_core.h"

extern "C" {
typedef int cudaError_t;
}

namespace {

// cudaError_t values: cudaErrorInvalidValue, cudaErrorMemoryAllocation, cudaErrorMapBufferObjectFailed,
// cudaErrorInvalidResourceHandle.
constexpr cudaError_t kSuccess = 0, kInvalidValue = 1, kMemoryAllocation = 2, kMapFailed = 205,
                      kInvalidHandle = 400;

constexpr char kMagic[8] = {'F', 'R', 'G', 'L', 'I', 'P', 'C', '1'};
constexpr std::uint32_t kVersion = 1;

// The 64 bytes of a cudaIpcMemHandle_t that fragless fills.
struct Handle {
  char magic[8];
  std::uint32_t version;
  std::int32_t pid;           // the exporter
  std::uint64_t token;        // the exporter's random token: with pid, names its socket
  std::uint64_t id;           // the share, in the exporter
  std::uint8_t nonce[16];     // random per share: a forged or reused id is refused
  std::uint8_t unused[16];    // 0
};
static_assert(sizeof(Handle) == 64, "cudaIpcMemHandle_t is 64 bytes");

// A request: the share's id and nonce. The answer: a Reply, then the description in pieces of at most
// kPiece bytes, then the descriptors, at most kFdsPerMessage a message (SCM_RIGHTS carries at most 253).
struct Request {
  std::uint64_t id;
  std::uint8_t nonce[16];
};
struct Reply {
  std::uint32_t status;  // 0: the share follows; else why not, in `why`
  std::uint32_t fds;
  std::uint64_t description;  // bytes
  char why[200];
};
constexpr std::size_t kPiece = 32 << 10, kFdsPerMessage = fragless_fd::kMaxFds;

template <typename F>
F next(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

struct Real {
  cudaError_t (*get)(void*, void*) = next<decltype(get)>("cudaIpcGetMemHandle");
  cudaError_t (*open)(void**, Handle, unsigned) = next<decltype(open)>("cudaIpcOpenMemHandle");
  cudaError_t (*close)(void*) = next<decltype(close)>("cudaIpcCloseMemHandle");
  cudaError_t (*get_device)(int*) = next<decltype(get_device)>("cudaGetDevice");
};
const Real& real() {  // made_once: a fork may come while another thread makes it
  static std::atomic<const Real*> r{nullptr};
  static std::once_flag once;
  return fragless::made_once(r, once, [] { return new Real(); });  // never destroyed, as the interposer
}

// The users a process of this library deals with over the sockets (an abstract socket has no permissions): its
// own and root. The exporter's listener answers only them; the importer asks only them (unless it is root).
bool own_user_or_root(uid_t uid) { return uid == geteuid() || uid == 0; }

std::string socket_name(std::int32_t pid, std::uint64_t token) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "fragless-ipc-%d-%016llx", static_cast<int>(pid), static_cast<unsigned long long>(token));
  return buf;
}

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name.data(), name.size());  // sun_path[0] == 0: the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

bool random_bytes(void* p, std::size_t n) { return getrandom(p, n, 0) == static_cast<ssize_t>(n); }

bool send_part(int sock, const void* data, std::size_t n, const int* fds, std::size_t nfds) {
  return fragless_fd::send_message(sock, data, n, fds, nfds) == static_cast<ssize_t>(n ? n : 1);
}

void close_all(std::vector<int>* fds) {
  for (int fd : *fds) ::close(fd);
  fds->clear();
}

// Deadlines. A peer on the other end of a socket may be slow, stalled or hostile: each side gives a whole
// exchange one deadline (not one per message), so that nobody can keep it waiting longer by trickling.
using Clock = std::chrono::steady_clock;
constexpr std::chrono::seconds kFetchDeadline{10}, kAnswerDeadline{3};

// Waits until sock is ready for `events` (or its peer is gone) before the deadline; false when time ran out,
// or when stop_fd (when there is one) became readable.
bool ready_by(int sock, short events, Clock::time_point deadline, int stop_fd = -1) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p[2] = {{sock, events, 0}, {stop_fd, POLLIN, 0}};
    const int n = poll(p, stop_fd >= 0 ? 2 : 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
    if (n > 0) return !(stop_fd >= 0 && p[1].revents);  // else ready, or hung up or failed: the call that follows says
    if (n < 0 && errno != EINTR) return false;
  }
}

// Sends one message before the deadline on a non-blocking socket (send_part's rules).
bool send_by(int sock, Clock::time_point deadline, int stop_fd, const void* data, std::size_t n, const int* fds,
             std::size_t nfds) {
  for (;;) {
    if (send_part(sock, data, n, fds, nfds)) return true;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    if (!ready_by(sock, POLLOUT, deadline, stop_fd)) return false;
  }
}

// Receives one message of exactly n bytes and exactly nfds descriptors (appended to *fds) before the
// deadline. False otherwise (the descriptors that came are appended all the same, for the caller to close).
bool recv_exactly_by(int sock, Clock::time_point deadline, void* data, std::size_t n, std::vector<int>* fds,
                     std::size_t nfds, int stop_fd = -1) {
  const std::size_t had = fds->size();
  char byte;
  return ready_by(sock, POLLIN, deadline, stop_fd) &&
         fragless_fd::recv_message(sock, n ? data : &byte, n ? n : 1, fds, nfds ? nfds : 1) ==
             static_cast<ssize_t>(n ? n : 1) &&
         fds->size() - had == nfds;
}

// ---- The exporter -----------------------------------------------------------------------------------------

struct Export {
  int device;
  void* base;
  std::uint8_t nonce[16];
  fragless::SharedBlock share;
};

struct Exporter {
  std::mutex mu;  // guards everything below; never held across a blocking call
  std::map<std::uint64_t, Export> exports;                 // by id
  std::map<std::pair<int, void*>, std::uint64_t> by_block;  // (device, base) -> id
  std::uint64_t next_id = 1;
  std::int32_t pid = 0;      // the process the listener serves (0: none started)
  std::uint64_t token = 0;
  int listen_fd = -1, wake[2] = {-1, -1};
  std::thread thread;
  std::atomic<int> count{0};  // exports.size(), read without the lock by every free
  // The duplicates the listener is sending (a lease among them): a child forked meanwhile closes its copies.
  std::vector<int> sending;

  // Starts the listener if this process has none. False (and *why) when it could not.
  bool listening(std::string* why);
  void serve(int lfd, int stop_fd);
  void answer(int conn, int stop_fd);
  void stop();
  bool forget(int device, const void* p);
  void after_fork_in_child();
};

Exporter& exporter() {
  static Exporter* e = new Exporter();  // never destroyed: frees may come from static destructors
  return *e;
}

bool Exporter::listening(std::string* why) {
  if (pid == getpid()) return true;
  std::uint64_t t = 0;
  if (!random_bytes(&t, sizeof t)) {
    *why = std::string("getrandom: ") + std::strerror(errno);
    return false;
  }
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  int w[2] = {-1, -1};
  socklen_t len = 0;
  const sockaddr_un a = abstract_address(socket_name(getpid(), t), &len);
  if (fd < 0 || bind(fd, reinterpret_cast<const sockaddr*>(&a), len) != 0 || listen(fd, 64) != 0 ||
      pipe2(w, O_CLOEXEC) != 0) {
    *why = "the exporter's socket: " + std::string(std::strerror(errno));
    if (fd >= 0) ::close(fd);
    return false;
  }
  // The thread first: nothing is committed (and no exception leaves the C entry point) when it cannot start.
  try {
    thread = std::thread([this, fd, r = w[0]] { serve(fd, r); });
  } catch (const std::exception& e) {
    *why = std::string("the exporter's listener thread could not start: ") + e.what();
    for (int d : {fd, w[0], w[1]}) ::close(d);
    return false;
  }
  listen_fd = fd;
  wake[0] = w[0];
  wake[1] = w[1];
  token = t;
  pid = getpid();
  static const bool registered = [] {
    std::atexit([] { exporter().stop(); });
    pthread_atfork([] { exporter().mu.lock(); }, [] { exporter().mu.unlock(); },
                   [] { exporter().after_fork_in_child(); });
    return true;
  }();
  (void)registered;
  return true;
}

void Exporter::serve(int lfd, int stop_fd) {
  for (;;) {
    pollfd p[2] = {{lfd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "fragless (LD_PRELOAD): the IPC listener stops: poll: %s\n", std::strerror(errno));
      return;
    }
    if (p[1].revents) return;  // stop()
    const int conn = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      if (errno != EINTR && errno != ECONNABORTED) poll(nullptr, 0, 10);  // out of descriptors: no busy loop
      continue;
    }
    // An abstract socket has no permissions: the peer's credentials decide. Its user or root only.
    ucred peer{};
    socklen_t n = sizeof peer;
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &n) == 0 && own_user_or_root(peer.uid)) {
      answer(conn, stop_fd);
    } else {
      Reply r{1, 0, 0, {}};
      std::snprintf(r.why, sizeof r.why, "the exporter serves its own user and root only, not user %u",
                    static_cast<unsigned>(peer.uid));
      send_part(conn, &r, sizeof r, nullptr, 0);  // non-blocking: at most once
    }
    ::close(conn);
  }
}

// One deadline for the whole connection (kAnswerDeadline), and stop() (the exit) ends it at once: a peer that
// stalls or stops reading keeps the other importers and the exit waiting that long at most.
void Exporter::answer(int conn, int stop_fd) {
  const Clock::time_point deadline = Clock::now() + kAnswerDeadline;
  Request rq{};
  std::vector<int> none;
  Reply r{};
  auto refuse = [&](const std::string& why) {
    r.status = 1;
    std::snprintf(r.why, sizeof r.why, "%s", why.c_str());
    send_by(conn, deadline, stop_fd, &r, sizeof r, nullptr, 0);
  };
  if (!recv_exactly_by(conn, deadline, &rq, sizeof rq, &none, 0, stop_fd)) {
    close_all(&none);
    return refuse("the request is not a fragless IPC request");
  }
  close_all(&none);
  std::string description;
  std::vector<int> fds;  // duplicates, so that a free meanwhile cannot close them under the reply
  {
    std::lock_guard lk(mu);
    auto it = exports.find(rq.id);
    if (it == exports.end())
      return refuse("share " + std::to_string(rq.id) + " is not exported (its allocation was freed, or the handle is forged)");
    unsigned diff = 0;
    for (int i = 0; i < 16; ++i) diff |= it->second.nonce[i] ^ rq.nonce[i];
    if (diff) return refuse("the handle's nonce does not match share " + std::to_string(rq.id) + ": forged");
    description = it->second.share.description;
    for (int fd : it->second.share.fds) {
      const int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (d < 0) {
        close_all(&fds);
        return refuse(std::string("the exporter could not duplicate a descriptor: ") + std::strerror(errno));
      }
      fds.push_back(d);
    }
    sending = fds;
  }
  r.fds = static_cast<std::uint32_t>(fds.size());
  r.description = description.size();
  bool ok = send_by(conn, deadline, stop_fd, &r, sizeof r, nullptr, 0);
  for (std::size_t at = 0; ok && at < description.size(); at += kPiece)
    ok = send_by(conn, deadline, stop_fd, description.data() + at, std::min(kPiece, description.size() - at), nullptr, 0);
  for (std::size_t at = 0; ok && at < fds.size(); at += kFdsPerMessage)
    ok = send_by(conn, deadline, stop_fd, nullptr, 0, fds.data() + at, std::min(kFdsPerMessage, fds.size() - at));
  std::lock_guard lk(mu);
  sending.clear();
  close_all(&fds);
}

// At exit: the listener is woken (in a connection too: it polls the wake pipe there) and joined, and its socket closed, so that a handle asked for from now on
// is refused at once (nobody serves it) rather than left waiting.
void Exporter::stop() {
  if (pid != getpid() || !thread.joinable()) return;
  const char b = 1;
  if (write(wake[1], &b, 1) == 1) thread.join();
  else thread.detach();
  ::close(std::exchange(listen_fd, -1));
}

bool Exporter::forget(int device, const void* p) {
  if (count.load(std::memory_order_seq_cst) == 0) return false;  // none, and none being recorded (get_handle)
  std::lock_guard lk(mu);
  auto it = by_block.find({device, const_cast<void*>(p)});
  if (it == by_block.end()) return false;
  exports.erase(it->second);  // closes the exporter's copy of the share's descriptors
  by_block.erase(it);
  count.store(static_cast<int>(exports.size()), std::memory_order_release);
  return true;
}

// The child of a fork (single-threaded; mu is held, taken before the fork): the parent's listener and
// exports are the parent's. Their descriptors are closed here (copies of the leases would hold the parent's
// blocks), and so are the duplicates the listener was sending at the fork; the thread object is the parent's
// thread, which does not exist here, and is left unjoined.
void Exporter::after_fork_in_child() {
  for (auto& [id, e] : exports) e.share.close_fds();
  close_all(&sending);  // the listener's duplicates in flight at the fork (its thread is not here)
  exports.clear();
  by_block.clear();
  count.store(0);
  for (int* fd : {&listen_fd, &wake[0], &wake[1]})
    if (*fd >= 0) ::close(std::exchange(*fd, -1));
  if (thread.joinable()) new (&thread) std::thread();  // forget the parent's thread (no handle to join here)
  pid = 0;
  mu.unlock();
}

// The device whose engine holds p (its first byte or any inside it) and the allocation's base, and whether the
// program freed it already (*freed); -1 if none.
int containing(const void* p, void** base, bool* freed) {
  fragless::Allocator* a = fragless_preload::allocator();
  if (!a || !p) return -1;
  for (int d = 0; d < a->device_count(); ++d)
    if (fragless::DeviceEngine* e = a->existing(d))
      if ((*base = e->allocation_containing(const_cast<void*>(p), nullptr, freed))) return d;
  return -1;
}

cudaError_t get_handle(Handle* h, void* p) {
  void* base = nullptr;
  bool freed = false;
  const int dev = fragless_preload::recursing() ? -1 : containing(p, &base, &freed);
  if (dev < 0) return real().get ? real().get(h, p) : kInvalidValue;
  fragless_preload::Inside inside;
  fragless::Allocator* a = fragless_preload::allocator();
  if (freed) {
    std::fprintf(stderr, "fragless (LD_PRELOAD): cudaIpcGetMemHandle of %p: its allocation was freed (cudaFree); "
                 "nothing was exported\n", p);
    return kInvalidValue;
  }
  if (!a->options().shareable_handles) {
    std::fprintf(stderr,
                 "fragless (LD_PRELOAD): cudaIpcGetMemHandle of %p: fragless memory has a CUDA IPC handle only when "
                 "it is created shareable: set shareable_handles:True in FRAGLESS_CONF (in the exporting process); "
                 "cudaErrorInvalidValue returned, as the runtime does for memory it cannot export\n",
                 p);
    return kInvalidValue;
  }
  Exporter& x = exporter();
  // A handle names the pid and token of the listener, the share's id and its nonce.
  auto fill = [&](std::uint64_t id, const Export& e) {  // under x.mu
    Handle out{};
    std::memcpy(out.magic, kMagic, sizeof kMagic);
    out.version = kVersion;
    out.pid = x.pid;
    out.token = x.token;
    out.id = id;
    std::memcpy(out.nonce, e.nonce, sizeof out.nonce);
    std::memcpy(h, &out, sizeof out);
  };
  auto exported_already = [&] {  // under x.mu
    auto known = x.by_block.find({dev, base});
    if (x.pid != getpid() || known == x.by_block.end()) return false;
    fill(known->second, x.exports.at(known->second));
    return true;
  };
  if (std::lock_guard lk(x.mu); exported_already()) return kSuccess;
  // Shared without x.mu (share takes the engine's lock and calls the driver; the listener and every free of an
  // exported allocation wait on x.mu): a thread that exported the same allocation meanwhile wins, and this
  // share is dropped. The lock order is x.mu, then an engine's lock, never the reverse.
  Export e{dev, base, {}, {}};
  fragless::AllocError err;
  if (!random_bytes(e.nonce, sizeof e.nonce)) {
    std::fprintf(stderr, "fragless (LD_PRELOAD): cudaIpcGetMemHandle of %p: getrandom: %s\n", p, std::strerror(errno));
    return kMemoryAllocation;
  }
  if (a->device(dev)->share(base, &e.share, &err) != fragless::Status::ok) {
    std::fprintf(stderr, "fragless (LD_PRELOAD): cudaIpcGetMemHandle of %p: %s\n", p, err.message.c_str());
    return err.status == fragless::Status::invalid_argument ? kInvalidValue : kMapFailed;
  }
  std::lock_guard lk(x.mu);
  std::string why;
  if (!x.listening(&why)) {
    std::fprintf(stderr, "fragless (LD_PRELOAD): cudaIpcGetMemHandle of %p: %s; nothing was exported\n", p, why.c_str());
    return kMemoryAllocation;
  }
  if (exported_already()) return kSuccess;  // e, the duplicate, is dropped
  // Note [Exports and frees]: a free the engine took before this check finds no export to forget: e is
  // dropped here, its lease closed, and the block reaped (freed now if its owner freed it while it was held).
  // The count covers the export about to be recorded from before the check: a free taken after the check
  // then finds it non-zero and waits for x.mu (forget's fast path would otherwise miss the record).
  x.count.store(static_cast<int>(x.exports.size()) + 1, std::memory_order_seq_cst);
  if (a->device(dev)->allocation_containing(base, nullptr, &freed) != base || freed) {
    x.count.store(static_cast<int>(x.exports.size()), std::memory_order_release);
    std::fprintf(stderr, "fragless (LD_PRELOAD): cudaIpcGetMemHandle of %p: its allocation was freed meanwhile; "
                 "nothing was exported\n", p);
    e.share.close_fds();
    a->device(dev)->reap_shared(0);
    return kInvalidValue;
  }
  const std::uint64_t id = x.next_id++;
  fill(id, x.exports.emplace(id, std::move(e)).first->second);
  x.by_block.emplace(std::pair{dev, base}, id);
  x.count.store(static_cast<int>(x.exports.size()), std::memory_order_release);
  return kSuccess;
}

// ---- The importer -----------------------------------------------------------------------------------------

struct Opened {
  void* ptr;
  int device;
  int refs;
};

struct Importer {
  std::mutex mu;  // guards both maps; never held across a fetch, an open_shared or a close_shared
  std::map<std::tuple<int, std::int32_t, std::uint64_t, std::uint64_t>, Opened> by_handle;  // device, pid, token, id
  std::map<void*, decltype(by_handle)::key_type> by_ptr;
};

Importer& importer() {
  static Importer* i = new Importer();
  return *i;
}

// Why the listener at the other end of `sock` is not the exporter process `pid` (empty when it is). The
// socket's name is no proof: an abstract name is free again once its process exits, and any process may then
// take it, so the kernel's word is asked (SO_PEERCRED: who listened). It must be the process the handle names.
// Its user is checked as the exporter checks its peers' (its listener answers its own user and root): this
// process's user or root; a root importer takes an exporter of any user, as that exporter answers root. The
// kernel reports pid 0 for a listener in a pid namespace it cannot name here; then the user alone is checked,
// and must be this process's or root.
std::string not_the_exporter(int sock, std::int32_t pid) {
  ucred peer{};
  socklen_t n = sizeof peer;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &peer, &n) != 0)
    return std::string("who serves its exporter's socket cannot be told (SO_PEERCRED: ") + std::strerror(errno) + ")";
  if (peer.pid != 0 && peer.pid != pid)
    return "process " + std::to_string(peer.pid) + " serves its exporter's socket, not the exporting process " +
           std::to_string(pid) + " (which exited, and another process took its socket's name): stale; nothing was "
           "sent to it";
  if (!own_user_or_root(peer.uid) && (peer.pid == 0 || geteuid() != 0))
    return "the process serving its exporter's socket runs as user " + std::to_string(peer.uid) +
           ", neither this process's user (" + std::to_string(geteuid()) + ") nor root: nothing was sent to it";
  return {};
}

// Asks the exporter named by h for its share: the description and descriptors, or why not. The whole
// exchange has one deadline (kFetchDeadline), and every message must be exactly the size announced.
std::string fetch(const Handle& h, std::string* description, std::vector<int>* fds) {
  const Clock::time_point deadline = Clock::now() + kFetchDeadline;
  const std::string name = socket_name(h.pid, h.token);
  const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (sock < 0) return std::string("socket: ") + std::strerror(errno);
  timeval tv{static_cast<time_t>(kFetchDeadline.count()), 0};  // connect and send: within the deadline too
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  socklen_t len = 0;
  const sockaddr_un a = abstract_address(name, &len);
  std::string why;
  Request rq{h.id, {}};
  std::memcpy(rq.nonce, h.nonce, sizeof rq.nonce);
  Reply r{};
  const std::string late = "the exporter did not answer in full within " + std::to_string(kFetchDeadline.count()) +
                           " s, or its answer is malformed";
  if (connect(sock, reinterpret_cast<const sockaddr*>(&a), len) != 0)
    why = "nobody serves it (" + std::string(std::strerror(errno)) + "): the exporting process " + std::to_string(h.pid) +
          " exited, or the handle is forged: stale";
  else if (std::string who = not_the_exporter(sock, h.pid); !who.empty())
    why = who;  // asked nothing: the request (its nonce) goes to the exporter only
  else if (!send_part(sock, &rq, sizeof rq, nullptr, 0) || !recv_exactly_by(sock, deadline, &r, sizeof r, fds, 0))
    why = late;
  else if (r.status != 0)
    why = "the exporter refused it: " + std::string(r.why, strnlen(r.why, sizeof r.why));
  else if (r.description > (std::uint64_t{1} << 30) || r.fds > (1u << 21))
    why = "the exporter's answer is malformed";
  description->clear();  // grown as the pieces come, not as announced
  for (std::uint64_t rest = why.empty() ? r.description : 0; rest > 0;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kPiece, rest)), at = description->size();
    description->resize(at + n);
    if (!recv_exactly_by(sock, deadline, description->data() + at, n, fds, 0)) {
      why = late;
      break;
    }
    rest -= n;
  }
  for (std::size_t rest = why.empty() ? r.fds : 0; rest > 0;) {
    const std::size_t n = std::min(kFdsPerMessage, rest);
    if (!recv_exactly_by(sock, deadline, nullptr, 0, fds, n)) {
      why = late;
      break;
    }
    rest -= n;
  }
  ::close(sock);
  if (!why.empty()) close_all(fds);
  return why;
}

cudaError_t open_handle(void** out, const Handle& h, unsigned flags) {
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0)
    return real().open ? real().open(out, h, flags) : kInvalidValue;  // not fragless's: the runtime's
  // `mapped_said`: the reason (open_shared's message) says already that nothing was mapped.
  auto refuse = [&](cudaError_t code, const std::string& why, bool mapped_said = false) {
    std::fprintf(stderr, "fragless (LD_PRELOAD): cudaIpcOpenMemHandle refused a fragless handle (process %d, share %llu): %s%s\n",
                 static_cast<int>(h.pid), static_cast<unsigned long long>(h.id), why.c_str(),
                 mapped_said ? "" : "; nothing was mapped");
    *out = nullptr;
    return code;
  };
  if (flags & ~1u)  // cudaIpcMemLazyEnablePeerAccess is the only flag
    return refuse(kInvalidValue, "flags " + std::to_string(flags) + " are not cudaIpcMemLazyEnablePeerAccess (1)");
  if (h.version != kVersion)
    return refuse(kInvalidHandle, "it is version " + std::to_string(h.version) + ", this fragless reads " + std::to_string(kVersion));
  for (std::uint8_t b : h.unused)
    if (b) return refuse(kInvalidHandle, "its reserved bytes are not zero: forged");
  fragless::Allocator* a = fragless_preload::allocator();
  if (!a) return refuse(kInvalidValue, "fragless is off in this process (see the error above)");
  int dev = 0;
  if (real().get_device) real().get_device(&dev);
  fragless_preload::Inside inside;
  fragless::DeviceEngine* e = a->device(dev);
  if (!e) return refuse(kInvalidValue, "device " + std::to_string(dev) + " has no fragless engine");
  Importer& im = importer();
  const auto key = std::tuple{dev, h.pid, h.token, h.id};
  auto opened_already = [&] {  // under im.mu
    auto it = im.by_handle.find(key);
    if (it == im.by_handle.end()) return false;
    ++it->second.refs;  // opened already in this process, on this device: the same pointer, one more reference
    *out = it->second.ptr;
    return true;
  };
  if (std::lock_guard lk(im.mu); opened_already()) return kSuccess;
  // Fetched and mapped without the lock (a slow exporter keeps nobody else waiting); a thread that opened the
  // same handle meanwhile wins, and this mapping is dropped.
  std::string description;
  std::vector<int> fds;
  if (std::string why = fetch(h, &description, &fds); !why.empty()) return refuse(kInvalidHandle, why);
  fragless::AllocError err;
  void* p = e->open_shared(description, fds.data(), fds.size(), nullptr, &err);
  close_all(&fds);  // open_shared keeps what it needs
  if (!p) return refuse(err.status == fragless::Status::invalid_argument ? kInvalidHandle : kMapFailed, err.message, true);
  {
    std::lock_guard lk(im.mu);
    if (!opened_already()) {
      im.by_handle.emplace(key, Opened{p, dev, 1});
      im.by_ptr.emplace(p, key);
      *out = p;
      return kSuccess;
    }
  }
  if (e->close_shared(p, &err) != fragless::Status::ok)
    std::fprintf(stderr, "fragless (LD_PRELOAD): cudaIpcOpenMemHandle: the second mapping of a handle two threads "
                 "opened at once stays mapped: %s\n", err.message.c_str());
  return kSuccess;
}

cudaError_t close_handle(void* p) {
  Importer& im = importer();
  std::unique_lock lk(im.mu);
  auto at = im.by_ptr.find(p);
  if (at == im.by_ptr.end()) {
    lk.unlock();
    return real().close ? real().close(p) : kInvalidValue;  // not opened by fragless: the runtime's
  }
  const auto key = at->second;
  Opened o = im.by_handle.at(key);
  if (--im.by_handle.at(key).refs > 0) return kSuccess;
  im.by_handle.erase(key);  // the last reference: unmapped without the lock (close_shared synchronises)
  im.by_ptr.erase(at);
  lk.unlock();
  fragless_preload::Inside inside;
  fragless::AllocError err;
  if (fragless_preload::allocator()->device(o.device)->close_shared(p, &err) == fragless::Status::ok) return kSuccess;
  std::fprintf(stderr, "fragless (LD_PRELOAD): cudaIpcCloseMemHandle of %p: %s\n", p, err.message.c_str());
  lk.lock();  // still mapped (Note [Failed waits]): the reference stays, unless the handle was opened anew meanwhile
  if (im.by_handle.emplace(key, o).second) im.by_ptr.emplace(p, key);
  return kInvalidValue;
}

}  // namespace

bool fragless_preload::forget_export(int device, const void* p) { return exporter().forget(device, p); }

extern "C" {

#define FRAGLESS_EXPORT __attribute__((visibility("default")))

FRAGLESS_EXPORT cudaError_t cudaIpcGetMemHandle(void* handle, void* p) {
  if (!handle) return kInvalidValue;
  return get_handle(static_cast<Handle*>(handle), p);
}

FRAGLESS_EXPORT cudaError_t cudaIpcOpenMemHandle(void** p, Handle handle, unsigned flags) {
  if (!p) return kInvalidValue;
  return open_handle(p, handle, flags);
}

FRAGLESS_EXPORT cudaError_t cudaIpcCloseMemHandle(void* p) { return close_handle(p); }

}  // extern "C"
