"""Blending kernels: exact equality with the pure-Python references and with megatron-core.

The kernel takes a plain scan below 48 datasets, an active set with a re-entry calendar above,
and (greedy) hands over to a kinetic tournament tree for a while when the active set stays large;
large blends are split into speculative chunks on several threads and repaired to be exact.
The property tests draw blends on several sides of those lines, on the inputs where
floating-point rounding and ties decide the outcome: tiny weights, equal weights, exact binary
fractions; the active-set tests force each path (and fallbacks) through a private hook.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill import _core
from tokenmill._core import _testing
from tokenmill.index import blending
from tokenmill.index.blending import (
    INT16_MAX_DATASETS,
    build_blending_indices,
    build_exhaustive_blending_indices,
    dataset_index_dtype,
)
from tokenmill.index.cache_writes import BuildContext, build_context, current_context

from oracles import import_oracle, message
from reference import blending_indices_reference, exhaustive_blending_indices_reference

TREE_MIN_DATASETS = 129  # blends this large and above: the active set and its tree hand-over

# Weights on which rounding and ties matter, mixed with arbitrary ones.
special_weights = st.sampled_from([0.0, 1e-9, 1e-300, 0.5, 0.25, 0.125, 0.375, 1.0, 3.0, 0.1])
weight = st.one_of(special_weights, st.floats(0.0, 1.0), st.floats(0.0, 1e3))


@st.composite
def weight_vectors(draw: st.DrawFn) -> list[float]:
    n = draw(st.one_of(st.integers(1, 6), st.integers(TREE_MIN_DATASETS, 150)))
    style = draw(st.sampled_from(["free", "equal", "few-values", "normalised"]))
    if style == "equal":
        return [draw(weight)] * n
    if style == "few-values":  # many exact ties between datasets
        pool = draw(st.lists(weight, min_size=1, max_size=3))
        return [draw(st.sampled_from(pool)) for _ in range(n)]
    values = draw(st.lists(weight, min_size=n, max_size=n))
    if style == "normalised" and sum(values) > 0:
        array = np.asarray(values)
        return list(array / array.sum())  # as BlendedDataset does
    return values


def as_lists(result: tuple[np.ndarray, np.ndarray]) -> tuple[list[int], list[int]]:
    return result[0].tolist(), result[1].tolist()


@settings(deadline=None, max_examples=300)
@given(weights=weight_vectors(), size=st.one_of(st.integers(0, 2), st.integers(0, 300)))
def test_greedy_matches_reference(weights: list[float], size: int) -> None:
    got = as_lists(build_blending_indices(weights, size))
    assert got == blending_indices_reference(weights, size)


@settings(deadline=None, max_examples=150)
@given(
    sizes=st.one_of(
        st.lists(st.integers(1, 30), min_size=1, max_size=6),
        st.lists(st.integers(1, 4), min_size=TREE_MIN_DATASETS, max_size=150),
        st.integers(TREE_MIN_DATASETS, 150).flatmap(
            lambda n: st.integers(1, 3).map(lambda size: [size] * n)
        ),
    )
)
def test_exhaustive_matches_reference(sizes: list[int]) -> None:
    got = as_lists(build_exhaustive_blending_indices(sizes))
    assert got == exhaustive_blending_indices_reference(sizes)


def test_single_dataset_and_empty_blend() -> None:
    ids, positions = build_blending_indices([0.7], 5)
    assert ids.tolist() == [0] * 5
    assert positions.tolist() == [0, 1, 2, 3, 4]
    ids, positions = build_blending_indices([0.5, 0.5], 0)
    assert ids.shape == (0,)
    assert positions.shape == (0,)
    assert as_lists(build_exhaustive_blending_indices([1])) == ([0], [0])


def test_first_sample_uses_t_equal_one() -> None:
    # t = max(i, 1): samples 0 and 1 both see t = 1, so with equal weights the first two samples
    # come from datasets 0 and 1, and ties always go to the lower index.
    ids, positions = build_blending_indices([0.25] * 4, 8)
    assert ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert positions.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_outputs_are_a_valid_blend() -> None:
    rng = np.random.default_rng(7)
    weights = rng.dirichlet(np.ones(300))
    ids, positions = build_blending_indices(weights, 100_000)
    assert ids.dtype == np.int16
    assert positions.dtype == np.int64
    counts = np.bincount(ids, minlength=300)
    # Each dataset's positions are 0, 1, 2, ... in order of appearance.
    for d in (0, 17, 299):
        assert positions[ids == d].tolist() == list(range(counts[d]))
    # The greedy keeps every dataset within one sample of its share, give or take.
    assert np.all(np.abs(counts - weights * 100_000) <= 2)


def direct_rule(
    weights: npt.NDArray[np.float64], size: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The greedy rule with numpy: w * t - c elementwise in float64, argmax = first maximum."""
    counts = np.zeros(weights.size, dtype=np.int64)
    ids = np.empty(size, dtype=np.int64)
    positions = np.empty(size, dtype=np.int64)
    for i in range(size):
        best = int(np.argmax(weights * float(max(i, 1)) - counts.astype(np.float64)))
        ids[i] = best
        positions[i] = counts[best]
        counts[best] += 1
    return ids, positions


