// fragless's native trace format (allocator/include/fragless/trace_format.h): reader and writer.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <functional>
#include <string>
#include <vector>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <unordered_set>

#include "fragless/trace.h"
#include "fragless/trace_format.h"
#include "trace_model.h"

namespace fragless::formats {

namespace {

constexpr std::uint16_t kFlagNoTime = 1;

bool op_of(std::uint8_t action, Op* op) {
  switch (static_cast<TraceAction>(action)) {
    case TraceAction::alloc: *op = Op::alloc; return true;
    case TraceAction::free_requested: *op = Op::free_requested; return true;
    case TraceAction::free_completed:
    case TraceAction::free: *op = Op::free; return true;
    case TraceAction::segment_alloc: *op = Op::segment_alloc; return true;
    case TraceAction::segment_free: *op = Op::segment_free; return true;
    case TraceAction::segment_map: *op = Op::segment_map; return true;
    case TraceAction::segment_unmap: *op = Op::segment_unmap; return true;
    case TraceAction::phys_create: *op = Op::phys_create; return true;
    case TraceAction::phys_release: *op = Op::phys_release; return true;
    case TraceAction::oom: *op = Op::oom; return true;
    case TraceAction::snapshot: *op = Op::snapshot; return true;
    case TraceAction::empty_cache: *op = Op::empty_cache; return true;
    case TraceAction::block_present:
    case TraceAction::segment_present: *op = Op::alloc; return true;  // placed in seed / pre_segments by the reader
  }
  return false;
}

TraceAction action_of(Op op) {
  switch (op) {
    case Op::alloc: return TraceAction::alloc;
    case Op::free: return TraceAction::free_completed;
    case Op::free_requested: return TraceAction::free_requested;
    case Op::segment_alloc: return TraceAction::segment_alloc;
    case Op::segment_free: return TraceAction::segment_free;
    case Op::segment_map: return TraceAction::segment_map;
    case Op::segment_unmap: return TraceAction::segment_unmap;
    case Op::phys_create: return TraceAction::phys_create;
    case Op::phys_release: return TraceAction::phys_release;
    case Op::oom: return TraceAction::oom;
    case Op::snapshot: return TraceAction::snapshot;
    case Op::empty_cache: return TraceAction::empty_cache;
  }
  return TraceAction::alloc;
}

}  // namespace

// Note [Reading a native trace in blocks]
// A native trace is the one format whose reader needs none of it at once: records are fixed-size. So the reader
// takes the file's bytes a block at a time (read_at), and reading a trace needs the memory of its events (48
// bytes a record, as in the file) and one block, not the file's bytes besides: a 10-million-record trace needs
// about 0.5 GB where holding the file too needed 1 GB. trace_from_native_bytes reads from memory the same way.
// (The last block, and a zero tail, are read twice: once to find where the records end, once as records.) The
// size is the file's when it was opened: a trace still being written is read up to it; one that another
// process cuts short meanwhile is refused, saying so.
namespace {

// Fills dst with `len` bytes from `offset`; false with *why (what went wrong) when it cannot.
using ReadAt = std::function<bool(std::uint64_t offset, std::size_t len, char* dst, std::string* why)>;

LoadResult native_from(std::uint64_t size, const ReadAt& read_at, const std::string& name) {
  LoadResult r;
  auto fail = [&](const std::string& what) {
    r.ok = false;
    r.error = name + ": " + what;
    return r;
  };
  std::string unread;  // why read_at could not read
  auto unreadable = [&] { return fail(unread); };
  NativeTraceHeader h{};
  char head[sizeof h];
  const std::size_t head_len = static_cast<std::size_t>(std::min<std::uint64_t>(size, sizeof h));
  if (!read_at(0, head_len, head, &unread)) return unreadable();
  if (head_len < sizeof kTraceMagic || std::memcmp(head, kTraceMagic, sizeof kTraceMagic) != 0)
    return fail("not a fragless native trace (bad magic)");
  if (head_len < sizeof h) return fail("native trace header cut short (" + std::to_string(size) + " of 64 bytes)");
  std::memcpy(&h, head, sizeof h);
  if (h.version != kTraceVersion)
    return fail("unsupported native trace version " + std::to_string(h.version) + " (this build reads version " +
                std::to_string(kTraceVersion) + ")");
  // Version 1's header is fixed (trace_format.h): a header of another size, a flag this reader does not know
  // or a reserved field that is not 0 is a file of another version or a damaged one, not one to skip through.
  if (h.header_size != sizeof h)
    return fail("bad header size " + std::to_string(h.header_size) + " (version 1 headers are 64 bytes)");
  if (h.flags & ~kFlagNoTime)
    return fail("unknown header flags 0x" + [&] { char b[8]; std::snprintf(b, sizeof b, "%x", h.flags & ~kFlagNoTime); return std::string(b); }() +
                " (version 1 defines only 0x1, no timestamps)");
  if (h.reserved0 != 0 || h.reserved1 != 0)
    return fail(std::string("reserved header field ") + (h.reserved0 ? "reserved0" : "reserved1") + " is " +
                std::to_string(h.reserved0 ? h.reserved0 : h.reserved1) + ", not 0");
  if (h.record_size != sizeof(NativeTraceRecord))
    return fail("bad record size " + std::to_string(h.record_size) + " (version 1 records are 48 bytes)");
  const bool timed = !(h.flags & kFlagNoTime);
  Trace& t = r.trace;
  t.source = name;
  t.has_time = false;
  const std::uint64_t body = size - h.header_size;
  // Note [A zero-filled tail]
  // A machine that crashes (power lost, the kernel panics) can leave a file whose size was extended but whose
  // last blocks were never written: ext4 and XFS then read them as zeros. A record has a nonzero marker, so a
  // run of zero bytes to the end of the file, from a record's start, is that: the records before it are read,
  // with a warning naming where the zeros begin, as a file cut mid-record is. A zero record followed by
  // anything else is corruption, refused as before.
  // Found from the end a block at a time (Note [Reading a native trace in blocks]: the last block is read again
  // as records).
  constexpr std::size_t kBlock = 21845 * sizeof(NativeTraceRecord);  // about 1 MiB of whole records
  std::vector<char> block(kBlock);
  std::uint64_t zeros_from = size;
  for (bool nonzero = false; !nonzero && zeros_from > h.header_size;) {
    const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(kBlock, zeros_from - h.header_size));
    if (!read_at(zeros_from - len, len, block.data(), &unread)) return unreadable();
    std::size_t k = len;
    while (k > 0 && block[k - 1] == 0) --k;
    nonzero = k > 0;
    zeros_from -= len - k;
  }
  const std::uint64_t first_zero_record = (zeros_from - h.header_size + sizeof(NativeTraceRecord) - 1) / sizeof(NativeTraceRecord);
  const bool zero_tail = zeros_from < size && first_zero_record < body / sizeof(NativeTraceRecord);
  const std::size_t n = static_cast<std::size_t>(zero_tail ? first_zero_record : body / sizeof(NativeTraceRecord));
  t.events.reserve(n);
  std::size_t in_block = 0, block_first = 0;  // records in `block`, and the index of its first
  std::vector<std::unordered_set<std::uint64_t>> live_by_device;
  std::vector<std::pair<std::int64_t, std::size_t>> latest;  // per device: the latest time read, and its record
  for (std::size_t i = 0; i < n; ++i) {
    NativeTraceRecord rec;
    const std::uint64_t off = h.header_size + static_cast<std::uint64_t>(i) * sizeof rec;
    if (i >= block_first + in_block) {
      block_first = i;
      in_block = std::min(n - i, kBlock / sizeof rec);
      if (!read_at(off, in_block * sizeof rec, block.data(), &unread)) return unreadable();
    }
    std::memcpy(&rec, block.data() + (i - block_first) * sizeof rec, sizeof rec);
    Event e;
    if (rec.marker != kTraceRecordMarker || !op_of(rec.action, &e.op))
      return fail("corrupt record " + std::to_string(i) + " at byte " + std::to_string(off) + " (action " +
                  std::to_string(rec.action) + ", marker " + std::to_string(rec.marker) + ")");
    e.device = rec.device;
    e.stream = rec.stream;
    e.address = rec.address;
    e.size = rec.requested;
    e.block_size = rec.block;
    if (const std::string why = event_out_of_bounds(e); !why.empty())
      return fail("record " + std::to_string(i) + " at byte " + std::to_string(off) + ": " + why);
    if (timed) {
      if (rec.time_ns > UINT64_MAX - h.origin_unix_ns)
        return fail("record " + std::to_string(i) + " at byte " + std::to_string(off) + ": its time, " +
                    std::to_string(rec.time_ns) + " ns after the header's origin of " + std::to_string(h.origin_unix_ns) +
                    " ns, is past the latest time a trace holds (2^64 ns)");
      e.time_us = static_cast<std::int64_t>((h.origin_unix_ns + rec.time_ns) / 1000);
      t.has_time = true;
      // kOutOfOrderUs (trace_model.h), refused by every reader, per device: each device's records are in
      // order, but devices sharing a file are written a batch at a time, and a trace converted from a snapshot
      // holds one device's events after another's.
      if (latest.size() <= rec.device) latest.resize(rec.device + 1u, {-1, 0});
      auto& [latest_us, latest_record] = latest[rec.device];
      if (e.time_us + kOutOfOrderUs < latest_us)
        return fail("record " + std::to_string(i) + " at byte " + std::to_string(off) + ": its time is " +
                    seconds_text(latest_us - e.time_us) + " s before record " + std::to_string(latest_record) +
                    "'s, on device " + std::to_string(rec.device) + "; a device's records may be out of order by " +
                    "at most 1 s");
      if (e.time_us > latest_us) {
        latest_us = e.time_us;
        latest_record = i;
      }
    }
    if (live_by_device.size() <= rec.device) live_by_device.resize(rec.device + 1u);
    auto& lv = live_by_device[rec.device];
    const bool present = rec.action == static_cast<std::uint8_t>(TraceAction::segment_present) ||
                         rec.action == static_cast<std::uint8_t>(TraceAction::block_present);
    if (present && !t.events.empty())  // written first (trace.h): one present later would be a phantom
      return fail("record " + std::to_string(i) + " at byte " + std::to_string(off) + ": a " +
                  trace_action_name(static_cast<TraceAction>(rec.action)) +
                  " record after the trace's first event (such records come before it)");
    if (rec.action == static_cast<std::uint8_t>(TraceAction::segment_present)) {
      e.op = rec.block ? Op::segment_map : Op::segment_alloc;
      e.block_size = 0;
      t.pre_segments.push_back(e);
      continue;
    }
    if (rec.action == static_cast<std::uint8_t>(TraceAction::block_present)) {
      if (!lv.insert(e.address).second)
        return fail("record " + std::to_string(i) + " at byte " + std::to_string(off) + ": block present twice");
      t.seed.push_back(e);
      continue;
    }
    if (holds_nothing(e)) {
      // pairs with nothing (trace_model.h)
    } else if (e.op == Op::alloc) {
      if (!lv.insert(e.address).second)
        return fail("record " + std::to_string(i) + " at byte " + std::to_string(off) + ": address " +
                    address_text(e.address) + " allocated twice without a free");
    } else if (e.op == Op::free) {
      if (!lv.erase(e.address))
        return fail("record " + std::to_string(i) + " at byte " + std::to_string(off) + ": free of address " +
                    address_text(e.address) + " that was never allocated in this trace");
    }
    t.events.push_back(e);
  }
  if (zero_tail)
    r.warning = name + ": the trace ends in " + std::to_string(size - (h.header_size + n * sizeof(NativeTraceRecord))) +
                " zero bytes from byte " + std::to_string(h.header_size + n * sizeof(NativeTraceRecord)) +
                " (blocks never written, as a crash of the machine leaves them); read " + std::to_string(n) +
                " complete records before them (events, and the segments and blocks present before the first)";
  else if (body % sizeof(NativeTraceRecord))
    r.warning = name + ": the trace ends in a partial record at byte " +
                std::to_string(h.header_size + n * sizeof(NativeTraceRecord)) + " (cut short, e.g. by a crash); read " +
                std::to_string(n) + " complete records (events, and the segments and blocks present before the first)";
  r.ok = true;
  return r;
}

}  // namespace

