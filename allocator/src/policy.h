// Policies decide how address space and physical pages back blocks. The engine owns pools, blocks,
// stats and the retry chain; a policy implements the virtual hooks declared below.
#pragma once
#include <atomic>
#include <memory>
#include <vector>

#include "engine_state.h"

namespace fragless {

// One unit of background work (Note [Background work] in background.h), passed by value from its take to
// its run and its finish.
struct BackgroundJob {
  enum class Kind : std::uint8_t { none, split, unmap_lent } kind = Kind::none;
  Segment* segment = nullptr;
  Block* busy = nullptr;             // the range, held out of every pool while the job runs
  std::size_t first = 0, pages = 0;  // the range, in segment pages
  DevicePtr va = 0;                  // its address
  PhysHandle handle = 0;             // split: the multi-page handle mapped there
  Stream stream = 0;                 // whose queued work used the range
  std::vector<PhysHandle> created;   // split: the new handles, in address order
  std::vector<std::size_t> sizes;    // split: their pages (Note [Split in the background])
  bool to_pages = false;             // split: the handle is a piece of an earlier split: make pages
  Event event = 0;                   // unmap_lent: the event the range's old mapping waits for
  std::uint64_t id = 0;              // unmap_lent: the range
  std::atomic<int>* claim = nullptr; // unmap_lent: the range's state, which the run sets when it lets go
  // How it ended: done; cancelled (nothing changed, the range as it was); gave back (the range is unmapped
  // and its old handle released, or handed to the deferred releases when release_failed).
  enum class Outcome : std::uint8_t { cancelled, done, gave_back } outcome = Outcome::cancelled;
  bool release_failed = false;
};

class Policy {
 public:
  explicit Policy(DeviceEngine::State& s) : s_(s) {}
  virtual ~Policy() = default;
  virtual PolicyKind kind() const = 0;
  // Makes a free, mapped block of at least p.rounded bytes for (p.pool, p.stream) and returns it outside
  // the pool; nullptr with p.status set when the driver or the memory limit refused.
  virtual Block* grow(AllocParams& p) = 0;
  // Gives back to the driver everything cached (free, no events) in `only`, or in every pool when null.
  // `device_synchronized`: the whole device was synchronised just before (graph-private memory, R17), so no
  // stream need be waited for.
  virtual void release_free(PoolSet* only, bool device_synchronized) = 0;
  // Releases the segment of a free block that is a whole segment (classic); false if it cannot.
  virtual bool release_whole_segment(Block* b) { return false; }
  // Whether free block b should be split to serve a request of `rounded` bytes.
  virtual bool should_split(const Block* b, std::size_t rounded) const = 0;
  // Whether a small request that misses its own pool may take a free block of the large pool that no large
  // request fits (under kSmallSize) before the small pool grows (fragless).
  virtual bool small_from_large_remnants() const { return false; }
  // Whether best fit should prefer blocks that cannot grow (PyTorch's expandable-segments rule).
  virtual bool prefer_non_growable() const { return false; }
  // Physical bytes held but backing no page of any segment (fragless's idle pages).
  virtual std::size_t idle_bytes() const { return 0; }
  // Checks the policy's own invariants (empty when they hold).
  virtual std::string check() const { return {}; }

  // Background work (background.h). Under the device lock: the next job, false when there is none.
  virtual bool take_background_job(BackgroundJob*) { return false; }
  // Without the lock: the job's driver calls; it stops early when `abort` is set. `manual`: the caller
  // steps the background by hand and must not be kept waiting for the GPU.
  virtual void run_background_job(BackgroundJob&, const std::atomic<bool>& abort, bool manual) {}
  // Under the device lock: the job's results into the engine's books.
  virtual void finish_background_job(BackgroundJob&) {}
  // Under the device lock: free block b, which may overlap a multi-page mapping (Block::multi), went back
  // to its pool (merged with its free neighbours).
  virtual void freed(Block* b, DevicePtr lo, DevicePtr hi) {}

  Driver& driver() { return *s_.driver; }

 protected:
  // `only`, or the default pool and every private pool when null.
  std::vector<PoolSet*> pool_sets(PoolSet* only) {
    if (only) return {only};
    std::vector<PoolSet*> all{&s_.default_pools};
    for (auto& [id, ps] : s_.private_pools) all.push_back(ps.get());
    return all;
  }

  DeviceEngine::State& s_;
};

std::unique_ptr<Policy> make_classic_policy(DeviceEngine::State& s);
std::unique_ptr<Policy> make_expandable_policy(DeviceEngine::State& s);
std::unique_ptr<Policy> make_fragless_policy(DeviceEngine::State& s);

}  // namespace fragless
