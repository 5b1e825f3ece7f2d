// Philox4x64-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
// counter-based generator. Output block i is a pure function of (key, counter i), so any
// position of a random stream is computable without replaying the positions before it. This is
// what lets a mixture say which source feeds chunk k of the token stream in O(1) at a resume.
//
// The block function is bit-identical to numpy.random.Philox's (tests/test_mixture_kernels.py
// checks it against numpy and against the pure-Python reference in tests/reference.py).
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace tokenmill {

using PhiloxBlock = std::array<uint64_t, 4>;
using PhiloxKey = std::array<uint64_t, 2>;

// The 10-round Philox4x64 block of `counter` under `key`.
PhiloxBlock philox4x64_10(PhiloxBlock counter, PhiloxKey key);

// The source of each chunk of a mixture segment: out[i] = the first s with
// u53(first_chunk + i) < thresholds[s], where u53 is the top 53 bits of word 0 of the Philox
// block of counter (first_chunk + i, stream, draw, 0) under key, and thresholds are the
// cumulative weights scaled to [0, 2^53] (non-decreasing, the last one exactly 2^53).
// Integer thresholds keep the choice exact: no floating point in the comparison.
void draw_chunk_sources(std::span<const uint64_t> thresholds, PhiloxKey key, uint64_t stream,
                        uint64_t draw, uint64_t first_chunk, std::span<int32_t> out);

}  // namespace tokenmill