LoadResult trace_from_native_bytes(const std::string& bytes, const std::string& name) {
  return native_from(bytes.size(),
                     [&](std::uint64_t offset, std::size_t len, char* dst, std::string*) {
                       std::memcpy(dst, bytes.data() + offset, len);
                       return true;
                     },
                     name);
}

LoadResult trace_from_native_file(int fd, std::uint64_t size, const std::string& name) {
  return native_from(size,
                     [&](std::uint64_t offset, std::size_t len, char* dst, std::string* why) {
                       while (len) {
                         const ssize_t got = ::pread(fd, dst, len, static_cast<off_t>(offset));
                         if (got < 0 && errno == EINTR) continue;
                         if (got < 0) {
                           *why = std::string("cannot read (") + std::strerror(errno) + ")";
                           return false;
                         }
                         if (got == 0) {  // cut short since it was opened: another process truncated it
                           struct stat st {};
                           const long long now = ::fstat(fd, &st) == 0 ? static_cast<long long>(st.st_size) : -1;
                           *why = "it was cut short while it was read (" + std::to_string(size) + " bytes when opened" +
                                  (now >= 0 ? ", " + std::to_string(now) + " now" : "") +
                                  "): another process is replacing it; read it again once it is written";
                           return false;
                         }
                         dst += got;
                         len -= static_cast<std::size_t>(got);
                         offset += static_cast<std::uint64_t>(got);
                       }
                       return true;
                     },
                     name);
}

