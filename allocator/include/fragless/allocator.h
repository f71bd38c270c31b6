// The process-wide allocator: one DeviceEngine per device, built from Options (FRAGLESS_CONF).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "fragless/config.h"
#include "fragless/engine.h"
#include "fragless/tracer.h"

namespace fragless {

// Builds the driver `opts.driver` for one device; nullptr with *error set when it cannot.
std::unique_ptr<Driver> make_driver(const Options& opts, int device, std::string* error);

class Allocator {
 public:
  // `devices` engines (-1: as many as the cuda driver reports; 1 for host and sim).
  static std::unique_ptr<Allocator> create(const Options& opts, int devices, std::string* error);

  int device_count() const { return static_cast<int>(engines_.size()); }
  // nullptr for an invalid device.
  DeviceEngine* device(int d) {
    return d >= 0 && d < device_count() ? engines_[static_cast<std::size_t>(d)].get() : nullptr;
  }
  const Options& options() const { return opts_; }
  // Hands every buffered trace record to the writers and waits until they are written.
  void flush_traces();
  std::vector<std::string> trace_paths() const;
  // The tracer's sink for a device (nullptr when tracing is off), for callers that chain sinks.
  EventSink* trace_sink(int device) { return tracing_ ? tracing_->sink(device) : nullptr; }

 private:
  Options opts_;
  std::unique_ptr<Tracing> tracing_;  // before engines_: outlives them (their teardown is traced too)
  std::vector<std::unique_ptr<DeviceEngine>> engines_;
};

}  // namespace fragless
