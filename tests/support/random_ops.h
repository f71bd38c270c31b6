// A random walk over the engine's operations, shared by the randomized and integrity tests.
#pragma once
#include <random>
#include <vector>

#include "helpers.h"
#include "seed.h"

namespace fragless::test {

struct LiveBlock {
  char* ptr;
  std::size_t size;
  std::uint64_t id;
  Stream stream;
};

// Sizes like a training step's: many small tensors, 1–10 MiB activations, a few large ones.
inline std::size_t random_size(std::mt19937_64& rng) {
  const int kind = static_cast<int>(rng() % 100);
  if (kind < 40) return 1 + rng() % 65536;
  if (kind < 60) return 65536 + rng() % (1u << 20);
  if (kind < 90) return (1u << 20) + rng() % (9u << 20);
  return (10u << 20) + rng() % (30u << 20);
}

}  // namespace fragless::test
