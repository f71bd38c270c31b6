#include "unwind.h"

#include <execinfo.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#include <mutex>
#include <unordered_map>

#include "made_once.h"
#endif

namespace fragless::stacks {

namespace {
std::atomic<unsigned long long> g_misses{0}, g_fallbacks{0};
}  // namespace

[[gnu::noinline]] int unwind_with_backtrace(void** out, int max, int skip) {
  constexpr int kMax = 256;
  void* buf[kMax];
  const int n = backtrace(buf, std::min(kMax, max + skip + 8));
  // The caller's frames start at this function's return address: usually buf[1] (buf[0] is in here), later
  // where a sanitizer's interceptor of backtrace put frames of its own in between.
  void* const ret = __builtin_return_address(0);
  int first = 1;
  for (int i = 0; i < n; ++i)
    if (buf[i] == ret) {
      first = i;
      break;
    }
  int k = 0;
  for (int i = first + skip; i < n && k < max; ++i) out[k++] = buf[i];
  return k;
}

UnwindCounters unwind_counters() {
  UnwindCounters c;
  c.misses = g_misses.load(std::memory_order_relaxed);
  c.fallbacks = g_fallbacks.load(std::memory_order_relaxed);
  return c;
}

#if !(defined(__x86_64__) && defined(__linux__))

[[gnu::noinline]] int unwind(void** out, int max, int skip) {
  g_fallbacks.fetch_add(1, std::memory_order_relaxed);
  const int n = unwind_with_backtrace(out, max, skip + 1);  // +1: this function
  __asm__ volatile("" ::: "memory");  // not a tail call
  return n;
}

void lock_unwind_table() {}
void unlock_unwind_table() {}

#else

namespace {

// Note [A cached unwind rule]
// On x86-64 a frame's DWARF call-frame information, at any instruction, almost always says: the canonical
// frame address (CFA, the caller's stack pointer) is rsp or rbp plus a constant; the return address is
// saved at CFA - 8; rbp is unchanged or saved at CFA plus a constant. So the whole answer for one return
// address fits in a few integers: computed once by interpreting the FDE's instructions up to that address
// (slow: a search for the FDE, then a small interpreter), then reused, which is what makes the walk cheap.
// Anything else (a CFA given by an expression, as in signal trampolines; rbp restored from another
// register) is `unknown` and ends the walk; a return address the CFI marks undefined (_start, a thread's
// start) is the outermost frame. The same scheme is used by PyTorch's unwinder
// (torch/csrc/profiler/unwind), which caches one such rule per instruction address.
struct Rule {
  enum Kind : std::uint8_t { unknown = 0, outermost, step };
  Kind kind = unknown;
  std::uint8_t cfa_reg = 0;     // kRsp or kRbp
  bool rbp_saved = false;       // rbp's value in the caller is at CFA + rbp_off (else unchanged)
  std::int32_t cfa_off = 0;
  std::int32_t ra_off = 0;      // the return address is at CFA + ra_off
  std::int32_t rbp_off = 0;
};

constexpr int kRbp = 6, kRsp = 7, kRa = 16;  // DWARF register numbers on x86-64

// --- Reading .eh_frame ------------------------------------------------------------------------------------

struct Reader {
  const std::uint8_t* p;
  const std::uint8_t* end;
  bool bad = false;

