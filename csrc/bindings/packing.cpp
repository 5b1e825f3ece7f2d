// Bindings of packing: plans (which document pieces fill each row) and the packed-row gather.
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "../packing.hpp"
#include "arrays.hpp"
#include "../fault_guard.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

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
    ReleasedGil release;  // reads the caller's lengths buffer, writes C++ vectors
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
  // The plan comes from a cache file (any alignment; every value checked by the kernel).
  if (entries_array.ndim() != 2 || entries_array.shape(1) != 5) {
    fail_value("entries must have shape [E, 5], got ndim " + std::to_string(entries_array.ndim()));
  }
  if (row_offsets_array.ndim() != 1 || row_offsets_array.shape(0) < 1) {
    fail_value("row_offsets must be 1-D with at least one entry");
  }
  auto entries = input_unaligned<int64_t>(entries_array, "entries");
  auto row_offsets = input_unaligned<int64_t>(row_offsets_array, "row_offsets");
  auto rows = input_span<int64_t>(rows_array, "rows");
  auto pointers = input_unaligned<int64_t>(pointers_array, "sequence_pointers");
  auto lengths = input_unaligned<int32_t>(lengths_array, "sequence_lengths");
  if (pointers.size() != lengths.size()) {
    fail_value("sequence_pointers and sequence_lengths must have the same length");
  }
  // Positions and piece numbers are stored as int32 (cu_seqlens, doc_ids).
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (row_length < 1 || row_length > kInt32Max) {
    fail_value("row_length must be in [1, 2^31 - 1], got " + std::to_string(row_length));
  }
  if (max_pieces_per_row < 1 || max_pieces_per_row >= kInt32Max) {
    fail_value("max_pieces_per_row must be in [1, 2^31 - 2], got " +
               std::to_string(max_pieces_per_row));
  }
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
  dispatch_tokens(tokens_array, [&](auto token_span) {
    using T = typename decltype(token_span)::element_type;
    if constexpr (std::is_same_v<std::remove_const_t<T>, uint64_t>) {
      throw py::type_error("tokens must be (u)int8/16, (u)int32 or int64, got uint64");
    } else {
      ReleasedGil release;  // every buffer is owned by the caller for the call
      // a SIGBUS from the mapped tokens (the .bin shrank) throws MappedReadFault; the kernel
      // owns no memory (fault_guard.hpp)
      tokenmill::guard_mapped_reads([&] {
        tokenmill::gather_packed_rows(entries, row_offsets, rows, pointers, lengths, token_span,
                                      options, ids, targets, positions, documents, bounds);
      });
    }
  });
}

}  // namespace

void register_packing(py::module_& m) {
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
        "Fill packed rows (input_ids, labels, position_ids, doc_ids, cu_seqlens) of a plan. A "
        "corrupt plan raises IndexError naming the field.");
}

}  // namespace tokenmill::bindings
