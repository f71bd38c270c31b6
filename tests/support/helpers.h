// Shared helpers for the tests: engines over every driver and policy.
#pragma once
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "fragless/allocator.h"
#include "fragless/engine.h"
#include "fragless/host_driver.h"
#include "fragless/test_events.h"
#include "fragless/sim_driver.h"

namespace fragless::test {

constexpr std::size_t MiB = 1u << 20;

struct EngineSpec {
  PolicyKind policy = PolicyKind::fragless;
  DriverKind driver = DriverKind::sim;
  std::size_t capacity = 1024 * MiB;
  std::size_t page = 2 * MiB;
  Options base{};
};

inline std::unique_ptr<DeviceEngine> make_engine(const EngineSpec& spec) {
  Options o = spec.base;
  o.policy = spec.policy;
  o.driver = spec.driver;
  std::unique_ptr<Driver> d;
  if (spec.driver == DriverKind::host) {
    HostDriverOptions h;
    h.capacity = spec.capacity;
    h.page_size = spec.page;
    h.shareable = o.shareable_handles;
    std::string err;
    d = make_host_driver(h, &err);
    REQUIRE(d != nullptr);
  } else {
    SimDriverOptions s;
    s.capacity = spec.capacity;
    s.page_size = spec.page;
    d = make_sim_driver(s);
  }
  return std::make_unique<DeviceEngine>(o, std::move(d));
}

// An Allocator over `devices` devices configured by `conf` (a FRAGLESS_CONF string); the test fails when
// either is refused.
inline std::unique_ptr<Allocator> allocator_from(const std::string& conf, int devices = 1) {
  auto parsed = parse_config(conf);
  INFO(parsed.error);
  REQUIRE(parsed.ok);
  std::string err;
  auto a = Allocator::create(parsed.options, devices, &err);
  INFO(err);
  REQUIRE(a);
  return a;
}

inline std::int64_t reserved(DeviceEngine& e) { return e.stats().reserved_bytes.all().current; }

inline void require_consistent(DeviceEngine& e) {
  const std::string err = e.check_invariants();
  INFO(err);
  REQUIRE(err.empty());
}

inline const char* name(PolicyKind p) { return policy_name(p); }

// Runs this test binary again on the hidden test spec `spec` ('[.name]'), in a process of its own, behind the
// shell words `env` (variables to set, or ""); its exit status, with the command and its output (stdout and
// stderr) in *cmd and *out.
inline int run_hidden_case(const std::string& env, const std::string& spec, std::string* cmd, std::string* out) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  REQUIRE(n > 0);
  self[n] = '\0';
  *cmd = env + (env.empty() ? "" : " ") + "'" + self + "' -w NoTests '" + spec + "' 2>&1";
  FILE* child = popen(cmd->c_str(), "r");
  REQUIRE(child);
  out->clear();
  char buf[512];
  while (std::size_t got = std::fread(buf, 1, sizeof buf, child)) out->append(buf, got);
  return pclose(child);
}

}  // namespace fragless::test
