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

// Fault now, not in the caller's read, if the file shrank below the end of mapping[begin:end):
// one touch. The page after the one holding the last byte faults for every cut before it (a
// cut below the last byte's page, or inside it), so when that page lies in the mapping it is
// the only one touched; otherwise (the last byte is in the mapping's last page) the last byte
// is, and a cut inside that page reads zeros undetected, as for probe_next_page.
void probe_range(const Py_buffer& view, int64_t begin, int64_t end) {
  check_range(view, begin, end);
  if (begin == end) return;
  const auto* base = static_cast<const unsigned char*>(view.buf);
  const unsigned char* last = base + end - 1;
  const auto stop = reinterpret_cast<uintptr_t>(base + view.len);
  const uintptr_t page = tokenmill::fault_guard_detail::page_size();
  const uintptr_t next = (reinterpret_cast<uintptr_t>(last) & ~(page - 1)) + page;
  const auto* touched = next < stop ? reinterpret_cast<const unsigned char*>(next) : last;
  tokenmill::guard_mapped_reads(
      [&] { (void)*reinterpret_cast<const volatile unsigned char*>(touched); });
}

PyObject* mapped_read_fault = nullptr;  // the MappedReadFault type (the module holds it)

// probe_mapped(mapping, begin, end, /) as a METH_FASTCALL function rather than through
// pybind11's dispatch: it runs once per `IndexedDataset[i]`, where pybind11's argument
// conversion cost about as much as the probe, and one touch rather than two (the last byte
// and the next page) halves the TLB and cache misses of random reads in a large file. Both
// keep `dataset[i]` ahead of megatron-core's, whose view is never touched
// (benchmarks/bench_indexed.py).
PyObject* probe_mapped(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "probe_mapped() takes 3 positional arguments (%zd given)",
                 nargs);
    return nullptr;
  }
  const long long begin = PyLong_AsLongLong(args[1]);
  if (begin == -1 && PyErr_Occurred() != nullptr) return nullptr;
  const long long end = PyLong_AsLongLong(args[2]);
  if (end == -1 && PyErr_Occurred() != nullptr) return nullptr;
  Py_buffer view{};
  if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS) != 0) return nullptr;
  try {
    probe_range(view, begin, end);
  } catch (const tokenmill::MappedReadFault& fault) {
    PyBuffer_Release(&view);
    PyErr_SetString(mapped_read_fault, fault.what());
    return nullptr;
  } catch (const py::index_error& error) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_IndexError, error.what());
    return nullptr;
  }
  PyBuffer_Release(&view);
  Py_RETURN_NONE;
}

PyMethodDef probe_mapped_definition = {
    "probe_mapped",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&probe_mapped)),
    METH_FASTCALL,
    // pybind11's signature line (not CPython's "--" text signature, which would move it out
    // of __doc__): tests/test_core_stubs.py checks the stub against this line like any other.
    "probe_mapped(mapping: numpy.ndarray, begin: int, end: int, /) -> None\n\n"
    "Touch the page after the last byte of mapping[begin:end] (the last byte itself when that "
    "page is past the mapping): MappedReadFault if the mapped file shrank below them.",
};

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

// A mapped file held for guarded reads that cost one call each: its buffer is taken once, at
// construction (the map stays alive while this object does). Probing its last byte is the
// cheap form of the shrink check: every page wholly past a new, shorter end raises SIGBUS when
// touched, the mapping's last page included, so the probe faults after any cut below that page
// however far from it the read was; the byte is one hot cache line, where the page after a read
// (probe_next_page) is a cold one. A cut inside the last page stays unseen, as with that probe.
class MappedFile {
 public:
  explicit MappedFile(const py::handle& exporter) : held_(exporter, PyBUF_C_CONTIGUOUS) {}

  int64_t size() const { return held_.view.len; }

  const unsigned char* last_byte() const {
    if (held_.view.len == 0) return nullptr;
    return static_cast<const unsigned char*>(held_.view.buf) + held_.view.len - 1;
  }

  // MappedReadFault if the file now ends before the mapping's last page.
  void probe() const {
    if (held_.view.len == 0) return;
    const auto* last = static_cast<const unsigned char*>(held_.view.buf) + held_.view.len - 1;
    tokenmill::guard_mapped_reads([&] { (void)*reinterpret_cast<const volatile unsigned char*>(last); });
  }

