// Bindings of the blending kernels (BlendedDataset's dataset_index / dataset_sample_index). The
// module's functions always take the library's kernel choice; the _testing versions also take
// the knobs that force a kernel (path, window, margin, block, guess_zero), which never change
// the result.
#include <cstdint>
#include <span>
#include <string>

#include "../blending.hpp"
#include "../cpu_features.hpp"
#include "../shuffle.hpp"
#include "arrays.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

void check_blend_outputs(const py::array& dataset_index, const py::array& dataset_sample_index) {
  if (dataset_index.ndim() != 1 || dataset_sample_index.ndim() != 1 ||
      dataset_index.shape(0) != dataset_sample_index.shape(0)) {
    fail_value("dataset_index and dataset_sample_index must be 1-D arrays of the same length");
  }
}

// The private test hook: "auto" (what the library uses), "scan", "scan-simd" (the AVX-512
// register scan), "active", "active-avx2" / "active-baseline" (the active set without AVX-512 /
// AVX2) or "tree", and the active set's window, initial margin and AVX-512 block length (0 /
// negative: the defaults).
tokenmill::BlendingOptions blending_options(const std::string& path, size_t window, double margin,
                                            size_t block, size_t threads, bool guess_zero) {
  using Path = tokenmill::BlendingOptions::Path;
  tokenmill::BlendingOptions options;
  if (path == "auto") {
    options.path = Path::kAuto;
  } else if (path == "scan") {
    options.path = Path::kScan;
  } else if (path == "active") {
    options.path = Path::kActive;
  } else if (path == "scan-simd") {
    options.path = Path::kScanSimd;
  } else if (path == "active-avx2") {
    options.path = Path::kActiveAvx2;
  } else if (path == "active-baseline") {
    options.path = Path::kActiveBaseline;
  } else if (path == "tree") {
    options.path = Path::kTree;
  } else {
    fail_value("path must be 'auto', 'scan', 'scan-simd', 'active', 'active-avx2', "
               "'active-baseline' or 'tree', got '" + path + "'");
  }
  options.window = window;
  options.margin = margin;
  options.block = block;
  options.threads = threads;
  options.guess_zero = guess_zero;
  return options;
}

void build_blending_indices(const py::array& weights_array, py::array dataset_index,
                            py::array dataset_sample_index, const std::string& path,
                            size_t window, double margin, size_t block,
                            size_t threads, bool guess_zero) {
  const auto options = blending_options(path, window, margin, block, threads, guess_zero);
  auto weights = input_span<double>(weights_array, "weights");
  if (weights.empty()) fail_value("weights must not be empty");
  for (size_t d = 0; d < weights.size(); ++d) {
    if (!(weights[d] >= 0.0) || weights[d] > 1e300) {
      fail_value("weights[" + std::to_string(d) + "] must be finite and >= 0, got " +
                 std::to_string(weights[d]));
    }
  }
  check_blend_outputs(dataset_index, dataset_sample_index);
  auto samples = output_span<int64_t>(dataset_sample_index, "dataset_sample_index");
  auto run = [&](auto ids) {
    ReleasedGil release;  // buffers are owned by the caller for the whole call
    tokenmill::build_blending_indices(weights, ids, samples, options);
  };
  if (has_dtype<int16_t>(dataset_index)) {
    if (weights.size() > 32767) fail_value("int16 dataset_index holds at most 32767 datasets");
    run(output_span<int16_t>(dataset_index, "dataset_index"));
  } else if (has_dtype<int32_t>(dataset_index)) {
    run(output_span<int32_t>(dataset_index, "dataset_index"));
  } else {
    throw py::type_error("dataset_index must be int16 or int32, got " + dtype_name(dataset_index));
  }
}

void build_exhaustive_blending_indices(const py::array& sizes_array, py::array dataset_index,
                                       py::array dataset_sample_index, const std::string& path,
                                       size_t window, double margin, size_t block,
                            size_t threads, bool guess_zero) {
  const auto options = blending_options(path, window, margin, block, threads, guess_zero);
  auto sizes = input_span<int64_t>(sizes_array, "sizes");
  if (sizes.empty()) fail_value("sizes must not be empty");
  int64_t total = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] <= 0) {
      fail_value("sizes[" + std::to_string(d) + "] must be > 0, got " + std::to_string(sizes[d]));
    }
    if (__builtin_add_overflow(total, sizes[d], &total)) {
      throw py::value_error("sum of sizes overflows int64");
    }
  }
  check_blend_outputs(dataset_index, dataset_sample_index);
  if (dataset_index.shape(0) != total) {
    fail_value("dataset_index must have sum(sizes) = " + std::to_string(total) + " entries, got " +
               std::to_string(dataset_index.shape(0)));
  }
  auto samples = output_span<int64_t>(dataset_sample_index, "dataset_sample_index");
  auto run = [&](auto ids) {
    ReleasedGil release;  // buffers are owned by the caller for the whole call
    tokenmill::build_exhaustive_blending_indices(sizes, ids, samples, options);
  };
  if (has_dtype<int16_t>(dataset_index)) {
    if (sizes.size() > 32767) fail_value("int16 dataset_index holds at most 32767 datasets");
    run(output_span<int16_t>(dataset_index, "dataset_index"));
  } else if (has_dtype<int32_t>(dataset_index)) {
    run(output_span<int32_t>(dataset_index, "dataset_index"));
  } else {
    throw py::type_error("dataset_index must be int16 or int32, got " + dtype_name(dataset_index));
  }
}

