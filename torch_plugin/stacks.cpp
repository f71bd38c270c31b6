#include "stacks.h"

#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdio>
#include <atomic>
#include <cstdlib>
#include <type_traits>
#include <mutex>
#include <unordered_map>

#include "made_once.h"
#include "unwind.h"

namespace fragless::stacks {

namespace {

constexpr int kMaxFrames = 96;

// The parts of the CPython C API the capture needs (stable since 3.9), looked up once.
struct Python {
  int (*is_initialized)() = nullptr;
  int (*gil_check)() = nullptr;
  void* (*get_frame)() = nullptr;           // PyEval_GetFrame: borrowed
  void* (*frame_code)(void*) = nullptr;     // PyFrame_GetCode: new reference
  void* (*frame_back)(void*) = nullptr;     // PyFrame_GetBack: new reference
  int (*frame_line)(void*) = nullptr;       // PyFrame_GetLineNumber
  void (*incref)(void*) = nullptr;          // Py_IncRef
  void (*decref)(void*) = nullptr;          // Py_DecRef
  void* (*getattr)(void*, const char*) = nullptr;  // PyObject_GetAttrString: new reference
  const char* (*utf8)(void*) = nullptr;     // PyUnicode_AsUTF8
  void (*err_clear)() = nullptr;            // PyErr_Clear
  int (*frame_lasti)(void*) = nullptr;      // PyFrame_GetLasti (3.11+): the line is then named later
  int (*addr2line)(void*, int) = nullptr;   // PyCode_Addr2Line
  int (*gil_ensure)() = nullptr;            // PyGILState_Ensure
  void (*gil_release)(int) = nullptr;       // PyGILState_Release
  int (*finalizing)() = nullptr;            // Py_IsFinalizing (3.13) or _Py_IsFinalizing
  void* (*this_thread_state)() = nullptr;   // PyGILState_GetThisThreadState: needs no GIL
  bool ok = false;
  bool can_take_gil = false;                // what taking the GIL for a thread that released it needs