  // (int64 at pointers_offset + 8 * index, int32 at lengths_offset + 4 * index) of an index
  // of `count` entries (a .idx's pointer and length), read under the guard, then the probe.
  py::tuple entry(int64_t lengths_offset, int64_t pointers_offset, int64_t count,
                  int64_t index) const {
    return read_entry(lengths_offset, pointers_offset, count, index, nullptr);
  }

  // entry(), with the end of `also` (the .bin the entry points into) probed in the same guard:
  // one call checks both files. `also` comes first and nothing has a default: pybind11's
  // defaults and keywords cost more than the read itself (0.8 us against 0.2 us per call).
  py::tuple entry_probing(const MappedFile& also, int64_t lengths_offset, int64_t pointers_offset,
                          int64_t count, int64_t index) const {
    return read_entry(lengths_offset, pointers_offset, count, index, also.last_byte());
  }

 private:
  py::tuple read_entry(int64_t lengths_offset, int64_t pointers_offset, int64_t count,
                       int64_t index, const unsigned char* also_last) const {
    const int64_t size = held_.view.len;
    if (count < 0 || lengths_offset < 0 || pointers_offset < 0 ||
        count > (size - lengths_offset) / 4 || count > (size - pointers_offset) / 8) {
      throw py::value_error("an index of " + std::to_string(count) +
                            " entries does not fit a mapping of " + std::to_string(size) +
                            " bytes");
    }
    if (index < 0 || index >= count) {
      throw py::index_error("sequence " + std::to_string(index) + " is outside an index of " +
                            std::to_string(count) + " sequences");
    }
    const auto* base = static_cast<const unsigned char*>(held_.view.buf);
    const unsigned char* length_at = base + lengths_offset + 4 * index;
    const unsigned char* pointer_at = base + pointers_offset + 8 * index;
    const unsigned char* last = base + size - 1;
    int32_t length = 0;
    int64_t pointer = 0;
    tokenmill::guard_mapped_reads([&] {
      std::memcpy(&length, length_at, sizeof length);
      std::memcpy(&pointer, pointer_at, sizeof pointer);
      (void)*reinterpret_cast<const volatile unsigned char*>(last);
      if (also_last != nullptr) (void)*reinterpret_cast<const volatile unsigned char*>(also_last);
    });
    return py::make_tuple(pointer, length);
  }

  HeldView held_;
};

}  // namespace

void register_mapped_reads(py::module_& m) {
  mapped_read_fault =
      py::register_exception<tokenmill::MappedReadFault>(m, "MappedReadFault", PyExc_OSError)
          .ptr();
  PyObject* probe = PyCFunction_NewEx(&probe_mapped_definition, nullptr, m.attr("__name__").ptr());
  if (probe == nullptr) throw py::error_already_set();
  m.add_object("probe_mapped", py::reinterpret_steal<py::object>(probe));
  m.def("copy_mapped", &copy_mapped, "destination"_a, "mapping"_a, "begin"_a,
        "Copy len(destination) bytes of mapping from byte `begin`, MappedReadFault (not SIGBUS) "
        "if the mapped file shrank underneath.");
  py::class_<MappedFile>(m, "MappedFile",
                         "A mapped file held for guarded reads (MappedReadFault, not SIGBUS, "
                         "if the file shrank underneath).")
      .def(py::init<const py::handle&>(), "mapping"_a)
      .def_property_readonly("size", &MappedFile::size)
      .def("probe", &MappedFile::probe,
           "Touch the mapping's last byte: MappedReadFault if the file now ends before its "
           "last page.")
      .def("entry", &MappedFile::entry, "lengths_offset"_a, "pointers_offset"_a, "count"_a,
           "index"_a,
           "(pointer, length) of entry `index` of a .idx's int64 pointers and int32 lengths at "
           "these byte offsets, read under the guard, then probe().")
      .def("entry_probing", &MappedFile::entry_probing, "also"_a, "lengths_offset"_a,
           "pointers_offset"_a, "count"_a, "index"_a,
           "entry(), then also.probe(), in one guarded call.");
}

}  // namespace tokenmill::bindings
