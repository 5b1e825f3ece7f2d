// The active set compiled for AVX-512 (F, DQ, BW, VL; this file is built with -mavx512* on
// x86-64 only, see CMakeLists.txt), plus the register kernel decide_block() that decides whole
// blocks of samples without touching memory on the critical path, and the register scan of small
// greedy blends. Chosen at run time by blending.cpp when the CPU has AVX-512. Keys are computed
// exactly as key() does (no FMA: -ffp-contract=off). Nothing here has external linkage but the
// entry points: see blending_internal.hpp.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "blending_internal.hpp"

namespace tokenmill::blending {
namespace {

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
    if (ordered) {
      // Slots in dataset order: the winner is the first slot holding the largest key, unique or
      // tied alike, so ties take no branch. Equal weights tie at nearly every sample (all the
      // datasets not yet drawn in the current round share one key): a tie branch there was
      // mispredicted often enough to make 10 equal weights slower than megatron-core's scan.
      if (__builtin_expect(!(best >= L) || !(best > -kNever), 0)) break;
      const uint64_t first_low = bits & (~bits + 1);
      high = bits != 0 ? 0 : high & (~high + 1);
      bits = first_low;
      for (int j = 0; j < NV; ++j) {
        hit[j] = static_cast<__mmask8>(j < 8 ? bits >> (8 * (j & 7)) : high >> (8 * (j & 7)));
      }
    } else if (const uint64_t either = bits | high;
               // Exactly one slot: a power of two in one of the two words, zero in the other.
               __builtin_expect(!(best >= L) || !(best > -kNever) || (either & (either - 1)) != 0 ||
                             (bits != 0 && high != 0),
                         0)) {
      if (!(best >= L) || !(best > -kNever)) break;
      // Equal largest keys in several slots: megatron's choice is the lowest dataset among them.
      {
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
static_assert(kDecideMaxSlots == kRegisterScanMaxDatasets);

#define TOKENMILL_BLEND_FAST 1
#include "blending_active.inc"
#undef TOKENMILL_BLEND_FAST

// Greedy blending of at most kDecideMaxSlots datasets by the register kernel alone (every
// dataset is a slot, L = -inf). A sample it cannot decide (equal largest keys) takes the plain
// scan, which picks the lowest index.
template <typename IndexT>
void register_scan(const ActiveRun<IndexT>& run) {
  struct alignas(64) Chunk {
    double v[8];
  };
  const size_t n = run.datasets;
  Vector<Chunk> w((n + 7) / 8);
  Vector<Chunk> c((n + 7) / 8);
  Vector<int32_t> member(w.size() * 8);
  for (size_t s = 0; s < w.size() * 8; ++s) {
    w[s / 8].v[s % 8] = s < n ? run.weights[s] : 0.0;
    c[s / 8].v[s % 8] = s < n ? run.counts[s] : kNever;
    member[s] = static_cast<int32_t>(s);
  }
  double* const counts = c.data()->v;
  double lowest = kNever;
  for (size_t i = run.start; i < run.samples;) {
    i = decide(n, w.data()->v, counts, counts, member.data(), nullptr, -kNever, i, run.samples,
               run.ids, run.positions, lowest, true);
    if (i == run.samples) break;
    const size_t d = scan_first_max(w.data()->v, counts, w.size() * 8,
                                    static_cast<double>(i > 1 ? i : 1));
    run.ids[i] = static_cast<IndexT>(d);
    run.positions[i] = static_cast<int64_t>(counts[d]);
    counts[d] += 1.0;
    ++i;
  }
  for (size_t d = 0; d < n; ++d) run.counts[d] = counts[d];
}

}  // namespace

size_t run_active_avx512(const ActiveRun<int16_t>& run) { return run_active_set(run); }
size_t run_active_avx512(const ActiveRun<int32_t>& run) { return run_active_set(run); }
void register_scan_avx512(const ActiveRun<int16_t>& run) { register_scan(run); }
void register_scan_avx512(const ActiveRun<int32_t>& run) { register_scan(run); }

}  // namespace tokenmill::blending
