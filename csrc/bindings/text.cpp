// Bindings of the text packers (the tokenize pipeline's fast path): JSON Lines fields, text
// lines and string arrays packed into one 0xFF-separated buffer, and the scan for code points
// a tokenizer backend treats differently (Unicode 17).
#include <string>
#include <utility>
#include <vector>

#include "../text_pack.hpp"
#include "arrays.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

// A read-only byte view of a bytes object or any 1-byte, C-contiguous buffer (numpy uint8).
std::span<const uint8_t> byte_span(const py::buffer_info& info, const char* name) {
  if (info.itemsize != 1 || info.ndim > 1 ||
      (info.ndim == 1 && info.strides[0] != 1 && info.shape[0] > 1)) {
    throw py::type_error(std::string(name) + " must be bytes or a contiguous 1-byte buffer");
  }
  return {static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size)};
}

// Runs `pack` into a bytes object of `capacity` bytes (the GIL released: the object is not
// shared yet) and shrinks it to what was written. Returns (packed, lengths int64, failed).
template <typename Pack>
py::tuple run_pack(size_t capacity, Pack&& pack) {
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<py::ssize_t>(capacity));
  if (raw == nullptr) throw py::error_already_set();
  py::object guard = py::reinterpret_steal<py::object>(raw);  // released on any exception
  std::vector<int64_t> lengths;
  tokenmill::PackResult result;
  {
    ReleasedGil release;
    std::span<uint8_t> out(reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(raw)), capacity);
    result = pack(out, lengths);
  }
  guard.release();
  if (_PyBytes_Resize(&raw, static_cast<py::ssize_t>(result.written)) != 0) {
    throw py::error_already_set();  // _PyBytes_Resize freed the object
  }
  py::bytes packed = py::reinterpret_steal<py::bytes>(raw);
  const auto size = static_cast<py::ssize_t>(lengths.size());
  return py::make_tuple(packed, vector_to_array(std::move(lengths), {size}), result.failed);
}

py::tuple pack_jsonl_field(const py::buffer& data, const std::string& key) {
  const py::buffer_info info = data.request();
  const auto input = byte_span(info, "data");
  return run_pack(input.size(), [&](std::span<uint8_t> out, std::vector<int64_t>& lengths) {
    return tokenmill::pack_jsonl_field(input, key, out, lengths);
  });
}

py::tuple pack_lines(const py::buffer& data) {
  const py::buffer_info info = data.request();
  const auto input = byte_span(info, "data");
  return run_pack(input.size() + 1, [&](std::span<uint8_t> out, std::vector<int64_t>& lengths) {
    return tokenmill::pack_lines(input, out, lengths);
  });
}

py::tuple pack_documents(const py::buffer& data, const py::array& offsets) {
  const py::buffer_info info = data.request();
  const auto input = byte_span(info, "data");
  const auto bounds = input_span<int64_t>(offsets, "offsets");
  if (!bounds.empty()) {
    if (bounds.front() < 0 || bounds.back() > static_cast<int64_t>(input.size())) {
      fail_value("offsets must lie in [0, " + std::to_string(input.size()) + "], got [" +
                 std::to_string(bounds.front()) + ", " + std::to_string(bounds.back()) + "]");
    }
    for (size_t i = 1; i < bounds.size(); ++i) {
      if (bounds[i] < bounds[i - 1]) {
        fail_value("offsets must be non-decreasing, got " + std::to_string(bounds[i - 1]) +
                   " then " + std::to_string(bounds[i]) + " at " + std::to_string(i));
      }
    }
  }
  const size_t documents = bounds.empty() ? 0 : bounds.size() - 1;
  return run_pack(input.size() + documents,
                  [&](std::span<uint8_t> out, std::vector<int64_t>& lengths) {
                    return tokenmill::pack_documents(input, bounds, out, lengths);
                  });
}

py::array_t<int64_t> find_code_points(const py::buffer& packed, const py::array& ranges) {
  const py::buffer_info info = packed.request();
  const auto input = byte_span(info, "packed");
  const auto bounds = input_span<uint32_t>(ranges, "ranges");
  if (bounds.size() % 2 != 0) fail_value("ranges must hold (first, last) pairs");
  for (size_t i = 0; i < bounds.size(); i += 2) {
    if (bounds[i] < 0x800 || bounds[i] > bounds[i + 1] || (i > 0 && bounds[i] <= bounds[i - 1])) {
      fail_value("ranges must be sorted, disjoint and >= U+0800; pair " + std::to_string(i / 2) +
                 " is [" + std::to_string(bounds[i]) + ", " + std::to_string(bounds[i + 1]) + "]");
    }
  }
  std::vector<int64_t> positions;
  {
    ReleasedGil release;  // read-only scan of buffers the caller keeps alive
    positions = tokenmill::find_code_points(input, bounds);
  }
  const auto size = static_cast<py::ssize_t>(positions.size());
  return vector_to_array(std::move(positions), {size});
}

}  // namespace

void register_text(py::module_& m) {
  m.def("pack_jsonl_field", &pack_jsonl_field, "data"_a, "key"_a,
        "JSON Lines to packed documents: (packed bytes, lengths int64, failed line or -1).");
  m.def("pack_lines", &pack_lines, "data"_a,
        "Text lines to packed documents: (packed bytes, lengths int64, failed line or -1).");
  m.def("pack_documents", &pack_documents, "data"_a, "offsets"_a.noconvert(),
        "Documents data[offsets[i]:offsets[i+1]] to packed documents: (packed bytes, lengths "
        "int64, failed document or -1).");
  m.def("find_code_points", &find_code_points, "packed"_a, "ranges"_a.noconvert(),
        "Byte positions (int64) of code points inside the (first, last) uint32 ranges.");
}

}  // namespace tokenmill::bindings
