#include "fragless/rounding.h"

#include <bit>

namespace fragless {

std::size_t roundup_divisions(std::size_t size, const Options& o) {
  // Interval i covers [2^i MiB, 2^(i+1) MiB); smaller sizes use interval 0, larger ones the last.
  const int log_mb = size >> 20 == 0 ? 0 : std::bit_width(size >> 20) - 1;
  const int index = log_mb < kRoundUpPowerOfTwoIntervals ? log_mb : kRoundUpPowerOfTwoIntervals - 1;
  return o.roundup_power2_divisions[static_cast<std::size_t>(index)];
}

std::size_t roundup_power2_next_division(std::size_t size, std::size_t divisions) {
  if (std::has_single_bit(size)) return size;
  const std::size_t floor = std::bit_floor(size);
  const std::size_t step = floor >> (std::bit_width(divisions) - 1);
  if (step == 0) return floor << 1;
  return round_up(size, step);
}

std::size_t round_size(std::size_t size, const Options& o) {
  if (size < kMinBlockSize) return kMinBlockSize;
  const std::size_t divisions = roundup_divisions(size, o);
  if (divisions > 1 && size > kMinBlockSize * divisions) return roundup_power2_next_division(size, divisions);
  return round_up(size, kMinBlockSize);
}

std::size_t classic_segment_size(std::size_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return round_up(rounded, kRoundLarge);
}

}  // namespace fragless
