#include "shuffle.hpp"

#include "cpu_features.hpp"
#include "mt19937_twist.hpp"

#include <algorithm>
#include <array>
#include <utility>

namespace tokenmill {

namespace {

using Twist = void (*)(uint32_t*);

struct TwistUnit {
  Twist twist;
  const char* isa;
};

// The best unit the CPU has, capped by TOKENMILL_SIMD (cpu_features() applies the pin).
TwistUnit choose_twist() {
#ifdef TOKENMILL_X86_UNITS
  if (cpu_features().avx512) return {mt19937::twist_avx512, "avx512"};
  if (cpu_features().avx2) return {mt19937::twist_avx2, "avx2"};
#endif
  return {[](uint32_t* state) { mt19937::twist_state(state); }, "baseline"};
}

const TwistUnit& twist_unit() {
  static const TwistUnit unit = choose_twist();
  return unit;
}

}  // namespace

static_assert(Mt19937::kStateSize == mt19937::kStateSize && Mt19937::kShift == mt19937::kShift);

void Mt19937::twist(uint32_t* state) {
  static const Twist best = twist_unit().twist;
  best(state);
}

const char* Mt19937::twist_isa() { return twist_unit().isa; }

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
