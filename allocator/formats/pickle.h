// A pickle reader that accepts data only.
//
// Understands protocols 0–5 for dicts, lists, tuples, sets, str, bytes, int, float, bool, None, the memo
// and frames. Every opcode that could build an object or run code (GLOBAL, STACK_GLOBAL, REDUCE, BUILD,
// INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT*, PERSID, BINPERSID, buffers) is refused with an error naming it and
// its offset: nothing from the input is ever executed or looked up. Bounded: nesting depth, declared
// lengths (checked against the bytes left) and integer widths are limited, and the memo grows by one slot
// per put whatever index the input names.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fragless::formats {

struct PyValue;
using PyRef = std::shared_ptr<PyValue>;

// One value per object read; a snapshot holds several per trace entry, so the small fields come first, packed
// (144 bytes with a 64-bit libstdc++). Integers, True, False and None may be shared between parents: nothing changes a value once read
// but a list under a ReadOptions::count_only key.
struct PyValue {
  enum class Type : std::uint8_t { none, boolean, integer, real, str, bytes, list, tuple, dict, set } type = Type::none;
  bool wide = false;  // an integer in [2^63, 2^64): its value is static_cast<std::uint64_t>(i)
  std::uint32_t depth = 1;
  std::int64_t i = 0;
  double f = 0;
  std::string s;                                // str (UTF-8) and bytes
  std::vector<PyRef> items;                     // list, tuple, set
  std::vector<std::pair<PyRef, PyRef>> entries; // dict, insertion order
  // A list read with ReadOptions::count_only under its key: its items were dropped once its dict took it,
  // and this is how many there were (items is then empty).
  std::size_t dropped = 0;
  mutable std::vector<std::uint32_t> index_;  // get(): entries' positions by key, then position (large dicts)
  mutable std::size_t indexed_ = 0;           // entries.size() when index_ was made

  // Dict lookup by string key (nullptr if absent or not a dict). A key set twice gives its last value, as
  // Python's dict does. Large dicts are searched through an index made at the first lookup (a hostile
  // file may look one dict of many keys up once per reference to it).
  const PyValue* get(std::string_view key) const;
  bool is_number() const { return type == Type::integer || type == Type::real || type == Type::boolean; }
  std::int64_t as_int() const { return type == Type::real ? static_cast<std::int64_t>(f) : i; }
  std::uint64_t as_uint() const { return static_cast<std::uint64_t>(as_int()); }
  // The integer in decimal, as Python prints it (wide values unsigned).
  std::string int_text() const {
    return wide ? std::to_string(static_cast<std::uint64_t>(i)) : std::to_string(i);
  }
};

// Owns every container read, and empties them all when destroyed: a hostile file cannot leak memory
// through reference cycles built with the memo, and destruction never recurses deeply.
struct PickleArena {
  std::vector<PyRef> containers;
  ~PickleArena() {
    for (auto& c : containers) {
      c->items.clear();
      c->entries.clear();
    }
  }
};

struct PickleResult {
  PyRef value;        // null on error
  std::string error;  // names the problem and the byte offset
  std::size_t end = 0;  // bytes read through STOP (what follows is not the pickle's, as for Python's pickle.load)
  std::shared_ptr<PickleArena> arena = std::make_shared<PickleArena>();  // declared last: destroyed first
};

struct ReadOptions {
  // Dict keys whose list values are only counted: a list set under one of them keeps its length
  // (PyValue::dropped) and lets go of its items as soon as the dict holds it, so a reader that needs only
  // how many there were (a snapshot's stack frames, hundreds of bytes per trace entry) does not keep them.
  std::vector<std::string_view> count_only;
};

PickleResult read_pickle(std::string_view data, const ReadOptions& options = {});

}  // namespace fragless::formats

namespace fragless::formats {

// A streaming pickle writer (protocol 4, no frames; the memo only for shared_str and begin_shared_dict) for
// the data types the reader accepts: what Python's pickle.load and PyTorch's viewer read back as plain
// dicts, lists, tuples, str, int, float, bool and None.
class PickleWriter {
 public:
  PickleWriter();
  void begin_dict();   // then key, value, key, value, ...
  void end_dict();
  void begin_list();
  void end_list();
  void begin_tuple();
  void end_tuple();
  void str(std::string_view s);
  void integer(std::int64_t v);
  void uinteger(std::uint64_t v);
  void real(double v);
  void boolean(bool v);
  void none();
  // Key-value helpers inside a dict.
  void kv(std::string_view k, std::string_view v) { str(k); str(v); }
  void kv_int(std::string_view k, std::int64_t v) { str(k); integer(v); }
  void kv_uint(std::string_view k, std::uint64_t v) { str(k); uinteger(v); }
  // Objects written once and referred to after, as Python's pickler shares an object it meets twice (and
  // PyTorch's snapshots share their frames): shared_str writes s the first time (MEMOIZE) and a reference
  // (BINGET) after; begin_shared_dict begins a dict remembered under `key` and returns true (write its items,
  // then end_dict), or writes a reference to the one begun under that key before and returns false.
  void shared_str(std::string_view s);
  bool begin_shared_dict(const std::string& key);
  // The same by the caller's object: after shared_str or begin_shared_dict, also_known_as(p) lets
  // recall_object(p) write a reference to what they just wrote or referred to, without building its key
  // again. p must name the same value for the writer's life (an object the caller keeps alive and unchanged).
  void also_known_as(const void* p);
  bool recall_object(const void* p);
  std::string finish();  // STOP; the writer is spent

  // Items per APPENDS / pairs per SETITEMS, as CPython's pickler batches them. A reader that spreads one
  // batch into one call (PyTorch's MemoryViz.js does) overflows its stack on a list of ~10^5 items.
  static constexpr std::size_t kBatch = 1000;

 private:
  // An open list or dict: items written into its current batch, and whether the batch's MARK is out.
  struct Frame { char kind; std::size_t items = 0; bool marked = false; };
  void write_integer(std::int64_t v);
  void write_str(std::string_view s);
  bool recall(const std::string& key);  // writes a reference to the object remembered under key, if any
  void remember(const std::string& key);  // MEMOIZE: the object on top is remembered under key
  void before_item();  // opens the enclosing container's batch if needed
  void after_item();   // closes it after kBatch items (dict: 2 * kBatch, keys and values)
  std::string out_;
  std::vector<Frame> open_;
  void get(std::uint32_t index);   // BINGET or LONG_BINGET
  std::unordered_map<std::string, std::uint32_t> memo_;  // key ("s" + a string, "d" + a dict's) -> index
  std::unordered_map<const void*, std::uint32_t> by_object_;  // also_known_as -> index
  std::uint32_t last_ = 0;  // the index recall or remember last met
};

}  // namespace fragless::formats
