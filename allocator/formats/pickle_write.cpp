#include <bit>
#include <cassert>
#include <cstring>

#include "pickle.h"

namespace fragless::formats {

namespace {
constexpr char kProto = '\x80', kStop = '.', kMark = '(', kEmptyDict = '}', kSetItems = 'u', kEmptyList = ']',
               kAppends = 'e', kTuple = 't', kBinInt = 'J', kBinInt1 = 'K', kBinInt2 = 'M', kLong1 = '\x8a',
               kShortUnicode = '\x8c', kUnicode = 'X', kBinFloat = 'G', kTrue = '\x88', kFalse = '\x89', kNone = 'N',
               kMemoize = '\x94', kBinGet = 'h', kLongBinGet = 'j';

// A container opens with its opcode and a frame; a list or dict closes with the last batch's opcode where a
// batch is open, a tuple always with TUPLE.
template <class Frames>
void open_frame(std::string& out, Frames& open, char opcode, char kind) {
  out.push_back(opcode);
  open.push_back({kind});
}
template <class Frames>
void close_frame(std::string& out, Frames& open, char opcode) {
  if (open.back().kind == 't' || open.back().marked) out.push_back(opcode);
  open.pop_back();
}

}  // namespace

PickleWriter::PickleWriter() {
  out_.push_back(kProto);
  out_.push_back('\x04');
}

// Lists and dicts are written as CPython writes them: EMPTY_LIST (EMPTY_DICT), then batches of at most
// kBatch items (pairs), each MARK ... APPENDS (SETITEMS); an empty container has no batch at all.
void PickleWriter::before_item() {
  if (open_.empty()) return;
  Frame& f = open_.back();
  if (f.kind == 't' || f.marked) return;
  out_.push_back(kMark);
  f.marked = true;
}

void PickleWriter::after_item() {
  if (open_.empty()) return;
  Frame& f = open_.back();
  if (f.kind == 't') return;
  if (++f.items == (f.kind == 'd' ? 2 * kBatch : kBatch)) {
    out_.push_back(f.kind == 'd' ? kSetItems : kAppends);
    f.items = 0;
    f.marked = false;
  }
}

void PickleWriter::begin_dict() { before_item(); open_frame(out_, open_, kEmptyDict, 'd'); }
void PickleWriter::end_dict() { close_frame(out_, open_, kSetItems); after_item(); }
void PickleWriter::begin_list() { before_item(); open_frame(out_, open_, kEmptyList, 'l'); }
void PickleWriter::end_list() { close_frame(out_, open_, kAppends); after_item(); }
void PickleWriter::begin_tuple() { before_item(); open_frame(out_, open_, kMark, 't'); }
void PickleWriter::end_tuple() { close_frame(out_, open_, kTuple); after_item(); }

void PickleWriter::write_str(std::string_view s) {
  if (s.size() < 256) {
    out_.push_back(kShortUnicode);
    out_.push_back(static_cast<char>(s.size()));
  } else {
    out_.push_back(kUnicode);
    const auto n = static_cast<std::uint32_t>(s.size());
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>(n >> (8 * i)));
  }
  out_.append(s);
}

void PickleWriter::str(std::string_view s) {
  before_item();
  write_str(s);
  after_item();
}

// The memo is numbered densely from 0 in the order of MEMOIZE, as Python's pickler numbers it.
bool PickleWriter::recall(const std::string& key) {
  const auto it = memo_.find(key);
  if (it == memo_.end()) return false;
  get(it->second);
  return true;
}

void PickleWriter::get(std::uint32_t i) {
  last_ = i;
  before_item();
  if (i < 256) {
    out_.push_back(kBinGet);
    out_.push_back(static_cast<char>(i));
  } else {
    out_.push_back(kLongBinGet);
    for (int b = 0; b < 4; ++b) out_.push_back(static_cast<char>(i >> (8 * b)));
  }
  after_item();
}

void PickleWriter::also_known_as(const void* p) { by_object_.emplace(p, last_); }

bool PickleWriter::recall_object(const void* p) {
  const auto it = by_object_.find(p);
  if (it == by_object_.end()) return false;
  get(it->second);
  return true;
}

void PickleWriter::remember(const std::string& key) {
  // Only after recall(key) found nothing: a key written twice would shift every later index by one.
  last_ = static_cast<std::uint32_t>(memo_.size());
  const bool fresh = memo_.emplace(key, last_).second;
  assert(fresh);
  (void)fresh;
  out_.push_back(kMemoize);
}

void PickleWriter::shared_str(std::string_view s) {
  std::string key = "s";
  key.append(s);
  if (recall(key)) return;
  before_item();
  write_str(s);
  remember(key);  // before after_item, which may close the enclosing batch
  after_item();
}

bool PickleWriter::begin_shared_dict(const std::string& key) {
  const std::string k = "d" + key;
  if (recall(k)) return false;
  begin_dict();
  remember(k);  // the empty dict is on top until its first batch's MARK
  return true;
}

void PickleWriter::integer(std::int64_t v) {
  before_item();
  write_integer(v);
  after_item();
}

void PickleWriter::write_integer(std::int64_t v) {
  if (v >= 0 && v < 256) {
    out_.push_back(kBinInt1);
    out_.push_back(static_cast<char>(v));
  } else if (v >= 0 && v < 65536) {
    out_.push_back(kBinInt2);
    out_.push_back(static_cast<char>(v));
    out_.push_back(static_cast<char>(v >> 8));
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_.push_back(kBinInt);
    const auto u = static_cast<std::uint32_t>(static_cast<std::int32_t>(v));
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>(u >> (8 * i)));
  } else {
    // LONG1: little-endian two's complement, as few bytes as keep the sign.
    auto u = static_cast<std::uint64_t>(v);
    std::string b;
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<char>(u >> (8 * i)));
    while (b.size() > 1) {
      const auto last = static_cast<unsigned char>(b.back());
      const auto prev = static_cast<unsigned char>(b[b.size() - 2]);
      if ((last == 0 && !(prev & 0x80)) || (last == 0xff && (prev & 0x80))) b.pop_back();
      else break;
    }
    out_.push_back(kLong1);
    out_.push_back(static_cast<char>(b.size()));
    out_ += b;
  }
}

void PickleWriter::uinteger(std::uint64_t v) {
  if (v <= static_cast<std::uint64_t>(INT64_MAX)) return integer(static_cast<std::int64_t>(v));
  before_item();
  out_.push_back(kLong1);
  out_.push_back('\x09');
  for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>(v >> (8 * i)));
  out_.push_back('\0');  // positive
  after_item();
}

void PickleWriter::real(double v) {
  before_item();
  out_.push_back(kBinFloat);
  const auto u = std::bit_cast<std::uint64_t>(v);
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>(u >> (8 * i)));  // big-endian
  after_item();
}

void PickleWriter::boolean(bool v) {
  before_item();
  out_.push_back(v ? kTrue : kFalse);
  after_item();
}
void PickleWriter::none() {
  before_item();
  out_.push_back(kNone);
  after_item();
}

std::string PickleWriter::finish() {
  out_.push_back(kStop);
  return std::move(out_);
}

}  // namespace fragless::formats
