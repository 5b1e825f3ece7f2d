// Test-only entry points of the runtime: the thread pool (thread counts, fault injection, an
// exception thrown on a worker) and the cgroup CPU quota reader. Registered on
// tokenmill._core._testing by module.cpp; the library never calls them.
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../thread_pool.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

[[noreturn]] void throw_named(const std::string& kind) {
  if (kind == "MemoryError") throw std::bad_alloc();
  if (kind == "IndexError") throw std::out_of_range("thrown on a pool worker");
  if (kind == "ValueError") throw std::invalid_argument("thrown on a pool worker");
  if (kind == "OverflowError") throw std::overflow_error("thrown on a pool worker");
  throw std::runtime_error("thrown on a pool worker");
}

// Runs a two-part region in which the part that lands on a pool worker throws `kind`, while the
// caller's part waits for the worker to start (so the exception is thrown off the caller's
// thread). The caller's wait is bounded (60 s) only to turn a broken pool into an error.
void throw_in_worker(const std::string& kind) {
  static const std::vector<std::string> kinds = {"MemoryError", "IndexError", "ValueError",
                                                 "OverflowError", "RuntimeError"};
  if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) {
    throw py::value_error("kind must be MemoryError, IndexError, ValueError, OverflowError or "
                          "RuntimeError, got '" + kind + "'");
  }
  if (usable_threads(2) < 2) throw std::runtime_error("throw_in_worker needs two usable CPUs");
  ReleasedGil release;  // the parts never touch Python
  const std::thread::id caller = std::this_thread::get_id();
  std::mutex mutex;
  std::condition_variable started;
  bool worker_started = false;
  parallel_for(2, 2, [&](size_t /*part*/) {
    if (std::this_thread::get_id() == caller) {
      std::unique_lock<std::mutex> lock(mutex);
      if (!started.wait_for(lock, std::chrono::seconds(60), [&] { return worker_started; })) {
        throw std::runtime_error("no pool worker took a part within 60 s");
      }
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      worker_started = true;
    }
    started.notify_all();
    throw_named(kind);
  });
}

// For each of `parts` parts of one region on up to `threads` threads: which thread ran it (0:
// the caller, 1, 2, ...: other threads in order of first appearance).
std::vector<int> run_parts(size_t parts, int threads) {
  std::vector<std::thread::id> ran(parts);
  {
    ReleasedGil release;  // the parts never touch Python
    parallel_for(parts, threads, [&](size_t part) { ran[part] = std::this_thread::get_id(); });
  }
  std::map<std::thread::id, int> number{{std::this_thread::get_id(), 0}};
  std::vector<int> result;
  result.reserve(parts);
  for (const std::thread::id& id : ran) {
    const auto found = number.try_emplace(id, static_cast<int>(number.size()));
    result.push_back(found.first->second);
  }
  return result;
}

}  // namespace

void register_runtime_testing(py::module_& testing) {
  testing.def("available_cpus", &available_cpus,
              "CPUs this process may use: its affinity mask, capped by its cgroup CPU quota.");
  testing.def("usable_threads", &usable_threads, "requested"_a,
              "Threads a pool region asking for `requested` gets (<= 0: all available).");
  testing.def("pool_workers", &pool_testing::workers,
              "Worker threads this process's pool has started.");
  testing.def("fail_thread_creation", &pool_testing::fail_thread_creation, "fail"_a,
              "While true, starting a pool worker fails as if the system refused.");
  testing.def("cgroup_cpu_limit", &cgroup_cpu_limit, "root"_a,
              "The cgroup CPU limit (quota / period) read under `root` (a directory standing for "
              "/), or None.");
  testing.def("run_parts", &run_parts, "parts"_a, "threads"_a,
              "Which thread ran each part of one region (0: the caller).");
  testing.def("throw_in_worker", &throw_in_worker, "kind"_a,
              "Raise `kind` (MemoryError, IndexError, ValueError, OverflowError, RuntimeError) "
              "from a pool worker, through the caller.");
}

}  // namespace tokenmill::bindings
