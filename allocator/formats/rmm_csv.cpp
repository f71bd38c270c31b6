// RAPIDS RMM logging_resource_adaptor CSV: Thread,Time,Action,Pointer,Size,Stream.
#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include "trace_model.h"

namespace fragless::formats {

namespace {

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : line) {
    if (c == ',') {
      out.push_back(cur);
      cur.clear();
    } else if (c != '\r') {
      cur.push_back(c);
    }
  }
  out.push_back(cur);
  for (auto& s : out) {
    s.erase(0, s.find_first_not_of(' '));  // one erase: one per space cost a field of n spaces n^2
    while (!s.empty() && s.back() == ' ') s.pop_back();
  }
  return out;
}

bool parse_hex(std::string s, std::uint64_t* v) {
  if (s == "(nil)") {
    *v = 0;
    return true;
  }
  if (s.rfind("0x", 0) == 0 || s.rfind("0X", 0) == 0) s = s.substr(2);
  if (s.empty() || s.size() > 16) return false;
  std::uint64_t r = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return false;
    r = r << 4 | static_cast<std::uint64_t>(d);
  }
  *v = r;
  return true;
}

bool parse_dec(const std::string& s, std::uint64_t* v) {
  if (s.empty() || s.size() > 20) return false;
  std::uint64_t r = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    const auto d = static_cast<std::uint64_t>(c - '0');
    if (r > (UINT64_MAX - d) / 10) return false;  // past 2^64 - 1
    r = r * 10 + d;
  }
  *v = r;
  return true;
}

// Note [Times of day in an RMM log]
// RMM's logger writes the local time of day ("%H:%M:%S.%f", no date), so a run that passes midnight starts
// again at 00:00:00. A clock time more than half a day before the latest one read is taken as the next day's
// (a log whose rows are more than 12 hours apart with none between is read wrong; RMM writes a row per
// call), and one more than half a day after it, once a midnight has passed, as the day before's (a row of
// another thread stamped just before that midnight and written just after it). Rows written by several threads may be slightly out of order (the time is taken before the
// logger's lock): up to a second back is kept as recorded; more (a clock set back, a daylight-saving change)
// is refused, naming both rows. Plain microseconds never wrap. A time on some rows and not others is refused.
constexpr std::int64_t kDayUs = 86400LL * 1000000, kHalfDayUs = kDayUs / 2;

// HH:MM:SS[.f...] (RMM's form, up to six digits of the second: ".5" is half a second) or plain microseconds
// -> microseconds; -1 when empty, -2 when malformed or out of range (fields beyond a clock's, more digits than
// a microsecond's, or a value that would overflow).
std::int64_t parse_time(const std::string& s) {
  if (s.empty()) return -1;
  if (s.find(':') != std::string::npos) {
    std::uint64_t h = 0, m = 0, sec = 0, us = 0;
    const auto c1 = s.find(':'), c2 = s.find(':', c1 + 1), dot = s.find('.');
    if (c2 == std::string::npos) return -2;
    const std::string frac = dot == std::string::npos ? "" : s.substr(dot + 1);
    if (dot != std::string::npos && (dot < c2 || frac.empty() || frac.size() > 6)) return -2;
    if (!parse_dec(s.substr(0, c1), &h) || !parse_dec(s.substr(c1 + 1, c2 - c1 - 1), &m) ||
        !parse_dec(s.substr(c2 + 1, (dot == std::string::npos ? s.size() : dot) - c2 - 1), &sec) ||
        (!frac.empty() && !parse_dec(frac + std::string(6 - frac.size(), '0'), &us)))
      return -2;
    if (h >= 1000000 || m >= 60 || sec >= 61) return -2;
    return static_cast<std::int64_t>(((h * 60 + m) * 60 + sec) * 1000000 + us);
  }
  std::uint64_t v;
  if (parse_dec(s, &v) && v <= static_cast<std::uint64_t>(INT64_MAX)) return static_cast<std::int64_t>(v);
  return -2;
}

}  // namespace

