// Sharing blocks across processes: share, open_shared, close_shared (engine.h).
//
// Note [Sharing]
// A live block's physical memory is a list of whole handles mapped at offsets of one segment (driver.h, R5:
// a mapping is a whole handle); the handles under a block may reach beyond it (a 2 MiB page shared with
// neighbours, a multi-page handle), so what is exported is the span of those handles and the block's place
// in it. The other process reserves exactly the span (no more: nothing ever grows there), maps each handle
// whole at its offset, sets access for its device and hands out the span's base plus the block's offset.
//
// Lifetime. The exporter must not re-back, lend or reuse the pages under the block while anyone has it open,
// across process death too. A reference count kept by hand would be lost with a process that dies, so the
// kernel keeps it: each share makes a lease, a pair of connected sockets. The exporting engine keeps one
// end; the other travels with the share, and every process that opens the block holds a copy of it until
// it closes the block (or dies: the kernel closes its descriptors). When no copy of the travelling end is
// left anywhere, the engine's end reports a hang-up. Until then the block stays allocated in the engine's
// books, so no policy can touch the handles under it (they are never under a free block), and its owner's
// free is only recorded (owner_freed); the free is done when the last lease hangs up, found by polling the
// leases on slow allocations, empty_cache, stats and reap_shared. A copy on its way (an SCM_RIGHTS message
// not yet received, multiprocessing's resource sharer) counts as open.
//
// Forged and stale descriptions. The description names the exporter's process, a random token and, per
// handle, its size and the identity (device, inode) of the file its descriptor names; the engine's end of
// the lease sends the whole description down the lease once, and only the exporter can write there.
// open_shared refuses, leaving nothing mapped: a description that does not parse or whose sizes do not add
// up; a lease that is not such a socket, whose peer is another process, or that does not carry this very
// description (altered on its way, or another share's lease); a lease whose engine end is gone (the
// exporting process exited: its block may be reused by now); a handle descriptor that names other memory
// than the description's, or that the driver does not accept at the size described (R19).
//
// Fabric handles (shareable_handles:fabric, driver.h R26). Each handle's CUmemFabricHandle travels inside the
// description (its entry), so the lease is the only descriptor; the lease's copy of the description covers
// the handles' bytes too (altered bytes are refused as a forged description), and the driver refuses bytes
// that name no exported memory. The lifetime rule stays the lease's: a fabric share opens only where the
// lease can go (a process of the same machine); across nodes the lease would need a transport of its own.
#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "state/engine_state.h"
#include "fragless/engine.h"

