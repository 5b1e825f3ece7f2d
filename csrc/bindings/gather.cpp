// Bindings of the sample gather (GPTDataset.__getitem__ / __getitems__): a Gatherer holds a
// dataset's index arrays and token buffer, checked once, and fills caller-owned batch buffers
// with the GIL released.
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../gather.hpp"
#include "arrays.hpp"
#include "bindings.hpp"

namespace tokenmill::bindings {
namespace {

using namespace pybind11::literals;

// The outputs of one gather call, checked against the batch shape. The arrays are kept here so
// the spans stay valid while the GIL is released. (Optional ones are held as py::object: a
// default-constructed py::array allocates an empty numpy array, which a small gather notices.)
struct BatchOutputs {
  py::array tokens, labels, loss_mask;
  py::object position_ids, document_starts, cu_seqlens, max_seqlen;
  size_t rows = 0;  // output rows (>= the number of samples gathered)
  std::span<float> loss;
  std::span<int64_t> positions, starts;
  std::span<int32_t> cu, widest;
};

// An optional output (None: not filled) with `expected` elements of type T.
template <typename T>
std::span<T> optional_output(const py::object& object, int64_t expected, const char* name,
                             py::object& keep) {
  if (object.is_none()) return {};
  auto array = object.cast<py::array>();
  if (array.size() != expected) {
    fail_value(std::string(name) + " must have " + std::to_string(expected) + " elements, got " +
               std::to_string(array.size()));
  }
  const std::span<T> span = output_span<T>(array, name);
  keep = std::move(array);
  return span;
}

BatchOutputs check_outputs(int64_t sequence_length, bool inter_document_masking, py::array tokens,
                           py::array labels, py::array loss_mask, const py::object& position_ids,
                           const py::object& document_starts, const py::object& cu_seqlens,
                           const py::object& max_seqlen) {
  const int64_t S = sequence_length;
  const auto rows = static_cast<size_t>(tokens.size() / S);
  const auto cells = static_cast<int64_t>(rows) * S;
  if (tokens.size() != cells) {
    fail_value("tokens must have a multiple of sequence_length = " + std::to_string(S) +
               " elements, got " + std::to_string(tokens.size()));
  }
  for (auto [array, name] : {std::pair{&labels, "labels"}, std::pair{&loss_mask, "loss_mask"}}) {
    if (array->size() != cells) {
      fail_value(std::string(name) + " must have " + std::to_string(cells) + " elements, got " +
                 std::to_string(array->size()));
    }
  }
  BatchOutputs out{std::move(tokens), std::move(labels), std::move(loss_mask), {}, {}, {}, {},
                   rows, {}, {}, {}, {}, {}};
  out.loss = output_span<float>(out.loss_mask, "loss_mask");
  const auto count = static_cast<int64_t>(rows);
  out.positions = optional_output<int64_t>(position_ids, cells, "position_ids", out.position_ids);
  out.starts =
      optional_output<int64_t>(document_starts, cells, "document_starts", out.document_starts);
  out.cu = optional_output<int32_t>(cu_seqlens, count * (S + 1), "cu_seqlens", out.cu_seqlens);
  out.widest = optional_output<int32_t>(max_seqlen, count, "max_seqlen", out.max_seqlen);
  if (inter_document_masking && (out.cu.empty() || out.widest.empty())) {
    fail_value("inter_document_masking needs cu_seqlens and max_seqlen outputs");
  }
  return out;
}

// The output row of each sample (None: 0, 1, ...), checked against the outputs.
std::span<const int64_t> check_rows(const py::object& rows_object, size_t samples,
                                    size_t out_rows, py::object& keep) {
  if (rows_object.is_none()) {
    if (samples > out_rows) {
      fail_value("outputs have " + std::to_string(out_rows) + " rows for " +
                 std::to_string(samples) + " indices");
    }
    return {};
  }
  auto array = rows_object.cast<py::array>();
  const auto rows = input_span<int64_t>(array, "rows");
  keep = std::move(array);
  if (rows.size() != samples) {
    fail_value("rows must have one entry per index (" + std::to_string(samples) + "), got " +
               std::to_string(rows.size()));
  }
  for (const int64_t row : rows) {
    if (row < 0 || static_cast<size_t>(row) >= out_rows) {
      throw py::index_error("row " + std::to_string(row) + " is outside the " +
                            std::to_string(out_rows) + " output rows");
    }
  }
  return rows;
}

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
    py::object rows_array;
    const auto out_rows = static_cast<size_t>(tokens.size() / options_.sequence_length);
    const std::span<const int64_t> rows =
        check_rows(rows_object, indices.size(), out_rows, rows_array);
    BatchOutputs out = check_outputs(options_.sequence_length, options_.inter_document_masking,
                                     std::move(tokens), std::move(labels), std::move(loss_mask),
                                     position_ids, document_starts, cu_seqlens, max_seqlen);
    tokenmill::GatherOptions options = options_;
    options.num_threads = num_threads;
    switch (token_kind_) {
      case TokenKind::kUint16:
        gather_tokens(input_span<uint16_t>(tokens_, "tokens"), indices, rows, out, options);
        break;
      case TokenKind::kInt32:
        gather_tokens(input_span<int32_t>(tokens_, "tokens"), indices, rows, out, options);
        break;
      case TokenKind::kUint8:
        gather_tokens(input_span<uint8_t>(tokens_, "tokens"), indices, rows, out, options);
        break;
      case TokenKind::kInt8:
        gather_tokens(input_span<int8_t>(tokens_, "tokens"), indices, rows, out, options);
        break;
      case TokenKind::kInt16:
        gather_tokens(input_span<int16_t>(tokens_, "tokens"), indices, rows, out, options);
        break;
      case TokenKind::kInt64:
        gather_tokens(input_span<int64_t>(tokens_, "tokens"), indices, rows, out, options);
        break;
    }
  }

