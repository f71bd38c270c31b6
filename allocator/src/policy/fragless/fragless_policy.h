// The fragless policy: growable segments with page-granular (2 MiB) pages whose physical memory comes from
// a device-wide pool of whole handles (handle_pool.h). One class, in four files by concept:
//   policy.cpp       placement: a growth's steps in order (idle handles, reclaim, creation, mapping),
//                    unmaps and what they give back, refills, failure, the background hooks, check();
//   reclaim.cpp      reclaim: whole handles under free blocks, and the audit of Note [Complete re-backing];
//   create.cpp       new memory: how much may be created, the shape of new handles (Note [Cells]), and the
//                    worker's reserve of pages (Note [Growth reserve]);
//   lent_ranges.h    lending: ranges lent without a sync until their old mappings go;
//   handle_splitter.h  splitting free multi-page handles in the background.
// A growth's state is one value, Growth, made by map_pages and passed to each step (and, through
// GrowablePolicy::Unmap, to unmap_pages): no step reads what another left in a member.
//
// Note [Whole handles]
// CUDA maps a physical handle only whole, at offset 0 (driver.h, R5), and unmaps whole mappings only (R7).
// So the unit that can move from one address to another is a handle, and its size is a policy choice:
// one page per handle moves the finest but costs a cuMemCreate per page; one handle per growth costs one
// call but pins the whole growth while any byte of it is live. `handles:ends` puts the body of a growth in
// handles of at most handle_max_mb and its last page, the one a neighbour may share, in a handle of its
// own, and `handles:cells` creates what expandable segments would (Note [Cells]); a free multi-page handle
// that an allocation has used is split into pieces in the background (Note [Split in the background]).
// docs/RESULTS.md, "Handle shapes", measures them. A handle larger than what a request still needs is
// mapped whole anyway when the unmapped room after the request holds it: the extra pages become free space
// at the segment's end. When the room does not hold it (a growth into a gap between mapped pages), the
// handle stays where it is and the growth creates: such memory is unusable to that growth for lack of a
// split (docs/RESULTS.md, "Pattern zoo", the multi-stream `random` draw).
//
// Note [Complete re-backing]
// Invariant, checked after every operation: fragless creates new physical memory only when no physical
// memory it already holds and could put under the request without waiting remains — no idle handle that
// fits the room, and no whole handle under a free block of a default pool on the requesting stream, or, with
// lend_across_streams, on another stream that has no unfinished work (Note [Lending across streams]) (holes
// and free segment tails alike), outside the run being grown. A growth in which a hole's unmap failed (a
// driver error) is exempt. Three exceptions: one ends cycles (Note [Refills]): a growth into pages that
// reclaims stripped twice within the last kRefillWindow growths creates its memory; a large-pool growth
// that could create all it needs leaves the small pool's free pages alone while they are no more than one
// cell (Note [The small pool keeps a cell]); and during a capture no hole is taken at all, only idle and
// new handles (Note [Capture rules]), and the check is not made. The worker's reserve (Note [Growth reserve])
// is made ahead of need, bounded by a cell; a growth it covers takes it instead of creating (audited too).
//
// Note [The small pool keeps a cell]
// A page of the small pool that re-backing moves under a large request is missing the next time small
// requests need it, and the small pool's growth then creates it again, on the caller's path: one
// cuMemCreate (about 190 µs on an A100) for every page moved, where expandable segments, which never move
// a page, create none. So a large-pool growth that could create everything it still needs (within the
// device's free memory and the memory fraction) takes no small-pool page while the small pool's free whole
// pages, among the holes it may take, are no more than one cell (small_keep: the larger of a large-pool cell,
// reserve_slack of live bytes between a page and chunk_size_mb, and a small buffer), nor than the pages the
// small pool has ever had allocated (at least one; State::small_allocated_high, never reset): a page it never
// needed is not one it will create again. (A small-pool growth of one page takes the smallest idle handle
// that covers it, as Note [Complete re-backing] requires, which may be a ten-page handle a large hole left; on
// a bf16 inference draw whose small requests never passed 0.61 MiB the small pool then kept 20 MiB free at
// the peak, 18 MiB above expandable.) The rule applies to the
// requesting stream's holes and to other idle streams' holes apart, as reclaim takes them, so what it withholds
// from re-backing is bounded by two cells, as the free tail a growth at a segment's end leaves is by one.
// Beyond that the small pool holds memory it does not need, and every free small page may be taken as before;
// when creating would exceed the device, too (a small page is never kept at the price of an out-of-memory: the
// last resort takes the kept pages first). If the driver refuses a create that an answer known without asking
// said would fit (memory another process took meanwhile, or physical memory too fragmented), the growth asks
// again and takes the kept pages itself, with the driver's fresh answer (Note [Asking for free memory]);
// only if that and the creates after it fail does the request go through the out-of-memory retry, which
// releases the free cached memory. Measured in
// docs/RESULTS.md ("Driver time on the allocation path", at 349e87f): on the Wedsonlin 128 training trace most of
// the path's extra creates were small-pool pages created again after re-backing took them (144 creates on the
// path became 97, expandable's count); some peaks rose by up to 22 MiB (serving), none above a peer's.
//
// Note [Growth reserve]
// A tensor that grows by concatenation (a KV cache that torch.cat makes one token longer at every decoding
// step, 2 per layer) is allocated a page or so past the free block its last copy left, into the page that
// re-backing left unmapped just below it: a growth into a gap that misses one page. With nothing free
// anywhere to re-back (live memory is growing), each such growth creates its page on the caller's path, one
// cuMemCreate per page, where expandable segments create 20 MiB per call: on a 12-layer rollout decoding 1,024
// tokens for 128 sequences (workload:rl with static_kv=0, d_model=4096), 11,000 path creates, 2.96 s of
// modelled driver time against expandable's 0.57 s. A gap's growth cannot round up to a cell (its room
// ends at the next mapped page), and a multi-page handle cannot be mapped in part (R5): the calls can only
// leave the path by being made before it. So the worker keeps a reserve of single pages:
//  - demand: a growth into a gap that still misses pages after idle handles and holes (Note [Complete
//    re-backing]), no more than a cell, adds them to gap_demand_, which loses kReserveDecay of itself at every
//    growth (about the last 32 growths' small gap misses). Frontier growths count nothing: their cells already
//    cost one call per cell. Larger gap misses neither: their handles of up to handle_max_mb cost a call per
//    32 pages, and a reserve of a cell would save none of them;
//  - target: from kReserveMinDemand pages of demand (about half of the recent growths missing a page each), the
//    demand itself (what the next 32 such growths would miss at the same rate; a host thread runs ahead of the
//    GPU, so a burst of growths may come before the worker's next turn), at most a large-pool cell
//    (reserve_slack of live bytes, between a page and chunk_size_mb): what the reserve holds at a peak is
//    bounded as a cell's free tail is. A growth that leaves the reserve short of the target wakes the worker
//    (the first wake starts the worker thread, on that growth's path, once);
//    A quarter of the demand measured the same on the replay's inputs, whose worker runs between events, but
//    took 158 of the decoding test's 538 path creates off the path where the demand takes 224 (the worker
//    runs there once per 24 growths: tests/core/test_reserve.cpp);
//  - use: a growth about to create (after idle handles and holes) takes reserve pages when they cover all it
//    still misses (taking fewer would save no create), frontier or gap, also after a create of its own was
//    refused part way; where creating would exceed the device it takes them for part of the growth too,
//    before the last resort's holes that need a wait. A frontier growth so served rounds nothing up to a cell,
//    and its pages are mappings of a page each;
//  - limits: as a refill (Note [Refills]), the reserve may not take reserved past reserve_slack above the
//    peak of live bytes plus two pages: made once live memory has stopped growing, with free memory held
//    elsewhere, it would be memory no growth needs (a zoo serving draw held 18 MiB of reserve at its peak,
//    4 MiB above expandable, without this bound). The worker creates only on a free-memory answer known
//    without asking that a growth would still use (Note [Asking for free memory]), and only while what stays
//    creatable after the pages is more than half of what the process may hold plus an eighth of the device,
//    within per_process_memory_fraction (never near the limit, where the memory belongs to requests);
//    never during a capture (no job runs while a pool routing is active); reserve pages count in reserved and
//    in idle_bytes, and a release of the default pools (empty_cache, the out-of-memory retry, teardown; not a
//    graph pool's) gives them back with the idle handles and forgets the demand. A create the driver refuses
//    ends the job with what it made, forgets the known free memory and halves the demand (no job is taken
//    again before a growth has asked the driver); the growth that then misses creates on its own path, with
//    its own out-of-memory retry. A page that the memory fraction, lowered while the job ran, no longer
//    allows goes to the deferred releases. Once demand fades the reserve is kept (at most a cell of the live
//    bytes when it was made), for the next growth that would create.
// Measured (docs/RESULTS.md, "Driver time on the allocation path"): that rollout's path falls to 0.78 s (peak
// +20 MiB, still 3.6 GiB below expandable's); over the driver table no input changes which targets it meets
// (rl's path from 205.9 to 174.6 ms); over five seeds of the general table's draws, 180 of 400 meet every
// target against 181 without the reserve, for 22% less path time.
//
// Note [Refills]
// A repeated step can make re-backing cycle: a miss at R takes memory from hole H, the next step's miss at
// H takes it back from R, and so on, an unmap and a map every step for ever. The sign is a growth into
// pages that reclaims stripped twice within kRefillWindow growths: the memory taken from there keeps being
// needed there. (Once is no sign: a step of another shape re-backs there legitimately.) Strips older than
// the window are forgotten where strips are added and read (forget_old_strips), so the list holds one
// window's strips, whatever the growths do (check() asserts it). Such a growth
// creates new memory instead (idle handles still come first), so both places keep memory and the
// step reaches a steady state with no driver call. A refill is bounded: it may not take reserved past
// reserve_slack above the peak of live bytes plus two pages, and past it the cycle goes on (a U-Net step at
// one image size moves 128 pages at every step, to one place and at the next step back: maps and a set-access
// on the path, no create; 0.40% to 1.19% of a step on 4 of docs/RESULTS.md's 15 fixed-shape workloads, "Repeated steps",
// which a larger reserve_slack buys off for about what expandable holds); a larger growth into stripped pages (a
// repeated chain of doubling activations, whose second pass lands where the first pass took memory from)
// re-backs completely instead, at the price of its driver calls. Lent ranges whose events have completed
// are unmapped by the worker (or, with background:False, by the growth first), so their handles count
// too. Holes on other streams are taken, before creating, where their stream has no unfinished work; a
// busy stream's only as the last resort, when creating would exceed the device, lent behind a device-side
// wait, or with lend_across_streams:False after a counted host synchronisation (Note [Lending across
// streams]). Private pools (graph capture) are never reclaimed from: their addresses are baked into
// graphs.
//
// Note [Lending across streams]
// The rule: a hole on another stream S is taken for a request on stream T, with no wait at all, when S has
// no unfinished work (an event recorded on S at that moment has already completed: the work that used the
// hole is done, and so is everything else S had queued). A hole of a busy S is taken only as the last
// resort, when creating the memory would exceed the device: then T is made to wait, on the device, for
// an event recorded on S (cuStreamWaitEvent), the old mapping stays until that event completes, and the
// host never waits. (CUDA's stream-ordered pools reuse memory across streams the same way,
// cudaMemPoolReuseAllowInternalDependencies.)
// Why: the event can only be recorded when the hole is taken, not when it was freed (recording one at
// every free would put a driver call, a cuEventRecord of about a microsecond, on the fast path of every
// free; the cache-hit pair costs well under that), so waiting for it makes T wait for everything queued on S
// since the free too: a pending NCCL receive on a communication stream would stall compute, and two ranks
// could wait on each other. Measured on the libcuda double's virtual clock (test_cuda_path.cpp, "lending
// across streams waits for what it must"): a hole freed on S, then a kernel of 100000 ticks queued on S;
// lending it to T the old way delayed T's next kernel by 100100 ticks, with this rule by 0 (T gets new
// memory); on a full device the last resort delays it by the same 100100 ticks and the host by 0.
// Per-thread default streams (driver.h, R16) are asked through the mark their own thread records at each
// free there (engine_state.h). `lend_across_streams:False` takes other streams' holes only as the last
// resort, after synchronising S on the host.
//
// Note [Lending pages without a sync]
// cuMemUnmap is not stream-ordered, so unmapping a hole while its stream may still run work that used it
// needs a synchronisation first (PyTorch synchronises before every unmap). But a hole on the requesting
// stream need not be unmapped first: its handles are mapped at the new address while the old mappings stay
// (R9: one handle may be mapped at several addresses). The new block's work is queued on the same stream
// after everything that used the hole, so stream order makes the sharing safe. An event recorded on the
// stream at that moment tells when the old mappings may go; they are unmapped once the event has completed
// (by the background worker, or polled on later slow paths: lent_ranges.h), or, if their address range is needed again before that, after waiting for
// the event, which counts as a forced synchronisation. Until its old mapping is gone a lent range is
// `unmapped` to the engine and no other request maps it.
//
// Note [Strips die with their segment]
// A strip (Stripped, Note [Refills]) names its segment by the Segment object's address. A release that
// drops a segment frees that object, and the heap may place the next new segment at the same address: a
// strip left behind would then count as a strip of the new segment, and a growth there would be a refill
// (new memory) where it should re-back (reclaim). Whether it is depends on where malloc put the object,
// that is on the heap's history, not on the requests: the same requests made different decisions
// natively, under valgrind and with glibc's per-thread cache off, and a replay of a recorded run reserved
// a different peak than the run. So a release forgets the strips of the segments it dropped
// (after_release): a new segment has no history. (The splitter's queue names handles, not segments: a
// handle of a dropped segment was unmapped, so its queued split is dropped when its turn comes.)
//
// In a steady state (the same step again) no driver call and no synchronisation happen once every request
// hits the cache; where re-backing keeps cycling instead (Note [Refills]: some fixed-shape steps, and
// repeated decoding and random steps, docs/RESULTS.md "Repeated steps"), each step maps the same pages again,
// creating nothing. Otherwise the driver is only touched when the working set changes shape.
#pragma once
#include <atomic>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "policy/fragless/handle_pool.h"
#include "policy/fragless/handle_splitter.h"
#include "policy/fragless/lent_ranges.h"
#include "policy/growable.h"