namespace fragless {

SharedBlock& SharedBlock::operator=(SharedBlock&& o) noexcept {
  if (this != &o) {
    close_fds();
    description = std::move(o.description);
    fds = std::move(o.fds);
    o.fds.clear();
  }
  return *this;
}

void SharedBlock::close_fds() {
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
  fds.clear();
}

namespace {

constexpr char kMagic[8] = {'F', 'R', 'G', 'L', 'S', 'H', 'R', '1'};
constexpr std::uint32_t kMaxHandles = 1u << 20;

// The description's fixed part; then one HandleEntry per handle, in address order.
struct Header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t handles;
  std::int32_t device;
  std::int32_t pid;          // the exporting process
  std::uint32_t flags;       // kFlagSmallPool, kFlagFabric
  std::uint32_t unused;      // 0
  std::uint64_t token;       // random: two shares' descriptions always differ
  std::uint64_t granularity;
  std::uint64_t span;        // sum of the handles' sizes
  std::uint64_t offset;      // the block, inside the span
  std::uint64_t size;
};

constexpr std::uint32_t kVersion = 2;
constexpr std::uint32_t kFlagSmallPool = 1;  // the block is in the exporter's small pool (imported_bytes' pool)
constexpr std::uint32_t kFlagFabric = 2;     // the handles travel as fabric handles (R26), not descriptors

// One handle: its size and the identity of the file its descriptor names (fstat), so that a descriptor of
// other memory in its place is refused; or, for fabric handles, the handle itself (no descriptor travels).
struct HandleEntry {
  std::uint64_t size;
  std::uint64_t dev, ino;
  FabricHandle fabric;  // zero unless kFlagFabric
};

// The identity of the file behind fd (0, 0 when there is none).
std::pair<std::uint64_t, std::uint64_t> identity(int fd) {
  struct stat st{};
  if (fstat(fd, &st) != 0) return {0, 0};
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

// A whole handle under a block: where it is mapped and its size.
struct Piece {
  DevicePtr va;
  PhysHandle handle;
  std::size_t size;
};

// The whole handles under block b, in address order (they tile the span: adjacent mappings).
std::vector<Piece> pieces_under(Driver& d, const Block& b) {
  const Segment& seg = *b.segment;
  std::vector<Piece> out;
  std::size_t i = (b.ptr - seg.base) / seg.page_size;
  const std::size_t last = (b.ptr + b.size - 1 - seg.base) / seg.page_size;
  while (i <= last) {
    const PageRef r = seg.pages[i];
    const DevicePtr va = seg.base + i * seg.page_size - r.offset;
    const std::size_t size = d.mapping_size(va);
    out.push_back(Piece{va, r.handle, size});
    i = (va + size - seg.base + seg.page_size - 1) / seg.page_size;
  }
  return out;
}

bool lease_hung_up(int fd, int timeout_ms) {
  pollfd p{fd, 0, 0};
  return poll(&p, 1, timeout_ms) > 0 && (p.revents & (POLLHUP | POLLERR)) != 0;
}

// Why `fd` is not the lease of the share `desc` describes (exported by process `pid`), or empty when it is.
// The engine's end of a lease sent the description down it once, so a description altered on its way, or
// another share's lease, does not match.
std::string check_lease(int fd, const std::string& desc, std::int32_t pid) {
  int type = 0;
  socklen_t len = sizeof type;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_SEQPACKET)
    return "its lease (descriptor 0) is not a share's lease socket: forged";
  ucred cred{};
  len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid != pid)
    return "its lease belongs to process " + std::to_string(cred.pid) + ", not to the exporter " +
           std::to_string(pid) + ": forged";
  if (lease_hung_up(fd, 0))
    return "stale: the exporting process (" + std::to_string(pid) + ") closed the share or exited, and the "
           "block may have been reused";
  std::string m(desc.size() + 1, '\0');
  const ssize_t n = recv(fd, m.data(), m.size(), MSG_PEEK | MSG_DONTWAIT | MSG_TRUNC);
  if (n != static_cast<ssize_t>(desc.size()) || std::memcmp(m.data(), desc.data(), desc.size()) != 0)
    return "the description is not the one its lease carries (altered, or another share's lease): forged";
  return {};
}

