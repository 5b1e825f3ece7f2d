// Bindings of the read ahead of data files (csrc/read_ahead.hpp), used by
// tokenmill.common.whole_read.reading_ahead: its results handed over without a copy.
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../read_ahead.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

// A buffer read ahead (csrc/read_ahead.hpp), owned by a Python object: freed when the last
// view of it (memoryview, numpy array) is gone. Not a bytes object: that would be a copy into
// fresh memory on the caller's thread, the cost the read ahead takes off it.
class OwnedBuffer {
 public:
  OwnedBuffer(std::unique_ptr<char[]> data, size_t length)
      : data_(std::move(data)), length_(length) {}
  py::buffer_info buffer() const {
    return py::buffer_info(data_.get(), 1, py::format_descriptor<uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(length_)}, {1}, /*readonly=*/true);
  }
  size_t size() const { return length_; }

 private:
  std::unique_ptr<char[]> data_;
  size_t length_;
};

class PyReadAhead {
 public:
  // requests: (path, whole, limit, sample)
  PyReadAhead(const std::vector<std::tuple<std::string, bool, uint64_t, uint64_t>>& requests,
              size_t max_pending, size_t max_pending_bytes) {
    std::vector<ReadAheadRequest> made;
    made.reserve(requests.size());
    for (const auto& [path, whole, limit, sample] : requests) {
      made.push_back(ReadAheadRequest{path, whole, limit, sample});
    }
    ahead_ = std::make_unique<ReadAhead>(std::move(made), max_pending, max_pending_bytes);
  }
  ~PyReadAhead() {
    ReleasedGil release;  // the worker finishes its file without Python
    ahead_.reset();
  }

  py::object take(size_t index) {
    std::optional<ReadAheadResult> found;
    {
      ReleasedGil release;
      found = ahead_->take(index);
    }
    if (!found) return py::none();
    ReadAheadResult& result = *found;
    const OpenedForRead& opened = result.opened;
    int error = opened.error;
    int step = static_cast<int>(opened.step);
    if (error == 0 && result.read_error != 0) {
      error = result.read_error;
      step = static_cast<int>(FileStep::write);  // read_small_file's step for a failed read
    }
    py::object data = py::none();
    if (error == 0 && result.read) {
      data = py::cast(std::make_unique<OwnedBuffer>(std::move(result.contents), result.length));
    }
    return py::make_tuple(error, step, std::move(data), result.head, opened.size, opened.inode,
                          opened.mtime_ns, opened.ctime_ns);
  }
  size_t size() const { return ahead_->size(); }
  size_t read_by_worker() const { return ahead_->read_by_worker(); }

 private:
  std::unique_ptr<ReadAhead> ahead_;
};

}  // namespace

void register_read_ahead(py::module_& m) {
  py::class_<OwnedBuffer>(m, "OwnedBuffer", py::buffer_protocol(),
                          "Bytes read ahead (ReadAhead.take), read-only through the buffer "
                          "protocol, freed when the last view of them is.")
      .def_buffer(&OwnedBuffer::buffer)
      .def("__len__", &OwnedBuffer::size);
  py::class_<PyReadAhead>(m, "ReadAhead",
                          "Data files read ahead of their use on a background thread without "
                          "the GIL (csrc/read_ahead.hpp).")
      .def(py::init<const std::vector<std::tuple<std::string, bool, uint64_t, uint64_t>>&, size_t,
                    size_t>(),
           "requests"_a, "max_pending"_a, "max_pending_bytes"_a,
           "requests: (path, whole, limit, sample) each; whole: the file read whole if it has at "
           "most `limit` bytes; otherwise `sample` bytes at each end. The worker stays at most "
           "`max_pending` results and `max_pending_bytes` bytes ahead of take().")
      .def("take", &PyReadAhead::take, "index"_a,
           "Request `index`'s result, once: (errno, failed step, data, head, size, inode, "
           "mtime_ns, ctime_ns), data an OwnedBuffer (whole: the file; sampled: `head` bytes, then "
           "the tail) or None (not read: an error, or a whole file over the limit); read on this "
           "thread if the worker has not started it. None if taken already, out of range, or in a "
           "forked child. Steps as read_small_file's.")
      .def_property_readonly("read_by_worker", &PyReadAhead::read_by_worker,
                             "How many results the worker has read (diagnostics, tests).")
      .def("__len__", &PyReadAhead::size);
}

}  // namespace tokenmill::bindings
