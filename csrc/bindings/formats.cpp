// Bindings of the token scan (find_token_positions, count_token): the BOS/EOS scans the shard
// formats use to find document boundaries; and of the .idx structural check.
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "../index_check.hpp"
#include "../token_scan.hpp"
#include "arrays.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

// The token id as T, or nothing when T cannot hold it (then no element can equal it, which is
// what numpy's `tokens == token` gives for an out-of-range Python int).
template <typename T>
std::optional<T> token_as(const py::int_& token) {
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(token.ptr(), &overflow);
  if (overflow == 0 && value == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow < 0) return std::nullopt;
  if (overflow > 0) {
    const unsigned long long big = PyLong_AsUnsignedLongLong(token.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return std::nullopt;
    }
    if (!std::in_range<T>(big)) return std::nullopt;
    return static_cast<T>(big);
  }
  if (!std::in_range<T>(value)) return std::nullopt;
  return static_cast<T>(value);
}

py::array_t<int64_t> find_token_positions(const py::array& tokens, const py::int_& token,
                                          int num_threads) {
  return dispatch_tokens(tokens, [&](auto span) {
    using T = std::remove_const_t<typename decltype(span)::element_type>;
    const auto value = token_as<T>(token);
    std::vector<int64_t> positions;
    if (value) {
      ReleasedGil release;  // read-only scan of a buffer the caller keeps alive
      positions = tokenmill::find_token_positions(span, *value, num_threads);
    }
    const auto size = static_cast<py::ssize_t>(positions.size());
    return vector_to_array(std::move(positions), {size});
  });
}

int64_t count_token(const py::array& tokens, const py::int_& token, int num_threads) {
  return dispatch_tokens(tokens, [&](auto span) -> int64_t {
    using T = std::remove_const_t<typename decltype(span)::element_type>;
    const auto value = token_as<T>(token);
    if (!value) return 0;
    ReleasedGil release;  // read-only scan of a buffer the caller keeps alive
    return tokenmill::count_token(span, *value, num_threads);
  });
}

// (violation code, index, expected pointer, end byte offset): see index_check.hpp.
py::tuple check_megatron_index_arrays(const py::array& lengths, const py::array& pointers,
                                      const py::array& boundaries, int64_t itemsize) {
  if (itemsize < 1 || itemsize > 8) {
    fail_value("itemsize must be 1..8 bytes, got " + std::to_string(itemsize));
  }
  const auto length_span = input_unaligned<int32_t>(lengths, "sequence_lengths");
  const auto pointer_span = input_unaligned<int64_t>(pointers, "sequence_pointers");
  const auto boundary_span = input_unaligned<int64_t>(boundaries, "document_indices");
  IndexVerdict verdict;
  {
    ReleasedGil release;  // read-only pass over buffers the caller keeps alive
    verdict = check_megatron_index(length_span, pointer_span, boundary_span, itemsize);
  }
  return py::make_tuple(static_cast<int>(verdict.violation), verdict.index, verdict.expected,
                        verdict.end);
}

}  // namespace

void register_formats(py::module_& m) {
  m.def("check_megatron_index_arrays", &check_megatron_index_arrays,
        "sequence_lengths"_a.noconvert(), "sequence_pointers"_a.noconvert(),
        "document_indices"_a.noconvert(), "itemsize"_a,
        "The first structural violation of a .idx's arrays: (code, index, expected pointer, end "
        "byte offset); code 0 means consistent (tokenmill.formats.validate).");
  m.def("find_token_positions", &find_token_positions, "tokens"_a.noconvert(), "token"_a,
        "num_threads"_a = 1,
        "Positions (int64, ascending) where tokens == token: numpy.flatnonzero(tokens == token).");
  m.def("count_token", &count_token, "tokens"_a.noconvert(), "token"_a, "num_threads"_a = 1,
        "Number of positions where tokens == token.");
}

}  // namespace tokenmill::bindings
