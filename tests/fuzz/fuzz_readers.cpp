// libFuzzer: the trace readers (pickle, PyTorch snapshot, RMM CSV, native) on arbitrary bytes. They
// must never crash, hang or read out of bounds; a refusal always names the problem; whatever loads can
// be written back out in every format.
#include <cstddef>
#include <cstdint>
#include <string>

#include "pickle.h"
#include "trace_model.h"

using namespace fragless::formats;

namespace {
void check(const LoadResult& r) {
  if (!r.ok) {
    if (r.error.empty()) __builtin_trap();
    return;
  }
  (void)trace_to_native(r.trace);
  (void)trace_to_rmm_csv(r.trace, 0);
  if (r.trace.events.size() + r.trace.seed.size() < 100000) (void)trace_to_snapshot(r.trace);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
#if defined(FUZZ_PICKLE)
  auto p = read_pickle(bytes);
  if (!p.value && p.error.empty()) __builtin_trap();
  check(trace_from_snapshot_bytes(bytes, "fuzz"));
#elif defined(FUZZ_CSV)
  check(trace_from_rmm_csv(bytes, "fuzz"));
#elif defined(FUZZ_NATIVE)
  check(trace_from_native_bytes(bytes, "fuzz"));
#else
  check(trace_from_bytes(bytes, "fuzz"));
#endif
  return 0;
}
