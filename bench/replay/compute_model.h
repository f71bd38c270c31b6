// The compute time of the built-in workloads, which record no time of their own: the clock on which the
// replay runs background work for them (Note [Background work in the replay], replay.cpp).
//
// Note [Compute time of the built-in workloads]
// Each generator charges the kernels of its step as it emits the step's allocations: a kernel takes its
// floating-point work at half of an A100's dense peak for its element type, or its memory traffic at the
// A100-80GB's 2.0 TB/s, whichever is longer, plus 5 µs to launch. The peaks are PyTorch's defaults: bf16 on
// the tensor cores (312 TFLOPS), fp32 on the CUDA cores (19.5 TFLOPS: PyTorch does not use TF32 for
// matmuls unless asked; the transformer workloads' `tf32=1` asks, 156 TFLOPS). Every event is stamped with
// the time at which the host reaches it, taken to be the time the GPU has spent on the kernels before it (a
// host that runs ahead of the GPU shortens the gaps; a real job's communication, data loading and Python
// lengthen them).
#pragma once
#include <cstdint>
#include <vector>

namespace fragless::replay {

class ModelClock {
 public:
  static constexpr double kBf16FlopsPerUs = 156e6;  // FLOP per µs: half of 312 TFLOPS
  static constexpr double kFp32FlopsPerUs = 9.75e6;  // half of 19.5
  static constexpr double kTf32FlopsPerUs = 78e6;    // half of 156
  static constexpr double kBytesPerUs = 2.0e6;
  static constexpr double kLaunchUs = 5;

  explicit ModelClock(bool tf32 = false) : tf32_(tf32) {}
  // One kernel: `flops` of arithmetic on elements of `bytes_per_element` (2: bf16, 4: fp32; others are
  // charged at the bf16 rate) and `bytes` of memory traffic.
  void kernel(double flops, double bytes, int bytes_per_element = 2) {
    const double rate = bytes_per_element != 4 ? kBf16FlopsPerUs : tf32_ ? kTf32FlopsPerUs : kFp32FlopsPerUs;
    const double us = flops / rate > bytes / kBytesPerUs ? flops / rate : bytes / kBytesPerUs;
    now_ += us + kLaunchUs;
  }
  // Stamps the event just emitted (at the end of `times`).
  void stamp(std::vector<std::int64_t>& times) const { times.push_back(static_cast<std::int64_t>(now_)); }
  double now() const { return now_; }

 private:
  bool tf32_;
  double now_ = 0;  // µs since the start of the workload
};

}  // namespace fragless::replay
