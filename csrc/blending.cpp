// Blending kernels: megatron-core's greedy rule, computed with a kinetic tournament tree.
//
// The rule (blending.hpp): at sample i with t = max(i, 1), pick the first dataset with the
// strictly largest key(d, t) = fl(fl(w[d] * t) - count[d]). Megatron scans all n datasets per
// sample, O(samples x n).
//
// Here the datasets are the leaves of a complete binary tree. Every internal node holds the
// winner of its subtree at the time it was last computed, under the total order "larger key
// wins, equal keys go to the lower index" (the left child always holds the lower indices, so the
// root winner is exactly megatron's first strict maximum). Between two samples only the chosen
// dataset's count changes; time moves every node's keys, but along straight lines, so each node
// also stores a certificate: a time before which its loser cannot catch its winner while their
// counts stay fixed. A sample then costs:
//   * the path from the chosen leaf to the root, recomputed (O(log n));
//   * every node whose certificate expired, recomputed (amortised few per sample for realistic
//     weights, because a node's winner changes about as often as its subtree is sampled).
// `subtree_expiry[v]` is the minimum certificate in v's subtree, so expired nodes are found by a
// pruned descent from the root.
//
// Bit-identity: decisions are never taken from a certificate. Each recomputation evaluates both
// keys with the exact expression above and compares them exactly. A certificate only says when to
// look again, and it is computed conservatively: it asks the exact-arithmetic gap between the two
// lines to exceed 32 units of roundoff of every term (a proven bound on both keys' rounding
// error, plus the error of computing the certificate itself, is below 12), so for every integer
// time before it the floating-point comparison has the same outcome. When the margin cannot be
// shown (nearly equal weights, or values so large that products might overflow) the node is
// simply re-examined at the next sample, which is slower but still exact.
//
// Exhaustive blending is the same tree with weights sizes[d] / total; a dataset whose count
// reaches its size becomes a dead leaf that never wins, which is megatron's removal from its set.
//
// Floating-point contraction (FMA) would change the keys, so this file is compiled with
// -ffp-contract=off (CMakeLists.txt).
#include "blending.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace tokenmill {
namespace {

// Up to this many datasets the plain scan is as fast as the tree or faster (measured on random,
// equal and power-law weights; benchmarks/BLENDING.md).
constexpr size_t kScanMaxDatasets = 48;

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
constexpr int32_t kDead = -1;

// 32 units of roundoff (u = 2^-53). See the header comment for why 32 is ample.
constexpr double kMargin = 0x1p-48;
// Absorbs the absolute error of a product that underflows into the subnormal range.
constexpr double kTiny = 0x1p-1000;
// Certificates further out than this are treated as never expiring.
constexpr double kFar = 0x1p62;

inline double key(double weight, double count, double t) {
  // Exactly megatron's expression: the product is rounded, then the difference.
  return weight * t - count;
}

// First time after `t` at which the loser might beat the winner, given fixed counts.
// `winner_first`: the winner has the lower index, so it also wins ties.
inline int64_t certify(double w_win, double c_win, double w_lose, double c_lose, int64_t t,
                       bool winner_first) {
  // Equal weights give equal products at every t, and fl(p - c) is monotone in c, so the
  // comparison is settled by the counts alone for as long as they stay fixed.
  if (w_win == w_lose && winner_first && c_win <= c_lose) return kNever;
  // gap(t') = (w_win - w_lose) t' + (c_lose - c_win), required to exceed the margin
  // kMargin * ((w_win + w_lose) t' + c_win + c_lose); both sides are lines in t'.
  const double slope = (w_win - w_lose) - kMargin * (w_win + w_lose);
  const double offset = (c_lose - c_win) - kMargin * (c_win + c_lose) - kTiny;
  if (slope >= 0.0) {
    return slope * static_cast<double>(t + 1) + offset > 0.0 ? kNever : t + 1;
  }
  if (!(offset > 0.0)) return t + 1;
  const double crossing = offset / -slope * (1.0 - 0x1p-40);
  if (!(crossing < kFar)) return kNever;
  const auto until = static_cast<int64_t>(crossing);
  return until > t + 1 ? until : t + 1;
}

// The tournament tree over n datasets; see the file comment. Each node keeps a copy of its
// winner's weight and count, so recomputing a node reads only its two adjacent children.
class KineticTournament {
 public:
  explicit KineticTournament(std::span<const double> weights) {
    leaves_ = 1;
    while (leaves_ < weights.size()) leaves_ *= 2;
    nodes_.resize(2 * leaves_);
    for (size_t d = 0; d < weights.size(); ++d) {
      nodes_[leaves_ + d] = Node{weights[d], 0.0, kNever, kNever, static_cast<int32_t>(d)};
    }
    // Every internal node starts expired, so the first refresh builds the whole tree.
    for (size_t v = 1; v < leaves_; ++v) nodes_[v].own_expiry = nodes_[v].subtree_expiry = 0;
  }

