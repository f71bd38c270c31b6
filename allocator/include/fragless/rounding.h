// Size rounding and pool/segment sizing: PyTorch's rules, exactly (reference §1–§3).
#pragma once
#include <cstddef>

#include "fragless/config.h"

namespace fragless {

inline constexpr std::size_t kMinBlockSize = 512;
inline constexpr std::size_t kSmallSize = 1u << 20;        // largest small-pool request
inline constexpr std::size_t kSmallBuffer = 2u << 20;      // small-pool segment / page
inline constexpr std::size_t kLargeBuffer = 20u << 20;     // segment for 1–10 MiB requests; large page
inline constexpr std::size_t kMinLargeAlloc = 10u << 20;
inline constexpr std::size_t kRoundLarge = 2u << 20;
inline constexpr std::size_t kMaxRequest = std::size_t{1} << 60;  // 1 EiB: larger requests are refused

constexpr std::size_t round_up(std::size_t v, std::size_t to) { return (v + to - 1) / to * to; }
constexpr std::size_t round_down(std::size_t v, std::size_t to) { return v / to * to; }

// Divisions for a requested size under the roundup_power2_divisions table.
std::size_t roundup_divisions(std::size_t size, const Options& o);
// PyTorch's roundup_power2_next_division.
std::size_t roundup_power2_next_division(std::size_t size, std::size_t divisions);
// PyTorch's round_size: every request goes through this before pool selection.
std::size_t round_size(std::size_t size, const Options& o);
inline bool is_small(std::size_t rounded) { return rounded <= kSmallSize; }
// PyTorch's get_allocation_size: the cudaMalloc size of a new classic segment.
std::size_t classic_segment_size(std::size_t rounded);

}  // namespace fragless
