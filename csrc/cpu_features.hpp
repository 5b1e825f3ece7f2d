// Run-time CPU detection for the per-ISA units (blending_avx2.cpp, blending_avx512.cpp,
// mt19937_avx2.cpp, mt19937_avx512.cpp). Those units are compiled with -mavx2 / -mavx512* on
// x86-64 only (CMake defines TOKENMILL_X86_UNITS there); a caller runs one only when the flag
// below says the CPU (and the operating system, which must save the wider registers) supports
// it. Elsewhere every flag is false and only the baseline code exists.
#pragma once

namespace tokenmill {

struct CpuFeatures {
  bool avx2 = false;
  bool avx512 = false;  // F, DQ, BW and VL: what the AVX-512 units use
};

// Detected once per process (GCC's and clang's __builtin_cpu_supports, which also check that
// the OS enabled the registers).
const CpuFeatures& cpu_features();

}  // namespace tokenmill
