// The fragless policy's physical handle pool: every handle the policy created and has not released, each
// a whole number of pages, each in exactly one of four states:
//   idle   — mapped nowhere the engine sees; any request may take it;
//   reserve — one page the worker created ahead of growths (Note [Growth reserve], fragless_policy.h); only a
//            growth about to create takes it;
//   taken  — chosen for the request being mapped (from the idle set, or reclaimed from a hole);
//   mapped — mapped, whole, at one place in one segment (driver.h, R5: a mapping is one whole handle).
// Invariant (check()): idle + reserve + taken + mapped pages = created pages, and nothing is taken between
// operations. A handle lent without a sync (Note [Lending pages without a sync]) is also still mapped at
// its old address until its event completes; the pool sees only the engine's mapping.
#pragma once
#include <algorithm>
#include <cstddef>
#include <map>
#include <string>
#include <stdexcept>
#include <vector>

#include "fragless/driver.h"
#include "fragless/flat_table.h"

namespace fragless {

class HandlePool {
 public:
  enum class State : unsigned char { idle, taken, mapped, reserve };

  void add_taken(PhysHandle h, std::size_t pages) {
    info_[h] = Info{pages, State::taken};
    total_pages_ += pages;
    taken_.push_back(h);
  }
  std::size_t pages(PhysHandle h) const { return at(h).pages; }
  std::size_t idle_pages() const { return idle_pages_; }
  const std::vector<PhysHandle>& taken() const { return taken_; }

  // The idle handle to put next under a request that still needs `need` pages with `room` pages free to
  // map into: the smallest one that covers the need and fits the room, else the largest one below the
  // need; 0 if no idle handle fits. After a loop of picks ends, no idle handle fits the room left.
  PhysHandle pick(std::size_t need, std::size_t room) const {
    auto it = idle_.lower_bound(need);
    if (it != idle_.end() && it->first <= room) return it->second.oldest();
    if (it == idle_.begin()) return 0;
    --it;
    return it->first <= room ? it->second.oldest() : 0;
  }
  // Pages of the idle handles no larger than `room` (what could still be put under a request).
  std::size_t idle_pages_within(std::size_t room) const {
    std::size_t n = 0;
    for (auto it = idle_.begin(); it != idle_.end() && it->first <= room; ++it) n += it->first * it->second.count();
    return n;
  }

  // Note [Growth reserve]: pages the worker created ahead, one page a handle.
  void add_reserve(PhysHandle h) {
    info_[h] = Info{1, State::reserve};
    total_pages_ += 1;
    reserve_.push_back(h);
  }
  std::size_t reserve_pages() const { return reserve_.size(); }
  // Takes up to n reserve pages for the request, to be mapped after what it has taken; returns how many.
  std::size_t take_reserve(std::size_t n) {
    const std::size_t k = std::min(n, reserve_.size());
    for (std::size_t i = 0; i < k; ++i) {
      const PhysHandle h = reserve_.back();
      reserve_.pop_back();
      at(h).state = State::taken;
      taken_.push_back(h);
    }
    return k;
  }
  // Removes every reserve page, calling f(handle, 1) for each (to release it).
  template <class F>
  void release_reserve(F&& f) {
    for (PhysHandle h : reserve_) {
      f(h, std::size_t{1});
      info_.erase(h);
      total_pages_ -= 1;
    }
    reserve_.clear();
  }

  void take_idle(PhysHandle h) {
    Info& i = at(h);
    erase_idle(h, i.pages);
    i.state = State::taken;
    taken_.push_back(h);
  }
  // A mapped handle leaves its mapping for the request being mapped (reclaim) or for the idle set.
  void unmapped_to_taken(PhysHandle h) {
    at(h).state = State::taken;
    taken_.push_back(h);
  }
  void unmapped_to_idle(PhysHandle h) { to_idle(h); }
  void mark_mapped(PhysHandle h) { at(h).state = State::mapped; }
  // The first `count` taken handles were mapped (mark_mapped): they are no longer the request's.
  void forget_taken(std::size_t count) { taken_.erase(taken_.begin(), taken_.begin() + count); }
  // Mapped handle h was split in place (handle_splitter.h): handles `by`, of pages[i] pages each (pieces of
  // 1, 1, 2, 4, ... pages, or single pages), are mapped instead.
  void replace_mapped(PhysHandle h, const std::vector<PhysHandle>& by, const std::vector<std::size_t>& pages) {
    remove_mapped(h);
    for (std::size_t i = 0; i < by.size(); ++i) {
      info_[by[i]] = Info{pages[i], State::mapped};
      total_pages_ += pages[i];
    }
  }
  // Mapped handle `from` is called `to` from now on (Note [Handle aliases]).
  void rename_mapped(PhysHandle from, PhysHandle to) {
    const Info i = at(from);
    info_.erase(from);
    info_[to] = i;
  }
  // Mapped handle h was unmapped and released (a split that gave its range back).
  void remove_mapped(PhysHandle h) {
    total_pages_ -= at(h).pages;
    info_.erase(h);
  }
  // Removes idle handle h (to release it).
  void remove_idle(PhysHandle h) {
    const Info& i = at(h);
    erase_idle(h, i.pages);
    total_pages_ -= i.pages;
    info_.erase(h);
  }
  // After a failed request: what it had taken becomes idle.
  void return_taken() {
    for (PhysHandle h : taken_) to_idle(h);
    taken_.clear();
  }

