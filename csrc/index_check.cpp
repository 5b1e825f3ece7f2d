#include "index_check.hpp"

namespace tokenmill {

IndexVerdict check_megatron_index(UnalignedSpan<int32_t> lengths, UnalignedSpan<int64_t> pointers,
                                  UnalignedSpan<int64_t> boundaries, int64_t itemsize) {
  IndexVerdict verdict;
  const size_t count = lengths.size();
  if (pointers.size() != count) {
    verdict.violation = IndexViolation::kPointerCountMismatch;
    return verdict;
  }
  for (size_t i = 0; i < count; ++i) {
    if (lengths[i] < 0) {
      verdict = {IndexViolation::kNegativeLength, static_cast<int64_t>(i), 0, 0};
      return verdict;
    }
  }
  int64_t next = 0;  // byte offset where the next sequence must start
  for (size_t i = 0; i < count; ++i) {
    const int64_t length = lengths[i];
    if (pointers[i] != next) {
      verdict = {IndexViolation::kPointerMismatch, static_cast<int64_t>(i), next, 0};
      return verdict;
    }
    // length < 2^31 and itemsize <= 8: the product fits; the sum may not (a corrupt count)
    if (__builtin_add_overflow(next, length * itemsize, &next)) {
      verdict = {IndexViolation::kOffsetOverflow, static_cast<int64_t>(i), 0, 0};
      return verdict;
    }
  }
  verdict.end = next;
  const size_t total = boundaries.size();
  if (total == 0) {
    verdict.violation = IndexViolation::kNoBoundaries;
    return verdict;
  }
  if (boundaries[0] != 0) {
    verdict.violation = IndexViolation::kFirstBoundary;
    return verdict;
  }
  if (boundaries[total - 1] != static_cast<int64_t>(count)) {
    verdict.violation = IndexViolation::kLastBoundary;
    verdict.index = static_cast<int64_t>(total - 1);
    return verdict;
  }
  int64_t previous = boundaries[0];
  for (size_t i = 1; i < total; ++i) {
    const int64_t current = boundaries[i];
    if (current < previous) {
      verdict.violation = IndexViolation::kDecreasingBoundary;
      verdict.index = static_cast<int64_t>(i - 1);
      return verdict;
    }
    previous = current;
  }
  return verdict;
}

}  // namespace tokenmill
