// `cuda` driver: the real CUDA driver API, loaded at run time (dlopen + cuGetProcAddress; never linked), so
// the library loads on any machine and explains itself where there is no GPU. FRAGLESS_LIBCUDA names
// another library to load instead of libcuda.so.1 (the tests' libcuda double).
#pragma once
#include <memory>
#include <string>

#include "fragless/driver.h"

namespace fragless {

struct CudaDriverOptions {
  int device = 0;
  bool peer_access = true;  // also grant access to every peer device that can access this one
  // Request CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR for physical memory (exportable to other processes). Off
  // by default: a shareable handle type can make cuMemCreate fail or cost more where the process does not
  // need it, and fragless memory is not handed to other processes by itself.
  bool shareable_handles = false;
  // With shareable_handles: CU_MEM_HANDLE_TYPE_FABRIC instead (R26); the driver is refused on a device without
  // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED.
  bool fabric_handles = false;
};

// The library fragless loads as the driver: FRAGLESS_LIBCUDA when set, else libcuda.so.1 (LD_PRELOAD's driver
// half forwards to the same one).
const char* cuda_library_name();
// Devices the driver sees; -1 with *error when libcuda cannot be loaded or initialised.
int cuda_device_count(std::string* error);
// The device (ordinal) of a CUDA stream, from its context (cuStreamGetCtx; every driver fragless runs on has
// it, unlike the runtime's cudaStreamGetDevice of CUDA 12.8); -1 for the legacy and per-thread default
// streams (the caller's current device) and when it cannot be told. Needs the calling thread to have a current
// context, as any thread that has used the CUDA runtime does.
int cuda_stream_device(Stream s);
// nullptr with *error (naming the CUresult) when the device cannot be used: no libcuda, no such device,
// no virtual memory management support.
std::unique_ptr<Driver> make_cuda_driver(const CudaDriverOptions& opts, std::string* error);

}  // namespace fragless
