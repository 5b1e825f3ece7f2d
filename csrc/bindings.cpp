// The only translation unit that sees Python: argument checks (raising ValueError, TypeError,
// IndexError or OverflowError with the offending value), dtype dispatch, GIL release.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "blending.hpp"
#include "common.hpp"
#include "gather.hpp"
#include "packing.hpp"
#include "philox.hpp"
#include "sample_index.hpp"
#include "shuffle.hpp"
#include "text_pack.hpp"
#include "token_scan.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

[[noreturn]] void fail_value(const std::string& message) { throw py::value_error(message); }

std::string dtype_name(const py::array& array) { return py::str(array.dtype()).cast<std::string>(); }

template <typename T>
bool has_dtype(const py::array& array) {
  // Identity for numpy's builtin descriptors; equality for copies (e.g. unpickled arrays).
  const auto expected = py::dtype::of<T>();
  const auto actual = array.dtype();
  return actual.is(expected) || actual.equal(expected);
}

// TypeError naming the argument unless `array` is C-contiguous with dtype T.
template <typename T>
void check_input(const py::array& array, const char* name) {
  if (!has_dtype<T>(array)) {
    throw py::type_error(std::string(name) + " must have dtype " +
                         py::str(py::dtype::of<T>()).cast<std::string>() + ", got " +
                         dtype_name(array));
  }
  if (!(array.flags() & py::array::c_style)) {
    throw py::type_error(std::string(name) + " must be C-contiguous");
  }
}

// A C-contiguous view of `array` as T, or TypeError naming the argument.
template <typename T>
std::span<const T> input_span(const py::array& array, const char* name) {
  check_input<T>(array, name);
  return {static_cast<const T*>(array.data()), static_cast<size_t>(array.size())};
}

// Like input_span, for arrays read in place from a Megatron .idx (lengths, pointers), which may
// sit at any byte offset.
template <typename T>
tokenmill::UnalignedSpan<T> input_unaligned(const py::array& array, const char* name) {
  check_input<T>(array, name);
  return {array.data(), static_cast<size_t>(array.size())};
}

template <typename T>
std::span<T> output_span(py::array& array, const char* name) {
  auto view = input_span<T>(array, name);
  if (!array.writeable()) throw py::value_error(std::string(name) + " must be writeable");
  return {const_cast<T*>(view.data()), view.size()};
}

