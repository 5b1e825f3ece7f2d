// The only translation unit that sees Python: argument checks (raising ValueError, TypeError,
// IndexError or OverflowError with the offending value), dtype dispatch, GIL release.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <span>
#include <string>

#include "blending.hpp"
#include "sample_index.hpp"
#include "shuffle.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

[[noreturn]] void fail_value(const std::string& message) { throw py::value_error(message); }

std::string dtype_name(const py::array& array) { return py::str(array.dtype()).cast<std::string>(); }

template <typename T>
bool has_dtype(const py::array& array) {
  return array.dtype().is(py::dtype::of<T>());
}

// A C-contiguous view of `array` as T, or TypeError naming the argument.
template <typename T>
std::span<const T> input_span(const py::array& array, const char* name) {
  if (!has_dtype<T>(array)) {
    throw py::type_error(std::string(name) + " must have dtype " +
                         py::str(py::dtype::of<T>()).cast<std::string>() + ", got " +
                         dtype_name(array));
  }
  if (!(array.flags() & py::array::c_style)) {
    throw py::type_error(std::string(name) + " must be C-contiguous");
  }
  return {static_cast<const T*>(array.data()), static_cast<size_t>(array.size())};
}

template <typename T>
std::span<T> output_span(py::array& array, const char* name) {
  auto view = input_span<T>(array, name);
  if (!array.writeable()) throw py::value_error(std::string(name) + " must be writeable");
  return {const_cast<T*>(view.data()), view.size()};
}

void check_documents(std::span<const int32_t> sizes, std::span<const int32_t> documents,
                     const char* name) {
  int64_t bad = -1;
  {
    py::gil_scoped_release release;  // a read-only scan of buffers the caller keeps alive
    bad = tokenmill::find_out_of_range(documents, static_cast<int64_t>(sizes.size()));
  }
  if (bad >= 0) {
    throw py::index_error(std::string(name) + "[" + std::to_string(bad) + "] = " +
                          std::to_string(documents[static_cast<size_t>(bad)]) +
                          " is not a document id in [0, " + std::to_string(sizes.size()) + ")");
  }
}

uint32_t check_seed(int64_t seed) {
  if (seed < 0 || seed > 0xffffffffLL) {
    fail_value("random_seed must be in [0, 2**32 - 1] (numpy.random.RandomState), got " +
               std::to_string(seed));
  }
  return static_cast<uint32_t>(seed);
}

void shuffle_like_numpy(py::array values, int64_t seed) {
  tokenmill::NumpyRandomState random(check_seed(seed));
  if (values.ndim() != 1) fail_value("values must be 1-D, got ndim " + std::to_string(values.ndim()));
  auto run = [&](auto span) {
    py::gil_scoped_release release;  // the buffer is owned by the caller for the whole call
    tokenmill::shuffle_like_numpy(span, random);
  };
  if (has_dtype<int32_t>(values)) {
    run(output_span<int32_t>(values, "values"));
  } else if (has_dtype<uint32_t>(values)) {
    run(output_span<uint32_t>(values, "values"));
  } else if (has_dtype<int64_t>(values)) {
    run(output_span<int64_t>(values, "values"));
  } else {
    throw py::type_error("values must be int32, uint32 or int64, got " + dtype_name(values));
  }
}

int64_t sum_selected_lengths(const py::array& sizes_array, const py::array& indices_array) {
  auto sizes = input_span<int32_t>(sizes_array, "sizes");
  auto indices = input_span<int32_t>(indices_array, "indices");
  check_documents(sizes, indices, "indices");
  py::gil_scoped_release release;  // read-only loop over caller-owned buffers
  return tokenmill::sum_selected_lengths(sizes, indices);
}

void check_sequence(int64_t sequence_length, int64_t extra_token) {
  if (sequence_length < 1) {
    fail_value("sequence_length must be >= 1, got " + std::to_string(sequence_length));
  }
  if (extra_token != 0 && extra_token != 1) {
    fail_value("add_extra_token_to_sequence must be 0 or 1, got " + std::to_string(extra_token));
  }
}

void check_sample_index_shape(const py::array& sample_index) {
  if (sample_index.ndim() != 2 || sample_index.shape(1) != 2 || sample_index.shape(0) < 1) {
    fail_value("sample_index must have shape [num_samples + 1, 2]");
  }
}

void build_sample_index(const py::array& sizes_array, const py::array& document_index_array,
                        int64_t sequence_length, int64_t extra_token, py::array sample_index,
                        int num_threads) {
  check_sequence(sequence_length, extra_token);
  check_sample_index_shape(sample_index);
  auto sizes = input_span<int32_t>(sizes_array, "sizes");
  auto documents = input_span<int32_t>(document_index_array, "document_index");
  check_documents(sizes, documents, "document_index");
  if (documents.empty()) fail_value("document_index must not be empty");
  auto run = [&](auto rows) {
    py::gil_scoped_release release;  // buffers are owned by the caller for the whole call
    tokenmill::build_sample_index(sizes, documents, sequence_length, extra_token, rows,
                                  num_threads);
  };
  if (has_dtype<int32_t>(sample_index)) {
    run(output_span<int32_t>(sample_index, "sample_index"));
  } else if (has_dtype<int64_t>(sample_index)) {
    run(output_span<int64_t>(sample_index, "sample_index"));
  } else {
    throw py::type_error("sample_index must be int32 or int64, got " + dtype_name(sample_index));
  }
}

