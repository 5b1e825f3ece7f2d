#include "sample_index.hpp"

#include <algorithm>
#include <numeric>
#include <thread>
#include <vector>

#include "common.hpp"
#include "shuffle.hpp"

namespace tokenmill {

int64_t sum_selected_lengths(std::span<const int32_t> sizes, std::span<const int32_t> indices) {
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

// Writes the rows of every sample whose start falls in documents [begin, end) of
// document_index, given the number of tokens before `begin`.
template <typename T>
void emit_rows_for_documents(std::span<const int32_t> sizes,
                             std::span<const int32_t> document_index, int64_t begin,
                             int64_t end, int64_t tokens_before, int64_t sequence_length,
                             int64_t extra_token, int64_t num_samples, T* rows) {
  int64_t document_start = tokens_before;
  for (int64_t position = begin; position < end; ++position) {
    const int64_t length = sizes[static_cast<size_t>(document_index[static_cast<size_t>(position)])];
    const int64_t document_end = document_start + length;
    if (length > 0) {
      // Samples k >= 1 with document_start < k * S + extra <= document_end start here.
      int64_t first = (document_start + 1 - extra_token + sequence_length - 1) / sequence_length;
      if (document_start + 1 - extra_token <= 0) first = 1;
      first = std::max<int64_t>(first, 1);
      const int64_t last = std::min<int64_t>((document_end - extra_token) / sequence_length,
                                             num_samples);
      for (int64_t k = first; k <= last; ++k) {
        rows[2 * k] = static_cast<T>(position);
        rows[2 * k + 1] = static_cast<T>(k * sequence_length - document_start);
      }
    }
    document_start = document_end;
  }
}

}  // namespace

template <typename T>
void build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                        int64_t sequence_length, int64_t extra_token,
                        std::span<T> sample_index, int num_threads) {
  const int64_t num_samples = static_cast<int64_t>(sample_index.size() / 2) - 1;
  const int64_t num_documents = static_cast<int64_t>(document_index.size());
  T* rows = sample_index.data();
  rows[0] = 0;
  rows[1] = 0;
  if (num_samples <= 0 || num_documents == 0) return;

  const int threads = threads_for(num_threads, num_documents, 1 << 16);
  std::vector<int64_t> bounds(static_cast<size_t>(threads) + 1);
  for (int t = 0; t <= threads; ++t) bounds[static_cast<size_t>(t)] = num_documents * t / threads;

  // Pass 1: tokens per chunk of document positions.
  std::vector<int64_t> chunk_tokens(static_cast<size_t>(threads), 0);
  auto count_tokens = [&](int t) {
    int64_t total = 0;
    for (int64_t p = bounds[static_cast<size_t>(t)]; p < bounds[static_cast<size_t>(t) + 1]; ++p) {
      total += sizes[static_cast<size_t>(document_index[static_cast<size_t>(p)])];
    }
    chunk_tokens[static_cast<size_t>(t)] = total;
  };
  // Pass 2: every chunk writes the rows of the samples that start inside it.
  std::vector<int64_t> tokens_before(static_cast<size_t>(threads), 0);
  auto emit = [&](int t) {
    emit_rows_for_documents(sizes, document_index, bounds[static_cast<size_t>(t)],
                            bounds[static_cast<size_t>(t) + 1],
                            tokens_before[static_cast<size_t>(t)], sequence_length, extra_token,
                            num_samples, rows);
  };
  auto run_all = [&](auto&& work) {
    std::vector<std::thread> workers;
    for (int t = 1; t < threads; ++t) workers.emplace_back(work, t);
    work(0);
    for (auto& worker : workers) worker.join();
  };
  run_all(count_tokens);
  for (int t = 1; t < threads; ++t) {
    tokens_before[static_cast<size_t>(t)] =
        tokens_before[static_cast<size_t>(t) - 1] + chunk_tokens[static_cast<size_t>(t) - 1];
  }
  const int64_t total_tokens = tokens_before.back() + chunk_tokens.back();
  run_all(emit);

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
void build_gpt_indices(std::span<const int32_t> sizes, std::span<const int32_t> indices,
                       const GptIndexPlan& plan, std::span<int32_t> document_index,
                       std::span<SampleT> sample_index, std::span<ShuffleT> shuffle_index) {
  NumpyRandomState random(plan.seed);
  fill_epochs(indices, document_index);
  if (plan.separate_final_epoch && plan.num_epochs > 1) {
    const size_t head = indices.size() * static_cast<size_t>(plan.num_epochs - 1);
    shuffle_like_numpy(document_index.subspan(0, head), random);
    shuffle_like_numpy(document_index.subspan(head), random);
  } else {
    shuffle_like_numpy(document_index, random);
  }
  // The shuffle index only needs the stream (already positioned) and the sample count, so it is
  // drawn on its own thread while the sample index is computed.
  const std::span<const int32_t> documents(document_index.data(), document_index.size());
  if (plan.num_threads >= 2) {
    std::thread shuffler([&] { build_shuffle_index(shuffle_index, plan.shuffle_split, random); });
    build_sample_index(sizes, documents, plan.sequence_length, plan.extra_token, sample_index,
                       plan.num_threads - 1);
    shuffler.join();
  } else {
    build_sample_index(sizes, documents, plan.sequence_length, plan.extra_token, sample_index, 1);
    build_shuffle_index(shuffle_index, plan.shuffle_split, random);
  }
}

template void build_sample_index<int32_t>(std::span<const int32_t>, std::span<const int32_t>,
                                          int64_t, int64_t, std::span<int32_t>, int);
template void build_sample_index<int64_t>(std::span<const int32_t>, std::span<const int32_t>,
                                          int64_t, int64_t, std::span<int64_t>, int);
template void build_gpt_indices<int32_t, uint32_t>(std::span<const int32_t>,
                                                   std::span<const int32_t>, const GptIndexPlan&,
                                                   std::span<int32_t>, std::span<int32_t>,
                                                   std::span<uint32_t>);
template void build_gpt_indices<int32_t, int64_t>(std::span<const int32_t>,
                                                  std::span<const int32_t>, const GptIndexPlan&,
                                                  std::span<int32_t>, std::span<int32_t>,
                                                  std::span<int64_t>);
template void build_gpt_indices<int64_t, uint32_t>(std::span<const int32_t>,
                                                   std::span<const int32_t>, const GptIndexPlan&,
                                                   std::span<int32_t>, std::span<int64_t>,
                                                   std::span<uint32_t>);
template void build_gpt_indices<int64_t, int64_t>(std::span<const int32_t>,
                                                  std::span<const int32_t>, const GptIndexPlan&,
                                                  std::span<int32_t>, std::span<int64_t>,
                                                  std::span<int64_t>);

}  // namespace tokenmill
