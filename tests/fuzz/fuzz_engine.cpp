// libFuzzer: operation sequences over the engine (every policy, sim driver with a small capacity):
// allocate, free, record_stream, retire_stream, empty_cache, memory fraction, and another user of the device
// taking and giving back memory the engine does not see (Note [Asking for free memory]); the invariant checker
// after every operation.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fragless/engine.h"
#include "fragless/sim_driver.h"

using namespace fragless;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  Options o;
  o.policy = static_cast<PolicyKind>(data[0] % 3);
  o.driver = DriverKind::sim;
  SimDriverOptions so;
  so.capacity = 256u << 20;
  DeviceEngine e(o, make_sim_driver(so));
  std::vector<void*> live;
  std::vector<PhysHandle> theirs;  // another user's memory, created through the same driver
  std::size_t i = 1;
  auto byte = [&]() -> std::uint32_t { return i < size ? data[i++] : 0; };
  while (i < size) {
    const std::uint32_t op = byte() % 11;
    switch (op) {
      case 0:
      case 1:
      case 2: {
        const std::uint32_t a = byte(), b = byte();
        const std::size_t bytes = op == 0 ? a * 512 + b : op == 1 ? (a << 16 | b << 8) : (static_cast<std::size_t>(a % 64) << 20) + b;
        AllocError err;
        if (void* p = e.allocate(bytes, byte() % 3, &err)) live.push_back(p);
        else if (bytes && err.message.empty()) __builtin_trap();
        break;
      }
      case 3:
      case 4:
        if (!live.empty()) {
          const std::size_t k = byte() % live.size();
          if (e.free(live[k]) != Status::ok) __builtin_trap();
          live.erase(live.begin() + static_cast<long>(k));
        }
        break;
      case 5:
        if (!live.empty()) e.record_stream(live[byte() % live.size()], byte() % 4);
        break;
      case 6: e.empty_cache(); break;
      case 7: (void)e.set_memory_fraction((byte() % 11) / 10.0); break;
      case 8: {  // another user takes 2 to 64 MiB, if the device has it
        PhysHandle h = 0;
        if (e.driver().create((byte() % 32 + 1) * (2u << 20), &h) == Status::ok) theirs.push_back(h);
        break;
      }
      case 9:
        if (!theirs.empty()) {
          const std::size_t k = byte() % theirs.size();
          if (e.driver().release(theirs[k]) != Status::ok) __builtin_trap();
          theirs.erase(theirs.begin() + static_cast<long>(k));
        }
        break;
      case 10:  // a stream destroyed (Note [Destroyed streams]); a later use of the value names a new stream
        if (e.retire_stream(1 + byte() % 3) != Status::ok) __builtin_trap();
        break;
    }
    if (!e.check_invariants().empty()) __builtin_trap();
  }
  for (void* p : live) e.free(p);
  for (PhysHandle h : theirs) e.driver().release(h);
  e.empty_cache();
  if (!e.check_invariants().empty()) __builtin_trap();
  return 0;
}
