#include "sample_index.hpp"

#include <algorithm>
#include <numeric>
#include <vector>

#include "common.hpp"
#include "shuffle.hpp"
#include "thread_pool.hpp"

namespace tokenmill {

int64_t sum_selected_lengths(UnalignedSpan<int32_t> sizes, std::span<const int32_t> indices) {
  int64_t total = 0;
  for (const int32_t index : indices) total += sizes[static_cast<size_t>(index)];
  return total;
}

int64_t find_out_of_range(std::span<const int32_t> values, int64_t limit) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] < 0 || values[i] >= limit) return static_cast<int64_t>(i);
  }
  return -1;
}

namespace {

constexpr int64_t kPrefetchDistance = 32;

// Sum of the lengths of documents [begin, end) of document_index.
int64_t count_tokens(UnalignedSpan<int32_t> sizes, std::span<const int32_t> document_index,
                     int64_t begin, int64_t end) {
  int64_t total = 0;
  for (int64_t p = begin; p < end; ++p) {
    if (p + kPrefetchDistance < end) {
      __builtin_prefetch(sizes.address(static_cast<size_t>(document_index[static_cast<size_t>(p + kPrefetchDistance)])));
    }
    total += sizes[static_cast<size_t>(document_index[static_cast<size_t>(p)])];
  }
  return total;
}

// Writes the rows of every sample whose start falls in documents [begin, end) of
// document_index, given the number of tokens before `begin`. Sample k >= 1 starts in the first
// document p with start(p) < k * S + extra <= end(p), at offset k * S - start(p); the next such
// boundary is carried along, so the walk needs no division per document.
template <typename T>
void emit_rows_for_documents(UnalignedSpan<int32_t> sizes,
                             std::span<const int32_t> document_index, int64_t begin,
                             int64_t end, int64_t tokens_before, int64_t sequence_length,
                             int64_t extra_token, int64_t num_samples, T* rows) {
  // The first sample k >= 1 with k * S + extra > tokens_before.
  int64_t sample = std::max<int64_t>(1, (tokens_before - extra_token) / sequence_length + 1);
  if (tokens_before - extra_token < 0) sample = 1;
  int64_t boundary = sample * sequence_length + extra_token;  // k * S + extra for k = sample
  int64_t document_start = tokens_before;
  for (int64_t position = begin; position < end && sample <= num_samples; ++position) {
    // document_index is shuffled, so sizes[...] is a random access: fetch it ahead.
    if (position + kPrefetchDistance < end) {
      __builtin_prefetch(
          sizes.address(static_cast<size_t>(
              document_index[static_cast<size_t>(position + kPrefetchDistance)])));
    }
    const int64_t document_end =
        document_start + sizes[static_cast<size_t>(document_index[static_cast<size_t>(position)])];
    while (boundary <= document_end && sample <= num_samples) {
      rows[2 * sample] = static_cast<T>(position);
      rows[2 * sample + 1] = static_cast<T>(boundary - extra_token - document_start);
      ++sample;
      boundary += sequence_length;
    }
    document_start = document_end;
  }
}

}  // namespace

template <typename T>
void build_sample_index(UnalignedSpan<int32_t> sizes, std::span<const int32_t> document_index,
                        int64_t sequence_length, int64_t extra_token,
                        std::span<T> sample_index, int num_threads, int64_t total_tokens) {
  const int64_t num_samples = static_cast<int64_t>(sample_index.size() / 2) - 1;
  const int64_t num_documents = static_cast<int64_t>(document_index.size());
  T* rows = sample_index.data();
  rows[0] = 0;
  rows[1] = 0;
  if (num_samples <= 0 || num_documents == 0) return;
  if (total_tokens < 0) total_tokens = count_tokens(sizes, document_index, 0, num_documents);

  auto emit = [&](int64_t begin, int64_t end, int64_t tokens_before) {
    emit_rows_for_documents(sizes, document_index, begin, end, tokens_before, sequence_length,
                            extra_token, num_samples, rows);
  };
  if (num_threads >= 2 && num_documents >= (1 << 16) && usable_threads(num_threads) >= 2) {
    // The first part starts at token 0; the second learns where it starts by counting its own
    // tokens (total - count), so it walks its documents twice and the first part once: a 2:1
    // split balances the two threads. Rows depend only on positions, so the result is the same.
    const int64_t split = num_documents * 2 / 3;
    parallel_for(2, 2, [&](size_t part) {
      if (part == 0) {
        emit(0, split, 0);
      } else {
        const int64_t tail = count_tokens(sizes, document_index, split, num_documents);
        emit(split, num_documents, total_tokens - tail);
      }
    });
  } else {
    emit(0, num_documents, 0);
  }

  // Samples that would need tokens past the end of the data (only the last one or two, when the
  // partial final sample is kept) stop on the last document, `extra` tokens before its end.
  const int64_t last_position = num_documents - 1;
  const int64_t last_length =
      sizes[static_cast<size_t>(document_index[static_cast<size_t>(last_position)])];
  for (int64_t k = num_samples; k >= 1 && k * sequence_length + extra_token > total_tokens; --k) {
    rows[2 * k] = static_cast<T>(last_position);
    rows[2 * k + 1] = static_cast<T>(last_length - extra_token);
  }
}

