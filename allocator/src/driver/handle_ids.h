// Handle values as the host and sim drivers hand them out (driver.h, R8): a value names its handle until the
// handle's memory is gone, and then comes back for a later handle, the most recently gone first, as an
// allocator's freed object address would. So an engine that kept a released handle's value anywhere meets
// it again under another handle at once, in every test, as it could under CUDA.
#pragma once
#include <vector>

#include "fragless/driver.h"

namespace fragless {

class HandleIds {
 public:
  PhysHandle take() {
    if (gone_.empty()) return next_++;
    const PhysHandle h = gone_.back();
    gone_.pop_back();
    return h;
  }
  void gone(PhysHandle h) { gone_.push_back(h); }

 private:
  PhysHandle next_ = 1;
  std::vector<PhysHandle> gone_;
};

}  // namespace fragless
