// Events for drivers without a GPU (host, sim): work "completes" at once, unless a test holds a stream,
// in which case events recorded on it stay pending until the stream is released or someone waits on it.
// This is how tests prove that the engine waits for record_stream'd uses before reusing memory.
#pragma once
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "fragless/driver.h"

namespace fragless {

class TestEvents {
 public:
  Event record(Stream s);
  Status query(Event e);
  void synchronize(Event e);
  void release(Event e);
  void synchronize_stream(Stream s);
  void wait(Stream s, Event e);  // events recorded on s from now on complete only after e
  void synchronize_all();        // every stream's work is done (a device-wide synchronisation)

  // Test controls.
  void hold(Stream s);          // events recorded on s from now on stay pending
  void complete(Stream s);      // stop holding s; its pending events complete
  std::size_t pending() const;  // events recorded and not yet complete

 private:
  mutable std::mutex mu_;
  Event next_ = 1;
  std::unordered_set<Stream> held_;
  std::unordered_map<Event, Stream> pending_;  // event -> stream, only for events not yet complete
  std::unordered_map<Stream, std::vector<Event>> waits_;  // events a stream's later work waits for
  std::unordered_map<Event, std::vector<Event>> after_;   // event -> events it completes after
  bool ready(Event e) const;
  void finish(std::vector<Event> todo);  // these events and what they waited for are done (mu_ held)
};

}  // namespace fragless
