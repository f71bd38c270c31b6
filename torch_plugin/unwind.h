// The calling thread's return addresses, fast: a DWARF unwinder whose rule for each return address (where
// the caller's frame and return address are) is worked out once, from the .eh_frame data the unwinding of
// C++ exceptions uses, and cached. glibc's backtrace() interprets that data again for every frame of every
// call (about 200 ns a frame); a cached rule costs a table lookup and two loads.
//
// x86-64 Linux; elsewhere, and wherever a rule cannot be expressed (a frame whose CFA is a DWARF expression,
// such as a signal trampoline's), the walk falls back to backtrace() or stops there.
#pragma once

namespace fragless::stacks {

// Fills out[0 .. n) with return addresses, innermost first, the caller of unwind() first, after leaving out
// `skip` of them; returns n (at most `max`).
int unwind(void** out, int max, int skip);

// The same with glibc's backtrace() (what unwind() is checked against, and its fallback).
int unwind_with_backtrace(void** out, int max, int skip);

// Counters of the rule cache since the process started (for tests and the benchmark).
struct UnwindCounters {
  unsigned long long hits = 0, misses = 0, fallbacks = 0;
};
UnwindCounters unwind_counters();

// The lock of the shared rule table, for fork() (stacks::lock_tables).
void lock_unwind_table();
void unlock_unwind_table();

}  // namespace fragless::stacks