@pytest.mark.parametrize(
    "style", ["binary-fractions", "tiny", "near-equal", "two-values", "unnormalised"]
)
def test_tree_on_adversarial_weights(style: str) -> None:
    # Longer runs than the property tests, on a tree-sized blend, where rounding decides.
    rng = np.random.default_rng(len(style))
    n = 300
    if style == "binary-fractions":
        weights = rng.integers(1, 9, n) / 1024.0
    elif style == "tiny":
        weights = np.where(rng.random(n) < 0.1, 0.1, 1e-12)
    elif style == "near-equal":  # weights one or two ulps apart: certificates cannot help
        weights = np.nextafter(np.full(n, 1.0 / n), 1.0) * (1 + rng.integers(0, 3, n) * 2**-52)
    elif style == "two-values":
        weights = np.where(rng.random(n) < 0.5, 1 / 3, 2 / 3) / n
    else:
        weights = rng.integers(0, 5, n).astype(np.float64)
    ids, positions = build_blending_indices(weights, 6000)
    expected_ids, expected_positions = direct_rule(weights, 6000)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(positions, expected_positions)


def test_int32_output_above_int16_range() -> None:
    # More datasets than int16 can name: the wrapper switches to int32 and the values are the
    # same as the rule computed directly (numpy evaluates w * t - c elementwise in float64, and
    # argmax returns the first maximum).
    n = INT16_MAX_DATASETS + 300
    rng = np.random.default_rng(3)
    weights = rng.random(n)
    weights /= weights.sum()
    size = 3000
    ids, positions = build_blending_indices(weights, size)
    assert ids.dtype == np.int32
    expected_ids, expected_positions = direct_rule(weights, size)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(positions, expected_positions)
    assert ids.max() > np.iinfo(np.int16).max


@pytest.mark.parametrize("n", [3, 60, 500])
def test_int16_and_int32_outputs_agree(n: int) -> None:
    rng = np.random.default_rng(n)
    weights = rng.random(n)
    weights /= weights.sum()
    outputs = {}
    for dtype in (np.int16, np.int32):
        ids = np.empty(20_000, dtype=dtype)
        positions = np.empty(20_000, dtype=np.int64)
        _core.build_blending_indices(weights, ids, positions)
        outputs[dtype] = (ids.astype(np.int64), positions)
    np.testing.assert_array_equal(outputs[np.int16][0], outputs[np.int32][0])
    np.testing.assert_array_equal(outputs[np.int16][1], outputs[np.int32][1])


@pytest.mark.megatron
def test_dataset_index_dtype_follows_megatron_bound() -> None:
    """megatron-core's own BlendedDataset decides: the largest blend it accepts stores int16
    dataset ids, and tokenmill stores the same dtype there; one dataset more, megatron refuses
    (its assertion) and tokenmill switches to int32."""
    import types
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_dataset import BlendedDataset as TheirBlend
        from megatron.core.datasets.utils import Split as TheirSplit

    class Member:  # what megatron's BlendedDataset reads from a member dataset
        def __init__(self) -> None:
            self.index_split = TheirSplit.train
            self.unique_identifiers = {"class": "Member"}

        def __len__(self) -> int:
            return 3

    config = types.SimpleNamespace(
        path_to_cache=None,
        defer_npy_index_mmap=False,
        fast_cache_load=False,
        mid_level_dataset_surplus=0.0,
    )
    member = Member()

    def theirs(count: int) -> np.dtype:
        blend = TheirBlend([member] * count, [1.0] * count, 3, config)  # type: ignore[arg-type]
        return np.asarray(blend.dataset_index).dtype

    largest = INT16_MAX_DATASETS - 1
    for count in (1, 2, largest):
        assert np.dtype(dataset_index_dtype(count)) == theirs(count), count
    with pytest.raises(AssertionError):
        theirs(largest + 1)
    assert dataset_index_dtype(largest + 1) is np.int32