  bool more() const { return !bad && p < end; }
  std::uint8_t u8() {
    if (p >= end) return fail();
    return *p++;
  }
  template <class T>
  T fixed() {
    if (end - p < static_cast<std::ptrdiff_t>(sizeof(T))) return static_cast<T>(fail());
    T v;
    std::memcpy(&v, p, sizeof v);
    p += sizeof v;
    return v;
  }
  std::uint64_t uleb() {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      const std::uint8_t b = u8();
      v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    return fail();
  }
  std::int64_t sleb() {
    std::int64_t v = 0;
    int shift = 0;
    std::uint8_t b = 0;
    do {
      if (shift >= 64) return static_cast<std::int64_t>(fail());
      b = u8();
      v |= static_cast<std::int64_t>(b & 0x7f) << shift;
      shift += 7;
    } while (b & 0x80);
    if (shift < 64 && (b & 0x40)) v |= -(static_cast<std::int64_t>(1) << shift);
    return v;
  }
  // A pointer in the DW_EH_PE encoding `enc` (only what GCC and Clang emit in .eh_frame: absolute or
  // pc-relative; data- and text-relative need bases this reader does not need).
  std::uintptr_t pointer(std::uint8_t enc) {
    if (enc == 0xff) return 0;  // DW_EH_PE_omit
    const std::uintptr_t here = reinterpret_cast<std::uintptr_t>(p);
    std::uintptr_t v = 0;
    switch (enc & 0x0f) {
      case 0x00: v = fixed<std::uint64_t>(); break;
      case 0x01: v = uleb(); break;
      case 0x02: v = fixed<std::uint16_t>(); break;
      case 0x03: v = fixed<std::uint32_t>(); break;
      case 0x04: v = fixed<std::uint64_t>(); break;
      case 0x09: v = static_cast<std::uintptr_t>(sleb()); break;
      case 0x0a: v = static_cast<std::uintptr_t>(static_cast<std::intptr_t>(fixed<std::int16_t>())); break;
      case 0x0b: v = static_cast<std::uintptr_t>(static_cast<std::intptr_t>(fixed<std::int32_t>())); break;
      case 0x0c: v = static_cast<std::uintptr_t>(fixed<std::int64_t>()); break;
      default: return fail();
    }
    switch (enc & 0x70) {
      case 0x00: break;
      case 0x10: v += here; break;  // DW_EH_PE_pcrel
      default: return fail();
    }
    if (enc & 0x80) return fail();  // indirect: not in FDE addresses
    return v;
  }
  std::uint64_t fail() {
    bad = true;
    p = end;
    return 0;
  }
};

// One register's rule while the CFA program runs.
struct RegRule {
  enum Kind : std::uint8_t { same, undefined, offset, other } kind = same;
  std::int64_t off = 0;
};

struct Row {
  int cfa_reg = kRsp;
  std::int64_t cfa_off = 8;
  bool cfa_expr = false;
  RegRule rbp, ra;
};

struct Cie {
  std::uint64_t code_align = 1;
  std::int64_t data_align = -8;
  std::uint64_t ra_reg = kRa;
  std::uint8_t fde_enc = 0;
  bool has_aug_data = false;
  const std::uint8_t* insns = nullptr;
  const std::uint8_t* end = nullptr;
};

bool parse_cie(const std::uint8_t* at, Cie* cie) {
  Reader r{at, at + 4};
  const std::uint32_t len = r.fixed<std::uint32_t>();
  if (r.bad || len == 0 || len == 0xffffffffu) return false;  // 64-bit DWARF: not produced for x86-64 ELF
  r.end = at + 4 + len;
  if (r.fixed<std::uint32_t>() != 0) return false;  // CIE id
  const std::uint8_t version = r.u8();
  if (version != 1 && version != 3) return false;
  const char* aug = reinterpret_cast<const char*>(r.p);
  const std::size_t aug_len = strnlen(aug, static_cast<std::size_t>(r.end - r.p));
  r.p += aug_len + 1;
  cie->code_align = r.uleb();
  cie->data_align = r.sleb();
  cie->ra_reg = version == 1 ? r.u8() : r.uleb();
  if (aug_len && aug[0] == 'z') {
    cie->has_aug_data = true;
    const std::uint64_t n = r.uleb();
    const std::uint8_t* data_end = r.p + n;
    for (std::size_t i = 1; i < aug_len && r.more(); ++i) {
      switch (aug[i]) {
        case 'R': cie->fde_enc = r.u8(); break;
        case 'L': r.u8(); break;
        case 'P': r.pointer(r.u8() & 0x0f); break;  // the personality routine: skipped
        case 'S': break;
        default: return false;
      }
    }
    if (r.bad || data_end > r.end) return false;
    r.p = data_end;
  } else if (aug_len) {
    return false;  // an augmentation without 'z': its data cannot be skipped
  }
  cie->insns = r.p;
  cie->end = r.end;
  return !r.bad;
}

RegRule* reg_of(Row& row, std::uint64_t reg, std::uint64_t ra_reg) {
  static thread_local RegRule ignored;
  if (reg == static_cast<std::uint64_t>(kRbp)) return &row.rbp;
  if (reg == ra_reg) return &row.ra;
  return &ignored;
}

// Runs a CFA program from `loc` until the row that covers `target`. Returns false on anything it cannot
// follow. `initial` is the row after the CIE's instructions (what DW_CFA_restore goes back to).
bool run_cfa(Reader r, const Cie& cie, std::uintptr_t loc, std::uintptr_t target, const Row& initial, Row* row,
             std::uint8_t fde_enc) {
  Row stack[8];
  int depth = 0;
  auto advance = [&](std::uint64_t delta) {
    loc += delta * cie.code_align;
    return loc <= target;
  };
  while (r.more()) {
    const std::uint8_t op = r.u8();
    const std::uint8_t low = op & 0x3f;
    switch (op & 0xc0) {
      case 0x40:
        if (!advance(low)) return true;
        continue;
      case 0x80: {
        RegRule* rr = reg_of(*row, low, cie.ra_reg);
        *rr = {RegRule::offset, static_cast<std::int64_t>(r.uleb()) * cie.data_align};
        continue;
      }
      case 0xc0:
        *reg_of(*row, low, cie.ra_reg) = *reg_of(const_cast<Row&>(initial), low, cie.ra_reg);
        continue;
      default: break;
    }
    switch (op) {
      case 0x00: break;                                       // nop
      case 0x01: loc = r.pointer(fde_enc); if (loc > target) return true; break;  // set_loc
      case 0x02: if (!advance(r.u8())) return true; break;
      case 0x03: if (!advance(r.fixed<std::uint16_t>())) return true; break;
      case 0x04: if (!advance(r.fixed<std::uint32_t>())) return true; break;
      case 0x05: {                                            // offset_extended
        const std::uint64_t reg = r.uleb();
        *reg_of(*row, reg, cie.ra_reg) = {RegRule::offset, static_cast<std::int64_t>(r.uleb()) * cie.data_align};
        break;
      }
      case 0x06: {                                            // restore_extended
        const std::uint64_t reg = r.uleb();
        *reg_of(*row, reg, cie.ra_reg) = *reg_of(const_cast<Row&>(initial), reg, cie.ra_reg);
        break;
      }
      case 0x07: *reg_of(*row, r.uleb(), cie.ra_reg) = {RegRule::undefined, 0}; break;
      case 0x08: *reg_of(*row, r.uleb(), cie.ra_reg) = {RegRule::same, 0}; break;
      case 0x09: {                                            // register
        const std::uint64_t reg = r.uleb();
        r.uleb();
        *reg_of(*row, reg, cie.ra_reg) = {RegRule::other, 0};
        break;
      }
      case 0x0a:                                              // remember_state
        if (depth == 8) return false;
        stack[depth++] = *row;
        break;
      case 0x0b:                                              // restore_state
        if (depth == 0) return false;
        *row = stack[--depth];
        break;
      case 0x0c: row->cfa_reg = static_cast<int>(r.uleb()); row->cfa_off = static_cast<std::int64_t>(r.uleb()); row->cfa_expr = false; break;
      case 0x0d: row->cfa_reg = static_cast<int>(r.uleb()); row->cfa_expr = false; break;
      case 0x0e: row->cfa_off = static_cast<std::int64_t>(r.uleb()); break;
      case 0x0f: r.p += r.uleb(); row->cfa_expr = true; break;   // def_cfa_expression
      case 0x10: {                                            // expression
        const std::uint64_t reg = r.uleb();
        r.p += r.uleb();
        *reg_of(*row, reg, cie.ra_reg) = {RegRule::other, 0};
        break;
      }
      case 0x11: {                                            // offset_extended_sf
        const std::uint64_t reg = r.uleb();
        *reg_of(*row, reg, cie.ra_reg) = {RegRule::offset, r.sleb() * cie.data_align};
        break;
      }
      case 0x12: row->cfa_reg = static_cast<int>(r.uleb()); row->cfa_off = r.sleb() * cie.data_align; row->cfa_expr = false; break;
      case 0x13: row->cfa_off = r.sleb() * cie.data_align; break;
      case 0x14: case 0x15: {                                 // val_offset(_sf)
        const std::uint64_t reg = r.uleb();
        if (op == 0x14) r.uleb(); else r.sleb();
        *reg_of(*row, reg, cie.ra_reg) = {RegRule::other, 0};
        break;
      }
      case 0x16: {                                            // val_expression
        const std::uint64_t reg = r.uleb();
        r.p += r.uleb();
        *reg_of(*row, reg, cie.ra_reg) = {RegRule::other, 0};
        break;
      }
      case 0x2e: r.uleb(); break;                             // GNU_args_size
      case 0x2f: {                                            // GNU_negative_offset_extended
        const std::uint64_t reg = r.uleb();
        *reg_of(*row, reg, cie.ra_reg) = {RegRule::offset, -static_cast<std::int64_t>(r.uleb()) * cie.data_align};
        break;
      }
      default: return false;
    }
    if (r.p > r.end) return false;
  }
  return !r.bad;
}

struct EhBases {
  void* tbase;
  void* dbase;
  void* func;
};
using FindFde = const void* (*)(void*, EhBases*);

// made_once, not a function's static (a child forked while another thread looked it up would wait for ever
// on the static's guard); a null answer is kept too.
FindFde find_fde() {
  static std::atomic<const FindFde*> f{nullptr};
  static std::once_flag once;
  return made_once(f, once, [] { return new FindFde(reinterpret_cast<FindFde>(dlsym(RTLD_DEFAULT, "_Unwind_Find_FDE"))); });
}

// The rule for the frame whose return address is `ra` (looked up at ra - 1, inside the call instruction:
// a call that ends a function, such as one to a noreturn function, returns past its end).
Rule compute_rule(std::uintptr_t ra) {
  Rule out;
  const std::uintptr_t pc = ra - 1;
  FindFde find = find_fde();
  if (!find) return out;
  EhBases bases{};
  const auto* fde = static_cast<const std::uint8_t*>(find(reinterpret_cast<void*>(pc), &bases));
  if (!fde) return out;
  Reader r{fde, fde + 8};
  const std::uint32_t len = r.fixed<std::uint32_t>();
  if (len == 0 || len == 0xffffffffu) return out;
  r.end = fde + 4 + len;
  const std::uint8_t* cie_ptr_at = r.p;
  const std::uint32_t cie_off = r.fixed<std::uint32_t>();
  Cie cie;
  if (r.bad || !parse_cie(cie_ptr_at - cie_off, &cie)) return out;
  const std::uintptr_t begin = r.pointer(cie.fde_enc);
  r.pointer(cie.fde_enc & 0x0f);  // the range
  if (cie.has_aug_data) r.p += r.uleb();
  if (r.bad || r.p > r.end) return out;
  Row initial;
  initial.ra = {RegRule::same, 0};
  if (!run_cfa(Reader{cie.insns, cie.end}, cie, begin, ~std::uintptr_t{0}, initial, &initial, cie.fde_enc)) return out;
  Row row = initial;
  if (!run_cfa(r, cie, begin, pc, initial, &row, cie.fde_enc)) return out;
  if (row.ra.kind == RegRule::undefined) {
    out.kind = Rule::outermost;
    return out;
  }
  if (row.cfa_expr || (row.cfa_reg != kRsp && row.cfa_reg != kRbp) || row.ra.kind != RegRule::offset ||
      (row.rbp.kind != RegRule::same && row.rbp.kind != RegRule::offset))
    return out;
  out.kind = Rule::step;
  out.cfa_reg = static_cast<std::uint8_t>(row.cfa_reg);
  out.cfa_off = static_cast<std::int32_t>(row.cfa_off);
  out.ra_off = static_cast<std::int32_t>(row.ra.off);
  out.rbp_saved = row.rbp.kind == RegRule::offset;
  out.rbp_off = static_cast<std::int32_t>(row.rbp.off);
  return out;
}

// --- The caches ---------------------------------------------------------------------------------------

// Note [The loader's lock across fork]
// dl_iterate_phdr takes glibc's loader write lock, which glibc does not reset in a forked child (it resets the
// load lock only): a fork while another thread is inside dlopen, dlclose or dl_iterate_phdr leaves a child in
// which every dl_iterate_phdr waits for ever. capi_fork's random draws, where three threads make their first
// calls (one of them loading libcuda) while the main thread forks, hung 1 child in 300 under load, in this
// function. So a forked child never calls it: it keeps the count its parent last saw. Code unloaded in the
// child and other code loaded at the same addresses could then meet a stale rule: frames wrong, never a read
// outside the thread's stack (every step checks the stack's bounds).
std::atomic<bool> g_forked{false};
std::atomic<unsigned long long> g_last_unloads{0};
[[gnu::constructor]] void note_forks() {
  pthread_atfork(nullptr, nullptr, [] { g_forked.store(true, std::memory_order_relaxed); });
}

// How many libraries were unloaded so far (dl_iterate_phdr's dlpi_subs): a rule is only valid while the
// code it was read from is mapped, so every cache is dropped when this moves.
unsigned long long unloads() {
  if (g_forked.load(std::memory_order_relaxed)) return g_last_unloads.load(std::memory_order_relaxed);
  unsigned long long subs = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t size, void* data) {
        if (size >= offsetof(dl_phdr_info, dlpi_subs) + sizeof info->dlpi_subs)
          *static_cast<unsigned long long*>(data) = info->dlpi_subs;
        return 1;
      },
      &subs);
  g_last_unloads.store(subs, std::memory_order_relaxed);
  return subs;
}

