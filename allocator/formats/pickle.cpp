#include "pickle.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace fragless::formats {

const PyValue* PyValue::get(std::string_view key) const {
  if (type != Type::dict) return nullptr;
  constexpr std::size_t kScan = 16;  // PyTorch's dicts hold fewer keys: a scan is quicker than an index
  if (entries.size() <= kScan || entries.size() > UINT32_MAX) {
    for (std::size_t j = entries.size(); j-- > 0;)
      if (entries[j].first->type == Type::str && entries[j].first->s == key) return entries[j].second.get();
    return nullptr;
  }
  if (indexed_ != entries.size()) {
    index_.clear();
    for (std::size_t j = 0; j < entries.size(); ++j)
      if (entries[j].first->type == Type::str) index_.push_back(static_cast<std::uint32_t>(j));
    std::stable_sort(index_.begin(), index_.end(),
                     [&](std::uint32_t a, std::uint32_t b) { return entries[a].first->s < entries[b].first->s; });
    indexed_ = entries.size();
  }
  // The last position among equal keys: the value set last.
  auto it = std::upper_bound(index_.begin(), index_.end(), key,
                             [&](std::string_view k, std::uint32_t at) { return k < entries[at].first->s; });
  if (it == index_.begin() || entries[*std::prev(it)].first->s != key) return nullptr;
  return entries[*std::prev(it)].second.get();
}

namespace {

constexpr std::uint32_t kMaxDepth = 512;

// Note [The unpickler's memory budget]
// One byte of input can build one object (']' is an empty list, 'h' a reference), and an object costs about
// 190 bytes of memory here (kObjectCost), so a file of 30 MB of ']' would ask for 5.8 GB: memory proportional to the input is
// not bounded enough. What the reader builds (objects, their items and the bytes of their strings, as
// estimated by charge()) is limited to kBudgetBase + kBudgetPerByte times the input's size; past it the
// read fails with an error naming the budget. PyTorch's snapshots built 3 to 17 bytes per byte of input
// (17 without stack frames, whose repeated keys and frames are memoised; the shared traces and
// tools/make_big_snapshot.py's files measured so when a value took 112 bytes; at 144 the objects' part is
// about a fifth more); the ratio leaves room above that, and holds a file of
// empty lists to about a quarter of what it would build.
constexpr std::uint64_t kBudgetBase = std::uint64_t{256} << 20;
constexpr std::uint64_t kBudgetPerByte = 48;
constexpr std::uint64_t kObjectCost = sizeof(PyValue) + 48;  // the value, its control block, allocator slack

class Unpickler {
 public:
  Unpickler(std::string_view d, const ReadOptions& o)
      : d_(d), opts_(o), budget_(kBudgetBase + kBudgetPerByte * static_cast<std::uint64_t>(d.size())) {}

  std::uint64_t built() const { return built_; }

  PickleResult run() {
    PickleResult r;
    arena_ = r.arena.get();
    try {
      r.value = loop();
      r.end = pos_;
    } catch (const Error& e) {
      r.value = nullptr;
      r.error = e.what;
    }
    return r;
  }

 private:
  struct Error { std::string what; };

  [[noreturn]] void fail(const std::string& what) const {
    throw Error{"pickle: " + what + " at byte " + std::to_string(op_pos_)};
  }

