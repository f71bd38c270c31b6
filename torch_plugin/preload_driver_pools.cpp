// libfragless_preload.so, the driver half (preload_driver.h): pools (R23), a device's current pool and a
// pool's statistics (R24), and what the interposer keeps about a block: the pool it came from, its buffer id
// (R25).
#include <cstdio>
#include <mutex>
#include <unordered_map>

#include "preload_core.h"
#include "preload_driver.h"

namespace fragless_preload::cu {

// ---- Pools (R23, R24) ---------------------------------------------------------------------------------------

constexpr int kMaxPools = 256;
KnownPool g_pools[kMaxPools];
std::atomic<int> g_pool_count{0};
std::mutex g_pools_mu;

// A destroyed pool's slot: its handle value may come back for a new pool, which must not inherit the old
// one's statistics; the slot is taken again only once no fragless block of the old pool is live.
const CUmemoryPool kDestroyed = reinterpret_cast<CUmemoryPool>(~std::uintptr_t{0});

KnownPool* find_pool(CUmemoryPool p) {
  const int n = g_pool_count.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)  // acquire: a slot's device and servable are written before its handle
    if (g_pools[i].pool.load(std::memory_order_acquire) == p) return &g_pools[i];
  return nullptr;
}

void remember_pool(CUmemoryPool p, int device, bool servable) {
  std::lock_guard lk(g_pools_mu);
  const int n = g_pool_count.load(std::memory_order_acquire);
  KnownPool* k = nullptr;
  for (int i = 0; i < n && !k; ++i) {
    const CUmemoryPool q = g_pools[i].pool.load(std::memory_order_relaxed);
    if (q == p || (q == kDestroyed && g_pools[i].used.load(std::memory_order_relaxed) == 0)) k = &g_pools[i];
  }
  if (!k) {
    if (n == kMaxPools) return;  // unknown pools are forwarded
    k = &g_pools[n];
  }
  if (k->pool.load(std::memory_order_relaxed) != p) {  // a new slot, or a destroyed one taken again
    k->pool.store(nullptr, std::memory_order_release);
    k->used_high.store(0, std::memory_order_relaxed);
    k->reserved_high.store(0, std::memory_order_relaxed);
    k->max_size.store(0, std::memory_order_relaxed);
  }
  k->device.store(device, std::memory_order_relaxed);
  k->servable.store(servable, std::memory_order_relaxed);
  k->pool.store(p, std::memory_order_release);
  if (k == &g_pools[n]) g_pool_count.store(n + 1, std::memory_order_release);  // published once filled in
}

// The pool is gone: its slot keeps counting the fragless blocks still live from it (their frees find it by
// address, not by handle) but answers to no handle.
void forget_pool(CUmemoryPool p) {
  std::lock_guard lk(g_pools_mu);
  if (KnownPool* k = find_pool(p)) {
    k->servable.store(false, std::memory_order_relaxed);
    k->pool.store(kDestroyed, std::memory_order_release);
  }
}

// Each device's default pool (once seen) and its current pool (cuDeviceSetMemPool, cuMemSetMemPool; nullptr
// until one is set), by ordinal: cuMemAllocAsync allocates from the current pool of the stream's device.
constexpr int kMaxDevices = 64;
std::atomic<CUmemoryPool> g_default_pools[kMaxDevices], g_current_pools[kMaxDevices];

void remember_default_pool(CUmemoryPool p, int device) {
  if (device < 0 || device >= kMaxDevices) return;
  if (!find_pool(p)) remember_pool(p, device, true);
  g_default_pools[device].store(p, std::memory_order_release);
}

// A device without memory pools (the driver has no cuDeviceGetDefaultMemPool, or says the device does not
// support it): there is no pool to follow or count, and fragless serves the stream-ordered calls as it did
// before it followed pools, where the driver's own would fail.
KnownPool g_no_pools;

KnownPool* current_pool(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  if (CUmemoryPool p = g_current_pools[device].load(std::memory_order_acquire)) return find_pool(p);
  CUmemoryPool p = g_default_pools[device].load(std::memory_order_acquire);
  CUdevice d = -1;
  if (!p && real().device_get(&d, device) == CUDA_SUCCESS) {
    const CUresult r = real().default_pool ? real().default_pool(&p, d) : CUDA_ERROR_NOT_SUPPORTED;
    if (r == CUDA_SUCCESS) remember_default_pool(p, device);
    if (r == CUDA_ERROR_NOT_SUPPORTED) {
      g_no_pools.servable.store(true, std::memory_order_relaxed);
      return &g_no_pools;
    }
  }
  return p ? find_pool(p) : nullptr;
}

bool pool_cap_reached(const KnownPool* k, size_t size) {
  const std::uint64_t cap = k ? k->max_size.load(std::memory_order_relaxed) : 0;
  if (cap == 0) return false;
  cuuint64_t reserved = 0;
  const CUmemoryPool p = k->pool.load(std::memory_order_acquire);
  return real().pool_get_attribute && real().pool_get_attribute(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) == CUDA_SUCCESS &&
         reserved + size > cap;
}

