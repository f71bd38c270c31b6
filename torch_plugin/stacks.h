// Stack traces for snapshots, with _record_memory_history's semantics: captured when an event is recorded
// (cheap: return addresses and Python code objects with their lines), symbolised only when a snapshot is
// taken.
//
// - C++ frames: the return addresses of the calling thread (glibc's backtrace), symbolised with dladdr and
//   demangled: the name of the nearest exported symbol and its library (no line: that needs debug info).
// - Python frames: those of the calling thread when it holds the GIL, read through the CPython C API found
//   at run time with dlsym (nothing links libpython; a process without Python has none). Each code object is
//   kept alive (one reference, forever) the first time it is seen, so a frame is a pointer and a line.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fragless::stacks {

enum Which : int { python = 1, cpp = 2 };

struct Frame {
  std::string filename, name;
  std::int64_t line = 0;
};

struct Stack {
  std::vector<void*> cpp;                           // innermost first
  std::vector<std::pair<const void*, int>> python;  // (code info, line), innermost first
};

// `which`: python | cpp. `skip`: C++ frames of the caller's own to leave out. nullptr when nothing was found.
std::shared_ptr<const Stack> capture(int which, int skip);

// C++ frames first (innermost first), then Python frames (innermost first): PyTorch's order.
std::vector<Frame> symbolize(const Stack& s);

// Whether this process has a Python interpreter the capture can read.
bool python_available();

}  // namespace fragless::stacks
