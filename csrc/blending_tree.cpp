// The kinetic tournament tree: the blending kernel that takes over from the active set when that
// stays large (equal weights), and the one tests force with path "tree".
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
// keys with the exact expression key() and compares them exactly. A certificate only says when
// to look again and is computed conservatively (see certify()), so for every integer time before
// it the floating-point comparison has the same outcome. When the margin cannot be shown (nearly
// equal weights) the node is re-examined at the next sample: slower, still exact.
//
// Exhaustive blending is the same tree with weights sizes[d] / total; a dataset whose count
// reaches its size points its leaf at a sentinel that never wins, which is megatron's removal
// from its set.
//
// Cost: O(log n) per sample for the path plus the expired certificates; measured in
// benchmarks/BLENDING.md. Compiled with -ffp-contract=off like every blending unit.
#include "blending_internal.hpp"

#include <algorithm>

namespace tokenmill::blending {
namespace {

// 32 units of roundoff (u = 2^-53); see certify().
constexpr double kMargin = 0x1p-48;
// Absorbs the absolute error of a product that underflows into the subnormal range.
constexpr double kTiny = 0x1p-1000;

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

}  // namespace

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

template size_t tree_from<int16_t>(std::span<const double>, std::span<const double>,
                                   std::vector<double>&, size_t, std::span<int16_t>,
                                   std::span<int64_t>);
template size_t tree_from<int32_t>(std::span<const double>, std::span<const double>,
                                   std::vector<double>&, size_t, std::span<int32_t>,
                                   std::span<int64_t>);

}  // namespace tokenmill::blending