std::mutex g_mu;  // guards the shared table
unsigned long long g_table_unloads = 0;
std::unordered_map<std::uintptr_t, Rule>& shared_rules() {
  static auto* m = new std::unordered_map<std::uintptr_t, Rule>;  // never destroyed: used until exit
  return *m;
}

Rule shared_rule(std::uintptr_t ra, unsigned long long subs) {
  std::lock_guard lk(g_mu);
  auto& m = shared_rules();
  if (g_table_unloads != subs) {
    m.clear();
    g_table_unloads = subs;
  }
  auto it = m.find(ra);
  if (it != m.end()) return it->second;
  g_misses.fetch_add(1, std::memory_order_relaxed);
  return m.emplace(ra, compute_rule(ra)).first->second;
}

// A thread's rules, direct-mapped: a hit is a load and a compare, no lock.
struct ThreadRules {
  static constexpr std::size_t kSlots = 2048;
  std::uintptr_t key[kSlots] = {};
  Rule rule[kSlots];
  unsigned long long unloads = 0;
  std::uintptr_t stack_lo = 0, stack_hi = 0;  // the thread's stack, [lo, hi)
  bool bounds_tried = false;
};

ThreadRules& thread_rules() {
  thread_local ThreadRules t;
  return t;
}

bool stack_bounds(ThreadRules& t) {
  if (!t.bounds_tried) {
    t.bounds_tried = true;
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      void* addr = nullptr;
      std::size_t size = 0;
      if (pthread_attr_getstack(&attr, &addr, &size) == 0 && addr && size) {
        t.stack_lo = reinterpret_cast<std::uintptr_t>(addr);
        t.stack_hi = t.stack_lo + size;
      }
      pthread_attr_destroy(&attr);
    }
  }
  return t.stack_hi != 0;
}

