// Bindings of the background file writer (csrc/file_writer.hpp), used by
// tokenmill.common.atomic for cache files: the one binding that does I/O. It holds a buffer
// view of every chunk it was given until the job's ticket is waited for, so the bytes stay
// alive and the exporter (a numpy array) cannot resize them meanwhile; waiting releases the GIL.
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../file_writer.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

// (errno, failed step, size, inode, mtime_ns, ctime_ns, generation)
using Outcome = std::tuple<int, int, uint64_t, uint64_t, int64_t, int64_t, int64_t>;

// A buffer view held until its job has been waited for; released with the GIL held.
class HeldBuffer {
 public:
  explicit HeldBuffer(const py::handle& exporter) {
    // a C-contiguous view (a non-contiguous exporter raises BufferError)
    if (PyObject_GetBuffer(exporter.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      throw py::error_already_set();
    }
  }
  ~HeldBuffer() { PyBuffer_Release(&view_); }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  FileChunk chunk() const { return FileChunk{view_.buf, static_cast<size_t>(view_.len)}; }

 private:
  Py_buffer view_{};
};

struct PendingJob {
  uint64_t ticket = 0;   // the FileWriter's
  bool waiting = false;  // a thread is in wait() for it: a second one is refused
  std::vector<std::unique_ptr<HeldBuffer>> buffers;
};

class PyFileWriter {
 public:
  explicit PyFileWriter(int threads) {
    if (threads < 0) throw py::value_error("threads must be >= 0, got " + std::to_string(threads));
    writer_ = std::make_unique<FileWriter>(threads);
  }

  ~PyFileWriter() {
    {
      ReleasedGil release;  // queued jobs finish without Python
      writer_.reset();
    }
    jobs_.clear();  // the buffer views are released with the GIL held
  }

  uint64_t submit_write(const std::string& path, const py::list& chunks, bool sync) {
    std::vector<PendingJob> pending(1);
    std::vector<std::pair<std::string, std::vector<FileChunk>>> files;
    files.emplace_back(path, hold(chunks, pending.front()));
    return submit(std::move(pending), [&] { return writer_->submit_writes(std::move(files), sync); })
        .front();
  }

  // several files at once, one ticket each: (path, chunks) pairs
  std::vector<uint64_t> submit_writes(const py::list& files, bool sync) {
    std::vector<PendingJob> pending(files.size());
    std::vector<std::pair<std::string, std::vector<FileChunk>>> jobs;
    jobs.reserve(files.size());
    size_t number = 0;
    for (const py::handle& file : files) {
      auto pair = file.cast<py::tuple>();
      if (pair.size() != 2) throw py::value_error("files must be (path, chunks) pairs");
      jobs.emplace_back(pair[0].cast<std::string>(),
                        hold(pair[1].cast<py::list>(), pending[number++]));
    }
    return submit(std::move(pending), [&] { return writer_->submit_writes(std::move(jobs), sync); });
  }

  uint64_t submit_sync(const std::string& path) {
    return submit(std::vector<PendingJob>(1), [&] {
             return std::vector<uint64_t>{writer_->submit_sync(path)};
           })
        .front();
  }

  // fsync every path, all in flight at once; (errno, failed step) per path
  std::vector<std::pair<int, int>> sync_all(const std::vector<std::string>& paths) {
    ReleasedGil release;
    std::vector<uint64_t> tickets;
    tickets.reserve(paths.size());
    std::vector<std::pair<int, int>> outcomes;
    outcomes.reserve(paths.size());
    try {
      for (const std::string& path : paths) tickets.push_back(writer_->submit_sync(path));
    } catch (...) {
      for (uint64_t ticket : tickets) writer_->wait(ticket);  // none left behind
      throw;
    }
    for (uint64_t ticket : tickets) {
      FileWriteOutcome outcome = writer_->wait(ticket);
      outcomes.emplace_back(outcome.error, static_cast<int>(outcome.step));
    }
    return outcomes;
  }

