// What a PyTorch snapshot's window began with, and the empty_cache calls its release entries stand for: the
// parts of the snapshot reader (snapshot_import.cpp) that work on the events already read.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>

#include "trace_model.h"

namespace fragless::formats {
struct PyValue;

namespace snapshot_window {

// A segment (or mapped range) the dump holds: its size, whether it is an expandable segment's range, its
// stream, and the event that frees it in the window (SIZE_MAX: none).
struct DumpSeg {
  std::uint64_t size;
  bool expandable;
  std::uint64_t stream;
  std::size_t freed_at = SIZE_MAX;
};

// Note [Releases the program asked for] (snapshot_window.cpp).
enum class OwnReleases { off, unknown, possible };
OwnReleases own_releases(const PyValue& root);
// Inserts an empty_cache before each run of release entries from first_event on; returns the lone releases
// taken as calls (OwnReleases::unknown) or left as PyTorch's own (::possible).
std::size_t add_empty_cache_calls(Trace& t, std::size_t first_event, OwnReleases own);
// Appends to t.pre_segments what device dev held before the window (at_dump rolled back through its events).
void add_pre_segments(Trace& t, std::size_t first_event, std::size_t dev, const std::map<std::uint64_t, DumpSeg>& at_dump);

}  // namespace snapshot_window
}  // namespace fragless::formats
