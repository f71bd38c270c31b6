// The native trace format: what the tracer writes and `allocator/formats` reads. Little-endian, fixed-size
// records after a fixed-size header, so a file cut short by a crash still reads up to its last complete
// record and a reader can seek by index.
//
//   header (64 bytes)  magic "FRAGLESS", version, sizes, pid, rank, device (-1: all devices of the
//                      process share this file), origin time, policy name
//   record (48 bytes)  time since origin (ns), address, requested size, block size, stream, device,
//                      action (TraceAction), marker byte, per-sink sequence number
//
// Records of one device appear in the order the engine produced them; records of different devices that
// share a file are interleaved in chunks (sort by time to merge).
#pragma once
#include <cstdint>
#include <cstring>

namespace fragless {

inline constexpr char kTraceMagic[8] = {'F', 'R', 'A', 'G', 'L', 'E', 'S', 'S'};
inline constexpr std::uint16_t kTraceVersion = 1;
inline constexpr std::uint8_t kTraceRecordMarker = 0xA5;

struct NativeTraceHeader {
  char magic[8];
  std::uint16_t version;
  std::uint16_t header_size;
  std::uint16_t record_size;
  std::uint16_t flags;           // bit 0: no timestamps (a converted untimed trace); the other bits 0
  std::uint32_t pid;
  std::int32_t rank;             // RANK from the environment, -1 if unset
  std::int32_t device;           // -1: every device of the process writes here
  std::uint32_t reserved0;       // 0 (a reader refuses another value)
  std::uint64_t origin_unix_ns;  // wall-clock time of record time 0
  char policy[16];               // NUL-padded policy name
  std::uint64_t reserved1;       // 0
};
static_assert(sizeof(NativeTraceHeader) == 64);

struct NativeTraceRecord {
  std::uint64_t time_ns;    // since header.origin_unix_ns
  std::uint64_t address;
  std::uint64_t requested;  // requested bytes (segment/page events: bytes mapped or released)
  std::uint64_t block;      // block bytes after rounding
  std::uint64_t stream;
  std::uint16_t device;
  std::uint8_t action;      // TraceAction
  std::uint8_t marker;      // kTraceRecordMarker: a cheap check against garbage
  std::uint32_t sequence;   // per writer, wraps
};
static_assert(sizeof(NativeTraceRecord) == 48);

}  // namespace fragless