# --- bad inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ([0.5, -0.1], r"weights\[1\] must be finite and >= 0, got -0.1"),
        ([np.nan, 0.5], r"weights\[0\] must be finite and >= 0, got nan"),
        ([0.5, np.inf], r"weights\[1\] must be finite and >= 0, got inf"),
        ([], "weights must not be empty"),
        ([[0.5, 0.5]], r"weights must be 1-D, got shape \(1, 2\)"),
    ],
)
def test_bad_weights(weights: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_blending_indices(weights, 10)  # type: ignore[arg-type]


@pytest.mark.parametrize("weights", [["a", "b"], np.array([1 + 1j]), np.array([True, False])])
def test_weights_of_wrong_type(weights: object) -> None:
    with pytest.raises(TypeError, match="weights must be real numbers"):
        build_blending_indices(weights, 10)  # type: ignore[arg-type]


def test_bad_size() -> None:
    with pytest.raises(ValueError, match="size must be >= 0, got -1"):
        build_blending_indices([1.0], -1)
    with pytest.raises(TypeError):
        build_blending_indices([1.0], 2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ([3, 0], r"sizes\[1\] must be > 0, got 0"),
        ([-2, 3], r"sizes\[0\] must be > 0, got -2"),
        ([], "sizes must not be empty"),
        (np.array([2**63 - 1, 1], dtype=np.int64), "overflows int64"),
        (np.array([2**64 - 1], dtype=np.uint64), r"sizes\[0\] = 18446744073709551615 does not"),
    ],
)
def test_bad_sizes(sizes: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_exhaustive_blending_indices(sizes)  # type: ignore[arg-type]


def test_sizes_of_wrong_type() -> None:
    with pytest.raises(TypeError, match="sizes must be integers, got dtype float64"):
        build_exhaustive_blending_indices([1.0, 2.0])


def test_core_rejects_wrong_dtypes() -> None:
    ids = np.empty(4, dtype=np.int16)
    positions = np.empty(4, dtype=np.int64)
    with pytest.raises(TypeError, match="weights must have dtype float64, got float32"):
        _core.build_blending_indices(np.ones(2, dtype=np.float32), ids, positions)
    with pytest.raises(TypeError, match="dataset_index must be int16 or int32, got int64"):
        _core.build_blending_indices(np.ones(2), positions.copy(), positions)
    with pytest.raises(TypeError, match="dataset_sample_index must have dtype int64, got int32"):
        _core.build_blending_indices(np.ones(2), ids, np.empty(4, dtype=np.int32))
    with pytest.raises(TypeError, match="sizes must have dtype int64, got int32"):
        _core.build_exhaustive_blending_indices(np.ones(2, dtype=np.int32), ids, positions)


def test_core_rejects_mismatched_lengths() -> None:
    ids = np.empty(4, dtype=np.int16)
    with pytest.raises(ValueError, match="same length"):
        _core.build_blending_indices(np.ones(2), ids, np.empty(5, dtype=np.int64))
    with pytest.raises(ValueError, match=r"sum\(sizes\) = 5 entries, got 4"):
        _core.build_exhaustive_blending_indices(
            np.array([2, 3], dtype=np.int64), ids, np.empty(4, dtype=np.int64)
        )
    with pytest.raises(ValueError, match=r"weights\[0\] must be finite and >= 0, got nan"):
        _core.build_blending_indices(np.array([np.nan]), ids, np.empty(4, dtype=np.int64))


# --- differential tests against megatron-core --------------------------------------------------


def megatron_helpers() -> ModuleType:
    """megatron-core's compiled helpers, loaded without importing megatron (and torch)."""
    # Only the top-level package is imported: megatron.core would pull in torch (~4 s).
    megatron = import_oracle("megatron")
    folder = Path(next(iter(megatron.__path__))) / "core" / "datasets"
    found = sorted(folder.glob("helpers_cpp*.so"))
    if not found:  # a broken oracle: fails, never skips (tests/oracles.py)
        pytest.fail(message("megatron-core", f"no compiled helpers in {folder}"), pytrace=False)
    module_spec = importlib.util.spec_from_file_location("helpers_cpp", found[0])
    assert module_spec is not None
    assert module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def make_weights(kind: str, n: int, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    if kind == "uniform":
        raw = rng.random(n)
    elif kind == "equal":
        raw = np.ones(n)
    elif kind == "power-law":
        raw = 1.0 / np.arange(1, n + 1) ** 1.3
    elif kind == "lognormal":
        raw = rng.lognormal(0.0, 2.0, n)
    else:  # "tiny": a few datasets dominate, the rest are nearly starved
        raw = np.where(rng.random(n) < 0.05, 1.0, 1e-9)
    result: npt.NDArray[np.float64] = raw / raw.sum()
    return result


GREEDY_CASES = [
    (2, 300_000, "uniform"),
    (10, 1_000_000, "lognormal"),
    (100, 1_000_000, "uniform"),
    (129, 300_000, "equal"),
    (150, 300_000, "uniform"),
    (200, 500_000, "tiny"),
    (333, 300_000, "power-law"),
    (1000, 200_000, "uniform"),
    (1000, 200_000, "lognormal"),
    (2000, 300_000, "lognormal"),
    (60, 1_000_000, "lognormal"),
    (1000, 100_000, "equal"),
]


def assert_greedy_matches_megatron(
    helpers: ModuleType, weights: npt.NDArray[np.float64], size: int
) -> None:
    """tokenmill's greedy blend (the library path, then split over four threads) equals
    megatron-core's compiled helper."""
    expected_ids = np.empty(size, dtype=np.int16)
    expected_positions = np.empty(size, dtype=np.int64)
    helpers.build_blending_indices(
        expected_ids, expected_positions, weights, weights.shape[0], size, False
    )
    ids, positions = build_blending_indices(weights, size)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(positions, expected_positions)
    # The same split into speculative chunks on four threads.
    ids, positions = blend_with(weights, size, threads=4)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(positions, expected_positions)


@pytest.mark.megatron
@pytest.mark.parametrize(("n", "size", "kind"), GREEDY_CASES)
def test_greedy_matches_megatron(n: int, size: int, kind: str) -> None:
    helpers = megatron_helpers()
    weights = make_weights(kind, n, np.random.default_rng(n * 7919 + size))
    assert_greedy_matches_megatron(helpers, weights, size)


@pytest.mark.megatron
@pytest.mark.parametrize("seed", range(8))
def test_greedy_matches_megatron_random_shapes(seed: int) -> None:
    helpers = megatron_helpers()
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(2, 1001))
    size = int(rng.integers(1, 1_000_000 // max(1, n // 50) + 1))
    kind = str(rng.choice(["uniform", "equal", "power-law", "lognormal", "tiny"]))
    weights = make_weights(kind, n, rng)
    assert_greedy_matches_megatron(helpers, weights, size)


EXHAUSTIVE_CASES = [(3, 200_000), (60, 200_000), (130, 200_000), (1000, 100_000)]


@pytest.mark.megatron
@pytest.mark.parametrize(("n", "total"), EXHAUSTIVE_CASES)
def test_exhaustive_matches_megatron(n: int, total: int) -> None:
    helpers = megatron_helpers()
    rng = np.random.default_rng(n)
    shares = rng.lognormal(0.0, 1.5, n)
    sizes = np.maximum(1, np.round(shares / shares.sum() * total)).astype(np.int64)
    expected_ids = np.empty(int(sizes.sum()), dtype=np.int16)
    expected_positions = np.empty(int(sizes.sum()), dtype=np.int64)
    helpers.build_exhaustive_blending_indices(expected_ids, expected_positions, sizes, n)
    ids, positions = build_exhaustive_blending_indices(sizes)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(positions, expected_positions)


# --- the active-set kernel ----------------------------------------------------------------------
# From 48 datasets the kernel scans only the datasets whose key may reach a threshold L and books
# the others back on a calendar. These tests force each path through the private hook
# (``path``, ``window``, ``margin``) and compare with the plain scan, which is megatron's loop.


def blend_with(
    weights: npt.NDArray[np.float64], size: int, **options: object
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    ids = np.empty(size, dtype=np.int32)
    positions = np.empty(size, dtype=np.int64)
    _testing.build_blending_indices(weights, ids, positions, **options)
    return ids, positions


def exhaustive_with(
    sizes: npt.NDArray[np.int64], **options: object
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    total = int(sizes.sum())
    ids = np.empty(total, dtype=np.int32)
    positions = np.empty(total, dtype=np.int64)
    _testing.build_exhaustive_blending_indices(sizes, ids, positions, **options)
    return ids, positions


ACTIVE_KINDS = ["uniform", "lognormal", "equal", "tiny", "power-law"]
# (path, window, margin): the default tuning, short windows (L moves often), and a zero margin
# with windows of one sample, which makes most samples fall back to the full scan.
ACTIVE_TUNINGS = [
    ("active", 0, -1.0),
    ("active", 16, 0.001),
    ("active", 1, 0.0),
    ("active-baseline", 0, -1.0),  # SSE2 even on a CPU with AVX2
    ("active-baseline", 1, 0.0),
    ("active-avx2", 0, -1.0),  # AVX2 (or SSE2) even on a CPU with AVX-512
    ("active-avx2", 16, 0.001),
    ("auto", 0, -1.0),
]


@pytest.mark.parametrize("kind", ACTIVE_KINDS)
@pytest.mark.parametrize("n", [50, 129, 700, 2000])
def test_active_set_matches_scan(kind: str, n: int) -> None:
    rng = np.random.default_rng(n * 31 + len(kind))
    weights = make_weights(kind, n, rng)
    size = 60 * n + int(rng.integers(0, 1000))
    expected = blend_with(weights, size, path="scan")
    for path, window, margin in ACTIVE_TUNINGS:
        got = blend_with(weights, size, path=path, window=window, margin=margin)
        np.testing.assert_array_equal(got[0], expected[0], err_msg=f"{path} {window} {margin}")
        np.testing.assert_array_equal(got[1], expected[1], err_msg=f"{path} {window} {margin}")


@pytest.mark.parametrize("style", ["unnormalised", "half-sum", "near-equal", "zeros", "extreme"])
def test_active_set_on_adversarial_weights(style: str) -> None:
    # Weights that do not sum to 1 make every key drift (L must follow, or fall back), near-equal
    # weights tie, zero weights never come back, and extreme ones live on the heap or never.
    rng = np.random.default_rng(len(style) + 100)
    n = 300
    if style == "unnormalised":
        weights = rng.integers(0, 5, n).astype(np.float64)
    elif style == "half-sum":
        weights = make_weights("uniform", n, rng) * 0.5
    elif style == "near-equal":
        weights = np.nextafter(np.full(n, 1.0 / n), 1.0) * (1 + rng.integers(0, 3, n) * 2**-52)
    elif style == "zeros":
        weights = np.where(rng.random(n) < 0.5, 0.0, make_weights("uniform", n, rng))
    else:
        weights = np.where(rng.random(n) < 0.3, 1e-300, rng.lognormal(0.0, 6.0, n))
        weights /= weights.sum()
    size = 40_000
    expected = blend_with(weights, size, path="scan")
    for path, window, margin in ACTIVE_TUNINGS:
        got = blend_with(weights, size, path=path, window=window, margin=margin)
        np.testing.assert_array_equal(got[0], expected[0], err_msg=f"{path} {window} {margin}")
        np.testing.assert_array_equal(got[1], expected[1], err_msg=f"{path} {window} {margin}")


@pytest.mark.parametrize("n", [50, 300, 1500])
def test_active_set_exhaustive_matches_scan(n: int) -> None:
    rng = np.random.default_rng(n + 5)
    shares = rng.lognormal(0.0, 2.0, n)
    sizes = np.maximum(1, np.round(shares / shares.sum() * 40 * n)).astype(np.int64)
    expected = exhaustive_with(sizes, path="scan")
    for path, window, margin in [*ACTIVE_TUNINGS, ("tree", 0, -1.0)]:
        got = exhaustive_with(sizes, path=path, window=window, margin=margin)
        np.testing.assert_array_equal(got[0], expected[0], err_msg=f"{path} {window} {margin}")
        np.testing.assert_array_equal(got[1], expected[1], err_msg=f"{path} {window} {margin}")


@settings(deadline=None, max_examples=40)
@given(
    weights=st.integers(48, 120).flatmap(lambda n: st.lists(weight, min_size=n, max_size=n)),
    size=st.integers(0, 3000),
    window=st.integers(1, 64),
    margin=st.sampled_from([0.0, 1e-12, 0.01, 0.3]),
    block=st.sampled_from([0, 1, 4, 32, 256]),
)
def test_active_set_property(
    weights: list[float], size: int, window: int, margin: float, block: int
) -> None:
    array = np.asarray(weights)
    expected = blend_with(array, size, path="scan")
    for path in ("active", "active-avx2", "active-baseline"):
        got = blend_with(array, size, path=path, window=window, margin=margin, block=block)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_unknown_path_is_rejected() -> None:
    ids = np.empty(4, dtype=np.int16)
    with pytest.raises(ValueError, match="path must be"):
        _testing.build_blending_indices(np.ones(2), ids, np.empty(4, dtype=np.int64), path="x")


# --- the AVX-512 register kernel ------------------------------------------------------------------
# On a CPU with AVX-512, greedy blends of at most 64 datasets take the register scan
# ("scan-simd"), and the active set decides blocks of samples in registers ("block": samples per
# block, rounded up to a power of two). Without AVX-512 these paths fall back to the plain scan and
# the AVX2/SSE2 active set, and the tests still hold.

WEIGHT_FAMILIES = ["uniform", "lognormal", "equal", "tiny", "power-law"]


def adversarial_weights(style: str, n: int, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    """Weights whose keys tie or nearly tie: exact and off-by-one-ulp equalities, repeated values."""
    if style == "ulp":  # equal weights, some one or two ulps above
        base = np.full(n, 1.0 / n)
        return base * (1 + rng.integers(0, 3, n) * 2.0**-52)
    if style == "pairs":  # every weight appears twice (same keys whenever counts match)
        half = make_weights("lognormal", (n + 1) // 2, rng)
        return np.repeat(half, 2)[:n] / np.repeat(half, 2)[:n].sum()
    if style == "dyadic":  # powers of two: products and differences are exact, ties are frequent
        raw = 2.0 ** -rng.integers(0, 6, n).astype(np.float64)
        return raw / raw.sum()
    if style == "unnormalised":  # small integers: keys drift, many exact ties
        return rng.integers(0, 4, n).astype(np.float64)
    # "one-heavy": one dataset takes most samples, the rest near-tie among themselves
    raw = np.full(n, 1.0)
    raw[int(rng.integers(0, n))] = 50.0 * n
    return raw / raw.sum()


ADVERSARIAL_STYLES = ["ulp", "pairs", "dyadic", "unnormalised", "one-heavy"]


@pytest.mark.parametrize("kind", WEIGHT_FAMILIES + ADVERSARIAL_STYLES)
@pytest.mark.parametrize("n", [1, 2, 5, 8, 9, 10, 16, 17, 33, 47, 48, 63, 64, 65, 100])
def test_register_scan_matches_scan(kind: str, n: int) -> None:
    rng = np.random.default_rng(n * 131 + len(kind))
    if kind in ADVERSARIAL_STYLES:
        weights = adversarial_weights(kind, n, rng)
        if not weights.any():
            weights[0] = 1.0
    else:
        weights = make_weights(kind, n, rng)
    size = 3000 * max(1, n // 8) + int(rng.integers(0, 500))
    expected = blend_with(weights, size, path="scan")
    for path in ("scan-simd", "auto"):
        got = blend_with(weights, size, path=path)
        np.testing.assert_array_equal(got[0], expected[0], err_msg=path)
        np.testing.assert_array_equal(got[1], expected[1], err_msg=path)


BLOCKS = [0, 1, 2, 8, 32, 64, 4096]


@pytest.mark.parametrize("seed", range(24))
def test_block_kernel_random_shapes(seed: int) -> None:
    # Random n in [5, 2000], random family, every block length, default and short windows.
    rng = np.random.default_rng(7000 + seed)
    n = int(rng.integers(5, 2001))
    kind = str(rng.choice(WEIGHT_FAMILIES + ADVERSARIAL_STYLES))
    if kind in ADVERSARIAL_STYLES:
        weights = adversarial_weights(kind, n, rng)
        if not weights.any():
            weights[0] = 1.0
    else:
        weights = make_weights(kind, n, rng)
    size = int(rng.integers(1, 40 * n + 2000))
    expected = blend_with(weights, size, path="scan")
    for block in BLOCKS:
        for window, margin in [
            (0, -1.0),
            (int(rng.integers(1, 100)), float(rng.choice([0.0, 1e-9, 0.05]))),
        ]:
            got = blend_with(
                weights, size, path="active", window=window, margin=margin, block=block
            )
            message = f"n={n} {kind} block={block} window={window} margin={margin}"
            np.testing.assert_array_equal(got[0], expected[0], err_msg=message)
            np.testing.assert_array_equal(got[1], expected[1], err_msg=message)


@pytest.mark.parametrize("style", ADVERSARIAL_STYLES)
@pytest.mark.parametrize("n", [60, 300, 1500])
def test_block_kernel_on_near_ties(style: str, n: int) -> None:
    rng = np.random.default_rng(n + len(style) * 17)
    weights = adversarial_weights(style, n, rng)
    size = 30 * n + 1234
    expected = blend_with(weights, size, path="scan")
    for block in BLOCKS:
        for path in ("active", "auto"):
            got = blend_with(weights, size, path=path, block=block)
            np.testing.assert_array_equal(got[0], expected[0], err_msg=f"{path} block={block}")
            np.testing.assert_array_equal(got[1], expected[1], err_msg=f"{path} block={block}")


@pytest.mark.parametrize("block", [1, 32, 4096])
@pytest.mark.parametrize("style", ["lognormal", "small", "uniform"])
def test_block_kernel_exhaustive(block: int, style: str) -> None:
    # Exhaustive blends take the block kernel too: it stops after a sample that spends its
    # dataset. "small" sizes (1-40 samples) are spent inside blocks all the time.
    rng = np.random.default_rng(block + len(style))
    if style == "small":
        sizes = rng.integers(1, 40, 400).astype(np.int64)
    else:
        shares = rng.lognormal(0.0, 2.0, 400) if style == "lognormal" else rng.random(400)
        sizes = np.maximum(1, np.round(shares / shares.sum() * 20_000)).astype(np.int64)
    expected = exhaustive_with(sizes, path="scan")
    for path in ("active", "auto"):
        got = exhaustive_with(sizes, path=path, block=block, threads=1)
        np.testing.assert_array_equal(got[0], expected[0], err_msg=path)
        np.testing.assert_array_equal(got[1], expected[1], err_msg=path)


# --- speculative chunks ---------------------------------------------------------------------------
# Large blends are cut into chunks decided on their own threads from guessed counts, then repaired
# from the true counts (csrc/blending.cpp, "Speculative chunks"). The hook forces the number of
# threads on small blends, and `guess_zero` forces guesses that never meet the true run, so the
# repair recomputes whole chunks.

SPECULATION = [(2, False), (3, False), (8, False), (2, True), (5, True)]


@pytest.mark.parametrize("kind", ["uniform", "lognormal", "equal", "power-law"])
@pytest.mark.parametrize("n", [3, 20, 60, 700])
def test_speculative_chunks_match_one_thread(kind: str, n: int) -> None:
    rng = np.random.default_rng(n * 7 + len(kind))
    weights = make_weights(kind, n, rng)
    size = 30_000 + int(rng.integers(0, 1000))
    expected = blend_with(weights, size, threads=1)
    np.testing.assert_array_equal(expected[0], blend_with(weights, size, path="scan")[0])
    for threads, guess_zero in SPECULATION:
        got = blend_with(weights, size, threads=threads, guess_zero=guess_zero)
        np.testing.assert_array_equal(got[0], expected[0], err_msg=f"{threads} {guess_zero}")
        np.testing.assert_array_equal(got[1], expected[1], err_msg=f"{threads} {guess_zero}")


@pytest.mark.parametrize("style", ["lognormal", "small", "one-big"])
def test_speculative_chunks_exhaustive(style: str) -> None:
    # Guessed chunks may spend every dataset before their end, or spend datasets the true run
    # has not spent yet; both must be repaired.
    rng = np.random.default_rng(len(style))
    if style == "small":
        sizes = rng.integers(1, 30, 300).astype(np.int64)
    elif style == "one-big":
        sizes = np.concatenate([[20_000], rng.integers(1, 5, 80)]).astype(np.int64)
    else:
        shares = rng.lognormal(0.0, 2.0, 300)
        sizes = np.maximum(1, np.round(shares / shares.sum() * 30_000)).astype(np.int64)
    expected = exhaustive_with(sizes, path="scan", threads=1)
    for threads, guess_zero in SPECULATION:
        got = exhaustive_with(sizes, threads=threads, guess_zero=guess_zero)
        np.testing.assert_array_equal(got[0], expected[0], err_msg=f"{threads} {guess_zero}")
        np.testing.assert_array_equal(got[1], expected[1], err_msg=f"{threads} {guess_zero}")


@settings(deadline=None, max_examples=60)
@given(
    weights=st.lists(weight, min_size=1, max_size=80),
    size=st.integers(0, 4000),
    threads=st.integers(1, 9),
    guess_zero=st.booleans(),
)
def test_speculative_chunks_property(
    weights: list[float], size: int, threads: int, guess_zero: bool
) -> None:
    array = np.asarray(weights)
    expected = blend_with(array, size, path="scan", threads=1)
    got = blend_with(array, size, threads=threads, guess_zero=guess_zero)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


@pytest.mark.megatron
@pytest.mark.parametrize(
    ("n", "kind"),
    [
        (10, "equal"),
        (10, "uniform"),
        (33, "lognormal"),
        (64, "equal"),
        (100, "uniform"),
        (1000, "lognormal"),
    ],
)
def test_block_and_register_kernels_match_megatron(n: int, kind: str) -> None:
    helpers = megatron_helpers()
    weights = make_weights(kind, n, np.random.default_rng(n * 3 + len(kind)))
    size = 400_000
    assert_greedy_matches_megatron(helpers, weights, size)


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists for the first CPU (empty off Linux x86-64)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_the_active_set_runs_on_the_best_instruction_set_the_cpu_has() -> None:
    # The per-ISA units are chosen at run time (csrc/cpu_features.hpp): AVX-512 (F, DQ, BW, VL)
    # when /proc/cpuinfo lists it, else AVX2, else the baseline; TOKENMILL_SIMD (this process's
    # pin, see test_simd_dispatch_is_pinned_by_the_environment) and forced paths cap it.
    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not flags:
        assert _testing.active_set_isa() == "baseline"
        return
    pinned = os.environ.get("TOKENMILL_SIMD", "auto") or "auto"
    has_avx2 = "avx2" in flags and pinned != "baseline"
    has_avx512 = {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags and pinned in (
        "auto",
        "avx512",
    )
    expected = "avx512" if has_avx512 else "avx2" if has_avx2 else "baseline"
    assert _testing.simd_dispatch()["shuffle"] == expected
    assert _testing.active_set_isa() == expected
    assert _testing.active_set_isa("active") == expected
    assert _testing.active_set_isa("active-avx2") == ("avx2" if has_avx2 else "baseline")
    assert _testing.active_set_isa("active-baseline") == "baseline"


# -- indices computed ahead (compute_ahead) --------------------------------------------------------


@pytest.fixture
def nothing_ahead() -> Iterator[BuildContext]:
    """A build (what compute_ahead needs), with nothing computed ahead yet."""
    with build_context() as context:
        assert context.ahead == {}
        yield context
        blending.discard_ahead()


def test_indices_computed_ahead_are_taken_once_by_the_same_inputs(
    greedy_threads: list[str], nothing_ahead: BuildContext
) -> None:
    threads = greedy_threads
    weights = np.random.default_rng(5).random(40)
    weights /= weights.sum()
    expected = blending_indices_reference(weights, 3000)
    blending.compute_ahead(weights, 3000)
    blending.compute_ahead(weights, 3000)  # already under way: not started twice
    taken = build_blending_indices(weights, 3000)
    assert threads == ["tokenmill-blending-ahead"]
    np.testing.assert_array_equal(taken[0], expected[0])
    np.testing.assert_array_equal(taken[1], expected[1])
    # taken once: the next call computes in line, and so does one whose inputs differ in a bit
    again = build_blending_indices(weights, 3000)
    blending.compute_ahead(weights, 3000)
    nudged = weights.copy()
    nudged[0] = np.nextafter(nudged[0], 1.0)
    build_blending_indices(nudged, 3000)
    assert threads[1] == "MainThread" and threads[-1] == "MainThread"
    np.testing.assert_array_equal(again[0], expected[0])
    blending.discard_ahead()
    assert nothing_ahead.ahead == {}


def test_bad_inputs_ahead_are_ignored_and_refused_by_the_real_call(
    nothing_ahead: BuildContext,
) -> None:
    blending.compute_ahead([0.5, float("nan")], 10)
    blending.compute_ahead([0.5, 0.5], -1)
    blending.compute_ahead("weights", 10)
    assert nothing_ahead.ahead == {}
    with pytest.raises(ValueError, match=r"weights\[1\] must be finite"):
        build_blending_indices([0.5, float("nan")], 10)


@pytest.mark.usefixtures("nothing_ahead")
def test_an_error_computed_ahead_is_raised_by_the_call_that_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def out_of_memory(vector: np.ndarray, count: int) -> Any:
        raise MemoryError("the blending indices of 10 samples: out of memory")

    monkeypatch.setattr(blending, "_greedy", out_of_memory)
    blending.compute_ahead([0.5, 0.5], 10)
    with pytest.raises(MemoryError, match="blending indices of 10 samples"):
        build_blending_indices([0.5, 0.5], 10)


@pytest.mark.usefixtures("nothing_ahead")
def test_a_forked_child_never_waits_for_its_parents_computation() -> None:
    import multiprocessing

    blending.compute_ahead([0.25, 0.75], 50_000)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(_ahead_in_child) == 0


def _ahead_in_child() -> int:
    build_blending_indices([0.25, 0.75], 50_000)  # computed here, in line
    context = current_context()
    return -1 if context is None else len(context.ahead)


def test_nothing_is_computed_ahead_outside_a_build(greedy_threads: list[str]) -> None:
    """Outside a build there is nowhere to keep a result (no module-level state): the call
    computes in line."""
    assert current_context() is None
    blending.compute_ahead([0.25, 0.75], 1000)
    build_blending_indices([0.25, 0.75], 1000)
    assert greedy_threads == ["MainThread"]


# -- TOKENMILL_SIMD: every unit forced ------------------------------------------------------------

SIMD_PROBE = (
    "from tokenmill._core import _testing as t; d = t.simd_dispatch(); "
    "print(d['level'], d['shuffle'], d['blending'], ','.join(d['supported']))"
)


def simd_probe(value: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "TOKENMILL_SIMD": value}
    return subprocess.run(
        [sys.executable, "-c", SIMD_PROBE], env=environment, capture_output=True, text=True
    )


def test_simd_dispatch_is_pinned_by_the_environment() -> None:
    """TOKENMILL_SIMD pins the shuffle's twist and the blending kernels to one unit (.ci/run
    runs the kernel tests once per unit this CPU has); auto takes the best unit."""
    supported = _testing.simd_dispatch()["supported"]
    assert isinstance(supported, list) and "baseline" in supported
    best = supported[-1]
    for value, expected in [("", best), ("auto", best)] + [(unit, unit) for unit in supported]:
        probe = simd_probe(value)
        assert probe.returncode == 0, probe.stderr
        level, shuffle, blend, listed = probe.stdout.split()
        assert (level, shuffle, blend) == (expected, expected, expected), value
        assert listed.split(",") == supported


@pytest.mark.parametrize("value", ["sse9", "AVX2", "avx-512"])
def test_a_misspelt_simd_pin_refuses_the_import(value: str) -> None:
    probe = simd_probe(value)
    assert probe.returncode != 0
    assert f"TOKENMILL_SIMD='{value}' is not one of 'auto', 'baseline', 'avx2', 'avx512'" in (
        probe.stderr
    )


def test_an_unsupported_simd_pin_refuses_the_import() -> None:
    """A unit the CPU lacks is a clear error at import, never an illegal instruction; on a CPU
    with every unit there is nothing to refuse (the misspelt pins above take the same path)."""
    supported = _testing.simd_dispatch()["supported"]
    missing = [unit for unit in ("avx2", "avx512") if unit not in supported]
    for unit in missing:
        probe = simd_probe(unit)
        assert probe.returncode != 0
        assert f"TOKENMILL_SIMD={unit}, but this CPU (or this build)" in probe.stderr