void check_documents(tokenmill::UnalignedSpan<int32_t> sizes, std::span<const int32_t> documents,
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
  auto sizes = input_unaligned<int32_t>(sizes_array, "sizes");
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

// An int32 sample index stores document positions up to len(document_index) - 1 and offsets up
// to the longest document; a uint32 shuffle index stores sample ids below num_samples. The
// Python wrappers pick int64 past those limits (megatron-core's rule); callers that do not must
// get an error, not positions truncated to 32 bits.
void check_sample_index_fits(const py::array& sample_index, int64_t num_documents) {
  if (has_dtype<int32_t>(sample_index) &&
      num_documents - 1 > static_cast<int64_t>(std::numeric_limits<int32_t>::max())) {
    throw std::overflow_error("an int32 sample_index cannot hold document positions up to " +
                              std::to_string(num_documents - 1) + "; use int64");
  }
}

void check_shuffle_index_fits(const py::array& shuffle_index, int64_t num_samples) {
  if (has_dtype<uint32_t>(shuffle_index) &&
      num_samples - 1 > static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
    throw std::overflow_error("a uint32 shuffle_index cannot hold sample ids up to " +
                              std::to_string(num_samples - 1) + "; use int64");
  }
}

void build_sample_index(const py::array& sizes_array, const py::array& document_index_array,
                        int64_t sequence_length, int64_t extra_token, py::array sample_index,
                        int num_threads) {
  check_sequence(sequence_length, extra_token);
  check_sample_index_shape(sample_index);
  auto sizes = input_unaligned<int32_t>(sizes_array, "sizes");
  auto documents = input_span<int32_t>(document_index_array, "document_index");
  if (documents.empty()) fail_value("document_index must not be empty");
  check_sample_index_fits(sample_index, static_cast<int64_t>(documents.size()));
  check_documents(sizes, documents, "document_index");
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
  auto sizes = input_unaligned<int32_t>(sizes_array, "sizes");
  auto indices = input_span<int32_t>(indices_array, "indices");
  if (indices.empty()) fail_value("indices must not be empty");
  check_documents(sizes, indices, "indices");
  auto documents = output_span<int32_t>(document_index_array, "document_index");
  const int64_t expected =
      tokenmill::checked_mul(static_cast<int64_t>(indices.size()), num_epochs,
                             "num_epochs * len(indices)");
  if (static_cast<int64_t>(documents.size()) != expected) {
    fail_value("document_index must have num_epochs * len(indices) = " +
               std::to_string(expected) + " entries, got " + std::to_string(documents.size()));
  }
  const int64_t num_samples = sample_index.shape(0) - 1;
  if (shuffle_index.ndim() != 1 || shuffle_index.shape(0) != num_samples) {
    fail_value("shuffle_index must have num_samples = " + std::to_string(num_samples) +
               " entries");
  }
  check_sample_index_fits(sample_index, expected);
  check_shuffle_index_fits(shuffle_index, num_samples);
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

// One visit per integer token dtype: the shards tokenmill reads store (u)int8/16/32/64.
template <typename Visit>
auto dispatch_tokens(const py::array& tokens, Visit visit) {
  if (tokens.ndim() != 1) fail_value("tokens must be 1-D, got ndim " + std::to_string(tokens.ndim()));
  if (has_dtype<uint16_t>(tokens)) return visit(input_span<uint16_t>(tokens, "tokens"));
  if (has_dtype<uint32_t>(tokens)) return visit(input_span<uint32_t>(tokens, "tokens"));
  if (has_dtype<int32_t>(tokens)) return visit(input_span<int32_t>(tokens, "tokens"));
  if (has_dtype<int64_t>(tokens)) return visit(input_span<int64_t>(tokens, "tokens"));
  if (has_dtype<uint8_t>(tokens)) return visit(input_span<uint8_t>(tokens, "tokens"));
  if (has_dtype<int8_t>(tokens)) return visit(input_span<int8_t>(tokens, "tokens"));
  if (has_dtype<int16_t>(tokens)) return visit(input_span<int16_t>(tokens, "tokens"));
  if (has_dtype<uint64_t>(tokens)) return visit(input_span<uint64_t>(tokens, "tokens"));
  throw py::type_error("tokens must have an integer dtype (u)int8/16/32/64, got " +
                       dtype_name(tokens));
}

// -- packing ------------------------------------------------------------------------------

template <typename T>
py::array_t<T> vector_to_array(std::vector<T>&& values, std::vector<py::ssize_t> shape) {
  // Hand the vector's buffer to numpy without copying; the capsule frees it.
  auto* owned = new std::vector<T>(std::move(values));
  py::capsule owner(owned, [](void* pointer) { delete static_cast<std::vector<T>*>(pointer); });
  return py::array_t<T>(shape, owned->data(), owner);
}

py::tuple plan_packing(const py::array& lengths_array, int64_t row_length, int64_t overlap,
                       int64_t max_pieces_per_row, int64_t window, int64_t max_open_rows,
                       int64_t segment, bool bos_aligned, int num_threads) {
  auto lengths = input_unaligned<int32_t>(lengths_array, "lengths");
  if (row_length < 2) fail_value("sequence_length must be >= 2, got " + std::to_string(row_length));
  if (overlap < 0 || 2 * overlap > row_length) {
    fail_value("window_overlap must be in [0, sequence_length / 2], got " +
               std::to_string(overlap));
  }
  if (max_pieces_per_row < 1) {
    fail_value("max_documents_per_row must be >= 1, got " + std::to_string(max_pieces_per_row));
  }
  if (window < 1) fail_value("planning_window must be >= 1, got " + std::to_string(window));
  if (max_open_rows < 1) fail_value("max_open_rows must be >= 1, got " + std::to_string(max_open_rows));
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 0) {
      throw py::value_error("lengths[" + std::to_string(i) + "] = " + std::to_string(lengths[i]) +
                            " is negative");
    }
  }
  tokenmill::PackingOptions options;
  options.row_length = row_length;
  options.overlap = overlap;
  options.max_pieces_per_row = max_pieces_per_row;
  options.window = window;
  options.max_open_rows = max_open_rows;
  options.segment = segment;
  options.bos_aligned = bos_aligned;
  options.num_threads = num_threads;
  tokenmill::PackingPlan plan;
  {
    py::gil_scoped_release release;  // reads the caller's lengths buffer, writes C++ vectors
    plan = tokenmill::plan_packing(lengths, options);
  }
  const auto entries = static_cast<py::ssize_t>(plan.entries.size() / 5);
  const auto rows = static_cast<py::ssize_t>(plan.row_offsets.size());
  return py::make_tuple(vector_to_array(std::move(plan.entries), {entries, 5}),
                        vector_to_array(std::move(plan.row_offsets), {rows}), plan.padding,
                        plan.inserted_bos);
}

