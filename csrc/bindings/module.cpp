// tokenmill._core: the compiled kernels (private; the package API wraps them), and
// tokenmill._core._testing: entry points only tests use (forced kernels, fault injection,
// introspection). Both are in the one extension so CI tests the binary that ships.
#include <pybind11/pybind11.h>

#include "bindings.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_core, m, py::mod_gil_not_used()) {
  using namespace tokenmill::bindings;
  m.doc() = "tokenmill's compiled kernels (private: use the tokenmill package API)";
  py::module_ testing = m.def_submodule(
      "_testing", "Test-only entry points of tokenmill._core (forced kernels, fault injection).");
  // `import tokenmill._core._testing` (and stubtest) finds a submodule through sys.modules.
  py::module_::import("sys").attr("modules")[testing.attr("__name__")] = testing;
  register_formats(m);
  register_gpt_index(m, testing);
  register_blending(m, testing);
  register_packing(m);
  register_gather(m);
  register_mixture(m, testing);
  register_text(m);
  register_io(m, testing);
  register_runtime_testing(testing);
}
