// Guarded reads of mapped files for the Python readers (fault_guard.hpp): a probe of a range
// before a zero-copy view of it is handed out, and a copy out of a mapping. A SIGBUS (the file
// shrank underneath) raises tokenmill._core.MappedReadFault (an OSError); the Python caller
// names the file.
#include <cstdint>
#include <cstring>
#include <string>

#include "../fault_guard.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

struct HeldView {
  explicit HeldView(const py::handle& exporter, int flags) {
    if (PyObject_GetBuffer(exporter.ptr(), &view, flags) != 0) throw py::error_already_set();
  }
  ~HeldView() { PyBuffer_Release(&view); }
  HeldView(const HeldView&) = delete;
  HeldView& operator=(const HeldView&) = delete;
  Py_buffer view{};
};

void check_range(const Py_buffer& view, int64_t begin, int64_t end) {
  if (begin < 0 || end < begin || end > view.len) {
    throw py::index_error("byte range [" + std::to_string(begin) + ", " + std::to_string(end) +
                          ") is outside a mapping of " + std::to_string(view.len) + " bytes");
  }
}

// Touch the last byte of mapping[begin:end) and the page after it.
void probe_mapped(const py::handle& mapping, int64_t begin, int64_t end) {
  HeldView held(mapping, PyBUF_C_CONTIGUOUS);
  check_range(held.view, begin, end);
  if (begin == end) return;
  const auto* base = static_cast<const unsigned char*>(held.view.buf);
  const unsigned char* last = base + end - 1;
  const unsigned char* stop = base + held.view.len;
  tokenmill::guard_mapped_reads([&] {
    (void)*reinterpret_cast<const volatile unsigned char*>(last);
    tokenmill::probe_next_page(last, stop);
  });
}

// destination[:] = mapping[begin:begin + len(destination)], then the page after is probed.
void copy_mapped(const py::handle& destination, const py::handle& mapping, int64_t begin) {
  HeldView target(destination, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE);
  HeldView source(mapping, PyBUF_C_CONTIGUOUS);
  const int64_t count = target.view.len;
  check_range(source.view, begin, begin + count);
  if (count == 0) return;
  const auto* from = static_cast<const unsigned char*>(source.view.buf) + begin;
  const unsigned char* stop = static_cast<const unsigned char*>(source.view.buf) + source.view.len;
  auto* into = static_cast<unsigned char*>(target.view.buf);
  ReleasedGil release;
  tokenmill::guard_mapped_reads([&] {
    std::memcpy(into, from, static_cast<size_t>(count));
    tokenmill::probe_next_page(from + count - 1, stop);
  });
}

// (pointers[index], lengths[index]) of a mapped .idx (int64 and int32 arrays), read under the
// guard, then the page after each is probed: an index cut underneath the reader raises
// MappedReadFault instead of SIGBUS (or a zero length read from the partial page at the cut).
py::tuple sequence_entry(const py::handle& lengths, const py::handle& pointers, int64_t index) {
  HeldView held_lengths(lengths, PyBUF_C_CONTIGUOUS);
  HeldView held_pointers(pointers, PyBUF_C_CONTIGUOUS);
  if (index < 0 || index >= held_lengths.view.len / 4 || index >= held_pointers.view.len / 8) {
    throw py::index_error("sequence " + std::to_string(index) + " is outside an index of " +
                          std::to_string(held_lengths.view.len / 4) + " sequences");
  }
  const auto* length_at = static_cast<const unsigned char*>(held_lengths.view.buf) + index * 4;
  const auto* pointer_at = static_cast<const unsigned char*>(held_pointers.view.buf) + index * 8;
  const auto* lengths_end = static_cast<const unsigned char*>(held_lengths.view.buf) +
                            held_lengths.view.len;
  const auto* pointers_end = static_cast<const unsigned char*>(held_pointers.view.buf) +
                             held_pointers.view.len;
  int32_t length = 0;
  int64_t pointer = 0;
  tokenmill::guard_mapped_reads([&] {
    std::memcpy(&length, length_at, sizeof length);
    std::memcpy(&pointer, pointer_at, sizeof pointer);
    tokenmill::probe_next_page(length_at + 3, lengths_end);
    tokenmill::probe_next_page(pointer_at + 7, pointers_end);
  });
  return py::make_tuple(pointer, length);
}

}  // namespace

void register_mapped_reads(py::module_& m) {
  py::register_exception<tokenmill::MappedReadFault>(m, "MappedReadFault", PyExc_OSError);
  m.def("probe_mapped", &probe_mapped, "mapping"_a, "begin"_a, "end"_a,
        "Touch the last byte of mapping[begin:end] and the next page: MappedReadFault if the "
        "mapped file shrank below them.");
  m.def("copy_mapped", &copy_mapped, "destination"_a, "mapping"_a, "begin"_a,
        "Copy len(destination) bytes of mapping from byte `begin`, MappedReadFault (not SIGBUS) "
        "if the mapped file shrank underneath.");
  m.def("sequence_entry", &sequence_entry, "lengths"_a, "pointers"_a, "index"_a,
        "(pointers[index], lengths[index]) of a mapped .idx (int64, int32 arrays), read under the "
        "SIGBUS guard: MappedReadFault if the mapped index shrank underneath.");
}

}  // namespace tokenmill::bindings
