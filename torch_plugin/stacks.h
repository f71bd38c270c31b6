// Stack traces for snapshots, with _record_memory_history's semantics: captured when an event is recorded
// (cheap: return addresses and Python code objects with their lines), symbolised only when a snapshot is
// taken.
//
// - C++ frames: the return addresses of the calling thread (unwind.h: a DWARF unwinder with a rule cached per
//   return address), symbolised with dladdr and demangled: the name of the nearest exported symbol and its
//   library (no line: that needs debug info).
// - Python frames: those of the calling thread, read through the CPython C API found at run time with dlsym
//   (nothing links libpython; a process without Python has none), taking the GIL for the walk when the
//   thread released it (Note [Taking the GIL for Python frames], stacks.cpp). Each code object is kept alive
//   (one reference, forever) the first time it is seen, so a frame is a pointer and a line.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fragless::stacks {

enum Which : int { python = 1, cpp = 2 };

struct Frame {
  std::string filename, name;
  std::int64_t line = 0;
};

struct PyFrameRef {
  const void* code;  // the code object's cached file and name (stacks.cpp)
  int where;         // the line, or with `offset` the bytecode offset, named at snapshot time
  bool offset;
  bool operator==(const PyFrameRef&) const = default;
};

struct Stack {
  std::vector<void*> cpp;            // innermost first
  std::vector<PyFrameRef> python;    // innermost first
};

// Stacks by what they hold, not by which capture made them: a training loop captures the same stack at every
// step, and a snapshot names each distinct one once.
bool same_frames(const Stack& a, const Stack& b);
std::size_t hash_frames(const Stack& s);
struct SameFrames {
  bool operator()(const Stack* a, const Stack* b) const { return same_frames(*a, *b); }
};
struct HashFrames {
  std::size_t operator()(const Stack* s) const { return hash_frames(*s); }
};

// `which`: python | cpp. `skip`: C++ frames of the caller's own to leave out. nullptr when nothing was found.
// May take the GIL: call it holding no lock that an allocating thread may wait for.
std::shared_ptr<const Stack> capture(int which, int skip);

// The locks of the tables a capture fills (the code objects seen, the unwinder's rules), taken and released
// together, for fork() (fragless::hold_across_fork): a child forked while another thread captured finds them
// free. Neither is held while another lock is taken, nor while waiting for the GIL.
void lock_tables();
void unlock_tables();

// Names stacks innermost first, in PyTorch's order: each Python frame just before the C++ frame of the
// interpreter that ran it (a name containing PyEval_EvalFrame), the rest after the C++ frames (Note [Python
// frames among C++ frames], stacks.cpp).
// Python lines kept as bytecode offsets are computed here, under the GIL, which a Namer takes (if Python is
// running) on first need and gives back when destroyed: make one per snapshot, holding no lock the
// allocation path takes (an allocating thread may hold the GIL and wait for that lock).
class Namer {
 public:
  Namer() = default;
  ~Namer();
  Namer(const Namer&) = delete;
  Namer& operator=(const Namer&) = delete;
  std::vector<Frame> operator()(const Stack& s);

 private:
  int line(const void* code, int offset);
  int line_now(const void* code, int offset);
  struct CodeOffsetHash {
    std::size_t operator()(const std::pair<const void*, int>& k) const {
      return std::hash<const void*>()(k.first) ^ (static_cast<std::size_t>(k.second) * 0x9e3779b97f4a7c15ull);
    }
  };
  std::unordered_map<void*, Frame> cpp_names_;  // what each return address was named in this snapshot
  std::unordered_map<std::pair<const void*, int>, int, CodeOffsetHash> lines_;  // and each Python offset's line
  bool tried_ = false, held_ = false;
  int state_ = 0;
};

}  // namespace fragless::stacks