  // The winner at time t, after refreshing every node that needs it.
  size_t winner(int64_t t) {
    refresh(1, t, static_cast<double>(t));
    return static_cast<size_t>(nodes_[1].dataset);
  }

  // Count one sample of dataset d; returns the count before it.
  double take(size_t d) {
    const double before = nodes_[leaves_ + d].count;
    nodes_[leaves_ + d].count = before + 1.0;
    expire_path(d);
    return before;
  }

  // Remove a spent dataset from the competition (exhaustive blending).
  void kill(size_t d) {
    nodes_[leaves_ + d].dataset = kDead;
    expire_path(d);
  }

 private:
  struct Node {
    double weight = 0.0;  // of the winner
    double count = 0.0;   // of the winner; exact, counts stay far below 2^53
    int64_t own_expiry = kNever;      // this node's certificate
    int64_t subtree_expiry = kNever;  // min certificate in the subtree
    int32_t dataset = kDead;          // the winner, kDead for an empty subtree
  };

  void expire_path(size_t d) {
    for (size_t v = (leaves_ + d) >> 1; v >= 1; v >>= 1) {
      nodes_[v].own_expiry = 0;
      nodes_[v].subtree_expiry = 0;
    }
  }

  // Brings v's subtree up to date at time t; returns whether v's winner changed.
  bool refresh(size_t v, int64_t t, double time) {
    if (v >= leaves_ || nodes_[v].subtree_expiry > t) return false;
    const size_t left = 2 * v;
    // Both children must be refreshed: no short-circuit.
    const bool left_changed = refresh(left, t, time);
    const bool right_changed = refresh(left + 1, t, time);
    Node& node = nodes_[v];
    const Node& a = nodes_[left];
    const Node& b = nodes_[left + 1];
    bool changed = false;
    // A node whose certificate holds and whose children kept their winners is still right
    // (a count change only happens on the expired path).
    if (left_changed || right_changed || node.own_expiry <= t) {
      const int32_t before = node.dataset;
      const Node* win = &a;
      if (a.dataset == kDead || b.dataset == kDead) {
        if (a.dataset == kDead) win = &b;
        node.own_expiry = kNever;
      } else if (key(a.weight, a.count, time) >= key(b.weight, b.count, time)) {
        node.own_expiry = certify(a.weight, a.count, b.weight, b.count, t, true);
      } else {
        win = &b;
        node.own_expiry = certify(b.weight, b.count, a.weight, a.count, t, false);
      }
      node.weight = win->weight;
      node.count = win->count;
      node.dataset = win->dataset;
      changed = node.dataset != before;
    }
    int64_t expiry = node.own_expiry;
    if (left < leaves_) expiry = std::min({expiry, a.subtree_expiry, b.subtree_expiry});
    node.subtree_expiry = expiry;
    return changed;
  }

