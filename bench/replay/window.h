// A window of a trace (fragless-replay --window FROM:TO): the events between two fractions of the trace,
// with what was live at the window's start as the seed, so a part of a long run replays on its own.
#pragma once
#include <string>

#include "trace_model.h"

namespace fragless::replay {

// A window's bounds, as fractions of a trace's events: [from, to), 0 <= from < to <= 1.
struct Window {
  double from = 0, to = 1;
  bool whole() const { return from == 0 && to == 1; }
};

// Parses "FROM:TO" (two numbers in [0, 1], FROM < TO). False with *error naming what was wrong.
bool parse_window(const std::string& text, Window* out, std::string* error);

// Cuts t to events [floor(from * n), floor(to * n)) of each device's n events, in place. The blocks live at the
// window's start by the replay's rules (the trace's own seed, less what was freed before it, then every
// earlier allocation not freed before it, in trace order; a block an empty_cache before the window completed
// is freed there, and its later `free` record dropped, Note [Frees an empty_cache completes]) become the seed,
// and the free_requested marks still pending open the window, so an empty_cache in it completes them too. Classic's segments before the trace (pre_segments) are
// kept only for a window from the start: the recorded allocator's cache later on is not known, so all three
// policies then start from the live blocks alone. PyTorch's recorded peak is dropped unless the window is
// the whole trace (it was taken over the whole window). The source gets "@FROM:TO".
void cut_window(formats::Trace* t, const Window& w, const std::string& text);

}  // namespace fragless::replay
