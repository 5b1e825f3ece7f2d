#include "gather.hpp"

#include "fault_guard.hpp"

#include "common.hpp"
#include "thread_pool.hpp"

#include <algorithm>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace tokenmill {

namespace {

[[noreturn]] void corrupt(const std::string& message) { throw std::out_of_range(message); }

// One document part of a sample: `length` tokens of sequence `sequence` from `offset`.
struct Part {
  int64_t sequence;
  int64_t offset;
  int64_t length;
};

// The parts of the sample with bounds (b_row, b_off, e_row, e_off), exactly as megatron-core's
// _query_document_sample_shuffle_indices asks IndexedDataset.get for them, checked against
// every array so a corrupt index raises instead of reading out of bounds.
template <typename TokenT>
void sample_parts(const int64_t* bound, std::span<const int32_t> document_index,
                  UnalignedSpan<int64_t> pointers, UnalignedSpan<int32_t> lengths,
                  size_t token_count, int64_t extra, int64_t target, std::vector<Part>& parts) {
  parts.clear();
  const int64_t b_row = bound[0], b_off = bound[1], e_row = bound[2], e_off = bound[3];
  const auto documents = static_cast<int64_t>(document_index.size());
  if (b_row < 0 || e_row < b_row || e_row >= documents) {
    corrupt("sample index rows [" + std::to_string(b_row) + ", " + std::to_string(e_row) +
            "] are outside the document index of " + std::to_string(documents) + " entries");
  }
  int64_t total = 0;
  for (int64_t row = b_row; row <= e_row; ++row) {
    const int64_t sequence = document_index[static_cast<size_t>(row)];
    if (sequence < 0 || sequence >= static_cast<int64_t>(lengths.size())) {
      corrupt("document_index[" + std::to_string(row) + "] = " + std::to_string(sequence) +
              " is not a sequence id in [0, " + std::to_string(lengths.size()) + ")");
    }
    const int64_t size = lengths[static_cast<size_t>(sequence)];
    int64_t offset = 0;
    int64_t length = 0;
    // The offsets come from a file (the sample index cache): any int64 is possible, so the
    // arithmetic is checked rather than allowed to wrap.
    bool fits = true;
    if (b_row == e_row) {
      offset = b_off;
      fits = sub_fits(e_off, b_off, length) && add_fits(length, extra, length);
    } else {
      offset = row == b_row ? b_off : 0;
      fits = row < e_row ? sub_fits(size, offset, length) : add_fits(e_off, extra, length);
    }
    if (!fits || offset < 0 || length < 0 || offset > size || length > size - offset) {
      corrupt("sample asks for " + (fits ? std::to_string(length) : std::string("too many")) +
              " tokens from offset " + std::to_string(offset) + " of sequence " +
              std::to_string(sequence) + " of length " + std::to_string(size));
    }
    const int64_t pointer = pointers[static_cast<size_t>(sequence)];
    constexpr auto itemsize = static_cast<int64_t>(sizeof(TokenT));
    // offset + length <= size < 2^31 here; pointer / itemsize may be anything up to 2^63.
    if (pointer < 0 || pointer % itemsize != 0 ||
        offset + length > static_cast<int64_t>(token_count) - pointer / itemsize) {
      corrupt("sequence " + std::to_string(sequence) + " points at byte " +
              std::to_string(pointer) + ", outside the data file or off its item grid");
    }
    total += length;
    if (total > target) {
      corrupt("sample bounds cover " + std::to_string(total) + " tokens, more than " +
              std::to_string(target));
    }
    parts.push_back({sequence, pointer / itemsize + offset, length});
  }
}

template <typename TokenT>
constexpr bool representable(int64_t value) {
  if constexpr (std::is_same_v<TokenT, int64_t>) {
    return true;
  } else {
    return value >= static_cast<int64_t>(std::numeric_limits<TokenT>::min()) &&
           value <= static_cast<int64_t>(std::numeric_limits<TokenT>::max());
  }
}

// megatron-core's cu_seqlens of one sample from its part lengths (see _document_boundaries in
// python/tokenmill/datasets/gpt.py): the extra token leaves the last part, a shortfall (padding)
// joins it, empty parts are dropped only when they would not fit, the rest is padded with S.
void document_boundaries(const std::vector<Part>& parts, int64_t sequence_length, int64_t extra,
                         std::vector<int64_t>& scratch, int32_t* cu_seqlens, int32_t* max_seqlen,
                         int64_t* positions) {
  scratch.clear();
  for (const Part& part : parts) scratch.push_back(part.length);
  if (extra != 0) {
    scratch.back() -= 1;
    if (scratch.back() == 0) scratch.pop_back();
  }
  int64_t sum = 0;
  for (int64_t length : scratch) sum += length;
  const int64_t shortfall = sequence_length - sum;
  if (shortfall > 0) {
    if (scratch.empty()) {
      scratch.push_back(shortfall);
    } else {
      scratch.back() += shortfall;
    }
  }
  // Boundaries in place: 0, then the running sums.
  std::vector<int64_t>& bounds = scratch;
  bounds.insert(bounds.begin(), 0);
  for (size_t i = 1; i < bounds.size(); ++i) bounds[i] += bounds[i - 1];
  if (static_cast<int64_t>(bounds.size()) > sequence_length + 1) {
    bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  }
  int64_t widest = 0;
  for (size_t i = 1; i < bounds.size(); ++i) widest = std::max(widest, bounds[i] - bounds[i - 1]);
  if (max_seqlen != nullptr) *max_seqlen = static_cast<int32_t>(widest);
  if (cu_seqlens != nullptr) {
    size_t i = 0;
    for (; i < bounds.size(); ++i) cu_seqlens[i] = static_cast<int32_t>(bounds[i]);
    for (; i < static_cast<size_t>(sequence_length + 1); ++i) {
      cu_seqlens[i] = static_cast<int32_t>(sequence_length);
    }
  }
  if (positions != nullptr) {
    // position - (largest boundary <= position), as searchsorted(side="right") - 1 gives it.
    size_t next = 1;
    int64_t start = 0;
    for (int64_t p = 0; p < sequence_length; ++p) {
      while (next < bounds.size() && bounds[next] <= p) start = bounds[next++];
      positions[p] = p - start;
    }
  }
}

}  // namespace

