// Blending kernels: megatron-core's greedy rule, bit for bit, by whichever exact kernel is fastest
// for the input. This file holds the drivers; the kernels are
//   * a plain scan of every dataset per sample (below), for few datasets or keys that could
//     overflow, and its AVX-512 register version (register_scan, blending_avx512.cpp);
//   * the active set with a re-entry calendar (blending_active.inc: the default for
//     kActiveMinDatasets datasets or more), compiled for the baseline here and for AVX2 / AVX-512
//     in their own units, chosen at run time (cpu_features.hpp);
//   * the kinetic tournament tree (blending_tree.cpp), which takes over from the active set when
//     that stays large (equal weights);
// and a blend of many samples is cut into speculative chunks run on the thread pool (below).
//
// The rule (blending.hpp): at sample i with t = max(i, 1), pick the first dataset with the
// strictly largest key(d, t) = fl(fl(w[d] * t) - count[d]). Megatron scans all n datasets per
// sample, O(samples x n). Every kernel takes its decisions by comparing exact keys only; bounds
// and certificates only decide which datasets are looked at, so every path gives the same output
// (tests/test_blending_kernels.py forces each one). Floating-point contraction (FMA) would change
// the keys, so every blending unit is compiled with -ffp-contract=off (CMakeLists.txt).
#include "blending.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "blending_internal.hpp"
#include "cpu_features.hpp"
#include "thread_pool.hpp"

namespace tokenmill {
namespace blending {
namespace {

// Every dataset examined at every sample. Padding lanes and spent datasets have count +inf
// (weight 0 for padding), so they never win.
class Scan {
 public:
  explicit Scan(std::span<const double> weights) {
    const size_t padded = (weights.size() + kScanWays - 1) / kScanWays * kScanWays;
    weight_.assign(padded, 0.0);
    count_.assign(padded, kNever);
    for (size_t d = 0; d < weights.size(); ++d) weight_[d] = weights[d];
    std::fill_n(count_.begin(), weights.size(), 0.0);
  }
  size_t winner(double time) const {
    return scan_first_max(weight_.data(), count_.data(), weight_.size(), time);
  }
  void set_count(size_t d, double count) { count_[d] = count; }