  Python() {
    auto get = [](auto& fn, const char* name) { fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(RTLD_DEFAULT, name)); };
    get(is_initialized, "Py_IsInitialized");
    get(gil_check, "PyGILState_Check");
    get(get_frame, "PyEval_GetFrame");
    get(frame_code, "PyFrame_GetCode");
    get(frame_back, "PyFrame_GetBack");
    get(frame_line, "PyFrame_GetLineNumber");
    get(incref, "Py_IncRef");
    get(decref, "Py_DecRef");
    get(getattr, "PyObject_GetAttrString");
    get(utf8, "PyUnicode_AsUTF8");
    get(err_clear, "PyErr_Clear");
    get(frame_lasti, "PyFrame_GetLasti");
    get(addr2line, "PyCode_Addr2Line");
    get(gil_ensure, "PyGILState_Ensure");
    get(gil_release, "PyGILState_Release");
    get(finalizing, "Py_IsFinalizing");
    if (!finalizing) get(finalizing, "_Py_IsFinalizing");
    get(this_thread_state, "PyGILState_GetThisThreadState");
    if (!(addr2line && gil_ensure && gil_release && finalizing)) frame_lasti = nullptr;  // lines at capture
    ok = is_initialized && gil_check && get_frame && frame_code && frame_back && frame_line && incref && decref &&
         getattr && utf8 && err_clear;
    can_take_gil = ok && gil_ensure && gil_release && finalizing && this_thread_state;
  }
};

// made_once, not a function's static: a child forked while another thread made it would wait for ever on the
// static's guard at its first capture.
const Python& py() {
  static std::atomic<const Python*> p{nullptr};
  static std::once_flag once;
  return made_once(p, once, [] { return new Python(); });  // never destroyed: captures run until exit
}

// A code object's file and name, read once (under the GIL); the code object is kept alive by one reference
// so its address names it for good.
struct CodeInfo {
  void* code;
  std::string filename, name;
};

std::mutex g_mu;  // guards the tables below
std::unordered_map<const void*, CodeInfo*>& codes() {
  static auto* m = new std::unordered_map<const void*, CodeInfo*>;  // never destroyed: used until exit
  return *m;
}

std::string attr_text(const Python& p, void* obj, const char* name) {
  void* a = p.getattr(obj, name);
  if (!a) {
    p.err_clear();
    return "??";
  }
  const char* s = p.utf8(a);
  std::string out = s ? s : "??";
  if (!s) p.err_clear();
  p.decref(a);
  return out;
}

// A thread's recent code objects, direct-mapped: a hit costs a load and a compare, no lock.
struct CodeCache {
  static constexpr std::size_t kSlots = 1024;
  const void* key[kSlots] = {};
  const CodeInfo* value[kSlots] = {};
};

CodeCache& code_cache() {
  thread_local CodeCache c;  // one TLS lookup per capture, not per frame
  return c;
}

const CodeInfo* code_info(const Python& p, void* code, CodeCache& cache) {
  const std::size_t slot = (reinterpret_cast<std::uintptr_t>(code) >> 4) % CodeCache::kSlots;
  if (cache.key[slot] == code) return cache.value[slot];
  std::lock_guard lk(g_mu);
  auto& m = codes();
  auto it = m.find(code);
  if (it == m.end()) {
    p.incref(code);  // kept: its address stays this code object's
    it = m.emplace(code, new CodeInfo{code, attr_text(p, code, "co_filename"), attr_text(p, code, "co_name")}).first;
  }
  cache.key[slot] = code;
  cache.value[slot] = it->second;
  return it->second;
}

// The Python frames of the calling thread, which holds the GIL, innermost first.
void python_frames(const Python& p, Stack* s) {
  CodeCache& cache = code_cache();
  s->python.reserve(32);
  void* f = p.get_frame();  // borrowed
  bool owned = false;
  for (int depth = 0; f && depth < kMaxFrames; ++depth) {
    void* code = p.frame_code(f);
    if (code) {
      // The bytecode offset where the API gives it; the line (a walk of the line table) at snapshot time.
      if (p.frame_lasti) s->python.push_back({code_info(p, code, cache), p.frame_lasti(f), true});
      else s->python.push_back({code_info(p, code, cache), p.frame_line(f), false});
      p.decref(code);
    }
    void* back = p.frame_back(f);  // new reference (or null)
    if (owned) p.decref(f);
    f = back;
    owned = true;
  }
  if (owned && f) p.decref(f);
}

// Note [Taking the GIL for Python frames]
// PyTorch's generated bindings release the GIL around the operator that allocates (torch.empty, arithmetic,
// ...), so the allocating thread usually does not hold it. As PyTorch's own allocator does
// (CapturedTraceback's Python gatherer), the frames are read by taking the GIL for the walk, which is why
// capture() must run before any fragless lock is taken: a thread holding the GIL may be waiting for that
// lock (lock order GIL -> fragless). Never taken by a thread with no Python thread state (a pure C++
// thread: PyGILState_Ensure would create one, and it has no Python frames anyway), nor while the
// interpreter is finalizing (PyGILState_Ensure may then never return or end the thread): no Python frames
// then.
void python_stack(Stack* s) {
  const Python& p = py();
  if (!p.ok || !p.is_initialized()) return;
  if (p.finalizing && p.finalizing()) return;
  if (p.gil_check() == 1) return python_frames(p, s);
  if (!p.can_take_gil || !p.this_thread_state()) return;
  const int state = p.gil_ensure();
  python_frames(p, s);
  p.gil_release(state);
}

}  // namespace

std::shared_ptr<const Stack> capture(int which, int skip) {
  auto s = std::make_shared<Stack>();
  if (which & cpp) {
    void* buf[kMaxFrames];
    const int n = unwind(buf, kMaxFrames, skip + 1);  // +1: this function
    s->cpp.assign(buf, buf + n);
  }
  if (which & python) python_stack(s.get());
  if (s->cpp.empty() && s->python.empty()) return nullptr;
  return s;
}

Namer::~Namer() {
  if (held_) py().gil_release(state_);
}