void gather_packed_rows(const py::array& entries_array, const py::array& row_offsets_array,
                        const py::array& rows_array, const py::array& pointers_array,
                        const py::array& lengths_array, const py::array& tokens_array,
                        int64_t row_length, int64_t max_pieces_per_row, int64_t bos, int64_t pad,
                        int64_t ignore, bool reset_positions, py::array input_ids,
                        py::array labels, py::array position_ids, py::array doc_ids,
                        py::array cu_seqlens) {
  auto entries = input_span<int64_t>(entries_array, "entries");
  auto row_offsets = input_span<int64_t>(row_offsets_array, "row_offsets");
  auto rows = input_span<int64_t>(rows_array, "rows");
  auto pointers = input_unaligned<int64_t>(pointers_array, "sequence_pointers");
  auto lengths = input_unaligned<int32_t>(lengths_array, "sequence_lengths");
  if (pointers.size() != lengths.size()) {
    fail_value("sequence_pointers and sequence_lengths must have the same length");
  }
  if (row_length < 1 || max_pieces_per_row < 1) fail_value("row_length and max_pieces_per_row must be >= 1");
  const auto batch = static_cast<int64_t>(rows.size());
  auto check = [&](const py::array& array, int64_t width, const char* name) {
    if (array.ndim() != 2 || array.shape(0) != batch || array.shape(1) != width) {
      fail_value(std::string(name) + " must have shape [" + std::to_string(batch) + ", " +
                 std::to_string(width) + "]");
    }
  };
  check(input_ids, row_length, "input_ids");
  check(labels, row_length, "labels");
  check(position_ids, row_length, "position_ids");
  check(doc_ids, row_length, "doc_ids");
  check(cu_seqlens, max_pieces_per_row + 1, "cu_seqlens");
  tokenmill::PackedRowOptions options;
  options.row_length = row_length;
  options.max_pieces_per_row = max_pieces_per_row;
  options.bos = bos;
  options.pad = pad;
  options.ignore = ignore;
  options.reset_positions = reset_positions;
  auto ids = output_span<int64_t>(input_ids, "input_ids");
  auto targets = output_span<int64_t>(labels, "labels");
  auto positions = output_span<int64_t>(position_ids, "position_ids");
  auto documents = output_span<int32_t>(doc_ids, "doc_ids");
  auto bounds = output_span<int32_t>(cu_seqlens, "cu_seqlens");
  auto run = [&](auto token_span) {
    try {
      py::gil_scoped_release release;  // every buffer is owned by the caller for the call
      tokenmill::gather_packed_rows(entries, row_offsets, rows, pointers, lengths, token_span,
                                    options, ids, targets, positions, documents, bounds);
    } catch (const std::out_of_range& error) {
      throw py::index_error(error.what());
    }
  };
  dispatch_tokens(tokens_array, [&](auto token_span) {
    using T = typename decltype(token_span)::element_type;
    if constexpr (std::is_same_v<std::remove_const_t<T>, uint64_t>) {
      throw py::type_error("tokens must be (u)int8/16, (u)int32 or int64, got uint64");
    } else {
      run(token_span);
    }
  });
}

// ---- sample gathering (GPTDataset.__getitem__ / __getitems__) ------------------------------

// A dataset's index arrays and token buffer, checked once, kept alive for the gathers.
class Gatherer {
 public:
  Gatherer(py::array shuffle_index, py::array sample_index, py::array document_index,
           py::array sequence_pointers, py::array sequence_lengths, py::array tokens,
           int64_t sequence_length, int64_t extra_token, int64_t eod, int64_t pad,
           bool eod_mask_loss, bool reset_position_ids, bool inter_document_masking)
      : shuffle_(std::move(shuffle_index)),
        sample_(std::move(sample_index)),
        document_(std::move(document_index)),
        pointers_(std::move(sequence_pointers)),
        lengths_(std::move(sequence_lengths)),
        tokens_(std::move(tokens)) {
    check_sequence(sequence_length, extra_token);
    check_sample_index_shape(sample_);
    if (shuffle_.ndim() != 1 || shuffle_.shape(0) != sample_.shape(0) - 1) {
      fail_value("shuffle_index must be 1-D with one entry per sample (" +
                 std::to_string(sample_.shape(0) - 1) + ")");
    }
    shuffle_is_uint32_ = has_dtype<uint32_t>(shuffle_);
    if (shuffle_is_uint32_) {
      shuffle32_ = input_span<uint32_t>(shuffle_, "shuffle_index");
    } else if (has_dtype<int64_t>(shuffle_)) {
      shuffle64_ = input_span<int64_t>(shuffle_, "shuffle_index");
    } else {
      throw py::type_error("shuffle_index must be uint32 or int64, got " + dtype_name(shuffle_));
    }
    sample_is_int32_ = has_dtype<int32_t>(sample_);
    if (sample_is_int32_) {
      sample32_ = input_span<int32_t>(sample_, "sample_index");
    } else if (has_dtype<int64_t>(sample_)) {
      sample64_ = input_span<int64_t>(sample_, "sample_index");
    } else {
      throw py::type_error("sample_index must be int32 or int64, got " + dtype_name(sample_));
    }
    document_span_ = input_span<int32_t>(document_, "document_index");
    pointers_span_ = input_unaligned<int64_t>(pointers_, "sequence_pointers");
    lengths_span_ = input_unaligned<int32_t>(lengths_, "sequence_lengths");
    if (pointers_span_.size() != lengths_span_.size()) {
      fail_value("sequence_pointers and sequence_lengths must have the same length, got " +
                 std::to_string(pointers_span_.size()) + " and " +
                 std::to_string(lengths_span_.size()));
    }
    if (tokens_.ndim() != 1) fail_value("tokens must be 1-D");
    if (!(tokens_.flags() & py::array::c_style)) throw py::type_error("tokens must be C-contiguous");
    if (has_dtype<uint16_t>(tokens_)) {
      token_kind_ = TokenKind::kUint16;
    } else if (has_dtype<int32_t>(tokens_)) {
      token_kind_ = TokenKind::kInt32;
    } else if (has_dtype<uint8_t>(tokens_)) {
      token_kind_ = TokenKind::kUint8;
    } else if (has_dtype<int8_t>(tokens_)) {
      token_kind_ = TokenKind::kInt8;
    } else if (has_dtype<int16_t>(tokens_)) {
      token_kind_ = TokenKind::kInt16;
    } else if (has_dtype<int64_t>(tokens_)) {
      token_kind_ = TokenKind::kInt64;
    } else {
      throw py::type_error("tokens must be an integer dtype (uint8, int8, int16, uint16, int32 or "
                           "int64), got " + dtype_name(tokens_));
    }
    options_.sequence_length = sequence_length;
    options_.extra_token = extra_token;
    options_.eod = eod;
    options_.pad = pad;
    options_.eod_mask_loss = eod_mask_loss;
    options_.reset_position_ids = reset_position_ids;
    options_.inter_document_masking = inter_document_masking;
  }