 private:
  std::vector<double> weight_;
  std::vector<double> count_;
};


#if defined(__x86_64__)
struct Simd {  // SSE2: baseline x86-64
  using V = __m128d;
  static constexpr size_t kWidth = 2;
  static V set1(double x) { return _mm_set1_pd(x); }
  static V max(V a, V b) { return _mm_max_pd(a, b); }
  static V keys(const double* w, const double* c, size_t k, V t) {
    return _mm_sub_pd(_mm_mul_pd(_mm_load_pd(w + k), t), _mm_load_pd(c + k));
  }
  static uint32_t equal(V a, V b) {
    return static_cast<uint32_t>(_mm_movemask_pd(_mm_cmpeq_pd(a, b)));
  }
  static double hmax(V a) { return _mm_cvtsd_f64(_mm_max_pd(a, _mm_unpackhi_pd(a, a))); }
  static void set_lane(double* chunk, size_t lane, double value) {
    const auto odd = static_cast<int64_t>(lane);
    const __m128d mask = _mm_castsi128_pd(_mm_set_epi64x(-odd, odd - 1));
    _mm_store_pd(chunk, _mm_or_pd(_mm_and_pd(mask, _mm_set1_pd(value)),
                                  _mm_andnot_pd(mask, _mm_load_pd(chunk))));
  }
};
#else
struct Simd {  // one double per "vector": portable C++
  using V = double;
  static constexpr size_t kWidth = 1;
  static V set1(double x) { return x; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V keys(const double* w, const double* c, size_t k, V t) { return key(w[k], c[k], t); }
  static uint32_t equal(V a, V b) { return a == b ? 1u : 0u; }
  static double hmax(V a) { return a; }
  static void set_lane(double* chunk, size_t, double value) { chunk[0] = value; }
};
#endif

#include "blending_active.inc"

}  // namespace

size_t run_active_baseline(const ActiveRun<int16_t>& run) { return run_active_set(run); }
size_t run_active_baseline(const ActiveRun<int32_t>& run) { return run_active_set(run); }

namespace {

// ---- Drivers -----------------------------------------------------------------------------------

// True if some key could overflow or leave the range where the bounds hold; such inputs take the
// plain scan, which is exact by construction.
bool may_overflow(std::span<const double> weights, size_t samples) {
  const double max_weight = *std::max_element(weights.begin(), weights.end());
  return !(max_weight * static_cast<double>(std::max<size_t>(samples, 1)) < 0x1p900);
}

// Samples [start, ids.size()) with the scan. `counts[d]` is d's count, +inf once spent (updated in
// place); `limits[d]` the count at which it is spent (+inf: greedy). Returns the sample it
// stopped at: ids.size(), or earlier once every dataset is spent.
template <typename IndexT>
size_t scan_from(std::span<const double> weights, std::span<const double> limits,
                 std::vector<double>& counts, size_t start, std::span<IndexT> ids,
                 std::span<int64_t> positions) {
  Scan scan(weights);
  size_t alive = 0;
  for (size_t d = 0; d < weights.size(); ++d) {
    scan.set_count(d, counts[d]);
    alive += counts[d] != kNever ? 1 : 0;
  }
  size_t i = start;
  for (; i < ids.size() && alive > 0; ++i) {
    const size_t d = scan.winner(static_cast<double>(std::max<size_t>(i, 1)));
    ids[i] = static_cast<IndexT>(d);
    positions[i] = static_cast<int64_t>(counts[d]);
    counts[d] += 1.0;
    if (counts[d] >= limits[d]) {  // spent: megatron erases it from its set
      counts[d] = kNever;
      --alive;
    }
    scan.set_count(d, counts[d]);
  }
  return i;
}

enum class Isa { kBaseline, kAvx2, kAvx512 };

// The best instruction set the CPU has for the active set, capped by the path a test forces.
Isa active_isa(BlendingOptions::Path path) {
  using Path = BlendingOptions::Path;
#ifdef TOKENMILL_X86_UNITS
  if (path != Path::kActiveBaseline && path != Path::kActiveAvx2 && cpu_features().avx512) {
    return Isa::kAvx512;
  }
  if (path != Path::kActiveBaseline && cpu_features().avx2) return Isa::kAvx2;
#else
  (void)path;
#endif
  return Isa::kBaseline;
}

// The active set from sample `start` and `counts`; returns where it stopped and leaves the
// counts there in `counts`.
template <typename IndexT>
size_t run_active(std::span<const double> weights, std::span<const double> limits,
                  const BlendingOptions& options, size_t start, std::span<IndexT> ids,
                  std::span<int64_t> positions, bool may_hand_over, std::vector<double>& counts) {
  const ActiveRun<IndexT> run{weights.data(), limits.data(), counts.data(), weights.size(),
                              &options,       start,         ids.data(),    positions.data(),
                              ids.size(),     may_hand_over};
  switch (active_isa(options.path)) {
#ifdef TOKENMILL_X86_UNITS
    case Isa::kAvx512:
      return run_active_avx512(run);
    case Isa::kAvx2:
      return run_active_avx2(run);
#endif
    default:
      return run_active_baseline(run);
  }
}

// Samples handed over to the scan or the tree before the active set is tried again (doubling).
constexpr size_t kHandOverSpan = size_t{1} << 16;

// Samples [start, ids.size()) from `counts`, the counts at sample `start` (+inf: spent), by the
// kernel the options and the CPU choose. Leaves the counts where it stopped in `counts` and
// returns that sample: ids.size(), or earlier once every dataset is spent.
template <typename IndexT>
size_t blend_range(std::span<const double> weights, std::span<const double> limits,
                   std::vector<double>& counts, size_t start, std::span<IndexT> ids,
                   std::span<int64_t> positions, const BlendingOptions& options) {
  using Path = BlendingOptions::Path;
  const size_t n = weights.size();
  const size_t samples = ids.size();
  if (start >= samples) return start;
  const bool greedy = std::all_of(limits.begin(), limits.end(), [](double l) { return l == kNever; });
  Path path = options.path;
  if (path == Path::kAuto) {
    path = n < kActiveMinDatasets ? Path::kScanSimd : Path::kActive;
  }
  if (may_overflow(weights, samples)) path = Path::kScan;
#ifdef TOKENMILL_X86_UNITS
  if (path == Path::kScanSimd && greedy && n <= kRegisterScanMaxDatasets &&
      cpu_features().avx512) {
    register_scan_avx512(ActiveRun<IndexT>{weights.data(), limits.data(), counts.data(), n,
                                           &options, start, ids.data(), positions.data(),
                                           samples, false});
    return samples;
  }
#endif
  if (path == Path::kScanSimd) path = Path::kScan;
  if (path == Path::kScan) return scan_from(weights, limits, counts, start, ids, positions);
  if (path == Path::kTree) return tree_from(weights, limits, counts, start, ids, positions);
  // Exhaustive blends never hand over: their tree costs 4-10x the active set's worst stretch
  // (measured at 1000 datasets: lognormal, uniform and lognormal with every size >= 100).
  const bool may_hand_over = options.path == Path::kAuto && greedy;
  // A hand-over is for a span of samples, after which the active set is tried again: A can stay
  // large for a while and then shrink (exhaustive blends: near t = total * p / q, the keys of
  // all datasets bunch at multiples of 1 / q). Spans double, so a blend whose A stays large
  // (equal weights) pays the active set's restarts only O(log samples) times.
  size_t at = start;
  size_t span = kHandOverSpan;
  for (;;) {
    const size_t end =
        run_active(weights, limits, options, at, ids, positions, may_hand_over, counts);
    const bool spent = std::all_of(counts.begin(), counts.end(), [](double c) { return c == kNever; });
    if (end == samples || spent) return end;
    const size_t until = std::min(samples, end + span);
    span *= 2;
    // The tree, not the scan, even for few datasets: where A stays large (equal weights) the
    // tree's certificates last long (measured 50-120 ns against the scan's 60-260 at 48-200
    // equal weights).
    const size_t reached = tree_from(weights, limits, counts, end, ids.first(until), positions);
    if (reached < until || until == samples) return reached;
    at = until;
  }
}

// ---- Speculative chunks ------------------------------------------------------------------------
//
// The rule is sequential: sample i depends on the counts after sample i - 1. But the counts are
// the whole state (the keys are a function of the weights, the counts and i), and the greedy
// rule keeps every count within a few samples of weight * i. So a blend of many samples is cut
// into chunks; chunk 0 starts from the true counts (zero) and every other chunk from a guess of
// the counts at its first sample (weight * start rounded so they sum to start, capped at the
// limits), the chunks spread over the thread pool. Started from a guess, a chunk's run is the true
// run as soon as its counts equal the true counts at the same sample: from there on both runs
// are the same function of the same state. Measured, a guess differs from the truth in a few
// counts at 1000 datasets and the two runs meet within a few dozen samples.
//
// Once every chunk ran, the chunks are repaired in order: with the true counts at its first
// sample (the previous chunk's, once repaired), the true run is recomputed over growing spans
// (overwriting the guessed run's output) until its counts equal the guessed run's counts at the
// same sample. Those are the guessed counts advanced over the guessed run's own output, read
// before it is overwritten. If they never meet, the chunk is recomputed whole (as slow as one
// thread, still exact). Every output sample is thus either recomputed from the true state or
// decided from a state proven equal to it: the output is the single-threaded output, bit for
// bit (tests/test_blending_kernels.py forces tiny chunks and bad guesses to check it).

// Samples per chunk below which chunks are not worth cutting (a thread wake-up and a repair cost
// tens of microseconds; a sample tens of nanoseconds).
constexpr size_t kMinChunk = size_t{1} << 18;

// The guessed counts at sample `start`.
std::vector<double> guess_counts(std::span<const double> weights, std::span<const double> limits,
                                 size_t start) {
  const size_t n = weights.size();
  std::vector<double> counts(n, 0.0);
  double total = 0.0;
  for (const double w : weights) total += w;
  if (!(total > 0.0)) return counts;
  std::vector<double> rest(n);
  size_t assigned = 0;
  for (size_t d = 0; d < n; ++d) {
    const double share = weights[d] / total * static_cast<double>(start);
    const double whole = std::floor(share);
    counts[d] = whole;
    rest[d] = share - whole;
    assigned += static_cast<size_t>(whole);
  }
  // The largest remainders get one more, so the counts sum to `start` as the true ones do.
  if (assigned < start) {
    std::vector<size_t> order(n);
    for (size_t d = 0; d < n; ++d) order[d] = d;
    const size_t extra = std::min(start - assigned, n);
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(extra),
                      order.end(), [&](size_t a, size_t b) { return rest[a] > rest[b]; });
    for (size_t k = 0; k < extra; ++k) counts[order[k]] += 1.0;
  }
  for (size_t d = 0; d < n; ++d) {
    if (counts[d] >= limits[d]) counts[d] = kNever;  // spent
  }
  return counts;
}

size_t mismatches(const std::vector<double>& a, const std::vector<double>& b) {
  size_t differ = 0;
  for (size_t d = 0; d < a.size(); ++d) differ += a[d] != b[d] ? 1 : 0;
  return differ;
}

// Makes chunk [begin, end) exact, given the true counts at `begin` (`truth`). The guessed run
// filled [begin, guessed_end) from `guessed` and finished with `guessed_final`. Returns the true
// counts at the end of the chunk (and where the true run stopped, in `stop`).
template <typename IndexT>
std::vector<double> repair(std::span<const double> weights, std::span<const double> limits,
                           std::vector<double> truth, std::vector<double> guessed,
                           std::vector<double> guessed_final, size_t guessed_end, size_t begin,
                           size_t end, std::span<IndexT> ids, std::span<int64_t> positions,
                           const BlendingOptions& options, size_t& stop) {
  size_t at = begin;
  size_t span = 64;
  bool met = mismatches(truth, guessed) == 0;
  while (!met && at < end) {
    const size_t until = std::min(end, at + span);
    span *= 2;
    // The guessed run's counts at `until`, from its own output (read before it is overwritten).
    const bool comparable = until <= guessed_end;
    if (comparable) {
      for (size_t i = at; i < until; ++i) {
        const auto d = static_cast<size_t>(ids[i]);
        guessed[d] += 1.0;
        if (guessed[d] >= limits[d]) guessed[d] = kNever;
      }
    }
    const size_t reached = blend_range(weights, limits, truth, at, ids.first(until), positions,
                                       options);
    if (reached < until) {  // every dataset spent: the blend ends here
      stop = reached;
      return truth;
    }
    at = until;
    met = comparable && mismatches(truth, guessed) == 0;
  }
  if (!met) {
    stop = at;
    return truth;
  }
  stop = guessed_end;
  return guessed_final;
}

template <typename IndexT>
void blend(std::span<const double> weights, std::span<const double> limits,
           std::span<IndexT> ids, std::span<int64_t> positions, const BlendingOptions& options) {
  const size_t n = weights.size();
  const size_t samples = ids.size();
  std::vector<double> zero(n);
  for (size_t d = 0; d < n; ++d) zero[d] = limits[d] > 0.0 ? 0.0 : kNever;
  // Chunks, each run on its own thread when the pool has one for it (0: as many as the CPUs
  // this process may use, at most 8, with at least kMinChunk samples each). The chunking alone
  // decides the work; the output is the same for any number of chunks and threads.
  size_t chunks = options.threads;
  if (chunks == 0) {
    chunks = static_cast<size_t>(usable_threads(8));
    chunks = std::min(chunks, std::max<size_t>(1, samples / kMinChunk));
  }
  chunks = std::min(chunks, std::max<size_t>(1, samples));
  if (chunks <= 1) {
    blend_range(weights, limits, zero, 0, ids, positions, options);
    return;
  }
  std::vector<size_t> bounds(chunks + 1);
  for (size_t p = 0; p <= chunks; ++p) bounds[p] = samples / chunks * p;
  bounds[chunks] = samples;
  std::vector<std::vector<double>> guessed(chunks);
  std::vector<std::vector<double>> finals(chunks);
  std::vector<size_t> ends(chunks);
  // An exception (std::bad_alloc) in a chunk reaches the caller through parallel_for.
  parallel_for(chunks, static_cast<int>(std::min<size_t>(chunks, 1 << 16)), [&](size_t p) {
    guessed[p] = p == 0 ? zero
                 : options.guess_zero ? zero
                                      : guess_counts(weights, limits, bounds[p]);
    finals[p] = guessed[p];
    ends[p] = blend_range(weights, limits, finals[p], bounds[p], ids.first(bounds[p + 1]),
                          positions, options);
  });
  // Chunk 0 is exact; each later chunk is repaired from the true counts at its start.
  std::vector<double> truth = std::move(finals[0]);
  size_t reached = ends[0];
  for (size_t p = 1; p < chunks; ++p) {
    if (reached < bounds[p]) return;  // every dataset spent before this chunk: the blend ended
    truth = repair(weights, limits, std::move(truth), std::move(guessed[p]), std::move(finals[p]),
                   ends[p], bounds[p], bounds[p + 1], ids, positions, options, reached);
  }
}

}  // namespace
}  // namespace blending

const char* active_set_isa(BlendingOptions::Path path) {
  switch (blending::active_isa(path)) {
    case blending::Isa::kAvx512:
      return "avx512";
    case blending::Isa::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

template <typename IndexT>
void build_blending_indices(std::span<const double> weights, std::span<IndexT> dataset_index,
                            std::span<int64_t> dataset_sample_index,
                            const BlendingOptions& options) {
  const size_t samples = std::min(dataset_index.size(), dataset_sample_index.size());
  if (weights.empty() || samples == 0) return;
  const std::vector<double> limits(weights.size(), blending::kNever);
  blending::blend(weights, std::span<const double>(limits), dataset_index.first(samples),
        dataset_sample_index.first(samples), options);
}

template <typename IndexT>
void build_exhaustive_blending_indices(std::span<const int64_t> sizes,
                                       std::span<IndexT> dataset_index,
                                       std::span<int64_t> dataset_sample_index,
                                       const BlendingOptions& options) {
  const size_t n = sizes.size();
  int64_t total = 0;
  for (const int64_t size : sizes) total += size;
  std::vector<double> weights(n);
  std::vector<double> limits(n);
  for (size_t d = 0; d < n; ++d) {
    weights[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
    // Counts are exact doubles (a count never exceeds 2^53 samples), so count >= limit is
    // exactly count >= size.
    limits[d] = static_cast<double>(sizes[d]);
  }
  const size_t samples = std::min(dataset_index.size(), dataset_sample_index.size());
  if (n == 0 || samples == 0) return;
  blending::blend(std::span<const double>(weights), std::span<const double>(limits),
        dataset_index.first(samples), dataset_sample_index.first(samples), options);
}

template void build_blending_indices<int16_t>(std::span<const double>, std::span<int16_t>,
                                              std::span<int64_t>, const BlendingOptions&);
template void build_blending_indices<int32_t>(std::span<const double>, std::span<int32_t>,
                                              std::span<int64_t>, const BlendingOptions&);
template void build_exhaustive_blending_indices<int16_t>(std::span<const int64_t>,
                                                         std::span<int16_t>, std::span<int64_t>,
                                                         const BlendingOptions&);
template void build_exhaustive_blending_indices<int32_t>(std::span<const int64_t>,
                                                         std::span<int32_t>, std::span<int64_t>,
                                                         const BlendingOptions&);

}  // namespace tokenmill