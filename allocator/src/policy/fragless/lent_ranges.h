// The fragless policy's lent ranges (Note [Lending pages without a sync] in policy/fragless/fragless_policy.h): address
// ranges whose handles now back another place while their old mappings stay until the work queued on
// their stream is done. Each is `unmapped` to the engine; its old mapping is unmapped by whoever gets to it
// first once its event has completed: the background worker (Note [Unmaps in the background]), or a later
// slow path, which also waits for the event when it needs the range back.
//
// Note [Unmaps in the background]
// Unmapping a lent range costs a cuMemUnmap the request that lent it does not need. The worker takes the
// oldest range nobody is handling (claimed), queries its event and, when the work is done, unmaps it, all
// without the device lock; the finish drops the range from the books. A range whose event is not done yet
// waits (is not taken again) until the next growth. With background work on, the allocation path does not
// unmap ranges it does not need (a growth only rearms the waiting ones); it never touches a claimed range:
// a growth that needs one back spins until the worker has let go of it (at most one query and one unmap),
// and a range the worker has unmapped it simply drops.
#pragma once
#include <atomic>
#include <cstdint>
#include <list>
#include <vector>

#include "policy/policy.h"

namespace fragless {

class LentRanges {
 public:
  LentRanges(DeviceEngine::State& s, std::size_t page) : s_(s), page_(page) {}

  // Pages [first, first + n) of seg, mapped to `handles` (each from its first page), were lent behind `event`
  // (recorded on the segment's stream).
  void add(Segment& seg, std::size_t first, std::size_t n, Event event, std::vector<PhysHandle> handles);
  bool empty() const { return ranges_.empty(); }
  // Handle h of `bytes` goes back to the driver while a range lent from it may still map it at its old address
  // (a failed growth whose lender's wait failed, FraglessPolicy::fail_request): the driver keeps its memory
  // until that unmap (R8), so it stays in reserved until the range is dropped. False when no such range holds
  // h (its memory goes with the release).
  bool hold_released(PhysHandle h, std::size_t bytes);
  // What released handles still hold through lent ranges' old mappings (counted in reserved).
  std::size_t held_bytes() const;

  // The room a request may map into from `first` stops at the next lent range of the segment.
  std::size_t room_before(const Segment& seg, std::size_t first, std::size_t need, std::size_t room) const;
  bool overlaps(const Segment& seg, std::size_t first, std::size_t n) const;
  // Whether a range overlapping pages [first, first + n) of seg still maps them and its stream's work is not
  // done (or a wait for it failed): mapping there now would wait on the host. Asks the driver about each
  // such range's event (not during a capture: Note [Capture rules]).
  bool pending(const Segment& seg, std::size_t first, std::size_t n);
  // Without background work: unmaps the ranges whose work is done, without waiting. With it: leaves them to
  // the worker, giving those it found not done another go; true when there is work for it.
  bool poll(bool background);
  // Unmaps the ranges of seg overlapping pages [first, first + n), or all of them when seg is null,
  // waiting for their events where needed (a forced sync, counted); a range whose wait fails stays, mapped at
  // its old address (Note [Failed waits]). False when one did.
  bool finish(const Segment* seg, std::size_t first, std::size_t n);

  // Background work (Note [Unmaps in the background]).
  bool take(BackgroundJob* job);
  static void run(Driver& d, BackgroundJob& job, const std::atomic<bool>& abort);
  void finish_job(BackgroundJob& job);

  std::string check() const;

 private:
  enum State : int { open, claimed, unmapped, waiting };  // waiting: its event was not done; not taken now
  struct Range {
    Segment* seg;
    std::size_t first, n;
    Event event;
    std::uint64_t id;
    std::atomic<int> state{open};
    std::vector<PhysHandle> handles;  // what the old mapping maps
    std::size_t held_bytes = 0;       // of those, released while it still maps them (hold_released)
  };
  bool hits(const Range& r, const Segment* seg, std::size_t first, std::size_t n) const {
    return !seg || (r.seg == seg && r.first < first + n && first < r.first + r.n);
  }
  // Waits (spinning, the device lock held) until the worker lets go of r; returns its state then.
  static int settle(const Range& r);
  void drop(Range& r);  // r's old mapping is gone or going now: unmap it unless the worker did, forget it

  DeviceEngine::State& s_;
  std::size_t page_;
  std::list<Range> ranges_;  // oldest first; a list, so the worker's job can point at its range
  std::uint64_t next_id_ = 1;
};

}  // namespace fragless