  int64_t size() const { return shuffle_.shape(0); }

  void gather(const py::array& indices_array, const py::object& rows_object, py::array tokens,
              py::array labels, py::array loss_mask, const py::object& position_ids,
              const py::object& document_starts, const py::object& cu_seqlens,
              const py::object& max_seqlen, int num_threads) const {
    if (num_threads < 1) fail_value("num_threads must be >= 1, got " + std::to_string(num_threads));
    run(input_span<int64_t>(indices_array, "indices"), rows_object, std::move(tokens),
        std::move(labels), std::move(loss_mask), position_ids, document_starts, cu_seqlens,
        max_seqlen, num_threads);
  }

  void gather_one(int64_t index, py::array tokens, py::array labels, py::array loss_mask,
                  const py::object& position_ids, const py::object& document_starts,
                  const py::object& cu_seqlens, const py::object& max_seqlen) const {
    run(std::span<const int64_t>(&index, 1), py::none(), std::move(tokens), std::move(labels),
        std::move(loss_mask), position_ids, document_starts, cu_seqlens, max_seqlen, 1);
  }

 private:
  void run(std::span<const int64_t> indices, const py::object& rows_object, py::array tokens,
           py::array labels, py::array loss_mask, const py::object& position_ids,
           const py::object& document_starts, const py::object& cu_seqlens,
           const py::object& max_seqlen, int num_threads) const {
    const int64_t S = options_.sequence_length;
    tokenmill::GatherOptions options = options_;
    options.num_threads = num_threads;
    std::span<const int64_t> rows;
    py::array rows_array;
    const auto out_rows = static_cast<size_t>(tokens.size() / (S > 0 ? S : 1));
    if (!rows_object.is_none()) {
      rows_array = rows_object.cast<py::array>();
      rows = input_span<int64_t>(rows_array, "rows");
      if (rows.size() != indices.size()) {
        fail_value("rows must have one entry per index (" + std::to_string(indices.size()) +
                   "), got " + std::to_string(rows.size()));
      }
      for (int64_t row : rows) {
        if (row < 0 || static_cast<size_t>(row) >= out_rows) {
          throw py::index_error("row " + std::to_string(row) + " is outside the " +
                                std::to_string(out_rows) + " output rows");
        }
      }
    } else if (indices.size() > out_rows) {
      fail_value("outputs have " + std::to_string(out_rows) + " rows for " +
                 std::to_string(indices.size()) + " indices");
    }
    const auto cells = static_cast<int64_t>(out_rows) * S;
    auto check_size = [&](const py::array& array, int64_t expected, const char* name) {
      if (array.size() != expected) {
        fail_value(std::string(name) + " must have " + std::to_string(expected) +
                   " elements, got " + std::to_string(array.size()));
      }
    };
    if (tokens.size() != cells) {
      fail_value("tokens must have a multiple of sequence_length = " + std::to_string(S) +
                 " elements, got " + std::to_string(tokens.size()));
    }
    check_size(labels, cells, "labels");
    check_size(loss_mask, cells, "loss_mask");
    auto loss = output_span<float>(loss_mask, "loss_mask");
    py::array positions_array, starts_array, cu_array, max_array;
    std::span<int64_t> positions, starts;
    std::span<int32_t> cu, widest;
    if (!position_ids.is_none()) {
      positions_array = position_ids.cast<py::array>();
      check_size(positions_array, cells, "position_ids");
      positions = output_span<int64_t>(positions_array, "position_ids");
    }
    if (!document_starts.is_none()) {
      starts_array = document_starts.cast<py::array>();
      check_size(starts_array, cells, "document_starts");
      starts = output_span<int64_t>(starts_array, "document_starts");
    }
    if (!cu_seqlens.is_none()) {
      cu_array = cu_seqlens.cast<py::array>();
      check_size(cu_array, static_cast<int64_t>(out_rows) * (S + 1), "cu_seqlens");
      cu = output_span<int32_t>(cu_array, "cu_seqlens");
    }
    if (!max_seqlen.is_none()) {
      max_array = max_seqlen.cast<py::array>();
      check_size(max_array, static_cast<int64_t>(out_rows), "max_seqlen");
      widest = output_span<int32_t>(max_array, "max_seqlen");
    }
    if (options_.inter_document_masking && (cu.empty() || widest.empty())) {
      fail_value("inter_document_masking needs cu_seqlens and max_seqlen outputs");
    }

    std::vector<int64_t> bounds(4 * indices.size());
    auto with_out = [&](auto token_span, auto out_tag) {
      using OutT = decltype(out_tag);
      tokenmill::GatherOutputs<OutT> outputs;
      outputs.tokens = output_span<OutT>(tokens, "tokens");
      outputs.labels = output_span<OutT>(labels, "labels");
      outputs.loss_mask = loss;
      outputs.position_ids = positions;
      outputs.document_starts = starts;
      outputs.cu_seqlens = cu;
      outputs.max_seqlen = widest;
      // Safe without the GIL: every buffer is owned by this object or the caller for the call.
      py::gil_scoped_release release;
      resolve(indices, bounds);
      tokenmill::gather_samples(std::span<const int64_t>(bounds), document_span_, pointers_span_,
                                lengths_span_, token_span, rows, options, outputs);
    };
    auto with_tokens = [&](auto token_span) {
      using TokenT = typename decltype(token_span)::value_type;
      using Plain = std::remove_const_t<TokenT>;
      if (has_dtype<int64_t>(tokens)) {
        with_out(token_span, int64_t{});
      } else if (has_dtype<int32_t>(tokens)) {
        with_out(token_span, int32_t{});
      } else if constexpr (sizeof(Plain) <= 2) {
        if (has_dtype<Plain>(tokens)) {
          with_out(token_span, Plain{});
          return;
        }
        throw py::type_error("outputs must be int64, int32 or the storage dtype, got " +
                             dtype_name(tokens));
      } else {
        throw py::type_error("outputs must be int64, int32 or the storage dtype, got " +
                             dtype_name(tokens));
      }
    };
    switch (token_kind_) {
      case TokenKind::kUint16:
        with_tokens(input_span<uint16_t>(tokens_, "tokens"));
        break;
      case TokenKind::kInt32:
        with_tokens(input_span<int32_t>(tokens_, "tokens"));
        break;
      case TokenKind::kUint8:
        with_tokens(input_span<uint8_t>(tokens_, "tokens"));
        break;
      case TokenKind::kInt8:
        with_tokens(input_span<int8_t>(tokens_, "tokens"));
        break;
      case TokenKind::kInt16:
        with_tokens(input_span<int16_t>(tokens_, "tokens"));
        break;
      case TokenKind::kInt64:
        with_tokens(input_span<int64_t>(tokens_, "tokens"));
        break;
    }
  }