int Namer::line(const void* code, int offset) {
  // One answer per code object and offset for the snapshot, as for C++ frames.
  auto [it, fresh] = lines_.try_emplace({code, offset}, 0);
  if (fresh) it->second = line_now(code, offset);
  return it->second;
}

int Namer::line_now(const void* code, int offset) {
  const Python& p = py();
  if (!tried_) {
    tried_ = true;
    // As for capture: never for a thread with no Python state, never while finalizing.
    if (p.frame_lasti && p.is_initialized() && !p.finalizing() &&
        (p.gil_check() == 1 || (p.this_thread_state && p.this_thread_state()))) {
      state_ = p.gil_ensure();
      held_ = true;
    }
  }
  if (!held_ || offset < 0) return 0;
  return p.addr2line(static_cast<const CodeInfo*>(code)->code, offset);
}

void lock_tables() {
  g_mu.lock();
  lock_unwind_table();
}
void unlock_tables() {
  unlock_unwind_table();
  g_mu.unlock();
}

bool same_frames(const Stack& a, const Stack& b) { return a.cpp == b.cpp && a.python == b.python; }

std::size_t hash_frames(const Stack& s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](std::uint64_t v) { h = (h ^ v) * 0x100000001b3ull; h ^= h >> 29; };
  for (void* a : s.cpp) mix(reinterpret_cast<std::uintptr_t>(a));
  mix(s.cpp.size());
  for (const PyFrameRef& r : s.python) {
    mix(reinterpret_cast<std::uintptr_t>(r.code));
    mix((static_cast<std::uint64_t>(static_cast<std::uint32_t>(r.where)) << 1) | (r.offset ? 1u : 0u));
  }
  return static_cast<std::size_t>(h);
}

// Note [Python frames among C++ frames]
// A stack with both kinds is named as PyTorch's CapturedTraceback symbolize
// (torch/csrc/profiler/combined_traceback.cpp) names it: innermost first, each C++ frame whose name contains
// "PyEval_EvalFrame" (the interpreter running a Python function) is preceded by the next Python frame, and the
// Python frames left over (an interpreter whose frame evaluator is not named so, or frames beyond the C++
// frames kept) follow the last C++ frame. So the Python caller of an operator shows where the interpreter
// called it, not after the process's entry point.
std::vector<Frame> Namer::operator()(const Stack& s) {
  std::vector<Frame> out;
  out.reserve(s.cpp.size() + s.python.size());
  auto py = s.python.begin();
  auto python_frame = [&](const PyFrameRef& r) {
    const auto* ci = static_cast<const CodeInfo*>(r.code);
    out.push_back({ci->filename, ci->name, r.offset ? line(r.code, r.where) : r.where});
  };
  auto cpp_frame = [&](const Frame& f) {
    if (py != s.python.end() && f.name.find("PyEval_EvalFrame") != std::string::npos) python_frame(*py++);
    out.push_back(f);
  };
  for (void* a : s.cpp) {
    // One name per return address for the snapshot: the stacks share most of theirs, and dladdr searches
    // a library's symbol table (about 1 ms an address in libtorch_cpu.so: 12 s for 4,096 events before).
    auto [it, fresh] = cpp_names_.try_emplace(a);
    if (!fresh) {
      cpp_frame(it->second);
      continue;
    }
    Frame& f = it->second;
    Dl_info info{};
    if (dladdr(a, &info) && info.dli_fname) {
      f.filename = info.dli_fname;
      if (info.dli_sname) {
        int status = 0;
        char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
        f.name = status == 0 && d ? d : info.dli_sname;
        std::free(d);
      } else {
        char b[32];
        std::snprintf(b, sizeof b, "0x%zx", static_cast<std::size_t>(reinterpret_cast<std::uintptr_t>(a) -
                                                                      reinterpret_cast<std::uintptr_t>(info.dli_fbase)));
        f.name = std::string("?? +") + b;
      }
    } else {
      f.filename = "??";
      f.name = "??";
    }
    cpp_frame(f);
  }
  for (; py != s.python.end(); ++py) python_frame(*py);
  return out;
}

}  // namespace fragless::stacks
