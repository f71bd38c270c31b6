// libfragless_preload.so built without cuda.h: there is no driver half (preload_driver*.cpp), so no pool is
// known and none is counted. What the runtime half asks of the driver half (preload_core.h) is answered here
// as the runtime half worked before pools were followed: cudaMallocAsync is fragless's on every device.
#include "preload_core.h"

namespace fragless_preload {
namespace cu {
struct KnownPool {};  // no pool is known here: one placeholder that stands for "served, counted nowhere"
}  // namespace cu

namespace {
cu::KnownPool g_served;
}

cu::KnownPool* current_pool_served(int) { return &g_served; }
void count_in(int, const void*, cu::KnownPool*, std::uint64_t) {}
void forget(int, const void*) {}
bool current_pool_cap_reached(int, size_t) { return false; }

}  // namespace fragless_preload