LoadResult trace_from_rmm_csv(const std::string& text, const std::string& name) {
  LoadResult r;
  // Lines are taken from `text` one at a time, as std::getline would give them, without a second copy of the
  // whole log (an istringstream held one: reading a 470 MB log peaked at 1.7 GB).
  std::size_t at = 0;
  auto getline = [&](std::string* line) {
    if (at >= text.size()) return false;
    std::size_t nl = text.find('\n', at);
    if (nl == std::string::npos) nl = text.size();
    line->assign(text, at, nl - at);
    at = nl + 1;
    return true;
  };
  std::string line;
  std::size_t lineno = 0;
  auto fail = [&](const std::string& what) {
    r.ok = false;
    r.error = name + ":" + std::to_string(lineno) + ": " + what;
    return r;
  };
  if (!getline(&line)) return fail("empty file (expected the header Thread,Time,Action,Pointer,Size,Stream)");
  ++lineno;
  // A UTF-8 byte order mark (a spreadsheet's export) is not part of the first column's name.
  if (line.compare(0, 3, "\xEF\xBB\xBF") == 0) line.erase(0, 3);
  const auto header = split(line);
  std::map<std::string, std::size_t> col;
  for (std::size_t i = 0; i < header.size(); ++i)
    if (!col.emplace(header[i], i).second)
      return fail("column '" + header[i] + "' appears twice in the header (columns " + std::to_string(col[header[i]] + 1) +
                  " and " + std::to_string(i + 1) + ")");
  for (const char* need : {"Action", "Pointer", "Size"})
    if (!col.count(need)) return fail(std::string("missing column '") + need + "' in the header");
  const bool has_stream = col.count("Stream"), has_time = col.count("Time"), has_thread = col.count("Thread");
  Trace& t = r.trace;
  t.source = name;
  std::map<std::uint64_t, std::pair<std::size_t, std::uint64_t>> live;  // address -> the line that allocated it, size
  // Note [Times of day in an RMM log]: the clock's days passed, the latest time read and its line.
  std::int64_t days_us = 0, latest = -1;
  std::size_t latest_line = 0, timed = 0, untimed = 0;
  std::set<std::uint64_t> threads;  // ids other than 0 (what the writer gives every row)
  r.trace.events.reserve(static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')));  // a row a line
  while (getline(&line)) {
    ++lineno;
    if (line.empty() || line == "\r") continue;
    const auto f = split(line);
    if (f.size() != header.size())
      return fail("expected " + std::to_string(header.size()) + " fields (the header's), found " + std::to_string(f.size()));
    Event e;
    const std::string& action = f[col["Action"]];
    if (action == "allocate") e.op = Op::alloc;
    else if (action == "free") e.op = Op::free;
    else if (action == "allocate failure") e.op = Op::oom;  // a failed allocation: kept, not replayed
    else return fail("unknown action '" + action + "' (expected allocate, allocate failure or free)");
    if (!parse_hex(f[col["Pointer"]], &e.address)) return fail("bad pointer '" + f[col["Pointer"]] + "'");
    if (!parse_dec(f[col["Size"]], &e.size)) return fail("bad size '" + f[col["Size"]] + "'");
    if (has_stream && !parse_hex(f[col["Stream"]], &e.stream)) return fail("bad stream '" + f[col["Stream"]] + "'");
    if (has_thread) {
      std::uint64_t id = 0;
      const std::string& th = f[col["Thread"]];
      if (!parse_dec(th, &id) && !((th.rfind("0x", 0) == 0 || th.rfind("0X", 0) == 0) && parse_hex(th, &id)))
        return fail("bad thread id '" + th + "' (expected a number, as RMM's logger writes it)");
      if (id) threads.insert(id);
    }
    if (has_time) {
      const std::string& when = f[col["Time"]];
      e.time_us = parse_time(when);
      if (e.time_us == -2) return fail("bad time '" + when + "' (expected HH:MM:SS.ffffff or microseconds)");
      if (e.time_us > kMaxTimeUs)  // before any arithmetic on it (Note [One set of bounds for every format])
        return fail("time " + when + " µs is past " + std::to_string(kMaxTimeUs) + " (2^64 ns)");
      ++(e.time_us >= 0 ? timed : untimed);
      if (timed && untimed)
        return fail(e.time_us >= 0 ? "a time where the rows before had none" : "no time where the rows before had one");
      // A clock of 24 hours or more (fragless's writer, for a run longer than a day) is taken as written.
      if (e.time_us >= 0 && e.time_us < kDayUs && when.find(':') != std::string::npos) {
        e.time_us += days_us;
        if (latest >= 0 && e.time_us + kHalfDayUs < latest) {  // past midnight
          days_us += kDayUs;
          e.time_us += kDayUs;
        } else if (latest >= 0 && e.time_us > latest + kHalfDayUs && e.time_us >= kDayUs) {
          e.time_us -= kDayUs;  // a row a little out of order from just before the midnight already passed
        }
      }
      if (e.time_us >= 0 && latest >= 0 && e.time_us + kOutOfOrderUs < latest) {
        return fail("time " + when + " is " + seconds_text(latest - e.time_us) + " s before line " + std::to_string(latest_line) +
                    "'s (a clock set back? RMM logs the local time of day); rows may be out of order by at most 1 s");
      }
      if (e.time_us > latest) {
        latest = e.time_us;
        latest_line = lineno;
      }
      t.has_time |= e.time_us >= 0;
    }
    if (const std::string why = event_out_of_bounds(e); !why.empty()) return fail(why);  // its time too
    const std::string address = address_text(e.address);
    if (e.op == Op::oom || holds_nothing(e)) {
      // Nothing was allocated: no address to pair with a free.
    } else if (e.op == Op::alloc) {
      // As the native reader: a log records every call, so a second allocate of a live address means the
      // log is corrupt (or rows were lost), and replaying it would hold memory the program never held.
      if (const auto [it, inserted] = live.try_emplace(e.address, lineno, e.size); !inserted)
        return fail("address " + address + " allocated again without a free (allocated at line " +
                    std::to_string(it->second.first) + ")");
    } else if (const auto it = live.find(e.address); it == live.end()) {
      return fail("free of address " + address + " that was never allocated in this log");
    } else if (e.size != 0 && it->second.second != e.size) {
      // RMM's deallocate takes the size the allocation asked for: another size is a corrupt row, or a program
      // freeing what it did not allocate. (0, as hand-written logs put it, says no size.)
      return fail("free of address " + address + " with size " + std::to_string(e.size) + ", but line " +
                  std::to_string(it->second.first) + " allocated it with size " + std::to_string(it->second.second) +
                  " (RMM frees with the allocation's size)");
    } else {
      live.erase(it);
    }
    t.events.push_back(e);
  }
  if (!threads.empty())
    r.dropped = "the Thread column (" + std::to_string(threads.size()) + (threads.size() == 1 ? " thread" : " threads") +
                "; a log written from the trace names thread 0 on every row)";
  r.ok = true;
  return r;
}

// Note [Times in a converted RMM log]
// A replay weighs each moment by trace time, or by one unit per event when the trace has none
// (replay.cpp), so a conversion must keep that weighting. A trace without times gets one microsecond per
// event of the device, in order (the rows' position among the events the replay counts: allocations,
// frees, empty_cache), which weighs every event by one unit again. Allocations live before the window are
// stamped at the window's first time, not at 00:00:00, so the log's span is the window's.
//
// Note [Times of day in a converted RMM log]
// Times are written in the form RMM's logger writes them, the time of day ("%H:%M:%S.%f", hours 00 to 23), so
// that what reads RMM's logs reads these; the date is lost (a snapshot's times are wall-clock microseconds, and
// their time of day is UTC's, where RMM's logger writes the local time). The reader
// takes a step back of more than half a day as the next day (Note [Times of day in an RMM log]), which gives
// back every time exactly while consecutive rows are less than 12 hours apart. A trace with a longer gap is
// written as hours since the midnight before its first row instead (past 23 after that day), which the
// reader also takes back exactly; *lost names what a log loses.
std::string trace_to_rmm_csv(const Trace& t, int device, std::string* lost) {
  struct Row { const Event* e; std::int64_t us; const char* action; };
  std::vector<Row> rows;
  std::int64_t first = -1;
  if (t.has_time)
    for (const auto& e : t.events)
      if (e.device == device && e.time_us >= 0) {
        first = e.time_us;
        break;
      }
  rows.reserve(t.seed.size() + t.events.size());
  for (const auto& e : t.seed)
    if (e.device == device) rows.push_back({&e, std::max<std::int64_t>(first, 0), "allocate"});
  std::int64_t index = 0, last = std::max<std::int64_t>(first, 0);
  for (const auto& e : t.events) {
    if (e.device != device) continue;
    if (e.op == Op::oom) {  // a failed allocation: RMM's "allocate failure" row, at the time of the event before
      rows.push_back({&e, t.has_time && e.time_us >= 0 ? e.time_us : last, "allocate failure"});
      continue;
    }
    if (e.op != Op::alloc && e.op != Op::free && e.op != Op::empty_cache) continue;
    ++index;
    if (e.op == Op::empty_cache) continue;  // RMM's log has no such row
    const std::int64_t us = !t.has_time ? index : e.time_us >= 0 ? e.time_us : last;  // untimed rows keep the time
    last = us;
    rows.push_back({&e, us, e.op == Op::alloc ? "allocate" : "free"});
  }
  bool long_gap = false;
  for (std::size_t i = 1; i < rows.size() && !long_gap; ++i) long_gap = rows[i].us - rows[i - 1].us >= kHalfDayUs;
  const std::int64_t midnight = rows.empty() ? 0 : rows.front().us - rows.front().us % kDayUs;
  if (lost) {
    lost->clear();
    if (midnight > 0) *lost = "the date of its times (an RMM log has the time of day)";
    if (long_gap)
      *lost += std::string(lost->empty() ? "" : "; ") + "the time of day after the first day: rows 12 hours apart or "
               "more, so its times are hours since the first row's midnight";
  }
  std::string out = "Thread,Time,Action,Pointer,Size,Stream\n";
  out.reserve(out.size() + rows.size() * 52);  // a row is 45 to 60 bytes: one growth at most, not a doubling's copies
  char buf[160];
  for (const Row& r : rows) {
    const std::int64_t us = long_gap ? r.us - midnight : r.us % kDayUs;
    std::snprintf(buf, sizeof buf, "0,%02" PRId64 ":%02" PRId64 ":%02" PRId64 ".%06" PRId64 ",%s,0x%" PRIx64
                  ",%" PRIu64 ",%" PRIx64 "\n",
                  us / 3600000000, us / 60000000 % 60, us / 1000000 % 60, us % 1000000, r.action, r.e->address,
                  r.e->size, r.e->stream);
    out += buf;
  }
  return out;
}

}  // namespace fragless::formats
