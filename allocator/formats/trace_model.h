// One event model for every trace format: what the replay consumes and the converters produce.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fragless::formats {

// `free` is the moment a block went back to the cache (PyTorch's free_completed, RMM's free, fragless's
// free/free_completed); `free_requested` (the user's call while the block still waits for other streams)
// is kept for conversions but not replayed. Segment, page and OOM events are what the recorded
// allocator did: kept for conversions and PyTorch's recorded peak, not instructions to a replay.
enum class Op : std::uint8_t {
  alloc, free, free_requested, segment_alloc, segment_free, segment_map, segment_unmap, phys_create,
  phys_release, oom, snapshot, empty_cache
};
const char* op_name(Op op);
bool is_segment_op(Op op);  // segment_alloc/free/map/unmap

struct Event {
  Op op = Op::alloc;
  std::int32_t device = 0;
  std::uint64_t stream = 0;
  std::uint64_t address = 0;  // the address the trace recorded (the key that pairs a free with its alloc)
  std::uint64_t size = 0;     // requested bytes (alloc, free) or segment bytes
  std::uint64_t block_size = 0;  // bytes after rounding, when the trace recorded it (native traces); else 0
  std::int64_t time_us = -1;  // -1 when the trace has no time
};

// Note [One set of bounds for every format]
// What any reader accepts of an event, so a trace one format holds converts to every other and reads back:
// sizes (requested and block) in [0, 2^63) (PyTorch's snapshots hold int64), an address whose block ends by
// 2^64 (address + size does not wrap), a device index below kMaxDevices, a time (when there is one) in
// [0, kMaxTimeUs], what a native trace's nanoseconds hold; a failed allocation's size and address are not
// checked (its size is whatever was asked for). Empty when `e` is within them, else what is outside, naming
// the field.
inline constexpr int kMaxDevices = 4096;
inline constexpr std::int64_t kMaxTimeUs = static_cast<std::int64_t>(UINT64_MAX / 1000);  // 2^64 ns, in µs
std::string event_out_of_bounds(const struct Event& e);
// An address as the readers' errors name it: 0x and lowercase hex.
std::string address_text(std::uint64_t address);
// Events of one recording may be out of time order by at most this much (threads take the time before the
// recorder's lock); a step further back is a clock set back or an edited file, which every reader refuses,
// naming both events.
inline constexpr std::int64_t kOutOfOrderUs = 1000000;
// Microseconds as seconds, six decimals ("3600.000000"), as those errors give a step back.
std::string seconds_text(std::int64_t us);

struct Trace {
  std::string source;                 // file name or workload spec
  std::vector<Event> events;          // in trace order
  // Allocations live before the window (frees of unknown addresses, blocks live at dump that the window
  // never allocated): replayed as allocations before the first event.
  std::vector<Event> seed;
  // Classic segments that existed before the window (their sizes), so a replay can start from the same
  // cache shape: created and freed before the seed is allocated.
  std::vector<Event> pre_segments;
  bool has_time = false;
  // For generated workloads, which record no time: the modelled time (µs) at which each event happens,
  // parallel to `events` (bench/replay/compute_model.h); empty otherwise. Not a recording: it drives only the
  // replay's background clock (Note [Background work in the replay], replay.cpp).
  std::vector<std::int64_t> model_time_us;
  // PyTorch's own peak reserved over the window per device, when the snapshot tells it (segments at dump
  // time rolled back through the window's segment events); empty otherwise.
  std::vector<std::optional<std::uint64_t>> recorded_peak_reserved;
  bool window = false;  // cut from a longer trace by fragless-replay --window (bench/replay/window.cpp)
  int devices() const;
};

// A null pointer for 0 bytes (RMM's pools answer a request of 0 bytes so, and its logging adaptor logs it
// and its free as "(nil)"): it holds nothing, so every reader pairs it with nothing and the replay skips it.
inline bool holds_nothing(const Event& e) { return e.address == 0 && e.size == 0; }

enum class Format { native, rmm_csv, snapshot };

struct LoadResult {
  bool ok = false;
  Trace trace;
  std::string error;    // names the file and the position
  std::string warning;  // loaded, but something was off (a native trace cut short by a crash)
  // What the input holds that the trace model has no field for (a snapshot's stack frames, compile
  // contexts, user metadata, annotations): lost by a conversion, irrelevant to a replay. Empty if nothing.
  std::string dropped;
  Format format{};  // what the input was read as (trace_from_bytes and load_trace set it)
};

const char* format_name(Format f);
// "native", "rmm"/"csv", "snapshot"/"pickle"; false when unknown.
bool parse_format(const std::string& s, Format* f);
// From a file name's extension: .fgt/.trace/.bin native, .csv RMM, .pickle/.pkl snapshot.
bool format_from_extension(const std::string& path, Format* f);
// Detected from content; false when none matches.
bool detect_format(const std::string& bytes, Format* f);

// Reads a trace in any supported format, detected from content: native, PyTorch snapshot pickle or RMM CSV.
LoadResult load_trace(const std::string& path);
LoadResult trace_from_bytes(const std::string& bytes, const std::string& name);
LoadResult trace_from_snapshot_bytes(const std::string& bytes, const std::string& name);
LoadResult trace_from_rmm_csv(const std::string& text, const std::string& name);
LoadResult trace_from_native_bytes(const std::string& bytes, const std::string& name);
// The same from an open file of `size` bytes, read a block at a time (Note [Reading a native trace in blocks]).
LoadResult trace_from_native_file(int fd, std::uint64_t size, const std::string& name);

// Writers. RMM logs have no device column: one device per file. A trace without times gets one
// microsecond per event (Note [Times in a converted RMM log], rmm_csv.cpp).
std::string trace_to_rmm_csv(const Trace& t, int device, std::string* lost = nullptr);
std::string trace_to_native(const Trace& t);
// PyTorch's _dump_snapshot layout (segments + device_traces), drawable by torch.cuda._memory_viz and
// pytorch.org/memory_viz. Segments are reconstructed from the trace's segment events; blocks live at the
// end outside any recorded segment get a segment of their own.
std::string trace_to_snapshot(const Trace& t);
// Writes `bytes` to `path` atomically (a temporary file in the target's folder, renamed over it), through
// symbolic links to their target; an existing target that is not a regular file (a FIFO, a device) is refused
// (Note [Writing an output file], formats.cpp). False with *error naming the path and the reason.
bool write_file(const std::string& path, const std::string& bytes, std::string* error);
// The file write_file would replace for `path` (symbolic links followed), or false with *error where it
// would refuse.
bool output_target(const std::string& path, std::string* target, std::string* error);
// False with *error when writing `path` would replace one of `inputs` (Note [An output never replaces an
// input], formats.cpp), or output_target refuses it.
bool output_spares_inputs(const std::string& path, const std::vector<std::string>& inputs, std::string* error);

}  // namespace fragless::formats
