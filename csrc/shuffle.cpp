#include "shuffle.hpp"

#include <algorithm>
#include <array>
#include <utility>

namespace tokenmill {

template <typename T>
void shuffle_like_numpy(std::span<T> values, NumpyRandomState& random) {
  const uint64_t size = values.size();
  if (size < 2) return;
  // Targets are drawn one block ahead so the swaps can prefetch their cache lines; the order of
  // draws and swaps is unchanged, so the permutation is exactly numpy's.
  constexpr uint64_t kBlock = 2048;
  constexpr uint64_t kPrefetchDistance = 24;
  std::array<uint64_t, kBlock> targets{};
  T* data = values.data();
  uint64_t i = size - 1;
  while (i >= 1) {
    const uint64_t count = std::min<uint64_t>(kBlock, i);
    for (uint64_t k = 0; k < count; ++k) targets[k] = random.interval(i - k);
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