namespace fragless {

// One growth of the fragless policy (one map_pages call), passed to each of its steps.
struct Growth {
  Stream stream = 0;                  // the segment's: the stream of the request
  bool small = false;                 // the segment's pool
  DevicePtr run_lo = 0, run_hi = 0;   // the run being grown: reclaim must not take pages from it
  std::size_t planned = 0;            // pages taken for the request so far
  bool unmap_failed = false;          // an unmap of a hole failed (the driver's fault, Note [Complete re-backing])
  bool keep_small = false;            // the small pool's free pages are left alone (Note [The small pool keeps a cell])
  std::map<Stream, bool> idle;        // whether a stream had no unfinished work when first asked
  std::size_t need = 0;               // pages the growth maps
  // The device's free and total memory as this growth sees it (Note [Asking for free memory]): known once
  // first needed, less what the growth has created since.
  bool asked = false;
  bool known = false;                 // ... known without asking the driver
  bool refused = false;               // the driver refused a create of this growth
  std::size_t free_bytes = 0, total_bytes = 0;
};

class FraglessPolicy final : public GrowablePolicy {
 public:
  using GrowablePolicy::GrowablePolicy;
  std::size_t near_fit_pages() const override { return kNearFitPages; }
  PolicyKind kind() const override { return PolicyKind::fragless; }
  // Idle handles, and released ones a lent range still maps (LentRanges::hold_released): held, not mapped.
  std::size_t idle_bytes() const override {
    return (pool_.idle_pages() + pool_.reserve_pages()) * page_ + lent_.held_bytes();
  }
  bool small_from_large_remnants() const override { return s_.opts.small_in_remnants; }
  bool retry_searches_cache() const override { return true; }
  std::string check() const override;
  void release_free(PoolSet* only, bool device_synchronized) override;
  void freed(Block* b, DevicePtr lo, DevicePtr hi) override;
  bool take_background_job(BackgroundJob* job) override;
  void run_background_job(BackgroundJob& job, const std::atomic<bool>& abort, bool manual) override;
  void finish_background_job(BackgroundJob& job) override;