  // One waiter per ticket: the first takes the outcome and frees the job, so a second thread
  // waiting on the same ticket is refused (ValueError) rather than left waiting for an entry
  // that is gone. The flag is set under jobs_mutex_, which serialises the check.
  Outcome wait(uint64_t key) {
    uint64_t ticket;
    {
      std::lock_guard<std::mutex> lock(jobs_mutex_);
      auto found = jobs_.find(key);
      if (found == jobs_.end() || found->second.ticket == 0) {
        throw py::value_error("unknown or already waited-for ticket " + std::to_string(key));
      }
      if (found->second.waiting) {
        throw py::value_error("ticket " + std::to_string(key) +
                              " is already being waited for by another thread");
      }
      found->second.waiting = true;
      ticket = found->second.ticket;
    }
    FileWriteOutcome outcome;
    try {
      ReleasedGil release;
      outcome = writer_->wait(ticket);
    } catch (...) {  // not taken: another wait may try again
      std::lock_guard<std::mutex> lock(jobs_mutex_);
      auto found = jobs_.find(key);
      if (found != jobs_.end()) found->second.waiting = false;
      throw;
    }
    PendingJob done;
    {
      std::lock_guard<std::mutex> lock(jobs_mutex_);
      auto found = jobs_.find(key);
      if (found != jobs_.end()) {
        done = std::move(found->second);
        jobs_.erase(found);
      }
    }
    return {outcome.error, static_cast<int>(outcome.step), outcome.size, outcome.inode,
            outcome.mtime_ns, outcome.ctime_ns, outcome.generation};
  }

 private:
  // A buffer view of every chunk, held by `job`; the spans the writer reads.
  static std::vector<FileChunk> hold(const py::list& chunks, PendingJob& job) {
    std::vector<FileChunk> spans;
    job.buffers.reserve(chunks.size());
    spans.reserve(chunks.size());
    for (const py::handle& chunk : chunks) {
      if (!PyObject_CheckBuffer(chunk.ptr())) {
        throw py::type_error("chunks must support the buffer protocol, got " +
                             std::string(py::str(py::type::of(chunk).attr("__name__"))));
      }
      job.buffers.push_back(std::make_unique<HeldBuffer>(chunk));
      spans.push_back(job.buffers.back()->chunk());
    }
    return spans;
  }

  // Store the jobs' views under new keys before the jobs can start (so nothing frees them
  // under a worker), submit with the GIL released (a job may run in line), attach the tickets;
  // returns the keys. On failure the keys are erased.
  template <typename Submit>
  std::vector<uint64_t> submit(std::vector<PendingJob> jobs, Submit&& submit_to_writer) {
    std::vector<uint64_t> keys;
    std::vector<PendingJob*> stored;
    keys.reserve(jobs.size());
    stored.reserve(jobs.size());
    {
      std::lock_guard<std::mutex> lock(jobs_mutex_);
      for (PendingJob& job : jobs) {
        keys.push_back(next_key_++);
        stored.push_back(&jobs_.emplace(keys.back(), std::move(job)).first->second);
      }
    }
    std::vector<uint64_t> tickets;
    try {
      ReleasedGil release;
      tickets = submit_to_writer();
    } catch (...) {
      std::lock_guard<std::mutex> lock(jobs_mutex_);
      for (uint64_t key : keys) jobs_.erase(key);
      throw;
    }
    std::lock_guard<std::mutex> lock(jobs_mutex_);
    for (size_t k = 0; k < stored.size(); ++k) stored[k]->ticket = tickets[k];  // values never move
    return keys;
  }

  std::unique_ptr<FileWriter> writer_;
  std::mutex jobs_mutex_;
  uint64_t next_key_ = 1;
  std::unordered_map<uint64_t, PendingJob> jobs_;  // submitted, not yet waited for
};

void inject_file_fault(const std::string& step, int count, int error, bool pause) {
  FileStep parsed;
  if (step == "create") {
    parsed = FileStep::create;
  } else if (step == "write") {
    parsed = FileStep::write;
  } else {
    throw py::value_error("step must be 'create' or 'write', got '" + step + "'");
  }
  file_writer_testing::inject(parsed, count, error, pause);
}

}  // namespace

