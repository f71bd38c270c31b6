// Controls of the libcuda test double (libfragless_fakecuda.so), for tests that dlopen it.
#pragma once
#include <cstddef>

extern "C" {
struct fakecuda_census {
  long handles;       // cuMemCreate'd and not released
  long mappings;      // cuMemMap'd and not unmapped
  long reservations;  // cuMemAddressReserve'd and not freed
  long events;        // cuEventCreate'd and not destroyed
  std::size_t used_bytes;
  long faults;                // illegal-address faults (memory unmapped, freed or handed out under running work)
  long invalidated_captures;  // stream captures an unsupported call invalidated
  long context_retains;       // primary-context retains outstanding, over all devices
  long own_allocations;       // the double's own allocations live (cuMemAlloc, cuMemAllocPitch, stream-ordered)
};
// The nth (1-based) future call of `fn` (e.g. "cuMemMap") returns `error` (a CUresult); nth 0 clears.
void fakecuda_fail(const char* fn, int nth, int error);
void fakecuda_reset_failures();
// How many injected errors have been returned so far (a sweep checks that each one fired).
unsigned long fakecuda_injected_failures();
// Every later call of `fn` takes this long (outside the double's lock); 0 clears.
void fakecuda_set_delay(const char* fn, unsigned microseconds);
unsigned long fakecuda_calls(const char* fn);
void fakecuda_get_census(fakecuda_census* out);
// The first fault's description ("" if none); clearing forgets faults and invalidated captures.
const char* fakecuda_first_fault();
void fakecuda_clear_faults();
// A held stream makes no progress until it is released or synchronised.
void fakecuda_hold_stream(void* stream, int hold);
void fakecuda_set_capacity(int device, std::size_t bytes);
// cuDriverGetVersion's answer (default 13000, or FAKECUDA_DRIVER_VERSION); cuGetProcAddress refuses newer.
void fakecuda_set_driver_version(int version);
// Whether devices have CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED and the process an IMEX channel
// (default off, or FAKECUDA_FABRIC=1): cuMemCreate with the fabric type is CUDA_ERROR_NOT_SUPPORTED without.
void fakecuda_set_fabric(int supported);
// requestedHandleTypes of the last cuMemCreate.
unsigned fakecuda_last_handle_types();
// A stream of device's primary context, as the CUDA runtime would create it; or an existing handle value
// adopted as one (for tests whose streams are fixed numbers). Streams the double does not know are refused.
void* fakecuda_stream_create(int device);
int fakecuda_adopt_stream(void* handle, int device);
// Destroys a stream made by fakecuda_stream_create (its queued work still completes). CUDA may give its
// handle value to a later stream once that work is done, and the double does (at once while
// fakecuda_reuse_stream_values_at_once is set).
int fakecuda_stream_destroy(void* stream);
// While set, a new stream takes the most recently destroyed stream's handle value at once, its work done or
// not (RMM's issue 649 reports CUDA reusing stream values at once); the two streams' work stays unordered.
void fakecuda_reuse_stream_values_at_once(int at_once);
// While set, cuMemUnmap refuses a range of more than one mapping (the strict reading of cuda.h's "the entire
// contiguous address range that was mapped to").
void fakecuda_refuse_multi_mapping_unmap(int refuse);
// Work on `stream` that reads and writes [ptr, ptr+bytes) for `ticks` of the virtual clock, after the work
// queued before it. CU_STREAM_PER_THREAD is the calling thread's per-thread stream of its current context. Returns a CUresult (an illegal address when the memory is not accessible to the device).
int fakecuda_launch(void* stream, const void* ptr, std::size_t bytes, unsigned long long ticks);
// Work queued on `waiter` from now on is ordered after everything queued on `waited` so far (what a program
// does with cudaEventRecord on `waited` and cudaStreamWaitEvent on `waiter`; torch's Stream.wait_stream).
int fakecuda_stream_wait(void* waiter, void* waited);
// When everything queued on `stream` so far is done, on the virtual clock (ULLONG_MAX while it waits behind a
// held stream); 0 for a stream with no work or one the double does not know.
unsigned long long fakecuda_stream_done_at(void* stream);
void fakecuda_advance(unsigned long long ticks);
// Memory the driver allocated for someone else (as its own cuMemAlloc would, without the caller's context):
// what a library that allocated without fragless leaves in the process, for tests of forwarding.
void* fakecuda_foreign_alloc(int device, std::size_t bytes);
// What cuMemGetInfo of the device would call free (its capacity less the physical memory in use).
std::size_t fakecuda_free_bytes(int device);
unsigned long long fakecuda_now();
}
