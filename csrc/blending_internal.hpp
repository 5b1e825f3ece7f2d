// Internal to the blending kernels: what the drivers (blending.cpp), the tree
// (blending_tree.cpp) and the per-ISA units of the active set (blending_active.inc, compiled in
// blending.cpp for the baseline and in blending_avx2.cpp / blending_avx512.cpp) share.
//
// The per-ISA units are compiled with -mavx2 / -mavx512* (CMakeLists.txt) and called only after
// a run-time CPU check (cpu_features.hpp). Any function they compile with external linkage (an
// inline function from a header, a std:: template instantiated on std:: types) is a weak symbol
// the linker may pick for every other caller in the library, which would then run AVX
// instructions on a CPU without them. So everything defined here lives in an unnamed namespace
// (each unit compiles its own copy for its own instruction set), containers use a local
// allocator (their instantiations are local too), and a unit's only external symbols are the
// entry points declared at the end. CMake checks the units' symbol tables for exactly that
// (cmake/check_isa_symbols.cmake).
#pragma once

#include "blending.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <span>
#include <vector>

namespace tokenmill::blending {
namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

inline double key(double weight, double count, double time) {
  // Exactly megatron's expression: the product is rounded, then the difference.
  return weight * time - count;
}

// std::allocator's behaviour under a type local to each translation unit, so that every
// container instantiated on it is local as well (see the file comment).
template <typename T>
struct LocalAllocator {
  using value_type = T;
  LocalAllocator() = default;
  template <typename U>
  explicit LocalAllocator(const LocalAllocator<U>& /*other*/) noexcept {}
  T* allocate(size_t count) {
    return static_cast<T*>(::operator new(count * sizeof(T), std::align_val_t{alignof(T)}));
  }
  void deallocate(T* pointer, size_t /*count*/) noexcept {
    ::operator delete(pointer, std::align_val_t{alignof(T)});
  }
  friend bool operator==(const LocalAllocator& /*a*/, const LocalAllocator& /*b*/) {
    return true;
  }
};

template <typename T>
using Vector = std::vector<T, LocalAllocator<T>>;

constexpr size_t kScanWays = 4;  // independent running maxima

// The first d < lanes (a multiple of kScanWays) with the largest weight[d] * time - count[d]:
// megatron's scan, computed as kScanWays interleaved scans whose running maxima do not wait on
// each other. Each keeps the first index holding its maximum (strict >), so the answer is the
// smallest index among those holding the overall maximum.
inline size_t scan_first_max(const double* weight, const double* count, size_t lanes,
                             double time) {
  if (lanes <= 2 * kScanWays) {
    // Few datasets: megatron's own loop is faster than merging interleaved maxima (measured).
    size_t first = 0;
    double top = key(weight[0], count[0], time);
    for (size_t d = 1; d < lanes; ++d) {
      const double k = key(weight[d], count[d], time);
      if (k > top) {
        top = k;
        first = d;
      }
    }
    return first;
  }
  double best[kScanWays];
  size_t where[kScanWays];
  for (size_t a = 0; a < kScanWays; ++a) {
    best[a] = -kNever;
    where[a] = a;
  }
  for (size_t d = 0; d < lanes; d += kScanWays) {
    for (size_t a = 0; a < kScanWays; ++a) {
      const double k = key(weight[d + a], count[d + a], time);
      // A mask, not a branch: the running maximum changes unpredictably, and GCC otherwise
      // branches on it (measured 1.3x slower at 100 datasets).
      const size_t take = size_t{0} - static_cast<size_t>(k > best[a]);
      where[a] = (where[a] & ~take) | ((d + a) & take);
      best[a] = k > best[a] ? k : best[a];
    }
  }
  double top = best[0];
  for (size_t a = 1; a < kScanWays; ++a) top = best[a] > top ? best[a] : top;
  size_t first = lanes;
  for (size_t a = 0; a < kScanWays; ++a) {
    if (best[a] == top && where[a] < first) first = where[a];
  }
  return first;
}

// Every dataset examined at every sample. Padding lanes and spent datasets have count +inf

constexpr size_t kActiveMinDatasets = 48;  // below this, the plain scan is as fast (measured)
constexpr size_t kDefaultWindow = 1024;
constexpr double kDefaultMargin = 0.02;
constexpr double kMaxMargin = 0.5;

inline size_t round_up(size_t value, size_t step) { return (value + step - 1) / step * step; }

// A dataset booked to re-enter the active set at sample `time` (min-heap order: time, then id).
struct Due {
  int64_t time;
  int32_t dataset;
};
inline bool operator>(const Due& a, const Due& b) {
  return a.time != b.time ? a.time > b.time : a.dataset > b.dataset;
}

}  // namespace

// One run of the active set, as plain pointers (nothing a per-ISA unit could share, see above):
// fills samples [start, samples) of `ids` / `positions` from `counts[d]`, the counts at sample
// `start` (+inf: spent; `limits[d]`: the count at which d is spent, +inf for greedy blends), and
// leaves the counts where it stopped in `counts`.
template <typename IndexT>
struct ActiveRun {
  const double* weights;
  const double* limits;
  double* counts;
  size_t datasets;
  const BlendingOptions* options;
  size_t start;
  IndexT* ids;
  int64_t* positions;
  size_t samples;
  // Stop early when A stays large, for the tree to take over (ActiveBlend::run).
  bool may_hand_over;
};

// The active set compiled for one instruction set; each returns the sample it stopped at
// (ActiveBlend::run). Baseline: SSE2 on x86-64, scalar elsewhere (blending.cpp).
size_t run_active_baseline(const ActiveRun<int16_t>& run);
size_t run_active_baseline(const ActiveRun<int32_t>& run);
#ifdef TOKENMILL_X86_UNITS
size_t run_active_avx2(const ActiveRun<int16_t>& run);  // blending_avx2.cpp
size_t run_active_avx2(const ActiveRun<int32_t>& run);
size_t run_active_avx512(const ActiveRun<int16_t>& run);  // blending_avx512.cpp
size_t run_active_avx512(const ActiveRun<int32_t>& run);
// Greedy blending of at most kRegisterScanMaxDatasets datasets by the AVX-512 register kernel
// alone (blending_avx512.cpp); `limits` and `may_hand_over` are unused, and it always reaches
// `samples`.
constexpr size_t kRegisterScanMaxDatasets = 96;
void register_scan_avx512(const ActiveRun<int16_t>& run);
void register_scan_avx512(const ActiveRun<int32_t>& run);
#endif

// The kinetic tournament tree from sample `start` (blending_tree.cpp); the same contract as the
// active set, over spans.
template <typename IndexT>
size_t tree_from(std::span<const double> weights, std::span<const double> limits,
                 std::vector<double>& counts, size_t start, std::span<IndexT> ids,
                 std::span<int64_t> positions);

}  // namespace tokenmill::blending