// Parses a description; empty on success, else why it is refused. `handles` gets each handle's entry (size,
// device, inode, fabric handle).
std::string parse(const std::string& desc, std::size_t nfds, std::size_t granularity, Header* h,
                  std::vector<HandleEntry>* handles) {
  if (desc.size() < sizeof(Header)) return "the description is " + std::to_string(desc.size()) + " bytes: too short";
  std::memcpy(h, desc.data(), sizeof *h);
  if (std::memcmp(h->magic, kMagic, sizeof kMagic) != 0) return "the description is not a fragless share's";
  if (h->version != kVersion)
    return "the description is version " + std::to_string(h->version) + "; this fragless reads " + std::to_string(kVersion);
  if ((h->flags & ~(kFlagSmallPool | kFlagFabric)) != 0 || h->unused != 0) return "the description has unknown flags";
  const bool fabric = (h->flags & kFlagFabric) != 0;
  if (h->handles == 0 || h->handles > kMaxHandles) return "the description names " + std::to_string(h->handles) + " handles";
  if (desc.size() != sizeof(Header) + h->handles * sizeof(HandleEntry))
    return "the description's length does not match its " + std::to_string(h->handles) + " handles";
  if (nfds != (fabric ? 1 : h->handles + 1))
    return std::to_string(nfds) + " descriptors came with a description of " + std::to_string(h->handles) +
           (fabric ? " fabric handles (the lease alone expected)" : " handles (the lease and one per handle expected)");
  if (h->granularity != granularity)
    return "exported with granularity " + std::to_string(h->granularity) + ", this device's is " +
           std::to_string(granularity);
  handles->resize(h->handles);
  std::memcpy(handles->data(), desc.data() + sizeof(Header), h->handles * sizeof(HandleEntry));
  std::uint64_t sum = 0;
  for (const HandleEntry& e : *handles) {
    if (e.size == 0 || e.size % granularity != 0 || e.size > (1ull << 50))
      return "a handle's size is not a multiple of the granularity";
    sum += e.size;
  }
  if (sum != h->span) return "the handles' sizes do not add up to the span described";
  if (h->size == 0 || h->offset > h->span || h->size > h->span - h->offset)
    return "the block does not lie inside the span described";
  return {};
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Exporting

Status DeviceEngine::share(void* ptr, SharedBlock* out, AllocError* err) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  Block* b = s.active_blocks.get(reinterpret_cast<DevicePtr>(ptr));
  if (!b || b->state != BlockState::allocated || b->deferred || (b->exported && s.exports.at(b->ptr).owner_freed)) {
    set_error(err, Status::invalid_argument,
              "fragless: share of pointer " + hex(ptr) + " on device " + std::to_string(s.driver->device()) +
                  ", which is not the start of a live fragless allocation; nothing was shared");
    return Status::invalid_argument;
  }
  const std::vector<Piece> pieces = pieces_under(*s.driver, *b);
  const bool fabric = s.driver->fabric_handles();
  SharedBlock sb;
  sb.fds.push_back(-1);  // the lease, below
  std::vector<FabricHandle> fabrics(fabric ? pieces.size() : 0);
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    int fd = -1;
    const Status st = fabric ? s.driver->export_handle(pieces[i].handle, &fabrics[i])
                             : s.driver->export_handle(pieces[i].handle, &fd);
    if (st != Status::ok) {
      set_error(err, st, "fragless: share of " + hex(ptr) + ": " + s.driver->last_error());
      return st;
    }
    if (fabric) continue;
    sb.fds.push_back(fd);
    fcntl(fd, F_SETFD, FD_CLOEXEC);  // kept for the share: never passed on to a program this process execs
  }
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) {
    set_error(err, Status::driver_error, std::string("fragless: share: socketpair: ") + std::strerror(errno));
    return Status::driver_error;
  }
  sb.fds[0] = pair[1];
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kVersion;
  h.flags = (b->pool->small ? kFlagSmallPool : 0) | (fabric ? kFlagFabric : 0);
  h.handles = static_cast<std::uint32_t>(pieces.size());
  h.device = s.driver->device();
  h.pid = static_cast<std::int32_t>(getpid());
  if (getrandom(&h.token, sizeof h.token, 0) != static_cast<ssize_t>(sizeof h.token)) h.token ^= reinterpret_cast<std::uintptr_t>(&h);
  h.granularity = s.driver->granularity();
  h.span = pieces.back().va + pieces.back().size - pieces.front().va;
  h.offset = b->ptr - pieces.front().va;
  h.size = b->size;
  sb.description.assign(reinterpret_cast<const char*>(&h), sizeof h);
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const auto [dev, ino] = fabric ? std::pair<std::uint64_t, std::uint64_t>{} : identity(sb.fds[i + 1]);
    const HandleEntry e{pieces[i].size, dev, ino, fabric ? fabrics[i] : FabricHandle{}};
    sb.description.append(reinterpret_cast<const char*>(&e), sizeof e);
  }
  if (send(pair[0], sb.description.data(), sb.description.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sb.description.size())) {
    ::close(pair[0]);
    set_error(err, Status::driver_error, std::string("fragless: share: send: ") + std::strerror(errno));
    return Status::driver_error;
  }
  State::Export& e = s.exports[b->ptr];
  if (e.span == 0) {
    e.span = h.span;
    s.stats.exported_bytes.add(b->pool->small, static_cast<std::int64_t>(h.span));
  }
  e.leases.push_back(pair[0]);
  b->exported = true;
  *out = std::move(sb);
  return Status::ok;
}

