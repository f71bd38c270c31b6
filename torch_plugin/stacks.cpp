#include "stacks.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>

#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <mutex>
#include <unordered_map>

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
  bool ok = false;

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
    ok = is_initialized && gil_check && get_frame && frame_code && frame_back && frame_line && incref && decref &&
         getattr && utf8 && err_clear;
  }
};

Python& py() {
  static Python p;
  return p;
}

// A code object's file and name, read once (under the GIL); the code object is kept alive by one reference
// so its address names it for good.
struct CodeInfo {
  std::string filename, name;
};

std::mutex g_mu;  // guards the tables below
std::unordered_map<const void*, CodeInfo*>& codes() {
  static auto* m = new std::unordered_map<const void*, CodeInfo*>;  // never destroyed: used until exit
  return *m;
}

std::string attr_text(Python& p, void* obj, const char* name) {
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

const CodeInfo* code_info(Python& p, void* code) {
  std::lock_guard lk(g_mu);
  auto& m = codes();
  if (auto it = m.find(code); it != m.end()) return it->second;
  p.incref(code);  // kept: its address stays this code object's
  auto* ci = new CodeInfo{attr_text(p, code, "co_filename"), attr_text(p, code, "co_name")};
  m.emplace(code, ci);
  return ci;
}

}  // namespace

bool python_available() {
  Python& p = py();
  return p.ok && p.is_initialized();
}

std::shared_ptr<const Stack> capture(int which, int skip) {
  auto s = std::make_shared<Stack>();
  if (which & cpp) {
    void* buf[kMaxFrames];
    const int n = backtrace(buf, kMaxFrames);
    for (int i = skip + 1; i < n; ++i) s->cpp.push_back(buf[i]);  // +1: this function
  }
  if (which & python) {
    Python& p = py();
    if (p.ok && p.is_initialized() && p.gil_check() == 1) {
      void* f = p.get_frame();  // borrowed
      bool owned = false;
      for (int depth = 0; f && depth < kMaxFrames; ++depth) {
        void* code = p.frame_code(f);
        const int line = p.frame_line(f);
        if (code) {
          s->python.emplace_back(code_info(p, code), line);
          p.decref(code);
        }
        void* back = p.frame_back(f);  // new reference (or null)
        if (owned) p.decref(f);
        f = back;
        owned = true;
      }
      if (owned && f) p.decref(f);
    }
  }
  if (s->cpp.empty() && s->python.empty()) return nullptr;
  return s;
}

std::vector<Frame> symbolize(const Stack& s) {
  std::vector<Frame> out;
  out.reserve(s.cpp.size() + s.python.size());
  for (void* a : s.cpp) {
    Frame f;
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
    out.push_back(std::move(f));
  }
  for (auto& [code, line] : s.python) {
    const auto* ci = static_cast<const CodeInfo*>(code);
    out.push_back({ci->filename, ci->name, line});
  }
  return out;
}

}  // namespace fragless::stacks