 protected:
  std::size_t page_size(bool) const override { return page_; }
  // Whole pages of b, narrowed to the whole mappings inside them (R7).
  bool unmappable_pages(const Block* b, std::size_t* lo, std::size_t* hi) const override {
    return whole_pages(b, lo, hi) && whole_mappings(*b->segment, lo, hi);
  }
  Status map_pages(Segment& seg, std::size_t first, std::size_t* n_io, std::size_t room, const Run& run) override;
  std::size_t unmap_pages(Segment& seg, std::size_t first, std::size_t n, const Unmap& how) override;
  bool multi_page(const Segment& seg, std::size_t first, std::size_t n) const override {
    return splitter_.any_multi(seg, first, n);
  }
  // During a capture a lent range is neither polled nor waited for (Note [Capture rules]): a growth passes
  // over a run that would map over one, to a later run or a new segment, instead of failing.
  bool may_map(const Segment& seg, std::size_t first, std::size_t n) const override {
    return !s_.capturing() || !lent_.overlaps(seg, first, n);
  }
  bool maps_over_lent(const Segment& seg, std::size_t first, std::size_t n) override {
    return lent_.pending(seg, first, n);
  }
  // After a release (empty_cache, OOM retry): every idle handle goes back to the driver, and the strips of
  // the segments the release dropped are forgotten (Note [Strips die with their segment]).
  void after_release() override {
    pool_.release_idle([&](PhysHandle h, std::size_t pages) { release_handle(h, pages); });
    // Note [Growth reserve]: given back by a release of the default pools (empty_cache, the out-of-memory
    // retry, teardown), not by a graph pool's, and not made again until gap growths want it again.
    if (releasing_defaults_) {
      pool_.release_reserve([&](PhysHandle h, std::size_t pages) { release_handle(h, pages); });
      gap_demand_ = 0;
    }
    std::erase_if(stripped_, [&](const Stripped& s) { return !s_.has_segment(s.seg); });
  }

