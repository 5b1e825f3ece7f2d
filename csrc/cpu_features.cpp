#include "cpu_features.hpp"

#include <cstdlib>

namespace tokenmill {
namespace {

CpuFeatures detect() {
  CpuFeatures features;
#ifdef TOKENMILL_X86_UNITS
  __builtin_cpu_init();
  features.cpu_avx2 = __builtin_cpu_supports("avx2");
  features.cpu_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
  features.avx2 = features.cpu_avx2;
  features.avx512 = features.cpu_avx512;
  const char* pinned = std::getenv("TOKENMILL_SIMD");
  features.requested = pinned == nullptr ? "" : pinned;
  const std::string& want = features.requested;
  const char* has = features.cpu_avx512 ? "avx512, avx2, baseline"
                    : features.cpu_avx2 ? "avx2, baseline"
                                        : "baseline";
  if (want.empty() || want == "auto") return features;
  if (want == "baseline") {
    features.avx2 = features.avx512 = false;
  } else if (want == "avx2") {
    if (!features.cpu_avx2) {
      features.error = "TOKENMILL_SIMD=avx2, but this CPU (or this build) has no AVX2 unit; "
                       "it runs: " + std::string(has);
    }
    features.avx512 = false;
  } else if (want == "avx512") {
    if (!features.cpu_avx512) {
      features.error = "TOKENMILL_SIMD=avx512, but this CPU (or this build) lacks AVX-512 F, DQ, "
                       "BW or VL; it runs: " + std::string(has);
    }
  } else {
    features.error = "TOKENMILL_SIMD='" + want +
                     "' is not one of 'auto', 'baseline', 'avx2', 'avx512' (this CPU runs: " +
                     has + ")";
  }
  if (!features.error.empty()) {  // never run a unit the CPU lacks: the import refuses anyway
    features.avx2 = features.avx2 && features.cpu_avx2;
    features.avx512 = features.avx512 && features.cpu_avx512;
  }
  return features;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

const char* simd_level() {
  const CpuFeatures& features = cpu_features();
  return features.avx512 ? "avx512" : features.avx2 ? "avx2" : "baseline";
}

}  // namespace tokenmill
