// The Mersenne Twister's twist compiled for AVX-512 (built with -mavx512f on x86-64 only).
#include "mt19937_twist.hpp"

namespace tokenmill::mt19937 {

void twist_avx512(uint32_t* state) { twist_state(state); }

}  // namespace tokenmill::mt19937
