// Shared helpers for the tokenmill kernels: integer-exact arithmetic and span aliases.
// Kernels never see Python; argument checks that need an error message live in csrc/bindings/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>

namespace tokenmill {

// A read-only array of T that may start at any byte address. Megatron's .idx puts its int32
// sequence lengths at byte 34 and its int64 pointers at byte 34 + 4 * count, so in a mapped
// .idx they are never naturally aligned; a std::span<const T> over them would be undefined
// behaviour (UBSan reports it, and a vectorising compiler may emit aligned loads). Elements are
// loaded with memcpy, which is a single plain load on x86-64 and aarch64.
template <typename T>
class UnalignedSpan {
 public:
  UnalignedSpan() = default;
  UnalignedSpan(const void* data, size_t size)
      : data_(static_cast<const unsigned char*>(data)), size_(size) {}
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T operator[](size_t i) const {
    T value;
    std::memcpy(&value, data_ + i * sizeof(T), sizeof(T));
    return value;
  }
  // For __builtin_prefetch.
  const void* address(size_t i) const { return data_ + i * sizeof(T); }
  UnalignedSpan subspan(size_t offset, size_t count) const {
    return {data_ + offset * sizeof(T), count};
  }

 private:
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

// Integer ceil-div for non-negative operands (never routed through float).
constexpr int64_t ceil_div(int64_t numerator, int64_t denominator) {
  return (numerator + denominator - 1) / denominator;
}

// Multiplication that refuses to wrap around instead of silently overflowing.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t result = 0;
  if (__builtin_mul_overflow(a, b, &result)) {
    throw std::overflow_error(std::string(what) + " overflows int64");
  }
  return result;
}

// a + b and a - b into `result`; false (result unspecified) when the exact value does not fit
// int64. For values read from files (index caches, .idx), where wrapping would be undefined
// behaviour and could turn a corrupt entry into an in-bounds-looking one.
inline bool add_fits(int64_t a, int64_t b, int64_t& result) {
  return !__builtin_add_overflow(a, b, &result);
}
inline bool sub_fits(int64_t a, int64_t b, int64_t& result) {
  return !__builtin_sub_overflow(a, b, &result);
}

// Number of worker threads to use for `items` units of work, at most `requested`.
inline int threads_for(int requested, int64_t items, int64_t min_items_per_thread) {
  if (requested < 1) requested = 1;
  const int64_t useful = items / (min_items_per_thread > 0 ? min_items_per_thread : 1);
  if (useful < requested) requested = static_cast<int>(useful < 1 ? 1 : useful);
  return requested;
}

}  // namespace tokenmill
