#include "fragless/test_events.h"

namespace fragless {

Event TestEvents::record(Stream s) {
  std::lock_guard lk(mu_);
  const Event e = next_++;
  if (held_.count(s)) pending_.emplace(e, s);
  return e;
}

Status TestEvents::query(Event e) {
  std::lock_guard lk(mu_);
  return pending_.count(e) ? Status::not_ready : Status::ok;
}

void TestEvents::synchronize(Event e) {
  std::lock_guard lk(mu_);
  pending_.erase(e);  // waiting makes the work done
}

void TestEvents::release(Event e) {
  std::lock_guard lk(mu_);
  pending_.erase(e);
}

void TestEvents::synchronize_stream(Stream s) {
  std::lock_guard lk(mu_);
  std::erase_if(pending_, [&](const auto& kv) { return kv.second == s; });
}

void TestEvents::hold(Stream s) {
  std::lock_guard lk(mu_);
  held_.insert(s);
}

void TestEvents::complete(Stream s) {
  std::lock_guard lk(mu_);
  held_.erase(s);
  std::erase_if(pending_, [&](const auto& kv) { return kv.second == s; });
}

std::size_t TestEvents::pending() const {
  std::lock_guard lk(mu_);
  return pending_.size();
}

}  // namespace fragless
