"""The mixture kernels: Philox4x64-10 (against numpy and the paper's definition) and the chunk
draws (against an exact rational reference)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill import _core
from tokenmill._core import _testing
from tokenmill.index.mixture_plan import THRESHOLD_ONE, weight_thresholds

from reference import chunk_source_reference, philox4x64_10_reference

WORD = st.integers(0, 2**64 - 1)


def test_philox_known_answers() -> None:
    # Random123's kat_vectors for philox4x64-10: counter 0 / key 0 and counter pi / key e.
    assert _testing.philox_block((0, 0, 0, 0), (0, 0)) == (
        0x16554D9ECA36314C,
        0xDB20FE9D672D0FDC,
        0xD7E772CEE186176B,
        0x7E68B68AEC7BA23B,
    )
    assert _testing.philox_block((2**64 - 1,) * 4, (2**64 - 1,) * 2) == (
        0x87B092C3013FE90B,
        0x438C3C67BE8D0224,
        0x9CC7D7C69CD777B6,
        0xA09CAEBF594F0BA0,
    )


@given(counter=st.tuples(WORD, WORD, WORD, WORD), key=st.tuples(WORD, WORD))
def test_philox_matches_numpy_and_reference(
    counter: tuple[int, int, int, int], key: tuple[int, int]
) -> None:
    block = _testing.philox_block(counter, key)
    assert block == philox4x64_10_reference(counter, key)
    packed = sum(word << (64 * i) for i, word in enumerate(counter))
    # numpy increments its counter before each block, so start one below
    generator = np.random.Philox(key=key[0] | (key[1] << 64), counter=(packed - 1) % 2**256)
    assert tuple(int(v) for v in generator.random_raw(4)) == block


def test_philox_argument_errors() -> None:
    with pytest.raises(ValueError, match="counter must have 4 words, got 3"):
        _testing.philox_block((1, 2, 3), (0, 0))
    with pytest.raises(ValueError, match="key must have 2 words, got 1"):
        _testing.philox_block((1, 2, 3, 4), (0,))
    with pytest.raises(ValueError, match="counter word 0 must be in \\[0, 2\\^64\\), got -1"):
        _testing.philox_block((-1, 0, 0, 0), (0, 0))
    with pytest.raises(ValueError, match=r"key word 1 must be in .*, got 18446744073709551616"):
        _testing.philox_block((0, 0, 0, 0), (0, 2**64))
    with pytest.raises(TypeError, match="key word 0 must be an int"):
        _testing.philox_block((0, 0, 0, 0), (0.5, 0))


@given(
    weights=st.lists(
        st.sampled_from([0.0, 0.1, 0.25, 1.0, 3.0, 1e-9, 7.5]), min_size=1, max_size=6
    ).filter(lambda w: sum(w) > 0),
    seed=WORD,
    stream=WORD,
    draw=st.integers(0, 5),
    first=st.integers(0, 2**40),
)
def test_draw_chunk_sources_matches_reference(
    weights: list[float], seed: int, stream: int, draw: int, first: int
) -> None:
    thresholds = weight_thresholds(weights)
    assert thresholds[-1] == THRESHOLD_ONE and np.all(np.diff(thresholds.astype(object)) >= 0)
    out = np.empty(20, dtype=np.int32)
    _core.draw_chunk_sources(thresholds, (seed, 3), stream, draw, first, out)
    expected = [
        chunk_source_reference(weights, (seed, 3), stream, draw, first + i) for i in range(20)
    ]
    assert out.tolist() == expected
    assert all(weights[s] > 0 for s in out)


def test_draws_follow_the_weights() -> None:
    out = np.empty(200_000, dtype=np.int32)
    _core.draw_chunk_sources(weight_thresholds([0.5, 0.0, 0.3, 0.2]), (1, 0), 0, 0, 0, out)
    counts = np.bincount(out, minlength=4) / out.size
    assert counts[1] == 0
    np.testing.assert_allclose(counts, [0.5, 0.0, 0.3, 0.2], atol=0.005)


def test_weight_threshold_errors() -> None:
    with pytest.raises(ValueError, match="need one value > 0"):
        weight_thresholds([0.0, 0.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        weight_thresholds([1.0, -1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        weight_thresholds([float("nan")])


def test_draw_chunk_sources_argument_errors() -> None:
    out = np.empty(3, dtype=np.int32)
    good = weight_thresholds([1.0, 1.0])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        _core.draw_chunk_sources(np.zeros(0, np.uint64), (0, 0), 0, 0, 0, out)
    with pytest.raises(ValueError, match="non-decreasing"):
        _core.draw_chunk_sources(np.array([2**53, 5], np.uint64), (0, 0), 0, 0, 0, out)
    with pytest.raises(ValueError, match="last threshold must be 2\\^53, got 7"):
        _core.draw_chunk_sources(np.array([1, 7], np.uint64), (0, 0), 0, 0, 0, out)
    with pytest.raises(TypeError):
        _core.draw_chunk_sources(good.astype(np.int64), (0, 0), 0, 0, 0, out)
    with pytest.raises(TypeError):
        _core.draw_chunk_sources(good, (0, 0), 0, 0, 0, out.astype(np.int64))
    readonly = out.copy()
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        _core.draw_chunk_sources(good, (0, 0), 0, 0, 0, readonly)