template <typename ShuffleT, typename SampleT>
void resolve_samples(std::span<const ShuffleT> shuffle_index, std::span<const SampleT> sample_index,
                     std::span<const int64_t> indices, std::span<int64_t> bounds) {
  const auto samples = static_cast<int64_t>(shuffle_index.size());
  const auto rows = static_cast<int64_t>(sample_index.size() / 2);
  for (size_t i = 0; i < indices.size(); ++i) {
    int64_t index = indices[i];
    if (index < 0) index += samples;
    if (index < 0 || index >= samples) {
      throw std::out_of_range("sample index " + std::to_string(indices[i]) +
                              " is out of range for a dataset of " + std::to_string(samples) +
                              " samples");
    }
    const auto position = static_cast<int64_t>(shuffle_index[static_cast<size_t>(index)]);
    if (position < 0 || position >= rows - 1) {  // (position + 1 could overflow)
      corrupt("shuffle_index[" + std::to_string(index) + "] = " + std::to_string(position) +
              " is outside the sample index of " + std::to_string(rows - 1) + " samples");
    }
    const SampleT* row = sample_index.data() + 2 * position;
    bounds[4 * i + 0] = static_cast<int64_t>(row[0]);
    bounds[4 * i + 1] = static_cast<int64_t>(row[1]);
    bounds[4 * i + 2] = static_cast<int64_t>(row[2]);
    bounds[4 * i + 3] = static_cast<int64_t>(row[3]);
  }
}

