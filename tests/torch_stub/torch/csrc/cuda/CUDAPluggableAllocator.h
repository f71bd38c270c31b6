// A stand-in for PyTorch's torch/csrc/cuda/CUDAPluggableAllocator.h: the declarations
// torch_plugin/torch_cuda.cpp uses, with the signatures PyTorch 2.x gives them, so that CI (which has no
// LibTorch with CUDA) compiles that file and a hook with a wrong type fails the build. Declarations only.
// The graph-pool setters are those of PyTorch 2.3 and later; with FRAGLESS_STUB_TORCH_2_1 those of 2.1 and
// 2.2 (routing by the capture's stream), with FRAGLESS_STUB_TORCH_2_0 those of 2.0 (by CUDA's capture id).
#pragma once
#include <functional>
#include <memory>
#include <utility>

struct CUstream_st;
typedef CUstream_st* cudaStream_t;

namespace c10::cuda {
using CaptureId_t = unsigned long long;
using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;
namespace CUDACachingAllocator {
class CUDAAllocator {
 public:
  virtual ~CUDAAllocator() = default;
};
}  // namespace CUDACachingAllocator
}  // namespace c10::cuda

namespace torch::cuda::CUDAPluggableAllocator {
using c10::cuda::CUDACachingAllocator::CUDAAllocator;
class CUDAPluggableAllocator : public CUDAAllocator {
 public:
  void set_init_fn(std::function<void(int)> init_fn);
  void set_reset_fn(std::function<void()> reset_fn);
  void set_memory_fraction_fn(std::function<void(double, int)> memory_fraction_fn);
  void set_base_alloc_fn(std::function<void*(void*, size_t*)> base_alloc_fn);
  void set_record_stream_fn(std::function<void(void* ptr, cudaStream_t stream)> record_stream_fn);
#if defined(FRAGLESS_STUB_TORCH_2_0)
  void set_capture_begin_fn(
      std::function<void(int, c10::cuda::CaptureId_t, c10::cuda::MempoolId_t)> capture_begin_fn);
  void set_capture_about_to_end_fn(std::function<void(int, c10::cuda::CaptureId_t)> capture_about_to_end_fn);
  void set_capture_ended_fn(std::function<void(int, c10::cuda::CaptureId_t)> capture_ended_fn);
  void set_capture_destroy_fn(std::function<void(int, c10::cuda::MempoolId_t)> capture_destroy_fn);
#elif defined(FRAGLESS_STUB_TORCH_2_1)
  void set_begin_allocate_stream_to_pool(
      std::function<void(int, cudaStream_t, c10::cuda::MempoolId_t)> capture_begin_fn);
  void set_end_allocate_stream_to_pool_fn(std::function<void(int, cudaStream_t)> capture_about_to_end_fn);
#else
  void set_begin_allocate_to_pool(
      std::function<void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)> capture_begin_fn);
  void set_end_allocate_to_pool_fn(std::function<void(int, c10::cuda::MempoolId_t)> capture_about_to_end_fn);
#endif
#if !defined(FRAGLESS_STUB_TORCH_2_0)
  void set_release_pool(std::function<void(int, c10::cuda::MempoolId_t)> capture_destroy_fn);
#endif
};
std::shared_ptr<CUDAAllocator> createCustomAllocator(std::function<void*(size_t, int, cudaStream_t)> alloc_fn,
                                                     std::function<void(void*, size_t, int, cudaStream_t)> free_fn);
void changeCurrentAllocator(const std::shared_ptr<CUDAAllocator>& allocator);
}  // namespace torch::cuda::CUDAPluggableAllocator