 private:
  struct Stripped { const Segment* seg; std::size_t lo, hi; std::uint64_t tick; std::uint32_t times; };
  static constexpr std::uint64_t kRefillWindow = 256;  // growths
  // Note [Near fits] (growable.cpp): 8 pages (16 MiB). Measured at 493b96e over the driver table of
  // docs/RESULTS.md, the general tables' seeds 1-3 and 36 draws of workload:rl: 4 and 16 save rl's path as
  // much (within 20 ms) but took `random` to 4.52% and 3.38% over live against 3.28%.
  static constexpr std::size_t kNearFitPages = 8;
  // Whole mappings [lo, hi) (segment pages) inside the free block b.
  struct Candidate { Block* b; std::size_t lo, hi; };

  static std::size_t mapping_start(const Segment& seg, std::size_t page) {
    return page - seg.pages[page].offset / seg.page_size;
  }
  // Narrows mapped pages [*lo, *hi) of seg to the whole mappings inside them; false if none.
  bool whole_mappings(const Segment& seg, std::size_t* lo, std::size_t* hi) const;
  bool background() const { return s_.opts.background != BackgroundMode::off; }
  bool lend_across() const { return s_.opts.lend_pages && s_.opts.lend_across_streams; }
  // Whether stream st had no unfinished work when this growth first asked (asked once per growth).
  bool idle(Growth& g, Stream st);