Status DeviceEngine::State::free_exported(Block* b, AllocError* err) {
  if (exports.at(b->ptr).owner_freed) {
    set_error(err, Status::invalid_argument,
              "fragless: free of pointer " + hex(reinterpret_cast<void*>(b->ptr)) +
                  " that was already freed (it is held for the processes that opened it); nothing was changed");
    return Status::invalid_argument;
  }
  exports.at(b->ptr).owner_freed = true;
  reap_exports();  // frees it now when no lease is open
  return Status::ok;
}

std::size_t DeviceEngine::State::reap_exports(int waited_us) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(waited_us);
  std::size_t freed = 0;
  for (;;) {
    for (auto it = exports.begin(); it != exports.end();) {
      Export& e = it->second;
      std::erase_if(e.leases, [](int fd) {
        if (!lease_hung_up(fd, 0)) return false;
        ::close(fd);
        return true;
      });
      if (e.held()) {
        ++it;
        continue;
      }
      auto next = std::next(it);
      freed += release_if_unheld(it);
      it = next;
    }
    if (freed || exports.empty() || std::chrono::steady_clock::now() >= deadline) return freed;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool DeviceEngine::State::release_if_unheld(std::unordered_map<DevicePtr, Export>::iterator it) {
  if (it->second.held()) return false;
  Block* b = active_blocks.get(it->first);
  b->exported = false;
  stats.exported_bytes.add(b->pool->small, -static_cast<std::int64_t>(it->second.span));
  const bool freed_by_owner = it->second.owner_freed;
  exports.erase(it);
  if (freed_by_owner) free_live(b);
  return freed_by_owner;
}

std::size_t DeviceEngine::reap_shared(int wait_us) {
  std::lock_guard lk(s_->mu);
  return s_->exports.empty() ? 0 : s_->reap_exports(wait_us);
}

// ---------------------------------------------------------------------------------------------------------
// Importing

void* DeviceEngine::open_shared(const std::string& desc, const int* fds, std::size_t nfds, std::size_t* size,
                                AllocError* err) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  Driver& d = *s.driver;
  auto refuse = [&](Status st, const std::string& why) -> void* {
    set_error(err, st, "fragless: open_shared on device " + std::to_string(d.device()) + " refused: " + why +
                           "; nothing was mapped");
    return nullptr;
  };
  Header h{};
  std::vector<HandleEntry> handles;
  if (!fds && nfds) return refuse(Status::invalid_argument, "no descriptors");
  if (std::string why = parse(desc, nfds, d.granularity(), &h, &handles); !why.empty())
    return refuse(Status::invalid_argument, why);
  if (std::string why = check_lease(fds[0], desc, h.pid); !why.empty()) return refuse(Status::invalid_argument, why);
  const bool fabric = (h.flags & kFlagFabric) != 0;
  for (std::size_t i = 0; i < handles.size() && !fabric; ++i)
    if (identity(fds[i + 1]) != std::pair{handles[i].dev, handles[i].ino})
      return refuse(Status::invalid_argument,
                    "descriptor " + std::to_string(i + 1) + " is not the memory the share describes: forged");
  DevicePtr va = 0;
  if (Status st = d.reserve(h.span, &va); st != Status::ok) return refuse(st, d.last_error());
  // Each handle imported, mapped whole at its offset and released at once (its mapping keeps it, R8).
  std::size_t mapped = 0;
  std::string failure;
  Status failed = Status::ok;
  for (std::size_t i = 0; i < handles.size() && failed == Status::ok; ++i) {
    PhysHandle ph = 0;
    const std::size_t hsize = handles[i].size;
    failed = fabric ? d.import_handle(handles[i].fabric, hsize, &ph) : d.import_handle(fds[i + 1], hsize, &ph);
    if (failed != Status::ok) {
      failure = "handle " + std::to_string(i) + ": " + d.last_error();
      break;
    }
    failed = d.map(va + mapped, hsize, ph, 0);
    if (failed != Status::ok) failure = "handle " + std::to_string(i) + ": " + d.last_error();
    s.give_back_handle(ph);
    if (failed == Status::ok) mapped += hsize;
  }
  if (failed == Status::ok && (failed = d.set_access(va, h.span)) != Status::ok) failure = d.last_error();
  const int lease = failed == Status::ok ? fcntl(fds[0], F_DUPFD_CLOEXEC, 0) : -1;
  if (failed == Status::ok && lease < 0) {
    failed = Status::driver_error;
    failure = std::string("dup of the lease: ") + std::strerror(errno);
  }
  if (failed != Status::ok) {
    if (mapped) s.give_back_mapping(va, mapped);
    s.give_back_reservation(va, h.span);
    return refuse(failed, failure);
  }
  const DevicePtr p = va + h.offset;
  const bool small = (h.flags & kFlagSmallPool) != 0;
  s.imports[p] = State::Import{va, h.span, h.size, lease, h.pid, small};
  s.stats.imported_bytes.add(small, static_cast<std::int64_t>(h.span));
  if (size) *size = h.size;
  return reinterpret_cast<void*>(p);
}