namespace {

// The per-sample steps below are forced inline into gather_range, which they were part of: as
// calls (GCC does not inline them by itself) the gather ran 15-20% slower for int64, int32 and
// uint16 outputs (measured: S=2048, B=8, one thread, both builds interleaved in one process).
#define TOKENMILL_GATHER_INLINE [[gnu::always_inline]] inline

// Per-thread state of a gather: scratch buffers allocated on first use and never zero-filled
// (every entry read is written first).
struct GatherScratch {
  std::vector<Part> parts;
  std::unique_ptr<int64_t[]> text;    // the padded sample, S + 1 tokens (general path)
  std::vector<int64_t> boundaries;    // document_boundaries' work list
  std::unique_ptr<int64_t[]> starts;  // first position of each token's document (EOD rule)
};

// Fast path of one sample: every token present and no pad id representable in TokenT, so tokens
// and labels are the widened data shifted by one.
template <typename TokenT, typename OutT>
TOKENMILL_GATHER_INLINE void fill_full_sample(const TokenT* data, const std::vector<Part>& parts,
                      const GatherOptions& options, OutT* out_tokens, OutT* out_labels,
                      float* loss, int64_t* starts) {
  const int64_t S = options.sequence_length;
  const int64_t eod = options.eod;
  int64_t at = 0;
  for (const Part& part : parts) {
    const TokenT* source = data + part.offset;
    // tokens[at + j] = source[j] for at + j < S
    const int64_t token_end = std::min(part.length, S - at);
    for (int64_t j = 0; j < token_end; ++j) {
      out_tokens[at + j] = static_cast<OutT>(static_cast<int64_t>(source[j]));
    }
    // labels[at + j - 1] = source[j] for 0 <= at + j - 1 < S
    const int64_t label_begin = at == 0 ? 1 : 0;
    const int64_t label_end = std::min(part.length, S + 1 - at);
    OutT* labels_at = out_labels + at - 1;
    for (int64_t j = label_begin; j < label_end; ++j) {
      labels_at[j] = static_cast<OutT>(static_cast<int64_t>(source[j]));
    }
    at += part.length;
  }
  if (options.extra_token == 0) {
    // labels[S - 1] is the pad id, replaced by 0; its loss is masked below.
    out_labels[S - 1] = static_cast<OutT>(0);
  }
  std::fill(loss, loss + S, 1.0F);
  if (options.extra_token == 0) loss[S - 1] = 0.0F;
  if (options.eod_mask_loss) {
    for (int64_t p = 0; p < S; ++p) {
      if (static_cast<int64_t>(out_tokens[p]) == eod) loss[p] = 0.0F;
    }
  }
  if (starts != nullptr) {
    int64_t start = 0;
    starts[0] = 0;
    for (int64_t p = 1; p < S; ++p) {
      if (static_cast<int64_t>(out_tokens[p - 1]) == eod) start = p;
      starts[p] = start;
    }
  }
}

// General path of one sample: the padded text in int64 first (`text`: S + 1 entries), then
// megatron's pad rules (a pad token reads as 0 and masks the loss of the position before it).
template <typename TokenT, typename OutT>
TOKENMILL_GATHER_INLINE void fill_padded_sample(const TokenT* data, const std::vector<Part>& parts,
                        const GatherOptions& options, int64_t* text, OutT* out_tokens,
                        OutT* out_labels, float* loss, int64_t* starts) {
  const int64_t S = options.sequence_length;
  const int64_t pad = options.pad;
  const int64_t eod = options.eod;
  int64_t at = 0;
  for (const Part& part : parts) {
    const TokenT* source = data + part.offset;
    for (int64_t j = 0; j < part.length && at + j <= S; ++j) {
      text[at + j] = static_cast<int64_t>(source[j]);
    }
    at += part.length;
  }
  for (int64_t p = std::min(at, S + 1); p <= S; ++p) text[p] = pad;
  if (options.extra_token == 0) text[S] = pad;  // labels[S - 1] = pad
  const bool mask_eod = options.eod_mask_loss;
  for (int64_t p = 0; p < S; ++p) {
    const int64_t a = text[p];
    const int64_t b = text[p + 1];
    out_tokens[p] = static_cast<OutT>(a == pad ? 0 : a);
    out_labels[p] = static_cast<OutT>(b == pad ? 0 : b);
    loss[p] = (b == pad || (mask_eod && a == eod)) ? 0.0F : 1.0F;
  }
  if (starts != nullptr) {
    int64_t start = 0;
    starts[0] = 0;
    for (int64_t p = 1; p < S; ++p) {
      if (text[p - 1] == eod) start = p;
      starts[p] = start;
    }
  }
}

// Position ids, document starts and cu_seqlens / max_seqlen of one sample (batch row `row`),
// from its parts or from the document starts the fill computed.
template <typename OutT>
TOKENMILL_GATHER_INLINE void fill_positions(const GatherOptions& options, const GatherOutputs<OutT>& outputs, size_t row,
                    GatherScratch& scratch) {
  const int64_t S = options.sequence_length;
  const size_t base = row * static_cast<size_t>(S);
  int64_t* positions =
      outputs.position_ids.empty() ? nullptr : outputs.position_ids.data() + base;
  if (options.inter_document_masking) {
    const size_t cu_base = row * static_cast<size_t>(S + 1);
    document_boundaries(
        scratch.parts, S, options.extra_token, scratch.boundaries,
        outputs.cu_seqlens.empty() ? nullptr : outputs.cu_seqlens.data() + cu_base,
        outputs.max_seqlen.empty() ? nullptr : outputs.max_seqlen.data() + row, positions);
    return;
  }
  const int64_t* starts = scratch.starts.get();
  if (positions != nullptr) {
    if (options.reset_position_ids) {
      for (int64_t p = 0; p < S; ++p) positions[p] = p - starts[p];
    } else {
      for (int64_t p = 0; p < S; ++p) positions[p] = p;
    }
  }
  if (!outputs.document_starts.empty()) {
    std::copy(starts, starts + S, outputs.document_starts.data() + base);
  }
}

// Samples [first, last) of the batch (see gather_samples).
template <typename TokenT, typename OutT>
void gather_range(std::span<const int64_t> bounds, std::span<const int32_t> document_index,
                  UnalignedSpan<int64_t> pointers, UnalignedSpan<int32_t> lengths,
                  std::span<const TokenT> tokens, std::span<const int64_t> rows,
                  const GatherOptions& options, const GatherOutputs<OutT>& outputs, size_t first,
                  size_t last) {
  const int64_t S = options.sequence_length;
  const int64_t target = S + options.extra_token;
  const bool pad_is_token = representable<TokenT>(options.pad);
  const bool need_starts = !options.inter_document_masking &&
                           (options.reset_position_ids || !outputs.document_starts.empty());
  GatherScratch scratch;
  scratch.parts.reserve(16);
  if (need_starts) scratch.starts.reset(new int64_t[static_cast<size_t>(S)]);
  int64_t* starts = scratch.starts.get();

  const TokenT* const data_end = tokens.data() + tokens.size();
  // A SIGBUS from the mapped tokens (the .bin shrank) abandons the loop and throws
  // MappedReadFault: the scratch state that owns memory lives in this frame, outside the guard
  // (fault_guard.hpp); the page after each part is probed for a shrink that left a partial page.
  guard_mapped_reads([&] {
    for (size_t i = first; i < last; ++i) {
      sample_parts<TokenT>(bounds.data() + 4 * i, document_index, pointers, lengths, tokens.size(),
                           options.extra_token, target, scratch.parts);
      const auto row = static_cast<size_t>(rows.empty() ? static_cast<int64_t>(i) : rows[i]);
      const size_t base = row * static_cast<size_t>(S);
      OutT* out_tokens = outputs.tokens.data() + base;
      OutT* out_labels = outputs.labels.data() + base;
      float* loss = outputs.loss_mask.data() + base;
      int64_t filled = 0;
      for (const Part& part : scratch.parts) filled += part.length;
      if (filled == target && !pad_is_token) {
        fill_full_sample(tokens.data(), scratch.parts, options, out_tokens, out_labels, loss,
                         starts);
      } else {
        if (!scratch.text) scratch.text.reset(new int64_t[static_cast<size_t>(S + 1)]);
        fill_padded_sample(tokens.data(), scratch.parts, options, scratch.text.get(), out_tokens,
                           out_labels, loss, starts);
      }
      fill_positions(options, outputs, row, scratch);
      for (const Part& part : scratch.parts) {
        if (part.length > 0) probe_next_page(tokens.data() + part.offset + part.length - 1, data_end);
      }
    }
  });
}

}  // namespace

