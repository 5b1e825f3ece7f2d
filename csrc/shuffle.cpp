#include "shuffle.hpp"

#include <algorithm>
#include <array>
#include <utility>

namespace tokenmill {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void Mt19937::twist(uint32_t* state) {
  constexpr uint32_t kUpper = 0x80000000u;
  constexpr uint32_t kLower = 0x7fffffffu;
  constexpr uint32_t kMatrix = 0x9908b0dfu;
  constexpr int n = kStateSize;
  constexpr int m = kShift;
  for (int i = 0; i < n - m; ++i) {
    const uint32_t y = (state[i] & kUpper) | (state[i + 1] & kLower);
    state[i] = state[i + m] ^ (y >> 1) ^ ((0u - (y & 1u)) & kMatrix);
  }
  for (int i = n - m; i < n - 1; ++i) {
    const uint32_t y = (state[i] & kUpper) | (state[i + 1] & kLower);
    state[i] = state[i + m - n] ^ (y >> 1) ^ ((0u - (y & 1u)) & kMatrix);
  }
  const uint32_t y = (state[n - 1] & kUpper) | (state[0] & kLower);
  state[n - 1] = state[m - 1] ^ (y >> 1) ^ ((0u - (y & 1u)) & kMatrix);
}

size_t NumpyRandomState::intervals_descending(uint32_t top, uint32_t* targets,
                                              size_t capacity) {
  const size_t limit = std::min(capacity, static_cast<size_t>(top));
  size_t k = 0;
  uint32_t step = top;
  while (k < limit) {
    if (head_ == tail_) refill();
    // The mask is constant while `step` stays in [2^b, 2^(b+1)); within that stretch the loop
    // carries only `step`, so a word costs a compare and an add.
    const uint32_t mask = static_cast<uint32_t>(mask_for(step));
    const uint32_t floor = (mask >> 1) + 1;
    size_t word = head_;
    while (word < tail_ && k < limit && step >= floor) {
      const uint32_t value = buffer_[word++] & mask;
      targets[k] = value;
      const uint32_t accept = value <= step ? 1u : 0u;
      k += accept;
      step -= accept;
    }
    head_ = word;
  }
  return k;
}

template <typename T>
void shuffle_like_numpy(std::span<T> values, NumpyRandomState& random) {
  const uint64_t size = values.size();
  if (size < 2) return;
  // Targets are drawn one block ahead so the swaps can prefetch their cache lines; the order of
  // draws and swaps is unchanged, so the permutation is exactly numpy's.
  constexpr uint64_t kBlock = 4096;
  constexpr uint64_t kPrefetchDistance = 32;
  std::array<uint64_t, kBlock> targets{};
  std::array<uint32_t, kBlock> narrow{};
  T* data = values.data();
  uint64_t i = size - 1;
  while (i >= 1) {
    uint64_t count = 0;
    if (i <= 0xffffffffULL) {
      count = random.intervals_descending(static_cast<uint32_t>(i), narrow.data(),
                                          std::min<uint64_t>(kBlock, i));
      for (uint64_t k = 0; k < count; ++k) targets[k] = narrow[k];
    } else {  // arrays beyond 2^32 elements: numpy's 64-bit draws
      count = std::min<uint64_t>(kBlock, i);
      for (uint64_t k = 0; k < count; ++k) targets[k] = random.interval(i - k);
    }
    const uint64_t warm = std::min<uint64_t>(kPrefetchDistance, count);
    for (uint64_t k = 0; k < warm; ++k) __builtin_prefetch(data + targets[k], 1, 0);
    for (uint64_t k = 0; k < count; ++k) {
      if (k + kPrefetchDistance < count) {
        __builtin_prefetch(data + targets[k + kPrefetchDistance], 1, 0);
      }
      std::swap(data[i - k], data[targets[k]]);
    }
    i -= count;
  }
}

template void shuffle_like_numpy<int32_t>(std::span<int32_t>, NumpyRandomState&);
template void shuffle_like_numpy<uint32_t>(std::span<uint32_t>, NumpyRandomState&);
template void shuffle_like_numpy<int64_t>(std::span<int64_t>, NumpyRandomState&);

}  // namespace tokenmill
