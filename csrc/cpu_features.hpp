// Run-time CPU detection for the per-ISA units (blending_avx2.cpp, blending_avx512.cpp,
// mt19937_avx2.cpp, mt19937_avx512.cpp). Those units are compiled with -mavx2 / -mavx512* on
// x86-64 only (CMake defines TOKENMILL_X86_UNITS there); a caller runs one only when the flag
// below says the CPU (and the operating system, which must save the wider registers) supports
// it. Elsewhere every flag is false and only the baseline code exists.
//
// TOKENMILL_SIMD (read once, at the first dispatch; the module refuses to import with a bad one)
// pins the dispatch of the shuffle's MT19937 twist and of the blending kernels: "baseline",
// "avx2" or "avx512" (or "auto"/unset: the best the CPU has). Pinning caps the flags below, so
// every kernel that asks takes the pinned unit; asking for a unit the CPU (or this build) lacks
// is an error, never a fallback, so a CI run that says it tested AVX-512 did.
#pragma once

#include <string>

namespace tokenmill {

struct CpuFeatures {
  bool avx2 = false;
  bool avx512 = false;  // F, DQ, BW and VL: what the AVX-512 units use
  // What the CPU (and this build) supports, before TOKENMILL_SIMD capped the two flags above.
  bool cpu_avx2 = false;
  bool cpu_avx512 = false;
  std::string requested;  // TOKENMILL_SIMD as given ("" when unset)
  std::string error;      // non-empty: TOKENMILL_SIMD cannot be honoured (why)
};

// Detected once per process (GCC's and clang's __builtin_cpu_supports, which also check that
// the OS enabled the registers), then capped by TOKENMILL_SIMD.
const CpuFeatures& cpu_features();

// The unit the dispatch uses: "avx512", "avx2" or "baseline".
const char* simd_level();

}  // namespace tokenmill
