// expandable: PyTorch's expandable_segments:True. One growing segment per (stream, pool); 2 MiB pages in
// the small pool and 20 MiB pages in the large pool (rounded up to the driver's granularity); one physical
// handle per page, created on map and released on unmap.
#include "policy/growable.h"
#include "state/trace_emit.h"

namespace fragless {
namespace {

class ExpandablePolicy final : public GrowablePolicy {
 public:
  using GrowablePolicy::GrowablePolicy;
  PolicyKind kind() const override { return PolicyKind::expandable; }

 protected:
  std::size_t page_size(bool small) const override {
    return round_up(small ? kSmallBuffer : kLargeBuffer, s_.driver->granularity());
  }

  Status map_pages(Segment& seg, std::size_t first, std::size_t* n_io, std::size_t, const Run&) override {
    const std::size_t page = seg.page_size, n = *n_io;
    if (!s_.capacity_allows(n * page) || !seg.pages.prepare(first, n)) return Status::out_of_memory;
    // As ExpandableSegment::map: every page's handle is created first, and a create that fails releases the
    // ones made and maps nothing; then each is mapped and the range gets its access in one call.
    Driver& d = *s_.driver;
    std::size_t made = 0, mapped = 0;
    Status st = Status::ok;
    for (; made < n; ++made) {
      PhysHandle h = 0;
      if ((st = d.create(page, &h)) != Status::ok) break;
      seg.pages.slot(first + made) = PageRef{h, 0};
    }
    while (st == Status::ok && mapped < n)
      if ((st = d.map(seg.base + (first + mapped) * page, page, seg.pages.slot(first + mapped).handle, 0)) == Status::ok)
        ++mapped;
    if (st == Status::ok) st = d.set_access(seg.base + first * page, n * page);
    if (st != Status::ok) {  // undo: nothing of this call stays mapped or created
      for (std::size_t i = 0; i < made; ++i) {
        PageRef& r = seg.pages.slot(first + i);
        if (i < mapped) s_.give_back_mapping(seg.base + (first + i) * page, page);
        s_.give_back_handle(r.handle);
        r = PageRef{};
      }
      return st;
    }
    s_.add_reserved(seg.small, static_cast<std::int64_t>(n * page));
    return Status::ok;
  }

  std::size_t unmap_pages(Segment& seg, std::size_t first, std::size_t n, const Unmap&) override {
    const std::size_t page = seg.page_size;
    Driver& d = *s_.driver;
    std::size_t done = 0;
    for (; done < n; ++done) {
      PageRef& r = seg.pages.slot(first + done);
      if (d.unmap(seg.base + (first + done) * page, page) != Status::ok) break;
      s_.give_back_handle(r.handle);
      r = PageRef{};
    }
    s_.add_reserved(seg.small, -static_cast<std::int64_t>(done * page));
    return done;
  }
};

}  // namespace

std::unique_ptr<Policy> make_expandable_policy(DeviceEngine::State& s) {
  return std::make_unique<ExpandablePolicy>(s);
}

}  // namespace fragless
