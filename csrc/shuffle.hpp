// A random stream and a Fisher-Yates shuffle that reproduce numpy.random.RandomState exactly.
//
// numpy.random.RandomState(seed) with an integer seed is the 32-bit MT19937 generator seeded
// with init_genrand(seed), which is exactly std::mt19937(seed). RandomState.shuffle on a 1-D
// array walks i = n-1 .. 1 and swaps a[i] with a[j], where j is drawn by masked rejection:
// mask = the smallest 2^k - 1 >= i, draw 32-bit words (64-bit words, high half first, once
// i >= 2^32) until (word & mask) <= i. The permutation does not depend on the element type.
//
// Cost: the swaps hit random cache lines, so a plain loop is bound by memory latency
// (about 60 ns per element on 100M int32). The swap targets depend only on the random stream,
// never on the array, so we draw them a block ahead and prefetch the lines they will touch.
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace tokenmill {

class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : engine_(seed) {}

  uint32_t next_uint32() { return static_cast<uint32_t>(engine_()); }

  uint64_t next_uint64() {
    const uint64_t high = next_uint32();
    return (high << 32) | next_uint32();
  }

  // A uniform integer in [0, max], drawn exactly as numpy's random_interval.
  uint64_t interval(uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    uint64_t value = 0;
    if (max <= 0xffffffffULL) {
      do {
        value = next_uint32() & mask;
      } while (value > max);
    } else {
      do {
        value = next_uint64() & mask;
      } while (value > max);
    }
    return value;
  }

 private:
  std::mt19937 engine_;
};

// Shuffles `values` in place exactly as RandomState.shuffle would, advancing `random`.
template <typename T>
void shuffle_like_numpy(std::span<T> values, NumpyRandomState& random);

}  // namespace tokenmill
