// `host` driver: real host memory with cuMemMap semantics.
//
// A memfd is the "physical memory" of the device; a handle is a contiguous page range in it (a memfd of its
// own when created exportable: `shareable`, Note [Exportable host handles] in host_driver.cpp). A reservation
// is a PROT_NONE anonymous mapping; map = mmap(MAP_FIXED|MAP_SHARED) of the handle's pages over it (still
// PROT_NONE, as cuMemMap leaves memory inaccessible); set_access = mprotect(READ|WRITE); unmap puts a
// PROT_NONE reservation back; release punches a hole in the memfd so the memory really goes back to the OS.
// `capacity` is the budget: create beyond it fails with out_of_memory exactly like CUDA_ERROR_OUT_OF_MEMORY.
// Across fork() the child's writes are its own: in the child, handles made before the fork are mapped
// copy-on-write (MAP_PRIVATE) wherever they are mapped, never exported and never punched, and new handles
// come from a memfd of the child's own (Note [Host memory across fork] in host_driver.cpp, which says
// what this does not give).
// The driver checks every pre-condition of driver.h and fails with invalid_argument when one is broken,
// which makes it a strict test double for the engine.
#pragma once
#include <memory>

#include "fragless/driver.h"
#include "fragless/test_events.h"

namespace fragless {

struct HostDriverOptions {
  int device = 0;
  std::size_t page_size = 2u << 20;     // granularity; a power of two, a multiple of the OS page
  std::size_t capacity = 4ull << 30;    // physical budget in bytes
  // Handles created exportable (R18): each a memfd of its own (one file descriptor held per handle), which
  // export_handle duplicates; otherwise a page range of the device's memfd, which export refuses.
  bool shareable = false;
};

// Returns nullptr and sets *error when the memfd cannot be made.
std::unique_ptr<Driver> make_host_driver(const HostDriverOptions& opts, std::string* error);

// Test access to the event model of a host or sim driver (nullptr for other drivers).
TestEvents* test_events_of(Driver& d);

// Failure injection for the host driver: fail the nth (1-based) future call of `call` with `status`, and the
// `times` - 1 calls of it after that one. nth == 0 clears the rule for that call.
void host_driver_inject_failure(Driver& d, DriverCall call, std::uint64_t nth, Status status, std::uint64_t times = 1);
// How many injected failures the driver has returned so far (a sweep checks that each one fired).
std::uint64_t host_driver_injected_failures(Driver& d);
// Number of live handles, mappings and reservations (leak checks in tests).
// imported_handles: those of handles that came from import_handle (another process's memory).
struct HostDriverCensus {
  std::size_t handles = 0, mappings = 0, reservations = 0, physical_bytes = 0, imported_handles = 0;
};
HostDriverCensus host_driver_census(Driver& d);

}  // namespace fragless
