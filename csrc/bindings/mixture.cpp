// Bindings of the mixture kernels: Philox4x64-10 (counter-based, numpy-exact) and the source of
// each chunk of a mixture's token stream.
#include <array>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "../philox.hpp"
#include "arrays.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

// A sequence of `size` Python ints, each in [0, 2^64).
template <size_t size>
std::array<uint64_t, size> words(const py::sequence& values, const char* what) {
  if (values.size() != size) {
    throw std::invalid_argument(std::string(what) + " must have " + std::to_string(size) +
                                " words, got " + std::to_string(values.size()));
  }
  std::array<uint64_t, size> result{};
  for (size_t i = 0; i < size; ++i) {
    const py::object value = values[i];
    if (!PyLong_Check(value.ptr())) {
      throw py::type_error(std::string(what) + " word " + std::to_string(i) +
                           " must be an int, got " + std::string(py::str(py::type::of(value))));
    }
    const unsigned long long word = PyLong_AsUnsignedLongLong(value.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      throw std::invalid_argument(std::string(what) + " word " + std::to_string(i) +
                                  " must be in [0, 2^64), got " + std::string(py::str(value)));
    }
    result[i] = static_cast<uint64_t>(word);
  }
  return result;
}

py::tuple philox_block(const py::sequence& counter, const py::sequence& key) {
  const auto block = tokenmill::philox4x64_10(words<4>(counter, "counter"), words<2>(key, "key"));
  return py::make_tuple(block[0], block[1], block[2], block[3]);
}

void draw_chunk_sources(const py::array_t<uint64_t, py::array::c_style>& thresholds,
                        const py::sequence& key, uint64_t stream, uint64_t draw,
                        uint64_t first_chunk, py::array_t<int32_t, py::array::c_style>& out) {
  if (thresholds.ndim() != 1 || thresholds.shape(0) < 1) {
    throw std::invalid_argument("thresholds must be a non-empty 1-D uint64 array");
  }
  if (out.ndim() != 1) throw std::invalid_argument("out must be a 1-D int32 array");
  if (!out.writeable()) throw std::invalid_argument("out must be writeable");
  const std::span<const uint64_t> limits(thresholds.data(),
                                         static_cast<size_t>(thresholds.shape(0)));
  for (size_t i = 1; i < limits.size(); ++i) {
    if (limits[i] < limits[i - 1]) {
      throw std::invalid_argument("thresholds must be non-decreasing, got " +
                                  std::to_string(limits[i]) + " after " +
                                  std::to_string(limits[i - 1]));
    }
  }
  if (limits.back() != (uint64_t{1} << 53)) {
    throw std::invalid_argument("the last threshold must be 2^53, got " +
                                std::to_string(limits.back()));
  }
  const std::span<int32_t> chunks(out.mutable_data(), static_cast<size_t>(out.shape(0)));
  const tokenmill::PhiloxKey philox_key = words<2>(key, "key");
  ReleasedGil release;  // pure arithmetic over buffers the caller keeps alive
  tokenmill::draw_chunk_sources(limits, philox_key, stream, draw, first_chunk, chunks);
}

}  // namespace

void register_mixture(py::module_& m, py::module_& testing) {
  m.def("draw_chunk_sources", &draw_chunk_sources, "thresholds"_a.noconvert(), "key"_a,
        "stream"_a, "draw"_a, "first_chunk"_a, "out"_a.noconvert(),
        "out[i] = first s with (Philox(first_chunk + i, stream, draw, 0)[0] >> 11) < "
        "thresholds[s].");
  testing.def("philox_block", &philox_block, "counter"_a, "key"_a,
              "The Philox4x64-10 block (4 uint64 words) of a 4-word counter under a 2-word key, "
              "bit-identical to numpy.random.Philox.");
}

}  // namespace tokenmill::bindings
