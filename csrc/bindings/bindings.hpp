// The bindings of tokenmill._core, one file per area; each registers its functions on the module
// and its test-only entry points on the _testing submodule (module.cpp assembles both). Only
// these files include pybind11: they check arguments, dispatch on dtypes and release the GIL
// around the kernels (csrc/*.hpp), which never see Python.
#pragma once

#include <pybind11/pybind11.h>

namespace tokenmill::bindings {

namespace py = pybind11;

// The GIL released for the scope of a kernel call: every binding uses this, not
// py::gil_scoped_release. Taking the GIL back can end the thread: before Python 3.14 a thread
// that asks for it while the interpreter finalizes (a daemon thread, such as a prefetcher, still
// gathering when the main thread exits) is ended by pthread_exit, whose forced unwind through
// pybind11's noexcept destructor calls std::terminate and aborts the process (SIGABRT) instead
// of letting it exit. Such a thread is parked here until the process ends. If finalizing starts
// while the thread already waits for the GIL, the unwind passes through this destructor
// (noexcept(false)) to pybind11's dispatcher, which lets it through.
class ReleasedGil {
 public:
  ReleasedGil() : state_(PyEval_SaveThread()) {}
  ~ReleasedGil() noexcept(false);
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;

 private:
  PyThreadState* state_;
};

void register_formats(py::module_& m);    // formats.cpp: token scan
void register_gpt_index(py::module_& m, py::module_& testing);  // gpt_index.cpp
void register_blending(py::module_& m, py::module_& testing);   // blending.cpp
void register_packing(py::module_& m);    // packing.cpp
void register_gather(py::module_& m);     // gather.cpp
void register_mixture(py::module_& m, py::module_& testing);    // mixture.cpp
void register_text(py::module_& m);       // text.cpp: text packers of the tokenize pipeline
void register_io(py::module_& m, py::module_& testing);         // io.cpp: background file writer
void register_read_ahead(py::module_& m);  // read_ahead.cpp: data files read ahead
void register_mapped_reads(py::module_& m);  // mapped_reads.cpp: SIGBUS-guarded reads
void register_runtime_testing(py::module_& testing);  // testing.cpp: thread pool, CPU dispatch

}  // namespace tokenmill::bindings
