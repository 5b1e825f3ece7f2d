// The active set compiled for AVX2 (this file is built with -mavx2 on x86-64 only; see
// CMakeLists.txt), chosen at run time by blending.cpp when the CPU has AVX2 (wheels stay baseline
// x86-64). Keys are computed exactly as key() does: a rounded product, then a rounded difference
// (no FMA: -ffp-contract=off). Nothing here has external linkage but the entry points: see
// blending_internal.hpp.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "blending_internal.hpp"

namespace tokenmill::blending {
namespace {

struct Simd {
  using V = __m256d;
  static constexpr size_t kWidth = 4;
  static V set1(double x) { return _mm256_set1_pd(x); }
  static V max(V a, V b) { return _mm256_max_pd(a, b); }
  static V keys(const double* w, const double* c, size_t k, V t) {
    return _mm256_sub_pd(_mm256_mul_pd(_mm256_load_pd(w + k), t), _mm256_load_pd(c + k));
  }
  static uint32_t equal(V a, V b) {
    return static_cast<uint32_t>(_mm256_movemask_pd(_mm256_cmp_pd(a, b, _CMP_EQ_OQ)));
  }
  static double hmax(V a) {
    __m128d h = _mm_max_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_max_pd(h, _mm_unpackhi_pd(h, h)));
  }
  static void set_lane(double* chunk, size_t lane, double value) {
    const __m256d mask = _mm256_castsi256_pd(_mm256_cmpeq_epi64(
        _mm256_set1_epi64x(static_cast<int64_t>(lane)), _mm256_setr_epi64x(0, 1, 2, 3)));
    _mm256_store_pd(chunk, _mm256_blendv_pd(_mm256_load_pd(chunk), _mm256_set1_pd(value), mask));
  }
};

#include "blending_active.inc"

}  // namespace

size_t run_active_avx2(const ActiveRun<int16_t>& run) { return run_active_set(run); }
size_t run_active_avx2(const ActiveRun<int32_t>& run) { return run_active_set(run); }

}  // namespace tokenmill::blending