void raise_to(std::atomic<std::uint64_t>& high, std::uint64_t v) {
  std::uint64_t h = high.load(std::memory_order_relaxed);
  while (h < v && !high.compare_exchange_weak(h, v, std::memory_order_relaxed)) {
  }
}

// ---- What the interposer keeps about a block ----------------------------------------------------------------

// Per device, the fragless blocks the interposer keeps something about, by address: the pool it was
// allocated from and the size asked (R24), its buffer id once asked for (R25). An entry goes at the block's
// free (fragless_preload::forget, from either half). Each device's book has its own lock; a free skips it
// while the book is empty.
struct Entry {
  KnownPool* pool = nullptr;
  std::uint64_t asked = 0;
  unsigned long long id = 0;
};
struct DeviceBook {
  std::mutex mu;
  std::unordered_map<CUdeviceptr, Entry> live;
  std::atomic<std::size_t> entries{0};
};

DeviceBook* book(int device) {
  static DeviceBook* books = new DeviceBook[kMaxDevices];  // never destroyed: frees may come from static destructors
  return device >= 0 && device < kMaxDevices ? &books[device] : nullptr;
}

// R25: fragless's ids have the top bit set; the driver's count its allocations from 1.
constexpr unsigned long long kFraglessBufferIds = 1ull << 63;

// The buffer id of the block at `base` on `device` (0: none can be kept).
unsigned long long buffer_id(int device, CUdeviceptr base) {
  static std::atomic<unsigned long long> next{0};
  DeviceBook* b = book(device);
  if (!b) return 0;
  std::lock_guard lk(b->mu);
  Entry& e = b->live[base];
  if (!e.id) e.id = kFraglessBufferIds | (next.fetch_add(1, std::memory_order_relaxed) + 1);
  b->entries.store(b->live.size(), std::memory_order_release);
  return e.id;
}

// The pool the block at `base` was allocated from (nullptr: none, or not from a pool).
CUmemoryPool pool_of(int device, CUdeviceptr base) {
  DeviceBook* b = book(device);
  if (!b || b->entries.load(std::memory_order_acquire) == 0) return nullptr;
  std::lock_guard lk(b->mu);
  auto it = b->live.find(base);
  return it != b->live.end() && it->second.pool ? it->second.pool->pool.load(std::memory_order_relaxed) : nullptr;
}

void say_once(std::atomic<bool>& said, const char* what) {
  if (!said.exchange(true)) std::fprintf(stderr, "fragless (LD_PRELOAD): %s\n", what);
}

// Whether fragless grants `peer` access to memory of `device` (the cuda driver grants every peer that can
// access it when peer_access is on).
bool fragless_grants(int device, int peer) {
  fragless::Allocator* a = fragless_preload::allocator();
  if (!a || !a->options().peer_access) return false;
  const Real& r = real();
  CUdevice d = -1, p = -1;
  int can = 0;
  if (r.device_get(&d, device) != CUDA_SUCCESS || r.device_get(&p, peer) != CUDA_SUCCESS) return false;
  auto can_access = reinterpret_cast<CUresult (*)(int*, CUdevice, CUdevice)>(
      real_dlsym() ? real_dlsym()(r.lib, "cuDeviceCanAccessPeer") : nullptr);
  return can_access && can_access(&can, p, d) == CUDA_SUCCESS && can;
}

}  // namespace fragless_preload::cu

using namespace fragless_preload::cu;

extern "C" {

FRAGLESS_EXPORT CUresult cuMemPoolCreate(CUmemoryPool* pool, const CUmemPoolProps* props) {
  const CUresult r = real().pool_create(pool, props);
  if (r != CUDA_SUCCESS || !pool || !props) return r;
  bool servable = props->allocType == CU_MEM_ALLOCATION_TYPE_PINNED && props->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
                  props->handleTypes == CU_MEM_HANDLE_TYPE_NONE && props->maxSize == 0 && props->usage == 0;
  int dev = -1;
  CUdevice d = -1;
  if (props->location.type == CU_MEM_LOCATION_TYPE_DEVICE && real().device_get(&d, props->location.id) == CUDA_SUCCESS)
    dev = props->location.id;  // known for a pool fragless cannot serve too (Note [Forwarded allocations out of memory])
  remember_pool(*pool, dev, servable && dev >= 0);
  if (KnownPool* k = find_pool(*pool)) k->max_size.store(props->maxSize, std::memory_order_relaxed);
  return r;
}

FRAGLESS_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool, CUdevice dev) {
  const CUresult r = real().default_pool(pool, dev);
  if (r != CUDA_SUCCESS || !pool) return r;
  remember_default_pool(*pool, ordinal_of(dev));
  return r;
}

