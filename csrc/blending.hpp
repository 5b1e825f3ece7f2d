// Blending indices for BlendedDataset, bit-identical to megatron-core 0.19.
//
// Greedy: for sample i (t = max(i, 1) as a double), every dataset d has the error
// weights[d] * t - count[d]; the first dataset with the strictly largest error is chosen, its
// current count is the sample's index inside that dataset, and the count is incremented.
// Exhaustive: weights are sizes[d] / sum(sizes) and only datasets that still have samples left
// take part; it stops when every dataset is spent (output length = sum(sizes)).
#pragma once

#include <cstdint>
#include <span>

namespace tokenmill {

template <typename IndexT>
void build_blending_indices(std::span<const double> weights, std::span<IndexT> dataset_index,
                            std::span<int64_t> dataset_sample_index);

template <typename IndexT>
void build_exhaustive_blending_indices(std::span<const int64_t> sizes,
                                       std::span<IndexT> dataset_index,
                                       std::span<int64_t> dataset_sample_index);

}  // namespace tokenmill