void build_gpt_indices(const py::array& sizes_array, const py::array& indices_array,
                       int64_t seed, int64_t num_epochs, bool separate_final_epoch,
                       int64_t shuffle_split, int64_t sequence_length, int64_t extra_token,
                       py::array document_index_array, py::array sample_index,
                       py::array shuffle_index, int num_threads) {
  check_sequence(sequence_length, extra_token);
  check_sample_index_shape(sample_index);
  if (num_epochs < 1) fail_value("num_epochs must be >= 1, got " + std::to_string(num_epochs));
  tokenmill::GptIndexPlan plan;
  plan.seed = check_seed(seed);
  plan.num_epochs = num_epochs;
  plan.separate_final_epoch = separate_final_epoch;
  plan.shuffle_split = shuffle_split;
  plan.sequence_length = sequence_length;
  plan.extra_token = extra_token;
  plan.num_threads = num_threads;
  auto sizes = input_span<int32_t>(sizes_array, "sizes");
  auto indices = input_span<int32_t>(indices_array, "indices");
  if (indices.empty()) fail_value("indices must not be empty");
  check_documents(sizes, indices, "indices");
  auto documents = output_span<int32_t>(document_index_array, "document_index");
  const int64_t expected = static_cast<int64_t>(indices.size()) * num_epochs;
  if (static_cast<int64_t>(documents.size()) != expected) {
    fail_value("document_index must have num_epochs * len(indices) = " +
               std::to_string(expected) + " entries, got " + std::to_string(documents.size()));
  }
  const int64_t num_samples = sample_index.shape(0) - 1;
  if (shuffle_index.ndim() != 1 || shuffle_index.shape(0) != num_samples) {
    fail_value("shuffle_index must have num_samples = " + std::to_string(num_samples) +
               " entries");
  }
  if (shuffle_split < 0 || shuffle_split > num_samples) {
    fail_value("shuffle_split must be in [0, " + std::to_string(num_samples) + "], got " +
               std::to_string(shuffle_split));
  }
  auto run = [&](auto rows, auto order) {
    py::gil_scoped_release release;  // buffers are owned by the caller for the whole call
    tokenmill::build_gpt_indices(sizes, indices, plan, documents, rows, order);
  };
  auto with_rows = [&](auto rows) {
    if (has_dtype<uint32_t>(shuffle_index)) {
      run(rows, output_span<uint32_t>(shuffle_index, "shuffle_index"));
    } else if (has_dtype<int64_t>(shuffle_index)) {
      run(rows, output_span<int64_t>(shuffle_index, "shuffle_index"));
    } else {
      throw py::type_error("shuffle_index must be uint32 or int64, got " +
                           dtype_name(shuffle_index));
    }
  };
  if (has_dtype<int32_t>(sample_index)) {
    with_rows(output_span<int32_t>(sample_index, "sample_index"));
  } else if (has_dtype<int64_t>(sample_index)) {
    with_rows(output_span<int64_t>(sample_index, "sample_index"));
  } else {
    throw py::type_error("sample_index must be int32 or int64, got " + dtype_name(sample_index));
  }
}

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
                                            size_t block) {
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
  return options;
}

void build_blending_indices(const py::array& weights_array, py::array dataset_index,
                            py::array dataset_sample_index, const std::string& path,
                            size_t window, double margin, size_t block) {
  const auto options = blending_options(path, window, margin, block);
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
    py::gil_scoped_release release;  // buffers are owned by the caller for the whole call
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
                                       size_t window, double margin, size_t block) {
  const auto options = blending_options(path, window, margin, block);
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
    py::gil_scoped_release release;  // buffers are owned by the caller for the whole call
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

}  // namespace

PYBIND11_MODULE(_core, m, py::mod_gil_not_used()) {
  m.doc() = "tokenmill's compiled kernels (private: use the tokenmill package API)";
  m.def("shuffle_like_numpy", &shuffle_like_numpy, "values"_a.noconvert(), "seed"_a,
        "Shuffle a 1-D int32/uint32/int64 array in place exactly as "
        "numpy.random.RandomState(seed).shuffle would.");
  m.def("sum_selected_lengths", &sum_selected_lengths, "sizes"_a.noconvert(),
        "indices"_a.noconvert(), "Sum of sizes[indices] as a Python int.");
  m.def("build_sample_index", &build_sample_index, "sizes"_a.noconvert(),
        "document_index"_a.noconvert(), "sequence_length"_a, "extra_token"_a,
        "sample_index"_a.noconvert(), "num_threads"_a = 1,
        "Fill a [num_samples + 1, 2] sample index (megatron-core's build_sample_idx).");
  m.def("build_gpt_indices", &build_gpt_indices, "sizes"_a.noconvert(), "indices"_a.noconvert(),
        "seed"_a, "num_epochs"_a, "separate_final_epoch"_a, "shuffle_split"_a,
        "sequence_length"_a, "extra_token"_a, "document_index"_a.noconvert(),
        "sample_index"_a.noconvert(), "shuffle_index"_a.noconvert(), "num_threads"_a = 1,
        "Fill the document, sample and shuffle indices of a GPTDataset.");
  m.def("build_blending_indices", &build_blending_indices, "weights"_a.noconvert(),
        "dataset_index"_a.noconvert(), "dataset_sample_index"_a.noconvert(), py::kw_only(),
        "path"_a = "auto", "window"_a = 0, "margin"_a = -1.0, "block"_a = 0,
        "Greedy blending indices (megatron-core's build_blending_indices). path, window, "
        "margin and block are a test hook: they choose the kernel, never the result.");
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices,
        "sizes"_a.noconvert(), "dataset_index"_a.noconvert(),
        "dataset_sample_index"_a.noconvert(), py::kw_only(), "path"_a = "auto", "window"_a = 0,
        "margin"_a = -1.0, "block"_a = 0,
        "Exhaustive blending indices (megatron-core's build_exhaustive_blending_indices). path, "
        "window, margin and block are a test hook: they choose the kernel, never the result.");
}
