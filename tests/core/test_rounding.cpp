#include <catch2/catch.hpp>

#include "fragless/rounding.h"

using namespace fragless;

TEST_CASE("round_size follows PyTorch's rules", "[rounding]") {
  Options o;
  CHECK(round_size(1, o) == 512);
  CHECK(round_size(512, o) == 512);
  CHECK(round_size(513, o) == 1024);
  CHECK(round_size(4, o) == 512);
  CHECK(round_size(20480000, o) == 20480000);  // already a multiple of 512
  CHECK(round_size(1200, o) == 1536);
  o.roundup_power2_divisions.fill(4);
  CHECK(round_size(1200, o) == 1536);  // 1200 <= 512 * 4: plain rounding (reference §2)
  CHECK(roundup_power2_next_division(1200, 4) == 1280);
  CHECK(round_size(3 * (1u << 20) + 1, o) == 3670016);  // 2 MiB floor, step 512 KiB -> 3.5 MiB
  CHECK(round_size(4u << 20, o) == 4u << 20);           // powers of two unchanged
}

TEST_CASE("division table lookup covers 2^i MiB up to 2^(i+1) MiB", "[rounding]") {
  Options o;
  o.roundup_power2_divisions[0] = 2;
  o.roundup_power2_divisions[1] = 8;
  o.roundup_power2_divisions[15] = 16;
  CHECK(roundup_divisions(100, o) == 2);
  CHECK(roundup_divisions((1u << 20) + 5, o) == 2);
  CHECK(roundup_divisions(2u << 20, o) == 8);
  CHECK(roundup_divisions(std::size_t{1} << 40, o) == 16);
}

TEST_CASE("classic segment sizes", "[rounding]") {
  CHECK(classic_segment_size(512) == 2u << 20);
  CHECK(classic_segment_size(1u << 20) == 2u << 20);
  CHECK(classic_segment_size((1u << 20) + 512) == 20u << 20);
  CHECK(classic_segment_size((10u << 20) - 512) == 20u << 20);
  CHECK(classic_segment_size(10u << 20) == 10u << 20);
  CHECK(classic_segment_size((10u << 20) + 512) == 12u << 20);
  CHECK(is_small(1u << 20));
  CHECK_FALSE(is_small((1u << 20) + 512));
}