  // Runs without the GIL: uses only the flags and pointers taken in the constructor.
  void resolve(std::span<const int64_t> indices, std::vector<int64_t>& bounds) const {
    auto run = [&](auto order) {
      if (sample_is_int32_) {
        tokenmill::resolve_samples(order, std::span<const int32_t>(sample32_), indices,
                                   std::span<int64_t>(bounds));
      } else {
        tokenmill::resolve_samples(order, std::span<const int64_t>(sample64_), indices,
                                   std::span<int64_t>(bounds));
      }
    };
    if (shuffle_is_uint32_) {
      run(shuffle32_);
    } else {
      run(shuffle64_);
    }
  }

  py::array shuffle_, sample_, document_, pointers_, lengths_, tokens_;
  enum class TokenKind { kUint8, kInt8, kInt16, kUint16, kInt32, kInt64 };
  TokenKind token_kind_ = TokenKind::kUint16;
  bool shuffle_is_uint32_ = false;
  bool sample_is_int32_ = false;
  std::span<const uint32_t> shuffle32_;
  std::span<const int64_t> shuffle64_;
  std::span<const int32_t> sample32_;
  std::span<const int64_t> sample64_;
  std::span<const int32_t> document_span_;
  tokenmill::UnalignedSpan<int64_t> pointers_span_;
  tokenmill::UnalignedSpan<int32_t> lengths_span_;
  tokenmill::GatherOptions options_;
};

}  // namespace