  // policy.cpp: placement, unmaps, refills, failure.
  std::string check_multi() const;
  void take_idle(Growth& g, std::size_t need, std::size_t room);
  Status fail_request(Status st, const std::vector<PhysHandle>& created, const std::vector<PhysHandle>& idled = {});
  void give_back(Segment& seg, std::size_t first, std::size_t n, Growth* to_request);
  // The handles mapped from pages [first, first + n) of seg, each at its first page.
  static std::vector<PhysHandle> handles_at(const Segment& seg, std::size_t first, std::size_t n);
  bool refills(const Segment& seg, std::size_t first, std::size_t missing);
  void forget_old_strips();
  bool past_refill_bound(std::size_t bytes) const;
  void move_reserved(bool to_small, std::size_t bytes);
  void release_handle(PhysHandle h, std::size_t pages, bool memory_goes = true);

  // reclaim.cpp
  bool reclaimable(const Block* b, const Growth& g, std::size_t* lo, std::size_t* hi) const;
  // In cands_ (Note [Growth buffers]).
  std::vector<Candidate>& candidates(Growth& g, Stream stream, bool other_streams, bool idle_only = false);
  std::size_t reclaimable_pages(Growth& g);
  void reclaim(Growth& g, bool other_streams, std::size_t need, std::size_t room, bool busy_too = false);
  void audit_creation(Growth& g, const Segment& target, std::size_t missing, std::size_t room);

