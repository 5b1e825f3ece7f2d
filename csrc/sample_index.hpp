// GPTDataset index construction, bit-identical to megatron-core 0.19.
//
// document_index: `num_epochs` copies of the split's document ids, shuffled with one
//   NumpyRandomState(seed); when the final epoch is separate, the first E-1 copies are shuffled
//   together and the final copy alone (two consecutive shuffles of the same stream).
// sample_index [num_samples + 1, 2]: row k = (position in document_index, token offset) where
//   sample k starts. Samples take sequence_length new tokens each, so sample k starts at token
//   g = k * sequence_length of the concatenated document stream, and reads sequence_length +
//   extra tokens (extra = 1 overlaps the next sample). Megatron records the start as the first
//   document position p whose end reaches g + extra, at offset g - start(p); a sample that runs
//   past the data is recorded as (last position, size(last) - extra). Row 0 is always (0, 0).
//   Because every row is a function of k, rows are computed in parallel over document chunks.
// shuffle_index: arange(num_samples) shuffled (two ranges when the final epoch is separate),
//   drawn from the same stream after the document index, so it runs beside the sample index.
//
// Worked example (sizes [3, 2, 4], one epoch, document_index [2, 0, 1], sequence_length 3,
// extra 1): the stream is d2 d2 d2 d2 d0 d0 d0 d1 d1 (9 tokens), num_samples = (9 - 1) / 3 = 2,
// sample_index = [[0, 0], [0, 3], [1, 2]]: sample 0 reads d2[0:4], sample 1 reads d2[3:4] +
// d0[0:3], and the third row marks where sample 2 would start.
#pragma once

#include "common.hpp"

#include <cstdint>
#include <span>

namespace tokenmill {

// Sum of sizes[indices]; indices must be valid (checked by the caller).
int64_t sum_selected_lengths(UnalignedSpan<int32_t> sizes, std::span<const int32_t> indices);

// Index of the first entry outside [0, limit), or -1 if all are inside.
int64_t find_out_of_range(std::span<const int32_t> values, int64_t limit);

// `total_tokens` is the sum of the sizes of document_index, or -1 to count it here.
template <typename T>
void build_sample_index(UnalignedSpan<int32_t> sizes, std::span<const int32_t> document_index,
                        int64_t sequence_length, int64_t extra_token,
                        std::span<T> sample_index, int num_threads, int64_t total_tokens = -1);

struct GptIndexPlan {
  uint32_t seed = 0;
  int64_t num_epochs = 1;
  bool separate_final_epoch = false;
  // First shuffle range of the shuffle index: [0, shuffle_split) then [shuffle_split, n).
  int64_t shuffle_split = 0;
  int64_t sequence_length = 0;
  int64_t extra_token = 1;
  int num_threads = 1;
};

// Fills the three preallocated outputs: document_index (num_epochs * indices.size()),
// sample_index (2 * (num_samples + 1)) and shuffle_index (num_samples).
template <typename SampleT, typename ShuffleT>
void build_gpt_indices(UnalignedSpan<int32_t> sizes, std::span<const int32_t> indices,
                       const GptIndexPlan& plan, std::span<int32_t> document_index,
                       std::span<SampleT> sample_index, std::span<ShuffleT> shuffle_index);

}  // namespace tokenmill
