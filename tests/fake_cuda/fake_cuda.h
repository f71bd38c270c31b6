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
};
// The nth (1-based) future call of `fn` (e.g. "cuMemMap") returns `error` (a CUresult); nth 0 clears.
void fakecuda_fail(const char* fn, int nth, int error);
void fakecuda_reset_failures();
unsigned long fakecuda_calls(const char* fn);
void fakecuda_get_census(fakecuda_census* out);
// Events recorded on a held stream stay not ready until the stream is released or synchronised.
void fakecuda_hold_stream(void* stream, int hold);
void fakecuda_set_capacity(int device, std::size_t bytes);
// cuDriverGetVersion's answer (default 13000, or FAKECUDA_DRIVER_VERSION); cuGetProcAddress refuses newer.
void fakecuda_set_driver_version(int version);
// requestedHandleTypes of the last cuMemCreate.
unsigned fakecuda_last_handle_types();
}
