// What every bindings file shares: numpy arrays checked into spans (strict dtype, C order,
// alignment, writeability), integer-dtype dispatch, results handed to numpy without a copy, and
// the argument checks the GPT index build and the gather both need. Errors name the argument and
// the value: TypeError for a wrong dtype or layout, ValueError for a wrong value or shape.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../common.hpp"

namespace tokenmill::bindings {

namespace py = pybind11;

[[noreturn]] inline void fail_value(const std::string& message) { throw py::value_error(message); }

inline std::string dtype_name(const py::array& array) {
  return py::str(array.dtype()).cast<std::string>();
}

template <typename T>
bool has_dtype(const py::array& array) {
  // Identity for numpy's builtin descriptors; equality for copies (e.g. unpickled arrays).
  const auto expected = py::dtype::of<T>();
  const auto actual = array.dtype();
  return actual.is(expected) || actual.equal(expected);
}

// TypeError naming the argument unless `array` is C-contiguous with dtype T.
template <typename T>
void check_input(const py::array& array, const char* name) {
  if (!has_dtype<T>(array)) {
    throw py::type_error(std::string(name) + " must have dtype " +
                         py::str(py::dtype::of<T>()).cast<std::string>() + ", got " +
                         dtype_name(array));
  }
  if (!(array.flags() & py::array::c_style)) {
    throw py::type_error(std::string(name) + " must be C-contiguous");
  }
}

// A C-contiguous, aligned view of `array` as T; TypeError or ValueError naming the argument.
// (A std::span over misaligned memory would be undefined behaviour: numpy allows such arrays,
// e.g. np.frombuffer at an odd offset.)
template <typename T>
std::span<const T> input_span(const py::array& array, const char* name) {
  check_input<T>(array, name);
  if (array.size() > 0 && reinterpret_cast<uintptr_t>(array.data()) % alignof(T) != 0) {
    throw py::value_error(std::string(name) + " must be aligned to " +
                          std::to_string(alignof(T)) + " bytes (a numpy view at an odd offset?)");
  }
  return {static_cast<const T*>(array.data()), static_cast<size_t>(array.size())};
}

// Like input_span, for arrays read in place from files (a Megatron .idx, a cached plan), which
// may sit at any byte offset: elements are loaded with memcpy (common.hpp).
template <typename T>
UnalignedSpan<T> input_unaligned(const py::array& array, const char* name) {
  check_input<T>(array, name);
  return {array.data(), static_cast<size_t>(array.size())};
}

template <typename T>
std::span<T> output_span(py::array& array, const char* name) {
  auto view = input_span<T>(array, name);
  if (!array.writeable()) throw py::value_error(std::string(name) + " must be writeable");
  return {const_cast<T*>(view.data()), view.size()};
}

// One visit per integer token dtype: the shards tokenmill reads store (u)int8/16/32/64.
template <typename Visit>
auto dispatch_tokens(const py::array& tokens, Visit visit) {
  if (tokens.ndim() != 1) fail_value("tokens must be 1-D, got ndim " + std::to_string(tokens.ndim()));
  if (has_dtype<uint16_t>(tokens)) return visit(input_span<uint16_t>(tokens, "tokens"));
  if (has_dtype<uint32_t>(tokens)) return visit(input_span<uint32_t>(tokens, "tokens"));
  if (has_dtype<int32_t>(tokens)) return visit(input_span<int32_t>(tokens, "tokens"));
  if (has_dtype<int64_t>(tokens)) return visit(input_span<int64_t>(tokens, "tokens"));
  if (has_dtype<uint8_t>(tokens)) return visit(input_span<uint8_t>(tokens, "tokens"));
  if (has_dtype<int8_t>(tokens)) return visit(input_span<int8_t>(tokens, "tokens"));
  if (has_dtype<int16_t>(tokens)) return visit(input_span<int16_t>(tokens, "tokens"));
  if (has_dtype<uint64_t>(tokens)) return visit(input_span<uint64_t>(tokens, "tokens"));
  throw py::type_error("tokens must have an integer dtype (u)int8/16/32/64, got " +
                       dtype_name(tokens));
}

// A vector's buffer handed to numpy without a copy; the capsule frees it with the array.
template <typename T>
py::array_t<T> vector_to_array(std::vector<T>&& values, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  py::capsule owner(owned, [](void* pointer) { delete static_cast<std::vector<T>*>(pointer); });
  return py::array_t<T>(shape, owned->data(), owner);
}

// ---- Checks the GPT index build and the gather share ---------------------------------------

inline void check_sequence(int64_t sequence_length, int64_t extra_token) {
  if (sequence_length < 1) {
    fail_value("sequence_length must be >= 1, got " + std::to_string(sequence_length));
  }
  if (extra_token != 0 && extra_token != 1) {
    fail_value("add_extra_token_to_sequence must be 0 or 1, got " + std::to_string(extra_token));
  }
}

inline void check_sample_index_shape(const py::array& sample_index) {
  if (sample_index.ndim() != 2 || sample_index.shape(1) != 2 || sample_index.shape(0) < 1) {
    fail_value("sample_index must have shape [num_samples + 1, 2]");
  }
}

}  // namespace tokenmill::bindings