const Rule& rule_for(ThreadRules& t, std::uintptr_t ra, unsigned long long subs) {
  const std::size_t slot = (ra ^ (ra >> 11)) % ThreadRules::kSlots;
  if (t.key[slot] != ra) {
    t.rule[slot] = shared_rule(ra, subs);
    t.key[slot] = ra;
  }
  return t.rule[slot];
}

}  // namespace

void lock_unwind_table() { g_mu.lock(); }
void unlock_unwind_table() { g_mu.unlock(); }

// Called by the entry stub below with the stub's own stack pointer (pointing at its return address) and
// the caller's rbp.
extern "C" [[gnu::visibility("hidden")]] int fl_unwind_from(void** out, int max, int skip,
                                                                  std::uintptr_t rsp, std::uintptr_t rbp);

extern "C" int fl_unwind_from(void** out, int max, int skip, std::uintptr_t rsp, std::uintptr_t rbp) {
  ThreadRules& t = thread_rules();
  if (!find_fde() || !stack_bounds(t) || rsp < t.stack_lo || rsp + 8 > t.stack_hi) {
    g_fallbacks.fetch_add(1, std::memory_order_relaxed);
    return unwind_with_backtrace(out, max, skip + 2);  // +2: this function and unwind()
  }
  const unsigned long long subs = unloads();
  if (t.unloads != subs) {
    std::fill(std::begin(t.key), std::end(t.key), 0);
    t.unloads = subs;
  }
  const std::uintptr_t lo = t.stack_lo, hi = t.stack_hi;
  auto in_stack = [lo, hi](std::uintptr_t a) { return a >= lo && a + 8 <= hi; };
  std::uintptr_t ip = *reinterpret_cast<const std::uintptr_t*>(rsp);
  rsp += 8;
  int n = 0;
  // The stub's return address is in unwind(): the first frame reported is unwind()'s caller.
  for (int frame = 0; ip && n < max; ++frame) {
    if (frame > skip) out[n++] = reinterpret_cast<void*>(ip);
    const Rule& r = rule_for(t, ip, subs);
    if (r.kind != Rule::step) break;
    const std::uintptr_t cfa = (r.cfa_reg == kRsp ? rsp : rbp) + static_cast<std::intptr_t>(r.cfa_off);
    const std::uintptr_t ra_at = cfa + static_cast<std::intptr_t>(r.ra_off);
    const std::uintptr_t rbp_at = cfa + static_cast<std::intptr_t>(r.rbp_off);
    if (cfa <= rsp || !in_stack(ra_at) || (r.rbp_saved && !in_stack(rbp_at))) break;
    ip = *reinterpret_cast<const std::uintptr_t*>(ra_at);
    if (r.rbp_saved) rbp = *reinterpret_cast<const std::uintptr_t*>(rbp_at);
    rsp = cfa;
  }
  return n;
}

// The entry: passes its own rsp (at its return address) and the caller's rbp on, and tail-calls.
__asm__(
    ".text\n"
    ".globl fl_unwind_entry\n"
    ".hidden fl_unwind_entry\n"
    ".type fl_unwind_entry,@function\n"
    "fl_unwind_entry:\n"
    "  mov %rsp, %rcx\n"
    "  mov %rbp, %r8\n"
    "  jmp fl_unwind_from\n"
    ".size fl_unwind_entry, .-fl_unwind_entry\n");
extern "C" int fl_unwind_entry(void** out, int max, int skip);

[[gnu::noinline]] int unwind(void** out, int max, int skip) {
  const int n = fl_unwind_entry(out, max, skip);
  __asm__ volatile("" ::: "memory");  // not a tail call: the stub's return address must be in here
  return n;
}

#endif

}  // namespace fragless::stacks
