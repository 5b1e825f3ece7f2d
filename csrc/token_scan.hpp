// Token scan: the positions of one token id in a token array (BOS/EOS scans, document
// boundaries). Plain C++ over spans; bindings.cpp does the argument checks and dtype dispatch.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tokenmill {

// Positions i (ascending) with tokens[i] == token, exactly numpy.flatnonzero(tokens == token).
//
// The array is cut into `num_threads` contiguous chunks; each thread collects its chunk's
// positions into its own vector and the vectors are concatenated in chunk order, so the output
// does not depend on the thread count. Cost: one sequential read of the array (memory bound)
// plus 8 bytes per match.
template <typename T>
std::vector<int64_t> find_token_positions(std::span<const T> tokens, T token, int num_threads);

// Number of i with tokens[i] == token (the same scan without the output).
template <typename T>
int64_t count_token(std::span<const T> tokens, T token, int num_threads);

}  // namespace tokenmill
