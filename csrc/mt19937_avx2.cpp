// The Mersenne Twister's twist compiled for AVX2 (built with -mavx2 on x86-64 only).
#include "mt19937_twist.hpp"

namespace tokenmill::mt19937 {

void twist_avx2(uint32_t* state) { twist_state(state); }

}  // namespace tokenmill::mt19937
