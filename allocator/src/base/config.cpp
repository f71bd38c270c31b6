#include "fragless/config.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <tuple>
#include <utility>
#include <vector>

namespace fragless {

namespace {
// The policies' names, both ways.
constexpr std::pair<PolicyKind, const char*> kPolicyNames[] = {
    {PolicyKind::classic, "classic"}, {PolicyKind::expandable, "expandable"}, {PolicyKind::fragless, "fragless"}};
}  // namespace

const char* policy_name(PolicyKind p) {
  for (const auto& [kind, name] : kPolicyNames)
    if (kind == p) return name;
  return "?";
}

std::optional<PolicyKind> policy_from_name(std::string_view name) {
  for (const auto& [kind, n] : kPolicyNames)
    if (name == n) return kind;
  return std::nullopt;
}


namespace {

// ---- Value parsers, for the table's rows: each returns "" when the value was right, else the forms a value
// may take (the parser names the key and what was typed around it).

bool parse_uint(std::string_view t, std::size_t* out) {
  if (t.empty() || t.size() > 19) return false;
  for (char c : t)
    if (c < '0' || c > '9') return false;
  *out = std::strtoull(std::string(t).c_str(), nullptr, 10);
  return true;
}

bool parse_double(std::string_view t, double* out) {
  if (t.empty()) return false;
  const std::string s(t);
  char* end = nullptr;
  errno = 0;
  *out = std::strtod(s.c_str(), &end);
  return errno == 0 && end == s.c_str() + s.size() && std::isfinite(*out);
}

std::string boolean(std::string_view v, bool* out) {
  if (v != "True" && v != "False") return "True or False (exactly)";
  *out = v == "True";
  return {};
}

// A whole number of MiB in [lo, hi], as bytes.
std::string mib(std::string_view v, std::size_t lo, std::size_t hi, const char* expected, std::size_t* out) {
  std::size_t n = 0;
  if (!parse_uint(v, &n) || n < lo || n > hi) return expected;
  *out = n > (SIZE_MAX >> 20) ? SIZE_MAX : n << 20;
  return {};
}

std::string fraction(std::string_view v, bool open, double* out) {
  double d = 0;
  if (!parse_double(v, &d) || !(open ? d > 0.0 && d < 1.0 : d >= 0.0 && d <= 1.0))
    return open ? "a number in (0, 1)" : "a number in [0, 1]";
  *out = d + 0.0;  // "-0" is zero: stored as +0, so nothing prints it as -0
  return {};
}

// Row parsers for a field of Options, by kind of value.
template <bool Options::*Field>
std::string flag(std::string_view v, Options& o) {
  return boolean(v, &(o.*Field));
}

template <std::size_t Options::*Field, std::size_t Lo, std::size_t Hi>
std::string mib_field(std::string_view v, Options& o) {
  // Made at each call, not kept in a function's static: the allocator may be made while another thread forks,
  // and a child forked during a static's first initialisation waits for ever on its guard (Note [Making the
  // allocator once]).
  const std::string expected = Lo == 20 ? std::string("an integer number of MiB, at least 20")
                                        : "an integer number of MiB between 1 and 2^" +
                                              std::to_string(std::bit_width(Hi) - 1);
  return mib(v, Lo, Hi, expected.c_str(), &(o.*Field));
}

template <double Options::*Field, bool Open>
std::string fraction_field(std::string_view v, Options& o) {
  return fraction(v, Open, &(o.*Field));
}

// Note [One options table]
// A key is written once: its row below gives its name, its accepted forms, its default and meaning (the
// README's table, `fragless-config --table` and `--help` print these) and the function that parses its
// value into Options. The parser knows no key by name but the list-valued one (whose row has no function:
// its value is the list grammar, divisions()) and the policy/expandable_segments rule (run()).
const char* fragless_policy_only(const Options& o) {
  return o.policy == PolicyKind::fragless ? nullptr : "the fragless policy only";
}
const char* classic_policy_only(const Options& o) {
  return o.policy == PolicyKind::classic
             ? nullptr
             : "the classic policy only (PyTorch's expandable segments ignore it too; the growable policies hold "
               "no whole segment it could free)";
}
const char* simulated_drivers_only(const Options& o) {
  return o.driver == DriverKind::cuda ? "the host and sim drivers only (the cuda driver's device has its own)" : nullptr;
}

constexpr OptionInfo kOptions[] = {
    {"policy", "classic, expandable or fragless", "fragless",
     "How address space and physical pages back blocks: PyTorch's native behaviour, PyTorch's "
     "expandable_segments, or fragless's re-backing policy.",
     [](std::string_view v, Options& o) -> std::string {
       if (const auto p = policy_from_name(v)) return o.policy = *p, std::string{};
       return "classic, expandable or fragless";
     }},
    {"expandable_segments", "True or False", "False",
     "PyTorch's key: True selects the expandable policy unless `policy` is also given; an allocator refuses it "
     "when it contradicts that policy (True with classic, False with expandable or fragless).",
     &flag<&Options::expandable_segments>},
    {"max_split_size_mb", "integer >= 20 (MiB)", "unlimited",
     "Cached blocks this large or larger serve only requests at least this large (and at most "
     "max_non_split_rounding_mb smaller than the block); with the classic policy they are never split (PyTorch's "
     "semantics, which its expandable segments share).",
     &mib_field<&Options::max_split_size, 20, SIZE_MAX>},
    {"max_non_split_rounding_mb", "integer >= 20 (MiB)", "20",
     "An oversize request may take a cached block at most this much larger.",
     &mib_field<&Options::max_non_split_rounding_size, 20, SIZE_MAX>},
    {"roundup_power2_divisions", "power of two >= 1, or list [MB:div,...,>:div] (div 0 or a power of two)", "off",
     "Round requests up to one of `div` steps between powers of two, per size interval (PyTorch's semantics).",
     nullptr},
    {"garbage_collection_threshold", "number in (0, 1)", "0 (off)",
     "With a memory fraction below 1: above this share of the limit, free the oldest whole cached segments "
     "(classic policy).",
     &fraction_field<&Options::garbage_collection_threshold, true>, &classic_policy_only},
    {"per_process_memory_fraction", "number in [0, 1]", "1",
     "Cap on physical memory this process may reserve, as a fraction of the device's total; any value below 1 is "
     "a cap, 0 included (nothing new can be reserved), as in PyTorch.",
     &fraction_field<&Options::per_process_memory_fraction, false>},
    {"driver", "cuda, host or sim", "cuda",
     "Backend: the real CUDA driver, host memory with cuMemMap semantics, or the counting simulator.",
     [](std::string_view v, Options& o) -> std::string {
       if (const auto d = driver_kind_from_name(v)) return o.driver = *d, std::string{};
       return "cuda, host or sim";
     }},
    {"page_size_mb", "power of two in [1, 1024] (MiB)", "2", "Page (granularity) of the host and sim drivers.",
     [](std::string_view v, Options& o) -> std::string {
       std::size_t n = 0;
       if (!parse_uint(v, &n) || n == 0 || n > 1024 || !std::has_single_bit(n))
         return "a power of two between 1 and 1024 (MiB)";
       return o.page_size = n << 20, std::string{};
     }, &simulated_drivers_only},
    {"capacity_mb", "integer in [1, 2^30] (MiB)", "host 4096, sim 81920",
     "Physical memory of one host or sim device; creating beyond it fails as out of memory.",
     &mib_field<&Options::capacity, 1, std::size_t{1} << 30>, &simulated_drivers_only},
    {"on_oom", "throw", "throw",
     "libfragless.so: fragless_malloc throws a C++ exception carrying the diagnosis on out of memory (PyTorch's "
     "normal path crashes on NULL). The value null was removed: torch.cuda.MemPool takes fragless_pool_malloc, "
     "which returns NULL.",
     [](std::string_view v, Options&) -> std::string {
       if (v == "null")
         return "throw (on_oom:null was removed: fragless_malloc always throws on out of memory, as a NULL "
                "crashes PyTorch's first kernel; give torch.cuda.MemPool the entry point fragless_pool_malloc, "
                "which returns NULL)";
       return v == "throw" ? std::string{} : std::string("throw");
     }},
    {"peer_access", "True or False", "True",
     "cuda driver: grant every peer device that can access this one (cuDeviceCanAccessPeer) access to fragless "
     "memory, as cudaMalloc memory is reachable by peers: one cuMemSetAccess per mapped range (adjacent mappings in one call), "
     "with one descriptor per device. False grants the owning device only (peer copies and NCCL P2P through it then fault).",
     &flag<&Options::peer_access>},
    {"shareable_handles", "True, False or fabric", "False",
     "create physical memory exportable, so that blocks can be shared with other processes (fragless.share): "
     "cuda driver: a POSIX file descriptor handle type (cuMemExportToShareableHandle) where the device "
     "supports it; host driver: a memfd per handle. fabric (cuda driver): fabric handles "
     "(CU_MEM_HANDLE_TYPE_FABRIC, multi-node NVLink; 64 bytes carried in the share's description), refused "
     "on a device without CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED. Off, sharing is refused.",
     [](std::string_view v, Options& o) -> std::string {
       o.fabric_handles = v == "fabric";
       if (o.fabric_handles) return o.shareable_handles = true, std::string{};
       return boolean(v, &o.shareable_handles).empty() ? std::string{} : "True, False or fabric (exactly)";
     }},
    {"handles", "pages, ends, whole or cells", "cells",
     "fragless policy: the shape of new physical handles (a mapping is always one whole handle). pages: one "
     "handle per page (finest re-backing, most cuMemCreate calls); ends: the body of a growth in handles of "
     "at most handle_max_mb, its last page in a handle of its own; whole: one handle per growth; cells: new "
     "memory in the cells expandable segments would create (chunk_size_mb in the large pool, shrunk to "
     "reserve_slack of live bytes, and 2 MiB in the small pool), the cells a request covers whole in one "
     "handle of at most handle_max_mb. With background:True, free multi-page handles are split into pieces of 1, 1, 2, 4, ... pages.",
     [](std::string_view v, Options& o) -> std::string {
       constexpr std::pair<std::string_view, HandleShape> shapes[] = {
           {"pages", HandleShape::pages}, {"ends", HandleShape::ends}, {"whole", HandleShape::whole},
           {"cells", HandleShape::cells}};
       for (const auto& [name, shape] : shapes)
         if (v == name) return o.handle_shape = shape, std::string{};
       return "pages, ends, whole or cells";
     }, &fragless_policy_only},
    {"handle_max_mb", "integer in [1, 2^20] (MiB)", "64",
     "fragless policy (handles ends or cells): the body of a growth is created in handles of at most this much; "
     "a live block that straddles a handle pins less than this of it, and one background split replaces at "
     "most this much. With handles cells, near the limit (a growth that would leave less than half of the "
     "process's memory still creatable) no handle is larger than chunk_size_mb.",
     &mib_field<&Options::handle_max, 1, std::size_t{1} << 20>, &fragless_policy_only},
    {"chunk_size_mb", "integer in [1, 2^20] (MiB)", "20",
     "fragless policy: with handles ends or whole, a growth's new handle may be rounded up to this much, mapped "
     "as free space after the request, to save cuMemCreate calls, never past reserve_slack of live bytes; with "
     "handles cells, the largest cell.",
     &mib_field<&Options::chunk_size, 1, std::size_t{1} << 20>, &fragless_policy_only},
    {"reserve_slack", "number in [0, 1]", "0.0078125 (1/128)",
     "fragless policy: memory is only created when the memory held cannot be put under the request; this "
     "share of live bytes bounds what a growth may create past its request (a cell of handles cells, the "
     "rounding of ends or whole) and what a refill that ends a re-backing cycle may add past the peak of live "
     "bytes (plus two pages). A repeated step whose cycle needs more keeps moving those pages every step (maps "
     "and a set-access on the allocation path, no create): 0.125 took those calls off the path on every "
     "fixed-shape workload of docs/RESULTS.md's \"Repeated steps\", for about what expandable segments hold.",
     &fraction_field<&Options::reserve_slack, false>, &fragless_policy_only},
    {"lend_pages", "True or False", "True",
     "fragless policy: pages of a hole on the requesting stream are mapped where needed without a "
     "synchronisation (the old mapping goes once the stream's queued work is done). False: synchronise and "
     "unmap first, as PyTorch does.",
     &flag<&Options::lend_pages>, &fragless_policy_only},
    {"lend_across_streams", "True or False", "True",
     "fragless policy (with lend_pages): a hole on another stream whose queued work is done is taken with no "
     "wait; a busy stream's hole only when creating the memory would exceed the device, and then lent: the "
     "requesting stream waits on the device (cuStreamWaitEvent) for the hole's stream, the host never waits. "
     "False: other streams' holes are taken only when the device is full, after synchronising their stream.",
     &flag<&Options::lend_across_streams>, &fragless_policy_only},
    {"small_in_remnants", "True or False", "True",
     "fragless policy: a small request (<= 1 MiB) that would grow the small pool may take a free large-pool "
     "block under 1 MiB, which no large request fits.",
     &flag<&Options::small_in_remnants>, &fragless_policy_only},
    {"growth_reserve", "True or False", "True",
     "fragless policy (with background): while growths into gaps between live blocks keep missing a page or "
     "so with nothing free to move there (a KV cache grown by torch.cat), the worker creates 2 MiB pages "
     "ahead of them, at most a cell (reserve_slack of live bytes, at most chunk_size_mb) and never past "
     "reserve_slack above the peak of live bytes, so that those growths map a page instead of waiting for "
     "cuMemCreate. The pages count as reserved; empty_cache and an out-of-memory retry give them back. False: "
     "none.",
     &flag<&Options::growth_reserve>, &fragless_policy_only},
    {"background", "True or False", "True",
     "A worker thread per device does the driver work no request waits for: with the fragless policy it "
     "splits a multi-page handle, once it is free, into pieces of 1, 1, 2, 4, ... pages in place (so its memory "
     "can be re-backed a piece at a time; a piece used and freed again becomes 2 MiB pages), unmaps each range lent without a synchronisation once the event recorded when it was lent has completed, creates pages ahead of growths (growth_reserve), and asks the driver for free "
     "memory (`cuMemGetInfo`) every 32 growths so that growths need not (once a split or a lent range has "
     "started it). It stops at process exit, before the CUDA driver tears down. False: none is done "
     "(growths then ask every 64).",
     [](std::string_view v, Options& o) -> std::string {
       bool on = false;
       if (std::string e = boolean(v, &on); !e.empty()) return e;
       return o.background = on ? BackgroundMode::thread : BackgroundMode::off, std::string{};
     }, &fragless_policy_only},
    {"trace", "file path; %p pid, %d device, %r rank, %% percent", "off",
     "Record every allocator event to this file in fragless's native format (one file per device with %d; "
     "use %r under torchrun). The path may not contain ',', ':', '[', ']' or whitespace.",
     [](std::string_view v, Options& o) -> std::string {
       for (std::size_t i = 0; i < v.size(); ++i)
         if (v[i] == '%' && (i + 1 >= v.size() || std::string_view("pdr%").find(v[i + 1]) == std::string_view::npos))
           return "a path where '%' is followed by p (pid), d (device), r (rank) or %";
         else if (v[i] == '%')
           ++i;
       return o.trace = std::string(v), std::string{};
     }},
};

// Any character std::isspace takes, as PyTorch's ConfigTokenizer drops (c10/core/AllocatorConfig.h).
bool is_space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }

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

const OptionInfo* row_of(std::string_view key) {
  for (const auto& o : kOptions)
    if (o.key == key) return &o;
  return nullptr;
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
    std::vector<std::string> keys;
    while (i_ < toks_.size()) {
      const std::size_t key_at = i_;
      const std::string key = toks_[i_++];
      if (key == ",")  // ",x:1", "x:1,,y:2": PyTorch refuses an empty item too ("Unrecognized key ','")
        return fail("FRAGLESS_CONF: an empty item (a ',' with no key:value before it" +
                    std::string(key_at == 0 ? ", at the start" : ", after another ','") + ")");
      if (key == ":")  // ":fragless", "policy:classic,:x": the tokenizer drops nothing but whitespace before ':'
        return fail("FRAGLESS_CONF: an empty key before ':'" +
                    (i_ < toks_.size() && toks_[i_] != "," ? " (value '" + written_[i_] + "')" : std::string()) +
                    ": every item is key:value (accepted keys: " + accepted_keys() + ")");
      if (key == "[" || key == "]")
        return fail("FRAGLESS_CONF: expected a key, found '" + key +
                    "' (a list [...] is the value of roundup_power2_divisions only)");
      if (!expect(":", key_at)) return fail();
      const OptionInfo* row = row_of(key);
      if (!row) return unknown_key(written_[key_at]), fail();
      if (written_[key_at] != key)  // PyTorch would read "max_split _size_mb" as a key: say what was typed
        return fail("FRAGLESS_CONF: key '" + written_[key_at] + "' has spaces inside (write '" + key + "')");
      // A key given twice would take its last value and silently drop the first: refused, as a typo is.
      if (std::find(keys.begin(), keys.end(), key) != keys.end())
        return fail("FRAGLESS_CONF: key '" + key + "' is given more than once (each key may be given once)");
      keys.push_back(key);
      if (i_ >= toks_.size()) return fail("FRAGLESS_CONF: key '" + key + "' has no value");
      if (!row->parse) {  // the list-valued key
        if (!divisions(key)) return fail();
      } else {
        const std::size_t value_at = i_;
        const std::string v = toks_[i_++];
        if (v == "[" || v == "]" || v == "," || v == ":")
          return fail(bad_value(key, v, "a single value (only roundup_power2_divisions takes a list)"));
        if (written_[value_at] != v)  // PyTorch would read "fra gless" as "fragless": say what was typed
          return fail(bad_value(key, written_[value_at], "a value without spaces inside"));
        if (!value(*row, v)) return fail();
      }
      if (i_ < toks_.size() && toks_[i_] != ",")
        return fail("FRAGLESS_CONF: expected ',' after the value of '" + key + "', found '" + toks_[i_] + "'");
      if (i_ < toks_.size()) ++i_;  // the ',' (one at the end is allowed, as PyTorch allows it)
    }
    // PyTorch's rule: expandable_segments:True selects the expandable policy unless this text names one.
    const auto given = [&](std::string_view k) { return std::find(keys.begin(), keys.end(), k) != keys.end(); };
    if (given("expandable_segments") && o_.expandable_segments && !given("policy")) o_.policy = PolicyKind::expandable;
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

  static bool is_key(std::string_view key) { return row_of(key) != nullptr; }

  bool unknown_key(const std::string& written) {
    for (std::string_view k : kPyTorchOnlyKeys)
      if (k == written)
        return err("FRAGLESS_CONF: '" + written + "' is a key of PyTorch's own allocator (PYTORCH_CUDA_ALLOC_CONF) and "
                   "configures nothing in fragless: leave it out (accepted keys: " + accepted_keys() + ")");
    return err("FRAGLESS_CONF: unknown key '" + written + "' (accepted keys: " + accepted_keys() + ")");
  }

  // The value of a key whose row parses it (Note [One options table]).
  bool value(const OptionInfo& row, const std::string& v) {
    if (std::string expected = row.parse(v, o_); !expected.empty()) return err(bad_value(row.key, v, expected));
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
    // As PyTorch's parser (c10/core/AllocatorConfig.cpp, parseRoundUpPower2Divisions): '>' fills the
    // intervals after the last one named, counting from interval 0 when none was (so interval 0, requests
    // under 2 MiB, keeps 0); the first size named also fills the intervals below it, even after a '>'.
    // Note [An entry the list overwrites]
    // PyTorch applies the entries in order, so an entry whose every
    // interval later entries set again ([64:4,128:2,128:8]'s 128:2, [1:4,>:8,>:2]'s first '>') changes nothing,
    // and would be ignored without a word: refused, as a key given twice is. An entry that still sets an
    // interval stands ([64:4,64:8]: the first fills the intervals below 64 MB).
    bool first = true;
    int last_index = 0;
    std::array<int, kRoundUpPowerOfTwoIntervals> owner;  // the entry that set each interval last (-1: none)
    owner.fill(-1);
    std::vector<std::string> entries;  // each entry as written, K:V or >:V
    auto set = [&](int j, std::size_t v) {
      table[static_cast<std::size_t>(j)] = v;
      owner[static_cast<std::size_t>(j)] = static_cast<int>(entries.size());
    };
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
        for (int j = last_index + 1; j < kRoundUpPowerOfTwoIntervals; ++j) set(j, v);
      } else {
        std::size_t mb = 0;
        if (!parse_uint(k, &mb) || !std::has_single_bit(mb))
          return err(bad_value(key, k, "interval starts in MB that are powers of two"));
        const int index = std::min<int>(std::bit_width(mb) - 1, kRoundUpPowerOfTwoIntervals - 1);
        if (first)
          for (int j = 0; j < index; ++j) set(j, v);
        first = false;
        set(index, v);
        last_index = index;
      }
      entries.push_back(k + ":" + vtok);
      if (i_ < toks_.size() && toks_[i_] == ",") ++i_;
    }
    for (std::size_t e = 0; e < entries.size(); ++e)
      if (std::find(owner.begin(), owner.end(), static_cast<int>(e)) == owner.end())
        return err(bad_value(key, entries[e], "entries that each set some interval (later entries set again every "
                                              "interval this one does; K names sizes from K to 2K MB, and from "
                                              "32768 MB on one interval)"));
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

std::string config_error_from(const std::string& error, std::string_view source) {
  constexpr std::string_view kPrefix = "FRAGLESS_CONF: ";
  if (error.compare(0, kPrefix.size(), kPrefix) != 0) return error;
  return std::string(source) + ": " + error.substr(kPrefix.size());
}

// Note [Keys that do nothing]
// A key that configures one policy or driver (its row's `applies`) given with another would be silently
// ignored by the allocator, so an allocator's text refuses it, naming the key, what it configures and the
// policy or driver the text selects. So does a contradiction: expandable_segments:True with the classic
// policy, or False with a growable one. And a host or sim capacity must be a whole number of pages (the driver
// would round it down, or fail at the first allocation). A replay runs one --conf under every policy it
// compares, so it parses with parse_config and keeps keys that tune one policy.
ConfigResult parse_allocator_config(std::string_view text) {
  ConfigResult r = parse_config(text);
  if (!r.ok) return r;
  const Options& o = r.options;
  const auto given = [&](std::string_view k) { return std::find(r.keys.begin(), r.keys.end(), k) != r.keys.end(); };
  auto refuse = [&](std::string msg) {
    ConfigResult bad;
    bad.error = "FRAGLESS_CONF: " + std::move(msg);
    return bad;
  };
  for (const std::string& key : r.keys)
    if (const OptionInfo* row = row_of(key); row && row->applies)
      if (const char* what = row->applies(o))
        return refuse("key '" + key + "' configures " + what + ", and this configuration selects the " +
                      std::string(policy_name(o.policy)) + " policy on the " + driver_kind_name(o.driver) +
                      " driver: leave it out");
  if (given("expandable_segments") && given("policy") && o.expandable_segments == (o.policy == PolicyKind::classic))
    return refuse(std::string("expandable_segments:") + (o.expandable_segments ? "True" : "False") +
                  " contradicts policy:" + policy_name(o.policy) + " (give one of the two)");
  // The host driver backs each growable segment with a reservation of 9/8 of the device, as the cuda driver
  // does (allocator/src/policy/growable.h), in a process's 128 TiB of address space: past a few TiB the reservations
  // fail and every allocation would be an out-of-memory naming nothing of this.
  if (constexpr std::size_t kHostMost = std::size_t{1} << 42; o.driver == DriverKind::host && o.capacity > kHostMost)
    return refuse("capacity_mb:" + std::to_string(o.capacity >> 20) + " is more than the host driver can reserve "
                  "address space for (9/8 of it per segment, in a process's 128 TiB): give capacity_mb:" +
                  std::to_string(kHostMost >> 20) + " (4 TiB) at most");
  if (o.driver != DriverKind::cuda && o.capacity && o.capacity % o.page_size != 0)
    return refuse("capacity_mb:" + std::to_string(o.capacity >> 20) + " is not a whole number of pages of " +
                  std::to_string(o.page_size >> 20) + " MiB (page_size_mb)");
  return r;
}

bool same_settings(const Options& a, const Options& b) {
  auto key = [](const Options& o) {
    return std::tie(o.policy, o.driver, o.max_split_size, o.max_non_split_rounding_size, o.roundup_power2_divisions,
                    o.garbage_collection_threshold, o.per_process_memory_fraction, o.page_size, o.capacity,
                    o.peer_access, o.shareable_handles, o.fabric_handles, o.trace, o.handle_shape, o.handle_max,
                    o.chunk_size, o.reserve_slack, o.lend_pages, o.lend_across_streams, o.small_in_remnants,
                    o.growth_reserve, o.background);
  };
  return key(a) == key(b);
}

ConfigResult config_from_environment() {
  const char* env = std::getenv("FRAGLESS_CONF");
  return parse_allocator_config(env ? env : "");
}

}  // namespace fragless