  // create.cpp
  // The device's free memory for a growth: from the driver, or known without asking (Note [Asking for free
  // memory]).
  void device_free(Growth& g);
  // Forgets what device_free knew: the next growth asks the driver (after a create the driver refused).
  void forget_device_free() {
    known_free_.valid = false;
    new_answer();
  }
  // What device_free knows changed (the driver answered on the path, or its answer is forgotten): a worker's
  // question asked before this is not kept, and one not yet taken is not asked.
  void new_answer() {
    ++answers_;
    if (refresh_ == Refresh::wanted) refresh_ = Refresh::none;
  }
  // The worker's free-memory question (Note [Asking for free memory]): taken when one is wanted, and its
  // answer kept when no call that changes free memory began while it was asked and nothing newer is known.
  bool take_memory_info(BackgroundJob* job);
  void finish_memory_info(const BackgroundJob& job);
  // What the process may hold at most, in bytes: the device (total_bytes), or per_process_memory_fraction of it.
  std::size_t process_limit(std::size_t total_bytes) const {
    return s_.memory_limited ? std::min(total_bytes, s_.allowed_memory_maximum) : total_bytes;
  }
  // free_b, less what the memory fraction leaves to a process holding `held` (with per_process_memory_fraction).
  std::size_t within_fraction(std::size_t free_b, std::size_t held) const {
    return std::min(free_b, s_.allowed_memory_maximum > held ? s_.allowed_memory_maximum - held : 0);
  }
  // With limit_pages: also process_limit, in pages.
  std::size_t creatable_pages(Growth& g, std::size_t* limit_pages = nullptr);
  // Whether creating `pages` more leaves less than half of what this process may hold still creatable
  // (Note [Cells]: near the limit, no handle is larger than chunk_size_mb).
  bool memory_tight(Growth& g, std::size_t pages);
  // (pages > 0: creatable_pages already weighs the memory fraction, reading the held bytes once.)
  bool can_create(Growth& g, std::size_t pages) { return creatable_pages(g) >= pages; }
  // The handle sizes, in pages, in shape_ (Note [Growth buffers]).
  const std::vector<std::size_t>& shape(Growth& g, std::size_t missing, std::size_t room, std::size_t at, bool small,
                                        bool frontier);
  const std::vector<std::size_t>& cells(Growth& g, std::size_t missing, std::size_t room, std::size_t at,
                                        std::size_t chunk, bool frontier);
  Status create(Growth& g, std::size_t missing, std::size_t room, std::size_t at, bool small, bool frontier,
                std::vector<PhysHandle>* created);
  void add_created(Growth& g, PhysHandle h, std::size_t pages, std::vector<PhysHandle>* created);
  // Note [Growth reserve]
  void reserve_demand(const Growth& g, bool gap);
  void refill_reserve();
  std::size_t reserve_target() const;
  bool take_reserve_job(BackgroundJob* job);
  static void run_reserve(Driver& d, std::size_t page, BackgroundJob& job, const std::atomic<bool>& abort);
  void finish_reserve(BackgroundJob& job);
  std::size_t cell_pages(bool small) const;
  // Note [The small pool keeps a cell]: at most this many free small-pool pages are kept from a large growth.
  std::size_t small_keep() const {
    const std::size_t high = (static_cast<std::size_t>(s_.small_allocated_high) + page_ - 1) / page_;
    return std::clamp(high, cell_pages(true), std::max(cell_pages(false), cell_pages(true)));
  }

