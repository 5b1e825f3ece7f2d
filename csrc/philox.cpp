#include "philox.hpp"

#include <algorithm>

namespace tokenmill {
namespace {

// Multipliers and Weyl key increments of Philox4x64 (Random123's PHILOX_M4x64_*, PHILOX_W64_*).
constexpr uint64_t kMultiplier0 = 0xD2E7470EE14C6C93ULL;
constexpr uint64_t kMultiplier1 = 0xCA5A826395121157ULL;
constexpr uint64_t kKeyIncrement0 = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kKeyIncrement1 = 0xBB67AE8584CAA73BULL;

// 64 x 64 -> 128-bit product as (high, low) words, from four 32-bit partial products so the
// code needs no compiler extension (__int128 is not ISO C++).
inline void multiply_high_low(uint64_t a, uint64_t b, uint64_t& high, uint64_t& low) {
  const uint64_t a_low = a & 0xFFFFFFFFULL, a_high = a >> 32;
  const uint64_t b_low = b & 0xFFFFFFFFULL, b_high = b >> 32;
  const uint64_t low_low = a_low * b_low;
  const uint64_t high_low = a_high * b_low;
  const uint64_t low_high = a_low * b_high;
  const uint64_t high_high = a_high * b_high;
  const uint64_t middle = (low_low >> 32) + (high_low & 0xFFFFFFFFULL) + low_high;
  low = (middle << 32) | (low_low & 0xFFFFFFFFULL);
  high = high_high + (high_low >> 32) + (middle >> 32);
}

inline PhiloxBlock philox_round(const PhiloxBlock& counter, const PhiloxKey& key) {
  uint64_t high0 = 0, low0 = 0, high1 = 0, low1 = 0;
  multiply_high_low(kMultiplier0, counter[0], high0, low0);
  multiply_high_low(kMultiplier1, counter[2], high1, low1);
  return {high1 ^ counter[1] ^ key[0], low1, high0 ^ counter[3] ^ key[1], low0};
}

}  // namespace

PhiloxBlock philox4x64_10(PhiloxBlock counter, PhiloxKey key) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kKeyIncrement0;
      key[1] += kKeyIncrement1;
    }
    counter = philox_round(counter, key);
  }
  return counter;
}

void draw_chunk_sources(std::span<const uint64_t> thresholds, PhiloxKey key, uint64_t stream,
                        uint64_t draw, uint64_t first_chunk, std::span<int32_t> out) {
  const auto last = static_cast<int32_t>(thresholds.size()) - 1;
  for (size_t i = 0; i < out.size(); ++i) {
    const PhiloxBlock block = philox4x64_10({first_chunk + i, stream, draw, 0}, key);
    const uint64_t u53 = block[0] >> 11;
    // first s with u53 < thresholds[s]; thresholds.back() == 2^53 > u53, so one always exists
    const auto found = std::upper_bound(thresholds.begin(), thresholds.end(), u53);
    out[i] = std::min(static_cast<int32_t>(found - thresholds.begin()), last);
  }
}

}  // namespace tokenmill
