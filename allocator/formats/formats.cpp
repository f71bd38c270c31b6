// Format names, detection from content, loading from files, atomic writes.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "fragless/trace_format.h"
#include "trace_model.h"

namespace fragless::formats {

const char* op_name(Op op) {
  switch (op) {
    case Op::alloc: return "alloc";
    case Op::free: return "free";
    case Op::free_requested: return "free_requested";
    case Op::segment_alloc: return "segment_alloc";
    case Op::segment_free: return "segment_free";
    case Op::segment_map: return "segment_map";
    case Op::segment_unmap: return "segment_unmap";
    case Op::phys_create: return "phys_create";
    case Op::phys_release: return "phys_release";
    case Op::oom: return "oom";
    case Op::snapshot: return "snapshot";
    case Op::empty_cache: return "empty_cache";
  }
  return "?";
}

bool is_segment_op(Op op) {
  return op == Op::segment_alloc || op == Op::segment_free || op == Op::segment_map || op == Op::segment_unmap;
}

const char* format_name(Format f) {
  switch (f) {
    case Format::native: return "native";
    case Format::rmm_csv: return "rmm";
    case Format::snapshot: return "snapshot";
  }
  return "?";
}

bool parse_format(const std::string& s, Format* f) {
  if (s == "native" || s == "fragless") *f = Format::native;
  else if (s == "rmm" || s == "csv") *f = Format::rmm_csv;
  else if (s == "snapshot" || s == "pickle" || s == "pytorch") *f = Format::snapshot;
  else return false;
  return true;
}

bool format_from_extension(const std::string& path, Format* f) {
  auto ends = [&](const char* e) {
    const std::size_t n = std::strlen(e);
    return path.size() >= n && path.compare(path.size() - n, n, e) == 0;
  };
  if (ends(".fgt") || ends(".trace") || ends(".bin")) *f = Format::native;
  else if (ends(".csv")) *f = Format::rmm_csv;
  else if (ends(".pickle") || ends(".pkl")) *f = Format::snapshot;
  else return false;
  return true;
}

bool detect_format(const std::string& bytes, Format* f) {
  if (bytes.size() >= sizeof kTraceMagic && std::memcmp(bytes.data(), kTraceMagic, sizeof kTraceMagic) == 0)
    *f = Format::native;
  else if (bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x80)
    *f = Format::snapshot;
  else if (bytes.rfind("Thread,", 0) == 0 || bytes.substr(0, bytes.find('\n')).find("Action") != std::string::npos)
    *f = Format::rmm_csv;
  else
    return false;
  return true;
}

LoadResult trace_from_bytes(const std::string& bytes, const std::string& name) {
  Format f;
  if (!detect_format(bytes, &f)) {
    LoadResult r;
    r.error = name + ": unknown trace format (expected a fragless native trace, a PyTorch memory snapshot "
                     "pickle or an RMM log CSV)";
    return r;
  }
  switch (f) {
    case Format::native: return trace_from_native_bytes(bytes, name);
    case Format::snapshot: return trace_from_snapshot_bytes(bytes, name);
    case Format::rmm_csv: return trace_from_rmm_csv(bytes, name);
  }
  return {};
}

LoadResult load_trace(const std::string& path) {
  LoadResult r;
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    r.error = path + ": is a directory (expected a trace file)";
    return r;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    r.error = path + ": cannot open (" + std::strerror(errno) + ")";
    return r;
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    r.error = path + ": cannot read (" + std::strerror(errno) + ")";
    return r;
  }
  const std::string bytes = ss.str();
  if (bytes.empty()) {
    r.error = path + ": is empty (expected a fragless native trace, a PyTorch memory snapshot pickle or an RMM log CSV)";
    return r;
  }
  return trace_from_bytes(bytes, path);
}

bool write_file(const std::string& path, const std::string& bytes, std::string* error) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) {
    if (error) *error = path + ": cannot write (" + std::strerror(errno) + ")";
    return false;
  }
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    if (error) *error = path + ": cannot write (" + std::strerror(errno) + ")";
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace fragless::formats