Status DeviceEngine::close_shared(void* ptr, AllocError* err) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  auto it = s.imports.find(reinterpret_cast<DevicePtr>(ptr));
  if (it == s.imports.end()) {
    set_error(err, Status::invalid_argument,
              "fragless: close_shared of pointer " + hex(ptr) + " on device " + std::to_string(s.driver->device()) +
                  ", which open_shared did not return (or was closed already); nothing was changed");
    return Status::invalid_argument;
  }
  if (s.capturing()) {  // Note [Capture rules]: nothing is unmapped while a capture may be under way
    set_error(err, Status::invalid_argument,
              "fragless: close_shared of " + hex(ptr) + " while a CUDA graph capture may be under way on device " +
                  std::to_string(s.driver->device()) + "; close it after the capture");
    return Status::invalid_argument;
  }
  // The work that used the memory may be on any stream (R13, R17): it is done before the unmap.
  if (!s.synchronize_device()) {
    set_error(err, Status::driver_error, std::move(s.wait_error));  // Note [Failed waits]: still mapped
    s.wait_error.clear();
    return Status::driver_error;
  }
  const State::Import im = it->second;
  s.imports.erase(it);
  s.give_back_mapping(im.va, im.span);
  s.give_back_reservation(im.va, im.span);
  if (im.lease >= 0) ::close(im.lease);  // none in a forked child (Note [Imports across fork])
  s.stats.imported_bytes.add(im.small, -static_cast<std::int64_t>(im.span));
  return Status::ok;
}

// Note [Imports across fork]
// A process that opened other processes' memory and then forks (a DataLoader's workers, by default) gives the
// child a copy of every import's lease; each copy holds the exporter's block, so the parent's close_shared
// would no longer reach the exporter and the block would stay held until every such child exited. The engine
// registers with fork() (hold_across_fork_first, from its construction) and the child closes its copies: a
// child cannot use the parent's CUDA memory anyway, and its mappings, kept, hold nothing in the exporter.
// The child runs this on its one thread, the parent's device locks released (or held by itself, forked from
// an event sink): the books are read without the lock. A close_shared in the child closes no lease again.
void DeviceEngine::State::imports_in_forked_child(void* state) {
  for (auto& [p, im] : static_cast<State*>(state)->imports)
    if (im.lease >= 0) ::close(std::exchange(im.lease, -1));
}

std::string DeviceEngine::State::imported_free_message(void* ptr) const {
  return "fragless: free of pointer " + hex(ptr) + ", which open_shared mapped from another process; close it "
         "with close_shared; nothing was changed";
}

void DeviceEngine::State::close_all_shares() {
  for (auto& [p, im] : imports) {
    give_back_mapping(im.va, im.span);
    give_back_reservation(im.va, im.span);
    if (im.lease >= 0) ::close(im.lease);
  }
  imports.clear();
  for (auto& [p, e] : exports)
    for (int fd : e.leases) ::close(fd);
  exports.clear();
}

