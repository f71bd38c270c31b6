// Policies decide how address space and physical pages back blocks. The engine owns pools, blocks,
// stats and the retry chain; a policy implements the virtual hooks declared below.
#pragma once
#include <atomic>
#include <memory>
#include <vector>

#include "state/engine_state.h"

namespace fragless {

class Policy : public BackgroundWork {
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
  // Whether the out-of-memory retry looks in the cache again after releasing it, before growing (fragless: a
  // block an event returned during the release, in a segment a live block keeps). PyTorch's malloc grows at
  // once (alloc_block after release_cached_blocks), and so do its models.
  virtual bool retry_searches_cache() const { return false; }
  // Whether best fit should prefer blocks that cannot grow (PyTorch's expandable-segments rule).
  virtual bool prefer_non_growable() const { return false; }
  // Physical bytes held but backing no page of any segment (fragless's idle pages).
  virtual std::size_t idle_bytes() const { return 0; }
  // Checks the policy's own invariants (empty when they hold).
  virtual std::string check() const { return {}; }

  // Background work (state/background.h, BackgroundWork): none unless a policy has some.
  bool take_background_job(BackgroundJob*) override { return false; }
  void run_background_job(BackgroundJob&, const std::atomic<bool>&, bool) override {}
  void finish_background_job(BackgroundJob&) override {}
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
