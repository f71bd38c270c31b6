#include "fragless/allocator.h"

#include "fragless/cuda_driver.h"
#include "fragless/host_driver.h"
#include "fragless/sim_driver.h"

namespace fragless {

std::unique_ptr<Driver> make_driver(const Options& opts, int device, std::string* error) {
  switch (opts.driver) {
    case DriverKind::host: {
      HostDriverOptions h;
      h.device = device;
      h.page_size = opts.page_size;
      if (opts.capacity) h.capacity = opts.capacity;
      return make_host_driver(h, error);
    }
    case DriverKind::sim: {
      SimDriverOptions s;
      s.device = device;
      s.page_size = opts.page_size;
      if (opts.capacity) s.capacity = opts.capacity;
      return make_sim_driver(s);
    }
    case DriverKind::cuda: {
#if defined(FRAGLESS_HAVE_CUDA)
      CudaDriverOptions c;
      c.device = device;
      c.peer_access = opts.peer_access;
      c.shareable_handles = opts.shareable_handles;
      return make_cuda_driver(c, error);
#else
      break;
#endif
    }
  }
  if (error) *error = "fragless: this build has no cuda driver (the CUDA headers were not found); use driver:host or driver:sim";
  return nullptr;
}

std::unique_ptr<Allocator> Allocator::create(const Options& opts, int devices, std::string* error) {
  auto a = std::unique_ptr<Allocator>(new Allocator());
  a->opts_ = opts;
  if (devices < 0) {  // as many as the driver has
#if defined(FRAGLESS_HAVE_CUDA)
    devices = opts.driver == DriverKind::cuda ? cuda_device_count(error) : 1;
    if (devices < 0) return nullptr;
#else
    devices = 1;
#endif
  }
  if (!opts.trace.empty()) {
    a->tracing_ = Tracing::open(opts.trace, devices, policy_name(opts.policy), error);
    if (!a->tracing_) return nullptr;
  }
  for (int d = 0; d < devices; ++d) {
    auto drv = make_driver(opts, d, error);
    if (!drv) return nullptr;
    a->engines_.push_back(std::make_unique<DeviceEngine>(opts, std::move(drv)));
    if (a->tracing_) a->engines_.back()->set_event_sink(a->tracing_->sink(d));
  }
  return a;
}

void Allocator::flush_traces() {
  for (auto& e : engines_) e->flush_trace();
}

std::vector<std::string> Allocator::trace_paths() const {
  return tracing_ ? tracing_->paths() : std::vector<std::string>{};
}

}  // namespace fragless
