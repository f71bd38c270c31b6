// fragless::torch::install(): registers libfragless's C ABI as LibTorch's CUDA allocator from C++
// (torch::cuda::CUDAPluggableAllocator::createCustomAllocator + changeCurrentAllocator), with every hook.
// Built only against a LibTorch with CUDA (>= 2.1); Debian's libtorch-dev is CPU-only, so CI compiles this
// file against tests/torch_stub (the setters' signatures as PyTorch 2.3 and later declare them, and as 2.1 and
// 2.2 do) and checks that it sets every hook the Python helper sets (tests/python/test_hook_parity.py); it has
// not met a real LibTorch.
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "fragless/fragless.h"
#include "fragless/torch_cuda.h"

namespace fragless::torch {

namespace {
template <typename>
constexpr bool kNoGraphHooks = false;

// The graph-pool hooks (torch.cuda.graph, MemPool): without them a capture's blocks mix with the default pool
// and are reused while the graph may still replay. PyTorch renamed them, and the Python helper's _GRAPH_HOOKS
// lists the same sets in the same order: 2.3's (a filter of streams), else 2.1 and 2.2's (the capture's
// stream). A LibTorch with neither (2.0) fails the build rather than install an allocator that corrupts graphs.
template <typename P>
void install_graph_hooks(P* p) {
  if constexpr (requires(P& q) { q.set_begin_allocate_to_pool(nullptr); }) {
    p->set_begin_allocate_to_pool(
        [](int device, c10::cuda::MempoolId_t pool, std::function<bool(cudaStream_t)> filter) {
          fragless_begin_allocate_to_pool(device, {pool.first, pool.second}, std::move(filter));
        });
    p->set_end_allocate_to_pool_fn(
        [](int device, c10::cuda::MempoolId_t pool) { fragless_end_allocate_to_pool(device, {pool.first, pool.second}); });
  } else if constexpr (requires(P& q) { q.set_begin_allocate_stream_to_pool(nullptr); }) {
    p->set_begin_allocate_stream_to_pool([](int device, cudaStream_t stream, c10::cuda::MempoolId_t pool) {
      fragless_begin_allocate_stream_to_pool(device, stream, {pool.first, pool.second});
    });
    p->set_end_allocate_stream_to_pool_fn(
        [](int device, cudaStream_t stream) { fragless_end_allocate_stream_to_pool(device, stream); });
  } else {
    static_assert(kNoGraphHooks<P>, "this LibTorch's CUDAPluggableAllocator has none of the CUDA graph hooks "
                                    "fragless follows (PyTorch 2.1 or later is needed)");
  }
  p->set_release_pool(
      [](int device, c10::cuda::MempoolId_t pool) { fragless_release_pool(device, {pool.first, pool.second}); });
}
}  // namespace

void install() {
  namespace pa = ::torch::cuda::CUDAPluggableAllocator;
  auto a = pa::createCustomAllocator(
      [](size_t size, int device, cudaStream_t stream) { return fragless_malloc(size, device, stream); },
      [](void* ptr, size_t size, int device, cudaStream_t stream) { fragless_free(ptr, size, device, stream); });
  if (auto p = std::dynamic_pointer_cast<pa::CUDAPluggableAllocator>(a)) {
    p->set_init_fn([](int n) { fragless_init(n); });
    p->set_reset_fn([] { fragless_empty_cache(); });
    p->set_memory_fraction_fn([](double f, int d) { fragless_set_memory_fraction(f, d); });
    p->set_base_alloc_fn([](void* ptr, size_t* size) { return fragless_get_base_allocation(ptr, size); });
    p->set_record_stream_fn([](void* ptr, cudaStream_t s) { fragless_record_stream(ptr, s); });
    install_graph_hooks(p.get());
  }
  pa::changeCurrentAllocator(a);
}

}  // namespace fragless::torch
