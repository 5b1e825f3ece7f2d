// Blending kernels: megatron-core's greedy rule. Exact kernels: a plain scan (below
// kActiveMinDatasets datasets, or when keys could overflow), its AVX-512 register version (greedy,
// below kActiveMinDatasets, on CPUs with AVX-512: see decide_block()), the active set with a
// re-entry calendar (the default; see "The active set" below and blending_active.inc; with
// AVX-512 it decides whole blocks of samples in registers), and the kinetic tournament tree
// described here, which takes over from the active set when that stays large.
//
// The rule (blending.hpp): at sample i with t = max(i, 1), pick the first dataset with the
// strictly largest key(d, t) = fl(fl(w[d] * t) - count[d]). Megatron scans all n datasets per
// sample, O(samples x n).
//
// Here the datasets are the leaves of a complete binary tree. Every internal node holds the
// winner of its subtree under the total order "larger key wins, equal keys go to the lower
// index"; the left child always holds the lower indices, so the root winner is exactly
// megatron's first strict maximum. Between two samples only the chosen dataset's count changes.
// Time moves every key, but along straight lines, so each node also stores a certificate: a
// time before which its loser cannot catch its winner while their counts stay fixed, and
// `expiry_[v]` is the smallest certificate in v's subtree. The sample after dataset d costs:
//   * the off-path subtrees (the siblings of d's leaf-to-root path) that hold an expired
//     certificate, refreshed children-first (few per sample: a node's winner changes about as
//     often as its subtree is sampled, though a heavily weighted dataset that drops after a
//     sample and climbs back past several ancestors can cost several);
//   * d's path, recomputed from the siblings' winners (O(log n)). Their keys are independent, so
//     the serial chain each sample waits on is one comparison per level.
// Invariants: after a refresh at time t every node's winner is exact at t, and every node whose
// certificate is > t is exact at every integer time below its certificate.
//
// Bit-identity: decisions are never taken from a certificate. Each recomputation evaluates both
// keys with the exact expression above and compares them exactly. A certificate only says when to
// look again and is computed conservatively (see certify()), so for every integer time before it
// the floating-point comparison has the same outcome. When the margin cannot be shown (nearly
// equal weights) the node is re-examined at the next sample: slower, still exact. Inputs whose
// products could approach overflow, and blends of fewer than kActiveMinDatasets datasets, take a
// plain scan (or its AVX-512 register version), exact by construction.
//
// Exhaustive blending is the same tree with weights sizes[d] / total; a dataset whose count
// reaches its size points its leaf at a sentinel that never wins, which is megatron's removal
// from its set.
//
// Cost: O(log n) per sample for the path plus the expired certificates; measured in
// benchmarks/BLENDING.md. Floating-point contraction (FMA) would change the keys, so this file is
// compiled with -ffp-contract=off (CMakeLists.txt).
#include "blending.hpp"

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace tokenmill {
namespace {


constexpr double kNever = std::numeric_limits<double>::infinity();

// 32 units of roundoff (u = 2^-53); see certify().
constexpr double kMargin = 0x1p-48;
// Absorbs the absolute error of a product that underflows into the subnormal range.
constexpr double kTiny = 0x1p-1000;

inline double key(double weight, double count, double time) {
  // Exactly megatron's expression: the product is rounded, then the difference.
  return weight * time - count;
}

// The certificate of a match that `win` (weight, count) leads over `lose` at `time`: a time
// before which, while both counts stay fixed, `lose` cannot win at any integer time. The node
// is valid for integer t' < certificate and recomputed at the first t' >= it.
//
// gap(t') = (w_win - w_lose) t' + (c_lose - c_win) is the exact-arithmetic lead. Each key carries
// at most 3u(w t' + c) of rounding error (u = 2^-53: one rounding of the product, one of the
// difference), so the floating-point comparison cannot flip while gap(t') exceeds
// kMargin ((w_win + w_lose) t' + c_win + c_lose); evaluating that line in doubles costs at most
// ~6u more of the same scale, well inside kMargin = 32u. The condition is linear in t': if it
// rises it holds forever once it holds at time + 1; if it falls it holds until its root, which
// is shrunk by 2^-40 to stay below the true root. Otherwise: look again at time + 1.
// `winner_first`: the winner has the lower index, so it also wins ties. Equal weights round to
// equal products and fl(p - c) is monotone in c, so then the counts alone settle the match.
// Branch-free on purpose: the outcome is unpredictable and a mispredict costs more than the
// arithmetic of both sides.
inline double certify(double w_win, double c_win, double w_lose, double c_lose, double time,
                      bool winner_first) {
  const double next = time + 1.0;
  const double slope = (w_win - w_lose) - kMargin * (w_win + w_lose);
  const double offset = (c_lose - c_win) - kMargin * (c_win + c_lose) - kTiny;
  const double crossing = offset / -slope * (1.0 - 0x1p-40);
  const double rising = slope * next + offset > 0.0 ? kNever : next;
  const double later = crossing > next ? crossing : next;
  const double falling = offset > 0.0 ? later : next;
  const double bound = slope >= 0.0 ? rising : falling;
  const bool settled = (w_win == w_lose && winner_first && c_win <= c_lose) ||
                       c_lose == kNever || c_win == kNever;  // a dead side never flips
  return settled ? kNever : bound;
}

// The tournament tree over n datasets; see the file comment. Node v (1-based heap order, leaves
// at [leaves_, 2 * leaves_)) stores the dataset winning its subtree and the smallest certificate
// in that subtree. Dataset n is a sentinel with count +inf (key -inf): padding leaves and spent
// datasets point at it and never win.
class KineticTournament {
 public:
  explicit KineticTournament(std::span<const double> weights)
      : dead_(static_cast<int32_t>(weights.size())) {
    depth_ = 0;
    while ((size_t{1} << depth_) < weights.size()) ++depth_;
    leaves_ = size_t{1} << depth_;
    weight_.assign(weights.begin(), weights.end());
    weight_.push_back(0.0);
    count_.assign(weights.size(), 0.0);
    count_.push_back(kNever);
    winner_.assign(2 * leaves_, dead_);
    expiry_.assign(2 * leaves_, kNever);
    for (size_t d = 0; d < weights.size(); ++d) winner_[leaves_ + d] = static_cast<int32_t>(d);
  }

  // The winner at `time` from the current counts: builds every node.
  size_t first_winner(double time) {
    for (size_t v = leaves_ - 1; v >= 1; --v) recompute(v, time);
    return static_cast<size_t>(winner_[1]);
  }

  void set_count(size_t d, double count) { count_[d] = count; }

  // Records one more sample of `taken` (the previous winner), or its removal when `spent`, and
  // returns the winner at `time`.
  size_t next_winner(size_t taken, double count, double time) {
    count_[taken] = count;
    const size_t leaf = leaves_ + taken;
    // Off-path subtrees first: each hangs off the path as a sibling, and only expired ones are
    // entered. The path itself is recomputed below from those siblings.
    for (size_t k = 0; k < depth_; ++k) {
      const size_t sibling = (leaf >> k) ^ 1;
      if (expiry_[sibling] <= time) refresh(sibling, time);
    }
    return update_path(leaf, time);
  }

  void kill(size_t d) { winner_[leaves_ + d] = dead_; }

 private:
  // Recomputes every node on the leaf's path at `time`. The siblings' winners are loaded and
  // their keys computed independently, so the only serial chain is one comparison per level,
  // which is what every sample waits on.
  size_t update_path(size_t leaf, double time) {
    int32_t sibling_winner[kMaxDepth];
    double sibling_key[kMaxDepth];
    for (size_t k = 0; k < depth_; ++k) {
      const int32_t w = winner_[(leaf >> k) ^ 1];
      sibling_winner[k] = w;
      sibling_key[k] = key(weight_[static_cast<size_t>(w)], count_[static_cast<size_t>(w)], time);
    }
    int32_t current = winner_[leaf];
    double current_key =
        key(weight_[static_cast<size_t>(current)], count_[static_cast<size_t>(current)], time);
    double below = kNever;  // min certificate under the current path node
    for (size_t k = 0; k < depth_; ++k) {
      const int32_t other = sibling_winner[k];
      const double other_key = sibling_key[k];
      // The left child holds the lower indices and wins ties.
      const bool path_is_left = ((leaf >> k) & 1) == 0;
      const bool keep = path_is_left ? current_key >= other_key : current_key > other_key;
      const int32_t win = keep ? current : other;
      const int32_t lose = keep ? other : current;
      const auto w = static_cast<size_t>(win);
      const auto l = static_cast<size_t>(lose);
      const double own = certify(weight_[w], count_[w], weight_[l], count_[l], time,
                                 keep == path_is_left);
      const double sibling_expiry = expiry_[(leaf >> k) ^ 1];
      below = std::min({below, own, sibling_expiry});
      const size_t parent = leaf >> (k + 1);
      winner_[parent] = win;
      expiry_[parent] = below;
      current = win;
      current_key = keep ? current_key : other_key;
    }
    return static_cast<size_t>(current);
  }

  // Brings an off-path subtree up to date: every node in it whose subtree holds an expired
  // certificate is recomputed, children first.
  void refresh(size_t v, double time) {
    if (v >= leaves_ || expiry_[v] > time) return;
    refresh(2 * v, time);
    refresh(2 * v + 1, time);
    recompute(v, time);
  }

  void recompute(size_t v, double time) {
    const int32_t a = winner_[2 * v];
    const int32_t b = winner_[2 * v + 1];
    const auto ia = static_cast<size_t>(a);
    const auto ib = static_cast<size_t>(b);
    const bool left_wins = key(weight_[ia], count_[ia], time) >= key(weight_[ib], count_[ib], time);
    const size_t w = left_wins ? ia : ib;
    const size_t l = left_wins ? ib : ia;
    const double own = certify(weight_[w], count_[w], weight_[l], count_[l], time, left_wins);
    winner_[v] = left_wins ? a : b;
    expiry_[v] = std::min({own, expiry_[2 * v], expiry_[2 * v + 1]});
  }

  static constexpr size_t kMaxDepth = 40;
  int32_t dead_;
  size_t depth_ = 0;
  size_t leaves_ = 1;
  std::vector<double> weight_;   // per dataset, then the sentinel's 0
  std::vector<double> count_;    // per dataset (exact: far below 2^53), then the sentinel's +inf
  std::vector<int32_t> winner_;  // per node
  std::vector<double> expiry_;   // per node: min certificate in its subtree (leaves: never)
};

constexpr size_t kScanWays = 4;  // independent running maxima

// The first d < lanes (a multiple of kScanWays) with the largest weight[d] * time - count[d]:
// megatron's scan, computed as kScanWays interleaved scans whose running maxima do not wait on
// each other. Each keeps the first index holding its maximum (strict >), so the answer is the
// smallest index among those holding the overall maximum.
inline size_t scan_first_max(const double* weight, const double* count, size_t lanes,
                             double time) {
  if (lanes <= 2 * kScanWays) {
    // Few datasets: megatron's own loop is faster than merging interleaved maxima (measured).
    size_t first = 0;
    double top = key(weight[0], count[0], time);
    for (size_t d = 1; d < lanes; ++d) {
      const double k = key(weight[d], count[d], time);
      if (k > top) {
        top = k;
        first = d;
      }
    }
    return first;
  }
  double best[kScanWays];
  size_t where[kScanWays];
  for (size_t a = 0; a < kScanWays; ++a) {
    best[a] = -kNever;
    where[a] = a;
  }
  for (size_t d = 0; d < lanes; d += kScanWays) {
    for (size_t a = 0; a < kScanWays; ++a) {
      const double k = key(weight[d + a], count[d + a], time);
      // A mask, not a branch: the running maximum changes unpredictably, and GCC otherwise
      // branches on it (measured 1.3x slower at 100 datasets).
      const size_t take = size_t{0} - static_cast<size_t>(k > best[a]);
      where[a] = (where[a] & ~take) | ((d + a) & take);
      best[a] = k > best[a] ? k : best[a];
    }
  }
  double top = best[0];
  for (size_t a = 1; a < kScanWays; ++a) top = best[a] > top ? best[a] : top;
  size_t first = lanes;
  for (size_t a = 0; a < kScanWays; ++a) {
    if (best[a] == top && where[a] < first) first = where[a];
  }
  return first;
}

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


// ---- The active set ----------------------------------------------------------------------------
//
// Measured on lognormal and uniform weights that sum to 1: the keys of all datasets stay spread
// over about [-0.5, 0.5], but the winning key stays in a narrow band (0.44-0.54 at 1000 datasets,
// 0.39-0.65 at 100). So with a threshold L just under that band, only the few datasets whose key
// is >= L can win, and each of them is scanned, not the n.
//
// Invariant: every dataset outside the active set A has key < L at the current time. Then, if the
// largest key in A is >= L, it is the largest key overall and no dataset outside A ties with it:
// the first dataset holding it in A (lowest index) is megatron's choice. Otherwise the sample is
// decided by a full scan of all n datasets (a fallback), L is lowered below the key that won, and
// A is rebuilt from scratch.
//
// A dataset whose key drops below L after a sample leaves A, and a calendar (a ring of buckets
// indexed by sample, plus a min-heap for the far future) brings it back at a time tau computed
// early, so that its key is < L at every time before tau (schedule() has the proof). Keys are
// non-decreasing in t (both roundings are monotone), so entering early only makes A larger. A
// dataset whose tau is beyond the last sample never comes back (unless L is lowered: the rebuild
// looks at everyone).
//
// L adapts: after every window of samples it is raised to (the smallest winning key in that
// window) - margin, evicting the members of A below it. Raising L keeps the invariant (a key < old
// L is < new L). A fallback doubles the margin; every quiet window shrinks it a little, so
// fallbacks stay rare (each costs O(n)).
//
// Decisions are taken only by comparing exact keys fl(fl(w * t) - c); L, tau and the margin only
// decide which datasets are looked at. Costs: |A| keys per sample (A scanned as contiguous
// struct-of-arrays with SSE2, or AVX2 when the CPU has it), plus O(1) calendar work per sample.
//
// With AVX-512 and greedy blending, samples go in blocks of 2^shift_ (32) samples, which are also
// the calendar's buckets: at a block's start everything due in the block enters A, so every
// dataset outside A has key < L during the whole block, and decide_block() decides the block's
// samples with A held in registers (weights, counts; up to kDecideMaxSlots slots). Winners stay in
// A until the block ends (their keys only fell: harmless). At the block's end compact() evicts
// every member below L, eight lanes at a time (re-entry times computed as vectors), and compresses
// A in place. A sample the kernel cannot prove (largest key in A below L, or equal largest keys
// in several slots) goes through the per-sample step, as without AVX-512.
// By Little's law |A| is about n x (mean winning key - L), a few dozen at n = 1000. Equal weights
// have a winning band as wide as [0, 1), so A holds about half of the datasets: there the
// greedy kernel hands over to the tree once A stays large, for a span of samples (doubling).

constexpr size_t kActiveMinDatasets = 48;  // below this, the plain scan is as fast (measured)
constexpr size_t kDefaultWindow = 1024;
constexpr double kDefaultMargin = 0.02;
constexpr double kMaxMargin = 0.5;

inline size_t round_up(size_t value, size_t step) { return (value + step - 1) / step * step; }

// The vector operations the active set needs, per instruction set. Keys are computed exactly as
// key() does (a rounded product, then a rounded difference: no FMA here either).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TOKENMILL_BLEND_X86 1
#endif

#ifdef TOKENMILL_BLEND_X86
namespace sse2 {  // baseline x86-64
struct Simd {
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
#include "blending_active.inc"
}  // namespace sse2

// The same code compiled for AVX2, chosen at run time (wheels stay baseline x86-64). Functions
// defined before this region (the standard library's templates, key()) keep their own target.
#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
struct Simd {
  using V = __m256d;
  static constexpr size_t kWidth = 4;
  static V set1(double x) { return _mm256_set1_pd(x); }
  static V max(V a, V b) { return _mm256_max_pd(a, b); }
  static V keys(const double* w, const double* c, size_t k, V t) {
    return _mm256_sub_pd(_mm256_mul_pd(_mm256_load_pd(w + k), t), _mm256_load_pd(c + k));
  }
  static uint32_t equal(V a, V b) {
    return static_cast<uint32_t>(_mm256_movemask_pd(_mm256_cmp_pd(a, b, _CMP_EQ_OQ)));
  }
  static double hmax(V a) {
    __m128d h = _mm_max_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_max_pd(h, _mm_unpackhi_pd(h, h)));
  }
  static void set_lane(double* chunk, size_t lane, double value) {
    const __m256d mask = _mm256_castsi256_pd(_mm256_cmpeq_epi64(
        _mm256_set1_epi64x(static_cast<int64_t>(lane)), _mm256_setr_epi64x(0, 1, 2, 3)));
    _mm256_store_pd(chunk, _mm256_blendv_pd(_mm256_load_pd(chunk), _mm256_set1_pd(value), mask));
  }
};
#include "blending_active.inc"
}  // namespace avx2
#pragma GCC pop_options

// AVX-512: the same active set, plus the register kernel below that decides whole blocks of
// samples without touching memory on the critical path.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl")
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_pd(), which it then reports as
// maybe-uninitialized (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace avx512 {
struct Simd {
  using V = __m512d;
  static constexpr size_t kWidth = 8;
  static V set1(double x) { return _mm512_set1_pd(x); }
  static V max(V a, V b) { return _mm512_max_pd(a, b); }
  static V keys(const double* w, const double* c, size_t k, V t) {
    return _mm512_sub_pd(_mm512_mul_pd(_mm512_load_pd(w + k), t), _mm512_load_pd(c + k));
  }
  static uint32_t equal(V a, V b) { return _mm512_cmp_pd_mask(a, b, _CMP_EQ_OQ); }
  static double hmax(V a) {
    a = _mm512_max_pd(a, _mm512_shuffle_f64x2(a, a, 0x4E));
    a = _mm512_max_pd(a, _mm512_shuffle_f64x2(a, a, 0xB1));
    return _mm512_cvtsd_f64(_mm512_max_pd(a, _mm512_permute_pd(a, 0x55)));
  }
  static void set_lane(double* chunk, size_t lane, double value) {
    _mm512_store_pd(chunk, _mm512_mask_mov_pd(_mm512_load_pd(chunk),
                                              static_cast<__mmask8>(1u << lane),
                                              _mm512_set1_pd(value)));
  }
};

// The largest of keys [B, E), by a tree of vertical maxima (short dependency chain).
template <int B, int E>
inline __m512d max_range(const __m512d* k) {
  if constexpr (E - B == 1) {
    return k[B];
  } else {
    return _mm512_max_pd(max_range<B, (B + E) / 2>(k), max_range<(B + E) / 2, E>(k));
  }
}

// The register kernel. Slots [0, 8 NV) of `w` / `c` (64-byte aligned; unused slots have count
// +inf, so key -inf) hold the datasets `member[slot]`; every dataset not among them has key < L
// at every sample in [begin, end). Decides samples begin, begin + 1, ... while each is provably
// megatron's choice, and returns the first sample it did not decide (end, or a sample whose
// largest key is < L: the caller decides that one).
//
// Per sample, the keys of all slots are computed exactly as key() does (rounded product, then
// rounded difference) from weights and counts held in registers; their maximum is broadcast to
// every lane and compared for equality. If it is >= L, every dataset holding it is in A. If
// exactly one slot holds it, that slot is megatron's choice whatever the index order, and the
// equality mask is exactly the winner's one-hot mask. Otherwise (equal keys, rare except for
// equal weights) the lowest dataset among the slots holding it wins: the first such slot when
// `ordered` (slots in dataset order), else the one with the lowest `member`.
//
// The next sample depends on this one only through that mask: its keys are computed both with
// the current counts and with one more (both exact, independent of the decision), and the mask
// selects per lane. The chain per sample is thus blend, max tree, three shuffles, compare. The
// slot number, the outputs and the counts in memory (`c[slot]`, `count[member[slot]]`) are
// computed off that chain.
template <int NV, typename IndexT>
size_t decide_block(const double* w, double* c, double* count, const int32_t* member,
                    const double* limit, double L, size_t begin, size_t end, IndexT* ids,
                    int64_t* positions, double& lowest, bool ordered) {
  __m512d weight[NV];
  __m512d cnt[NV];
  for (int j = 0; j < NV; ++j) {
    weight[j] = _mm512_load_pd(w + 8 * j);
    cnt[j] = _mm512_load_pd(c + 8 * j);
  }
  const __m512d one = _mm512_set1_pd(1.0);
  __m512d low = _mm512_set1_pd(lowest);
  // The previous sample's winner (one-hot; none before the first sample).
  __mmask8 last[NV];
  for (int j = 0; j < NV; ++j) last[j] = 0;
  size_t i = begin;
  for (; i < end; ++i) {
    const __m512d t = _mm512_set1_pd(static_cast<double>(i > 1 ? i : 1));
    // Keys with the counts before the previous sample, and with one more: both exact keys
    // computed without waiting for the previous decision, which only picks, per lane, which of
    // the two is current (counts are integers below 2^53, so count + 1 is exact).
    __m512d k[NV];
    for (int j = 0; j < NV; ++j) {
      const __m512d product = _mm512_mul_pd(weight[j], t);
      const __m512d plus = _mm512_add_pd(cnt[j], one);
      k[j] = _mm512_mask_blend_pd(last[j], _mm512_sub_pd(product, cnt[j]),
                                  _mm512_sub_pd(product, plus));
      cnt[j] = _mm512_mask_blend_pd(last[j], cnt[j], plus);
    }
    __m512d m = max_range<0, NV>(k);
    m = _mm512_max_pd(m, _mm512_shuffle_f64x2(m, m, 0x4E));
    m = _mm512_max_pd(m, _mm512_shuffle_f64x2(m, m, 0xB1));
    m = _mm512_max_pd(m, _mm512_permute_pd(m, 0x55));
    __mmask8 hit[NV];
    uint64_t bits = 0;  // slots 0-63
    uint64_t high = 0;  // slots 64-95
    for (int j = 0; j < NV; ++j) {
      hit[j] = _mm512_cmp_pd_mask(k[j], m, _CMP_EQ_OQ);
      if (j < 8) {
        bits |= static_cast<uint64_t>(hit[j]) << (8 * (j & 7));
      } else {
        high |= static_cast<uint64_t>(hit[j]) << (8 * (j & 7));
      }
    }
    const double best = _mm512_cvtsd_f64(m);
    // Exactly one slot: a power of two in one of the two words, zero in the other.
    const uint64_t either = bits | high;
    if (__builtin_expect(!(best >= L) || !(best > -kNever) || (either & (either - 1)) != 0 ||
                             (bits != 0 && high != 0),
                         0)) {
      if (!(best >= L) || !(best > -kNever)) break;
      // Equal largest keys in several slots: megatron's choice is the lowest dataset among them,
      // the first slot when slots are in dataset order.
      if (ordered) {
        if (bits != 0) {
          bits &= ~bits + 1;
          high = 0;
        } else {
          high &= ~high + 1;
        }
      } else {
        size_t chosen = 0;
        int32_t lowest_id = std::numeric_limits<int32_t>::max();
        for (uint64_t rest = bits; rest != 0; rest &= rest - 1) {
          const auto at = static_cast<size_t>(__builtin_ctzll(rest));
          if (member[at] < lowest_id) {
            lowest_id = member[at];
            chosen = at;
          }
        }
        for (uint64_t rest = high; rest != 0; rest &= rest - 1) {
          const auto at = 64 + static_cast<size_t>(__builtin_ctzll(rest));
          if (member[at] < lowest_id) {
            lowest_id = member[at];
            chosen = at;
          }
        }
        bits = chosen < 64 ? uint64_t{1} << chosen : 0;
        high = chosen < 64 ? 0 : uint64_t{1} << (chosen - 64);
      }
      for (int j = 0; j < NV; ++j) {
        hit[j] = static_cast<__mmask8>(j < 8 ? bits >> (8 * (j & 7)) : high >> (8 * (j & 7)));
      }
    }
    for (int j = 0; j < NV; ++j) last[j] = hit[j];
    const auto slot = bits != 0 ? static_cast<size_t>(__builtin_ctzll(bits))
                                : 64 + static_cast<size_t>(__builtin_ctzll(high));
    const auto d = static_cast<size_t>(member[slot]);
    const double before = c[slot];
    ids[i] = static_cast<IndexT>(d);
    positions[i] = static_cast<int64_t>(before);
    c[slot] = before + 1.0;
    count[d] = before + 1.0;
    low = _mm512_min_pd(low, m);
    // Exhaustive: a spent dataset leaves the blend, which the caller does before going on. Off
    // the chain, and taken once per dataset.
    if (limit != nullptr && __builtin_expect(before + 1.0 >= limit[slot], 0)) {
      ++i;
      break;
    }
  }
  lowest = _mm512_cvtsd_f64(low);
  return i;
}

// decide_block for the smallest NV that covers `slots` (1 to kDecideMaxSlots slots).
template <typename IndexT>
size_t decide(size_t slots, const double* w, double* c, double* count, const int32_t* member,
              const double* limit, double L, size_t begin, size_t end, IndexT* ids,
              int64_t* positions, double& lowest, bool ordered) {
  switch ((slots + 7) / 8) {
    case 1:
      return decide_block<1>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 2:
      return decide_block<2>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 3:
      return decide_block<3>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 4:
      return decide_block<4>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 5:
      return decide_block<5>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 6:
      return decide_block<6>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 7:
      return decide_block<7>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 8:
      return decide_block<8>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 9:
      return decide_block<9>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 10:
      return decide_block<10>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    case 11:
      return decide_block<11>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
    default:
      return decide_block<12>(w, c, count, member, limit, L, begin, end, ids, positions, lowest,
                              ordered);
  }
}
constexpr size_t kDecideMaxSlots = 96;

#define TOKENMILL_BLEND_FAST 1
#include "blending_active.inc"
#undef TOKENMILL_BLEND_FAST

// Greedy blending of at most kDecideMaxSlots datasets by the register kernel alone (every
// dataset is a slot, L = -inf). A sample it cannot decide (equal largest keys) takes the plain
// scan, which picks the lowest index.
template <typename IndexT>
void register_scan(std::span<const double> weights, std::vector<double>& initial, size_t start,
                   std::span<IndexT> ids, std::span<int64_t> positions) {
  struct alignas(64) Chunk {
    double v[8];
  };
  const size_t n = weights.size();
  std::vector<Chunk> w((n + 7) / 8);
  std::vector<Chunk> c((n + 7) / 8);
  std::vector<int32_t> member(w.size() * 8);
  for (size_t s = 0; s < w.size() * 8; ++s) {
    w[s / 8].v[s % 8] = s < n ? weights[s] : 0.0;
    c[s / 8].v[s % 8] = s < n ? initial[s] : kNever;
    member[s] = static_cast<int32_t>(s);
  }
  double* const counts = c.data()->v;
  double lowest = kNever;
  for (size_t i = start; i < ids.size();) {
    i = decide(n, w.data()->v, counts, counts, member.data(), nullptr, -kNever, i, ids.size(),
               ids.data(), positions.data(), lowest, true);
    if (i == ids.size()) break;
    const size_t d = scan_first_max(w.data()->v, counts, w.size() * 8,
                                    static_cast<double>(std::max<size_t>(i, 1)));
    ids[i] = static_cast<IndexT>(d);
    positions[i] = static_cast<int64_t>(counts[d]);
    counts[d] += 1.0;
    ++i;
  }
  for (size_t d = 0; d < n; ++d) initial[d] = counts[d];
}
}  // namespace avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
#else
namespace portable {
struct Simd {
  using V = double;
  static constexpr size_t kWidth = 1;
  static V set1(double x) { return x; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V keys(const double* w, const double* c, size_t k, V t) { return key(w[k], c[k], t); }
  static uint32_t equal(V a, V b) { return a == b ? 1u : 0u; }
  static double hmax(V a) { return a; }
  static void set_lane(double* chunk, size_t, double value) { chunk[0] = value; }
};
#include "blending_active.inc"
}  // namespace portable
#endif

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

// The same with the kinetic tournament tree.
template <typename IndexT>
size_t tree_from(std::span<const double> weights, std::span<const double> limits,
                 std::vector<double>& counts, size_t start, std::span<IndexT> ids,
                 std::span<int64_t> positions) {
  const size_t samples = ids.size();
  if (start >= samples) return start;
  KineticTournament tree(weights);
  size_t alive = 0;
  for (size_t d = 0; d < weights.size(); ++d) {
    if (counts[d] == kNever) {
      tree.kill(d);
    } else {
      tree.set_count(d, counts[d]);
      ++alive;
    }
  }
  if (alive == 0) return start;
  size_t d = tree.first_winner(static_cast<double>(std::max<size_t>(start, 1)));
  for (size_t i = start;;) {
    ids[i] = static_cast<IndexT>(d);
    positions[i] = static_cast<int64_t>(counts[d]);
    counts[d] += 1.0;
    if (counts[d] >= limits[d]) {
      counts[d] = kNever;
      tree.kill(d);
      if (--alive == 0) return i + 1;
    }
    if (++i == samples) return samples;
    d = tree.next_winner(d, counts[d], static_cast<double>(i));
  }
}

// The active set from sample `start` and `counts`; returns where it stopped (see
// ActiveBlend::run) and leaves the counts there in `counts`.
template <typename Active, typename IndexT>
size_t run_active(std::span<const double> weights, std::span<const double> limits,
                  const BlendingOptions& options, size_t start, std::span<IndexT> ids,
                  std::span<int64_t> positions, bool may_hand_over, std::vector<double>& counts) {
  Active active(weights, std::vector<double>(limits.begin(), limits.end()), counts, start,
                ids.size(), options);
  const size_t end = active.run(ids, positions, may_hand_over);
  for (size_t d = 0; d < weights.size(); ++d) counts[d] = active.count(d);
  return end;
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
#ifdef TOKENMILL_BLEND_X86
  if (path == Path::kScanSimd && greedy && n <= avx512::kDecideMaxSlots && has_avx512()) {
    avx512::register_scan(weights, counts, start, ids, positions);
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
#ifdef TOKENMILL_BLEND_X86
    size_t end = 0;
    if (path == Path::kActive && has_avx512()) {
      end = run_active<avx512::ActiveBlend>(weights, limits, options, at, ids, positions,
                                            may_hand_over, counts);
    } else if (path != Path::kActiveBaseline && has_avx2()) {
      end = run_active<avx2::ActiveBlend>(weights, limits, options, at, ids, positions,
                                          may_hand_over, counts);
    } else {
      end = run_active<sse2::ActiveBlend>(weights, limits, options, at, ids, positions,
                                          may_hand_over, counts);
    }
#else
    const size_t end = run_active<portable::ActiveBlend>(weights, limits, options, at, ids,
                                                         positions, may_hand_over, counts);
#endif
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
// limits), all chunks on their own threads. Started from a guess, a chunk's run is the true
// run as soon as its counts equal the true counts at the same sample: from there on both runs
// are the same function of the same state. Measured, a guess differs from the truth in a few
// counts at 1000 datasets and the two runs meet within a few dozen samples.
//
// After the threads join, every chunk is repaired in order: with the true counts at its first
// sample (the previous chunk's, once repaired), the true run is recomputed over growing spans
// (overwriting the guessed run's output) until its counts equal the guessed run's counts at the
// same sample. Those are the guessed counts advanced over the guessed run's own output, read
// before it is overwritten. If they never meet, the chunk is recomputed whole (as slow as one
// thread, still exact). Every output sample is thus either recomputed from the true state or
// decided from a state proven equal to it: the output is the single-threaded output, bit for
// bit (tests/test_blending_kernels.py forces tiny chunks and bad guesses to check it).

// Samples per chunk below which threads are not worth starting (a thread start and a repair cost
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
  size_t threads = options.threads;
  if (threads == 0) {
    threads = std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), 8));
    threads = std::min(threads, std::max<size_t>(1, samples / kMinChunk));
  }
  threads = std::min(threads, std::max<size_t>(1, samples));
  if (threads <= 1) {
    blend_range(weights, limits, zero, 0, ids, positions, options);
    return;
  }
  std::vector<size_t> bounds(threads + 1);
  for (size_t p = 0; p <= threads; ++p) bounds[p] = samples / threads * p;
  bounds[threads] = samples;
  std::vector<std::vector<double>> guessed(threads);
  std::vector<std::vector<double>> finals(threads);
  std::vector<size_t> ends(threads);
  // An exception (std::bad_alloc) must not escape a thread (std::terminate): kept, rethrown here.
  std::vector<std::exception_ptr> errors(threads);
  auto run_chunk = [&](size_t p) {
    try {
      guessed[p] = p == 0 ? zero
                   : options.guess_zero ? zero
                                        : guess_counts(weights, limits, bounds[p]);
      finals[p] = guessed[p];
      ends[p] = blend_range(weights, limits, finals[p], bounds[p], ids.first(bounds[p + 1]),
                            positions, options);
    } catch (...) {
      errors[p] = std::current_exception();
    }
  };
  {
    std::vector<std::thread> workers;
    workers.reserve(threads - 1);
    for (size_t p = 1; p < threads; ++p) workers.emplace_back(run_chunk, p);
    run_chunk(0);
    for (std::thread& worker : workers) worker.join();
  }
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  // Chunk 0 is exact; each later chunk is repaired from the true counts at its start.
  std::vector<double> truth = std::move(finals[0]);
  size_t reached = ends[0];
  for (size_t p = 1; p < threads; ++p) {
    if (reached < bounds[p]) return;  // every dataset spent before this chunk: the blend ended
    truth = repair(weights, limits, std::move(truth), std::move(guessed[p]), std::move(finals[p]),
                   ends[p], bounds[p], bounds[p + 1], ids, positions, options, reached);
  }
}

}  // namespace

template <typename IndexT>
void build_blending_indices(std::span<const double> weights, std::span<IndexT> dataset_index,
                            std::span<int64_t> dataset_sample_index,
                            const BlendingOptions& options) {
  const size_t samples = std::min(dataset_index.size(), dataset_sample_index.size());
  if (weights.empty() || samples == 0) return;
  const std::vector<double> limits(weights.size(), kNever);
  blend(weights, std::span<const double>(limits), dataset_index.first(samples),
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
  blend(std::span<const double>(weights), std::span<const double>(limits),
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
