#include "fragless/config.h"

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace fragless {

const char* policy_name(PolicyKind p) {
  switch (p) {
    case PolicyKind::classic: return "classic";
    case PolicyKind::expandable: return "expandable";
    case PolicyKind::fragless: return "fragless";
  }
  return "?";
}

const char* driver_kind_name(DriverKind d) {
  switch (d) {
    case DriverKind::cuda: return "cuda";
    case DriverKind::host: return "host";
    case DriverKind::sim: return "sim";
  }
  return "?";
}

std::optional<PolicyKind> policy_from_name(std::string_view name) {
  for (PolicyKind p : {PolicyKind::classic, PolicyKind::expandable, PolicyKind::fragless})
    if (name == policy_name(p)) return p;
  return std::nullopt;
}

std::optional<DriverKind> driver_kind_from_name(std::string_view name) {
  for (DriverKind d : {DriverKind::cuda, DriverKind::host, DriverKind::sim})
    if (name == driver_kind_name(d)) return d;
  return std::nullopt;
}

namespace {

constexpr OptionInfo kOptions[] = {
    {"policy", "classic, expandable or fragless", "fragless",
     "How address space and physical pages back blocks: PyTorch's native behaviour, PyTorch's "
     "expandable_segments, or fragless's re-backing policy."},
    {"expandable_segments", "True or False", "False",
     "PyTorch's key: True selects the expandable policy unless `policy` is also given."},
    {"max_split_size_mb", "integer >= 20 (MiB)", "unlimited",
     "Blocks this large or larger are never split; smaller requests never take them (PyTorch's semantics)."},
    {"max_non_split_rounding_mb", "integer >= 20 (MiB)", "20",
     "An oversize request may take a cached block at most this much larger."},
    {"roundup_power2_divisions", "power of two, or list [MB:div,...,>:div]", "0 (off)",
     "Round requests up to one of `div` steps between powers of two, per size interval (PyTorch's semantics)."},
    {"garbage_collection_threshold", "number in (0, 1)", "0 (off)",
     "With a memory fraction below 1: above this share of the limit, free the oldest whole cached segments "
     "(classic policy)."},
    {"per_process_memory_fraction", "number in [0, 1]", "1",
     "Cap on physical memory this process may reserve, as a fraction of the device's total."},
    {"driver", "cuda, host or sim", "cuda",
     "Backend: the real CUDA driver, host memory with cuMemMap semantics, or the counting simulator."},
    {"page_size_mb", "power of two >= 1 (MiB)", "2", "Page (granularity) of the host and sim drivers."},
    {"capacity_mb", "integer >= 1 (MiB)", "host 4096, sim 81920",
     "Physical memory of one host or sim device; creating beyond it fails as out of memory."},
    {"on_oom", "throw", "throw",
     "libfragless.so: fragless_malloc throws a C++ exception carrying the diagnosis on out of memory (PyTorch's "
     "normal path crashes on NULL). The value null was removed: torch.cuda.MemPool takes fragless_pool_malloc, "
     "which returns NULL."},
    {"peer_access", "True or False", "True",
     "cuda driver: grant every peer device that can access this one (cuDeviceCanAccessPeer) access to fragless "
     "memory, as cudaMalloc memory is reachable by peers: one cuMemSetAccess per mapping, with one descriptor per "
     "device. False grants the owning device only (peer copies and NCCL P2P through it then fault)."},
    {"shareable_handles", "True or False", "False",
     "create physical memory exportable, so that blocks can be shared with other processes (fragless.share): "
     "cuda driver: a POSIX file descriptor handle type (cuMemExportToShareableHandle) where the device "
     "supports it; host driver: a memfd per handle. Off, sharing is refused."},
    {"handles", "pages, ends, whole or cells", "cells",
     "fragless policy: the shape of new physical handles (a mapping is always one whole handle). pages: one "
     "handle per page (finest re-backing, most cuMemCreate calls); ends: the body of a growth in handles of "
     "at most handle_max_mb, its last page in a handle of its own; whole: one handle per growth; cells: new "
     "memory in the cells expandable segments would create (chunk_size_mb in the large pool, shrunk to "
     "reserve_slack of live bytes, and 2 MiB in the small pool), the cells a request covers whole in one "
     "handle of at most handle_max_mb. With background:True, free multi-page handles are split into pieces of 1, 1, 2, 4, ... pages."},
    {"handle_max_mb", "integer >= 1 (MiB)", "64",
     "fragless policy (handles ends or cells): the body of a growth is created in handles of at most this much; "
     "a live block that straddles a handle pins less than this of it, and one background split replaces at "
     "most this much."},
    {"chunk_size_mb", "integer >= 1 (MiB)", "20",
     "fragless policy: with handles ends or whole, a growth's new handle may be rounded up to this much, mapped "
     "as free space after the request, to save cuMemCreate calls, never past reserve_slack of live bytes; with "
     "handles cells, the largest cell."},
    {"reserve_slack", "number in [0, 1]", "0.0078125 (1/128)",
     "fragless policy: memory is only created when the memory held cannot be put under the request; this "
     "share of live bytes bounds what a growth may create past its request (a cell of handles cells, the "
     "rounding of ends or whole) and what a refill that ends a re-backing cycle may add past the peak of live "
     "bytes (plus two pages)."},
    {"lend_pages", "True or False", "True",
     "fragless policy: pages of a hole on the requesting stream are mapped where needed without a "
     "synchronisation (the old mapping goes once the stream's queued work is done). False: synchronise and "
     "unmap first, as PyTorch does."},
    {"lend_across_streams", "True or False", "True",
     "fragless policy (with lend_pages): pages of a hole on another stream are lent too; the requesting stream "
     "waits on the device (cuStreamWaitEvent) for the hole's stream, the host never waits. False: such holes "
     "are taken only after synchronising their stream, when the device is full."},
    {"small_in_remnants", "True or False", "True",
     "fragless policy: a small request (<= 1 MiB) that would grow the small pool may take a free large-pool "
     "block under 1 MiB, which no large request fits."},
    {"background", "True or False", "True",
     "A worker thread per device does the driver work no request waits for: with the fragless policy it "
     "splits multi-page handles into 2 MiB pages once they are free (so their memory can be re-backed page by "
     "page). False: none is done."},
    {"trace", "file path; %p pid, %d device, %r rank, %% percent", "off",
     "Record every allocator event to this file in fragless's native format (one file per device with %d; "
     "use %r under torchrun). The path may not contain ',' or ':'."},
};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// PyTorch's tokenizer: ',' ':' '[' ']' are tokens, whitespace is dropped. Each token also keeps the text
// as written (inner whitespace included), which is what an error shows: "handles ends" is the token
// "handlesends", and the user should read back what they typed.
struct Tokenizer {
  std::vector<std::string> tokens, written;
  explicit Tokenizer(std::string_view s) {
    std::string cur, raw;
    auto flush = [&] {
      if (!cur.empty()) {
        while (!raw.empty() && is_space(raw.back())) raw.pop_back();
        tokens.push_back(std::move(cur));
        written.push_back(std::move(raw));
      }
      cur.clear();
      raw.clear();
    };
    for (char c : s) {
      if (c == ',' || c == ':' || c == '[' || c == ']') {
        flush();
        tokens.emplace_back(1, c);
        written.emplace_back(1, c);
      } else if (!is_space(c)) {
        cur.push_back(c);
        raw.push_back(c);
      } else if (!cur.empty()) {
        raw.push_back(c);
      }
    }
    flush();
  }
};

// Keys of PyTorch's own allocator configuration (PYTORCH_CUDA_ALLOC_CONF) that configure nothing in
// fragless: refused with a message saying so, rather than as typos.
constexpr std::string_view kPyTorchOnlyKeys[] = {
    "backend", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse", "large_segment_size_mb",
    "pinned_free_catch_all", "throw_on_cudamalloc_oom", "expandable_segments_reserve",
    "expandable_segments_reserve_by_class"};

std::string accepted_keys() {
  std::string s;
  for (const auto& o : kOptions) {
    if (!s.empty()) s += ", ";
    s += o.key;
  }
  return s;
}

std::string bad_value(std::string_view key, std::string_view value, std::string_view expected) {
  return "FRAGLESS_CONF: bad value '" + std::string(value) + "' for key '" + std::string(key) + "': expected " +
         std::string(expected);
}

bool parse_uint(const std::string& t, std::size_t* out) {
  if (t.empty() || t.size() > 19) return false;
  for (char c : t)
    if (c < '0' || c > '9') return false;
  *out = std::strtoull(t.c_str(), nullptr, 10);
  return true;
}

bool parse_double(const std::string& t, double* out) {
  if (t.empty()) return false;
  char* end = nullptr;
  errno = 0;
  *out = std::strtod(t.c_str(), &end);
  return errno == 0 && end == t.c_str() + t.size() && std::isfinite(*out);
}

class Parser {
 public:
  Parser(std::string_view text, const Options& base) : o_(base) {
    Tokenizer t(text);
    toks_ = std::move(t.tokens);
    written_ = std::move(t.written);
    o_.settings = std::string(text);
  }

  ConfigResult run() {
    bool policy_given = false;
    bool expandable = false;
    std::vector<std::string> keys;
    while (i_ < toks_.size()) {
      const std::size_t key_at = i_;
      const std::string key = toks_[i_++];
      if (key == "," ) continue;
      if (!expect(":", key_at)) return fail();
      if (!is_key(key)) return unknown_key(written_[key_at]), fail();
      if (written_[key_at] != key)  // PyTorch would read "max_split _size_mb" as a key: say what was typed
        return fail("FRAGLESS_CONF: key '" + written_[key_at] + "' has spaces inside (write '" + key + "')");
      keys.push_back(key);
      if (i_ >= toks_.size()) return fail("FRAGLESS_CONF: key '" + key + "' has no value");
      if (key == "roundup_power2_divisions") {
        if (!divisions(key)) return fail();
      } else {
        const std::size_t value_at = i_;
        const std::string v = toks_[i_++];
        if (v == "[" || v == "]" || v == "," || v == ":")
          return fail(bad_value(key, v, "a single value (only roundup_power2_divisions takes a list)"));
        if (written_[value_at] != v)  // PyTorch would read "fra gless" as "fragless": say what was typed
          return fail(bad_value(key, written_[value_at], "a value without spaces inside"));
        if (!value(key, v, &policy_given, &expandable)) return fail();
      }
      if (i_ < toks_.size() && toks_[i_] != ",")
        return fail("FRAGLESS_CONF: expected ',' after the value of '" + key + "', found '" + toks_[i_] + "'");
    }
    if (expandable && !policy_given) o_.policy = PolicyKind::expandable;
    ConfigResult r;
    r.ok = true;
    r.options = o_;
    r.keys = std::move(keys);
    return r;
  }

 private:
  ConfigResult fail(std::string msg = {}) {
    ConfigResult r;
    r.error = msg.empty() ? err_ : msg;
    return r;
  }

  // The ':' after the key at toks_[key_at]; else an error naming the key as it was written.
  bool expect(const char* tok, std::size_t key_at) {
    if (i_ < toks_.size() && toks_[i_] == tok) {
      ++i_;
      return true;
    }
    const std::string& key = toks_[key_at];
    const std::string& written = written_[key_at];
    if (is_key(key)) return err("FRAGLESS_CONF: expected ':' after key '" + key + "'");
    // "handles ends": a known key, a space, a value.
    const std::string first = written.substr(0, written.find_first_of(" \t\n\r"));
    if (first != written && is_key(first)) {
      std::string rest = written.substr(first.size());
      rest.erase(0, rest.find_first_not_of(" \t\n\r"));
      return err("FRAGLESS_CONF: '" + written + "' is not key:value; a key and its value are joined by ':', as in '" +
                 first + ":" + rest + "'");
    }
    return unknown_key(written);
  }

  static bool is_key(std::string_view key) {
    for (const auto& o : kOptions)
      if (o.key == key) return true;
    return false;
  }

  bool unknown_key(const std::string& written) {
    for (std::string_view k : kPyTorchOnlyKeys)
      if (k == written)
        return err("FRAGLESS_CONF: '" + written + "' is a key of PyTorch's own allocator (PYTORCH_CUDA_ALLOC_CONF) and "
                   "configures nothing in fragless: leave it out (accepted keys: " + accepted_keys() + ")");
    return err("FRAGLESS_CONF: unknown key '" + written + "' (accepted keys: " + accepted_keys() + ")");
  }

  bool value(const std::string& key, const std::string& v, bool* policy_given, bool* expandable) {
    std::size_t n = 0;
    double d = 0;
    if (key == "policy") {
      if (const auto p = policy_from_name(v)) o_.policy = *p;
      else return err(bad_value(key, v, "classic, expandable or fragless"));
      *policy_given = true;
    } else if (key == "expandable_segments") {
      if (v != "True" && v != "False") return err(bad_value(key, v, "True or False (exactly)"));
      *expandable = v == "True";
    } else if (key == "max_split_size_mb" || key == "max_non_split_rounding_mb") {
      if (!parse_uint(v, &n) || n < 20) return err(bad_value(key, v, "an integer number of MiB, at least 20"));
      const std::size_t bytes = n > (SIZE_MAX >> 20) ? SIZE_MAX : n << 20;
      (key == "max_split_size_mb" ? o_.max_split_size : o_.max_non_split_rounding_size) = bytes;
    } else if (key == "garbage_collection_threshold") {
      if (!parse_double(v, &d) || !(d > 0.0 && d < 1.0)) return err(bad_value(key, v, "a number in (0, 1)"));
      o_.garbage_collection_threshold = d;
    } else if (key == "per_process_memory_fraction") {
      if (!parse_double(v, &d) || !(d >= 0.0 && d <= 1.0)) return err(bad_value(key, v, "a number in [0, 1]"));
      o_.per_process_memory_fraction = d;
    } else if (key == "driver") {
      if (const auto d = driver_kind_from_name(v)) o_.driver = *d;
      else return err(bad_value(key, v, "cuda, host or sim"));
    } else if (key == "page_size_mb") {
      if (!parse_uint(v, &n) || n == 0 || n > 1024 || !std::has_single_bit(n))
        return err(bad_value(key, v, "a power of two between 1 and 1024 (MiB)"));
      o_.page_size = n << 20;
    } else if (key == "capacity_mb") {
      if (!parse_uint(v, &n) || n == 0 || n > (std::size_t{1} << 30))
        return err(bad_value(key, v, "an integer number of MiB between 1 and 2^30"));
      o_.capacity = n << 20;
    } else if (key == "on_oom") {
      if (v == "null")
        return err("fragless: on_oom:null was removed: fragless_malloc always throws on out of memory (a NULL "
                   "crashes PyTorch's first kernel); give torch.cuda.MemPool the entry point fragless_pool_malloc, "
                   "which returns NULL");
      if (v != "throw") return err(bad_value(key, v, "throw"));
    } else if (key == "peer_access") {
      if (v != "True" && v != "False") return err(bad_value(key, v, "True or False (exactly)"));
      o_.peer_access = v == "True";
    } else if (key == "shareable_handles") {
      if (v != "True" && v != "False") return err(bad_value(key, v, "True or False (exactly)"));
      o_.shareable_handles = v == "True";
    } else if (key == "handles") {
      if (v == "pages") o_.handle_shape = HandleShape::pages;
      else if (v == "ends") o_.handle_shape = HandleShape::ends;
      else if (v == "whole") o_.handle_shape = HandleShape::whole;
      else if (v == "cells") o_.handle_shape = HandleShape::cells;
      else return err(bad_value(key, v, "pages, ends, whole or cells"));
    } else if (key == "handle_max_mb") {
      if (!parse_uint(v, &n) || n == 0 || n > (std::size_t{1} << 20))
        return err(bad_value(key, v, "an integer number of MiB between 1 and 2^20"));
      o_.handle_max = n << 20;
    } else if (key == "chunk_size_mb") {
      if (!parse_uint(v, &n) || n == 0 || n > (std::size_t{1} << 20))
        return err(bad_value(key, v, "an integer number of MiB between 1 and 2^20"));
      o_.chunk_size = n << 20;
    } else if (key == "reserve_slack") {
      if (!parse_double(v, &d) || !(d >= 0.0 && d <= 1.0)) return err(bad_value(key, v, "a number in [0, 1]"));
      o_.reserve_slack = d;
    } else if (key == "lend_pages" || key == "small_in_remnants" || key == "lend_across_streams") {
      if (v != "True" && v != "False") return err(bad_value(key, v, "True or False (exactly)"));
      (key == "lend_pages" ? o_.lend_pages : key == "small_in_remnants" ? o_.small_in_remnants
                                                                          : o_.lend_across_streams) = v == "True";
    } else if (key == "background") {
      if (v != "True" && v != "False") return err(bad_value(key, v, "True or False (exactly)"));
      o_.background = v == "True" ? BackgroundMode::thread : BackgroundMode::off;
    } else if (key == "trace") {
      for (std::size_t i = 0; i < v.size(); ++i)
        if (v[i] == '%' && (i + 1 >= v.size() || std::string_view("pdr%").find(v[i + 1]) == std::string_view::npos))
          return err(bad_value(key, v, "a path where '%' is followed by p (pid), d (device), r (rank) or %"));
        else if (v[i] == '%')
          ++i;
      o_.trace = v;
    } else {
      return unknown_key(key);
    }
    return true;
  }

  // roundup_power2_divisions: a single power of two, or [K:V,...,>:V] (PyTorch's semantics).
  bool divisions(const std::string& key) {
    auto& table = o_.roundup_power2_divisions;
    if (toks_[i_] != "[") {
      std::size_t v = 0;
      if (!parse_uint(toks_[i_], &v) || !std::has_single_bit(v))
        return err(bad_value(key, toks_[i_], "a power of two, or a list like [256:1,512:2,>:8]"));
      ++i_;
      table.fill(v);
      return true;
    }
    ++i_;
    table.fill(0);
    bool first = true;
    int last_index = -1;
    while (i_ < toks_.size() && toks_[i_] != "]") {
      const std::string k = toks_[i_++];
      if (i_ + 1 >= toks_.size() || toks_[i_] != ":")
        return err(bad_value(key, k, "list entries of the form MB:divisions or >:divisions"));
      ++i_;
      const std::string vtok = toks_[i_++];
      std::size_t v = 0;
      if (!parse_uint(vtok, &v) || (v != 0 && !std::has_single_bit(v)))
        return err(bad_value(key, vtok, "divisions that are 0 or a power of two"));
      if (k == ">") {
        for (int j = last_index + 1; j < kRoundUpPowerOfTwoIntervals; ++j) table[static_cast<std::size_t>(j)] = v;
      } else {
        std::size_t mb = 0;
        if (!parse_uint(k, &mb) || !std::has_single_bit(mb))
          return err(bad_value(key, k, "interval starts in MB that are powers of two"));
        const int index = std::min<int>(std::bit_width(mb) - 1, kRoundUpPowerOfTwoIntervals - 1);
        if (first)
          for (int j = 0; j < index; ++j) table[static_cast<std::size_t>(j)] = v;
        table[static_cast<std::size_t>(index)] = v;
        last_index = index;
      }
      first = false;
      if (i_ < toks_.size() && toks_[i_] == ",") ++i_;
    }
    if (i_ >= toks_.size()) return err("FRAGLESS_CONF: unterminated list for key '" + key + "' (missing ']')");
    ++i_;  // ]
    return true;
  }

  bool err(std::string m) {
    err_ = std::move(m);
    return false;
  }

  std::vector<std::string> toks_;
  std::vector<std::string> written_;  // each token as written (Tokenizer)
  std::size_t i_ = 0;
  Options o_;
  std::string err_;
};

}  // namespace

std::span<const OptionInfo> option_table() { return kOptions; }

ConfigResult parse_config(std::string_view text, const Options& base) { return Parser(text, base).run(); }

ConfigResult config_from_environment() {
  const char* env = std::getenv("FRAGLESS_CONF");
  return parse_config(env ? env : "");
}

}  // namespace fragless