// ---- token scan (find_token_positions / count_token) ---------------------------------------
namespace {

// The token id as T, or nothing when T cannot hold it (then no element can equal it, which is
// what numpy's `tokens == token` gives for an out-of-range Python int).
template <typename T>
std::optional<T> token_as(const py::int_& token) {
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(token.ptr(), &overflow);
  if (overflow == 0 && value == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow < 0) return std::nullopt;
  if (overflow > 0) {
    const unsigned long long big = PyLong_AsUnsignedLongLong(token.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return std::nullopt;
    }
    if (!std::in_range<T>(big)) return std::nullopt;
    return static_cast<T>(big);
  }
  if (!std::in_range<T>(value)) return std::nullopt;
  return static_cast<T>(value);
}

py::array_t<int64_t> positions_array(std::vector<int64_t>&& positions) {
  // Hand the vector to numpy without a copy; the capsule frees it with the array.
  auto* owned = new std::vector<int64_t>(std::move(positions));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  return py::array_t<int64_t>({static_cast<py::ssize_t>(owned->size())}, owned->data(), owner);
}


py::array_t<int64_t> find_token_positions(const py::array& tokens, const py::int_& token,
                                          int num_threads) {
  return dispatch_tokens(tokens, [&](auto span) {
    using T = std::remove_const_t<typename decltype(span)::element_type>;
    const auto value = token_as<T>(token);
    std::vector<int64_t> positions;
    if (value) {
      py::gil_scoped_release release;  // read-only scan of a buffer the caller keeps alive
      positions = tokenmill::find_token_positions(span, *value, num_threads);
    }
    return positions_array(std::move(positions));
  });
}

int64_t count_token(const py::array& tokens, const py::int_& token, int num_threads) {
  return dispatch_tokens(tokens, [&](auto span) -> int64_t {
    using T = std::remove_const_t<typename decltype(span)::element_type>;
    const auto value = token_as<T>(token);
    if (!value) return 0;
    py::gil_scoped_release release;  // read-only scan of a buffer the caller keeps alive
    return tokenmill::count_token(span, *value, num_threads);
  });
}

void register_token_scan(py::module_& m) {
  m.def("find_token_positions", &find_token_positions, "tokens"_a.noconvert(), "token"_a,
        "num_threads"_a = 1,
        "Positions (int64, ascending) where tokens == token: numpy.flatnonzero(tokens == token).");
  m.def("count_token", &count_token, "tokens"_a.noconvert(), "token"_a, "num_threads"_a = 1,
        "Number of positions where tokens == token.");
}

}  // namespace
// ---- end token scan -------------------------------------------------------------------------

// ---- mixtures: Philox4x64-10 and chunk sources ------------------------------------------------
namespace {

// A sequence of `size` Python ints, each in [0, 2^64).
template <size_t size>
std::array<uint64_t, size> words(const py::sequence& values, const char* what) {
  if (values.size() != size) {
    throw std::invalid_argument(std::string(what) + " must have " + std::to_string(size) +
                                " words, got " + std::to_string(values.size()));
  }
  std::array<uint64_t, size> result{};
  for (size_t i = 0; i < size; ++i) {
    const py::object value = values[i];
    if (!PyLong_Check(value.ptr())) {
      throw py::type_error(std::string(what) + " word " + std::to_string(i) +
                           " must be an int, got " + std::string(py::str(py::type::of(value))));
    }
    const unsigned long long word = PyLong_AsUnsignedLongLong(value.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      throw std::invalid_argument(std::string(what) + " word " + std::to_string(i) +
                                  " must be in [0, 2^64), got " + std::string(py::str(value)));
    }
    result[i] = static_cast<uint64_t>(word);
  }
  return result;
}

py::tuple philox_block(const py::sequence& counter, const py::sequence& key) {
  const auto block = tokenmill::philox4x64_10(words<4>(counter, "counter"), words<2>(key, "key"));
  return py::make_tuple(block[0], block[1], block[2], block[3]);
}

void draw_chunk_sources(const py::array_t<uint64_t, py::array::c_style>& thresholds,
                        const py::sequence& key, uint64_t stream, uint64_t draw,
                        uint64_t first_chunk, py::array_t<int32_t, py::array::c_style>& out) {
  if (thresholds.ndim() != 1 || thresholds.shape(0) < 1) {
    throw std::invalid_argument("thresholds must be a non-empty 1-D uint64 array");
  }
  if (out.ndim() != 1) throw std::invalid_argument("out must be a 1-D int32 array");
  if (!out.writeable()) throw std::invalid_argument("out must be writeable");
  const std::span<const uint64_t> limits(thresholds.data(),
                                         static_cast<size_t>(thresholds.shape(0)));
  for (size_t i = 1; i < limits.size(); ++i) {
    if (limits[i] < limits[i - 1]) {
      throw std::invalid_argument("thresholds must be non-decreasing, got " +
                                  std::to_string(limits[i]) + " after " +
                                  std::to_string(limits[i - 1]));
    }
  }
  if (limits.back() != (uint64_t{1} << 53)) {
    throw std::invalid_argument("the last threshold must be 2^53, got " +
                                std::to_string(limits.back()));
  }
  const std::span<int32_t> chunks(out.mutable_data(), static_cast<size_t>(out.shape(0)));
  const tokenmill::PhiloxKey philox_key = words<2>(key, "key");
  py::gil_scoped_release release;  // pure arithmetic over buffers the caller keeps alive
  tokenmill::draw_chunk_sources(limits, philox_key, stream, draw, first_chunk, chunks);
}

void register_philox(py::module_& m) {
  m.def("philox_block", &philox_block, "counter"_a, "key"_a,
        "The Philox4x64-10 block (4 uint64 words) of a 4-word counter under a 2-word key, "
        "bit-identical to numpy.random.Philox.");
  m.def("draw_chunk_sources", &draw_chunk_sources, "thresholds"_a.noconvert(), "key"_a,
        "stream"_a, "draw"_a, "first_chunk"_a, "out"_a.noconvert(),
        "out[i] = first s with (Philox(first_chunk + i, stream, draw, 0)[0] >> 11) < "
        "thresholds[s].");
}

}  // namespace
// ---- end mixtures ------------------------------------------------------------------------------