void build_blending_indices_auto(const py::array& weights, py::array dataset_index,
                                 py::array dataset_sample_index, size_t threads) {
  build_blending_indices(weights, std::move(dataset_index), std::move(dataset_sample_index),
                         "auto", 0, -1.0, 0, threads, false);
}

void build_exhaustive_blending_indices_auto(const py::array& sizes, py::array dataset_index,
                                            py::array dataset_sample_index, size_t threads) {
  build_exhaustive_blending_indices(sizes, std::move(dataset_index),
                                    std::move(dataset_sample_index), "auto", 0, -1.0, 0, threads,
                                    false);
}

}  // namespace

void register_blending(py::module_& m, py::module_& testing) {
  // TOKENMILL_SIMD pins the shuffle's and the blending kernels' units (cpu_features.hpp); a
  // request this CPU cannot run, or a misspelt one, refuses the import with the reason instead
  // of crashing on an illegal instruction or silently testing another unit.
  if (!tokenmill::cpu_features().error.empty()) {
    throw py::value_error(tokenmill::cpu_features().error);
  }
  m.def("build_blending_indices", &build_blending_indices_auto, "weights"_a.noconvert(),
        "dataset_index"_a.noconvert(), "dataset_sample_index"_a.noconvert(), py::kw_only(),
        "threads"_a = 0,
        "Greedy blending indices (megatron-core's build_blending_indices). threads: chunks of "
        "the samples, each on a thread of the pool when one is free (0: automatic).");
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices_auto,
        "sizes"_a.noconvert(), "dataset_index"_a.noconvert(),
        "dataset_sample_index"_a.noconvert(), py::kw_only(), "threads"_a = 0,
        "Exhaustive blending indices (megatron-core's build_exhaustive_blending_indices). "
        "threads: as for build_blending_indices.");
  testing.def("build_blending_indices", &build_blending_indices, "weights"_a.noconvert(),
              "dataset_index"_a.noconvert(), "dataset_sample_index"_a.noconvert(),
              py::kw_only(), "path"_a = "auto", "window"_a = 0, "margin"_a = -1.0,
              "block"_a = 0, "threads"_a = 0, "guess_zero"_a = false,
              "build_blending_indices with the kernel forced: path, window, margin, block and "
              "guess_zero choose the kernel, never the result.");
  testing.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices,
              "sizes"_a.noconvert(), "dataset_index"_a.noconvert(),
              "dataset_sample_index"_a.noconvert(), py::kw_only(), "path"_a = "auto",
              "window"_a = 0, "margin"_a = -1.0, "block"_a = 0, "threads"_a = 0,
              "guess_zero"_a = false,
              "build_exhaustive_blending_indices with the kernel forced (see "
              "build_blending_indices).");
  testing.def(
      "active_set_isa",
      [](const std::string& path) {
        const auto options = blending_options(path, 0, -1.0, 0, 0, false);
        return std::string(tokenmill::active_set_isa(options.path));
      },
      "path"_a = "auto",
      "The instruction set the active-set kernel runs on for `path` on this CPU: 'avx512', "
      "'avx2' or 'baseline' (SSE2 on x86-64, scalar elsewhere).");
  testing.def(
      "simd_dispatch",
      []() {
        const auto& features = tokenmill::cpu_features();
        py::list supported;
        supported.append("baseline");
        if (features.cpu_avx2) supported.append("avx2");
        if (features.cpu_avx512) supported.append("avx512");
        py::dict info;
        info["requested"] = features.requested;
        info["level"] = std::string(tokenmill::simd_level());
        info["shuffle"] = std::string(tokenmill::Mt19937::twist_isa());
        info["blending"] = std::string(tokenmill::active_set_isa());
        info["supported"] = supported;
        return info;
      },
      "The SIMD dispatch of this process: 'requested' (TOKENMILL_SIMD as given), 'level' (the "
      "unit the kernels use), 'shuffle' (the MT19937 twist's unit), 'blending' (the active "
      "set's unit) and 'supported' (the units this CPU and build can run).");
}

}  // namespace tokenmill::bindings