int sync_filesystem_of(int descriptor, const std::string& label) {
  ReleasedGil release;
  return sync_filesystem(descriptor, label);
}

py::tuple read_small_file_into_bytes(const std::string& path, uint64_t limit,
                                     bool want_generation, bool keep_open) {
  OpenedForRead opened;
  {
    ReleasedGil release;
    opened = open_for_read(path, want_generation);
  }
  auto outcome = [&](int error, int step, py::object data) {
    return py::make_tuple(error, step, std::move(data), opened.size, opened.inode,
                          opened.mtime_ns, opened.ctime_ns, opened.generation);
  };
  if (opened.error != 0) return outcome(opened.error, static_cast<int>(opened.step), py::none());
  if (opened.size > limit || opened.size >= static_cast<uint64_t>(PY_SSIZE_T_MAX)) {
    if (keep_open) return outcome(0, 0, py::int_(opened.descriptor));  // the caller maps it
    close_read(opened.descriptor);
    return outcome(0, 0, py::none());
  }
  // the bytes object is the buffer: one allocation, no copy (a 40 KiB .idx per source)
  const Py_ssize_t capacity = static_cast<Py_ssize_t>(opened.size) + 1;
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, capacity);
  if (raw == nullptr) {
    close_read(opened.descriptor);
    throw py::error_already_set();
  }
  ReadOutcome read;
  {
    ReleasedGil release;
    read = read_and_close(opened.descriptor, PyBytes_AS_STRING(raw), static_cast<size_t>(capacity));
  }
  if (read.error != 0) {
    Py_DECREF(raw);
    return outcome(read.error, static_cast<int>(FileStep::write), py::none());
  }
  if (static_cast<Py_ssize_t>(read.done) != capacity &&
      _PyBytes_Resize(&raw, static_cast<Py_ssize_t>(read.done)) != 0) {
    throw py::error_already_set();  // raw was freed by the failed resize
  }
  return outcome(0, 0, py::reinterpret_steal<py::object>(raw));
}

// A read-only map owned by a Python object: unmapped when the last view of it (memoryview,
// numpy array) is gone.
class ReadOnlyMap {
 public:
  explicit ReadOnlyMap(MappedRegion region) : region_(region) {}
  ~ReadOnlyMap() { unmap_region(region_.address, region_.length); }
  ReadOnlyMap(const ReadOnlyMap&) = delete;
  ReadOnlyMap& operator=(const ReadOnlyMap&) = delete;
  py::buffer_info buffer() const {
    return py::buffer_info(region_.address, 1, py::format_descriptor<uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(region_.length)}, {1}, /*readonly=*/true);
  }
  size_t size() const { return region_.length; }

 private:
  MappedRegion region_;
};

std::unique_ptr<ReadOnlyMap> map_readonly_region(int descriptor, uint64_t length) {
  if (length == 0 || length > static_cast<uint64_t>(PY_SSIZE_T_MAX)) {
    throw py::value_error("cannot map " + std::to_string(length) + " bytes");
  }
  MappedRegion region;
  {
    ReleasedGil release;
    region = map_region(descriptor, static_cast<size_t>(length));
  }
  if (region.error != 0) {
    errno = region.error;
    PyErr_SetFromErrno(PyExc_OSError);
    throw py::error_already_set();
  }
  return std::make_unique<ReadOnlyMap>(region);
}

