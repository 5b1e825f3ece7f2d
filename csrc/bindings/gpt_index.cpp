// Bindings of the GPT index build: numpy-exact shuffles, document / sample / shuffle indices
// (megatron-core's GPTDataset), and the sample index alone for tests.
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>

#include "../sample_index.hpp"
#include "../shuffle.hpp"
#include "arrays.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

void check_documents(UnalignedSpan<int32_t> sizes, std::span<const int32_t> documents,
                     const char* name) {
  int64_t bad = -1;
  {
    ReleasedGil release;  // a read-only scan of buffers the caller keeps alive
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
    ReleasedGil release;  // the buffer is owned by the caller for the whole call
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
  ReleasedGil release;  // read-only loop over caller-owned buffers
  return tokenmill::sum_selected_lengths(sizes, indices);
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
    ReleasedGil release;  // buffers are owned by the caller for the whole call
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
    ReleasedGil release;  // buffers are owned by the caller for the whole call
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

}  // namespace

void register_gpt_index(py::module_& m, py::module_& testing) {
  m.def("shuffle_like_numpy", &shuffle_like_numpy, "values"_a.noconvert(), "seed"_a,
        "Shuffle a 1-D int32/uint32/int64 array in place exactly as "
        "numpy.random.RandomState(seed).shuffle would.");
  m.def("sum_selected_lengths", &sum_selected_lengths, "sizes"_a.noconvert(),
        "indices"_a.noconvert(), "Sum of sizes[indices] as a Python int.");
  m.def("build_gpt_indices", &build_gpt_indices, "sizes"_a.noconvert(), "indices"_a.noconvert(),
        "seed"_a, "num_epochs"_a, "separate_final_epoch"_a, "shuffle_split"_a,
        "sequence_length"_a, "extra_token"_a, "document_index"_a.noconvert(),
        "sample_index"_a.noconvert(), "shuffle_index"_a.noconvert(), "num_threads"_a = 1,
        "Fill the document, sample and shuffle indices of a GPTDataset.");
  testing.def("build_sample_index", &build_sample_index, "sizes"_a.noconvert(),
              "document_index"_a.noconvert(), "sequence_length"_a, "extra_token"_a,
              "sample_index"_a.noconvert(), "num_threads"_a = 1,
              "Fill a [num_samples + 1, 2] sample index (megatron-core's build_sample_idx).");
}

}  // namespace tokenmill::bindings