constexpr size_t kPartsPerThread = 8;

// Samples write disjoint rows, so a batch splits into contiguous ranges of samples, one per
// thread: a large batch is bound by the bandwidth one core can write, and two cores write more.
template <typename TokenT, typename OutT>
void gather_samples(std::span<const int64_t> bounds, std::span<const int32_t> document_index,
                    UnalignedSpan<int64_t> pointers, UnalignedSpan<int32_t> lengths,
                    std::span<const TokenT> tokens, std::span<const int64_t> rows,
                    const GatherOptions& options, const GatherOutputs<OutT>& outputs) {
  const size_t count = bounds.size() / 4;
  const size_t threads = std::min<size_t>(std::max(options.num_threads, 1), count);
  if (threads <= 1) {
    gather_range(bounds, document_index, pointers, lengths, tokens, rows, options, outputs, 0,
                 count);
    return;
  }
  // Small parts (a few samples), taken in turn by the caller and the pool's workers: a worker
  // that wakes late (tens of microseconds on a VM) still takes what is left instead of leaving
  // the caller waiting for its fixed half. A corrupt index throws inside a part: parallel_for
  // rethrows it here.
  const size_t parts = std::min(count, kPartsPerThread * threads);
  parallel_for(parts, static_cast<int>(threads), [&](size_t part) {
    gather_range(bounds, document_index, pointers, lengths, tokens, rows, options, outputs,
                 count * part / parts, count * (part + 1) / parts);
  });
}

