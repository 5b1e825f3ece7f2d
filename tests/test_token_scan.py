"""find_token_positions / count_token == numpy.flatnonzero and the pure-Python reference."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.formats.token_scan import count_token, find_token_positions

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

from reference import token_positions_reference

DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_equals_flatnonzero(dtype: type, threads: int) -> None:
    rng = np.random.default_rng(threads)
    tokens = rng.integers(0, 7, 3_000_003).astype(dtype)  # > 1 Mi tokens per thread: threads run
    for token in (0, 3, 6):
        expected = np.flatnonzero(tokens == token)
        found = find_token_positions(tokens, token, threads)
        assert found.dtype == np.int64
        np.testing.assert_array_equal(found, expected)
        assert count_token(tokens, token, threads) == expected.shape[0]


@given(
    st.lists(st.integers(0, 4), max_size=60),
    st.integers(-2, 5),
    st.sampled_from(DTYPES),
    st.integers(1, 4),
)
def test_matches_reference(values: list[int], token: int, dtype: type, threads: int) -> None:
    tokens = np.asarray(values, dtype=dtype)
    expected = token_positions_reference(values, token)
    assert find_token_positions(tokens, token, threads).tolist() == expected
    assert count_token(tokens, token, threads) == len(expected)


def test_out_of_range_token_matches_nothing() -> None:
    tokens = np.array([0, 65535, 1], dtype=np.uint16)
    assert find_token_positions(tokens, -1).tolist() == []
    assert find_token_positions(tokens, 2**16 + 65535).tolist() == []
    assert find_token_positions(tokens, 2**80).tolist() == []
    assert find_token_positions(np.array([2**64 - 1], np.uint64), 2**64 - 1).tolist() == [0]


def test_views_and_errors() -> None:
    tokens = np.arange(20, dtype=np.int32)
    assert find_token_positions(tokens[::2], 4).tolist() == [2]  # non-contiguous: copied
    assert find_token_positions(tokens.astype(">i4"), 5).tolist() == [5]  # big-endian
    with pytest.raises(ValueError, match="1-D"):
        find_token_positions(tokens.reshape(4, 5), 1)
    with pytest.raises(TypeError, match="integer"):
        find_token_positions(tokens.astype(np.float32), 1)
    with pytest.raises(ValueError, match="num_threads"):
        find_token_positions(tokens, 1, 0)