  // The output dtype: int64, int32 or (for tokens stored in 1 or 2 bytes) the storage dtype.
  template <typename TokenT>
  void gather_tokens(std::span<const TokenT> tokens, std::span<const int64_t> indices,
                     std::span<const int64_t> rows, BatchOutputs& out,
                     const tokenmill::GatherOptions& options) const {
    if (has_dtype<int64_t>(out.tokens)) {
      gather_as<TokenT, int64_t>(tokens, indices, rows, out, options);
    } else if (has_dtype<int32_t>(out.tokens)) {
      gather_as<TokenT, int32_t>(tokens, indices, rows, out, options);
    } else if constexpr (sizeof(TokenT) <= 2) {
      if (!has_dtype<TokenT>(out.tokens)) {
        throw py::type_error("outputs must be int64, int32 or the storage dtype, got " +
                             dtype_name(out.tokens));
      }
      gather_as<TokenT, TokenT>(tokens, indices, rows, out, options);
    } else {
      throw py::type_error("outputs must be int64, int32 or the storage dtype, got " +
                           dtype_name(out.tokens));
    }
  }

  template <typename TokenT, typename OutT>
  void gather_as(std::span<const TokenT> tokens, std::span<const int64_t> indices,
                 std::span<const int64_t> rows, BatchOutputs& out,
                 const tokenmill::GatherOptions& options) const {
    tokenmill::GatherOutputs<OutT> outputs;
    outputs.tokens = output_span<OutT>(out.tokens, "tokens");
    outputs.labels = output_span<OutT>(out.labels, "labels");
    outputs.loss_mask = out.loss;
    outputs.position_ids = out.positions;
    outputs.document_starts = out.starts;
    outputs.cu_seqlens = out.cu;
    outputs.max_seqlen = out.widest;
    std::vector<int64_t> bounds(4 * indices.size());
    // Safe without the GIL: every buffer is owned by this object or the caller for the call.
    ReleasedGil release;
    resolve(indices, bounds);
    tokenmill::gather_samples(std::span<const int64_t>(bounds), document_span_, pointers_span_,
                              lengths_span_, tokens, rows, options, outputs);
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
  UnalignedSpan<int64_t> pointers_span_;
  UnalignedSpan<int32_t> lengths_span_;
  tokenmill::GatherOptions options_;
};

}  // namespace

void register_gather(py::module_& m) {
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

}  // namespace tokenmill::bindings