#define TOKENMILL_RESOLVE(S, R)                                                              \
  template void resolve_samples<S, R>(std::span<const S>, std::span<const R>,               \
                                      std::span<const int64_t>, std::span<int64_t>);
TOKENMILL_RESOLVE(uint32_t, int32_t)
TOKENMILL_RESOLVE(uint32_t, int64_t)
TOKENMILL_RESOLVE(int64_t, int32_t)
TOKENMILL_RESOLVE(int64_t, int64_t)
#undef TOKENMILL_RESOLVE

#define TOKENMILL_GATHER(T, O)                                                                \
  template void gather_samples<T, O>(                                                         \
      std::span<const int64_t>, std::span<const int32_t>, UnalignedSpan<int64_t>,             \
      UnalignedSpan<int32_t>, std::span<const T>, std::span<const int64_t>,                   \
      const GatherOptions&, const GatherOutputs<O>&);
#define TOKENMILL_GATHER_ALL(T) \
  TOKENMILL_GATHER(T, int64_t)  \
  TOKENMILL_GATHER(T, int32_t)
TOKENMILL_GATHER_ALL(uint8_t)
TOKENMILL_GATHER_ALL(int8_t)
TOKENMILL_GATHER_ALL(int16_t)
TOKENMILL_GATHER_ALL(uint16_t)
TOKENMILL_GATHER_ALL(int32_t)
TOKENMILL_GATHER_ALL(int64_t)
TOKENMILL_GATHER(uint8_t, uint8_t)
TOKENMILL_GATHER(int8_t, int8_t)
TOKENMILL_GATHER(int16_t, int16_t)
TOKENMILL_GATHER(uint16_t, uint16_t)
#undef TOKENMILL_GATHER_ALL
#undef TOKENMILL_GATHER

}  // namespace tokenmill