std::string trace_to_native(const Trace& t) {
  NativeTraceHeader h{};
  std::memcpy(h.magic, kTraceMagic, sizeof h.magic);
  h.version = kTraceVersion;
  h.header_size = sizeof h;
  h.record_size = sizeof(NativeTraceRecord);
  h.flags = t.has_time ? 0 : kFlagNoTime;
  h.rank = -1;
  h.device = -1;
  std::int64_t t0 = -1;
  for (const auto& e : t.events)
    if (e.time_us >= 0 && (t0 < 0 || e.time_us < t0)) t0 = e.time_us;
  if (t0 < 0) t0 = 0;
  h.origin_unix_ns = static_cast<std::uint64_t>(t0) * 1000;
  std::strncpy(h.policy, "converted", sizeof h.policy - 1);
  std::string out(reinterpret_cast<const char*>(&h), sizeof h);
  out.reserve(sizeof h + (t.seed.size() + t.events.size()) * sizeof(NativeTraceRecord));
  std::uint32_t seq = 0;
  // Frees that follow a free_requested of the same address complete it; others are immediate frees.
  std::vector<std::unordered_set<std::uint64_t>> pending;
  auto put = [&](const Event& e, TraceAction a) {
    NativeTraceRecord rec{};
    rec.time_ns = e.time_us >= 0 ? static_cast<std::uint64_t>(e.time_us - t0) * 1000 : 0;
    rec.address = e.address;
    rec.requested = e.size;
    rec.block = e.block_size;
    rec.stream = e.stream;
    rec.device = static_cast<std::uint16_t>(e.device);
    rec.action = static_cast<std::uint8_t>(a);
    rec.marker = kTraceRecordMarker;
    rec.sequence = seq++;
    out.append(reinterpret_cast<const char*>(&rec), sizeof rec);
  };
  // What was there before the window, stamped at the trace's start: present, not allocated by it.
  for (const auto& e : t.pre_segments) {
    Event s = e;
    s.time_us = t0;
    s.block_size = e.op == Op::segment_map ? 1 : 0;
    put(s, TraceAction::segment_present);
  }
  for (const auto& e : t.seed) {
    Event s = e;
    s.time_us = t0;
    put(s, TraceAction::block_present);
  }
  for (const auto& e : t.events) {
    if (pending.size() <= static_cast<std::size_t>(e.device)) pending.resize(static_cast<std::size_t>(e.device) + 1);
    auto& p = pending[static_cast<std::size_t>(e.device)];
    if (e.op == Op::free_requested) p.insert(e.address);
    if (e.op == Op::free && !p.erase(e.address)) {
      put(e, TraceAction::free);
      continue;
    }
    put(e, action_of(e.op));
  }
  return out;
}

}  // namespace fragless::formats
