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

#include <cstddef>
#include <cstdint>
#include <span>

namespace tokenmill {

// The 32-bit Mersenne Twister, word for word the stream of std::mt19937(seed) (and of numpy's
// RandomState(seed)). Written out because the block "twist" is the hot loop of every shuffle:
// as three plain loops it vectorises, and on x86-64 it is compiled for AVX-512, AVX2 and the
// baseline with run-time dispatch (mt19937_twist.hpp); libstdc++'s engine runs about 5x slower on
// a baseline build.
class Mt19937 {
 public:
  static constexpr int kStateSize = 624;
  static constexpr int kShift = 397;

  explicit Mt19937(uint32_t seed) {
    state_[0] = seed;
    for (int i = 1; i < kStateSize; ++i) {
      const uint32_t previous = state_[static_cast<size_t>(i - 1)];
      state_[static_cast<size_t>(i)] =
          1812433253u * (previous ^ (previous >> 30)) + static_cast<uint32_t>(i);
    }
  }

  // The unit the block twist runs on: "avx512", "avx2" or "baseline" (cpu_features.hpp,
  // TOKENMILL_SIMD).
  static const char* twist_isa();

  uint32_t operator()() {
    if (position_ >= kStateSize) {
      twist(state_);
      position_ = 0;
    }
    uint32_t y = state_[static_cast<size_t>(position_++)];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
  }

 private:
  static void twist(uint32_t* state);

  uint32_t state_[kStateSize];
  int position_ = kStateSize;
};

class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : engine_(seed) {}

  uint32_t next_uint32() {
    if (head_ == tail_) refill();
    return buffer_[head_++];
  }

  uint64_t next_uint64() {
    const uint64_t high = next_uint32();
    return (high << 32) | next_uint32();
  }

  // A uniform integer in [0, max], drawn exactly as numpy's random_interval.
  uint64_t interval(uint64_t max) {
    if (max == 0) return 0;
    const uint64_t mask = mask_for(max);
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

  // The Fisher-Yates targets for steps i = top, top - 1, ... (top < 2^32): writes up to
  // `capacity` values targets[k] = interval(top - k) and returns how many it wrote, consuming
  // exactly the words those draws consume. Branch-free: every buffered word is tested once
  // and either accepted for the current step or skipped, so no misprediction per rejection.
  size_t intervals_descending(uint32_t top, uint32_t* targets, size_t capacity);

  static uint64_t mask_for(uint64_t max) {
    uint64_t mask = max;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    return mask;
  }

 private:
  static constexpr size_t kBufferSize = 4096;

  void refill() {
    for (size_t k = 0; k < kBufferSize; ++k) buffer_[k] = engine_();
    head_ = 0;
    tail_ = kBufferSize;
  }

  Mt19937 engine_;
  uint32_t buffer_[kBufferSize];
  size_t head_ = 0;
  size_t tail_ = 0;
};

// Shuffles `values` in place exactly as RandomState.shuffle would, advancing `random`.
template <typename T>
void shuffle_like_numpy(std::span<T> values, NumpyRandomState& random);

}  // namespace tokenmill
