#include "blending.hpp"

#include <algorithm>
#include <vector>

namespace tokenmill {

// Straightforward O(samples x datasets) versions; see blending.hpp for the rule.
template <typename IndexT>
void build_blending_indices(std::span<const double> weights, std::span<IndexT> dataset_index,
                            std::span<int64_t> dataset_sample_index) {
  const size_t n = weights.size();
  std::vector<int64_t> counts(n, 0);
  for (size_t i = 0; i < dataset_index.size(); ++i) {
    const double t = static_cast<double>(std::max<size_t>(i, 1));
    size_t best = 0;
    double best_error = weights[0] * t - static_cast<double>(counts[0]);
    for (size_t d = 1; d < n; ++d) {
      const double error = weights[d] * t - static_cast<double>(counts[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index[i] = static_cast<IndexT>(best);
    dataset_sample_index[i] = counts[best]++;
  }
}

template <typename IndexT>
void build_exhaustive_blending_indices(std::span<const int64_t> sizes,
                                       std::span<IndexT> dataset_index,
                                       std::span<int64_t> dataset_sample_index) {
  const size_t n = sizes.size();
  int64_t total = 0;
  for (const int64_t size : sizes) total += size;
  std::vector<double> weights(n);
  for (size_t d = 0; d < n; ++d) {
    weights[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
  }
  std::vector<int64_t> counts(n, 0);
  for (size_t i = 0; i < dataset_index.size(); ++i) {
    const double t = static_cast<double>(std::max<size_t>(i, 1));
    size_t best = n;
    double best_error = 0.0;
    for (size_t d = 0; d < n; ++d) {
      if (counts[d] == sizes[d]) continue;
      const double error = weights[d] * t - static_cast<double>(counts[d]);
      if (best == n || error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index[i] = static_cast<IndexT>(best);
    dataset_sample_index[i] = counts[best]++;
  }
}

template void build_blending_indices<int16_t>(std::span<const double>, std::span<int16_t>,
                                              std::span<int64_t>);
template void build_blending_indices<int32_t>(std::span<const double>, std::span<int32_t>,
                                              std::span<int64_t>);
template void build_exhaustive_blending_indices<int16_t>(std::span<const int64_t>,
                                                         std::span<int16_t>, std::span<int64_t>);
template void build_exhaustive_blending_indices<int32_t>(std::span<const int64_t>,
                                                         std::span<int32_t>, std::span<int64_t>);

}  // namespace tokenmill