std::string DeviceEngine::State::check_sharing() const {
  StatArray exported, imported;  // recounts, per pool
  for (const auto& [p, e] : exports) {
    const Block* b = active_blocks.get(p);
    if (!b || !b->exported || b->state != BlockState::allocated)
      return "sharing: an exported block is not an allocated block marked exported";
    if (!e.held()) return "sharing: a listed block has no lease and no registration";
    exported.add(b->pool->small, static_cast<std::int64_t>(e.span));
  }
  std::size_t marked = 0;
  active_blocks.for_each([&](DevicePtr, Block* b) { marked += b->exported; });
  if (marked != exports.size()) return "sharing: a block is marked exported but not listed";
  for (const auto& [p, im] : imports) imported.add(im.small, static_cast<std::int64_t>(im.span));
  for (int k : {kAllPools, kSmallPool, kLargePool}) {
    if (exported.by_pool[k].current != stats.exported_bytes.by_pool[k].current)
      return "sharing: exported bytes differ from recount";
    if (imported.by_pool[k].current != stats.imported_bytes.by_pool[k].current)
      return "sharing: imported bytes differ from recount";
  }
  return {};
}

void DeviceEngine::State::describe_hold(const Block& b, BlockInfo* out) const {
  const Export& e = exports.at(b.ptr);
  out->held = true;
  out->owner_freed = e.owner_freed;
  out->exported_bytes = e.span;
  out->leases = e.leases.size();
  out->registrations = e.registrations;
}

// ---------------------------------------------------------------------------------------------------------
// Registered ranges
//
// Note [Registered ranges]
// NCCL's user-buffer registration (ncclCommRegister) binds an address range to the physical memory under it
// at that moment; re-backing the range (fragless's reclaim or lending, a split into pages, a release and a
// new handle) behind NCCL's back would make collectives read and write memory the range no longer has. The
// engine re-backs only memory under free blocks, so a registered range is held as a shared block is: its
// block stays allocated, whatever its owner frees, until every registration of it is deregistered. The
// program calls register_range right after ncclCommRegister and deregister_range right after
// ncclCommDeregister (docs/PYTORCH.md, "Sharing across processes"); a range must lie inside one allocation.

Block* DeviceEngine::State::live_block_holding(DevicePtr p, std::size_t size) const {
  for (const auto& seg : segments) {
    if (p < seg->base || p >= seg->base + seg->va_size) continue;
    for (Block* b = seg->first; b; b = b->next)
      if (p >= b->ptr && p < b->ptr + b->size)
        return b->state == BlockState::allocated && size <= b->ptr + b->size - p ? b : nullptr;
  }
  return nullptr;
}

Status DeviceEngine::register_range(void* ptr, std::size_t size, AllocError* err) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  const auto p = reinterpret_cast<DevicePtr>(ptr);
  Block* b = size ? s.live_block_holding(p, size) : nullptr;
  if (!b || (b->exported && s.exports.at(b->ptr).owner_freed)) {
    set_error(err, Status::invalid_argument,
              "fragless: register_range of " + std::to_string(size) + " bytes at " + hex(ptr) + " on device " +
                  std::to_string(s.driver->device()) + ": not inside one live fragless allocation; nothing was registered");
    return Status::invalid_argument;
  }
  ++s.exports[b->ptr].registrations;
  b->exported = true;
  return Status::ok;
}

Status DeviceEngine::deregister_range(void* ptr, AllocError* err) {
  State& s = *s_;
  std::lock_guard lk(s.mu);
  const auto p = reinterpret_cast<DevicePtr>(ptr);
  Block* b = s.live_block_holding(p, 1);
  auto it = b ? s.exports.find(b->ptr) : s.exports.end();
  if (it == s.exports.end() || it->second.registrations == 0) {
    set_error(err, Status::invalid_argument,
              "fragless: deregister_range at " + hex(ptr) + " on device " + std::to_string(s.driver->device()) +
                  ", which no register_range holds; nothing was changed");
    return Status::invalid_argument;
  }
  --it->second.registrations;
  s.release_if_unheld(it);
  return Status::ok;
}

}  // namespace fragless