  std::uint8_t byte() {
    if (pos_ >= d_.size()) fail("input ends inside an instruction (truncated file)");
    return static_cast<std::uint8_t>(d_[pos_++]);
  }
  std::string_view take(std::uint64_t n) {
    if (n > d_.size() - pos_)
      fail("declared length " + std::to_string(n) + " runs past the end of the input (a truncated or corrupt file)");
    auto v = d_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  std::uint64_t le(int n) {
    if (static_cast<std::uint64_t>(n) > d_.size() - pos_)
      fail("input ends inside an instruction's " + std::to_string(n) + "-byte argument (truncated file)");
    auto b = take(static_cast<std::uint64_t>(n));
    std::uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = v << 8 | static_cast<std::uint8_t>(b[static_cast<std::size_t>(i)]);
    return v;
  }
  std::string_view line() {
    const auto nl = d_.find('\n', pos_);
    if (nl == std::string_view::npos) fail("input ends inside a text argument (truncated file)");
    auto v = d_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return v;
  }

  // Counts `bytes` against the budget (Note [The unpickler's memory budget]).
  void charge(std::uint64_t bytes) {
    built_ += bytes;
    if (built_ > budget_)
      fail("the objects built would take more than " + std::to_string(budget_ >> 20) + " MiB (" +
           std::to_string(kBudgetBase >> 20) + " MiB + " + std::to_string(kBudgetPerByte) +
           " bytes per byte of a " + std::to_string(d_.size()) + "-byte input): not a memory snapshot");
  }

  PyRef make(PyValue::Type t) {
    charge(kObjectCost);
    auto v = std::make_shared<PyValue>();
    v->type = t;
    if (t == PyValue::Type::list || t == PyValue::Type::tuple || t == PyValue::Type::dict ||
        t == PyValue::Type::set)
      arena_->containers.push_back(v);
    return v;
  }
  // Integers are immutable once read, so equal ones may share one value: a snapshot repeats the same few
  // sizes, streams and devices, and each block's address in its alloc and free entries (Python's pickler
  // memoises containers and strings, never integers). A small direct-mapped cache finds most repeats
  // in a bounded table; a miss just makes a new value.
  PyRef make_int(std::int64_t i, bool wide = false) {
    const auto h = static_cast<std::uint64_t>(i) * 0x9e3779b97f4a7c15ULL;
    PyRef& slot = int_cache_[(h >> 52) ^ (wide ? 1u : 0u)];
    if (slot && slot->i == i && slot->wide == wide) return slot;
    auto v = make(PyValue::Type::integer);
    v->i = i;
    v->wide = wide;
    slot = v;
    return v;
  }
  // True, False and None are immutable singletons in Python; one value each here too.
  PyRef make_bool(bool b) {
    PyRef& slot = b ? true_ : false_;
    if (!slot) {
      slot = make(PyValue::Type::boolean);
      slot->i = b;
    }
    return slot;
  }
  PyRef make_none() {
    if (!none_) none_ = make(PyValue::Type::none);
    return none_;
  }
  PyRef make_str(std::string_view s, PyValue::Type t = PyValue::Type::str) {
    if (s.size() >= sizeof(std::string)) charge(s.size());  // shorter ones live inside the value
    auto v = make(t);
    v->s = std::string(s);
    return v;
  }
  // Signed little-endian two's-complement integer of n bytes (LONG1/LONG4). Every value in [-2^63, 2^64)
  // is read (PyTorch writes 2^64-1 in frame fields as LONG1 with 9 bytes); one outside is an error.
  PyRef make_long(std::string_view b) {
    if (b.empty()) return make_int(0);
    const bool negative = static_cast<std::uint8_t>(b.back()) & 0x80;
    // Bytes past the eighth that only extend the sign carry no value.
    while (b.size() > 8 && static_cast<std::uint8_t>(b.back()) == (negative ? 0xff : 0x00) &&
           (!negative || (static_cast<std::uint8_t>(b[b.size() - 2]) & 0x80)))
      b.remove_suffix(1);
    if (b.size() > 8) fail("integer outside [-2^63, 2^64) (" + std::to_string(b.size()) + " significant bytes)");
    std::uint64_t v = 0;
    for (std::size_t i = b.size(); i-- > 0;) v = v << 8 | static_cast<std::uint8_t>(b[i]);
    if (b.size() < 8 && negative) v |= ~std::uint64_t{0} << (8 * b.size());
    return make_int(static_cast<std::int64_t>(v), !negative && (v >> 63));  // wide: a positive number with the top bit set
  }

  void push(PyRef v) { stack_.push_back(std::move(v)); }
  PyRef pop() {
    if (stack_.size() <= mark_base()) fail("stack underflow");
    auto v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  PyRef& top() {
    if (stack_.size() <= mark_base()) fail("stack underflow");
    return stack_.back();
  }
  std::size_t mark_base() const { return marks_.empty() ? 0 : marks_.back(); }
  std::vector<PyRef> pop_mark() {
    if (marks_.empty()) fail("no MARK for this instruction");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyRef> out(std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(m)),
                           std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return out;
  }
  void add_child(PyValue& parent, const PyRef& child) {
    if (child->depth + 1 > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    if (child->depth + 1 > parent.depth) parent.depth = child->depth + 1;
  }
  void append(PyRef& container, std::vector<PyRef> items) {
    if (container->type != PyValue::Type::list && container->type != PyValue::Type::set)
      fail("APPEND/ADDITEMS to something that is not a list or set");
    charge(items.size() * sizeof(PyRef));
    for (auto& it : items) {
      add_child(*container, it);
      container->items.push_back(std::move(it));
    }
  }
  void set_items(PyRef& dict, std::vector<PyRef> kv) {
    if (dict->type != PyValue::Type::dict) fail("SETITEM(S) on something that is not a dict");
    if (kv.size() % 2) fail("SETITEMS with an odd number of values");
    charge(kv.size() * sizeof(PyRef));
    // Room for the batch at once (a dict's pairs usually come in one SETITEMS), growing geometrically so that
    // protocol 0's one SETITEM per pair stays linear.
    if (const std::size_t need = dict->entries.size() + kv.size() / 2; need > dict->entries.capacity())
      dict->entries.reserve(std::max(need, 2 * dict->entries.capacity()));
    for (std::size_t i = 0; i < kv.size(); i += 2) {
      add_child(*dict, kv[i]);
      add_child(*dict, kv[i + 1]);
      if (!opts_.count_only.empty()) count_only(*kv[i], *kv[i + 1]);
      dict->entries.emplace_back(std::move(kv[i]), std::move(kv[i + 1]));
    }
  }
  // ReadOptions::count_only: the list under such a key keeps its length and drops its items. (A list shared
  // through the memo is dropped once, where a dict first takes it under such a key; its length stays.)
  void count_only(const PyValue& key, PyValue& value) {
    if (key.type != PyValue::Type::str || value.type != PyValue::Type::list || value.items.empty()) return;
    for (std::string_view k : opts_.count_only)
      if (key.s == k) {
        value.dropped = value.items.size();
        built_ -= std::min<std::uint64_t>(built_, value.dropped * sizeof(PyRef));  // let go of: no longer held
        std::vector<PyRef>().swap(value.items);
        return;
      }
  }
  PyRef tuple(std::vector<PyRef> items) {
    auto t = make(PyValue::Type::tuple);
    charge(items.size() * sizeof(PyRef));
    for (auto& it : items) add_child(*t, it);
    t->items = std::move(items);
    return t;
  }
  // Writers number the memo densely from 0 (Python's pickler and TorchScript's alike), so the memo is a
  // vector; an index past its end (a hand-edited or optimised pickle) goes to a map. Either way each put
  // costs one slot, whatever index the input names.
  void memo_put(std::uint64_t idx) {
    charge(idx < memo_.size() ? 0 : idx == memo_.size() ? sizeof(PyRef) : 64);
    if (idx < memo_.size()) memo_[idx] = top();
    else if (idx == memo_.size()) memo_.push_back(top());
    else sparse_memo_[idx] = top();
  }
  PyRef memo_get(std::uint64_t idx) {
    if (idx < memo_.size() && memo_[idx]) return memo_[idx];
    if (auto it = sparse_memo_.find(idx); it != sparse_memo_.end()) return it->second;
    fail("memo index " + std::to_string(idx) + " not defined");
  }
  // The decimal argument of PUT and GET (protocol 0).
  std::uint64_t memo_index_text() {
    const std::string t(line());
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(t.c_str(), &end, 10);
    if (t.empty() || t[0] < '0' || t[0] > '9' || errno || end != t.c_str() + t.size()) fail("bad memo index '" + t + "'");
    return v;
  }
  // UNICODE's argument: Python's raw-unicode-escape (code points below 256 as single bytes, \uXXXX and
  // \UXXXXXXXX for the rest, and for '\\' and the newline) → UTF-8.
  std::string raw_unicode_escape(std::string_view in) {
    std::string out;
    for (std::size_t i = 0; i < in.size(); ++i) {
      std::uint32_t cp = static_cast<std::uint8_t>(in[i]);
      if (in[i] == '\\' && i + 1 < in.size() && (in[i + 1] == 'u' || in[i + 1] == 'U')) {
        const std::size_t n = in[i + 1] == 'u' ? 4 : 8;
        if (i + 2 + n > in.size()) fail("truncated \\u escape in a UNICODE string");
        cp = 0;
        for (std::size_t k = i + 2; k < i + 2 + n; ++k) {
          const int d = hex_digit(in[k]);
          if (d < 0) fail("bad \\u escape in a UNICODE string");
          cp = cp << 4 | static_cast<std::uint32_t>(d);
        }
        if (cp > 0x10ffff) fail("\\U escape past U+10FFFF in a UNICODE string");
        i += 1 + n;
      }
      append_utf8(out, cp);
    }
    return out;
  }
  static int hex_digit(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
  }
  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xc0 | cp >> 6));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xe0 | cp >> 12));
      out.push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3f)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      out.push_back(static_cast<char>(0xf0 | cp >> 18));
      out.push_back(static_cast<char>(0x80 | (cp >> 12 & 0x3f)));
      out.push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3f)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
  }
  // STRING's argument (protocol 0 from Python 2): a quoted literal with backslash escapes → its bytes.
  std::string quoted_string(std::string_view in) {
    if (in.size() < 2 || (in.front() != '\'' && in.front() != '"') || in.back() != in.front())
      fail("STRING argument is not a quoted literal");
    in = in.substr(1, in.size() - 2);
    std::string out;
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (in[i] != '\\' || i + 1 == in.size()) {
        out.push_back(in[i]);
        continue;
      }
      const char c = in[++i];
      switch (c) {
        case 'n': out.push_back('\n'); break;
        case 't': out.push_back('\t'); break;
        case 'r': out.push_back('\r'); break;
        case '0': out.push_back('\0'); break;
        case 'x': {
          const int hi = i + 2 < in.size() ? hex_digit(in[i + 1]) : -1, lo = hi < 0 ? -1 : hex_digit(in[i + 2]);
          if (lo < 0) fail("bad \\x escape in a STRING");
          out.push_back(static_cast<char>(hi << 4 | lo));
          i += 2;
          break;
        }
        default: out.push_back(c); break;  // \\, \', \"
      }
    }
    return out;
  }

  PyRef loop() {
    for (;;) {
      op_pos_ = pos_;
      const std::uint8_t op = byte();
      switch (op) {
        case 0x80: {                                                             // PROTO
          const int v = byte();
          if (v > 5) fail("unsupported pickle protocol " + std::to_string(v) + " (this reader knows 0 to 5)");
          break;
        }
        case 0x95: {  // FRAME: the next frame's length, which Python's unpickler reads whole (else "pickle exhausted")
          const std::uint64_t n = le(8);
          if (n > d_.size() - pos_)
            fail("a frame of " + std::to_string(n) + " bytes, past the end of the input (" + std::to_string(d_.size() - pos_) +
                 " bytes left: a truncated or corrupt file)");
          break;
        }
        case '.': {                                                              // STOP
          auto v = pop();
          if (!stack_.empty() || !marks_.empty()) fail("STOP with items left on the stack");
          return v;
        }
        case '(': marks_.push_back(stack_.size()); break;                        // MARK
        case '0': pop(); break;                                                  // POP
        case '1': pop_mark(); break;                                             // POP_MARK
        case '2': push(top()); break;                                            // DUP
        case 'N': push(make_none()); break;
        case 0x88: case 0x89: push(make_bool(op == 0x88)); break;               // NEWTRUE / NEWFALSE
        case 'K': push(make_int(byte())); break;                                 // BININT1
        case 'M': push(make_int(static_cast<std::int64_t>(le(2)))); break;      // BININT2
        case 'J': push(make_int(static_cast<std::int32_t>(le(4)))); break;      // BININT
        case 0x8a: { const auto n = byte(); push(make_long(take(n))); break; }  // LONG1
        case 0x8b: push(make_long(take(le(4)))); break;                          // LONG4
        case 'I': case 'L': {                                                    // INT / LONG (text)
          std::string t(line());
          if (!t.empty() && t.back() == 'L') t.pop_back();
          if (t == "01" || t == "00") { push(make_bool(t == "01")); break; }
          char* end = nullptr;
          errno = 0;
          const long long v = std::strtoll(t.c_str(), &end, 10);
          if (!t.empty() && t[0] != '-' && errno == ERANGE) {  // [2^63, 2^64): an unsigned 64-bit value
            errno = 0;
            const unsigned long long u = std::strtoull(t.c_str(), &end, 10);
            if (errno || end != t.c_str() + t.size()) fail("integer literal outside [-2^63, 2^64)");
            push(make_int(static_cast<std::int64_t>(u), true));
            break;
          }
          if (t.empty() || errno || end != t.c_str() + t.size()) fail("bad integer literal (or outside [-2^63, 2^64))");
          push(make_int(v));
          break;
        }
        case 'G': {                                                              // BINFLOAT (big-endian)
          auto b = take(8);
          std::uint64_t u = 0;
          for (char c : b) u = u << 8 | static_cast<std::uint8_t>(c);
          auto v = make(PyValue::Type::real);
          std::memcpy(&v->f, &u, 8);
          push(v);
          break;
        }
        case 'F': {                                                              // FLOAT (text)
          std::string t(line());
          char* end = nullptr;
          auto v = make(PyValue::Type::real);
          v->f = std::strtod(t.c_str(), &end);
          if (t.empty() || end != t.c_str() + t.size()) fail("bad float literal");
          push(v);
          break;
        }
        case 0x8c: { const auto n = byte(); push(make_str(take(n))); break; }    // SHORT_BINUNICODE
        case 'X': push(make_str(take(le(4)))); break;                            // BINUNICODE
        case 0x8d: push(make_str(take(le(8)))); break;                           // BINUNICODE8
        case 'V': push(make_str(raw_unicode_escape(line()))); break;             // UNICODE (raw-unicode-escape)
        case 'U': { const auto n = byte(); push(make_str(take(n))); break; }     // SHORT_BINSTRING
        case 'T': push(make_str(take(le(4)))); break;                            // BINSTRING
        case 'S': push(make_str(quoted_string(line()))); break;                  // STRING (quoted repr)
        case 'C': { const auto n = byte(); push(make_str(take(n), PyValue::Type::bytes)); break; }
        case 'B': push(make_str(take(le(4)), PyValue::Type::bytes)); break;
        case 0x8e: case 0x96: push(make_str(take(le(8)), PyValue::Type::bytes)); break;  // BINBYTES8 / BYTEARRAY8
        case '}': push(make(PyValue::Type::dict)); break;
        case ']': push(make(PyValue::Type::list)); break;
        case ')': push(make(PyValue::Type::tuple)); break;
        case 0x8f: push(make(PyValue::Type::set)); break;                        // EMPTY_SET
        case 'd': { auto kv = pop_mark(); auto dct = make(PyValue::Type::dict); set_items(dct, std::move(kv)); push(dct); break; }
        case 'l': { auto it = pop_mark(); auto lst = make(PyValue::Type::list); append(lst, std::move(it)); push(lst); break; }
        case 't': push(tuple(pop_mark())); break;
        case 0x91: { auto it = pop_mark(); auto st = make(PyValue::Type::set); append(st, std::move(it)); push(st); break; }  // FROZENSET
        case 0x85: { auto a = pop(); push(tuple({a})); break; }
        case 0x86: { auto b = pop(); auto a = pop(); push(tuple({a, b})); break; }
        case 0x87: { auto c = pop(); auto b = pop(); auto a = pop(); push(tuple({a, b, c})); break; }
        case 'a': { auto v = pop(); append(top(), {v}); break; }                 // APPEND
        case 'e': { auto it = pop_mark(); append(top(), std::move(it)); break; } // APPENDS
        case 0x90: { auto it = pop_mark(); append(top(), std::move(it)); break; } // ADDITEMS
        case 's': { auto v = pop(); auto k = pop(); set_items(top(), {k, v}); break; }  // SETITEM
        case 'u': { auto kv = pop_mark(); set_items(top(), std::move(kv)); break; }     // SETITEMS
        case 0x94: memo_put(memo_.size()); break;                                // MEMOIZE
        case 'q': memo_put(byte()); break;                                       // BINPUT
        case 'r': memo_put(le(4)); break;                                        // LONG_BINPUT
        case 'p': memo_put(memo_index_text()); break;                            // PUT
        case 'h': push(memo_get(byte())); break;                                 // BINGET
        case 'j': push(memo_get(le(4))); break;                                  // LONG_BINGET
        case 'g': push(memo_get(memo_index_text())); break;                      // GET
        case 'c': fail("refused GLOBAL: the file asks to import a Python object; only data is accepted");
        case 0x93: fail("refused STACK_GLOBAL: the file asks to import a Python object; only data is accepted");
        case 'R': fail("refused REDUCE: the file asks to call a Python object; only data is accepted");
        case 'b': fail("refused BUILD: the file asks to set an object's state; only data is accepted");
        case 'i': fail("refused INST: the file asks to build a Python object; only data is accepted");
        case 'o': fail("refused OBJ: the file asks to build a Python object; only data is accepted");
        case 0x81: fail("refused NEWOBJ: the file asks to build a Python object; only data is accepted");
        case 0x92: fail("refused NEWOBJ_EX: the file asks to build a Python object; only data is accepted");
        case 0x82: case 0x83: case 0x84: fail("refused EXT: the file refers to a registered extension object");
        case 'P': case 'Q': fail("refused PERSID: the file refers to a persistent object");
        case 0x97: case 0x98: fail("refused out-of-band buffer: only in-band data is accepted");
        default: {
          char buf[8];
          std::snprintf(buf, sizeof buf, "0x%02x", op);
          fail(std::string("unknown opcode ") + buf);
        }
      }
      if (stack_.size() > (std::size_t{1} << 26)) fail("stack too large");
    }
  }

  std::string_view d_;
  const ReadOptions& opts_;
  std::size_t pos_ = 0, op_pos_ = 0;
  std::vector<PyRef> stack_;
  std::vector<std::size_t> marks_;
  std::vector<PyRef> memo_;
  std::unordered_map<std::uint64_t, PyRef> sparse_memo_;
  PickleArena* arena_ = nullptr;
  const std::uint64_t budget_;
  std::uint64_t built_ = 0;
  std::vector<PyRef> int_cache_ = std::vector<PyRef>(4096);
  PyRef true_, false_, none_;
};

}  // namespace

PickleResult read_pickle(std::string_view data, const ReadOptions& options) {
  return Unpickler(data, options).run();
}

}  // namespace fragless::formats