  std::size_t page_ = s_.driver->granularity();
  HandlePool pool_;
  HandleSplitter splitter_{s_, pool_, page_};  // Note [Split in the background]
  std::uint64_t tick_ = 0;         // growths so far
  // Note [Growth reserve]: pages gap growths had to get new, less kReserveDecay of it every growth; the
  // reserve wanted from kReserveMinDemand on, as many pages as the demand; whether the worker is creating reserve
  // pages.
  static constexpr double kReserveDecay = 1.0 / 32;
  static constexpr double kReserveMinDemand = 16;
  double gap_demand_ = 0;
  bool reserve_in_flight_ = false;
  bool releasing_defaults_ = false;  // release_free is releasing the default pools (or everything)
  std::deque<Stripped> stripped_;  // ranges reclaims took memory from, within kRefillWindow growths
  LentRanges lent_{s_, page_};    // lent ranges still mapped at their old address
  // What the driver last answered about free memory (Note [Asking for free memory]).
  struct KnownFree {
    bool valid = false;
    std::size_t free = 0, total = 0;
    std::size_t reserved = 0;  // what fragless held when it asked
    unsigned uses = 0;         // growths answered without asking since
  };
  static constexpr unsigned kAskEvery = 64;               // growths
  static constexpr unsigned kRefreshAt = kAskEvery / 2;  // ...and the worker asks after this many
  KnownFree known_free_;
  // The device's free memory now, as k tells it with fragless holding `held`: what fragless added since it
  // asked comes out of the free memory; what it gave back goes into it.
  static std::size_t known_now(const KnownFree& k, std::size_t held) {
    return held >= k.reserved ? (k.free > held - k.reserved ? k.free - (held - k.reserved) : 0)
                              : std::min(k.total, k.free + (k.reserved - held));
  }
  enum class Refresh : std::uint8_t { none, wanted, asking } refresh_ = Refresh::none;  // the worker's question
  std::uint64_t answers_ = 0;  // new_answer calls so far
  // Note [Growth buffers]
  // A growth's lists (the handle sizes it creates, the handles it created, the holes it could take) live in
  // these members, cleared and refilled by each growth, so that memory first growing does not allocate and free
  // them on every growth. Only the allocation path uses them, under the device lock (the worker's splits have
  // their own), and no step that fills one runs while another step still reads it.
  std::vector<std::size_t> shape_;
  std::vector<PhysHandle> created_;
  std::vector<Candidate> cands_;
  std::string audit_;              // a broken Note [Complete re-backing], for check()
  mutable bool audit_on_ = false;  // check() has been called: audit every creation (Note [Auditing creations])
};

}  // namespace fragless
