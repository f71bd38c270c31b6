// fragless as LibTorch's CUDA allocator, from C++ (needs a LibTorch built with CUDA, >= 2.1).
#pragma once

namespace fragless::torch {
// Call before the first CUDA allocation. Throws c10::Error if another allocator is already in use.
void install();
}  // namespace fragless::torch