FRAGLESS_EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc* map, size_t count) {
  const CUresult r = real().pool_set_access(pool, map, count);
  const KnownPool* k = find_pool(pool);
  if (r != CUDA_SUCCESS || !k || !map) return r;
  const int dev = k->device.load(std::memory_order_relaxed);
  bool servable = k->servable.load(std::memory_order_relaxed);
  for (size_t i = 0; i < count && servable; ++i)
    if (map[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && map[i].location.id != dev &&
        map[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && !fragless_grants(dev, map[i].location.id))
      servable = false;  // a peer that would read fragless memory without access
  remember_pool(pool, dev, servable);
  return r;
}

FRAGLESS_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  const CUresult r = real().pool_destroy(pool);
  if (r == CUDA_SUCCESS) forget_pool(pool);  // fragless's blocks live on until freed
  return r;
}

// R24: the pool's statistics count the fragless memory allocated from it.
FRAGLESS_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  if (!real().pool_get_attribute) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().pool_get_attribute(pool, attr, value);
  const KnownPool* k = r == CUDA_SUCCESS && value ? find_pool(pool) : nullptr;
  if (!k) return r;
  auto add = [&](const std::atomic<std::uint64_t>& v) { *static_cast<cuuint64_t*>(value) += v.load(std::memory_order_relaxed); };
  if (attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT || attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) add(k->used);
  else if (attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) add(k->used_high);
  else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) add(k->reserved_high);
  return r;
}

// R24: a high-water mark the driver reset (to zero: it refuses any other value) restarts from fragless's use.
FRAGLESS_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  if (!real().pool_set_attribute) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().pool_set_attribute(pool, attr, value);
  KnownPool* k = r == CUDA_SUCCESS ? find_pool(pool) : nullptr;
  if (k && attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) k->used_high.store(k->used.load(std::memory_order_relaxed));
  if (k && attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) k->reserved_high.store(k->used.load(std::memory_order_relaxed));
  return r;
}

// The current pool of a device: cuMemAllocAsync on its streams allocates from it (R24).
FRAGLESS_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
  if (!real().device_set_pool) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().device_set_pool(dev, pool);
  const int ordinal = r == CUDA_SUCCESS ? ordinal_of(dev) : -1;
  if (ordinal >= 0 && ordinal < kMaxDevices) g_current_pools[ordinal].store(pool, std::memory_order_release);
  return r;
}
FRAGLESS_EXPORT CUresult cuMemSetMemPool(CUmemLocation* location, CUmemAllocationType type, CUmemoryPool pool) {
  if (!real().mem_set_pool) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = real().mem_set_pool(location, type, pool);
  if (r == CUDA_SUCCESS && location->type == CU_MEM_LOCATION_TYPE_DEVICE && type == CU_MEM_ALLOCATION_TYPE_PINNED &&
      location->id >= 0 && location->id < kMaxDevices)
    g_current_pools[location->id].store(pool, std::memory_order_release);
  return r;
}

}  // extern "C"

// ---- What either half's allocation and free tell this one (preload_core.h) -----------------------------------

fragless_preload::cu::KnownPool* fragless_preload::current_pool_served(int device) {
  static std::atomic<bool> said{false};
  KnownPool* k = current_pool(device);
  if (k && k->servable.load(std::memory_order_relaxed)) return k;
  say_once(said,
           "cudaMallocAsync or cuMemAllocAsync on a device whose current memory pool fragless cannot serve as the "
           "driver would (unknown to it, or with a shareable handle type, a maximum size, a usage, or access for a "
           "peer it does not grant): its allocations go to the runtime or the driver");
  return nullptr;
}

bool fragless_preload::current_pool_cap_reached(int device, size_t size) {
  return pool_cap_reached(current_pool(device), size);
}

void fragless_preload::count_in(int device, const void* p, cu::KnownPool* k, std::uint64_t asked) {
  DeviceBook* b = book(device);
  if (!b) return;
  const std::uint64_t now = k->used.fetch_add(asked, std::memory_order_relaxed) + asked;
  raise_to(k->used_high, now);
  raise_to(k->reserved_high, now);
  std::lock_guard lk(b->mu);
  b->live[reinterpret_cast<CUdeviceptr>(p)] = Entry{k, asked, 0};
  b->entries.store(b->live.size(), std::memory_order_release);
}


void fragless_preload::forget(int device, const void* p) {
  DeviceBook* b = book(device);
  if (!b || b->entries.load(std::memory_order_acquire) == 0) return;
  std::lock_guard lk(b->mu);
  auto it = b->live.find(reinterpret_cast<CUdeviceptr>(p));
  if (it == b->live.end()) return;
  if (KnownPool* k = it->second.pool) k->used.fetch_sub(it->second.asked, std::memory_order_relaxed);
  b->live.erase(it);
  b->entries.store(b->live.size(), std::memory_order_release);
}