  size_t leaves_ = 1;
  std::vector<Node> nodes_;  // 1-based heap order; leaves at [leaves_, 2 * leaves_)
};

// True if some key could overflow or leave the range where the certificate bounds hold; such
// inputs take the plain scan, which is exact by construction.
bool needs_scan(std::span<const double> weights, size_t samples) {
  if (weights.size() <= kScanMaxDatasets) return true;
  const double max_weight = *std::max_element(weights.begin(), weights.end());
  return !(max_weight * static_cast<double>(std::max<size_t>(samples, 1)) < 0x1p900);
}

template <typename IndexT>
void scan_blending(std::span<const double> weights, std::span<IndexT> dataset_index,
                   std::span<int64_t> dataset_sample_index) {
  const size_t n = weights.size();
  std::vector<int64_t> counts(n, 0);
  for (size_t i = 0; i < dataset_index.size(); ++i) {
    const double t = static_cast<double>(std::max<size_t>(i, 1));
    size_t best = 0;
    double best_key = key(weights[0], static_cast<double>(counts[0]), t);
    for (size_t d = 1; d < n; ++d) {
      const double k = key(weights[d], static_cast<double>(counts[d]), t);
      if (k > best_key) {
        best_key = k;
        best = d;
      }
    }
    dataset_index[i] = static_cast<IndexT>(best);
    dataset_sample_index[i] = counts[best]++;
  }
}

template <typename IndexT>
void scan_exhaustive(std::span<const int64_t> sizes, std::span<const double> weights,
                     std::span<IndexT> dataset_index, std::span<int64_t> dataset_sample_index) {
  const size_t n = sizes.size();
  std::vector<int64_t> counts(n, 0);
  for (size_t i = 0; i < dataset_index.size(); ++i) {
    const double t = static_cast<double>(std::max<size_t>(i, 1));
    size_t best = n;
    double best_key = 0.0;
    for (size_t d = 0; d < n; ++d) {
      if (counts[d] >= sizes[d]) continue;
      const double k = key(weights[d], static_cast<double>(counts[d]), t);
      if (best == n || k > best_key) {
        best_key = k;
        best = d;
      }
    }
    if (best == n) return;  // every dataset spent: the caller sized the output wrongly
    dataset_index[i] = static_cast<IndexT>(best);
    dataset_sample_index[i] = counts[best]++;
  }
}

}  // namespace

template <typename IndexT>
void build_blending_indices(std::span<const double> weights, std::span<IndexT> dataset_index,
                            std::span<int64_t> dataset_sample_index) {
  const size_t samples = std::min(dataset_index.size(), dataset_sample_index.size());
  if (weights.empty() || samples == 0) return;
  if (needs_scan(weights, samples)) {
    scan_blending(weights, dataset_index.first(samples), dataset_sample_index.first(samples));
    return;
  }
  KineticTournament tree(weights);
  for (size_t i = 0; i < samples; ++i) {
    const size_t d = tree.winner(static_cast<int64_t>(std::max<size_t>(i, 1)));
    dataset_index[i] = static_cast<IndexT>(d);
    dataset_sample_index[i] = static_cast<int64_t>(tree.take(d));
  }
}

template <typename IndexT>
void build_exhaustive_blending_indices(std::span<const int64_t> sizes,
                                       std::span<IndexT> dataset_index,
                                       std::span<int64_t> dataset_sample_index) {
  const size_t n = sizes.size();
  int64_t total = 0;
  for (const int64_t size : sizes) total += size;
  std::vector<double> weights(n);
  for (size_t d = 0; d < n; ++d) {
    weights[d] = static_cast<double>(sizes[d]) / static_cast<double>(total);
  }
  const size_t samples = std::min(dataset_index.size(), dataset_sample_index.size());
  if (n == 0 || samples == 0) return;
  if (needs_scan(weights, samples)) {
    scan_exhaustive(sizes, weights, dataset_index.first(samples),
                    dataset_sample_index.first(samples));
    return;
  }
  KineticTournament tree(weights);
  size_t alive = 0;
  for (size_t d = 0; d < n; ++d) {
    if (sizes[d] > 0) {
      ++alive;
    } else {
      tree.kill(d);
    }
  }
  for (size_t i = 0; i < samples && alive > 0; ++i) {
    const size_t d = tree.winner(static_cast<int64_t>(std::max<size_t>(i, 1)));
    dataset_index[i] = static_cast<IndexT>(d);
    const double before = tree.take(d);
    dataset_sample_index[i] = static_cast<int64_t>(before);
    if (before + 1.0 >= static_cast<double>(sizes[d])) {
      tree.kill(d);
      --alive;
    }
  }
}

template void build_blending_indices<int16_t>(std::span<const double>, std::span<int16_t>,
                                              std::span<int64_t>);
template void build_blending_indices<int32_t>(std::span<const double>, std::span<int32_t>,
                                              std::span<int64_t>);
template void build_exhaustive_blending_indices<int16_t>(std::span<const int64_t>,
                                                         std::span<int16_t>, std::span<int64_t>);
template void build_exhaustive_blending_indices<int32_t>(std::span<const int64_t>,
                                                         std::span<int32_t>, std::span<int64_t>);

}  // namespace tokenmill