namespace {

void fill_epochs(std::span<const int32_t> indices, std::span<int32_t> out) {
  const size_t n = indices.size();
  for (size_t offset = 0; offset + n <= out.size(); offset += n) {
    std::copy(indices.begin(), indices.end(), out.begin() + static_cast<std::ptrdiff_t>(offset));
  }
}

template <typename ShuffleT>
void build_shuffle_index(std::span<ShuffleT> out, int64_t split, NumpyRandomState& random) {
  std::iota(out.begin(), out.end(), ShuffleT{0});
  const size_t first = static_cast<size_t>(std::clamp<int64_t>(split, 0, static_cast<int64_t>(out.size())));
  shuffle_like_numpy(out.subspan(0, first), random);
  if (first < out.size()) shuffle_like_numpy(out.subspan(first), random);
}

}  // namespace

template <typename SampleT, typename ShuffleT>
void build_gpt_indices(UnalignedSpan<int32_t> sizes, std::span<const int32_t> indices,
                       const GptIndexPlan& plan, std::span<int32_t> document_index,
                       std::span<SampleT> sample_index, std::span<ShuffleT> shuffle_index) {
  NumpyRandomState random(plan.seed);
  const int64_t total_tokens = sum_selected_lengths(sizes, indices) * plan.num_epochs;
  fill_epochs(indices, document_index);
  if (plan.separate_final_epoch && plan.num_epochs > 1) {
    const size_t head = indices.size() * static_cast<size_t>(plan.num_epochs - 1);
    shuffle_like_numpy(document_index.subspan(0, head), random);
    shuffle_like_numpy(document_index.subspan(head), random);
  } else {
    shuffle_like_numpy(document_index, random);
  }
  // The shuffle index only needs the stream (already positioned) and the sample count, so it is
  // drawn on its own thread while the sample index is computed; below 2^16 samples the hand-off
  // costs more than the work (a blend of 1,000 small sources builds 1,000 such indices).
  const std::span<const int32_t> documents(document_index.data(), document_index.size());
  if (plan.num_threads >= 2 && shuffle_index.size() >= (size_t{1} << 16) &&
      usable_threads(plan.num_threads) >= 2) {
    parallel_for(2, 2, [&](size_t part) {
      if (part == 0) {
        build_sample_index(sizes, documents, plan.sequence_length, plan.extra_token,
                           sample_index, plan.num_threads - 1, total_tokens);
      } else {
        build_shuffle_index(shuffle_index, plan.shuffle_split, random);
      }
    });
  } else {
    build_sample_index(sizes, documents, plan.sequence_length, plan.extra_token, sample_index, 1,
                       total_tokens);
    build_shuffle_index(shuffle_index, plan.shuffle_split, random);
  }
}

template void build_sample_index<int32_t>(UnalignedSpan<int32_t>, std::span<const int32_t>,
                                          int64_t, int64_t, std::span<int32_t>, int, int64_t);
template void build_sample_index<int64_t>(UnalignedSpan<int32_t>, std::span<const int32_t>,
                                          int64_t, int64_t, std::span<int64_t>, int, int64_t);
template void build_gpt_indices<int32_t, uint32_t>(UnalignedSpan<int32_t>,
                                                   std::span<const int32_t>, const GptIndexPlan&,
                                                   std::span<int32_t>, std::span<int32_t>,
                                                   std::span<uint32_t>);
template void build_gpt_indices<int32_t, int64_t>(UnalignedSpan<int32_t>,
                                                  std::span<const int32_t>, const GptIndexPlan&,
                                                  std::span<int32_t>, std::span<int32_t>,
                                                  std::span<int64_t>);
template void build_gpt_indices<int64_t, uint32_t>(UnalignedSpan<int32_t>,
                                                   std::span<const int32_t>, const GptIndexPlan&,
                                                   std::span<int32_t>, std::span<int64_t>,
                                                   std::span<uint32_t>);
template void build_gpt_indices<int64_t, int64_t>(UnalignedSpan<int32_t>,
                                                  std::span<const int32_t>, const GptIndexPlan&,
                                                  std::span<int32_t>, std::span<int64_t>,
                                                  std::span<int64_t>);

}  // namespace tokenmill