// ---- text packing (the tokenize pipeline's fast path) -----------------------------------------
namespace {

// A read-only byte view of a bytes object or any 1-byte, C-contiguous buffer (numpy uint8).
std::span<const uint8_t> byte_span(const py::buffer_info& info, const char* name) {
  if (info.itemsize != 1 || info.ndim > 1 ||
      (info.ndim == 1 && info.strides[0] != 1 && info.shape[0] > 1)) {
    throw py::type_error(std::string(name) + " must be bytes or a contiguous 1-byte buffer");
  }
  return {static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size)};
}

// Runs `pack` into a bytes object of `capacity` bytes (the GIL released: the object is not
// shared yet) and shrinks it to what was written. Returns (packed, lengths int64, failed).
template <typename Pack>
py::tuple run_pack(size_t capacity, Pack&& pack) {
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<py::ssize_t>(capacity));
  if (raw == nullptr) throw py::error_already_set();
  auto* lengths = new std::vector<int64_t>();
  py::capsule owner(lengths, [](void* pointer) { delete static_cast<std::vector<int64_t>*>(pointer); });
  tokenmill::PackResult result;
  {
    py::gil_scoped_release release;
    std::span<uint8_t> out(reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(raw)), capacity);
    result = pack(out, *lengths);
  }
  if (_PyBytes_Resize(&raw, static_cast<py::ssize_t>(result.written)) != 0) {
    throw py::error_already_set();
  }
  py::bytes packed = py::reinterpret_steal<py::bytes>(raw);
  py::array_t<int64_t> lengths_array({static_cast<py::ssize_t>(lengths->size())},
                                     lengths->data(), owner);
  return py::make_tuple(packed, lengths_array, result.failed);
}

py::tuple pack_jsonl_field(const py::buffer& data, const std::string& key) {
  const py::buffer_info info = data.request();
  const auto input = byte_span(info, "data");
  return run_pack(input.size(), [&](std::span<uint8_t> out, std::vector<int64_t>& lengths) {
    return tokenmill::pack_jsonl_field(input, key, out, lengths);
  });
}

py::tuple pack_lines(const py::buffer& data) {
  const py::buffer_info info = data.request();
  const auto input = byte_span(info, "data");
  return run_pack(input.size() + 1, [&](std::span<uint8_t> out, std::vector<int64_t>& lengths) {
    return tokenmill::pack_lines(input, out, lengths);
  });
}

py::tuple pack_documents(const py::buffer& data, const py::array& offsets) {
  const py::buffer_info info = data.request();
  const auto input = byte_span(info, "data");
  const auto bounds = input_span<int64_t>(offsets, "offsets");
  if (!bounds.empty()) {
    if (bounds.front() < 0 || bounds.back() > static_cast<int64_t>(input.size())) {
      fail_value("offsets must lie in [0, " + std::to_string(input.size()) + "], got [" +
                 std::to_string(bounds.front()) + ", " + std::to_string(bounds.back()) + "]");
    }
    for (size_t i = 1; i < bounds.size(); ++i) {
      if (bounds[i] < bounds[i - 1]) {
        fail_value("offsets must be non-decreasing, got " + std::to_string(bounds[i - 1]) +
                   " then " + std::to_string(bounds[i]) + " at " + std::to_string(i));
      }
    }
  }
  const size_t documents = bounds.empty() ? 0 : bounds.size() - 1;
  return run_pack(input.size() + documents,
                  [&](std::span<uint8_t> out, std::vector<int64_t>& lengths) {
                    return tokenmill::pack_documents(input, bounds, out, lengths);
                  });
}

py::array_t<int64_t> find_code_points(const py::buffer& packed, const py::array& ranges) {
  const py::buffer_info info = packed.request();
  const auto input = byte_span(info, "packed");
  const auto bounds = input_span<uint32_t>(ranges, "ranges");
  if (bounds.size() % 2 != 0) fail_value("ranges must hold (first, last) pairs");
  for (size_t i = 0; i < bounds.size(); i += 2) {
    if (bounds[i] < 0x800 || bounds[i] > bounds[i + 1] || (i > 0 && bounds[i] <= bounds[i - 1])) {
      fail_value("ranges must be sorted, disjoint and >= U+0800; pair " + std::to_string(i / 2) +
                 " is [" + std::to_string(bounds[i]) + ", " + std::to_string(bounds[i + 1]) + "]");
    }
  }
  std::vector<int64_t> positions;
  {
    py::gil_scoped_release release;  // read-only scan of buffers the caller keeps alive
    positions = tokenmill::find_code_points(input, bounds);
  }
  return positions_array(std::move(positions));
}

