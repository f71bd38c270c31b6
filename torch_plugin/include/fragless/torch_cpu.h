// fragless as LibTorch's CPU allocator (c10::Allocator over the host driver): real LibTorch programs
// allocate through the engine, so their traces and their numerical results can be checked on machines
// without a GPU.
#pragma once
#include <memory>
#include <string>

#include "fragless/allocator.h"

namespace fragless::torch {

// Installs fragless as the CPU allocator of this process (c10::SetAllocator with a priority above the
// default one). `conf` is a FRAGLESS_CONF string; the driver is forced to `host`. Tensors that exist
// already keep their own deleters. Returns false with *error on a bad configuration.
bool install_cpu_allocator(const std::string& conf, std::string* error);

// The engine behind the installed CPU allocator (nullptr before install).
DeviceEngine* cpu_engine();
// Writes buffered trace records (the tracer also flushes at exit). "" when every record so far is in its file,
// else what was lost and why (Allocator::flush_traces).
std::string flush_cpu_trace();

}  // namespace fragless::torch
