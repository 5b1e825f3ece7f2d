// tokenmill._core: the compiled kernels (private; the package API wraps them), and
// tokenmill._core._testing: entry points only tests use (forced kernels, fault injection,
// introspection). Both are in the one extension so CI tests the binary that ships.
#include <pthread.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "bindings.hpp"

namespace py = pybind11;

namespace tokenmill::bindings {
namespace {

// The thread that finalizes the interpreter, which must never be parked: Python's main thread
// (in a forked child, the thread that forked, which Python makes the child's main thread).
std::atomic<unsigned long> main_thread_ident{0};

void forked_child() { main_thread_ident.store(PyThread_get_thread_ident()); }

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

}  // namespace

ReleasedGil::~ReleasedGil() noexcept(false) {
#if PY_VERSION_HEX < 0x030E0000  // from 3.14 on, Python parks such a thread itself
  if (interpreter_finalizing() && PyThread_get_thread_ident() != main_thread_ident.load()) {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));  // until the process exits
  }
#endif
  PyEval_RestoreThread(state_);
}

}  // namespace tokenmill::bindings

// No py::mod_gil_not_used(): declaring free-threading support would let a free-threaded
// interpreter (3.13t/3.14t) run this module without the GIL, but no free-threaded wheel is built
// or tested, and the Python package assumes a GIL (module-level caches and memos, the file
// writer's held buffer views, numpy arrays shared between threads). Without the declaration a
// free-threaded interpreter re-enables the GIL on import (with a RuntimeWarning), which is
// correct; tests/test_package.py checks the module does not declare it.
PYBIND11_MODULE(_core, m) {
  using namespace tokenmill::bindings;
  m.doc() = "tokenmill's compiled kernels (private: use the tokenmill package API)";
  main_thread_ident.store(
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>());
  pthread_atfork(nullptr, nullptr, &forked_child);
  py::module_ testing = m.def_submodule(
      "_testing", "Test-only entry points of tokenmill._core (forced kernels, fault injection).");
  // `import tokenmill._core._testing` (and stubtest) finds a submodule through sys.modules.
  py::module_::import("sys").attr("modules")[testing.attr("__name__")] = testing;
  register_mapped_reads(m);  // first: other bindings' kernels may raise MappedReadFault
  register_formats(m);
  register_gpt_index(m, testing);
  register_blending(m, testing);
  register_packing(m);
  register_gather(m);
  register_mixture(m, testing);
  register_text(m);
  register_io(m, testing);
  register_read_ahead(m);
  register_runtime_testing(testing);
}
