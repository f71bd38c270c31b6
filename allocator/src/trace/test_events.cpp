#include "fragless/test_events.h"

namespace fragless {

bool TestEvents::ready(Event e) const {
  if (pending_.count(e)) return false;
  auto it = after_.find(e);
  if (it == after_.end()) return true;
  for (Event d : it->second)
    if (!ready(d)) return false;
  return true;
}

Event TestEvents::record(Stream s) {
  std::lock_guard lk(mu_);
  const Event e = next_++;
  if (held_.count(s)) pending_.emplace(e, s);
  if (auto w = waits_.find(s); w != waits_.end()) {
    std::erase_if(w->second, [&](Event d) { return ready(d); });
    if (!w->second.empty()) after_[e] = w->second;
  }
  return e;
}

Status TestEvents::query(Event e) {
  std::lock_guard lk(mu_);
  return ready(e) ? Status::ok : Status::not_ready;
}

void TestEvents::finish(std::vector<Event> todo) {
  while (!todo.empty()) {
    const Event x = todo.back();
    todo.pop_back();
    pending_.erase(x);
    if (auto it = after_.find(x); it != after_.end()) {
      todo.insert(todo.end(), it->second.begin(), it->second.end());
      after_.erase(it);
    }
  }
}

void TestEvents::synchronize(Event e) {
  std::lock_guard lk(mu_);
  finish({e});  // waiting makes the work done, and the work it waited for
}

void TestEvents::release(Event e) {
  std::lock_guard lk(mu_);
  // Destroying an event undoes no dependency on it: while later work waits for it, it stays pending.
  for (auto& [s, w] : waits_)
    for (Event d : w)
      if (d == e) return;
  for (auto& [x, deps] : after_)
    for (Event d : deps)
      if (d == e) return;
  pending_.erase(e);
}

void TestEvents::wait(Stream s, Event e) {
  std::lock_guard lk(mu_);
  if (!ready(e)) waits_[s].push_back(e);
}

void TestEvents::synchronize_stream(Stream s) {
  std::lock_guard lk(mu_);
  // The stream's work is done, and so is everything it waited for.
  std::vector<Event> todo;
  for (auto& [e, st] : pending_)
    if (st == s) todo.push_back(e);
  if (auto w = waits_.find(s); w != waits_.end()) {
    todo.insert(todo.end(), w->second.begin(), w->second.end());
    waits_.erase(w);
  }
  finish(std::move(todo));
  for (auto it = after_.begin(); it != after_.end();) it = ready(it->first) ? after_.erase(it) : std::next(it);
}

void TestEvents::synchronize_all() {
  std::lock_guard lk(mu_);
  pending_.clear();
  waits_.clear();
  after_.clear();
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
