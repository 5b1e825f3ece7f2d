// The Mersenne Twister's block "twist" (shuffle.hpp: Mt19937), the hot loop of every shuffle. As
// three plain loops it vectorises, so it is compiled three times: for the baseline
// (shuffle.cpp), for AVX2 (mt19937_avx2.cpp) and for AVX-512 (mt19937_avx512.cpp), the last two
// with per-file flags on x86-64 only and chosen at run time (cpu_features.hpp). The body lives in
// an unnamed namespace so each unit compiles its own copy; nothing compiled with wider
// instructions can be shared with baseline code (see blending_internal.hpp).
#pragma once

#include <cstdint>

namespace tokenmill::mt19937 {
namespace {

constexpr int kStateSize = 624;
constexpr int kShift = 397;

inline void twist_state(uint32_t* state) {
  constexpr uint32_t kUpper = 0x80000000u;
  constexpr uint32_t kLower = 0x7fffffffu;
  constexpr uint32_t kMatrix = 0x9908b0dfu;
  constexpr int n = kStateSize;
  constexpr int m = kShift;
  for (int i = 0; i < n - m; ++i) {
    const uint32_t y = (state[i] & kUpper) | (state[i + 1] & kLower);
    state[i] = state[i + m] ^ (y >> 1) ^ ((0u - (y & 1u)) & kMatrix);
  }
  for (int i = n - m; i < n - 1; ++i) {
    const uint32_t y = (state[i] & kUpper) | (state[i + 1] & kLower);
    state[i] = state[i + m - n] ^ (y >> 1) ^ ((0u - (y & 1u)) & kMatrix);
  }
  const uint32_t y = (state[n - 1] & kUpper) | (state[0] & kLower);
  state[n - 1] = state[m - 1] ^ (y >> 1) ^ ((0u - (y & 1u)) & kMatrix);
}

}  // namespace

#ifdef TOKENMILL_X86_UNITS
void twist_avx2(uint32_t* state);    // mt19937_avx2.cpp
void twist_avx512(uint32_t* state);  // mt19937_avx512.cpp
#endif

}  // namespace tokenmill::mt19937