  // Removes every idle handle, calling f(handle, pages) for each (to release it).
  template <class F>
  void release_idle(F&& f) {
    for (auto& [pages, list] : idle_)
      for (std::size_t i = list.head; i < list.handles.size(); ++i) {
        const PhysHandle h = list.handles[i];
        f(h, pages);
        info_.erase(h);
        total_pages_ -= pages;
      }
    idle_.clear();
    idle_pages_ = 0;
  }

  // `mapped_in_segments`: pages the segments map with this pool's handles, counted by the caller.
  std::string check(std::size_t mapped_in_segments) const {
    if (!taken_.empty()) return "fragless handle pool: handles taken for a request were left over";
    std::size_t idle = 0, reserve = 0, mapped = 0;
    info_.for_each([&](PhysHandle, const Info& i) {
      (i.state == State::idle ? idle : i.state == State::reserve ? reserve : mapped) += i.pages;
    });
    if (idle != idle_pages_) return "fragless handle pool: idle pages miscounted";
    if (reserve != reserve_.size()) return "fragless handle pool: reserve pages miscounted";
    if (idle + reserve + mapped != total_pages_)
      return "fragless handle pool: idle + reserve + mapped pages != created pages";
    if (mapped != mapped_in_segments) return "fragless handle pool: mapped pages != pages the segments map";
    return {};
  }

 private:
  struct Info { std::size_t pages; State state; };
  // The handle's entry; every handle asked about is in the pool (std::out_of_range otherwise, as the
  // std::unordered_map it replaced threw).
  Info& at(PhysHandle h) {
    Info* i = info_.find(h);
    if (!i) throw std::out_of_range("fragless handle pool: a handle it does not hold");
    return *i;
  }
  const Info& at(PhysHandle h) const { return const_cast<HandlePool*>(this)->at(h); }
  void to_idle(PhysHandle h) {
    Info& i = at(h);
    i.state = State::idle;
    idle_[i.pages].handles.push_back(h);
    idle_pages_ += i.pages;
  }
  void erase_idle(PhysHandle h, std::size_t pages) {
    auto it = idle_.find(pages);
    if (it == idle_.end()) return;
    IdleList& l = it->second;
    auto at = std::find(l.handles.begin() + static_cast<std::ptrdiff_t>(l.head), l.handles.end(), h);
    if (at == l.handles.end()) return;
    if (at == l.handles.begin() + static_cast<std::ptrdiff_t>(l.head))
      ++l.head;  // the oldest: pick()'s choice
    else
      l.handles.erase(at);
    idle_pages_ -= pages;
    if (l.count() == 0) {
      idle_.erase(it);
    } else if (l.head >= 32 && 2 * l.head >= l.handles.size()) {  // the taken front is dropped now and then
      l.handles.erase(l.handles.begin(), l.handles.begin() + static_cast<std::ptrdiff_t>(l.head));
      l.head = 0;
    }
  }

  // The idle handles of one size, oldest first: those from `head` on (the ones before it were taken).
  struct IdleList {
    std::vector<PhysHandle> handles;
    std::size_t head = 0;
    PhysHandle oldest() const { return handles[head]; }
    std::size_t count() const { return handles.size() - head; }
  };

  FlatTable<Info> info_;  // Note [Flat tables]: found on every growth's map and every split
  // By size in pages, none empty. A list per size, not a tree node per handle: an empty_cache or the
  // engine's end makes every free handle idle at once (tens of thousands in a replay), then releases them.
  std::map<std::size_t, IdleList> idle_;
  std::vector<PhysHandle> taken_;                // in the order they are to be mapped
  std::vector<PhysHandle> reserve_;              // Note [Growth reserve]: one page each
  std::size_t idle_pages_ = 0, total_pages_ = 0;
};

}  // namespace fragless
