#include "token_scan.hpp"

#include <algorithm>

#include "common.hpp"
#include "thread_pool.hpp"

namespace tokenmill {
namespace {

// Below this many tokens per thread, starting a thread costs more than it saves.
constexpr int64_t kMinTokensPerThread = int64_t{1} << 20;

template <typename T>
void scan_chunk(std::span<const T> tokens, T token, int64_t begin, int64_t end,
                std::vector<int64_t>& out) {
  const T* data = tokens.data();
  for (int64_t i = begin; i < end; ++i) {
    if (data[i] == token) out.push_back(i);
  }
}

template <typename T>
int64_t count_chunk(std::span<const T> tokens, T token, int64_t begin, int64_t end) {
  const T* data = tokens.data();
  int64_t count = 0;
  for (int64_t i = begin; i < end; ++i) count += data[i] == token ? 1 : 0;  // branch-free
  return count;
}

// Runs body(chunk, begin, end) over `chunks` contiguous chunks of [0, size), on the thread pool.
template <typename Body>
void for_each_chunk(int64_t size, int chunks, Body body) {
  const int64_t step = ceil_div(size, chunks);
  parallel_for(static_cast<size_t>(chunks), chunks, [&](size_t chunk) {
    const int64_t begin = std::min(size, step * static_cast<int64_t>(chunk));
    body(static_cast<int>(chunk), begin, std::min(size, begin + step));
  });
}

}  // namespace

template <typename T>
std::vector<int64_t> find_token_positions(std::span<const T> tokens, T token, int num_threads) {
  const auto size = static_cast<int64_t>(tokens.size());
  const int threads = threads_for(num_threads, size, kMinTokensPerThread);
  std::vector<std::vector<int64_t>> parts(static_cast<size_t>(threads));
  for_each_chunk(size, threads, [&](int t, int64_t begin, int64_t end) {
    scan_chunk(tokens, token, begin, end, parts[static_cast<size_t>(t)]);
  });
  if (threads == 1) return std::move(parts[0]);
  size_t total = 0;
  for (const auto& part : parts) total += part.size();
  std::vector<int64_t> positions;
  positions.reserve(total);
  for (const auto& part : parts) positions.insert(positions.end(), part.begin(), part.end());
  return positions;
}

template <typename T>
int64_t count_token(std::span<const T> tokens, T token, int num_threads) {
  const auto size = static_cast<int64_t>(tokens.size());
  const int threads = threads_for(num_threads, size, kMinTokensPerThread);
  std::vector<int64_t> counts(static_cast<size_t>(threads), 0);
  for_each_chunk(size, threads, [&](int t, int64_t begin, int64_t end) {
    counts[static_cast<size_t>(t)] = count_chunk(tokens, token, begin, end);
  });
  int64_t total = 0;
  for (const int64_t count : counts) total += count;
  return total;
}

#define TOKENMILL_INSTANTIATE_SCAN(T)                                                         \
  template std::vector<int64_t> find_token_positions<T>(std::span<const T>, T, int);         \
  template int64_t count_token<T>(std::span<const T>, T, int);

TOKENMILL_INSTANTIATE_SCAN(uint8_t)
TOKENMILL_INSTANTIATE_SCAN(int8_t)
TOKENMILL_INSTANTIATE_SCAN(uint16_t)
TOKENMILL_INSTANTIATE_SCAN(int16_t)
TOKENMILL_INSTANTIATE_SCAN(uint32_t)
TOKENMILL_INSTANTIATE_SCAN(int32_t)
TOKENMILL_INSTANTIATE_SCAN(uint64_t)
TOKENMILL_INSTANTIATE_SCAN(int64_t)

#undef TOKENMILL_INSTANTIATE_SCAN

}  // namespace tokenmill
