// Blending indices for BlendedDataset, bit-identical to megatron-core 0.19.
//
// Greedy: for sample i (t = max(i, 1) as a double), every dataset d has the error
// weights[d] * t - count[d]; the first dataset with the strictly largest error is chosen, its
// current count is the sample's index inside that dataset, and the count is incremented.
// Exhaustive: weights are sizes[d] / sum(sizes) and only datasets that still have samples left
// take part; it stops when every dataset is spent (output length = sum(sizes)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace tokenmill {

// Which kernel computes the blend, and its tuning. Production callers use the defaults; tests
// force a path (and a tiny margin, to force fallbacks) to exercise every branch. Every path gives
// the same output.
struct BlendingOptions {
  // kActive: the best instruction set the CPU has (AVX-512, else AVX2, else SSE2);
  // kActiveAvx2 / kActiveBaseline cap it at AVX2 / SSE2. kScanSimd: the register scan (AVX-512,
  // greedy, at most 64 datasets; otherwise the plain scan).
  enum class Path { kAuto, kScan, kScanSimd, kActive, kActiveAvx2, kActiveBaseline, kTree };
  Path path = Path::kAuto;
  size_t window = 0;    // active set: samples between threshold updates (0: default)
  double margin = -1;   // active set: initial margin below the winning keys (< 0: default)
  size_t block = 0;     // active set, AVX-512: samples per block (0: default; rounded to 2^k)
  // Chunks of the samples, each decided from guessed counts and repaired afterwards, run on up to
  // as many threads of the pool (0: the CPUs this process may use, at most 8, with at least 2^18
  // samples per chunk; 1: one chunk on the caller's thread).
  size_t threads = 0;
  bool guess_zero = false;  // test hook: start every chunk from zero counts (forces repairs)
};

// The instruction set the active-set kernel runs on for `path` on this CPU: "avx512", "avx2" or
// "baseline" (SSE2 on x86-64, scalar elsewhere).
const char* active_set_isa(BlendingOptions::Path path = BlendingOptions::Path::kAuto);

template <typename IndexT>
void build_blending_indices(std::span<const double> weights, std::span<IndexT> dataset_index,
                            std::span<int64_t> dataset_sample_index,
                            const BlendingOptions& options = {});

template <typename IndexT>
void build_exhaustive_blending_indices(std::span<const int64_t> sizes,
                                       std::span<IndexT> dataset_index,
                                       std::span<int64_t> dataset_sample_index,
                                       const BlendingOptions& options = {});

}  // namespace tokenmill