void register_text_pack(py::module_& m) {
  m.def("pack_jsonl_field", &pack_jsonl_field, "data"_a, "key"_a,
        "JSON Lines to packed documents: (packed bytes, lengths int64, failed line or -1).");
  m.def("pack_lines", &pack_lines, "data"_a,
        "Text lines to packed documents: (packed bytes, lengths int64, failed line or -1).");
  m.def("pack_documents", &pack_documents, "data"_a, "offsets"_a.noconvert(),
        "Documents data[offsets[i]:offsets[i+1]] to packed documents: (packed bytes, lengths "
        "int64, failed document or -1).");
  m.def("find_code_points", &find_code_points, "packed"_a, "ranges"_a.noconvert(),
        "Byte positions (int64) of code points inside the (first, last) uint32 ranges.");
}

}  // namespace
// ---- end text packing --------------------------------------------------------------------------

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
        "path"_a = "auto", "window"_a = 0, "margin"_a = -1.0, "block"_a = 0, "threads"_a = 0,
        "guess_zero"_a = false,
        "Greedy blending indices (megatron-core's build_blending_indices). threads: 0 for the "
        "CPU count; path, window, margin, block and guess_zero are a test hook: they choose the "
        "kernel, never the result.");
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices,
        "sizes"_a.noconvert(), "dataset_index"_a.noconvert(),
        "dataset_sample_index"_a.noconvert(), py::kw_only(), "path"_a = "auto", "window"_a = 0,
        "margin"_a = -1.0, "block"_a = 0, "threads"_a = 0, "guess_zero"_a = false,
        "Exhaustive blending indices (megatron-core's build_exhaustive_blending_indices). "
        "threads: 0 for the CPU count; path, window, margin, block and guess_zero are a test "
        "hook: they choose the kernel, never the result.");
  m.def("plan_packing", &plan_packing, "lengths"_a.noconvert(), "row_length"_a, "overlap"_a,
        "max_pieces_per_row"_a, "window"_a, "max_open_rows"_a, "segment"_a, "bos_aligned"_a,
        "num_threads"_a = 1,
        "Packing plan: (entries [E, 5] int64, row_offsets [R + 1] int64, padding, inserted_bos).");
  m.def("gather_packed_rows", &gather_packed_rows, "entries"_a.noconvert(),
        "row_offsets"_a.noconvert(), "rows"_a.noconvert(), "sequence_pointers"_a.noconvert(),
        "sequence_lengths"_a.noconvert(), "tokens"_a.noconvert(), "row_length"_a,
        "max_pieces_per_row"_a, "bos"_a, "pad"_a, "ignore"_a, "reset_positions"_a,
        "input_ids"_a.noconvert(), "labels"_a.noconvert(), "position_ids"_a.noconvert(),
        "doc_ids"_a.noconvert(), "cu_seqlens"_a.noconvert(),
        "Fill packed rows (input_ids, labels, position_ids, doc_ids, cu_seqlens) of a plan.");
  register_token_scan(m);  // token scan block above
  register_philox(m);  // mixtures block above
  register_text_pack(m);  // text packing block above

  py::class_<Gatherer>(m, "Gatherer",
                       "A GPTDataset's index arrays and token buffer, for batched gathers.")
      .def(py::init<py::array, py::array, py::array, py::array, py::array, py::array, int64_t,
                    int64_t, int64_t, int64_t, bool, bool, bool>(),
           "shuffle_index"_a.noconvert(), "sample_index"_a.noconvert(),
           "document_index"_a.noconvert(), "sequence_pointers"_a.noconvert(),
           "sequence_lengths"_a.noconvert(), "tokens"_a.noconvert(), "sequence_length"_a,
           "extra_token"_a, "eod"_a, "pad"_a, "eod_mask_loss"_a, "reset_position_ids"_a,
           "inter_document_masking"_a)
      .def("__len__", &Gatherer::size)
      .def("gather", &Gatherer::gather, "indices"_a.noconvert(), "rows"_a, "tokens"_a.noconvert(),
           "labels"_a.noconvert(), "loss_mask"_a.noconvert(), "position_ids"_a,
           "document_starts"_a, "cu_seqlens"_a, "max_seqlen"_a, "num_threads"_a = 1,
           "Gather samples `indices` into rows `rows` (None: 0..B-1) of the outputs, with the GIL "
           "released, split over `num_threads` threads.")
      .def("gather_one", &Gatherer::gather_one, "index"_a, "tokens"_a.noconvert(),
           "labels"_a.noconvert(), "loss_mask"_a.noconvert(), "position_ids"_a,
           "document_starts"_a, "cu_seqlens"_a, "max_seqlen"_a,
           "Gather one sample into 1-row outputs (gather() without the index array).");
}