void register_io(py::module_& m, py::module_& testing) {
  m.def("inode_generation", &inode_generation, "descriptor"_a,
        "The generation of the open file's inode (FS_IOC_GETVERSION), which changes when its "
        "number is reused; -1 where the filesystem reports none (tmpfs, NFS).");
  m.def("read_small_file", &read_small_file_into_bytes, "path"_a, "limit"_a,
        "want_generation"_a = false, "keep_open"_a = false,
        "Open, fstat and, for a file of at most `limit` bytes, read it whole (size + 1 bytes "
        "asked, into the bytes object returned) and close: (errno, failed step, data, size, "
        "inode, mtime_ns, ctime_ns, generation); data is None for a larger file, or with "
        "`keep_open` its open descriptor (the caller closes it); steps: 0 none, 4 open, "
        "3 fstat, 2 read, 6 not a regular file (a FIFO is opened without blocking and refused); "
        "generation -1 unless asked for and reported.");
  py::class_<ReadOnlyMap>(m, "ReadOnlyMap", py::buffer_protocol(),
                          "A read-only shared memory map (bytes, buffer protocol), unmapped when "
                          "the last view of it is freed; made by map_readonly.")
      .def_buffer(&ReadOnlyMap::buffer)
      .def("__len__", &ReadOnlyMap::size);
  m.def("map_readonly", &map_readonly_region, "descriptor"_a, "length"_a,
        "mmap(2) the first `length` bytes of the open `descriptor`, read-only and shared; the "
        "descriptor may be closed at once. Raises OSError (errno) when mmap fails, ValueError "
        "for a length of 0.");
  m.def("sync_filesystem", &sync_filesystem_of, "descriptor"_a, "label"_a,
        "syncfs(2): flush the filesystem holding the open `descriptor`; 0 or errno (ENOSYS "
        "without syncfs). `label` names it in the test log.");
  py::class_<PyFileWriter>(m, "FileWriter",
                           "Small files created, written, fstat-ed and closed on background "
                           "threads, and fsyncs (csrc/file_writer.hpp).")
      .def(py::init<int>(), "threads"_a,
           "At most `threads` worker threads, started on demand (0: every job in line).")
      .def("submit_write", &PyFileWriter::submit_write, "path"_a, "chunks"_a, "sync"_a = false,
           "Create `path` (O_EXCL), write the chunks (buffers, kept alive until wait) and, with "
           "`sync`, fsync it; returns a ticket.")
      .def("submit_writes", &PyFileWriter::submit_writes, "files"_a, "sync"_a = false,
           "submit_write for several (path, chunks) pairs at once (one lock, one wake-up); "
           "a ticket per file, in order.")
      .def("submit_sync", &PyFileWriter::submit_sync, "path"_a,
           "fsync an existing `path` (open, fsync, close); returns a ticket.")
      .def("sync_all", &PyFileWriter::sync_all, "paths"_a,
           "fsync every path (open, fsync, close), all in flight at once; (errno, failed "
           "step) per path.")
      .def("wait", &PyFileWriter::wait, "ticket"_a,
           "The job's outcome: (errno, failed step, size, inode, mtime_ns, ctime_ns, "
           "generation); steps: 0 none, 1 create, 2 write, 3 fstat, 4 open, 5 fsync; "
           "generation -1 where the filesystem reports none.");
  testing.def("inject_file_fault", &inject_file_fault, "step"_a, "count"_a, "error"_a = 0,
              "pause"_a = false,
              "The count-th create or write(2) of the file writer from now fails with errno "
              "`error`, or (pause) writes half its bytes, prints PAUSED and sleeps; count <= 0 "
              "disables.");
  testing.def("record_file_syncs", &file_writer_testing::record_syncs, "on"_a,
              "While on, every successful fsync of the file writer logs its path, and every "
              "sync_filesystem 'filesystem:' and its label.");
  testing.def("fail_file_writer_threads", &file_writer_testing::fail_thread_creation, "fail"_a,
              "While true, the file writer cannot start worker threads (jobs run in line).");
  testing.def("take_file_syncs", &file_writer_testing::take_synced,
              "The paths fsynced since the last call (while recording), in order.");
}

}  // namespace tokenmill::bindings
