// Packing plans: which pieces of which documents fill each row of `row_length` tokens.
//
// Pieces. A document of length L <= row_length is one piece. A longer one is cut into windows
// of at most row_length tokens starting every (row_length - overlap) tokens; every window but
// the first repeats the `overlap` tokens before it, and those are marked as a masked prefix
// (their targets were already trained in the previous window). Windows are generated until one
// reaches the end of the document.
//
// Plan. A row is a list of entries (document, offset, length, masked prefix, flags). Two
// planners, both deterministic functions of their input:
//  * best-fit decreasing: pieces are taken in blocks of `window` (in the given, already
//    shuffled order), each block sorted by length (longest first, ties in stream order), and
//    each piece goes to the open row with the least room that still fits it (ties: the row
//    opened first), else to a new row. Rows close when full, when they hold
//    `max_pieces_per_row` pieces, or, if more than `max_open_rows` are open, fullest first.
//    Rows are padded at the end; nothing is dropped.
//  * BOS-aligned best fit (nanochat's rule, without its waste): every row is filled to the last
//    token. From a buffer of `window` pieces, the longest piece that fits the room left is
//    placed; when none fits, the shortest piece is cropped to fill the row exactly and its
//    remainder goes back into the buffer, to start a later row behind an inserted BOS token
//    (flag kInsertedBos, one token of the row). Long documents are not cut into windows
//    first: they are cropped the same way. Only the last row can have padding.
// The piece stream is cut into segments of `segment` pieces planned independently, so segments
// run on several threads and the plan is identical for any thread count.
//
// Cost: O(pieces x (log window + row_length / 64)); about 1 s per 10M documents per thread.
#pragma once

#include "common.hpp"

#include <cstdint>
#include <span>
#include <vector>

namespace tokenmill {

constexpr int64_t kInsertedBos = 1;

struct PackingPlan {
  // Entry e: document (position in the caller's order), token offset, length, masked prefix,
  // flags. Rows are entries [row_offsets[r], row_offsets[r + 1]).
  std::vector<int64_t> entries;  // 5 values per entry
  std::vector<int64_t> row_offsets{0};
  int64_t padding = 0;         // row tokens holding no data
  int64_t inserted_bos = 0;    // BOS tokens the planner added
};

struct PackingOptions {
  int64_t row_length = 0;
  int64_t overlap = 0;
  int64_t max_pieces_per_row = 64;
  int64_t window = 8192;
  int64_t max_open_rows = 1024;
  int64_t segment = 1 << 20;
  bool bos_aligned = false;
  int num_threads = 1;
};

// The plan for documents with `lengths` (in the order they should be consumed).
PackingPlan plan_packing(UnalignedSpan<int32_t> lengths, const PackingOptions& options);

struct PackedRowOptions {
  int64_t row_length = 0;
  int64_t max_pieces_per_row = 64;
  int64_t bos = 0;
  int64_t pad = 0;
  int64_t ignore = -100;
  bool reset_positions = true;
};

// Rows of a plan as training tensors, [rows.size(), row_length] each (cu_seqlens:
// [rows.size(), max_pieces_per_row + 1]); see python/tokenmill/datasets/packed.py for the
// meaning of every output. `pointers` are byte offsets of the documents in `tokens` (the whole
// .bin). `entries` ([E, 5]) and `row_offsets` ([R + 1]) come from a cached plan and the
// pointers and lengths from an .idx, so any value is possible and any alignment: every one is
// checked (overflow-free) and a bad one throws std::out_of_range naming the field, as does a
// row outside the plan.
template <typename TokenT>
void gather_packed_rows(UnalignedSpan<int64_t> entries, UnalignedSpan<int64_t> row_offsets,
                        std::span<const int64_t> rows, UnalignedSpan<int64_t> pointers,
                        UnalignedSpan<int32_t> lengths, std::span<const TokenT> tokens,
                        const PackedRowOptions& options, std::span<int64_t> input_ids,
                        std::span<int64_t> labels, std::span<int64_t> position_ids,
                        std::span<int32_t> doc_ids, std::span<int32_t> cu_seqlens);

}  // namespace tokenmill
