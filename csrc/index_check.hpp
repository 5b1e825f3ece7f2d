// The structural check of a Megatron .idx (tokenmill.formats.validate.check_megatron_index):
// one pass over the sequence lengths, pointers and document boundaries, stopping at the first
// violated invariant. Plain C++ over spans; the Python side turns the verdict into a message
// naming the file, field, index and value.
#pragma once

#include <cstdint>

#include "common.hpp"

namespace tokenmill {

// What the first violation is (kNone: the index is consistent).
enum class IndexViolation : int {
  kNone = 0,
  kPointerCountMismatch = 1,  // pointers and lengths differ in size
  kNegativeLength = 2,        // lengths[index] < 0
  kPointerMismatch = 3,       // pointers[index] != expected (the running sum of length x size)
  kOffsetOverflow = 4,        // the running byte offset passes INT64_MAX at sequence index
  kNoBoundaries = 5,          // document boundaries empty
  kFirstBoundary = 6,         // boundaries[0] != 0
  kLastBoundary = 7,          // boundaries[last] != sequence count
  kDecreasingBoundary = 8,    // boundaries[index] > boundaries[index + 1]
};

struct IndexVerdict {
  IndexViolation violation = IndexViolation::kNone;
  int64_t index = 0;     // where (sequence or boundary position)
  int64_t expected = 0;  // kPointerMismatch: the pointer expected there
  int64_t end = 0;       // kNone: the byte offset where the last sequence ends (the .bin size)
};

// The first violation, in this order: the array sizes, any negative length (the first), the
// pointers sequence by sequence, then the boundaries (tests/reference.py has the slow
// reference). Allocates nothing. `itemsize` is the token size in bytes (1..8).
IndexVerdict check_megatron_index(UnalignedSpan<int32_t> lengths, UnalignedSpan<int64_t> pointers,
                                  UnalignedSpan<int64_t> boundaries, int64_t itemsize);

}  // namespace tokenmill
