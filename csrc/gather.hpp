// Sample gathering for GPTDataset: shuffle index -> sample index -> document parts -> tokens,
// and every per-token output megatron-core derives from them, in one pass per sample.
//
// A sample k is `sequence_length + extra` consecutive tokens of the documents listed in
// document_index, from row shuffle_index[k] of the sample index to the next row (see
// python/tokenmill/datasets/gpt.py for the layout). The tokens are read in their storage
// dtype and widened once, straight into the output rows; a sample shorter than
// `sequence_length + extra` (the partial last sample of a split) is padded with the pad id.
//
// Cost: one read of the sample's tokens plus one write of each requested output; the
// per-sample bookkeeping is a handful of loads from the index arrays (no allocation).
#pragma once

#include "common.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace tokenmill {

// Where each requested sample starts and ends: (begin row, begin offset, end row, end offset),
// four int64 per sample. Throws std::out_of_range for an index outside [-n, n) (n samples;
// negative indices count from the end, as numpy does) or a shuffle entry outside the sample
// index (a corrupt index cache).
template <typename ShuffleT, typename SampleT>
void resolve_samples(std::span<const ShuffleT> shuffle_index, std::span<const SampleT> sample_index,
                     std::span<const int64_t> indices, std::span<int64_t> bounds);

// The per-sample outputs that gather_samples may fill. Spans that are empty are not written.
// Row r of every output belongs to sample `rows[r]`'s position in the batch (identity when
// `rows` is empty).
template <typename OutT>
struct GatherOutputs {
  std::span<OutT> tokens;            // [B, S]
  std::span<OutT> labels;            // [B, S]
  std::span<float> loss_mask;        // [B, S]
  std::span<int64_t> position_ids;   // [B, S]
  std::span<int64_t> document_starts;  // [B, S]: first position of the token's document (EOD rule)
  std::span<int32_t> cu_seqlens;     // [B, S + 1] (inter-document masking)
  std::span<int32_t> max_seqlen;     // [B]
};

struct GatherOptions {
  int64_t sequence_length = 0;  // S
  int64_t extra_token = 1;      // 0 or 1
  int64_t eod = 0;
  int64_t pad = -1;
  bool eod_mask_loss = false;
  bool reset_position_ids = false;
  // Positions restart in every document part and cu_seqlens/max_seqlen are filled
  // (megatron-core's inter_document_masking); otherwise positions follow the EOD rule.
  bool inter_document_masking = false;
  int num_threads = 1;  // threads sharing the batch's samples
};

// Gather the samples whose bounds resolve_samples computed and fill `outputs`.
// `pointers` are byte offsets into `tokens` (the whole .bin as TokenT); `rows[i]` is the batch
// row of sample i (empty: row i). Throws std::out_of_range when the index arrays point outside
// the document index, the sequences or the .bin (a corrupt index), never reading out of bounds.
template <typename TokenT, typename OutT>
void gather_samples(std::span<const int64_t> bounds, std::span<const int32_t> document_index,
                    UnalignedSpan<int64_t> pointers, UnalignedSpan<int32_t> lengths,
                    std::span<const TokenT> tokens, std::span<const int64_t> rows,
                    const GatherOptions& options, const GatherOutputs<OutT>& outputs);

}  // namespace tokenmill
